//! The OpenAI API as kvmesh speaks it: request bodies (parsed leniently, validated strictly),
//! response bodies and stream chunks as vLLM emits them, and OpenAI-shaped errors.
//! Shared by the engine simulator and the router; pure (no I/O).

#![forbid(unsafe_code)]
mod error;
mod request;
mod response;

pub use error::{ApiError, clip};
pub use request::{
    ChatCompletionRequest, CompletionRequest, Prompt, PromptInput, StreamOptions, check_max_tokens,
    check_n, check_n_positive, parse_body, peek_model,
};
pub use response::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatMessage,
    Completion, CompletionChoice, ModelCard, ModelList, PromptTokensDetails, SSE_DONE, Usage,
    sse_json,
};
