//! `kvmesh bench --quick` as a real process (the CI smoke of the benchmark): a small
//! shared-prefix run on a local simulated fleet writes report.json with every contender's
//! fields, report.md and the SVG plots; and the virtual-time evaluator's hit rates agree with
//! the real-time run's on the same jobs; a count of 0 is refused.
//!
//! Bounded: the command runs with small parameters and is killed after 240 s (it takes
//! ~20–40 s on a shared 2-core VM); no timing is asserted.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// |real − evaluator| hit rate allowed per contender. Both run the same token-id jobs on the
/// same engine model, but the real run's routers learn of the engines' blocks through KV events
/// over ZMQ (ms late) and see the load as their own in-flight counts in wall time, so
/// interleavings differ; measured differences were at most 0.013 (this test's shape: 0.001;
/// the full shared-prefix and trace reports in BENCHMARKS.md: 0.000–0.013).
const TOLERANCE: f64 = 0.10;

fn run_bench(args: &[&str], out: &std::path::Path) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .arg("bench")
        .args(args)
        .arg("--out")
        .arg(out)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvmesh bench");
    let status = wait_bounded(&mut child);
    let mut err = String::new();
    let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut err));
    let mut so = String::new();
    let _ = child.stdout.take().map(|mut e| e.read_to_string(&mut so));
    assert!(
        status.success(),
        "kvmesh bench failed: {status}\n{err}\n{so}"
    );
    so
}

