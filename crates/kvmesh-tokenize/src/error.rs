//! The crate's single error type.

/// Everything that can go wrong while loading a tokenizer, rendering a chat template, encoding or
/// decoding.
///
/// The `Display` text of every variant is written to be shown to a person; the text of
/// [`TokenizeError::Template`] is additionally fit to be returned verbatim to an API client in a
/// `400 Bad Request` body (it is the message a template passed to `raise_exception`, or a short
/// description of what in the request made rendering fail).
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A tokenizer (or its `tokenizer_config.json`) could not be read, parsed or built.
    #[error("cannot load tokenizer from {path}: {reason}")]
    Load {
        /// The file or directory (or `"qwen3 (bundled)"`) that was being loaded.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The chat request could not be rendered: the template called `raise_exception(msg)` (the
    /// text is then exactly `msg`), the template failed (undefined attribute, type error, ...),
    /// the template source does not compile, or the messages are malformed (e.g. an
    /// `image_url` content part for this text-only renderer).
    #[error("{0}")]
    Template(String),
    /// Chat rendering was asked of a tokenizer that has no chat template (its
    /// `tokenizer_config.json` was missing or had no `chat_template`).
    #[error(
        "tokenizer {tokenizer} has no chat template (no chat_template in tokenizer_config.json or \
         chat_template.jinja); chat requests cannot be rendered"
    )]
    NoChatTemplate {
        /// [`crate::Tokenizer::name`] of the tokenizer.
        tokenizer: String,
    },
    /// The tokenizer pipeline failed to encode the text.
    #[error("encode failed: {0}")]
    Encode(String),
    /// The tokenizer pipeline failed to decode the ids.
    #[error("decode failed: {0}")]
    Decode(String),
}

impl TokenizeError {
    /// `true` when the error was caused by the request (a template error or malformed messages),
    /// i.e. an HTTP front end should answer `400`; `false` for server-side problems.
    pub fn is_client_error(&self) -> bool {
        matches!(self, TokenizeError::Template(_))
    }

    pub(crate) fn load(path: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        TokenizeError::Load {
            path: path.into(),
            reason: reason.to_string(),
        }
    }
}
