//! Request bodies of `/v1/chat/completions` and `/v1/completions`, parsed leniently the way
//! vLLM does (unknown fields are accepted and ignored) and validated strictly (a bad value is a
//! 400 naming the parameter, never a panic).

use crate::ApiError;
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};

/// A boolean that may be sent as `null` (OpenAI's schema allows it, and SDKs send it): null
/// reads as the default, `false`.
fn null_is_false<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` before `[DONE]`.
    #[serde(default, deserialize_with = "null_is_false")]
    pub include_usage: bool,
    /// Send `usage` in every chunk (vLLM extension).
    #[serde(default, deserialize_with = "null_is_false")]
    pub continuous_usage_stats: bool,
}

/// Body of `POST /v1/chat/completions`. Fields not listed are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model name.
    pub model: Option<String>,
    /// OpenAI messages, kept as JSON: the chat template reads them as they are.
    pub messages: Vec<Value>,
    /// Completion length (deprecated name).
    pub max_tokens: Option<i64>,
    /// Completion length (current name; wins over `max_tokens`).
    pub max_completion_tokens: Option<i64>,
    /// Stream the answer as server-sent events.
    #[serde(default, deserialize_with = "null_is_false")]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices.
    pub n: Option<i64>,
    /// Sampling temperature (≥ 0).
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: Option<f64>,
    /// End-user id (also a consistent-hash key for the router).
    pub user: Option<String>,
    /// Tool definitions passed to the chat template.
    pub tools: Option<Vec<Value>>,
    /// Extra variables for the chat template (vLLM extension), e.g. `enable_thinking`.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Append the assistant header (vLLM extension, default true).
    pub add_generation_prompt: Option<bool>,
    /// Continue the last (assistant) message instead of starting a new one (vLLM extension).
    #[serde(default, deserialize_with = "null_is_false")]
    pub continue_final_message: bool,
    /// Salt isolating this request's prefix cache (vLLM extension).
    pub cache_salt: Option<String>,
    /// Log probabilities asked for (`true`), kept as JSON: a router forwards it as it is.
    pub logprobs: Option<Value>,
    /// How many alternatives per token, kept as JSON.
    pub top_logprobs: Option<Value>,
}

impl ChatCompletionRequest {
    /// Whether log probabilities are asked for (`logprobs: true`, or `top_logprobs` set).
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs
            .as_ref()
            .is_some_and(|v| v.as_bool() != Some(false) && !v.is_null())
            || self.top_logprobs.as_ref().is_some_and(|v| !v.is_null())
    }
}

/// `prompt` of `/v1/completions`: text, token ids, or a batch of either.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// A batch of text prompts.
    TextBatch(Vec<String>),
    /// A batch of token-id prompts.
    TokensBatch(Vec<Vec<u32>>),
}

/// One prompt of a `/v1/completions` request after batch unwrapping.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput<'a> {
    /// Text to tokenize.
    Text(&'a str),
    /// Token ids given by the client.
    Tokens(&'a [u32]),
}

impl Prompt {
    /// The prompts in order (a batch has several).
    pub fn inputs(&self) -> Vec<PromptInput<'_>> {
        match self {
            Prompt::Text(t) => vec![PromptInput::Text(t)],
            Prompt::Tokens(t) => vec![PromptInput::Tokens(t)],
            Prompt::TextBatch(b) => b.iter().map(|t| PromptInput::Text(t)).collect(),
            Prompt::TokensBatch(b) => b.iter().map(|t| PromptInput::Tokens(t)).collect(),
        }
    }
}

/// Body of `POST /v1/completions`. Fields not listed are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model name.
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Completion length (OpenAI default for this endpoint: 16).
    pub max_tokens: Option<i64>,
    /// Stream the answer as server-sent events.
    #[serde(default, deserialize_with = "null_is_false")]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices.
    pub n: Option<i64>,
    /// Sampling temperature (≥ 0).
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: Option<f64>,
    /// Echo the prompt in the answer.
    #[serde(default, deserialize_with = "null_is_false")]
    pub echo: bool,
    /// End-user id.
    pub user: Option<String>,
    /// Salt isolating this request's prefix cache (vLLM extension).
    pub cache_salt: Option<String>,
    /// Log probabilities of this many alternatives per token, kept as JSON: a router
    /// forwards it as it is.
    pub logprobs: Option<Value>,
}

impl CompletionRequest {
    /// Whether log probabilities are asked for (`logprobs` set, 0 included).
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs.as_ref().is_some_and(|v| !v.is_null())
    }
}

/// Parses a JSON body into `T`, mapping every failure (invalid UTF-8, syntax, wrong types) to a
/// 400 that says what is wrong.
pub fn parse_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    if let Err(e) = std::str::from_utf8(body) {
        return Err(ApiError::bad_request(
            "invalid_utf8",
            format!(
                "request body is not valid UTF-8 (at byte {})",
                e.valid_up_to()
            ),
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        if e.is_data() && !body.trim_ascii_start().starts_with(b"{") {
            return ApiError::invalid_json("the request body must be a JSON object");
        }
        let detail = e.to_string();
        if let Some(at) =
            detail.strip_prefix("data did not match any variant of untagged enum Prompt")
        {
            return ApiError::invalid_param(
                "prompt",
                format!(
                    "`prompt` must be a string, an array of token ids (0 to 2^32 - 1), or an array of either{at}"
                ),
            );
        }
        if e.is_data() {
            return data_error::<T>(body).unwrap_or_else(|| ApiError::invalid_json(detail));
        }
        ApiError::invalid_json(detail)
    })
}

/// A well-formed body whose data does not fit `T`: the parameter at fault named, as OpenAI
/// does (`param`, code `invalid_type` for a value of the wrong type, `invalid_value` for
/// another value refused, `missing_required_parameter`). Parsed again with the path tracked:
/// the error's path only, never the request's. `None` when no parameter can be named.
fn data_error<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Option<ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let e = serde_path_to_error::deserialize::<_, T>(&mut de).err()?;
    let path = e.path().to_string();
    let inner = e.into_inner().to_string();
    if path.is_empty() || path == "." {
        // At the top: a required field missing.
        let name = inner
            .strip_prefix("missing field `")?
            .split('`')
            .next()
            .filter(|n| !n.is_empty())?
            .to_string();
        return Some(ApiError {
            param: Some(std::borrow::Cow::Owned(name.clone())),
            ..ApiError::bad_request(
                "missing_required_parameter",
                format!("missing required parameter `{name}`"),
            )
        });
    }
    let path = crate::error::clip(&path).into_owned();
    let code = if inner.starts_with("invalid type") {
        "invalid_type"
    } else {
        "invalid_value"
    };
    Some(ApiError {
        message: format!("invalid `{path}`: {inner}"),
        param: Some(std::borrow::Cow::Owned(path)),
        ..ApiError::bad_request(code, String::new())
    })
}

