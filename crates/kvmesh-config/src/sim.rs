//! `[sim]`: the engine simulator (`kvmesh sim`).

use crate::{ConfigError, check};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The most KV-cache blocks a simulated engine has (`sim.engine.num_blocks`, `--kv-blocks`):
/// 16M blocks, 268M tokens of 16 (the engine's block pool holds below `u32::MAX`, and
/// allocates per block at start).
pub const MAX_NUM_BLOCKS: u32 = 1 << 24;
/// The range of `sim.time_scale` (`--time-scale`): beyond it simulated durations overflow.
pub const MIN_TIME_SCALE: f64 = 0.001;
/// See [`MIN_TIME_SCALE`].
pub const MAX_TIME_SCALE: f64 = 1000.0;
/// The largest timing override (`[sim.engine.timing]`), in its unit.
const MAX_TIMING: f64 = 1e6;

/// Configuration of one simulated engine (`kvmesh sim`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// HTTP address the OpenAI-compatible API listens on.
    pub listen: String,
    /// Model name served (what `/v1/models` lists and requests must name).
    pub model: String,
    /// LoRA adapters served on top of the model (vLLM `--lora-modules NAME=PATH`): requests
    /// naming one are served by the same engine with the adapter's name mixed into every
    /// block hash (and sent in the KV events' `lora_name`); `/v1/models` lists them with the
    /// model as `parent`.
    pub lora_modules: Vec<String>,
    /// Path to a Hugging Face `tokenizer.json` (or a directory holding it and
    /// `tokenizer_config.json`); empty = the bundled Qwen3 tokenizer.
    pub tokenizer: String,
    /// Maximum prompt + completion length in tokens (vLLM `--max-model-len`).
    pub max_model_len: u32,
    /// Completion length when a request gives no `max_tokens` (the simulator always generates
    /// exactly `max_tokens`, as vLLM does with `ignore_eos`).
    pub default_max_tokens: u32,
    /// Multiplies every simulated duration: 0.1 runs ten times faster than real time. From
    /// 0.001 to 1000.
    pub time_scale: f64,
    /// Seed of every random choice (generated tokens, fault dice, the engine's block-hash seed).
    pub seed: u64,
    /// Largest request body accepted, in bytes (at least 1024). Above the router's own limit
    /// (`serve.max_body_bytes`), as vLLM sets none: a body the router accepts is never
    /// refused by the engine half-way through its upload (which the router would see as a
    /// broken connection, retry, and hold against the engine).
    pub max_body_bytes: usize,
    /// The engine model: cache, batching, timing.
    pub engine: EngineModelConfig,
    /// KV-cache events publisher (vLLM's ZMQ format).
    pub kv_events: KvEventsConfig,
    /// Faults active from start-up (also settable at run time via `/admin/faults`).
    pub faults: FaultConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            listen: "127.0.0.1:8100".to_string(),
            model: "Qwen/Qwen3-8B".to_string(),
            lora_modules: Vec::new(),
            tokenizer: String::new(),
            max_model_len: 32_768,
            default_max_tokens: 64,
            time_scale: 1.0,
            seed: 0,
            max_body_bytes: 64 * 1024 * 1024,
            engine: EngineModelConfig::default(),
            kv_events: KvEventsConfig::default(),
            faults: FaultConfig::default(),
        }
    }
}

impl SimConfig {
    /// The files it names exist (its tokenizer), as `kvmesh sim` needs them at start.
    pub fn check_files(&self) -> Result<(), ConfigError> {
        check(
            self.tokenizer.is_empty() || std::path::Path::new(&self.tokenizer).exists(),
            "sim.tokenizer",
            &format!("names {}, which does not exist", self.tokenizer),
        )
    }

