//! `kvmesh sim` as a real process, driven by Python's official `openai` client and a pyzmq
//! subscriber (scripts in tests/python; install them with scripts/install-test-deps.sh).

use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A `kvmesh sim` child process, killed on drop.
struct Sim {
    child: Child,
    port: u16,
}

impl Sim {
    fn start(extra: &[&str]) -> Sim {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(["sim", "--listen", &format!("127.0.0.1:{port}")])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvmesh sim");
        let mut sim = Sim { child, port };
        sim.wait_healthy();
        sim
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let mut err = String::new();
                if let Some(e) = self.child.stderr.as_mut() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("kvmesh sim exited early ({status}): {err}");
            }
            if http_status("GET", &format!("{}/health", self.base())) == Some(200) {
                return;
            }
            assert!(Instant::now() < deadline, "kvmesh sim never became healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Minimal blocking HTTP/1.1 request on loopback; returns the status.
fn http_status(method: &str, url: &str) -> Option<u16> {
    use std::io::Write;
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}")))?;
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.split_whitespace().nth(1)?.parse().ok()
}

fn python(script: &str, args: &[&str]) -> String {
    let path = repo_root().join("tests/python").join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("python3 not runnable ({e}); run scripts/install-test-deps.sh"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}\n(missing modules? run scripts/install-test-deps.sh)",
        out.status
    );
    stdout
}

#[test]
fn official_openai_client_streaming_and_not_with_correct_usage() {
    let sim = Sim::start(&["--model", "test-model", "--time-scale", "0.02"]);
    let out = python(
        "openai_check.py",
        &[
            &format!("{}/v1", sim.base()),
            "test-model",
            "--tokenize-url",
            &format!("{}/tokenize", sim.base()),
        ],
    );
    assert!(out.contains("\"ok\": true"), "{out}");
}

fn kv_events_roundtrip(encoding: &str) {
    let (pub_port, replay_port) = (free_port(), free_port());
    let pub_ep = format!("tcp://127.0.0.1:{pub_port}");
    let replay_ep = format!("tcp://127.0.0.1:{replay_port}");
    let sim = Sim::start(&[
        "--model",
        "test-model",
        "--time-scale",
        "0.02",
        "--kv-blocks",
        "100",
        "--max-model-len",
        "1024",
        "--kv-events",
        &pub_ep,
        "--kv-events-replay",
        &replay_ep,
        "--kv-events-format",
        encoding,
    ]);
    let out = python(
        "kv_events_sim_check.py",
        &[&sim.base(), &pub_ep, &replay_ep, "test-model", encoding],
    );
    assert!(out.contains("\"ok\": true"), "{out}");
}

#[test]
fn pyzmq_subscriber_reproduces_the_cache_from_array_events() {
    kv_events_roundtrip("array");
}

#[test]
fn pyzmq_subscriber_reproduces_the_cache_from_map_events() {
    kv_events_roundtrip("map");
}

#[test]
fn admin_crash_kills_the_process() {
    let mut sim = Sim::start(&["--time-scale", "0.02"]);
    assert_eq!(
        http_status("POST", &format!("{}/admin/crash", sim.base())),
        Some(200)
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(Some(status)) = sim.child.try_wait() {
            assert!(!status.success(), "a crash must not look like a clean exit");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still running after /admin/crash"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(http_status("GET", &format!("{}/health", sim.base())), None);
}

#[test]
fn bad_config_stops_startup_naming_the_key() {
    let dir = std::env::temp_dir().join(format!("kvmesh-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("bad.toml");
    std::fs::write(&file, "[sim.engine]\nblok_size = 16\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["sim", "--config"])
        .arg(&file)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("blok_size"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["sim", "--time-scale", "0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("time_scale"));
    let _ = std::fs::remove_dir_all(&dir);
}
