//! `[serve.prefix]` and `[serve.models.<name>]`: what cache-aware routing needs — the
//! tokenizer and block size of each model, the prefix index bounds, speculative-entry lifetimes
//! and the KV-event ingestion limits.

use crate::{ConfigError, check};
use kvmesh_policy::PolicyConfig;
use serde::{Deserialize, Serialize};

/// Cache-aware routing defaults (per-model overrides in [`ModelConfig`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixConfig {
    /// Tokenizer of the models: a `tokenizer.json` (or `.json.gz`) or a directory holding one
    /// (with `tokenizer_config.json` for the chat template). Empty = the bundled Qwen3
    /// tokenizer. It must be the engines' tokenizer for `precise` routing to find their blocks.
    pub tokenizer: String,
    /// Tokens per KV-cache block: must equal the engines' block size (vLLM's default is 16) for
    /// `precise` routing; events of another block size are skipped and counted.
    pub block_size: u32,
    /// Prefix-index entries kept per engine at most (LRU beyond): at least the engine's
    /// KV-cache size in blocks (`num_gpu_blocks`) for `precise` routing. About 50 bytes each.
    pub engine_capacity_blocks: u32,
    /// How long a routing decision marks the chosen engine as holding the request's blocks
    /// under `precise` and `scored` (until its KV events confirm them), ms; a block the engine
    /// reports removed loses its mark at once. llm-d uses 2 s, Dynamo 5 s.
    pub speculative_ttl_ms: u64,
    /// How long a routing decision is remembered under `cache_aware` (which learns only from
    /// its own decisions), and for engines whose event stream is stale, ms. Dynamo's
    /// approximate mode and SGLang's tree eviction use 120 s. Meshed, a peer's mark that
    /// expires more than the longer of the two lifetimes + 10 s from now is refused (a clock
    /// far ahead): give the routers of a cluster the same lifetimes.
    pub approximate_ttl_ms: u64,
    /// Token ids of prompt pieces kept for reuse across the turns of conversations, per
    /// tokenizer (4 bytes each, plus 48 bytes per piece counted as 12 ids; two generations:
    /// at most twice this many are held).
    pub tokenizer_cache_tokens: usize,
    /// Bytes of recently routed chat prompts (text, token ids, block keys) kept per tokenizer
    /// so that the next turn of a conversation only tokenizes and hashes its new part; prompts
    /// under 4 KB are not kept. 0 disables it.
    pub prompt_memo_bytes: usize,
    /// Request bodies of at least this many bytes have their prompt prepared (rendered,
    /// tokenized, hashed) on the blocking thread pool, off the threads that serve requests, so
    /// that a long prompt never holds up the requests sharing its thread.
    pub offload_prepare_bytes: usize,
    /// At most this many prompts are prepared on the blocking pool at once (others wait for a
    /// turn without holding a thread).
    pub offload_prepare_threads: usize,
    /// Prompts longer than this many tokens are routed on their first
    /// `max_prompt_tokens` tokens only (bounds the per-request hashing work).
    pub max_prompt_tokens: usize,
    /// Event batches queued between an engine's ZMQ socket and the index; beyond it batches
    /// are dropped (counted; the engine goes stale and is resynchronised).
    pub ingest_queue_batches: usize,
    /// Bound on one replay exchange with an engine's replay socket, ms.
    pub replay_timeout_ms: u64,
    /// Batches a replay fills a gap with at most. A wider gap — a router subscribing to an
    /// engine with a long history (vLLM keeps 10,000 batches) — is not filled: the
    /// router reads only the last `replay_max_batches` before the batch that revealed it and
    /// resynchronises exactly from the last `AllBlocksCleared` among them (a reset), or else
    /// marks the engine stale (its marks live `approximate_ttl_ms`) until its next clear.
    pub replay_max_batches: u64,
    /// ZMQ topic filter of the KV-event subscriptions (vLLM's default topic is empty).
    pub kv_events_topic: String,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            tokenizer: String::new(),
            block_size: 16,
            engine_capacity_blocks: 131_072,
            speculative_ttl_ms: 2_000,
            approximate_ttl_ms: 120_000,
            tokenizer_cache_tokens: 2_000_000,
            prompt_memo_bytes: 32 << 20,
            offload_prepare_bytes: 16 * 1024,
            offload_prepare_threads: 2,
            max_prompt_tokens: 262_144,
            ingest_queue_batches: 1_024,
            replay_timeout_ms: 2_000,
            replay_max_batches: 1_000,
            kv_events_topic: String::new(),
        }
    }
}

