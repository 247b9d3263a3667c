//! A request no engine would serve changes nothing on a cache-aware route: what every
//! OpenAI server rejects (no messages, `max_tokens` below 1, `n` below 1) is answered by the
//! router itself before any decision — no speculative entry, no attempt; and what the engine
//! refuses (a prompt past its context, a parameter it does not serve) is passed through with
//! the engine's own 4xx, its routing mark taken back, and left out of the prompt and
//! predicted-token figures and of the engine's latency.

mod common;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_no_engine_serves_leave_the_index_and_the_figures_alone() {
    let sims = start_sims(2, |_| {
        let mut c = instant_sim_cfg("m");
        c.max_model_len = 512;
        c
    })
    .await;
    let (router, engines) = cache_aware_router(&sims).await;
    let base = router.base_url();
    let chat = format!("{base}/v1/chat/completions");
    let c = client();
    let long = "a prompt no engine serves ".repeat(40);

    let page = scrape(&c, &base).await;
    let entries = metric(&page, "kvmesh_prefix_index_speculative_entries");
    assert_eq!(entries, 0.0, "a fresh index");

    // What every OpenAI server rejects: the router's own 400, naming the parameter.
    for (body, param) in [
        (
            json!({"model": "m", "messages": [{"role": "user", "content": long}], "max_tokens": 0}),
            "max_tokens",
        ),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": long}], "max_completion_tokens": -5}),
            "max_completion_tokens",
        ),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": long}], "n": 0}),
            "n",
        ),
        (json!({"model": "m", "messages": []}), "messages"),
        (
            json!({"model": "m", "messages": [{"content": long}]}),
            "messages",
        ),
    ] {
        let r = post_json(&c, &chat, &body).await;
        let v = assert_openai_error(&r, 400);
        assert_eq!(v["error"]["param"], param, "{}", r.body);
        assert!(r.engine.is_none(), "answered by the router: {r:?}");
    }
    // `n` above 1 is an engine's to serve or refuse (vLLM serves it; the simulator refuses).
    // The decision marked the engine with the prompt; the refusal takes the mark back (QA:
    // the same prompt was then predicted 704 tokens cached where the engine had none).
    let r = post_json(
        &c,
        &chat,
        &json!({"model": "m", "messages": [{"role": "user", "content": long}], "n": 2}),
    )
    .await;
    assert_openai_error(&r, 400);
    assert!(r.engine.is_some(), "the engine's refusal: {r:?}");
    wait_until(
        "the refused request's mark is taken back",
        std::time::Duration::from_secs(5),
        || async {
            let page = scrape(&c, &base).await;
            metric(&page, "kvmesh_prefix_index_speculative_entries") == 0.0
        },
    )
    .await;

    // What the engine refuses: a prompt past its context (512 tokens here).
    let too_long = "far too long for this engine ".repeat(200);
    let r = post_json(&c, &chat, &chat_body("m", &too_long, 2, false)).await;
    assert_openai_error(&r, 400);
    assert!(r.engine.is_some(), "passed through: {r:?}");
    // Longer than every engine's context (as they list it): not remembered as cached there
    // (QA: the same prompt was then predicted 3,520 tokens cached where the engine had 0).
    let page = scrape(&c, &base).await;
    assert_eq!(
        metric(&page, "kvmesh_prefix_index_speculative_entries"),
        0.0,
        "no mark for a prompt every engine refuses"
    );

    let page = scrape(&c, &base).await;
    let sent: f64 = attempts(&page, &engines).iter().sum();
    assert_eq!(sent, 2.0, "only the two the engines refused were sent");
    for e in &engines {
        assert_eq!(
            engine_metric(&page, "kvmesh_engine_prompt_tokens_total", e),
            0.0,
            "{e}: refused prompts are not counted as served"
        );
        assert_eq!(
            engine_metric(&page, "kvmesh_engine_predicted_cached_tokens_total", e),
            0.0
        );
    }

    // A request that is served is counted as before.
    let r = post_json(
        &c,
        &chat,
        &chat_body("m", "a prompt an engine serves", 2, false),
    )
    .await;
    assert!(r.ok(), "{r:?}");
    let page = scrape(&c, &base).await;
    let served: f64 = engines
        .iter()
        .map(|e| engine_metric(&page, "kvmesh_engine_prompt_tokens_total", e))
        .sum();
    assert!(served > 0.0, "the served prompt is counted");
    stop_sims(sims).await;
}

