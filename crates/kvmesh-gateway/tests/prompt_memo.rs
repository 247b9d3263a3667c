//! The prompt memo never changes a block key: over growing conversations (turns appended,
//! earlier turns edited, special tokens inside messages, tools, cache salts, the same body
//! again), the keys prepared with the memo equal those prepared without it.

mod common;

use kvmesh_config::ServeConfig;
use kvmesh_gateway::memo::PromptMemo;
use kvmesh_gateway::prefix::{
    Endpoint, ParsedRequest, PrefixState, RoutePrefix, Scratch, prompt_keys,
};
use kvmesh_policy::PolicyKind;
use kvmesh_tokenize::SegmentCache;
use serde_json::{Value, json};
use std::sync::Arc;

const WORDS: &[&str] = &[
    "router",
    " engine",
    " cache",
    "\n\n",
    "  ",
    "é",
    "東京",
    "🙂",
    " <|im_end",
    "|>",
    "def f(x):",
    "\treturn x",
    " 42",
    "<think>",
    "</think>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    " ",
    "\n",
    "<|",
    "im_start|>",
    " the prefill of long prompts",
];

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
    fn text(&mut self, words: usize) -> String {
        (0..words).map(|_| WORDS[self.below(WORDS.len())]).collect()
    }
}

fn route(state: &PrefixState, memo_bytes: usize, lora: Option<&str>) -> RoutePrefix {
    RoutePrefix {
        tokenizer: state.tokenizer("").expect("bundled tokenizer"),
        segments: Arc::new(SegmentCache::new(1 << 20)),
        memo: Arc::new(PromptMemo::new(memo_bytes)),
        block_size: 16,
        lora_name: lora.map(str::to_string),
        kind: PolicyKind::Precise,
        affinity: Default::default(),
        slot_to_idx: Vec::new(),
    }
}

fn keys(state: &PrefixState, rp: &RoutePrefix, body: &Value) -> Option<(u32, Vec<u64>)> {
    let bytes = serde_json::to_vec(body).expect("json");
    let req = ParsedRequest::parse(Endpoint::Chat, &bytes).ok()?;
    let mut s = Scratch::default();
    let l = prompt_keys(state, rp, &req, &mut s)?;
    Some((l.prompt_tokens, s.keys.iter().map(|k| k.0).collect()))
}

#[test]
fn keys_with_the_memo_equal_keys_without_it() {
    let state = PrefixState::new(&ServeConfig::default());
    for (seed, lora) in [(1u64, None), (2, Some("adapter")), (3, None)] {
        let with = route(&state, 32 << 20, lora);
        let without = route(&state, 0, lora);
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut conversations: Vec<Vec<Value>> = (0..3)
            .map(|_| vec![json!({"role": "system", "content": rng.text(400)})])
            .collect();
        for turn in 0..60 {
            let c = rng.below(conversations.len());
            let msgs = &mut conversations[c];
            match rng.below(10) {
                // Usually the next turn; sometimes an earlier message is edited, or the
                // last one dropped (a regenerated answer).
                0 if msgs.len() > 2 => {
                    let i = 1 + rng.below(msgs.len() - 1);
                    msgs[i]["content"] = json!(rng.text(50));
                }
                1 if msgs.len() > 2 => {
                    msgs.pop();
                }
                _ => {
                    msgs.push(json!({"role": "user", "content": rng.text(150)}));
                }
            }
            let mut body = json!({"model": "m", "messages": msgs.clone()});
            match rng.below(6) {
                0 => body["cache_salt"] = json!(format!("salt{}", rng.below(2))),
                1 => body["chat_template_kwargs"] = json!({"enable_thinking": false}),
                2 => {
                    body["tools"] =
                        json!([{"type": "function", "function": {"name": "f", "parameters": {}}}])
                }
                _ => {}
            }
            let a = keys(&state, &with, &body);
            let b = keys(&state, &without, &body);
            assert_eq!(a, b, "seed {seed} turn {turn}");
            // The same body again (a retry): memo hit on the whole text.
            assert_eq!(
                keys(&state, &with, &body),
                b,
                "seed {seed} turn {turn} again"
            );
            let answer = rng.text(80);
            conversations[c].push(json!({"role": "assistant", "content": answer}));
        }
        assert!(
            with.memo.found() >= 30,
            "the memo was used: {}",
            with.memo.found()
        );
        assert!(without.memo.is_empty());
    }
}

/// The piece caches and prompt memos, which fill over a busy router's first half hour or so,
/// show their size on the metrics page (QA30: a soak's RSS grew for 32 minutes before it
/// levelled off, and nothing on the page said what grew).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_caches_show_their_size_on_the_metrics_page() {
    use common::{cache_aware_router, chat_body, client, metric, post_json, scrape, start_sims};
    let sims = start_sims(2, |_| common::instant_sim_cfg("m")).await;
    let (router, _) = cache_aware_router(&sims).await;
    let c = client();
    let base = router.base_url();
    let sizes = |page: &str| {
        (
            metric(page, "kvmesh_prefix_piece_cache_bytes"),
            metric(page, "kvmesh_prefix_prompt_memo_bytes"),
        )
    };
    assert_eq!(sizes(&scrape(&c, &base).await), (0.0, 0.0));
    // Over the 4 KB under which the memo keeps no prompt.
    let long = "the prefill of long prompts ".repeat(300);
    let url = format!("{base}/v1/chat/completions");
    let r = post_json(&c, &url, &chat_body("m", &long, 2, false)).await;
    assert!(r.ok(), "{r:?}");
    let (pieces, memos) = sizes(&scrape(&c, &base).await);
    assert!(
        pieces > 0.0 && memos > long.len() as f64,
        "{pieces} {memos}"
    );
    router.shutdown().await;
    common::stop_sims(sims).await;
}
