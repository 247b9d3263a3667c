//! A router that subscribes to an engine's KV events after the engine published some (a router
//! started beside a serving engine, or ZMQ's slow joiner: a SUB socket misses what is published
//! before its subscription reaches the publisher) fetches them from the replay socket once
//! subscribed, even though no later batch ever reveals the gap.

mod common;

use common::*;
use kvmesh_policy::PolicyKind;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_before_the_subscription_reach_the_index() {
    let fleet = kvmesh_sim::start_fleet(1, true, |_| instant_sim_cfg("m"))
        .await
        .expect("fleet");
    let c = client();
    // The engine serves a request with no router subscribed: its events go nowhere.
    let text = "a long shared system prompt that spans many blocks ".repeat(40);
    let direct = post_json(
        &c,
        &format!("{}/v1/chat/completions", fleet.entries[0].url),
        &chat_body("m", &text, 2, false),
    )
    .await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut cfg = serve_cfg(&[]);
    cfg.engines = fleet.entries.clone();
    cfg.routing.policy.policy = PolicyKind::Precise;
    let router = start_router_with(cfg, "m", 1).await;
    // Nothing more is published; the router learns the engine's blocks from its replay socket.
    let mut confirmed = 0.0;
    let mut page = String::new();
    for _ in 0..60 {
        page = get(&c, &format!("{}/metrics", router.base_url())).await.1;
        confirmed = metric(&page, "kvmesh_prefix_index_confirmed_entries");
        if confirmed > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(confirmed > 0.0, "the engine's earlier events reached the index");
    // Counted once its batches are in (the scrape above may have come between the two).
    for _ in 0..20 {
        if metric(&page, "kvmesh_kv_events_catch_ups_total") > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        page = scrape(&c, &router.base_url()).await;
    }
    assert_eq!(
        metric(&page, "kvmesh_kv_events_catch_ups_total"),
        1.0,
        "{page}"
    );
    // The engine is exact (synced from seq 0), not stale: the same prompt is predicted.
    let again = post_json(
        &c,
        &format!("{}/v1/chat/completions", router.base_url()),
        &chat_body("m", &text, 2, false),
    )
    .await;
    assert_eq!(again.status, 200);
    let predicted = again
        .headers
        .get("x-kvmesh-predicted-cached-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(predicted >= 16 * 8, "predicted {predicted}");
    router.shutdown().await;
    stop_sims(fleet.sims).await;
}