    pub(crate) fn validate(&self, at: &str) -> Result<(), ConfigError> {
        check(
            !self.model.is_empty(),
            &format!("{at}.model"),
            "must not be empty",
        )?;
        check(
            self.listen.parse::<std::net::SocketAddr>().is_ok(),
            &format!("{at}.listen"),
            "must be an IP:port address such as 127.0.0.1:8100",
        )?;
        check(
            self.max_model_len >= 16,
            &format!("{at}.max_model_len"),
            "must be at least 16 tokens",
        )?;
        check(
            self.default_max_tokens >= 1,
            &format!("{at}.default_max_tokens"),
            "must be at least 1",
        )?;
        check(
            (MIN_TIME_SCALE..=MAX_TIME_SCALE).contains(&self.time_scale),
            &format!("{at}.time_scale"),
            "must be from 0.001 to 1000 (0.1 = ten times faster than real time)",
        )?;
        check(
            self.max_body_bytes >= 1024,
            &format!("{at}.max_body_bytes"),
            "must be at least 1024",
        )?;
        self.engine.validate(&format!("{at}.engine"))?;
        let block = u64::from(self.engine.block_size.max(1));
        check(
            block * u64::from(self.engine.num_blocks) >= u64::from(self.max_model_len),
            &format!("{at}.engine.num_blocks"),
            &format!(
                "the cache must hold at least one max_model_len sequence: {} blocks of {block} tokens hold {}, under max_model_len {}; give at least {} blocks (--kv-blocks) or a smaller max_model_len (--max-model-len)",
                self.engine.num_blocks,
                block * u64::from(self.engine.num_blocks),
                self.max_model_len,
                u64::from(self.max_model_len).div_ceil(block)
            ),
        )?;
        for (i, l) in self.lora_modules.iter().enumerate() {
            check(
                !l.is_empty() && *l != self.model && !self.lora_modules[..i].contains(l),
                &format!("{at}.lora_modules[{i}]"),
                "must be a non-empty name, distinct from the model and the other adapters",
            )?;
        }
        self.kv_events.validate(&format!("{at}.kv_events"))?;
        self.faults.validate(&format!("{at}.faults"))
    }
}

/// The engine model: paged prefix cache, continuous batching and the timing profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineModelConfig {
    /// Tokens per KV-cache block (vLLM default 16). The router's block size must match it for
    /// precise routing.
    pub block_size: u32,
    /// KV-cache capacity in blocks. Default 24,000 blocks × 16 = 384k tokens: an 8B model with
    /// 8 KV heads × 128 dims × 36 layers in bf16 needs 144 KiB per token, and an 80 GB H100 at
    /// 90% utilisation minus 16 GB of weights leaves ~56 GB ≈ 380k tokens. From 2 to 16777216.
    pub num_blocks: u32,
    /// Maximum sequences running at once (vLLM `--max-num-seqs`, default 256).
    pub max_num_seqs: u32,
    /// Token budget of one engine step, decodes plus prefill chunks (vLLM
    /// `--max-num-batched-tokens`; 8192 is vLLM V1's default for online serving on H100).
    pub max_num_batched_tokens: u32,
    /// Reuse cached blocks across requests (vLLM `--enable-prefix-caching`, on by default in V1).
    pub enable_prefix_caching: bool,
    /// Name of the timing profile (see `kvmesh sim --list-profiles`).
    pub profile: String,
    /// Per-parameter overrides of the profile; unset fields keep the profile's values.
    pub timing: TimingOverrides,
}

impl Default for EngineModelConfig {
    fn default() -> Self {
        EngineModelConfig {
            block_size: 16,
            num_blocks: 24_000,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            enable_prefix_caching: true,
            profile: "h100-8b".to_string(),
            timing: TimingOverrides::default(),
        }
    }
}

impl EngineModelConfig {
    pub(crate) fn validate(&self, at: &str) -> Result<(), ConfigError> {
        check(
            (1..=4096).contains(&self.block_size),
            &format!("{at}.block_size"),
            "must be between 1 and 4096 tokens",
        )?;
        check(
            (2..=MAX_NUM_BLOCKS).contains(&self.num_blocks),
            &format!("{at}.num_blocks"),
            "must be from 2 to 16777216",
        )?;
        check(
            self.max_num_seqs >= 1,
            &format!("{at}.max_num_seqs"),
            "must be at least 1",
        )?;
        check(
            self.max_num_batched_tokens >= self.block_size.max(1),
            &format!("{at}.max_num_batched_tokens"),
            "must be at least one block",
        )?;
        check(
            !self.profile.is_empty(),
            &format!("{at}.profile"),
            "must name a timing profile",
        )?;
        self.timing.validate(&format!("{at}.timing"))
    }
}

/// Optional overrides of a timing profile's parameters (see the engine model's docs for the
/// formula: step time = base + prefill + prefill attention + decode + decode attention).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimingOverrides {
    /// Fixed cost of one engine step, milliseconds (0 to 1000000).
    pub step_base_ms: Option<f64>,
    /// Cost per prefill token (linear layers), microseconds (0 to 1000000).
    pub prefill_token_us: Option<f64>,
    /// Cost per (prefill token × context token it attends to), nanoseconds (0 to 1000000).
    pub prefill_attention_ns: Option<f64>,
    /// Cost per decoding sequence in the batch, microseconds (0 to 1000000).
    pub decode_seq_us: Option<f64>,
    /// Cost per context token attended by a decoding sequence, nanoseconds (0 to 1000000).
    pub decode_context_ns: Option<f64>,
}

