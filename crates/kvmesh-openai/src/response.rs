//! Response bodies and streaming chunks of the OpenAI API, as vLLM emits them.

use serde::Serialize;

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// `usage`.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// Sum of both.
    pub total_tokens: u32,
    /// Prefix-cache details.
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    /// Usage for a finished request.
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// An assistant message.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage<'a> {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text.
    pub content: &'a str,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice<'a> {
    /// Index of the choice.
    pub index: u32,
    /// The message.
    pub message: ChatMessage<'a>,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
    /// Not produced by the simulator.
    pub logprobs: Option<()>,
}

/// A non-streamed chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion<'a> {
    /// Request id, `chatcmpl-…`.
    pub id: &'a str,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: &'a str,
    /// The choices.
    pub choices: Vec<ChatChoice<'a>>,
    /// Token counts.
    pub usage: Usage,
}

/// Delta of a streamed chat chunk.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta<'a> {
    /// Present on the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// Text delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
}

/// One choice of a streamed chat chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice<'a> {
    /// Index of the choice.
    pub index: u32,
    /// The delta.
    pub delta: ChatDelta<'a>,
    /// Set on the last content chunk.
    pub finish_reason: Option<&'static str>,
    /// Not produced by the simulator.
    pub logprobs: Option<()>,
}

/// A streamed chat chunk (`chat.completion.chunk`).
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk<'a> {
    /// Request id.
    pub id: &'a str,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: &'a str,
    /// Zero or one choice (zero in the final usage chunk).
    pub choices: Vec<ChatChunkChoice<'a>>,
    /// Present in the usage chunk (and every chunk with continuous usage stats).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a text completion (streamed or not).
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice<'a> {
    /// Index of the choice.
    pub index: u32,
    /// Generated text (or its delta when streaming).
    pub text: &'a str,
    /// `stop`, `length`, or null while streaming.
    pub finish_reason: Option<&'static str>,
    /// Not produced by the simulator.
    pub logprobs: Option<()>,
}

/// A text completion or one of its streamed chunks (`text_completion`).
#[derive(Debug, Clone, Serialize)]
pub struct Completion<'a> {
    /// Request id, `cmpl-…`.
    pub id: &'a str,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: &'a str,
    /// The choices.
    pub choices: Vec<CompletionChoice<'a>>,
    /// Token counts (always on the full response; on the usage chunk when streaming).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One entry of `/v1/models`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ModelCard {
    /// Model name.
    pub id: String,
    /// `model` (read leniently: an engine's list needs only each model's `id`).
    #[serde(default)]
    pub object: String,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// Owner (vLLM says `vllm`).
    #[serde(default)]
    pub owned_by: String,
    /// Root model.
    #[serde(default)]
    pub root: Option<String>,
    /// Context length (vLLM extension).
    #[serde(default)]
    pub max_model_len: Option<u32>,
    /// For a LoRA adapter: the base model it runs on (vLLM lists adapters this way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// `/v1/models`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ModelList {
    /// `list`.
    #[serde(default)]
    pub object: String,
    /// The models.
    pub data: Vec<ModelCard>,
}

/// Renders one SSE event carrying `value` as JSON.
pub fn sse_json<T: Serialize>(value: &T) -> String {
    let mut s = String::with_capacity(256);
    s.push_str("data: ");
    // Serialising these plain structs cannot fail.
    s.push_str(&serde_json::to_string(value).unwrap_or_default());
    s.push_str("\n\n");
    s
}

/// The terminating SSE event.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_s_model_list_needs_only_the_ids() {
        // QA: a list without `created` left its engine out of every route, silently.
        let list: ModelList =
            serde_json::from_str(r#"{"data":[{"id":"m","max_model_len":4096}]}"#).expect("list");
        assert_eq!(list.data[0].id, "m");
        assert_eq!(list.data[0].max_model_len, Some(4096));
        assert!(serde_json::from_str::<ModelList>(r#"{"data":[{"object":"model"}]}"#).is_err());
    }
}
