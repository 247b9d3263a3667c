//! `cargo bench -p kvmesh-gateway --bench prepare`
//!
//! The cache-aware request path before the policy, exactly as `proxy.rs` runs it
//! ([`prepare`]: parse the JSON body, render the chat template, tokenize with the per-model
//! piece cache, compute the block keys, look them up in an empty index), on multi-turn chat
//! bodies of about 1, 8, 32 and 128 KB of message text:
//! * `cold/<size>`: caches that have never seen the conversation (first request of a chat);
//! * `unique/<size>`: warm caches (the conversation so far was routed before), and a last user
//!   message never seen (a new prompt of an ongoing chat, or a unique 1 KB prompt under a
//!   known system prompt);
//! * `next_turn/<size>`: the previous turn (the same messages and the last user message) was
//!   routed, the new body adds the assistant's answer and a new user message — the common case
//!   of a chat;
//! * `same/<size>`: the exact same body again (retries, siblings).
//!
//! `phases/32KB` splits `same/32KB` into its steps (parse, render, tokenize with every piece
//! cached, block keys).
//!
//! `mark/<open>`: the decision's speculative mark as `proxy.rs` makes it after the decision
//! (a 512-block prompt of which 500 were found held, under the index's write lock, then its
//! hold dropped as the answer settles it), with 0 and 96 other decisions awaiting their
//! engine's answer across 8 engines (the ledger of `prefix::pending`).

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvmesh_config::ServeConfig;
use kvmesh_gateway::memo::PromptMemo;
use kvmesh_gateway::prefix::{Endpoint, ParsedRequest, PrefixState, RoutePrefix, Scratch, prepare};
use kvmesh_policy::PolicyKind;
use kvmesh_prefix::{BlockKey, EngineId, ExtraKeys, Target, block_keys};
use kvmesh_tokenize::{ChatRenderRequest, SegmentCache};
use serde_json::json;
use std::cell::Cell;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

#[path = "common/chat.rs"]
mod chat;
use chat::{body, conversation};

fn benches(c: &mut Criterion) {
    let cfg = ServeConfig::default();
    let state = PrefixState::new(&cfg);
    let tokenizer = state.tokenizer("").expect("bundled tokenizer");
    let route = || RoutePrefix {
        tokenizer: tokenizer.clone(),
        segments: Arc::new(SegmentCache::new(1 << 20)),
        memo: Arc::new(PromptMemo::new(cfg.prefix.prompt_memo_bytes)),
        block_size: 16,
        lora_name: None,
        kind: PolicyKind::Precise,
        affinity: Default::default(),
        slot_to_idx: Vec::new(),
    };
    let mut s = Scratch::default();
    let sizes: [(&str, usize); 4] = [
        ("1KB", 1024),
        ("8KB", 8 * 1024),
        ("32KB", 32 * 1024),
        ("128KB", 128 * 1024),
    ];
    for (name, size) in sizes {
        // Without the last user message: the conversation so far, then turn 1 asks a question,
        // turn 2 adds the answer and asks another.
        let messages = conversation(size.saturating_sub(100).max(1));
        let turn1 = body(&messages, "Summarize the review.");
        let mut next = messages.clone();
        next.push(json!({"role": "user", "content": "Summarize the review."}));
        next.push(json!({"role": "assistant", "content": "It is fine."}));
        let turn2 = body(&next, "Now list the three riskiest changes.");
        let warm = route();
        let l = prepare(&state, &warm, Endpoint::Chat, &turn1, 0, &mut s).expect("prepared");
        eprintln!(
            "{name}: body {} bytes → {} prompt tokens, {} blocks",
            turn1.len(),
            l.prompt_tokens,
            l.total_blocks
        );
        let mut g = c.benchmark_group(format!("prepare/{name}"));
        g.bench_function("cold", |b| {
            b.iter_batched(
                route,
                |rp| black_box(prepare(&state, &rp, Endpoint::Chat, &turn1, 0, &mut s)),
                BatchSize::SmallInput,
            )
        });
        let n = Cell::new(0u64);
        g.bench_function("unique", |b| {
            b.iter_batched(
                || {
                    n.set(n.get() + 1);
                    body(
                        &messages,
                        &format!("Question {} about the review.", n.get()),
                    )
                },
                |body| black_box(prepare(&state, &warm, Endpoint::Chat, &body, 0, &mut s)),
                BatchSize::SmallInput,
            )
        });
        g.bench_function("next_turn", |b| {
            b.iter_batched(
                || {
                    let rp = route();
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
                BatchSize::SmallInput,
            )
        });
        g.bench_function("same", |b| {
            b.iter(|| black_box(prepare(&state, &warm, Endpoint::Chat, &turn1, 0, &mut s)))
        });
        g.finish();
        if name == "32KB" {
            phases(c, &warm, &turn1);
        }
    }
    mark(c, &state);
}

/// The steps of `same/32KB` one by one.
fn phases(c: &mut Criterion, rp: &RoutePrefix, body: &[u8]) {
    let mut g = c.benchmark_group("phases/32KB");
    g.bench_function("parse", |b| {
        b.iter(|| black_box(ParsedRequest::parse(Endpoint::Chat, black_box(body)).is_ok()))
    });
    let Ok(ParsedRequest::Chat(req)) = ParsedRequest::parse(Endpoint::Chat, body) else {
        panic!("a chat body")
    };
    let render = ChatRenderRequest::new(&req.messages);
    g.bench_function("render", |b| {
        b.iter(|| black_box(rp.tokenizer.render_chat(&render).expect("render").len()))
    });
    let text = rp.tokenizer.render_chat(&render).expect("render");
    let mut ids = Vec::new();
    g.bench_function("tokenize_cached", |b| {
        b.iter(|| {
            ids.clear();
            rp.tokenizer
                .encode_cached(&text, &rp.segments, &mut ids)
                .expect("encode");
            black_box(ids.len())
        })
    });
    let mut keys = Vec::new();
    g.bench_function("block_keys", |b| {
        b.iter(|| {
            block_keys(&ids, 16, ExtraKeys::NONE, &mut keys);
            black_box(keys.len())
        })
    });
    g.finish();
}

fn mark(c: &mut Criterion, state: &PrefixState) {
    let targets: Vec<Target> = (0..8)
        .map(|i| Target {
            slot: state.alloc_slot(),
            engine: EngineId(i),
        })
        .collect();
    let prompt =
        |salt: u64| -> Vec<BlockKey> { (0..512).map(|i| BlockKey(salt << 20 | i)).collect() };
    let keys = prompt(1 << 30);
    let mut g = c.benchmark_group("mark");
    for open in [0usize, 96] {
        // Other conversations' decisions awaiting their answers, each with 12 new blocks.
        let held: Vec<_> = (0..open)
            .filter_map(|i| {
                let k = prompt(i as u64 + 1);
                state.mark(targets[i % 8], &k, 500, u64::MAX / 2, 1)
            })
            .collect();
        let mut now = 1u64;
        g.bench_function(open.to_string(), |b| {
            b.iter(|| {
                now += 1;
                let hold = state.mark(targets[0], &keys, 500, 120_000_000 + now, now);
                black_box(hold.map(|h| h.settled()))
            })
        });
        drop(held);
    }
    g.finish();
}

criterion_group! {
    name = prepare_benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = benches
}
criterion_main!(prepare_benches);
