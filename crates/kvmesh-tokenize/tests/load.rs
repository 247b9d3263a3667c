//! Loading: the bundled copy equals the upstream files, and bad inputs give `Load` errors.

mod common;

use common::shared_qwen3_dir;
use kvmesh_tokenize::{ChatRenderRequest, TokenizeError, Tokenizer};
use std::path::{Path, PathBuf};

fn sample_texts() -> Vec<String> {
    vec![
        "Hello, world! <|im_start|>user\nhi<|im_end|>".to_owned(),
        "日本語 😀 e\u{301} \t\n  spaces".to_owned(),
        "fn main() { println!(\"{}\", 1 + 2); }\n".repeat(20),
    ]
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvmesh-tokenize-test-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn assert_same_tokenizer(a: &Tokenizer, b: &Tokenizer) {
    for text in sample_texts() {
        assert_eq!(
            a.encode(&text, false).unwrap(),
            b.encode(&text, false).unwrap()
        );
        assert_eq!(
            a.encode(&text, true).unwrap(),
            b.encode(&text, true).unwrap()
        );
    }
    assert_eq!(a.vocab_size(), b.vocab_size());
    assert_eq!(a.eos_token_id(), b.eos_token_id());
    assert_eq!(a.model_max_length(), b.model_max_length());
    let messages = vec![serde_json::json!({"role": "user", "content": "hi"})];
    let req = ChatRenderRequest::new(&messages);
    assert_eq!(a.render_chat(&req).unwrap(), b.render_chat(&req).unwrap());
}

#[test]
fn from_path_file_and_directory_equal_bundled() {
    let bundled = Tokenizer::bundled_default().unwrap();
    let dir = shared_qwen3_dir();
    let from_dir = Tokenizer::from_path(&dir).unwrap();
    let from_file = Tokenizer::from_path(&dir.join("tokenizer.json")).unwrap();
    assert_same_tokenizer(&bundled, &from_dir);
    assert_same_tokenizer(&bundled, &from_file);
    assert_eq!(from_dir.name(), dir.display().to_string());
    assert_eq!(from_dir.stop_token_ids().first(), Some(&151_645));
}

#[test]
fn bundled_default_is_cached_and_load_bundled_is_fresh() {
    let a = Tokenizer::bundled_default().unwrap();
    let b = Tokenizer::bundled_default().unwrap();
    let c = Tokenizer::load_bundled().unwrap();
    assert_same_tokenizer(&a, &b);
    assert_same_tokenizer(&a, &c);
}

#[test]
fn gzipped_file_and_missing_config() {
    // A directory with only a (gzipped, canonical) tokenizer.json: loads, but has no chat
    // template, so chat rendering reports NoChatTemplate.
    let dir = temp_dir("gz");
    let gz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/qwen3/tokenizer.json.gz");
    std::fs::copy(&gz, dir.join("tokenizer.json")).unwrap();
    let tok = Tokenizer::from_path(&dir).unwrap();
    assert!(tok.chat_template().is_none());
    assert_eq!(tok.eos_token_id(), None);
    assert_eq!(tok.model_max_length(), None);
    assert_eq!(
        tok.encode("hello <|im_end|>", false).unwrap(),
        [14990, 220, 151645]
    );
    let messages = vec![serde_json::json!({"role": "user", "content": "hi"})];
    let err = tok
        .render_chat(&ChatRenderRequest::new(&messages))
        .unwrap_err();
    assert!(
        matches!(err, TokenizeError::NoChatTemplate { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("no chat template"));
    assert!(!err.is_client_error());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn side_files_are_read() {
    let dir = temp_dir("side");
    let gz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/qwen3/tokenizer.json.gz");
    std::fs::copy(&gz, dir.join("tokenizer.json")).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<|endoftext|>", "model_max_length": 4096,
            "chat_template": "not used: chat_template.jinja wins"}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ messages[0].content }}{{ eos_token }}",
    )
    .unwrap();
    std::fs::write(
        dir.join("special_tokens_map.json"),
        r#"{"bos_token": "<|im_start|>"}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [151645, 151643]}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_path(&dir).unwrap();
    assert_eq!(tok.eos_token_id(), Some(151_643));
    assert_eq!(tok.bos_token_id(), Some(151_644));
    assert_eq!(tok.stop_token_ids(), &[151_643, 151_645]);
    assert_eq!(tok.model_max_length(), Some(4096));
    let messages = vec![serde_json::json!({"role": "user", "content": "x"})];
    assert_eq!(
        tok.render_chat(&ChatRenderRequest::new(&messages)).unwrap(),
        "x<|endoftext|>"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn load_err(path: &Path) -> String {
    match Tokenizer::from_path(path) {
        Err(e @ TokenizeError::Load { .. }) => e.to_string(),
        Err(other) => panic!(
            "expected a Load error for {}, got {other:?}",
            path.display()
        ),
        Ok(_) => panic!("loading {} should fail", path.display()),
    }
}

#[test]
fn bad_paths_and_files_give_load_errors() {
    let msg = load_err(Path::new("/definitely/not/here/tokenizer.json"));
    assert!(msg.contains("/definitely/not/here"), "{msg}");
    let empty = temp_dir("empty");
    load_err(&empty); // a directory without tokenizer.json
    let bad = temp_dir("bad");
    for (name, content) in [
        ("not_json.json", "this is not json"),
        ("array.json", "[1, 2, 3]"),
        ("no_model.json", r#"{"version": "1.0", "added_tokens": []}"#),
        (
            "truncated.json",
            r#"{"version": "2.0", "model": {"type": "BPE", "vocab": {"#,
        ),
    ] {
        let p = bad.join(name);
        std::fs::write(&p, content).unwrap();
        load_err(&p);
    }
    std::fs::write(bad.join("binary.json"), [0xff, 0xfe, 0x00, 0x01]).unwrap();
    load_err(&bad.join("binary.json"));
    // A broken gzip stream.
    std::fs::write(bad.join("broken.gz"), [0x1f, 0x8b, 0x08, 0x00, 0x01]).unwrap();
    load_err(&bad.join("broken.gz"));
    // A broken tokenizer_config.json next to a good tokenizer.json.
    let cfg = temp_dir("badcfg");
    let gz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/qwen3/tokenizer.json.gz");
    std::fs::copy(&gz, cfg.join("tokenizer.json")).unwrap();
    std::fs::write(cfg.join("tokenizer_config.json"), "{").unwrap();
    assert!(load_err(&cfg).contains("tokenizer_config.json"));
    std::fs::write(
        cfg.join("tokenizer_config.json"),
        r#"{"chat_template": "{% if %}"}"#,
    )
    .unwrap();
    assert!(load_err(&cfg).contains("compile"));
    for d in [empty, bad, cfg] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn tokenizer_is_clone_send_sync() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<Tokenizer>();
    fn assert_send<T: Send>() {}
    assert_send::<kvmesh_tokenize::StreamDecoder>();
    let tok = Tokenizer::bundled_default().unwrap();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let tok = tok.clone();
            std::thread::spawn(move || tok.encode(&format!("thread {i} text"), false).unwrap())
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(
            h.join().unwrap(),
            tok.encode(&format!("thread {i} text"), false).unwrap()
        );
    }
}

#[test]
fn legacy_non_bpe_tokenizer_from_json_str() {
    // A tiny `"version": "1.0"` WordLevel tokenizer: exercises the legacy conversion and the
    // non-byte-level decode path.
    let json = r#"{"version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2},
                  "unk_token": "[UNK]"}}"#;
    let config = r#"{"unk_token": "[UNK]", "chat_template": "{{ messages[0].content }}"}"#;
    let tok = Tokenizer::from_json_str("tiny", json, Some(config)).unwrap();
    assert_eq!(tok.name(), "tiny");
    assert_eq!(tok.encode("hello world nope", false).unwrap(), [1, 2, 0]);
    assert_eq!(tok.decode(&[1, 2], false).unwrap(), "hello world");
    assert_eq!(tok.vocab_size(), 3);
    assert_eq!(tok.token_to_id("world"), Some(2));
    assert_eq!(tok.eos_token_id(), None);
    let messages = vec![serde_json::json!({"role": "user", "content": "hello"})];
    assert_eq!(
        tok.encode_chat(&ChatRenderRequest::new(&messages)).unwrap(),
        [1]
    );
    assert!(matches!(
        Tokenizer::from_json_str("bad", "{}", None),
        Err(TokenizeError::Load { .. })
    ));
}
