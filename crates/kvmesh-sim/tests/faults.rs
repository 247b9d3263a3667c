//! Fault injection at run time, client disconnects, cache reset and restart.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

fn completion(text: &str, max_tokens: u32) -> serde_json::Value {
    json!({"model": "sim-model", "prompt": text, "max_tokens": max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_faults_slowdown_and_clear() {
    let sim = kvmesh_sim::start(cfg()).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let url = format!("{base}/v1/completions");
    let faults = format!("{base}/admin/faults");

    let (s, v) = post(&c, &faults, json!({"error_rate": 1.0, "error_status": 429})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["error_rate"], 1.0);
    for _ in 0..5 {
        let (s, v) = post(&c, &url, completion("hello", 2)).await;
        assert_eq!(s, 429, "{v}");
        assert_eq!(v["error"]["type"], "rate_limit_error");
    }
    // Fields merge: changing the status keeps the rate.
    let (s, v) = post(&c, &faults, json!({"error_status": 500})).await;
    assert_eq!((s, &v["error_rate"]), (200, &json!(1.0)));
    let (s, _) = post(&c, &url, completion("hello", 2)).await;
    assert_eq!(s, 500);
    // A bad patch is refused and changes nothing.
    let (s, v) = post(&c, &faults, json!({"error_rate": 7})).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(
        v["error"]["param"], "error_rate",
        "the field refused is named: {v}"
    );
    let (s, v) = post(&c, &faults, json!({"no_such_fault": true})).await;
    assert_eq!(s, 400, "{v}");
    let (_, now) = get(&c, &faults).await;
    let now: serde_json::Value = serde_json::from_str(&now).expect("json");
    assert_eq!(
        (now["error_rate"].as_f64(), now["error_status"].as_u64()),
        (Some(1.0), Some(500))
    );
    let (s, _) = request(&c, "DELETE", &faults, bytes::Bytes::new()).await;
    assert_eq!(s, 200);
    let (s, v) = post(&c, &url, completion("hello", 2)).await;
    assert_eq!(s, 200, "{v}");
    let page = metrics(&c, &base).await;
    assert_eq!(metric(&page, "kvmesh_sim_injected_errors_total"), 6.0);

    // Slowdown ×5: the same uncached prefill takes five times the simulated TTFT.
    let ttft_of = |a: &str, b: &str| {
        metric(b, "vllm:time_to_first_token_seconds_sum")
            - metric(a, "vllm:time_to_first_token_seconds_sum")
    };
    let m0 = metrics(&c, &base).await;
    post(&c, &url, completion(&long_text(1, 400), 1)).await;
    let m1 = metrics(&c, &base).await;
    post(&c, &faults, json!({"slowdown": 5.0})).await;
    post(&c, &url, completion(&long_text(2, 400), 1)).await;
    let m2 = metrics(&c, &base).await;
    let (fast, slow) = (ttft_of(&m0, &m1), ttft_of(&m1, &m2));
    let ratio = slow / fast;
    assert!(
        (4.5..5.5).contains(&ratio),
        "slowdown ratio {ratio} ({fast} → {slow})"
    );
    sim.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_holds_requests_until_cleared() {
    let sim = kvmesh_sim::start(cfg()).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let (s, _) = post(&c, &format!("{base}/admin/faults"), json!({"hang": true})).await;
    assert_eq!(s, 200);
    let url = format!("{base}/v1/completions");
    let c2 = c.clone();
    let pending =
        tokio::spawn(async move { post(&c2, &url, completion("are you there", 3)).await });
    // It is accepted and waits in the engine.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let page = metrics(&c, &base).await;
        if metric(&page, "vllm:num_requests_waiting") + metric(&page, "vllm:num_requests_running")
            >= 1.0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "request never reached the engine"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pending.is_finished(), "a hung engine answered");
    // Health still answers (the API server is alive; only the engine hangs).
    assert_eq!(get(&c, &format!("{base}/health")).await.0, 200);
    let (s, _) = request(
        &c,
        "DELETE",
        &format!("{base}/admin/faults"),
        bytes::Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    let (s, v) = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("answered after the fault cleared")
        .expect("task");
    assert_eq!(s, 200, "{v}");
    sim.shutdown(Duration::from_secs(5)).await;
}

/// A streamed chat on a hung engine gets its head and nothing else: the stream opens with
/// the role once the engine's first token exists, as vLLM's does (the sim used to send the
/// role at once, so a router saw a first byte from an engine that never answered and took
/// ~0 ms for its time to first token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_s_stream_sends_nothing_before_its_first_token() {
    use http_body_util::BodyExt;
    let sim = kvmesh_sim::start(cfg()).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let (s, _) = post(&c, &format!("{base}/admin/faults"), json!({"hang": true})).await;
    assert_eq!(s, 200);
    let body = json!({"model": "sim-model", "stream": true, "max_tokens": 3,
        "messages": [{"role": "user", "content": "are you there"}]});
    let req = http::Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(5), c.request(req))
        .await
        .expect("head in time")
        .expect("head");
    assert_eq!(resp.status(), 200);
    let mut b = resp.into_body();
    let early = tokio::time::timeout(Duration::from_millis(400), b.frame()).await;
    assert!(early.is_err(), "a hung engine sent {early:?}");
    let (s, _) = request(
        &c,
        "DELETE",
        &format!("{base}/admin/faults"),
        bytes::Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    let mut text = String::new();
    while let Some(f) = tokio::time::timeout(Duration::from_secs(10), b.frame())
        .await
        .expect("the stream goes on once the fault is cleared")
    {
        if let Some(d) = f.expect("frame").data_ref() {
            text.push_str(&String::from_utf8_lossy(d));
        }
    }
    let first = text.lines().next().unwrap_or_default();
    assert!(first.contains(r#""role":"assistant""#), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    sim.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_aborts_the_engine_request() {
    let mut cfg = cfg();
    cfg.time_scale = 1.0; // slow enough that the request is still running when we leave
    let sim = kvmesh_sim::start(cfg).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let body = json!({
        "model": "sim-model", "prompt": "tell me a long story", "max_tokens": 2000, "stream": true
    });
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("req");
    let resp = c.request(req).await.expect("send");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    // Read a couple of frames, then drop the stream halfway.
    use http_body_util::BodyExt;
    for _ in 0..3 {
        let f = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("frame in time");
        assert!(f.is_some());
    }
    let page = metrics(&c, &base).await;
    assert_eq!(metric(&page, "vllm:num_requests_running"), 1.0);
    drop(body);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let page = metrics(&c, &base).await;
        if metric(&page, "vllm:num_requests_running") == 0.0 {
            assert_eq!(metric(&page, "kvmesh_sim_aborted_requests_total"), 1.0);
            assert_eq!(metric(&page, "vllm:request_success_total"), 0.0);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the engine kept running the request"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sim.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_prefix_cache_and_restart_empty_the_cache() {
    let sim = kvmesh_sim::start(cfg()).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let url = format!("{base}/v1/completions");
    let text = long_text(3, 300);
    let blocks = |c: HttpClient, base: String| async move {
        let (_, b) = get(&c, &format!("{base}/admin/kv_cache")).await;
        let v: serde_json::Value = serde_json::from_str(&b).expect("json");
        v["blocks"].as_array().map(Vec::len).unwrap_or(0)
    };
    post(&c, &url, completion(&text, 2)).await;
    assert!(blocks(c.clone(), base.clone()).await > 0);
    let (s, _) = request(
        &c,
        "POST",
        &format!("{base}/reset_prefix_cache"),
        bytes::Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(blocks(c.clone(), base.clone()).await, 0);
    let (_, v) = post(&c, &url, completion(&text, 2)).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, v) = post(&c, &url, completion(&text, 2)).await;
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));

    let (s, _) = request(
        &c,
        "POST",
        &format!("{base}/admin/restart"),
        bytes::Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(blocks(c.clone(), base.clone()).await, 0);
    let (_, v) = post(&c, &url, completion(&text, 2)).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let page = metrics(&c, &base).await;
    assert_eq!(metric(&page, "kvmesh_sim_restarts_total"), 1.0);
    sim.shutdown(Duration::from_secs(5)).await;
}
