//! The streaming decoder's deltas must add up to the one-shot decode.

use kvmesh_tokenize::{StreamDecoder, Tokenizer};
use proptest::prelude::*;

fn tok() -> Tokenizer {
    Tokenizer::bundled_default().expect("bundled tokenizer")
}

fn stream_all(dec: &mut StreamDecoder, ids: &[u32]) -> String {
    let mut out = String::new();
    for &id in ids {
        if let Some(delta) = dec.push(id).expect("push") {
            assert!(!delta.is_empty(), "deltas are never empty");
            out.push_str(&delta);
        }
    }
    if let Some(rest) = dec.finish().expect("finish") {
        out.push_str(&rest);
    }
    out
}

/// Text drawn from every part of Unicode, plus the characters tokenizers treat specially.
fn text_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        4 => any::<char>().prop_map(String::from),
        2 => "[a-zA-Z ,.!?'\n\t]{1,8}",
        1 => "[\\p{Han}\\p{Hiragana}\\p{Hangul}]{1,4}",
        1 => "[\u{1F300}-\u{1FAFF}\u{200d}\u{fe0f}]{1,4}",
        1 => prop::sample::select(vec![
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "\u{fffd}", "e\u{301}",
        ])
        .prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..40).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn stream_equals_full_decode_of_encoded_text(text in text_strategy(), skip in any::<bool>()) {
        let tok = tok();
        let ids = tok.encode(&text, false).unwrap();
        let full = tok.decode(&ids, skip).unwrap();
        let mut dec = tok.stream_decoder(skip);
        prop_assert_eq!(stream_all(&mut dec, &ids), full);
    }

    /// Arbitrary id sequences split UTF-8 characters anywhere (as a sampling model does).
    #[test]
    fn stream_equals_full_decode_of_arbitrary_ids(
        ids in prop::collection::vec(0u32..151_669, 0..60),
        skip in any::<bool>(),
    ) {
        let tok = tok();
        let full = tok.decode(&ids, skip).unwrap();
        let mut dec = tok.stream_decoder(skip);
        prop_assert_eq!(stream_all(&mut dec, &ids), full);
    }
}

#[test]
fn multibyte_characters_are_held_until_complete() {
    let tok = tok();
    // A single emoji is several byte-level tokens; nothing may be emitted mid-character.
    let ids = tok.encode("😀🚀 ok", false).unwrap();
    let mut dec = tok.stream_decoder(false);
    let mut deltas = Vec::new();
    for &id in &ids {
        if let Some(d) = dec.push(id).unwrap() {
            assert!(!d.contains('\u{fffd}'), "partial character leaked: {d:?}");
            deltas.push(d);
        }
    }
    assert_eq!(deltas.concat(), "😀🚀 ok");
    assert_eq!(dec.finish().unwrap(), None);
}

#[test]
fn special_tokens_skipped_or_kept() {
    let tok = tok();
    let ids = tok.encode("a<|im_end|>b", false).unwrap();
    let mut keep = tok.stream_decoder(false);
    assert_eq!(stream_all(&mut keep, &ids), "a<|im_end|>b");
    let mut skip = tok.stream_decoder(true);
    assert_eq!(stream_all(&mut skip, &ids), "ab");
}

#[test]
fn decoder_is_owned_and_sendable() {
    let tok = tok();
    let ids = tok.encode("moved to another thread", false).unwrap();
    let mut dec = tok.stream_decoder(true);
    drop(tok);
    let text = std::thread::spawn(move || stream_all(&mut dec, &ids))
        .join()
        .unwrap();
    assert_eq!(text, "moved to another thread");
}
