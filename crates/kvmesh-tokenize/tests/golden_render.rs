//! Golden test: chat rendering (and the tokens of the rendered prompt) must be byte-identical to
//! the Python reference (`tests/python/render_golden.py`: jinja2 set up like transformers'
//! `apply_chat_template`, on messages normalized like vLLM's, cross-checked against
//! transformers itself when it is installed).

mod common;

use common::{bundled_config_path, first_difference, python_encode, run_golden};
use kvmesh_tokenize::{ChatRenderRequest, TokenizeError, Tokenizer};
use serde_json::Value;

struct Outcome {
    name: String,
    rust: Result<String, TokenizeError>,
    case: Value,
}

fn render_all() -> Vec<Outcome> {
    let golden = run_golden(
        &[
            "render",
            "--config",
            &bundled_config_path().to_string_lossy(),
        ],
        None,
    );
    let cases = golden["cases"].as_array().expect("cases").clone();
    assert!(cases.len() > 150, "expected the full case list");
    let tok = Tokenizer::bundled_default().expect("bundled tokenizer");
    cases
        .into_iter()
        .map(|case| {
            let name = case["name"].as_str().expect("name").to_owned();
            let messages = case["messages"].as_array().cloned().unwrap_or_default();
            let tools = case.get("tools").and_then(Value::as_array).cloned();
            let kwargs = case
                .get("template_kwargs")
                .and_then(Value::as_object)
                .cloned();
            let req = ChatRenderRequest {
                messages: &messages,
                tools: tools.as_deref(),
                add_generation_prompt: case
                    .get("add_generation_prompt")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
                continue_final_message: case
                    .get("continue_final_message")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
                template_kwargs: kwargs.as_ref(),
            };
            let rust = match case.get("template").and_then(Value::as_str) {
                Some(source) => tok
                    .with_chat_template(source)
                    .and_then(|t| t.render_chat(&req)),
                None => tok.render_chat(&req),
            };
            Outcome { name, rust, case }
        })
        .collect()
}

#[test]
fn chat_rendering_matches_python_reference() {
    let outcomes = render_all();
    let mut failures = Vec::new();
    let mut rendered = 0;
    let mut errors = 0;
    for o in &outcomes {
        let want_text = o.case.get("rendered").and_then(Value::as_str);
        let want_err = o.case.get("error").and_then(Value::as_str);
        match (&o.rust, want_text, want_err) {
            (Ok(got), Some(want), _) => {
                rendered += 1;
                if got != want {
                    failures.push(format!("{}: {}", o.name, first_difference(got, want)));
                }
            }
            (Err(TokenizeError::Template(msg)), None, Some(want)) => {
                errors += 1;
                let exact = o.case.get("error_exact").and_then(Value::as_bool) == Some(true);
                if exact && msg != want {
                    failures.push(format!(
                        "{}: error message {msg:?}, python raised {want:?}",
                        o.name
                    ));
                }
            }
            (Ok(got), None, Some(want)) => failures.push(format!(
                "{}: python failed ({want}) but rust rendered {got:?}",
                o.name
            )),
            (Err(e), _, _) => failures.push(format!(
                "{}: rust failed with {e:?}, python: {:?}",
                o.name,
                want_text.or(want_err)
            )),
            (Ok(_), None, None) => failures.push(format!("{}: malformed golden case", o.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from the Python reference:\n{}",
        failures.len(),
        outcomes.len(),
        failures.join("\n")
    );
    // Make sure the suite exercised both paths.
    assert!(
        rendered > 150 && errors >= 6,
        "rendered {rendered}, errors {errors}"
    );
}

#[test]
fn chat_token_ids_match_python_tokenizers() {
    let outcomes = render_all();
    let tok = Tokenizer::bundled_default().expect("bundled tokenizer");
    let texts: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.rust.as_ref().ok().cloned())
        .collect();
    assert!(texts.len() > 150);
    let py = python_encode(&texts, false);
    let mut failures = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let ids = tok.encode(text, false).expect("encode");
        if ids != py.ids[i] {
            failures.push(format!(
                "text {i} {text:?}: rust {ids:?} != python {:?}",
                py.ids[i]
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn encode_chat_is_render_then_encode_without_added_specials() {
    let tok = Tokenizer::bundled_default().unwrap();
    let messages = vec![
        serde_json::json!({"role": "system", "content": "sys"}),
        serde_json::json!({"role": "user", "content": "hi"}),
    ];
    let req = ChatRenderRequest::new(&messages);
    let text = tok.render_chat(&req).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode_chat(&req).unwrap();
    assert_eq!(ids, tok.encode(&text, false).unwrap());
    assert_eq!(ids[0], 151_644, "<|im_start|> must map to its special id");
    let mut buf = vec![7u32];
    let again = tok.encode_chat_into(&req, &mut buf).unwrap();
    assert_eq!(again, text);
    assert_eq!(buf[0], 7);
    assert_eq!(&buf[1..], &ids[..]);
}
