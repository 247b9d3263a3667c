//! A router that subscribes to an engine's KV events after the engine published some (a router
//! started beside a serving engine, or ZMQ's slow joiner: a SUB socket misses what is published
//! before its subscription reaches the publisher) fetches them from the replay socket once
//! subscribed, even though no later batch ever reveals the gap; and after a restart seen by
//! the new process start time, it reads what the new process published before, from seq 0.

mod common;

use common::*;
use kvmesh_config::ModelConfig;
use kvmesh_policy::PolicyKind;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_before_the_subscription_reach_the_index() {
    caught_up("m", 16).await;
}

/// The same with a model of its own block size that the router learns only from discovery
/// (the catch-up may run before any live batch: it must use the discovered size too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caught_up_events_use_the_discovered_models_block_size() {
    caught_up("m32", 32).await;
}

async fn caught_up(model: &str, block_size: u32) {
    let fleet = kvmesh_sim::start_fleet(1, true, |_| {
        let mut c = instant_sim_cfg(model);
        c.engine.block_size = block_size;
        c
    })
    .await
    .expect("fleet");
    let c = client();
    // The engine serves a request with no router subscribed: its events go nowhere.
    let text = "a long shared system prompt that spans many blocks ".repeat(40);
    let direct = post_json(
        &c,
        &format!("{}/v1/chat/completions", fleet.entries[0].url),
        &chat_body(model, &text, 2, false),
    )
    .await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    let replay_ep = fleet.entries[0].kv_replay.clone();
    wait_until(
        "the engine published its events",
        Duration::from_secs(5),
        || async {
            kvmesh_kvevents::replay(&replay_ep, 0, Duration::from_secs(1))
                .await
                .is_ok_and(|b| !b.is_empty())
        },
    )
    .await;

    let mut cfg = serve_cfg(&[]);
    cfg.engines = fleet.entries.clone();
    cfg.routing.policy.policy = PolicyKind::Precise;
    assert!(
        cfg.engines[0].models.is_empty(),
        "the model comes from discovery"
    );
    cfg.models.insert(
        model.into(),
        ModelConfig {
            block_size: Some(block_size),
            ..ModelConfig::default()
        },
    );
    let router = start_router_with(cfg, model, 1).await;
    // Nothing more is published; the router learns the engine's blocks from its replay socket.
    let base = router.base_url();
    wait_until(
        "the engine's earlier events reached the index",
        Duration::from_secs(5),
        || async {
            let page = scrape(&c, &base).await;
            metric(&page, "kvmesh_prefix_index_confirmed_entries") > 0.0
                && metric(&page, "kvmesh_kv_events_catch_ups_total") > 0.0
        },
    )
    .await;
    let page = scrape(&c, &base).await;
    assert_eq!(
        metric(&page, "kvmesh_kv_events_catch_ups_total"),
        1.0,
        "{page}"
    );
    // The engine is exact (synced from seq 0), not stale: the same prompt is predicted.
    let again = post_json(
        &c,
        &format!("{}/v1/chat/completions", router.base_url()),
        &chat_body(model, &text, 2, false),
    )
    .await;
    assert_eq!(again.status, 200);
    let predicted = predicted_tokens(&again);
    assert!(
        predicted >= 8 * u64::from(block_size),
        "predicted {predicted}"
    );
    assert_eq!(predicted % u64::from(block_size), 0);
    router.shutdown().await;
    stop_sims(fleet.sims).await;
}

/// An engine restarted twice, the first time idle. The router's probe sees each new process
/// start time; the second one only after the new process's first batch was applied (that
/// batch, seq 0 after the first restart's clear, starts no epoch of its own). The clear that
/// hint makes is followed by a catch-up from seq 0, so the router holds what the engine holds
/// (QA: it held nothing until the engine's next batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_seen_after_the_new_process_s_first_batch_keeps_its_blocks() {
    let fleet = kvmesh_sim::start_fleet(1, true, |_| instant_sim_cfg("m"))
        .await
        .expect("fleet");
    let c = client();
    let mut cfg = serve_cfg(&[]);
    cfg.engines = fleet.entries.clone();
    cfg.routing.policy.policy = PolicyKind::Precise;
    // A second between reads of the engine's page: the new process's first batch comes well
    // before the next one.
    cfg.discovery_interval_ms = 1_000;
    let router = start_router_with(cfg, "m", 1).await;
    let base = router.base_url();
    let url = fleet.entries[0].url.clone();
    let restart = || async {
        let r = post_json(&c, &format!("{url}/admin/restart"), &serde_json::json!({})).await;
        assert_eq!(r.status, 200, "{}", r.body);
    };
    let seen = |n: f64| {
        let (c, base) = (&c, &base);
        move || async move { metric(&scrape(c, base).await, "kvmesh_kv_events_restarts_total") >= n }
    };
    restart().await;
    wait_until(
        "the idle restart is seen",
        Duration::from_secs(6),
        seen(1.0),
    )
    .await;
    // Past the next reads, which take the epoch the first restart began as their reference.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    restart().await;
    let text = "a long shared system prompt that spans many blocks ".repeat(40);
    let direct = post_json(
        &c,
        &format!("{url}/v1/chat/completions"),
        &chat_body("m", &text, 2, false),
    )
    .await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    wait_until(
        "the second restart is seen",
        Duration::from_secs(6),
        seen(2.0),
    )
    .await;
    wait_until(
        "the new process's blocks are in the index",
        Duration::from_secs(3),
        || async {
            metric(
                &scrape(&c, &base).await,
                "kvmesh_prefix_index_confirmed_entries",
            ) > 0.0
        },
    )
    .await;
    let again = post_json(
        &c,
        &format!("{base}/v1/chat/completions"),
        &chat_body("m", &text, 2, false),
    )
    .await;
    assert_eq!(again.status, 200);
    assert!(predicted_tokens(&again) >= 8 * 16, "{:?}", again.headers);
    router.shutdown().await;
    stop_sims(fleet.sims).await;
}
