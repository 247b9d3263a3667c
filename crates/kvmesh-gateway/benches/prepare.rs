//! `cargo bench -p kvmesh-gateway --bench prepare`
//!
//! The cache-aware request path before the policy, exactly as `proxy.rs` runs it: parse the
//! JSON body, render the chat template, tokenize (with the per-model piece cache), compute the
//! block keys, look them up. On a ~32 KB multi-turn chat prompt:
//! * `cold`: a piece cache that has never seen the conversation (first request of a chat);
//! * `next_turn`: the previous turn was routed before (its pieces are cached), the new turn
//!   adds one user message — the common case of a chat;
//! * `same`: the exact same body again (retries, siblings).

use criterion::{Criterion, criterion_group, criterion_main};
use kvmesh_config::ServeConfig;
use kvmesh_gateway::prefix::{Endpoint, PrefixState, RoutePrefix, Scratch, prepare};
use kvmesh_policy::PolicyKind;
use kvmesh_tokenize::SegmentCache;
use serde_json::{Value, json};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

const PROSE: &str = "Large language model inference is dominated by the prefill of long prompts. \
A router that knows which engine already holds the KV cache for a prefix can send the request \
there and skip most of that work, but only if it computes exactly the same token ids as the \
engine does, block by block. ";

const CODE: &str = r#"
```rust
fn route(blocks: &[u64], engines: &[Engine]) -> Option<usize> {
    engines.iter().enumerate().max_by_key(|(_, e)| e.matched(blocks)).map(|(i, _)| i)
}
```
"#;

/// A multi-turn conversation of about `target` bytes of message text.
fn conversation(target: usize) -> Vec<Value> {
    let mut messages =
        vec![json!({"role": "system", "content": "You are a senior Rust reviewer."})];
    let mut size = 0;
    let mut turn = 0;
    while size < target {
        let mut user = format!("Review {turn}: ");
        while user.len() < 2500 {
            user.push_str(PROSE);
            user.push_str(CODE);
        }
        let assistant = format!("Turn {turn}: looks good, but consider {PROSE}");
        size += user.len() + assistant.len() + 60;
        messages.push(json!({"role": "user", "content": user}));
        messages.push(json!({"role": "assistant", "content": assistant}));
        turn += 1;
    }
    messages
}

fn body(messages: &[Value], last: &str) -> Vec<u8> {
    let mut m = messages.to_vec();
    m.push(json!({"role": "user", "content": last}));
    serde_json::to_vec(&json!({"model": "m", "messages": m, "stream": true})).expect("json")
}

fn benches(c: &mut Criterion) {
    let cfg = ServeConfig::default();
    let state = PrefixState::new(&cfg);
    let tokenizer = state.tokenizer("").expect("bundled tokenizer");
    let route = |cache: Arc<SegmentCache>| RoutePrefix {
        tokenizer: tokenizer.clone(),
        segments: cache,
        block_size: 16,
        lora_name: None,
        kind: PolicyKind::Precise,
        affinity: Default::default(),
        slot_to_idx: Vec::new(),
    };
    let messages = conversation(32 * 1024);
    let turn1 = body(&messages, "Summarize the review.");
    let mut next = messages.clone();
    next.push(json!({"role": "user", "content": "Summarize the review."}));
    next.push(json!({"role": "assistant", "content": "It is fine."}));
    let turn2 = body(&next, "Now list the three riskiest changes.");
    let mut s = Scratch::default();
    let warm = route(Arc::new(SegmentCache::new(1 << 20)));
    let l = prepare(&state, &warm, Endpoint::Chat, &turn1, 0, &mut s).expect("prepared");
    eprintln!(
        "body {} bytes → {} prompt tokens, {} blocks",
        turn1.len(),
        l.prompt_tokens,
        l.total_blocks
    );
    let mut g = c.benchmark_group("prepare/32KB_chat");
    g.bench_function("cold", |b| {
        b.iter_batched(
            || route(Arc::new(SegmentCache::new(1 << 20))),
            |rp| black_box(prepare(&state, &rp, Endpoint::Chat, &turn1, 0, &mut s)),
            criterion::BatchSize::SmallInput,
        )
    });
    g.bench_function("next_turn", |b| {
        b.iter_batched(
            || {
                let rp = route(Arc::new(SegmentCache::new(1 << 20)));
                prepare(
                    &state,
                    &rp,
                    Endpoint::Chat,
                    &turn1,
                    0,
                    &mut Scratch::default(),
                );
                rp
            },
            |rp| black_box(prepare(&state, &rp, Endpoint::Chat, &turn2, 0, &mut s)),
            criterion::BatchSize::SmallInput,
        )
    });
    g.bench_function("same", |b| {
        b.iter(|| black_box(prepare(&state, &warm, Endpoint::Chat, &turn1, 0, &mut s)))
    });
    g.finish();
}

criterion_group! {
    name = prepare_benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = benches
}
criterion_main!(prepare_benches);
