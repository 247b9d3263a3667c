//! Incremental detokenization for streaming responses (SSE).

use crate::error::TokenizeError;
use tokenizers::pipeline::PipelineTokenizer;

/// Turns generated ids into text deltas one id at a time, for streaming.
///
/// This is the prefix-tracking scheme of Hugging Face's `DecodeStream` (which vLLM's fast
/// incremental detokenizer uses), so the deltas are the ones vLLM would send: an id whose bytes
/// do not yet complete a UTF-8 character (or that a cross-token decoder needs context for) yields
/// `None`, and the text comes out with a later id.
///
/// Owned: it holds a cheap handle (an `Arc`) to the tokenizer, not a borrow, so it can live in a
/// per-request task. The concatenation of every [`StreamDecoder::push`] delta and the final
/// [`StreamDecoder::finish`] equals [`crate::Tokenizer::decode`] of all the ids.
pub struct StreamDecoder {
    tokenizer: PipelineTokenizer,
    skip_special_tokens: bool,
    /// Ids of the current window: context already emitted (`..prefix_index`) plus pending ones.
    ids: Vec<u32>,
    /// Decoded text of `ids[..prefix_index]`.
    prefix: String,
    prefix_index: usize,
}

impl std::fmt::Debug for StreamDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDecoder")
            .field("skip_special_tokens", &self.skip_special_tokens)
            .field("ids", &self.ids)
            .field("prefix_index", &self.prefix_index)
            .finish_non_exhaustive()
    }
}

impl StreamDecoder {
    pub(crate) fn new(tokenizer: PipelineTokenizer, skip_special_tokens: bool) -> Self {
        StreamDecoder {
            tokenizer,
            skip_special_tokens,
            ids: Vec::with_capacity(8),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(ids, self.skip_special_tokens)
            .map_err(|e| TokenizeError::Decode(e.to_string()))
    }

    /// Feed the next generated id. Returns the new text it completes, or `None` while a
    /// character is still incomplete (or the id decodes to nothing, e.g. a skipped special
    /// token).
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizeError> {
        if self.prefix.is_empty() && !self.ids.is_empty() {
            let new_prefix = self.decode(&self.ids)?;
            if !new_prefix.ends_with('\u{fffd}') {
                self.prefix = new_prefix;
                self.prefix_index = self.ids.len();
            }
        }
        self.ids.push(id);
        let text = self.decode(&self.ids)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{fffd}') {
            return Ok(None);
        }
        let Some(delta) = text.strip_prefix(self.prefix.as_str()) else {
            // The window no longer decodes to an extension of what was already sent (cannot
            // happen for byte-level BPE). Like vLLM, recover instead of failing the stream:
            // restart the window at this id and send what it decodes to.
            self.ids.clear();
            self.ids.push(id);
            self.prefix.clear();
            self.prefix_index = 0;
            let text = self.decode(&self.ids)?;
            if text.ends_with('\u{fffd}') || text.is_empty() {
                return Ok(None);
            }
            self.prefix = text.clone();
            self.prefix_index = 1;
            return Ok(Some(text));
        };
        let delta = delta.to_owned();
        // Keep only the ids that produced this delta as context for the next one.
        let new_prefix_index = self.ids.len() - self.prefix_index;
        self.ids.drain(..self.prefix_index);
        self.prefix = self.decode(&self.ids)?;
        self.prefix_index = new_prefix_index;
        Ok(Some(delta))
    }

    /// End of generation: the text still held back (an incomplete UTF-8 sequence at the very
    /// end decodes to U+FFFD, exactly as the one-shot decode would show it), or `None`.
    pub fn finish(&mut self) -> Result<Option<String>, TokenizeError> {
        if self.ids.len() <= self.prefix_index {
            return Ok(None);
        }
        let text = self.decode(&self.ids)?;
        let rest = text
            .strip_prefix(self.prefix.as_str())
            .map(str::to_owned)
            .unwrap_or_default();
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        Ok((!rest.is_empty()).then_some(rest))
    }
}
