//! A request retried on another engine is remembered where it was served: under
//! `cache_aware` (the router's own decisions are all it knows of the engines' caches) the
//! engine that computed the prompt is the one the conversation's next turn can find it on.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_request_is_remembered_on_the_engine_that_served_it() {
    let sims = start_sims(2, |_| instant_sim_cfg("m")).await;
    let (router, engines) = cache_aware_router(&sims).await;
    let base = router.base_url();
    let chat = format!("{base}/v1/chat/completions");
    let c = client();
    let system = "a long system prompt that every turn of this conversation shares ".repeat(12);
    let turn = |n: usize| {
        let mut messages = vec![json!({"role": "system", "content": system})];
        for i in 0..n {
            messages.push(
                json!({"role": "user", "content": format!("question {i} of the conversation")}),
            );
            messages.push(json!({"role": "assistant", "content": format!("answer {i}")}));
        }
        messages.push(json!({"role": "user", "content": format!("question {n}")}));
        json!({"model": "m", "messages": messages, "max_tokens": 2})
    };

    // Turn 1: some engine computes the prompt and is marked with it.
    let r = post_json(&c, &chat, &turn(0)).await;
    assert!(r.ok(), "{r:?}");
    let home = r.engine.clone().expect("x-kvmesh-engine");
    let other = engines
        .iter()
        .find(|e| **e != home)
        .expect("two engines")
        .clone();
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_index_entries", &other),
        0.0,
        "only the engine that served holds the prompt"
    );

    // Turn 2 goes where the prefix is; that engine fails; the retry's engine computes it.
    set_faults(&c, &home, json!({"error_rate": 1.0, "error_status": 503})).await;
    let r = post_json(&c, &chat, &turn(1)).await;
    assert!(r.ok(), "{r:?}");
    assert_eq!(
        r.engine.as_deref(),
        Some(other.as_str()),
        "retried elsewhere"
    );
    wait_until(
        "the engine that served the retry is marked with the prompt",
        Duration::from_secs(5),
        || async {
            let page = scrape(&c, &base).await;
            engine_metric(&page, "kvmesh_engine_index_entries", &other) > 0.0
        },
    )
    .await;

    // Turn 3 (its first engine still failing, so served by the other whichever the policy
    // tries first): the router predicts what that engine really has cached.
    let r = post_json(&c, &chat, &turn(2)).await;
    assert!(r.ok(), "{r:?}");
    assert_eq!(r.engine.as_deref(), Some(other.as_str()));
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let predicted = predicted_tokens(&r);
    assert!(cached > 0, "the engine had turn 2 cached: {}", r.body);
    assert!(
        predicted > 0 && predicted <= cached,
        "predicted {predicted} against {cached} cached"
    );
    clear_faults(&c, &home).await;
    router.shutdown().await;
    stop_sims(sims).await;
}
