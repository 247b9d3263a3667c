//! Acceptance 7: graceful shutdown. A long stream in flight completes while the router shuts
//! down (drain), and new connections are refused from the moment the shutdown starts.

mod common;

use common::*;
use http_body_util::BodyExt;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_the_stream_in_flight_and_refuses_new_connections() {
    // Real time: a 600-token answer streams for ~3.5 s.
    let sims = start_sims(2, |_| {
        let mut c = sim_cfg("test-model");
        c.time_scale = 1.0;
        c
    })
    .await;
    let router = start_router_with(serve_cfg(&urls(&sims)), "test-model", 2).await;
    let addr = router.addr;
    let base = router.base_url();
    let c = client();

    let mut body = chat_body("test-model", "tell me a story", 600, true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let (_, stream, mut text) = stream_started(&c, &base, &body, 3).await;

    // Shut down while the stream is in flight.
    let shutdown = tokio::spawn(router.shutdown());
    wait_until(
        "new connections to be refused",
        Duration::from_secs(10),
        || async move { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    // The stream is still going (it was not cut) ...
    assert!(
        !shutdown.is_finished(),
        "shutdown did not wait for the stream"
    );
    // ... and completes.
    let rest = tokio::time::timeout(Duration::from_secs(30), stream.collect())
        .await
        .expect("stream ends in time")
        .expect("stream intact")
        .to_bytes();
    text.extend_from_slice(&rest);
    let text = String::from_utf8_lossy(&text);
    assert!(text.ends_with("data: [DONE]\n\n"), "{:.300}", text);
    assert!(!text.contains("\"error\""), "{:.300}", text);
    assert!(
        text.contains("\"completion_tokens\":600"),
        "the whole answer arrived: {:.300}",
        &text[text.len().saturating_sub(400)..]
    );
    // Then the shutdown finishes, well before its drain limit, and nothing listens any more.
    tokio::time::timeout(Duration::from_secs(15), shutdown)
        .await
        .expect("shutdown finished")
        .expect("task");
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    stop_sims(sims).await;
}

/// With `shutdown_delay_ms`, a stop first turns `/health` to 503 while the router keeps
/// serving (load balancers take it out), then it stops accepting; a second signal cuts the
/// wait short (found by QA: clients met refused connections from the first instant).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_is_announced_on_health_while_the_router_still_serves() {
    let sims = start_sims(1, |_| instant_sim_cfg("test-model")).await;
    let mut cfg = serve_cfg(&urls(&sims));
    cfg.shutdown_delay_ms = 60_000;
    let router = start_router_with(cfg, "test-model", 1).await;
    let (addr, base) = (router.addr, router.base_url());
    let c = client();
    assert_eq!(get(&c, &format!("{base}/health")).await.0, 200);
    let (second, signal) = tokio::sync::oneshot::channel::<()>();
    let stop = tokio::spawn(router.stop(async {
        let _ = signal.await;
    }));
    wait_until("/health to answer 503", Duration::from_secs(5), || {
        let (c, url) = (c.clone(), format!("{base}/health"));
        async move { get(&c, &url).await.0 == 503 }
    })
    .await;
    let chat = format!("{base}/v1/chat/completions");
    let r = post_json(
        &c,
        &chat,
        &chat_body("test-model", "still there?", 2, false),
    )
    .await;
    assert_eq!(r.status, 200, "served during the delay: {}", r.body);
    assert!(!stop.is_finished(), "the delay holds");
    // The second signal: the router stops accepting and shuts down now, not a minute later.
    let _ = second.send(());
    tokio::time::timeout(Duration::from_secs(15), stop)
        .await
        .expect("stopped without the rest of the delay")
        .expect("task");
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    stop_sims(sims).await;
}

/// A stream still going when the drain timeout ends is told why, with an OpenAI error event,
/// before its connection closes (QA: it was cut without a word, `curl: (18)`), and the
/// engine is not blamed for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_the_drain_timeout_is_told_with_an_error_event() {
    // Real time: a 2,000-token answer streams for about 12 s.
    let sims = start_sims(1, |_| {
        let mut c = sim_cfg("test-model");
        c.time_scale = 1.0;
        c
    })
    .await;
    let mut cfg = serve_cfg(&urls(&sims));
    cfg.drain_timeout_ms = 1_000;
    let router = start_router_with(cfg, "test-model", 1).await;
    let base = router.base_url();
    let gw = router.gateway.clone();
    let c = client();
    let body = chat_body("test-model", "tell me a long story", 2_000, true);
    let (_, mut stream, mut text) = stream_started(&c, &base, &body, 1).await;

    let shutdown = tokio::spawn(router.shutdown());
    // Frames until the connection closes, within the drain timeout and a margin.
    let read = async {
        while let Some(f) = stream.frame().await {
            match f {
                Ok(f) => text.extend_from_slice(f.data_ref().map_or(&[][..], |d| &d[..])),
                Err(_) => break,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the stream ends with the drain");
    let text = String::from_utf8_lossy(&text);
    let tail = &text[text.len().saturating_sub(400)..];
    assert!(!text.contains("data: [DONE]"), "{tail}");
    let last = text
        .trim_end()
        .rsplit("\n\n")
        .next()
        .and_then(|e| e.strip_prefix("data: "))
        .unwrap_or_default();
    let event: serde_json::Value =
        serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {tail}"));
    assert_eq!(event["error"]["code"], "service_unavailable", "{tail}");
    assert!(
        event["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("drain_timeout_ms")),
        "{tail}"
    );
    tokio::time::timeout(Duration::from_secs(15), shutdown)
        .await
        .expect("shutdown finished")
        .expect("task");
    let engine = gw.registry.members()[0].clone();
    assert_eq!(
        engine
            .metrics
            .errors
            .iter()
            .map(|e| e.load(std::sync::atomic::Ordering::Relaxed))
            .sum::<u64>(),
        0,
        "the engine is not blamed"
    );
    stop_sims(sims).await;
}
