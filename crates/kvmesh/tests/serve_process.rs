//! `kvmesh serve` and `kvmesh up` as real processes: the official `openai` client through the
//! router, the demo cluster, and start-up errors that name what is wrong.

mod common;

use common::*;
use std::process::Command;
use std::time::Duration;

#[test]
fn official_openai_client_through_the_router() {
    let a = Proc::start(&[
        "--model",
        "test-model",
        "--time-scale",
        "0.02",
        "--seed",
        "1",
    ]);
    let b = Proc::start(&[
        "--model",
        "test-model",
        "--time-scale",
        "0.02",
        "--seed",
        "2",
    ]);
    let router = Proc::spawn(
        "serve",
        &[
            "--engine",
            &a.base(),
            "--engine",
            &format!("url={},weight=2", b.base()),
            "--policy",
            "power_of_two",
        ],
    );
    let out = python(
        "openai_check.py",
        &[&format!("{}/v1", router.base()), "test-model", "--retrieve"],
    );
    assert!(out.contains("\"ok\": true"), "{out}");
}

#[test]
fn kvmesh_up_serves_the_demo_through_a_router() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args([
            "up",
            "--engines",
            "2",
            "--routers",
            "1",
            "--groups",
            "1",
            "--users",
            "2",
            "--turns",
            "2",
            "--base-port",
            "0",
            "--exit-after-demo",
        ])
        .output()
        .expect("run kvmesh up");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Both legs answered every request, and the difference is printed.
    assert_eq!(stdout.matches(" 4/0\n").count(), 2, "{stdout}");
    assert!(
        stdout.contains("kvmesh against round robin: hit rate"),
        "{stdout}"
    );
    assert!(stdout.contains("served 4 requests"), "{stdout}");
    // Logs went to the file, not into the human output.
    assert!(!stdout.contains(" INFO "), "{stdout}");
    assert!(stdout.contains("stopped"), "{stdout}");
}

#[test]
fn kvmesh_up_by_default_meshes_three_routers() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args([
            "up",
            "--groups",
            "2",
            "--users",
            "2",
            "--turns",
            "2",
            "--base-port",
            "0",
            "--exit-after-demo",
        ])
        .output()
        .expect("run kvmesh up");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("routers: 3 × kvmesh serve, policy precise, meshed"),
        "{stdout}"
    );
    assert_eq!(stdout.matches(" 8/0\n").count(), 2, "{stdout}");
    // Every router served part of it and sees the two others.
    for r in ["router-0", "router-1", "router-2"] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(r) && l.contains("served"))
            .unwrap_or_else(|| panic!("no line for {r}: {stdout}"));
        assert!(line.contains("meshed with 2 peers"), "{line}");
    }
}

/// Runs `kvmesh up ARGS` to its end: its process id (what its temporary files are named by)
/// and its output.
fn run_up(args: &[&str]) -> (u32, std::process::Output) {
    let child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .arg("up")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kvmesh up");
    let pid = child.id();
    (pid, child.wait_with_output().expect("wait"))
}

#[test]
fn kvmesh_up_that_fails_to_start_leaves_no_certificates_behind() {
    // Router 1's port is taken: the run's certificates (its CA key among them) were written
    // for the mesh before the routers started. The 18 ports are below the OS's ephemeral
    // range, and the run is tried again on another range when some other port of it was
    // taken meanwhile (tests run side by side).
    for attempt in 0..8u16 {
        // 400 ranges of 20 ports in 21,000–28,999, a different one each try.
        let slot = (std::process::id() + u32::from(attempt) * 37) % 400;
        let base = 21_000 + slot as u16 * 20;
        let Ok(taken) = std::net::TcpListener::bind(("127.0.0.1", base + 1)) else {
            continue;
        };
        let (pid, out) = run_up(&["--no-demo", "--base-port", &base.to_string()]);
        drop(taken);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        if !stderr.contains("router 1") {
            assert!(stderr.contains("in use"), "{stderr}");
            continue;
        }
        let prefix = format!("kvmesh-fleet-{pid}-");
        let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
            .expect("temp dir")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .map(|e| e.path())
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        return;
    }
    panic!("no free port range for the run in 8 tries");
}

