//! Template and request errors are `TokenizeError::Template` values, never panics.

use kvmesh_tokenize::{ChatRenderRequest, ChatTemplate, TokenizeError, Tokenizer};
use proptest::prelude::*;
use serde_json::{Value, json};

fn render(tok: &Tokenizer, messages: &[Value]) -> Result<String, TokenizeError> {
    tok.render_chat(&ChatRenderRequest::new(messages))
}

fn template_err(r: Result<String, TokenizeError>) -> String {
    match r {
        Err(TokenizeError::Template(msg)) => msg,
        other => panic!("expected a Template error, got {other:?}"),
    }
}

#[test]
fn raise_exception_message_is_returned_verbatim() {
    let tok = Tokenizer::bundled_default()
        .unwrap()
        .with_chat_template(
            "{% for m in messages %}{% if m.role == 'user' %}{% set ns = 1 %}{% endif %}{% endfor %}\
             {% if messages[-1].role != 'user' %}{{ raise_exception('No user query found in messages.') }}{% endif %}ok",
        )
        .unwrap();
    let msg = template_err(render(
        &tok,
        &[json!({"role": "assistant", "content": "a"})],
    ));
    assert_eq!(msg, "No user query found in messages.");
    let err = TokenizeError::Template(msg);
    assert!(err.is_client_error());
    assert_eq!(
        render(&tok, &[json!({"role": "user", "content": "u"})]).unwrap(),
        "ok"
    );
}

#[test]
fn raise_exception_inside_macro_and_loop() {
    let t = ChatTemplate::from_source(
        "{% macro check(m) %}{% if m.content is not string %}{{ raise_exception('bad content in ' ~ m.role) }}{% endif %}{% endmacro %}\
         {% for m in messages %}{{ check(m) }}{% endfor %}",
    )
    .unwrap();
    let messages = [
        json!({"role": "user", "content": "fine"}),
        json!({"role": "tool", "content": "x"}),
    ];
    assert_eq!(t.render(&ChatRenderRequest::new(&messages)).unwrap(), "");
    let t2 = ChatTemplate::from_source("{{ raise_exception(42) }}").unwrap();
    assert_eq!(
        template_err(t2.render(&ChatRenderRequest::new(&messages))),
        "42"
    );
}

#[test]
fn request_errors() {
    let tok = Tokenizer::bundled_default().unwrap();
    let msg = template_err(render(&tok, &[]));
    assert!(msg.contains("empty conversation"), "{msg}");
    for bad in [
        json!("just a string"),
        json!({"content": "no role"}),
        json!({"role": 5, "content": "x"}),
        json!({"role": "user", "content": 12}),
        json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        json!({"role": "user", "content": [{"type": "text"}]}),
        json!({"role": "user", "content": [7]}),
        json!({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}),
    ] {
        let msg = template_err(render(&tok, std::slice::from_ref(&bad)));
        assert!(!msg.is_empty(), "{bad}");
    }
    let messages = [json!({"role": "user", "content": "x"})];
    let mut req = ChatRenderRequest::new(&messages);
    req.continue_final_message = true;
    let msg = template_err(tok.render_chat(&req));
    assert!(msg.contains("not compatible"), "{msg}");
}

#[test]
fn template_runtime_and_compile_errors() {
    let tok = Tokenizer::bundled_default().unwrap();
    let messages = [json!({"role": "user", "content": "x"})];
    for source in [
        "{{ messages[0].nope.deeper }}",
        "{{ messages | tojson(indent='x', bogus=1) }}",
        "{{ undefined_thing | tojson }}",
        "{{ 'a' + 1 }}",
        "{% for x in 5 %}{% endfor %}",
        "{{ messages[0].content.nosuchmethod() }}",
    ] {
        let t = tok.with_chat_template(source).unwrap();
        let msg = template_err(render(&t, &messages));
        assert!(msg.starts_with("chat template error"), "{source}: {msg}");
    }
    for source in ["{% if %}", "{{ unclosed", "{% for %}", "{% endif %}"] {
        match tok.with_chat_template(source) {
            Err(TokenizeError::Template(msg)) => assert!(msg.contains("compile"), "{msg}"),
            other => panic!("{source}: expected a compile error, got {other:?}"),
        }
    }
    // Qwen3's template needs messages[0] when tools are given; it is there, so this renders,
    // while a deep recursion guard stops runaway templates.
    let t = tok
        .with_chat_template("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}")
        .unwrap();
    template_err(render(&t, &messages));
}

#[test]
fn multiple_templates_without_default() {
    let dir = std::env::temp_dir().join(format!("kvmesh-tokenize-multi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gz =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/qwen3/tokenizer.json.gz");
    std::fs::copy(&gz, dir.join("tokenizer.json")).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "tool_use", "template": "T{{ tools | length }}"},
                              {"name": "rag", "template": "R"}]}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_path(&dir).unwrap();
    let messages = [json!({"role": "user", "content": "x"})];
    let msg = template_err(render(&tok, &messages));
    assert!(msg.contains("no default"), "{msg}");
    let tools = [json!({"type": "function"})];
    let mut req = ChatRenderRequest::new(&messages);
    req.tools = Some(&tools);
    assert_eq!(tok.render_chat(&req).unwrap(), "T1");
    let names: Vec<&str> = tok.chat_template().unwrap().names().collect();
    assert_eq!(names, ["tool_use", "rag"]);
    let _ = std::fs::remove_dir_all(&dir);
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[a-z<>|{}% \n]{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "user",
            "assistant",
            "system",
            "tool",
            "content",
            "text",
            "function",
            "arguments",
            "tool_calls",
            "type"
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::from),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "role",
                        "content",
                        "tool_calls",
                        "function",
                        "arguments",
                        "name",
                        "reasoning_content",
                        "type",
                        "text",
                        "thinking",
                        "reasoning",
                    ]),
                    inner
                ),
                0..5
            )
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Arbitrary JSON as messages, tools and kwargs: rendering returns Ok or Template, never
    /// panics.
    #[test]
    fn arbitrary_requests_never_panic(
        messages in prop::collection::vec(arb_json(), 0..5),
        tools in prop::option::of(prop::collection::vec(arb_json(), 0..3)),
        agp in any::<bool>(),
        cfm in any::<bool>(),
        kwargs in prop::option::of(arb_json()),
    ) {
        let tok = Tokenizer::bundled_default().unwrap();
        let kwargs = kwargs.and_then(|k| k.as_object().cloned());
        let req = ChatRenderRequest {
            messages: &messages,
            tools: tools.as_deref(),
            add_generation_prompt: agp,
            continue_final_message: cfm,
            template_kwargs: kwargs.as_ref(),
        };
        match tok.render_chat(&req) {
            Ok(text) => { tok.encode(&text, false).unwrap(); }
            Err(TokenizeError::Template(msg)) => prop_assert!(!msg.is_empty()),
            Err(other) => prop_assert!(false, "unexpected error kind {other:?}"),
        }
    }

    #[test]
    fn arbitrary_ids_decode_without_panic(ids in prop::collection::vec(any::<u32>(), 0..40)) {
        let tok = Tokenizer::bundled_default().unwrap();
        tok.decode(&ids, false).unwrap();
        tok.decode(&ids, true).unwrap();
        let mut dec = tok.stream_decoder(false);
        for id in ids {
            dec.push(id).unwrap();
        }
        dec.finish().unwrap();
    }
}
