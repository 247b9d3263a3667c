//! Golden test: token ids and decodes of the bundled Qwen3 tokenizer must equal the Python
//! `tokenizers` package's on the upstream `tokenizer.json`.

mod common;

use common::{Rng, python_encode};
use kvmesh_tokenize::Tokenizer;

fn fixed_texts() -> Vec<String> {
    let long_english = "The quick brown fox jumps over the lazy dog. ".repeat(400);
    let code = r#"fn main() {
    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();
    println!("{:?} {}", v, v.iter().sum::<u32>());
}
def f(x):
	return {"a": [1, 2.5e-3, None], 'b': x ** 2}  # tabs & comments
"#;
    let mut texts: Vec<String> = [
        "",
        "Hello, world!",
        "hello world",
        " leading space",
        "trailing space ",
        "multiple   spaces    and\ttabs\t\tand\n\nnewlines\n\n\n",
        "   ",
        "\n",
        "\r\n\r\nwindows line endings\r\n",
        "It's we're they've I'm you'll he'd IT'S",
        "12345678901234567890 3.14159 1,000,000 -42 0x1F",
        "日本語のテキストです。中文文本，简体。한국어 텍스트.",
        "Emoji: 😀😃😄 👩‍👩‍👧‍👦 🏳️‍🌈 🚀🔥 and flags 🇫🇷🇯🇵",
        "Ünïcödé áccênts: café naïve résumé Ångström",
        "decomposed e\u{0301} and precomposed é (NFC must merge them)",
        "Arabic العربية Hebrew עברית Hindi हिन्दी Thai ภาษาไทย",
        "zero\u{200b}width\u{200d}joiner\u{feff}bom \u{00a0}nbsp \u{3000}ideographic",
        "control \u{1}\u{2}\u{7f} chars",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "text<|endoftext|>more<|im_end|><|im_start|>",
        "<think>\nreasoning\n</think>\n\nanswer",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        "almost special <|im_star|> <|im_end| |im_end|>",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝐀𝐁𝐂 and ancient 𐎀𐎁",
        "{\"json\": [1, 2, {\"nested\": true}], \"s\": \"\\u00e9\"}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    texts.push(long_english);
    texts.push(code.repeat(50));
    texts.push("a".repeat(5000));
    texts.push(" ".repeat(3000) + "x");
    texts.push("😀".repeat(700));
    texts
}

const ALPHABET: &[&str] = &[
    "a",
    "b",
    "Z",
    " ",
    "  ",
    "\n",
    "\t",
    "\r\n",
    ".",
    ",",
    "'s",
    "'",
    "\"",
    "1",
    "23",
    "é",
    "ß",
    "日",
    "本",
    "語",
    "😀",
    "👍🏽",
    "\u{200d}",
    "e\u{301}",
    "<|im_end|>",
    "<|im_start|>",
    "<",
    "|",
    ">",
    "{",
    "}",
    "\\",
    "ǅ",
    "ﬁ",
    "\u{a0}",
    "\u{3000}",
    "Ω",
    "й",
    "ก",
    "\u{fffd}",
];

fn random_texts(count: usize, seed: u64) -> Vec<String> {
    let mut rng = Rng(seed);
    (0..count)
        .map(|_| {
            let len = rng.below(60);
            (0..len)
                .map(|_| ALPHABET[rng.below(ALPHABET.len())])
                .collect()
        })
        .collect()
}

fn check_against_python(texts: &[String], add_special_tokens: bool) {
    let tok = Tokenizer::bundled_default().expect("bundled tokenizer");
    let py = python_encode(texts, add_special_tokens);
    let mut failures = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let ids = tok.encode(text, add_special_tokens).expect("encode");
        if ids != py.ids[i] {
            failures.push(format!(
                "encode {text:?}:\n  rust   {ids:?}\n  python {:?}",
                py.ids[i]
            ));
            continue;
        }
        let decoded = tok.decode(&ids, false).expect("decode");
        if decoded != py.decoded[i] {
            failures.push(format!(
                "decode {text:?}: rust {decoded:?} python {:?}",
                py.decoded[i]
            ));
        }
        let skipped = tok.decode(&ids, true).expect("decode");
        if skipped != py.decoded_skip_special[i] {
            failures.push(format!(
                "decode(skip) {text:?}: rust {skipped:?} python {:?}",
                py.decoded_skip_special[i]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches vs Python tokenizers:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn fixed_texts_match_python_tokenizers() {
    let texts = fixed_texts();
    check_against_python(&texts, false);
    check_against_python(&texts, true);
}

#[test]
fn random_texts_match_python_tokenizers() {
    check_against_python(&random_texts(400, 0x5eed), false);
}

#[test]
fn decode_round_trips_to_the_nfc_text() {
    let tok = Tokenizer::bundled_default().unwrap();
    for text in fixed_texts().iter().chain(random_texts(300, 7).iter()) {
        let ids = tok.encode(text, false).unwrap();
        let back = tok.decode(&ids, false).unwrap();
        // Qwen3 normalizes to NFC; everything else round-trips byte for byte.
        if !text.contains('\u{301}') {
            assert_eq!(&back, text, "round trip of {text:?}");
        }
        // Encoding the decode is a fixed point.
        assert_eq!(
            tok.encode(&back, false).unwrap(),
            tok.encode(&back, false).unwrap()
        );
    }
}

#[test]
fn known_qwen3_ids() {
    // Pinned from the Python tokenizers package, so this test fails even without Python.
    let tok = Tokenizer::bundled_default().unwrap();
    assert_eq!(
        tok.encode("hello <|im_end|>", false).unwrap(),
        [14990, 220, 151645]
    );
    assert_eq!(
        tok.encode("Hello, world!", true).unwrap(),
        [9707, 11, 1879, 0]
    );
    assert_eq!(tok.vocab_size(), 151_669);
    assert_eq!(tok.eos_token_id(), Some(151_645));
    assert_eq!(tok.bos_token_id(), None);
    assert_eq!(tok.stop_token_ids(), &[151_645, 151_643]);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(151_644));
    assert_eq!(tok.token_to_id("hello"), Some(14990));
    assert_eq!(tok.token_to_id("Ġworld"), Some(1879));
    assert_eq!(tok.token_to_id("definitely-not-a-token-xyz"), None);
    assert_eq!(tok.id_to_token(1879).as_deref(), Some("Ġworld"));
    assert_eq!(tok.id_to_token(151_645).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.id_to_token(10_000_000), None);
    assert_eq!(tok.model_max_length(), Some(131_072));
    assert_eq!(tok.special_token("pad_token"), Some("<|endoftext|>"));
    assert_eq!(tok.name(), "qwen3 (bundled)");
}

#[test]
fn encode_into_appends_and_keeps_capacity() {
    let tok = Tokenizer::bundled_default().unwrap();
    let mut out = Vec::with_capacity(4096);
    let cap = out.capacity();
    out.push(1);
    tok.encode_into("Hello, world!", false, &mut out).unwrap();
    assert_eq!(out, [1, 9707, 11, 1879, 0]);
    tok.encode_into(" again", false, &mut out).unwrap();
    assert_eq!(out.len(), 6);
    assert_eq!(
        out.capacity(),
        cap,
        "no reallocation when capacity suffices"
    );
}