/// A refused request whose prompt extends one an engine served: the decision found the
/// engine holding the served prompt's blocks (marked by the earlier decision) and extended
/// their marks; the refusal takes back only the blocks it marked anew, and the served
/// prompt's stay (the unmark used to drop every key of the refused prompt with its expiry,
/// the served prompt's marks it had extended among them: the engine was taken for holding
/// nothing of what it had just computed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_leaves_the_marks_of_what_was_served_before_it() {
    let sims = start_sims(2, |_| instant_sim_cfg("m")).await;
    let (router, engines) = cache_aware_router(&sims).await;
    let base = router.base_url();
    let chat = format!("{base}/v1/chat/completions");
    let c = client();
    let system = "a long shared system prompt that an engine serves first ".repeat(30);
    let served = json!({"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "the first question"},
    ]});
    let r = post_json(&c, &chat, &served).await;
    assert!(r.ok(), "{r:?}");
    let marked = metric(
        &scrape(&c, &base).await,
        "kvmesh_prefix_index_speculative_entries",
    );
    assert!(marked > 0.0, "the served prompt is marked");

    // The same conversation, one turn on, with a parameter the simulator refuses.
    let refused = json!({"model": "m", "max_tokens": 2, "n": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "the first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "a second question, with some more words to it"},
    ]});
    let r = post_json(&c, &chat, &refused).await;
    assert_openai_error(&r, 400);
    assert!(r.engine.is_some(), "the engine's refusal: {r:?}");
    // Its new blocks go (the count falls back, off the request's path); the served prompt's
    // stay, extended or not.
    wait_until(
        "the refused request's new blocks are taken back, the served prompt's kept",
        std::time::Duration::from_secs(5),
        || async {
            let page = scrape(&c, &base).await;
            metric(&page, "kvmesh_prefix_index_speculative_entries") == marked
        },
    )
    .await;
    // And a follow-up of the served prompt is still predicted cached.
    let r = post_json(&c, &chat, &served).await;
    assert!(r.ok(), "{r:?}");
    let page = scrape(&c, &base).await;
    let predicted: f64 = engines
        .iter()
        .map(|e| engine_metric(&page, "kvmesh_engine_predicted_cached_tokens_total", e))
        .sum();
    assert!(
        predicted > 0.0,
        "the served prompt's follow-up predicted cached"
    );
    stop_sims(sims).await;
}

/// Identical requests sent together, all refused: the first decision marks the prompt
/// anew; the others find it marked (by a decision whose engine has not answered yet) and
/// extend the marks. Every refusal must still leave the engine holding nothing (QA: with
/// two such requests 14 of the marks stayed, and the next turn was predicted 3,104 tokens
/// cached where the engine had none — the first refusal found its marks extended by a later
/// decision and left them; the later ones took them for held before them and left them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_requests_refused_together_leave_no_marks() {
    let sims = start_sims(1, |_| {
        let mut c = instant_sim_cfg("m");
        // Every request waits, then is refused: all the decisions are made before the
        // first answer.
        c.faults.error_rate = 1.0;
        c.faults.error_status = 400;
        c.faults.added_latency_ms = 400;
        c
    })
    .await;
    let (router, engines) = cache_aware_router(&sims).await;
    let base = router.base_url();
    let chat = format!("{base}/v1/chat/completions");
    let c = client();
    let body = chat_body(
        "m",
        &"a prompt sent four times at once ".repeat(40),
        2,
        false,
    );
    let replies = futures::future::join_all((0..4).map(|_| post_json(&c, &chat, &body))).await;
    for r in &replies {
        assert_openai_error(r, 400);
        assert!(r.engine.is_some(), "the engine's refusal: {r:?}");
    }
    wait_until(
        "every refused request's marks are taken back",
        std::time::Duration::from_secs(5),
        || async {
            let page = scrape(&c, &base).await;
            metric(&page, "kvmesh_prefix_index_speculative_entries") == 0.0
        },
    )
    .await;
    let page = scrape(&c, &base).await;
    assert_eq!(
        attempts(&page, &engines).iter().sum::<f64>(),
        4.0,
        "each sent once"
    );
    stop_sims(sims).await;
}
