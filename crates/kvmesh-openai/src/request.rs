//! Request bodies of `/v1/chat/completions` and `/v1/completions`, parsed leniently the way
//! vLLM does (unknown fields are accepted and ignored) and validated strictly (a bad value is a
//! 400 naming the parameter, never a panic).

use crate::ApiError;
use serde::Deserialize;
use serde_json::{Map, Value};

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
    /// Send `usage` in every chunk (vLLM extension).
    #[serde(default)]
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
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices.
    pub n: Option<i64>,
    /// End-user id (also a consistent-hash key for the router).
    pub user: Option<String>,
    /// Tool definitions passed to the chat template.
    pub tools: Option<Vec<Value>>,
    /// Extra variables for the chat template (vLLM extension), e.g. `enable_thinking`.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Append the assistant header (vLLM extension, default true).
    pub add_generation_prompt: Option<bool>,
    /// Continue the last (assistant) message instead of starting a new one (vLLM extension).
    #[serde(default)]
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
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices.
    pub n: Option<i64>,
    /// Echo the prompt in the answer.
    #[serde(default)]
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
    serde_json::from_slice(body).map_err(ApiError::invalid_json)
}

/// Checks a requested completion length: `None` stays `None`, ≤ 0 is a 400.
pub fn check_max_tokens(param: &'static str, v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid_param(
            param,
            format!("{param} must be at least 1, got {n}."),
        )),
        Some(n) => Ok(Some(u32::try_from(n).unwrap_or(u32::MAX))),
    }
}

/// Checks `n`: only a single choice is supported.
pub fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(v) if v < 1 => Err(ApiError::invalid_param(
            "n",
            format!("n must be at least 1, got {v}."),
        )),
        Some(v) => Err(ApiError::invalid_param(
            "n",
            format!("n = {v} is not supported: only one choice per request (n = 1)."),
        )),
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

    /// Validates what a server must reject before doing any work.
    pub fn validate(&self) -> Result<(), ApiError> {
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
        check_n(self.n)?;
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
    /// Validates what a server must reject before doing any work.
    pub fn validate(&self) -> Result<(), ApiError> {
        check_n(self.n)?;
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
        assert_eq!(e.param, Some("max_tokens"));
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
