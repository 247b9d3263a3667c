//! Engines of one model with different context lengths (`--max-model-len`): a request that
//! only the longer engines can hold is routed to one of them, where a shorter engine would
//! refuse it with vLLM's 400; requests that fit everywhere still reach the shorter engine;
//! a request too long for every engine gets the 400 of an engine of the longest context.

mod common;

use common::*;
use kvmesh_policy::PolicyKind;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_too_long_for_some_engines_goes_to_one_that_holds_it() {
    // Engine 0 holds 512 tokens, engine 1 4,096.
    let sims = start_sims(2, |i| {
        let mut c = instant_sim_cfg("m");
        c.max_model_len = if i == 0 { 512 } else { 4096 };
        c
    })
    .await;
    let (router, engines) = cache_aware_router(&sims).await;
    let base = router.base_url();
    let chat = format!("{base}/v1/chat/completions");
    let completions = format!("{base}/v1/completions");
    let c = client();
    let served_by = |r: &Reply| r.engine.clone().unwrap_or_default();

    // About 1,000 prompt tokens each, every prompt new (no cached prefix draws it anywhere).
    for i in 0..12 {
        let text = format!("conversation {i}: {}", "a long question ".repeat(300));
        let r = post_json(&c, &chat, &chat_body("m", &text, 8, false)).await;
        assert!(r.ok(), "request {i}: {r:?}");
        assert_eq!(served_by(&r), engines[1], "request {i}");
        let r = post_json(&c, &completions, &completion_body("m", &text, 8, false)).await;
        assert!(r.ok(), "completion {i}: {r:?}");
        assert_eq!(served_by(&r), engines[1], "completion {i}");
    }
    // A short prompt whose completion would pass 512 tokens: counted with its `max_tokens`.
    for i in 0..8 {
        let text = format!("short {i}");
        let r = post_json(&c, &chat, &chat_body("m", &text, 600, false)).await;
        assert!(r.ok(), "request {i}: {r:?}");
        assert_eq!(served_by(&r), engines[1], "request {i} with max_tokens 600");
    }
    // Requests that fit both engines still go to the shorter one as well.
    let mut on_short = 0;
    for i in 0..24 {
        let r = post_json(&c, &chat, &chat_body("m", &format!("hello {i}"), 4, false)).await;
        assert!(r.ok(), "short request {i}: {r:?}");
        on_short += usize::from(served_by(&r) == engines[0]);
    }
    assert!(on_short > 0, "no short request reached the shorter engine");
    // Too long for every engine: the refusal of an engine of the longest context, passed
    // through (it names the longest window there is; QA saw the shorter one's).
    for i in 0..6 {
        let text = format!("{i} far too long for any engine ").repeat(1000);
        let r = post_json(
            &c,
            &chat,
            &json!({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}),
        )
        .await;
        let v = assert_openai_error(&r, 400);
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("maximum context length is 4096")),
            "{}",
            r.body
        );
        assert_eq!(served_by(&r), engines[1], "passed through: {r:?}");
    }
    // /v1/models gives the length a client can send: the longest here, where each request
    // goes to an engine that holds it; the shortest on a route that does not read prompts.
    let context = |base: String| {
        let c = c.clone();
        async move {
            let (status, body) = get(&c, &format!("{base}/v1/models")).await;
            assert_eq!(status, 200, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).expect("json");
            v["data"][0]["max_model_len"].as_u64()
        }
    };
    assert_eq!(context(base.clone()).await, Some(4096));
    let mut cfg = serve_cfg(&engines);
    cfg.routing.policy.policy = PolicyKind::RoundRobin;
    let rr = start_router_with(cfg, "m", 2).await;
    assert_eq!(context(rr.base_url()).await, Some(512));
    stop_sims(sims).await;
}
