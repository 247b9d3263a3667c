//! Tokenization with the piece cache gives exactly the ids of a plain encode, and reuses the
//! earlier turns of a conversation.

mod common;

use kvmesh_tokenize::{ChatRenderRequest, SegmentCache, Tokenizer};
use serde_json::json;

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
    "<|endoftext|>",
    "<tool_call>",
    " ",
    "\n",
    "ab",
    "<|",
    "im_start|>",
];

fn random_text(rng: &mut common::Rng, n: usize) -> String {
    (0..n).map(|_| WORDS[rng.below(WORDS.len())]).collect()
}

/// Text without special tokens: each chat message is then exactly one piece.
fn plain_text(rng: &mut common::Rng, n: usize) -> String {
    (0..n)
        .map(|_| WORDS[rng.below(WORDS.len())])
        .filter(|w| !w.contains('<') && !w.contains('>'))
        .collect()
}

#[test]
fn cached_encode_equals_plain_encode_on_random_texts() {
    let tok = Tokenizer::bundled_default().expect("bundled");
    let cache = SegmentCache::new(1 << 16);
    let mut rng = common::Rng(7);
    for case in 0..400 {
        let n = 1 + rng.below(120);
        let text = random_text(&mut rng, n);
        let plain = tok.encode(&text, false).expect("encode");
        // Twice: a cold pass fills the cache, the warm pass reads it.
        for pass in 0..2 {
            let mut cached = Vec::new();
            tok.encode_cached(&text, &cache, &mut cached)
                .expect("encode_cached");
            assert_eq!(cached, plain, "case {case} pass {pass}: {text:?}");
        }
    }
}

#[test]
fn conversation_turns_reuse_earlier_pieces() {
    let tok = Tokenizer::bundled_default().expect("bundled");
    let cache = SegmentCache::new(1 << 20);
    let mut rng = common::Rng(11);
    let system = plain_text(&mut rng, 400);
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut last = (0, 0);
    for turn in 0..6 {
        messages.push(json!({"role": "user", "content": plain_text(&mut rng, 60)}));
        let text = tok
            .render_chat(&ChatRenderRequest::new(&messages))
            .expect("render");
        let plain = tok.encode(&text, false).expect("encode");
        let mut cached = Vec::new();
        tok.encode_cached(&text, &cache, &mut cached)
            .expect("cached");
        assert_eq!(cached, plain, "turn {turn}");
        let (hits, misses) = cache.stats();
        if turn > 0 {
            // Only the new question and the previous answer are new pieces.
            assert!(hits > last.0, "turn {turn}: no reuse ({hits} hits)");
            assert!(
                misses - last.1 <= 3,
                "turn {turn}: {} new pieces",
                misses - last.1
            );
        }
        last = (hits, misses);
        messages.push(json!({"role": "assistant", "content": plain_text(&mut rng, 40)}));
    }
}

#[test]
fn a_tiny_cache_stays_correct_and_bounded() {
    let tok = Tokenizer::bundled_default().expect("bundled");
    let cache = SegmentCache::new(64);
    let mut rng = common::Rng(3);
    for _ in 0..100 {
        let text = random_text(&mut rng, 200);
        let mut cached = Vec::new();
        tok.encode_cached(&text, &cache, &mut cached)
            .expect("cached");
        assert_eq!(cached, tok.encode(&text, false).expect("encode"));
    }
}

#[test]
fn many_tiny_unique_pieces_stay_within_the_bound() {
    let tok = Tokenizer::bundled_default().expect("bundled");
    let budget = 16 * 200;
    let cache = SegmentCache::new(budget);
    let mut out = Vec::new();
    for i in 0..5_000 {
        // Every piece is new and a few ids long: the per-piece overhead dominates.
        let text = format!("<|im_start|>u{i}<|im_end|>");
        out.clear();
        tok.encode_cached(&text, &cache, &mut out).expect("cached");
        assert!(
            cache.held_tokens() <= 2 * budget,
            "{} > 2 × {budget}",
            cache.held_tokens()
        );
    }
    assert!(cache.held_tokens() > 0);
}

/// Resuming at any recorded point of an earlier text, for a later text that shares the prefix
/// the tokenizer says it may resume in, gives the ids of a plain encode.
#[test]
fn resumed_encode_equals_plain_encode() {
    let tok = Tokenizer::bundled_default().expect("bundled");
    let cache = SegmentCache::new(1 << 16);
    let mut rng = common::Rng(11);
    for round in 0..200 {
        let old = random_text(&mut rng, 60);
        // The new text keeps a random part of the old one and goes on differently.
        let keep = rng.below(old.len() + 1);
        let keep = (0..=keep)
            .rev()
            .find(|&k| old.is_char_boundary(k))
            .unwrap_or(0);
        let new = format!("{}{}", &old[..keep], random_text(&mut rng, 30));
        let mut old_ids = Vec::new();
        let mut resumes = Vec::new();
        tok.encode_cached_from(&old, 0, &cache, &mut old_ids, Some(&mut resumes))
            .expect("old");
        assert_eq!(
            old_ids,
            tok.encode(&old, false).expect("encode"),
            "round {round}"
        );
        let common = old
            .bytes()
            .zip(new.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let n = tok.resumable(&resumes, common);
        let (start, mut ids) = match n.checked_sub(1).map(|i| resumes[i]) {
            Some(r) => (r.byte as usize, old_ids[..r.tokens as usize].to_vec()),
            None => (0, Vec::new()),
        };
        let mut more = resumes[..n].to_vec();
        tok.encode_cached_from(&new, start, &cache, &mut ids, Some(&mut more))
            .expect("new");
        assert_eq!(
            ids,
            tok.encode(&new, false).expect("encode"),
            "round {round}: {new:?}"
        );
        // The resume points recorded along the way are those of encoding `new` from scratch.
        let mut fresh = Vec::new();
        let mut expected = Vec::new();
        tok.encode_cached_from(&new, 0, &cache, &mut fresh, Some(&mut expected))
            .expect("fresh");
        assert_eq!(more, expected, "round {round}");
    }
}