/// Checks a requested completion length: `None` stays `None`, ≤ 0 is a 400, and so is one
/// past 2^32 - 1 (no context comes near it; said with the value asked, not a clamped one).
pub fn check_max_tokens(param: &'static str, v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid_param(
            param,
            format!("{param} must be at least 1, got {n}."),
        )),
        Some(n) => u32::try_from(n).map(Some).map_err(|_| {
            ApiError::invalid_param(
                param,
                format!("{param} must be at most {}, got {n}.", u32::MAX),
            )
        }),
    }
}

/// Checks `n` as every OpenAI server does: at least 1.
pub fn check_n_positive(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        Some(v) if v < 1 => Err(ApiError::invalid_param(
            "n",
            format!("n must be at least 1, got {v}."),
        )),
        _ => Ok(()),
    }
}

/// What vLLM refuses of the sampling parameters: a negative temperature, a `top_p` outside
/// (0, 1].
pub fn check_sampling(temperature: Option<f64>, top_p: Option<f64>) -> Result<(), ApiError> {
    if let Some(t) = temperature
        && (t.is_nan() || t < 0.0)
    {
        return Err(ApiError::invalid_param(
            "temperature",
            format!("temperature must be non-negative, got {t}."),
        ));
    }
    if let Some(p) = top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(ApiError::invalid_param(
            "top_p",
            format!("top_p must be in (0, 1], got {p}."),
        ));
    }
    Ok(())
}