impl PrefixConfig {
    pub(crate) fn validate(&self, at: &str) -> Result<(), ConfigError> {
        check(
            (1..=4096).contains(&self.block_size),
            &format!("{at}.block_size"),
            "must be between 1 and 4096",
        )?;
        check(
            (1..=1 << 24).contains(&self.engine_capacity_blocks),
            &format!("{at}.engine_capacity_blocks"),
            "must be between 1 and 16777216",
        )?;
        check(
            (10..=600_000).contains(&self.speculative_ttl_ms),
            &format!("{at}.speculative_ttl_ms"),
            "must be between 10 and 600000",
        )?;
        check(
            (10..=86_400_000).contains(&self.approximate_ttl_ms),
            &format!("{at}.approximate_ttl_ms"),
            "must be between 10 and 86400000",
        )?;
        check(
            self.max_prompt_tokens >= 1,
            &format!("{at}.max_prompt_tokens"),
            "must be at least 1",
        )?;
        check(
            (1..=1 << 20).contains(&self.ingest_queue_batches),
            &format!("{at}.ingest_queue_batches"),
            "must be between 1 and 1048576",
        )?;
        check(
            self.tokenizer_cache_tokens <= 1 << 30,
            &format!("{at}.tokenizer_cache_tokens"),
            "must be at most 1073741824",
        )?;
        check(
            self.prompt_memo_bytes <= 1 << 34,
            &format!("{at}.prompt_memo_bytes"),
            "must be at most 17179869184",
        )?;
        check(
            (1..=256).contains(&self.offload_prepare_threads),
            &format!("{at}.offload_prepare_threads"),
            "must be between 1 and 256",
        )?;
        check(
            (10..=86_400_000).contains(&self.replay_timeout_ms),
            &format!("{at}.replay_timeout_ms"),
            "must be between 10 and 86400000",
        )?;
        check(
            (1..=1_000_000).contains(&self.replay_max_batches),
            &format!("{at}.replay_max_batches"),
            "must be between 1 and 1000000",
        )
    }
}

/// One model's own settings; every key is optional and falls back to `[serve.routing.policy]`
/// and `[serve.prefix]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The model's policy (`[serve.models."NAME".policy]`); default: `[serve.routing.policy]`.
    pub policy: Option<PolicyConfig>,
    /// The model's tokenizer; default: `serve.prefix.tokenizer`.
    pub tokenizer: Option<String>,
    /// The model's block size; default: `serve.prefix.block_size`.
    pub block_size: Option<u32>,
    /// The model is a LoRA adapter: its name is mixed into every block key, as vLLM hashes
    /// an adapter's blocks. Default: what the engines' `/v1/models` says (an adapter is listed
    /// with a `parent`).
    pub lora: Option<bool>,
}

impl ModelConfig {
    pub(crate) fn validate(&self, at: &str) -> Result<(), ConfigError> {
        if let Some(p) = &self.policy {
            p.validate(&format!("{at}.policy"))
                .map_err(|e| ConfigError::invalid(&e.key, e.message))?;
        }
        if let Some(b) = self.block_size {
            check(
                (1..=4096).contains(&b),
                &format!("{at}.block_size"),
                "must be between 1 and 4096",
            )?;
        }
        Ok(())
    }
}
