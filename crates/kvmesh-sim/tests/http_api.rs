//! The simulator's HTTP API end to end, in-process on loopback.

mod common;

use common::*;
use serde_json::json;

fn chat(model: &str, text: &str, max_tokens: u32) -> serde_json::Value {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text}
        ],
        "max_tokens": max_tokens
    })
}

async fn prompt_tokens(c: &HttpClient, base: &str, body: &serde_json::Value) -> u64 {
    let (s, v) = post(
        c,
        &format!("{base}/tokenize"),
        json!({"messages": body["messages"]}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v["count"].as_u64().expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_rejected_with_openai_errors_and_changes_nothing() {
    let mut cfg = cfg();
    cfg.max_model_len = 512;
    cfg.max_body_bytes = 16 * 1024;
    let sim = kvmesh_sim::start(cfg).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let url = format!("{base}/v1/chat/completions");
    let before = metrics(&c, &base).await;

    let cases: Vec<(&str, bytes::Bytes, u16, &str)> = vec![
        ("malformed json", "{\"model\": ".into(), 400, "invalid_json"),
        (
            "unknown model",
            chat("nope", "hi", 4).to_string().into(),
            404,
            "model_not_found",
        ),
        (
            "prompt too long",
            chat("sim-model", &long_text(1, 600), 4).to_string().into(),
            400,
            "context_length_exceeded",
        ),
        (
            "max_tokens zero",
            chat("sim-model", "hi", 0).to_string().into(),
            400,
            "invalid_value",
        ),
        (
            "max_tokens negative",
            json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3})
                .to_string()
                .into(),
            400,
            "invalid_value",
        ),
        (
            "invalid utf-8",
            bytes::Bytes::from_static(b"{\"model\":\"sim-model\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"),
            400,
            "invalid_utf8",
        ),
        (
            "body over the limit",
            chat("sim-model", &"x".repeat(20_000), 4).to_string().into(),
            413,
            "body_too_large",
        ),
        (
            "no messages",
            json!({"model": "sim-model", "messages": []}).to_string().into(),
            400,
            "invalid_value",
        ),
        (
            "wrong type",
            json!({"model": "sim-model", "messages": "hello"}).to_string().into(),
            400,
            "invalid_type",
        ),
        (
            "logprobs (the simulator samples from no distribution)",
            json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "logprobs": true})
                .to_string()
                .into(),
            400,
            "invalid_value",
        ),
        (
            "top_logprobs alone",
            json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
                .to_string()
                .into(),
            400,
            "invalid_value",
        ),
    ];
    for (name, body, status, code) in cases {
        let (s, text) = request(&c, "POST", &url, body).await;
        assert_eq!(s, status, "{name}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json error body");
        assert_eq!(v["error"]["code"], code, "{name}: {text}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}"
        );
        assert!(v["error"]["type"].is_string(), "{name}");
    }
    // Completions: token ids out of vocabulary, empty prompt, batch.
    let curl = format!("{base}/v1/completions");
    for (body, code) in [
        (
            json!({"model": "sim-model", "prompt": [1, 2, 999999999]}),
            "invalid_value",
        ),
        (json!({"model": "sim-model", "prompt": ""}), "invalid_value"),
        (
            json!({"model": "sim-model", "prompt": "a", "max_tokens": 0}),
            "invalid_value",
        ),
        (
            json!({"model": "sim-model", "prompt": "a", "n": 3}),
            "invalid_value",
        ),
        (
            json!({"model": "sim-model", "prompt": "a", "logprobs": 0}),
            "invalid_value",
        ),
    ] {
        let (s, v) = post(&c, &curl, body.clone()).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], code, "{body}: {v}");
    }
    let (s, _) = request(&c, "GET", &url, bytes::Bytes::new()).await;
    assert_eq!(s, 405);
    let (s, _) = get(&c, &format!("{base}/nope")).await;
    assert_eq!(s, 404);

    // Nothing reached the engine.
    let after = metrics(&c, &base).await;
    for m in [
        "vllm:prefix_cache_queries_total",
        "vllm:prompt_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    ] {
        assert_eq!(metric(&before, m), metric(&after, m), "{m}");
    }
    let (_, cache) = get(&c, &format!("{base}/admin/kv_cache")).await;
    let cache: serde_json::Value = serde_json::from_str(&cache).expect("json");
    assert_eq!(cache["blocks"].as_array().map(Vec::len), Some(0));

    // And the server still serves.
    let (s, v) = post(&c, &url, chat("sim-model", "hello there", 3)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    sim.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_chat_hits_the_prefix_cache_and_is_faster_by_the_prefill_cost() {
    let cfg = cfg();
    let profile = kvmesh_engine::TimingProfile::by_name(&cfg.engine.profile).expect("profile");
    let block = cfg.engine.block_size as u64;
    let sim = kvmesh_sim::start(cfg).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let body = chat("sim-model", &long_text(7, 1900), 4);
    let n = prompt_tokens(&c, &base, &body).await;
    assert!((1900..2600).contains(&n), "prompt of {n} tokens");
    let url = format!("{base}/v1/chat/completions");

    let m0 = metrics(&c, &base).await;
    let (s, v1) = post(&c, &url, body.clone()).await;
    assert_eq!(s, 200, "{v1}");
    assert_eq!(v1["usage"]["prompt_tokens"].as_u64(), Some(n));
    assert_eq!(v1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let m1 = metrics(&c, &base).await;
    let (s, v2) = post(&c, &url, body.clone()).await;
    assert_eq!(s, 200, "{v2}");
    let m2 = metrics(&c, &base).await;

    // vLLM always computes the last prompt token: every full block before it is a hit.
    let expected_hits = (n - 1) / block * block;
    let hits = |a: &str, b: &str| {
        metric(b, "vllm:prefix_cache_hits_total") - metric(a, "vllm:prefix_cache_hits_total")
    };
    assert_eq!(hits(&m0, &m1), 0.0);
    assert_eq!(hits(&m1, &m2), expected_hits as f64);
    assert_eq!(
        v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(expected_hits)
    );
    let q = metric(&m2, "vllm:prefix_cache_queries_total");
    assert_eq!(q, 2.0 * n as f64);

    // TTFT (simulated seconds) of each request, from the histogram sums.
    let ttft = |a: &str, b: &str| {
        metric(b, "vllm:time_to_first_token_seconds_sum")
            - metric(a, "vllm:time_to_first_token_seconds_sum")
    };
    let (t1, t2) = (ttft(&m0, &m1), ttft(&m1, &m2));
    let shape = |computed: u64, context: u64| kvmesh_engine::BatchShape {
        prefill_tokens: computed,
        prefill_attention_pairs: computed * context + computed * computed / 2,
        decode_seqs: 0,
        decode_context_tokens: 0,
    };
    let full = profile.step_micros(&shape(n, 0)) / 1e6;
    let cached = profile.step_micros(&shape(n - expected_hits, expected_hits)) / 1e6;
    let saved = full - cached;
    assert!(t2 < t1, "second TTFT {t2} not below first {t1}");
    let measured = t1 - t2;
    assert!(
        (measured - saved).abs() <= 0.05 * saved + 0.001,
        "TTFT saving {measured:.4}s, profile predicts {saved:.4}s (t1 {t1:.4}, t2 {t2:.4})"
    );
    sim.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_larger_than_the_cache_evicts_and_misses_later() {
    let mut cfg = cfg();
    cfg.engine.num_blocks = 96; // 1,536 tokens
    cfg.max_model_len = 1024;
    let sim = kvmesh_sim::start(cfg).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let url = format!("{base}/v1/completions");
    let prompt =
        |i: u64| json!({"model": "sim-model", "prompt": long_text(100 + i, 500), "max_tokens": 2});
    for i in 0..6 {
        let (s, v) = post(&c, &url, prompt(i)).await;
        assert_eq!(s, 200, "{v}");
    }
    // The first prompt's blocks were evicted by the later ones: a miss now.
    let (s, v) = post(&c, &url, prompt(0)).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{v}"
    );
    // The last one is still cached: a hit.
    let (s, v) = post(&c, &url, prompt(5)).await;
    assert_eq!(s, 200, "{v}");
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{v}"
    );
    let page = metrics(&c, &base).await;
    assert!(metric(&page, "vllm:kv_cache_usage_perc") <= 1.0);
    sim.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_tokenize_and_streaming_shapes() {
    let sim = kvmesh_sim::start(cfg()).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let (s, b) = get(&c, &format!("{base}/health")).await;
    assert_eq!((s, b.as_str()), (200, ""));
    let (s, b) = get(&c, &format!("{base}/v1/models")).await;
    assert_eq!(s, 200);
    let v: serde_json::Value = serde_json::from_str(&b).expect("json");
    assert_eq!(v["data"][0]["id"], "sim-model");
    assert_eq!(v["data"][0]["max_model_len"], 32768);

    // Streaming chat with usage: role first, deltas, finish, usage, [DONE].
    let body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 12,
        "stream": true,
        "stream_options": {"include_usage": true}
    });
    let (s, text) = request(
        &c,
        "POST",
        &format!("{base}/v1/chat/completions"),
        body.to_string(),
    )
    .await;
    assert_eq!(s, 200);
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("data event"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    let finish: Vec<_> = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"] == "length")
        .collect();
    assert_eq!(finish.len(), 1);
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.is_empty());
    // The streamed text equals the detokenized tokens: stream again without streaming.
    let (s, whole) = post(
        &c,
        &format!("{base}/v1/completions"),
        json!({"model": "sim-model", "prompt": [1, 2, 3, 4], "max_tokens": 5, "echo": false}),
    )
    .await;
    assert_eq!(s, 200, "{whole}");
    assert_eq!(whole["usage"]["prompt_tokens"], 4);
    assert_eq!(whole["usage"]["completion_tokens"], 5);
    assert_eq!(whole["object"], "text_completion");
    sim.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapters_are_listed_served_and_hashed_apart() {
    let mut c0 = cfg();
    c0.lora_modules = vec!["ad-1".into()];
    let sim = kvmesh_sim::start(c0).await.expect("start");
    let base = sim.base_url();
    let c = client();
    let (s, b) = get(&c, &format!("{base}/v1/models")).await;
    assert_eq!(s, 200);
    let v: serde_json::Value = serde_json::from_str(&b).expect("json");
    assert_eq!(v["data"][0]["id"], "sim-model");
    assert!(v["data"][0].get("parent").is_none(), "{v}");
    assert_eq!(v["data"][1]["id"], "ad-1");
    assert_eq!(v["data"][1]["parent"], "sim-model");

    let prompt = long_text(3, 400);
    let ask = |model: &str| json!({"model": model, "prompt": prompt, "max_tokens": 2}).to_string();
    let url = format!("{base}/v1/completions");
    let (s, b) = request(&c, "POST", &url, ask("ad-1")).await;
    assert_eq!(s, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).expect("json");
    assert_eq!(v["model"], "ad-1");
    // The same prompt under the base model does not hit the adapter's blocks; under the
    // adapter again it does.
    let cached = |b: &str| {
        let v: serde_json::Value = serde_json::from_str(b).expect("json");
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    };
    let (s, b) = request(&c, "POST", &url, ask("sim-model")).await;
    assert_eq!((s, cached(&b)), (200, 0), "{b}");
    let (s, b) = request(&c, "POST", &url, ask("ad-1")).await;
    assert_eq!(s, 200);
    assert!(cached(&b) > 0, "{b}");
    let (s, _) = request(&c, "POST", &url, ask("ad-2")).await;
    assert_eq!(s, 404);
    sim.shutdown(std::time::Duration::from_secs(5)).await;
}