#[test]
fn kvmesh_up_refuses_an_empty_demo_before_it_starts_anything() {
    for flag in [
        "--groups",
        "--users",
        "--turns",
        "--max-tokens",
        "--sample-ms",
    ] {
        let (pid, out) = run_up(&[flag, "0", "--base-port", "0"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} 0 accepted");
        assert!(
            stderr.contains(&format!("{flag} must be at least 1")),
            "{flag}: {stderr}"
        );
        let log = std::env::temp_dir().join(format!("kvmesh-up-{pid}.log"));
        assert!(!log.exists(), "{flag}: {} made", log.display());
    }
}

#[test]
fn serve_startup_errors_name_the_problem() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(args)
            .output()
            .expect("run");
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(&["serve"]).contains("no engines"));
    assert!(
        run(&[
            "serve",
            "--engine",
            "http://127.0.0.1:1",
            "--policy",
            "fastest"
        ])
        .contains("fastest")
    );
    assert!(run(&["serve", "--engine", "url=http://127.0.0.1:1,wieght=3"]).contains("wieght"));
    // Joining the mesh needs certificates; a missing certificate names the file.
    assert!(
        run(&["serve", "--engine", "http://127.0.0.1:1", "--node-id", "a"]).contains("tls_dir")
    );
    let err = run(&[
        "serve",
        "--engine",
        "http://127.0.0.1:1",
        "--node-id",
        "a",
        "--tls-dir",
        "/nonexistent-kvmesh-dir",
        "--seed",
        "127.0.0.1:1",
    ]);
    assert!(
        err.contains("serve.mesh.tls_dir /nonexistent-kvmesh-dir"),
        "{err}"
    );
    // Out of range, refused with the key named.
    let err = run(&[
        "serve",
        "--engine",
        "http://127.0.0.1:1",
        "--node-id",
        "a",
        "--ingest-replicas",
        "65",
    ]);
    assert!(err.contains("ingest_replicas"), "{err}");
    let dir = std::env::temp_dir().join(format!("kvmesh-serve-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("bad.toml");
    std::fs::write(&file, "[serve.retry]\nmax_atempts = 3\n").expect("write");
    let err = run(&["serve", "--config", file.to_str().expect("utf8 path")]);
    assert!(err.contains("max_atempts"), "{err}");
    std::fs::write(&file, "[serve.routing.policy]\ncandidates = 99\n").expect("write");
    let err = run(&[
        "serve",
        "--config",
        file.to_str().expect("utf8 path"),
        "--engine",
        "http://127.0.0.1:1",
    ]);
    assert!(err.contains("candidates"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cert_writes_a_ca_and_a_pair_per_node_that_load() {
    let dir = certs_abc("cert");
    for f in [
        "ca.pem", "ca.key", "a.pem", "a.key", "b.pem", "b.key", "c.pem", "c.key",
    ] {
        assert!(dir.join(f).is_file(), "{f} written");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("a.key"))
            .expect("key")
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "keys are private");
    }
    for n in ["a", "b", "c"] {
        kvmesh_mesh::certs::NodeTls::load(&dir, n).expect("loads");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args([
            "cert",
            "--out",
            dir.to_str().expect("utf8"),
            "--nodes",
            "a,../x",
        ])
        .output()
        .expect("run");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad node name"));
    // A mesh port already taken is named in the error, as the HTTP port is.
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--engine",
            "http://127.0.0.1:9",
        ])
        .args(["--node-id", "a", "--tls-dir", dir.to_str().expect("utf8")])
        .args(["--mesh-listen", &addr])
        .output()
        .expect("run kvmesh serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&format!("cannot listen on {addr}")), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The sim's `kvmesh_sim_http2_requests_total`.
fn sim_http2_requests(sim: &Proc) -> f64 {
    let page = http(
        "GET",
        &format!("{}/metrics", sim.base()),
        &[],
        "",
        Duration::from_secs(10),
    )
    .expect("sim metrics");
    page.body
        .lines()
        .find(|l| l.starts_with("kvmesh_sim_http2_requests_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP/2 counter in {}", page.body))
}

#[test]
fn serve_upstream_http2_speaks_h2c_to_the_engine() {
    let sim = Proc::start(&["--model", "test-model", "--profile", "instant"]);
    let chat =
        r#"{"model":"test-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;
    let base = sim.base();
    // HTTP/1.1 by default, then the flag: the engine counts one request over HTTP/2.
    for (flags, h2) in [(&[][..], 0.0), (&["--upstream-http2"][..], 1.0)] {
        let mut args = vec!["--engine", base.as_str()];
        args.extend_from_slice(flags);
        let router = Proc::spawn("serve", &args);
        let r = http(
            "POST",
            &format!("{}/v1/chat/completions", router.base()),
            &[],
            chat,
            Duration::from_secs(30),
        )
        .expect("answer");
        assert_eq!(r.status, 200, "{flags:?}: {}", r.body);
        assert_eq!(sim_http2_requests(&sim), h2, "{flags:?}");
    }
}

/// A hangup (the terminal that started the router closed) stops the router as SIGTERM does:
/// it drains and exits with status 0 (QA26: SIGHUP's default action killed it, status 129,
/// its streams cut).
#[test]
fn serve_stops_gracefully_on_a_hangup() {
    let sim = Proc::start(&["--model", "test-model", "--profile", "instant"]);
    let mut router = Proc::spawn("serve", &["--engine", sim.base().as_str()]);
    let sent = Command::new("kill")
        .args(["-HUP", &router.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = router.child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the router did not stop after SIGHUP"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(e) = router.child.stderr.as_mut() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    assert!(status.success(), "exit {status}: {err}");
    assert!(err.contains("shutting down, draining"), "{err}");
}
