//! Engine parameters.

use crate::profile::TimingProfile;
use kvmesh_config::EngineModelConfig;

/// What the prefix cache does when a block becomes full and an identical block (same hash) is
/// already cached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DuplicateBlocks {
    /// vLLM's behaviour (`BlockHashToBlockMap`, "we don't de-duplicate the blocks in the
    /// cache"): the new block is cached too, under the same hash; a `BlockStored` is emitted for
    /// it and a `BlockRemoved` for each copy when it is evicted. A consumer must count copies
    /// per hash. Happens when a block-aligned prompt is repeated (its last block is always
    /// recomputed) and when identical prompts are prefilled concurrently in chunks.
    #[default]
    Keep,
    /// Never cache a hash twice: the request drops its freshly computed copy and references the
    /// cached block instead (no `BlockStored` for it). Not what vLLM does; for tests and
    /// experiments that want one block per hash.
    Share,
}

/// Everything [`crate::Engine::new`] needs.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineParams {
    /// Tokens per KV block (vLLM default 16).
    pub block_size: u32,
    /// KV-cache capacity in blocks.
    pub num_blocks: u32,
    /// Maximum running requests (vLLM `--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Token budget of one step (vLLM `--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Reuse cached blocks across requests; when false there are no hits and no KV events.
    pub enable_prefix_caching: bool,
    /// Maximum prompt + completion length (vLLM `--max-model-len`).
    pub max_model_len: u32,
    /// Step timing.
    pub profile: TimingProfile,
    /// Seeds the block hash (like vLLM's per-process hash seed) and the sampled output tokens.
    pub seed: u64,
    /// Token ids outputs are sampled from; empty means `0..1000`.
    pub output_vocab: Vec<u32>,
    /// Duplicate full blocks: vLLM keeps them (default).
    pub duplicate_blocks: DuplicateBlocks,
}

impl EngineParams {
    /// Parameters from the `[sim.engine]` config section. Fails when the profile name is unknown
    /// (the message lists the known names).
    pub fn from_config(
        cfg: &EngineModelConfig,
        max_model_len: u32,
        seed: u64,
    ) -> Result<EngineParams, String> {
        let profile = TimingProfile::by_name(&cfg.profile).ok_or_else(|| {
            format!(
                "unknown timing profile `{}` (known profiles: {})",
                cfg.profile,
                TimingProfile::names().join(", ")
            )
        })?;
        let p = EngineParams {
            block_size: cfg.block_size,
            num_blocks: cfg.num_blocks,
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            enable_prefix_caching: cfg.enable_prefix_caching,
            max_model_len,
            profile: profile.with_overrides(&cfg.timing),
            seed,
            output_vocab: Vec::new(),
            duplicate_blocks: DuplicateBlocks::Keep,
        };
        p.validate()?;
        Ok(p)
    }

    /// Checks ranges; [`crate::Engine::new`] panics on parameters that fail this.
    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            (self.block_size >= 1, "block_size must be at least 1"),
            (self.num_blocks >= 1, "num_blocks must be at least 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be at least 1"),
            (
                self.max_num_batched_tokens >= 1,
                "max_num_batched_tokens must be at least 1",
            ),
            (self.max_model_len >= 1, "max_model_len must be at least 1"),
        ];
        for (ok, msg) in checks {
            if !ok {
                return Err(msg.to_string());
            }
        }
        let p = &self.profile;
        for (name, v) in [
            ("step_base_ms", p.step_base_ms),
            ("prefill_token_us", p.prefill_token_us),
            ("prefill_attention_ns", p.prefill_attention_ns),
            ("decode_seq_us", p.decode_seq_us),
            ("decode_context_ns", p.decode_context_ns),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("timing parameter {name} must be finite and >= 0"));
            }
        }
        Ok(())
    }
}

impl Default for EngineParams {
    /// The config defaults (`h100-8b`, 24,000 blocks of 16) with max_model_len 32,768, seed 0.
    fn default() -> Self {
        EngineParams::from_config(&EngineModelConfig::default(), 32_768, 0)
            .expect("the default config is valid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_profile_lists_names() {
        let cfg = EngineModelConfig {
            profile: "b200".into(),
            ..Default::default()
        };
        let e = EngineParams::from_config(&cfg, 1000, 0).unwrap_err();
        assert!(
            e.contains("b200") && e.contains("h100-8b") && e.contains("instant"),
            "{e}"
        );
    }

    #[test]
    fn overrides_are_applied() {
        let mut cfg = EngineModelConfig::default();
        cfg.timing.decode_seq_us = Some(1.0);
        let p = EngineParams::from_config(&cfg, 1000, 5).unwrap();
        assert_eq!(p.profile.decode_seq_us, 1.0);
        assert_eq!(p.seed, 5);
        assert_eq!(p.block_size, 16);
    }
}
