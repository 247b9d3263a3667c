//! Every engine whose models are discovered ends up in the routing snapshot, however the
//! discoveries interleave. (Regression: concurrent snapshot rebuilds could store an older
//! snapshot last, leaving a discovered engine out of the route until the next membership
//! change: a router started in front of 4 engines routed to 2 of them for good.)
//!
//! Uses many tiny fake engines (`/v1/models`, `/metrics`, `/health` only) so that dozens of
//! routers can start in a few seconds.

mod common;

use common::*;
use http::{Request, Response};
use hyper::body::Incoming;
use kvmesh_http::{Body, json, ok_empty, prometheus};
use std::sync::Arc;
use std::time::Duration;

/// The fake engines' `/v1/models`: model `m`.
const MODELS: &str =
    r#"{"object":"list","data":[{"id":"m","object":"model","created":0,"owned_by":"x"}]}"#;

/// Serves `handler` on a loopback port: its URL, and the sender that stops it (on drop).
async fn spawn_engine<H, F>(handler: H) -> (String, tokio::sync::oneshot::Sender<()>)
where
    H: Fn(Arc<()>, Request<Incoming>) -> F + Send + Sync + Copy + 'static,
    F: std::future::Future<Output = Response<Body>> + Send + 'static,
{
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(kvmesh_http::serve(
        l,
        Arc::new(()),
        handler,
        rx,
        Duration::from_secs(1),
        kvmesh_http::ServeLimits::default(),
    ));
    (url, tx)
}

async fn fake_engine(_: Arc<()>, req: Request<Incoming>) -> Response<Body> {
    match req.uri().path() {
        "/v1/models" => json(200, MODELS.to_string()),
        "/metrics" => {
            prometheus("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n".into())
        }
        _ => ok_empty(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_discovered_engine_is_routed() {
    const ENGINES: usize = 16;
    const ROUTERS: usize = 60;
    let mut engines = Vec::new();
    let mut stops = Vec::new();
    for _ in 0..ENGINES {
        let (url, stop) = spawn_engine(fake_engine).await;
        engines.push(url);
        stops.push(stop);
    }
    // Busy threads preempt the rebuilding ones at random points, as a loaded machine does.
    let spin = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let spinners: Vec<_> = (0..2)
        .map(|_| {
            let spin = spin.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while spin.load(std::sync::atomic::Ordering::Relaxed) {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    std::hint::black_box(x);
                }
            })
        })
        .collect();
    for i in 0..ROUTERS {
        let mut cfg = serve_cfg(&engines);
        cfg.seed = i as u64 + 1;
        let router = start_router(cfg).await;
        // A stale snapshot stays until the next membership change: waiting cannot fix it.
        let gw = router.gateway.clone();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let routed = gw
                .registry
                .snapshot()
                .routes
                .get("m")
                .map_or(0, |r| r.engines.len());
            let discovered = gw
                .registry
                .members()
                .iter()
                .filter(|e| !e.models().is_empty())
                .count();
            if routed == ENGINES {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "router {i}: {routed} engines routed, {discovered} discovered"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        router.shutdown().await;
    }
    spin.store(false, std::sync::atomic::Ordering::Relaxed);
    for t in spinners {
        t.join().expect("spinner");
    }
    drop(stops);
}

/// A fake engine started with `--api-key k1`: `/v1/*` refuses a request without the key
/// (401), as vLLM's does; `/health` and `/metrics` need none.
async fn keyed_engine(_: Arc<()>, req: Request<Incoming>) -> Response<Body> {
    let keyed = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .is_some_and(|v| v == "Bearer k1");
    match req.uri().path() {
        "/v1/models" if !keyed => json(401, r#"{"error":"Unauthorized"}"#.to_string()),
        "/v1/models" => json(200, MODELS.to_string()),
        _ => ok_empty(),
    }
}

/// An engine whose `/v1/models` wants an API key serves its models once the router is given
/// the key (`engine_api_key`); without it, it serves none (QA: such an engine was never
/// routed to, and nothing said why: the router now warns).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_wants_a_key_is_discovered_with_the_router_s_engine_key() {
    let (engine, _stop) = spawn_engine(keyed_engine).await;
    let discovered = |gw: &kvmesh_gateway::Gateway| {
        gw.registry
            .members()
            .iter()
            .any(|e| e.models() == ["m".to_string()])
    };
    for key in ["", "k1"] {
        let mut cfg = serve_cfg(std::slice::from_ref(&engine));
        cfg.discovery_interval_ms = 100;
        cfg.engine_api_key = key.into();
        let router = start_router(cfg).await;
        let gw = router.gateway.clone();
        if key.is_empty() {
            // The start's first discovery round could not list its models.
            assert!(!discovered(&gw), "discovered without the key");
        } else {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !discovered(&gw) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "not discovered with the key"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        router.shutdown().await;
    }
}
