//! `kvmesh sim`: flags, their merge over the config file, and the run loop.

use clap::Args;
use kvmesh_config::{KvEventsFormat, KvmeshConfig, SimConfig};
use std::path::PathBuf;

fn d() -> SimConfig {
    SimConfig::default()
}

/// Flags of `kvmesh sim`. Every flag overrides the same key of the config file; defaults come
/// from `kvmesh_config::SimConfig` (the one source of every default).
#[derive(Debug, Args)]
pub struct SimArgs {
    /// TOML config file (section `[sim]`); flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[arg(long, value_name = "IP:PORT", help = format!("HTTP address of the OpenAI API [default: {}]", d().listen))]
    pub listen: Option<String>,
    #[arg(long, value_name = "NAME", help = format!("Model name served [default: {}]", d().model))]
    pub model: Option<String>,
    /// A LoRA adapter served on top of the model (repeatable; vLLM's --lora-modules NAME=PATH,
    /// the path is ignored): requests naming it get the adapter's name in their block hashes
    /// and KV events.
    #[arg(long = "lora-modules", value_name = "NAME[=PATH]")]
    pub lora_modules: Vec<String>,
    #[arg(
        long,
        value_name = "ENDPOINT",
        help = "ZMQ PUB endpoint of the KV-cache events, e.g. tcp://127.0.0.1:5557 [default: none]"
    )]
    pub kv_events: Option<String>,
    #[arg(
        long,
        value_name = "ENDPOINT",
        help = "ZMQ ROUTER endpoint answering KV-event replay requests [default: none]"
    )]
    pub kv_events_replay: Option<String>,
    #[arg(long, value_name = "array|map", help = format!("Wire encoding of KV events: vLLM's positional arrays or maps [default: {}]", d().kv_events.format))]
    pub kv_events_format: Option<KvEventsFormat>,
    #[arg(
        long,
        value_name = "TOPIC",
        help = "Topic frame of every KV-event message [default: \"\"]"
    )]
    pub kv_events_topic: Option<String>,
    #[arg(long, value_name = "N", help = format!("KV-cache capacity in blocks [default: {}]", d().engine.num_blocks))]
    pub kv_blocks: Option<u32>,
    #[arg(long, value_name = "N", help = format!("Tokens per KV-cache block [default: {}]", d().engine.block_size))]
    pub block_size: Option<u32>,
    #[arg(long, value_name = "N", help = format!("Maximum running sequences [default: {}]", d().engine.max_num_seqs))]
    pub max_num_seqs: Option<u32>,
    #[arg(long, value_name = "N", help = format!("Token budget of one engine step (chunked prefill) [default: {}]", d().engine.max_num_batched_tokens))]
    pub max_num_batched_tokens: Option<u32>,
    #[arg(long, value_name = "N", help = format!("Maximum prompt + completion tokens [default: {}]", d().max_model_len))]
    pub max_model_len: Option<u32>,
    #[arg(long, value_name = "N", help = format!("Completion length when a request sets no max_tokens [default: {}]", d().default_max_tokens))]
    pub default_max_tokens: Option<u32>,
    #[arg(long, value_name = "NAME", help = format!("Timing profile (see --list-profiles) [default: {}]", d().engine.profile))]
    pub profile: Option<String>,
    #[arg(long, value_name = "F", help = format!("Multiplies every simulated duration: 0.1 = ten times faster than real time [default: {}]", d().time_scale))]
    pub time_scale: Option<f64>,
    #[arg(long, value_name = "N", help = format!("Seed of generated tokens, fault dice and the engine's block-hash seed [default: {}]", d().seed))]
    pub seed: Option<u64>,
    #[arg(
        long,
        value_name = "PATH",
        help = "tokenizer.json (or a directory with it and tokenizer_config.json) [default: the bundled Qwen3 tokenizer]"
    )]
    pub tokenizer: Option<String>,
    #[arg(long, help = "Disable prefix caching (no reuse, no KV events)")]
    pub no_prefix_caching: bool,
    /// List the timing profiles with their parameters and exit.
    #[arg(long)]
    pub list_profiles: bool,
}

impl SimArgs {
    /// The effective configuration: defaults ← file ← flags, validated.
    pub fn resolve(&self) -> Result<SimConfig, String> {
        let mut file = match &self.config {
            Some(p) => KvmeshConfig::read(p).map_err(|e| e.to_string())?,
            None => KvmeshConfig::default(),
        };
        let c = &mut file.sim;
        macro_rules! set {
            ($flag:expr, $field:expr) => {
                if let Some(v) = $flag.clone() {
                    $field = v;
                }
            };
        }
        set!(self.listen, c.listen);
        set!(self.model, c.model);
        c.lora_modules.extend(
            self.lora_modules
                .iter()
                .map(|l| l.split_once('=').map_or(l.as_str(), |(n, _)| n).to_string()),
        );
        set!(self.kv_events, c.kv_events.endpoint);
        set!(self.kv_events_replay, c.kv_events.replay_endpoint);
        set!(self.kv_events_format, c.kv_events.format);
        set!(self.kv_events_topic, c.kv_events.topic);
        set!(self.kv_blocks, c.engine.num_blocks);
        set!(self.block_size, c.engine.block_size);
        set!(self.max_num_seqs, c.engine.max_num_seqs);
        set!(self.max_num_batched_tokens, c.engine.max_num_batched_tokens);
        set!(self.max_model_len, c.max_model_len);
        set!(self.default_max_tokens, c.default_max_tokens);
        set!(self.profile, c.engine.profile);
        set!(self.time_scale, c.time_scale);
        set!(self.seed, c.seed);
        set!(self.tokenizer, c.tokenizer);
        if self.no_prefix_caching {
            c.engine.enable_prefix_caching = false;
        }
        // Its own section only (QA33: a shared file's [serve], which leaves node_id to each
        // router's flag, stopped the simulator).
        file.validate_sim().map_err(|e| e.to_string())?;
        Ok(file.sim)
    }
}

/// Prints the timing profiles.
pub fn list_profiles() {
    for name in kvmesh_engine::TimingProfile::names() {
        if let Some(p) = kvmesh_engine::TimingProfile::by_name(name) {
            println!(
                "{name}: step_base_ms={} prefill_token_us={} prefill_attention_ns={} \
                 decode_seq_us={} decode_context_ns={}\n    {}",
                p.step_base_ms,
                p.prefill_token_us,
                p.prefill_attention_ns,
                p.decode_seq_us,
                p.decode_context_ns,
                p.description
            );
        }
    }
}

/// Runs one simulator until Ctrl-C / SIGTERM, then drains.
pub async fn run(cfg: SimConfig) -> Result<(), String> {
    let server = kvmesh_sim::start(cfg.clone())
        .await
        .map_err(|e| e.to_string())?;
    // The endpoints as bound: port 0 in the config asks the OS for a free one.
    let events = match (&server.kv_events_endpoint, &server.kv_replay_endpoint) {
        (Some(e), Some(r)) => format!("{e}, replay {r}"),
        (Some(e), None) => e.clone(),
        _ => "off".into(),
    };
    eprintln!(
        "kvmesh sim: model {} on {} (kv events: {events}), profile {}, time scale {}",
        cfg.model,
        server.base_url(),
        cfg.engine.profile,
        cfg.time_scale
    );
    crate::wait_for_signal().await;
    eprintln!("kvmesh sim: shutting down, draining open requests");
    server.shutdown(std::time::Duration::from_secs(30)).await;
    Ok(())
}
