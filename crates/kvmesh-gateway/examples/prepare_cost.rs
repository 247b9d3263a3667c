//! Instruction counts of the cache-aware preparation ([`prepare`]), for callgrind: the same
//! bodies and cases as `benches/prepare.rs` (1, 8, 32, 128 KB chats: cold, unique, next turn,
//! same), each measured call in a function of its own so that callgrind's inclusive cost per
//! function is the cost of one case:
//!
//! ```sh
//! cargo build --release -p kvmesh-gateway --example prepare_cost
//! valgrind --tool=callgrind --callgrind-out-file=cg.out target/release/examples/prepare_cost [--no-memo]
//! callgrind_annotate --inclusive=yes --threshold=100 cg.out | grep -E 'prepare_cost::kb[0-9]+::[a-z_]+ '
//! ```
//!
//! Divide each case's inclusive Ir by its call count (printed). `--no-memo` turns the prompt
//! memo off (`prompt_memo_bytes = 0`): the preparation as it was before the memo.

use kvmesh_config::ServeConfig;
use kvmesh_gateway::memo::PromptMemo;
use kvmesh_gateway::prefix::{Endpoint, Lookup, PrefixState, RoutePrefix, Scratch, prepare};
use kvmesh_policy::PolicyKind;
use kvmesh_tokenize::SegmentCache;
use serde_json::json;
use std::hint::black_box;
use std::sync::Arc;

#[path = "../benches/common/chat.rs"]
mod chat;
use chat::{body, conversation};

/// The measured calls of one size, one function per case (callgrind names them
/// `prepare_cost::kb32::next_turn` ...); `setup` prepares what a case needs beforehand. Each
/// body differs by a constant so that the compiler does not merge them into one.
macro_rules! cases {
    ($($m:ident = $id:literal),*) => {$(
        mod $m {
            use super::*;
            #[inline(never)]
            pub fn setup(st: &PrefixState, rp: &RoutePrefix, b: &[u8], s: &mut Scratch) -> Option<Lookup> {
                black_box($id * 10 + 1);
                black_box(prepare(st, rp, Endpoint::Chat, b, 0, s))
            }
            #[inline(never)]
            pub fn cold(st: &PrefixState, rp: &RoutePrefix, b: &[u8], s: &mut Scratch) -> Option<Lookup> {
                black_box($id * 10 + 2);
                black_box(prepare(st, rp, Endpoint::Chat, b, 0, s))
            }
            #[inline(never)]
            pub fn unique(st: &PrefixState, rp: &RoutePrefix, b: &[u8], s: &mut Scratch) -> Option<Lookup> {
                black_box($id * 10 + 3);
                black_box(prepare(st, rp, Endpoint::Chat, b, 0, s))
            }
            #[inline(never)]
            pub fn next_turn(st: &PrefixState, rp: &RoutePrefix, b: &[u8], s: &mut Scratch) -> Option<Lookup> {
                black_box($id * 10 + 4);
                black_box(prepare(st, rp, Endpoint::Chat, b, 0, s))
            }
            #[inline(never)]
            pub fn same(st: &PrefixState, rp: &RoutePrefix, b: &[u8], s: &mut Scratch) -> Option<Lookup> {
                black_box($id * 10 + 5);
                black_box(prepare(st, rp, Endpoint::Chat, b, 0, s))
            }
        }
    )*};
}
cases!(kb1 = 1, kb8 = 8, kb32 = 32, kb128 = 128);

fn main() {
    let memo_bytes = if std::env::args().any(|a| a == "--no-memo") {
        0
    } else {
        ServeConfig::default().prefix.prompt_memo_bytes
    };
    let cfg = ServeConfig::default();
    let state = PrefixState::new(&cfg);
    let tokenizer = state.tokenizer("").expect("bundled tokenizer");
    let route = || RoutePrefix {
        tokenizer: tokenizer.clone(),
        segments: Arc::new(SegmentCache::new(cfg.prefix.tokenizer_cache_tokens)),
        memo: Arc::new(PromptMemo::new(memo_bytes)),
        block_size: 16,
        lora_name: None,
        kind: PolicyKind::Precise,
        affinity: Default::default(),
        slot_to_idx: Vec::new(),
    };
    let mut s = Scratch::default();
    // `--only kb32`: one size (a smaller profile to read).
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    macro_rules! size {
        ($m:ident, $kb:literal, $iters:expr) => {{
            let messages = conversation(($kb * 1024usize).saturating_sub(100).max(1));
            let turn1 = body(&messages, "Summarize the review.");
            let mut next = messages.clone();
            next.push(json!({"role": "user", "content": "Summarize the review."}));
            next.push(json!({"role": "assistant", "content": "It is fine."}));
            let turn2 = body(&next, "Now list the three riskiest changes.");
            let warm = route();
            $m::setup(&state, &warm, &turn1, &mut s);
            let uniques: Vec<Vec<u8>> = (0..$iters)
                .map(|i| body(&messages, &format!("Question {i} about the review.")))
                .collect();
            for _ in 0..$iters {
                let rp = route();
                $m::cold(&state, &rp, &turn1, &mut s);
            }
            for b in &uniques {
                $m::unique(&state, &warm, b, &mut s);
            }
            for _ in 0..$iters {
                let rp = route();
                $m::setup(&state, &rp, &turn1, &mut s);
                $m::next_turn(&state, &rp, &turn2, &mut s);
            }
            for _ in 0..$iters {
                $m::same(&state, &warm, &turn1, &mut s);
            }
            println!("{} KB: body {} bytes, {} calls per case", $kb, turn1.len(), $iters);
        }};
    }
    for (name, run) in [("kb1", 0), ("kb8", 1), ("kb32", 2), ("kb128", 3)] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        match run {
            0 => size!(kb1, 1, 20),
            1 => size!(kb8, 8, 20),
            2 => size!(kb32, 32, 10),
            _ => size!(kb128, 128, 5),
        }
    }
}
