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

async fn fake_engine(_: Arc<()>, req: Request<Incoming>) -> Response<Body> {
    match req.uri().path() {
        "/v1/models" => json(
            200,
            r#"{"object":"list","data":[{"id":"m","object":"model","created":0,"owned_by":"x"}]}"#
                .to_string(),
        ),
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
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        engines.push(format!("http://{}", l.local_addr().expect("addr")));
        let (tx, rx) = tokio::sync::oneshot::channel();
        stops.push(tx);
        tokio::spawn(kvmesh_http::serve(
            l,
            Arc::new(()),
            fake_engine,
            rx,
            Duration::from_secs(1),
            kvmesh_http::ServeLimits::default(),
        ));
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
