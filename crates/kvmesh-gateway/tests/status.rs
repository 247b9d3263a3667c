//! The status page's data in process: `GET /` is the compiled-in page (HTML, no external
//! asset), `GET /status.json` lists the engines and the last routing decisions, newest
//! first, with their reason and, for a cache-aware route, the prompt and predicted cached
//! tokens; the ring stays bounded.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_shows_engines_and_the_last_decisions() {
    let sims = start_sims(2, |_| instant_sim_cfg("m")).await;
    let (router, engines) = cache_aware_router(&sims).await;
    let base = router.base_url();
    let c = client();

    let (status, page) = get(&c, &format!("{base}/")).await;
    assert_eq!(status, 200);
    assert!(page.starts_with("<!doctype html>"), "{page}");
    assert!(!page.contains("src=\"http") && !page.contains("href=\"http"));

    let (_, body) = get(&c, &format!("{base}/status.json")).await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["policy"], "cache_aware");
    assert_eq!(v["model_policies"], serde_json::json!({}));
    assert_eq!(v["mesh"], false);
    let listed: Vec<&str> = v["engines"]
        .as_array()
        .expect("engines")
        .iter()
        .filter_map(|e| e["url"].as_str())
        .collect();
    let mut want: Vec<&str> = engines.iter().map(String::as_str).collect();
    want.sort();
    assert_eq!(listed, want);
    assert_eq!(v["recent"].as_array().map(Vec::len), Some(0));
    // Failed attempts and weights are on the page (QA: an engine failing every request
    // looked like a good one there).
    for e in v["engines"].as_array().expect("engines") {
        assert_eq!(e["errors"], 0, "{e}");
        assert_eq!(e["weight"], 1.0, "{e}");
        let w = e["effective_weight"].as_f64().expect("effective weight");
        assert!(w > 0.0 && w <= 1.0, "{e}");
    }
    assert!(page.contains("failed") && page.contains("e.effective_weight"));

    // The same long prompt twice, then a short one: three decisions, newest first.
    let long = "the same system prompt ".repeat(60);
    for text in [long.as_str(), long.as_str(), "short"] {
        let r = post_json(
            &c,
            &format!("{base}/v1/chat/completions"),
            &chat_body("m", text, 2, false),
        )
        .await;
        assert!(r.ok(), "{r:?}");
    }
    let (_, body) = get(&c, &format!("{base}/status.json")).await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    let recent = v["recent"].as_array().expect("recent");
    assert_eq!(recent.len(), 3, "{v}");
    assert_eq!(v["decisions"], 3);
    for d in recent {
        assert_eq!(d["model"], "m");
        assert!(engines.iter().any(|e| d["engine"] == e.as_str()), "{d}");
        assert!(d["reason"].as_str().is_some_and(|r| !r.is_empty()), "{d}");
    }
    let short = recent[0]["prompt_tokens"].as_u64().expect("tokens");
    let second = recent[1]["prompt_tokens"].as_u64().expect("tokens");
    assert!(second > short, "newest first: {recent:?}");
    // The repeat was routed to where the first one went, for its cached prefix.
    assert_eq!(recent[1]["engine"], recent[2]["engine"], "{recent:?}");
    assert!(
        recent[1]["predicted_cached_tokens"].as_u64() > Some(0),
        "{recent:?}"
    );
    assert_eq!(recent[2]["predicted_cached_tokens"], 0, "{recent:?}");

    router.shutdown().await;
    stop_sims(sims).await;
}

/// A model's own policy overrides the default one: `/status.json` says which (QA33: with
/// `--policy round_robin` over a file giving the model `precise`, it named round_robin alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_names_the_models_own_policies() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let mut cfg = serve_cfg(&urls(&sims));
    cfg.routing.policy.policy = kvmesh_policy::PolicyKind::RoundRobin;
    let own = kvmesh_policy::PolicyConfig {
        policy: kvmesh_policy::PolicyKind::LeastRequest,
        ..Default::default()
    };
    cfg.models.insert(
        "m".into(),
        kvmesh_config::ModelConfig {
            policy: Some(own),
            ..Default::default()
        },
    );
    let router = start_router_with(cfg, "m", 1).await;
    let (_, body) = get(&client(), &format!("{}/status.json", router.base_url())).await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["policy"], "round_robin");
    assert_eq!(
        v["model_policies"],
        serde_json::json!({ "m": "least_request" })
    );
    router.shutdown().await;
    stop_sims(sims).await;
}
