//! `cargo bench -p kvmesh-tokenize --bench tokenize`
//!
//! Router hot path: render + tokenize a ~32 KB chat prompt (English prose + code), plus the
//! pieces (render only, encode only, 1 KB encode, decode, streaming decode) and the one-time cost
//! of building the bundled tokenizer. Kept short: a few seconds per benchmark.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvmesh_tokenize::{ChatRenderRequest, SegmentCache, Tokenizer};
use serde_json::{Value, json};
use std::hint::black_box;
use std::time::Duration;

const PROSE: &str = "Large language model inference is dominated by the prefill of long prompts. \
A router that knows which engine already holds the KV cache for a prefix can send the request \
there and skip most of that work, but only if it computes exactly the same token ids as the \
engine does, block by block. ";

const CODE: &str = r#"
```rust
fn route(blocks: &[u64], engines: &[Engine]) -> Option<usize> {
    engines
        .iter()
        .enumerate()
        .max_by_key(|(_, e)| blocks.iter().take_while(|b| e.has(**b)).count())
        .map(|(i, _)| i)
}
```
"#;

/// A multi-turn conversation whose rendered prompt is about `target` bytes.
fn conversation(target: usize) -> Vec<Value> {
    let mut messages =
        vec![json!({"role": "system", "content": "You are a senior Rust reviewer."})];
    let mut size = 0;
    let mut turn = 0;
    while size < target {
        let mut user = String::new();
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
    messages.push(json!({"role": "user", "content": "Summarize the review."}));
    messages
}

fn benches(c: &mut Criterion) {
    let tok = Tokenizer::bundled_default().expect("bundled tokenizer");
    let messages = conversation(32 * 1024);
    let req = ChatRenderRequest::new(&messages);
    let prompt = tok.render_chat(&req).expect("render");
    let ids = tok.encode(&prompt, false).expect("encode");
    let text_1k: String = prompt.chars().take(1024).collect();
    eprintln!(
        "prompt: {} bytes, {} tokens; 1k text: {} bytes",
        prompt.len(),
        ids.len(),
        text_1k.len()
    );

    let mut g = c.benchmark_group("chat_32k");
    g.throughput(Throughput::Bytes(prompt.len() as u64));
    let mut buf = Vec::with_capacity(ids.len() * 2);
    g.bench_function("render_and_encode", |b| {
        b.iter(|| {
            buf.clear();
            tok.encode_chat_into(black_box(&req), &mut buf)
                .expect("encode_chat");
            black_box(buf.len())
        })
    });
    g.bench_function("render_only", |b| {
        b.iter(|| black_box(tok.render_chat(black_box(&req)).expect("render").len()))
    });
    g.bench_function("encode_only", |b| {
        b.iter(|| {
            buf.clear();
            tok.encode_into(black_box(&prompt), false, &mut buf)
                .expect("encode");
            black_box(buf.len())
        })
    });
    g.bench_function("decode", |b| {
        b.iter(|| black_box(tok.decode(black_box(&ids), false).expect("decode").len()))
    });
    g.bench_function("stream_decode", |b| {
        b.iter(|| {
            let mut dec = tok.stream_decoder(false);
            let mut n = 0;
            for &id in &ids {
                if let Some(d) = dec.push(id).expect("push") {
                    n += d.len();
                }
            }
            black_box(n)
        })
    });
    g.finish();

    // A later turn of the same conversation: every earlier message is a cached piece, only
    // the new question is tokenized (what the router does for multi-turn chats).
    let mut g = c.benchmark_group("chat_32k_next_turn");
    g.throughput(Throughput::Bytes(prompt.len() as u64));
    let cache = SegmentCache::new(1 << 20);
    let earlier = ChatRenderRequest::new(&messages[..messages.len() - 1]);
    let warm = tok.render_chat(&earlier).expect("render");
    buf.clear();
    tok.encode_cached(&warm, &cache, &mut buf).expect("warm");
    g.bench_function("render_and_encode_cached", |b| {
        b.iter(|| {
            let text = tok.render_chat(black_box(&req)).expect("render");
            buf.clear();
            tok.encode_cached(&text, &cache, &mut buf).expect("encode");
            black_box(buf.len())
        })
    });
    g.bench_function("encode_cached_only", |b| {
        b.iter(|| {
            buf.clear();
            tok.encode_cached(black_box(&prompt), &cache, &mut buf)
                .expect("encode");
            black_box(buf.len())
        })
    });
    g.finish();

    let mut g = c.benchmark_group("text_1k");
    g.throughput(Throughput::Bytes(text_1k.len() as u64));
    g.bench_function("encode", |b| {
        b.iter(|| {
            buf.clear();
            tok.encode_into(black_box(&text_1k), false, &mut buf)
                .expect("encode");
            black_box(buf.len())
        })
    });
    g.finish();

    let mut g = c.benchmark_group("load");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(5));
    g.bench_function("bundled_qwen3", |b| {
        b.iter(|| black_box(Tokenizer::load_bundled().expect("load").vocab_size()))
    });
    g.finish();
}

criterion_group! {
    name = tokenize;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(tokenize);