impl TimingOverrides {
    fn validate(&self, at: &str) -> Result<(), ConfigError> {
        for (name, v) in [
            ("step_base_ms", self.step_base_ms),
            ("prefill_token_us", self.prefill_token_us),
            ("prefill_attention_ns", self.prefill_attention_ns),
            ("decode_seq_us", self.decode_seq_us),
            ("decode_context_ns", self.decode_context_ns),
        ] {
            if let Some(v) = v {
                check(
                    (0.0..=MAX_TIMING).contains(&v),
                    &format!("{at}.{name}"),
                    "must be a number from 0 to 1000000 (in its unit: ms, µs or ns)",
                )?;
            }
        }
        Ok(())
    }
}

/// Wire encoding of KV events: vLLM's positional arrays or (since mid-2026) maps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvEventsFormat {
    /// Positional arrays, as vLLM up to ~0.23 emits.
    #[default]
    Array,
    /// Maps keyed by field name with the tag under `"type"`.
    Map,
}

impl FromStr for KvEventsFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "array" => Ok(KvEventsFormat::Array),
            "map" => Ok(KvEventsFormat::Map),
            other => Err(format!("unknown KV events format `{other}` (array|map)")),
        }
    }
}

impl fmt::Display for KvEventsFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvEventsFormat::Array => "array",
            KvEventsFormat::Map => "map",
        })
    }
}

/// The KV-events publisher of the simulated engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// ZMQ PUB endpoint, e.g. `tcp://127.0.0.1:5557`; empty = no events.
    pub endpoint: String,
    /// ZMQ ROUTER endpoint answering replay requests; empty = no replay socket.
    pub replay_endpoint: String,
    /// `array` or `map`.
    pub format: KvEventsFormat,
    /// Topic frame of every message (vLLM default "").
    pub topic: String,
    /// Batches kept for replay (vLLM keeps 10,000).
    pub replay_buffer: usize,
    /// Block hashes as ints (vLLM default) or raw bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    pub int_block_hashes: bool,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            endpoint: String::new(),
            replay_endpoint: String::new(),
            format: KvEventsFormat::Array,
            topic: String::new(),
            replay_buffer: 10_000,
            int_block_hashes: true,
        }
    }
}

impl KvEventsConfig {
    fn validate(&self, at: &str) -> Result<(), ConfigError> {
        for (name, v) in [
            ("endpoint", &self.endpoint),
            ("replay_endpoint", &self.replay_endpoint),
        ] {
            check(
                v.is_empty() || v.starts_with("tcp://"),
                &format!("{at}.{name}"),
                "must be empty or a tcp:// endpoint such as tcp://127.0.0.1:5557",
            )?;
        }
        check(
            self.replay_endpoint.is_empty() || !self.endpoint.is_empty(),
            &format!("{at}.replay_endpoint"),
            "needs kv_events.endpoint to be set too",
        )?;
        check(
            self.replay_buffer >= 1,
            &format!("{at}.replay_buffer"),
            "must be at least 1",
        )
    }
}

/// Injected faults. All fields are optional in `POST /admin/faults` and merged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// Fraction of requests answered with `error_status` instead of being served (0..=1).
    pub error_rate: f64,
    /// Status of injected errors: 500 or 429 (any 4xx/5xx is accepted).
    pub error_status: u16,
    /// Extra latency before each request is admitted, milliseconds (not time-scaled).
    pub added_latency_ms: u64,
    /// Every engine step takes this many times longer (gray failure, thermal throttling).
    pub slowdown: f64,
    /// Accept requests and never answer them (the engine stops stepping).
    pub hang: bool,
    /// Consume event seqs without sending the batches (subscribers see gaps).
    pub drop_events: bool,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            error_rate: 0.0,
            error_status: 500,
            added_latency_ms: 0,
            slowdown: 1.0,
            hang: false,
            drop_events: false,
        }
    }
}

impl FaultConfig {
    /// Checks ranges; `at` is the dotted key prefix used in errors.
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        check(
            (0.0..=1.0).contains(&self.error_rate),
            &format!("{at}.error_rate"),
            "must be between 0 and 1",
        )?;
        check(
            (400..=599).contains(&self.error_status),
            &format!("{at}.error_status"),
            "must be an HTTP error status (400..=599), e.g. 500 or 429",
        )?;
        check(
            self.slowdown.is_finite() && self.slowdown >= 1.0 && self.slowdown <= 1000.0,
            &format!("{at}.slowdown"),
            "must be between 1 and 1000",
        )?;
        check(
            self.added_latency_ms <= 600_000,
            &format!("{at}.added_latency_ms"),
            "must be at most 600000 (10 minutes)",
        )
    }
}
