//! `kvmesh serve` and `kvmesh up` as real processes: the official `openai` client through the
//! router, the demo cluster, and start-up errors that name what is wrong.

mod common;

use common::*;
use std::process::Command;

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
        &[&format!("{}/v1", router.base()), "test-model"],
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
        ])
        .output()
        .expect("run kvmesh up");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("requests ok 4 / errors 0"), "{stdout}");
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