/// Checks `n` for a server that makes one choice per request (the simulator).
pub fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    check_n_positive(n)?;
    match n {
        Some(v) if v > 1 => Err(ApiError::invalid_param(
            "n",
            format!("n = {v} is not supported: only one choice per request (n = 1)."),
        )),
        _ => Ok(()),
    }
}

impl ChatCompletionRequest {
    /// The effective `max_completion_tokens` / `max_tokens`, validated.
    pub fn max_tokens(&self) -> Result<Option<u32>, ApiError> {
        if self.max_completion_tokens.is_some() {
            check_max_tokens("max_completion_tokens", self.max_completion_tokens)
        } else {
            check_max_tokens("max_tokens", self.max_tokens)
        }
    }

    /// Validates what a server must reject before doing any work (one choice per request).
    pub fn validate(&self) -> Result<(), ApiError> {
        self.check_openai()?;
        check_n(self.n)
    }

    /// What every OpenAI-compatible server rejects (a router checks this before it routes,
    /// so that a request no engine would serve changes nothing).
    pub fn check_openai(&self) -> Result<(), ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid_param(
                "messages",
                "messages must contain at least one message.",
            ));
        }
        for (i, m) in self.messages.iter().enumerate() {
            let ok = m
                .as_object()
                .is_some_and(|o| o.get("role").is_some_and(Value::is_string));
            if !ok {
                return Err(ApiError::invalid_param(
                    "messages",
                    format!("messages[{i}] must be an object with a string `role`."),
                ));
            }
        }
        check_n_positive(self.n)?;
        check_sampling(self.temperature, self.top_p)?;
        self.max_tokens()?;
        Ok(())
    }

    /// Whether a final usage chunk is requested when streaming.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

impl CompletionRequest {
    /// Validates what a server must reject before doing any work (one choice per request).
    pub fn validate(&self) -> Result<(), ApiError> {
        self.check_openai()?;
        check_n(self.n)
    }

    /// What every OpenAI-compatible server rejects (see
    /// [`ChatCompletionRequest::check_openai`]).
    pub fn check_openai(&self) -> Result<(), ApiError> {
        check_n_positive(self.n)?;
        check_sampling(self.temperature, self.top_p)?;
        check_max_tokens("max_tokens", self.max_tokens)?;
        let inputs = self.prompt.inputs();
        if inputs.is_empty() {
            return Err(ApiError::invalid_param(
                "prompt",
                "prompt must not be empty.",
            ));
        }
        for p in inputs {
            let empty = match p {
                PromptInput::Text(t) => t.is_empty(),
                PromptInput::Tokens(t) => t.is_empty(),
            };
            if empty {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "prompt must not be empty.",
                ));
            }
        }
        Ok(())
    }

    /// Whether a final usage chunk is requested when streaming.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// Reads only the `model` field of a body (the router's first look at a request).
