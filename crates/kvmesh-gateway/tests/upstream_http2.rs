//! HTTP/2 to the engines (`[serve.upstream] protocol = "http2"`): the router speaks h2c with
//! prior knowledge to simulators (which serve HTTP/1.1 and h2c on one port). Requests and
//! streams pass through, concurrent requests share one connection, a restarted engine is
//! reconnected, and a client that leaves mid-stream resets its stream so the engine aborts.
//! Every test checks that HTTP/2 was really spoken: the simulator counts the requests it
//! received over HTTP/2 (`kvmesh_sim_http2_requests_total`) and the router its connects.

mod common;

use common::*;
use kvmesh_config::{ServeConfig, UpstreamProtocol};
use std::time::Duration;

const MODEL: &str = "test-model";

fn h2_cfg(engines: &[String]) -> ServeConfig {
    let mut c = serve_cfg(engines);
    c.upstream.protocol = UpstreamProtocol::Http2;
    c
}

fn connects(router: &kvmesh_gateway::GatewayServer) -> u64 {
    router
        .gateway
        .upstream
        .connects()
        .expect("the production upstreams count their connects")
}

async fn h2_requests(c: &HttpClient, sim_base: &str) -> f64 {
    metric(
        &scrape(c, sim_base).await,
        "kvmesh_sim_http2_requests_total",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_streams_pass_over_http2_and_http1_stays_http1() {
    let sims = start_sims(2, |_| instant_sim_cfg(MODEL)).await;
    let engines = urls(&sims);
    let c = client();

    // HTTP/1.1 (the default) to the first engine: the engine sees no HTTP/2 request.
    assert_eq!(
        ServeConfig::default().upstream.protocol,
        UpstreamProtocol::Http1
    );
    let mut cfg = serve_cfg(&engines[..1]);
    cfg.upstream.protocol = UpstreamProtocol::Http1;
    let h1 = start_router_with(cfg, MODEL, 1).await;
    let r = post_json(
        &c,
        &format!("{}/v1/chat/completions", h1.base_url()),
        &chat_body(MODEL, "hello", 8, false),
    )
    .await;
    assert!(r.ok(), "{r:?}");
    assert_eq!(h2_requests(&c, &engines[0]).await, 0.0);
    h1.shutdown().await;

    // HTTP/2 to the second one.
    let router = start_router_with(h2_cfg(&engines[1..]), MODEL, 1).await;
    let base = router.base_url();
    let r = post_json(
        &c,
        &format!("{base}/v1/chat/completions"),
        &chat_body(MODEL, "hello", 8, false),
    )
    .await;
    assert!(r.ok(), "{r:?}");
    assert_eq!(r.engine.as_deref(), Some(engines[1].as_str()));
    let j = r.json();
    assert_eq!(j["object"], "chat.completion", "{j}");
    assert!(j["usage"]["completion_tokens"].as_u64() > Some(0), "{j}");

    let r = post_json(
        &c,
        &format!("{base}/v1/completions"),
        &completion_body(MODEL, "once upon a time", 16, true),
    )
    .await;
    assert!(r.ok(), "{r:?}");
    assert!(r.body.matches("data: {").count() >= 2, "{}", r.body);

    // Both reached the engine over HTTP/2 (its probes — health, models, metrics — are
    // HTTP/1.1), on one connection.
    assert_eq!(h2_requests(&c, &engines[1]).await, 2.0);
    assert_eq!(connects(&router), 1);
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_in_flight", &engines[1]),
        0.0
    );
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_errors_total", &engines[1]),
        0.0
    );
    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_one_connection() {
    let sims = start_sims(1, |_| sim_cfg(MODEL)).await;
    let engines = urls(&sims);
    let router = start_router_with(h2_cfg(&engines), MODEL, 1).await;
    let base = router.base_url();
    // One client connection per request (HTTP/1.1 to the router), 32 at once.
    let replies = futures::future::join_all((0..32).map(|i| {
        let url = format!("{base}/v1/chat/completions");
        async move {
            let c = client();
            post_json(&c, &url, &chat_body(MODEL, &format!("story {i}"), 32, true)).await
        }
    }))
    .await;
    let bad = failures(&replies);
    assert!(bad.is_empty(), "{bad:#?}");
    // HTTP/1.1 would have opened one connection per concurrent request.
    assert_eq!(connects(&router), 1, "one multiplexed connection");
    let c = client();
    assert_eq!(h2_requests(&c, &engines[0]).await, 32.0);
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_in_flight", &engines[0]),
        0.0
    );
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_requests_total", &engines[0]),
        32.0
    );
    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_reconnected() {
    let sim = kvmesh_sim::start(instant_sim_cfg(MODEL))
        .await
        .expect("start sim");
    // The router knows the engine by an address that outlives the engine's process: a
    // forwarder, so that the new engine is reached at the same address without rebinding a
    // port another socket may have taken meanwhile.
    let proxy = CrashProxy::start("127.0.0.1:0".parse().expect("addr"), sim.http_addr).await;
    let engine = proxy.url();
    let router = start_router_with(h2_cfg(std::slice::from_ref(&engine)), MODEL, 1).await;
    let url = format!("{}/v1/chat/completions", router.base_url());
    let c = client();
    let r = post_json(&c, &url, &chat_body(MODEL, "before", 8, false)).await;
    assert!(r.ok(), "{r:?}");
    assert_eq!(connects(&router), 1);

    // A new engine comes up behind the same address and the old one stops (its HTTP/2
    // connection gets a GOAWAY and closes): the router opens a new connection.
    let new_sim = kvmesh_sim::start(instant_sim_cfg(MODEL))
        .await
        .expect("start the new sim");
    proxy.retarget(new_sim.http_addr);
    sim.shutdown(Duration::from_secs(2)).await;
    let sim = new_sim;
    // Health checks may have ejected it meanwhile: bounded retries until it answers.
    wait_until(
        "a request through the restarted engine",
        Duration::from_secs(20),
        || {
            let (c, url) = (c.clone(), url.clone());
            async move {
                post_json(&c, &url, &chat_body(MODEL, "after", 8, false))
                    .await
                    .ok()
            }
        },
    )
    .await;
    assert_eq!(connects(&router), 2, "one new connection to the new engine");
    assert!(h2_requests(&c, &engine).await >= 1.0);
    router.shutdown().await;
    sim.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_reset_by_a_crash_is_replaced() {
    let sims = start_sims(1, |_| instant_sim_cfg(MODEL)).await;
    // The router reaches the engine through a forwarder that can die like a killed process:
    // every connection reset at once, no GOAWAY.
    let target = sims[0].http_addr;
    let mut proxy = CrashProxy::start("127.0.0.1:0".parse().expect("addr"), target).await;
    let engine = proxy.url();
    let router = start_router_with(h2_cfg(std::slice::from_ref(&engine)), MODEL, 1).await;
    let url = format!("{}/v1/chat/completions", router.base_url());
    let c = client();
    let r = post_json(&c, &url, &chat_body(MODEL, "before", 8, false)).await;
    assert!(r.ok(), "{r:?}");
    assert_eq!(connects(&router), 1);

    proxy.crash().await;
    proxy.restart(target).await;
    wait_until("a request after the crash", Duration::from_secs(20), || {
        let (c, url) = (c.clone(), url.clone());
        async move {
            post_json(&c, &url, &chat_body(MODEL, "after", 8, false))
                .await
                .ok()
        }
    })
    .await;
    assert_eq!(connects(&router), 2, "one new connection after the reset");
    assert_eq!(h2_requests(&c, &sims[0].base_url()).await, 2.0);
    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_resets_its_stream_and_the_engine_aborts() {
    // Real time: a 4,000-token answer takes ~22 s, far longer than the waits below, so the
    // request can only leave the engine early by being cancelled.
    let sims = start_sims(1, |_| {
        let mut c = sim_cfg(MODEL);
        c.time_scale = 1.0;
        c
    })
    .await;
    let engines = urls(&sims);
    let engine = engines[0].clone();
    let router = start_router_with(h2_cfg(&engines), MODEL, 1).await;
    let base = router.base_url();
    let c = client();

    let body = chat_body(MODEL, "tell me a very long story", 4000, true);
    let (_, stream, _) = stream_started(&c, &base, &body, 4).await;
    let page = scrape(&c, &engine).await;
    assert_eq!(metric(&page, "vllm:num_requests_running"), 1.0);
    assert_eq!(metric(&page, "kvmesh_sim_http2_requests_total"), 1.0);

    // Leave halfway: the router drops its upstream body, which resets the HTTP/2 stream.
    drop(stream);
    wait_until(
        "the engine to abort the abandoned request",
        Duration::from_secs(10),
        || {
            let (c, e) = (c.clone(), engine.clone());
            async move {
                let page = scrape(&c, &e).await;
                metric(&page, "vllm:num_requests_running") == 0.0
                    && metric(&page, "kvmesh_sim_aborted_requests_total") == 1.0
            }
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
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_errors_total", &engine),
        0.0,
        "a client leaving is not the engine's fault"
    );

    // Only the stream was reset: the connection serves the next request.
    let r = post_json(
        &c,
        &format!("{base}/v1/completions"),
        &completion_body(MODEL, "short", 2, false),
    )
    .await;
    assert!(r.ok(), "{r:?}");
    assert_eq!(connects(&router), 1, "the connection outlived the reset");
    assert_eq!(h2_requests(&c, &engine).await, 2.0);
    router.shutdown().await;
    stop_sims(sims).await;
}

/// An engine that speaks HTTP/1.1 only, as vLLM and SGLang do, behind a router told to speak
/// h2c: the client's 502 says what is likely, not a bare "http2 error" (QA35).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_speaks_http1_only_is_said_to() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let server = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                // What an HTTP/1.1 server answers to the HTTP/2 preface, then it closes.
                let mut buf = [0u8; 1024];
                let _ = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
                let _ = s
                    .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
                let _ = s.shutdown().await;
            });
        }
    });
    let mut cfg = h2_cfg(std::slice::from_ref(&url));
    cfg.engines[0].models = vec![MODEL.into()];
    cfg.routing.health.active.enabled = false;
    let router = start_router_with(cfg, MODEL, 1).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", router.base_url());
    let r = post_json(&c, &url, &chat_body(MODEL, "hi", 4, false)).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(
        r.body.contains("h2c") && r.body.contains("--upstream-http2"),
        "{}",
        r.body
    );
    router.shutdown().await;
    server.abort();
}
