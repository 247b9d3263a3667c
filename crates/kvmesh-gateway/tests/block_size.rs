//! Regression: an engine whose model is only known from discovery (no `models` in its entry,
//! as DNS-found engines always are) and whose model has its own block size
//! (`[serve.models."M"] block_size`) gets its KV events applied. The ingestion used to fix its
//! block size when it started, before discovery, and skipped every event as the wrong size.

mod common;

use common::*;
use kvmesh_config::ModelConfig;
use kvmesh_policy::PolicyKind;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_models_block_size_applies_to_its_events() {
    let fleet = kvmesh_sim::start_fleet(1, true, |_| {
        let mut c = instant_sim_cfg("m32");
        c.engine.block_size = 32;
        c
    })
    .await
    .expect("fleet");
    let mut cfg = serve_cfg(&[]);
    cfg.engines = fleet.entries.clone();
    assert!(
        cfg.engines[0].models.is_empty(),
        "the model comes from discovery"
    );
    cfg.routing.policy.policy = PolicyKind::Precise;
    // Short marks: the follow-up can only be predicted from the events once they expire.
    cfg.prefix.speculative_ttl_ms = 200;
    cfg.models.insert(
        "m32".into(),
        ModelConfig {
            block_size: Some(32),
            ..ModelConfig::default()
        },
    );
    let router = start_router_with(cfg, "m32", 1).await;
    let c = client();
    let chat = format!("{}/v1/chat/completions", router.base_url());
    let text = "a long shared system prompt that spans many blocks ".repeat(40);
    let first = post_json(&c, &chat, &chat_body("m32", &text, 2, false)).await;
    assert_eq!(first.status, 200, "{}", first.body);
    // The engine's events for the first prompt arrive (the index holds confirmed entries);
    // then, once the first request's speculative mark (200 ms here: the events are live) has
    // expired, the same prompt can only be predicted from the events.
    let mut confirmed = 0.0;
    for _ in 0..100 {
        let page = get(&c, &format!("{}/metrics", router.base_url())).await.1;
        confirmed = metric(&page, "kvmesh_prefix_index_confirmed_entries");
        if confirmed > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(confirmed > 0.0, "the engine's events reached the index");
    tokio::time::sleep(Duration::from_millis(250)).await;
    let again = post_json(&c, &chat, &chat_body("m32", &text, 2, false)).await;
    assert_eq!(again.status, 200);
    let predicted = predicted_tokens(&again);
    assert!(
        predicted >= 32,
        "the events were applied: predicted {predicted}"
    );
    assert_eq!(predicted % 32, 0, "in blocks of the model's size");
    let page = get(&c, &format!("{}/metrics", router.base_url())).await.1;
    assert!(
        page.contains("kvmesh_kv_events_skipped_block_size_total{"),
        "{page}"
    );
    let skipped = metric(&page, "kvmesh_kv_events_skipped_block_size_total");
    assert_eq!(skipped, 0.0, "{page}");
    router.shutdown().await;
    stop_sims(fleet.sims).await;
}