pub fn peek_model(body: &[u8]) -> Result<Option<String>, ApiError> {
    #[derive(Deserialize)]
    struct Peek {
        model: Option<String>,
    }
    let p: Peek = parse_body(body)?;
    Ok(p.model)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A well-formed body with a value of the wrong type names the parameter (QA: every such
    /// body was "invalid JSON", `param` null).
    #[test]
    fn a_value_of_the_wrong_type_names_its_parameter() {
        let m = r#""model":"m","messages":[{"role":"user","content":"hi"}]"#;
        for (body, param, code) in [
            (
                r#"{"model":"m","messages":"hi"}"#.to_string(),
                "messages",
                "invalid_type",
            ),
            (
                format!(r#"{{{m},"max_tokens":"4"}}"#),
                "max_tokens",
                "invalid_type",
            ),
            (
                format!(r#"{{{m},"stream":"yes"}}"#),
                "stream",
                "invalid_type",
            ),
            (format!(r#"{{{m},"user":5}}"#), "user", "invalid_type"),
            (
                format!(r#"{{{m},"stream_options":{{"include_usage":1}}}}"#),
                "stream_options.include_usage",
                "invalid_type",
            ),
            (
                r#"{"model":"m"}"#.to_string(),
                "messages",
                "missing_required_parameter",
            ),
        ] {
            let e = parse_body::<ChatCompletionRequest>(body.as_bytes()).expect_err(&body);
            assert_eq!(
                (e.status, e.param.as_deref(), e.code),
                (400, Some(param), code),
                "{body}: {}",
                e.message
            );
            assert!(e.message.contains(param), "{body}: {}", e.message);
        }
        // Not JSON at all stays what it was.
        let e = parse_body::<ChatCompletionRequest>(b"{\"model\":").expect_err("truncated");
        assert_eq!((e.code, e.param), ("invalid_json", None));
    }

    #[test]
    fn chat_parses_and_validates() {
        let r: ChatCompletionRequest = parse_body(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"unknown":1}"#,
        )
        .expect("parse");
        r.validate().expect("valid");
        assert_eq!(r.max_tokens().expect("ok"), Some(5));
    }

    #[test]
    fn sampling_parameters_vllm_refuses_are_refused() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
            parse_body::<ChatCompletionRequest>(body.as_bytes()).and_then(|r| r.check_openai())
        };
        let completion = |extra: &str| {
            let body = format!(r#"{{"prompt":"hi"{extra}}}"#);
            parse_body::<CompletionRequest>(body.as_bytes()).and_then(|r| r.check_openai())
        };
        for ok in [
            "",
            r#","temperature":0"#,
            r#","temperature":1.7,"top_p":1"#,
            r#","temperature":null"#,
        ] {
            assert!(chat(ok).is_ok() && completion(ok).is_ok(), "{ok}");
        }
        for (bad, param) in [
            (r#","temperature":-1"#, Some("temperature")),
            (r#","top_p":0"#, Some("top_p")),
            (r#","top_p":1.5"#, Some("top_p")),
            (r#","temperature":"hot""#, Some("temperature")),
        ] {
            for e in [chat(bad).unwrap_err(), completion(bad).unwrap_err()] {
                assert_eq!(
                    (e.status, e.param.as_deref()),
                    (400, param),
                    "{bad}: {}",
                    e.message
                );
            }
        }
    }

    #[test]
    fn logprobs_asked_for_are_told_apart_from_logprobs_declined() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
            parse_body::<ChatCompletionRequest>(body.as_bytes())
                .expect("parse")
                .wants_logprobs()
        };
        assert!(!chat(""));
        assert!(!chat(r#","logprobs":false"#));
        assert!(!chat(r#","logprobs":null,"top_logprobs":null"#));
        assert!(chat(r#","logprobs":true"#));
        assert!(chat(r#","top_logprobs":0"#));
        assert!(
            chat(r#","logprobs":"yes""#),
            "a router forwards odd values as they are"
        );
        let completion = |extra: &str| {
            let body = format!(r#"{{"prompt":"a"{extra}}}"#);
            parse_body::<CompletionRequest>(body.as_bytes())
                .expect("parse")
                .wants_logprobs()
        };
        assert!(!completion(""));
        assert!(!completion(r#","logprobs":null"#));
        assert!(completion(r#","logprobs":0"#));
    }

    #[test]
    fn bad_values_are_400() {
        let r: ChatCompletionRequest = parse_body(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":0}"#,
        )
        .expect("parse");
        let e = r.validate().expect_err("zero max_tokens");
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        // QA: 5e9 was clamped, and the context error named 4294967295.
        let r: ChatCompletionRequest = parse_body(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5000000000}"#,
        )
        .expect("parse");
        let e = r.validate().expect_err("too large");
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
        assert!(e.message.contains("5000000000"), "{}", e.message);
        let r: ChatCompletionRequest =
            parse_body(br#"{"model":"m","messages":[]}"#).expect("parse");
        assert!(r.validate().is_err());
        let r: ChatCompletionRequest =
            parse_body(br#"{"model":"m","messages":[{"content":"x"}]}"#).expect("parse");
        assert!(r.validate().is_err());
        assert_eq!(
            parse_body::<ChatCompletionRequest>(b"{not json")
                .expect_err("syntax")
                .code,
            "invalid_json"
        );
        assert_eq!(
            parse_body::<ChatCompletionRequest>(b"{\"model\":\"\xff\"}")
                .expect_err("utf8")
                .code,
            "invalid_utf8"
        );
    }

    #[test]
    fn null_booleans_read_as_false() {
        let r: ChatCompletionRequest = parse_body(
            br#"{"messages":[{"role":"user","content":"hi"}],"stream":null,"stream_options":{"include_usage":null,"continuous_usage_stats":null},"continue_final_message":null}"#,
        )
        .expect("nulls are accepted");
        assert!(!r.stream && !r.continue_final_message && !r.include_usage());
        let r: CompletionRequest =
            parse_body(br#"{"prompt":"a","stream":null,"echo":null}"#).expect("nulls");
        assert!(!r.stream && !r.echo);
        assert!(parse_body::<CompletionRequest>(br#"{"prompt":"a","stream":"yes"}"#).is_err());
    }

    #[test]
    fn messages_say_what_is_wrong_in_the_clients_terms() {
        for body in [&b"[]"[..], b"3", b"\"x\"", b" [1, 2]"] {
            let e = parse_body::<ChatCompletionRequest>(body).expect_err("not an object");
            assert!(e.message.contains("must be a JSON object"), "{}", e.message);
        }
        let e = parse_body::<CompletionRequest>(br#"{"prompt":{"a":1}}"#).expect_err("prompt");
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("must be a string"), "{}", e.message);
        assert!(!e.message.contains("untagged"), "{}", e.message);
    }

    #[test]
    fn the_openai_rules_leave_several_choices_to_the_engine() {
        let r: ChatCompletionRequest =
            parse_body(br#"{"messages":[{"role":"user","content":"hi"}],"n":3}"#).expect("parse");
        r.check_openai().expect("n = 3 is an engine's to serve");
        assert_eq!(
            r.validate().expect_err("one choice here").param.as_deref(),
            Some("n")
        );
        let r: CompletionRequest = parse_body(br#"{"prompt":"a","n":0}"#).expect("parse");
        assert_eq!(
            r.check_openai().expect_err("n = 0").param.as_deref(),
            Some("n")
        );
        let r: CompletionRequest = parse_body(br#"{"prompt":"a","max_tokens":-5}"#).expect("parse");
        assert_eq!(
            r.check_openai().expect_err("negative").param.as_deref(),
            Some("max_tokens")
        );
    }

    #[test]
    fn prompt_forms() {
        for (body, n) in [
            (&br#"{"prompt":"abc"}"#[..], 1),
            (br#"{"prompt":[1,2,3]}"#, 1),
            (br#"{"prompt":["a","b"]}"#, 2),
            (br#"{"prompt":[[1],[2],[3]]}"#, 3),
        ] {
            let r: CompletionRequest = parse_body(body).expect("parse");
            assert_eq!(r.prompt.inputs().len(), n);
            r.validate().expect("valid");
        }
        let r: CompletionRequest = parse_body(br#"{"prompt":""}"#).expect("parse");
        assert!(r.validate().is_err());
        assert!(parse_body::<CompletionRequest>(br#"{"prompt":[-1]}"#).is_err());
    }
}
