//! Acceptance 1: the official `openai` Python client through `kvmesh serve` in front of four
//! simulated engines, and a client that leaves a stream halfway cancels the engine's work.

mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs a script of tests/python with a time limit; returns its stdout or panics with both
/// streams.
fn python(script: &str, args: &[&str], limit: Duration) -> String {
    let path = repo_root().join("tests/python").join(script);
    let mut child = Command::new("python3")
        .arg(&path)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("python3 not runnable ({e}); run scripts/install-test-deps.sh"));
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("wait python").is_some() {
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{script} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("python output");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}\n(missing modules? run scripts/install-test-deps.sh)",
        out.status
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_through_the_router() {
    let sims = start_sims(4, |_| sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let router = start_router_with(serve_cfg(&engines), "test-model", 4).await;
    let base = router.base_url();
    let c = client();

    // The script blocks: run it off the runtime so the router and engines keep serving.
    let v1 = format!("{base}/v1");
    let out = tokio::task::spawn_blocking(move || {
        python(
            "openai_check.py",
            &[&v1, "test-model", "--retrieve"],
            Duration::from_secs(120),
        )
    })
    .await
    .expect("python task");
    assert!(out.contains("\"ok\": true"), "{out}");

    // Every request of the script went through the router: 7 inference calls (chat ×2,
    // completions ×3, the unknown model, max_tokens = 0), none of them retried.
    let page = scrape(&c, &base).await;
    assert_eq!(metric(&page, "kvmesh_requests_total"), 7.0, "{page}");
    assert_eq!(metric(&page, "kvmesh_retries_total"), 0.0);
    let sent: f64 = attempts(&page, &engines).iter().sum();
    assert_eq!(sent, 6.0, "6 reached an engine (the unknown model did not)");
    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_stream_cancels_the_upstream_request() {
    // Real time: a 4,000-token answer takes ~22 s, far longer than the wait below, so the
    // request can only leave the engine early by being cancelled.
    let sims = start_sims(4, |_| {
        let mut c = sim_cfg("test-model");
        c.time_scale = 1.0;
        c
    })
    .await;
    let engines = urls(&sims);
    let router = start_router_with(serve_cfg(&engines), "test-model", 4).await;
    let base = router.base_url();
    let c = client();

    let body = chat_body("test-model", "tell me a very long story", 4000, true);
    let (head, stream, _) = stream_started(&c, &base, &body, 4).await;
    let engine = head
        .get("x-kvmesh-engine")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .expect("x-kvmesh-engine");
    assert!(engines.contains(&engine), "{engine}");
    let running = |page: &str| metric(page, "vllm:num_requests_running");
    assert_eq!(running(&scrape(&c, &engine).await), 1.0);
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_in_flight", &engine),
        1.0
    );

    // Leave halfway.
    drop(stream);
    wait_until(
        "the engine to abort the abandoned request",
        Duration::from_secs(10),
        || {
            let (c, e) = (c.clone(), engine.clone());
            async move { running(&scrape(&c, &e).await) == 0.0 }
        },
    )
    .await;
    wait_until(
        "the router to count the request out",
        Duration::from_secs(10),
        || {
            let (c, b, e) = (c.clone(), base.clone(), engine.clone());
            async move {
                engine_metric(&scrape(&c, &b).await, "kvmesh_engine_in_flight", &e) == 0.0
            }
        },
    )
    .await;
    // A client leaving is not the engine's fault.
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_errors_total", &engine),
        0.0
    );
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_breaker_state", &engine),
        0.0
    );
    let engine_page = scrape(&c, &engine).await;
    assert!(
        metric(&engine_page, "vllm:num_requests_running") == 0.0
            && metric(&engine_page, "vllm:num_requests_waiting") == 0.0,
        "{engine_page}"
    );
    router.shutdown().await;
    stop_sims(sims).await;
}