/// Waits for the bench to end, killing it (and failing) after 240 s.
fn wait_bounded(child: &mut std::process::Child) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if start.elapsed() > Duration::from_secs(240) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvmesh bench did not finish within 240 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn bench_quick_writes_the_report_and_the_evaluator_agrees_with_real_time() {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let md = run_bench(
        &[
            "--quick",
            "--engines",
            "2",
            "--groups",
            "4",
            "--concurrency",
            "6",
            "--policy",
            "round_robin",
            "--policy",
            "precise",
            "--policy",
            "oracle",
        ],
        &dir,
    );
    assert!(md.contains("| contender |"), "{md}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    for k in ["machine", "commit", "seed", "command"] {
        assert!(!report[k].is_null(), "{k} missing");
    }
    assert!(
        report["command"]
            .as_str()
            .unwrap()
            .contains("bench --quick")
    );
    let contenders = report["contenders"].as_array().unwrap();
    let names: Vec<&str> = contenders
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["round_robin", "precise"]);
    for c in contenders {
        for k in [
            "name",
            "policy",
            "routers",
            "requests",
            "errors",
            "output_tokens_per_s",
            "requests_per_s",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "hit_rate",
            "predicted_hit_rate",
            "load_spread",
        ] {
            assert!(c.get(k).is_some(), "{k} missing in {c}");
        }
        assert_eq!(c["errors"], 0, "{c}");
        assert_eq!(c["requests"], 36, "{c}");
        assert!(c["output_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    assert!(contenders[1]["predicted_hit_rate"].as_f64().is_some());
    for f in [
        "report.md",
        "ttft_cdf.svg",
        "throughput.svg",
        "hit_rate.svg",
        "hit_rate_over_time.svg",
        "load_spread.svg",
    ] {
        let body = std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        assert!(body.len() > 200, "{f} missing or empty");
        if f.ends_with(".svg") {
            assert!(
                body.contains("<svg") && body.contains("<text"),
                "{f}: no SVG text"
            );
        }
    }
    // The evaluator: every policy and the oracle, the oracle the highest hit rate.
    let eval = report["evaluator"].as_array().unwrap();
    let hit = |n: &str| {
        eval.iter()
            .find(|e| e["name"] == n)
            .and_then(|e| e["hit_rate"].as_f64())
            .unwrap_or_else(|| panic!("no evaluator row {n}"))
    };
    assert!(hit("oracle") >= hit("precise") && hit("oracle") >= hit("round_robin"));
    for c in contenders {
        let real = c["hit_rate"].as_f64().unwrap();
        let virt = hit(c["policy"].as_str().unwrap());
        println!("{}: real hit {real:.3}, evaluator {virt:.3}", c["name"]);
        assert!(
            (real - virt).abs() <= TOLERANCE,
            "{}: real {real:.3} vs evaluator {virt:.3}",
            c["name"]
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Router counts side by side in one run: 1 router, 2 meshed and 2 independent replicas take
/// turns on the same fleet in every repeat, each row saying what it was, with the in-flight
/// spread sampled from the routers.
#[test]
fn bench_router_counts_interleave_in_one_run() {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-routers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let md = run_bench(
        &[
            "--quick",
            "--engines",
            "2",
            "--groups",
            "2",
            "--concurrency",
            "4",
            "--policy",
            "least_request",
            "--routers",
            "1",
            "--routers",
            "2",
            "--routers",
            "2:no-mesh",
        ],
        &dir,
    );
    assert!(md.contains("| in flight |"), "{md}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let contenders = report["contenders"].as_array().unwrap();
    let rows: Vec<(&str, u64, bool)> = contenders
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap(),
                c["routers"].as_u64().unwrap(),
                c["mesh"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("round_robin", 1, false),
            ("least_request", 1, false),
            ("round_robin x2 mesh", 2, true),
            ("least_request x2 mesh", 2, true),
            ("round_robin x2 no-mesh", 2, false),
            ("least_request x2 no-mesh", 2, false),
        ]
    );
    for c in contenders {
        assert_eq!(c["errors"], 0, "{c}");
        assert!(c["requests"].as_u64().unwrap() > 0, "{c}");
        let s = c["inflight_spread"].as_f64().expect("in-flight samples");
        assert!(s >= 1.0, "max / mean is at least 1: {c}");
        let mean = c["inflight_mean"].as_f64().expect("mean in flight");
        assert!(mean > 0.0, "the counted samples are under load: {c}");
        let excess = c["inflight_excess"]
            .as_f64()
            .expect("excess over the fewest");
        assert!(
            excess >= 0.0,
            "no engine holds fewer than the fewest possible max: {c}"
        );
    }
    assert_eq!(report["fleet"]["routers"].as_array().unwrap().len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A count of 0 is refused with the flag's name, before anything starts (it used to become 1
/// without a word).
#[test]
fn bench_refuses_zero_counts() {
    for flag in [
        "--engines",
        "--repeats",
        "--concurrency",
        "--groups",
        "--requests",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(["bench", "--quick", flag, "0"])
            .stdin(Stdio::null())
            .output()
            .expect("run kvmesh bench");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} 0 accepted");
        assert!(
            err.contains(&format!("{flag} must be at least 1")),
            "{flag}: {err}"
        );
    }
}

/// Values that would only waste a run are refused before anything starts, naming the flag;
/// a run none of whose requests was answered exits non-zero with the first error.
#[test]
fn bench_refuses_what_would_waste_a_run_and_fails_when_nothing_was_answered() {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-refuse-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("md-dir/report.md")).expect("dir");
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "").expect("write");
    let out_dir = dir.join("out");
    let run = |args: &[&str]| {
        let started = Instant::now();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
        cmd.args(["bench", "--quick"]).args(args);
        if !args.contains(&"--out") {
            cmd.arg("--out").arg(&out_dir);
        }
        let out = cmd.stdin(Stdio::null()).output().expect("run kvmesh bench");
        assert!(!out.status.success(), "{args:?} accepted");
        (
            String::from_utf8_lossy(&out.stderr).into_owned(),
            started.elapsed(),
        )
    };
    let md_dir = dir.join("md-dir");
    let empty = empty.to_str().expect("utf8");
    for (args, says) in [
        (vec!["--speedup", "0"], "--speedup must be above 0"),
        (vec!["--speedup=-1"], "--speedup must be above 0"),
        (vec!["--target", "notaurl"], "--target notaurl"),
        (
            vec!["--kv-blocks", "100"],
            "--kv-blocks 100 holds 1600 tokens",
        ),
        (
            vec!["--workload", "trace", "--trace", empty],
            "the trace has no requests",
        ),
        (
            vec!["--out", md_dir.to_str().expect("utf8")],
            "report.md is a directory",
        ),
        // Flags that would do nothing in the combination are refused (QA).
        (
            vec!["--trace", empty],
            "--trace is read with --workload trace only",
        ),
        (
            vec!["--target", "http://127.0.0.1:1", "--engines", "8"],
            "--engines sets up the local fleet",
        ),
        (
            vec!["--sticky-clients", "--routers", "1"],
            "--sticky-clients needs more than one router",
        ),
    ] {
        let (err, _) = run(&args);
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("repeat 0"), "{args:?} ran: {err}");
    }
    // Nothing listens on port 1: every request fails, and the run says so by its status.
    let (err, took) = run(&["--target", "http://127.0.0.1:1", "--groups", "1"]);
    assert!(err.contains("every request of `target` failed"), "{err}");
    assert!(took < Duration::from_secs(120), "{took:?}");
    let json = std::fs::read_to_string(out_dir.join("report.json")).expect("report written");
    assert!(json.contains("\"first_error\""), "{json}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A bench whose stdout and stderr are pipes nobody reads any more (`kvmesh bench ... 2>&1 |
/// head` once `head` has exited) runs to its end and writes its report; it used to panic at
/// its first progress line (QA).
#[test]
fn bench_runs_on_when_its_output_pipes_are_closed() {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-pipes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (out_r, out_w) = std::io::pipe().expect("pipe");
    let (err_r, err_w) = std::io::pipe().expect("pipe");
    drop((out_r, err_r));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["bench", "--quick", "--engines", "1", "--groups", "2"])
        .args(["--concurrency", "2", "--policy", "round_robin", "--out"])
        .arg(&dir)
        .env("RUST_LOG", "warn")
        .stdout(out_w)
        .stderr(err_w)
        .spawn()
        .expect("start kvmesh bench");
    let status = wait_bounded(&mut child);
    assert!(status.success(), "{status}");
    assert!(dir.join("report.json").exists(), "report written");
    let _ = std::fs::remove_dir_all(&dir);
}
