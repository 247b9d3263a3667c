//! `kvmesh sim` as a real process, driven by Python's official `openai` client and a pyzmq
//! subscriber (scripts in tests/python; install them with scripts/install-test-deps.sh).

mod common;

use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn official_openai_client_streaming_and_not_with_correct_usage() {
    let sim = Proc::start(&["--model", "test-model", "--time-scale", "0.02"]);
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
    let sim = Proc::start(&[
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
    let mut sim = Proc::start(&["--time-scale", "0.02"]);
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
