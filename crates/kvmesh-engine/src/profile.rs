//! Timing profiles: how long one engine step takes, from the batch's composition.
//!
//! ```text
//! step_us = ( step_base_ms × 1000
//!           + prefill_tokens × prefill_token_us
//!           + prefill_attention_pairs × prefill_attention_ns / 1000
//!           + decode_seqs × decode_seq_us
//!           + decode_context_tokens × decode_context_ns / 1000 ) × slowdown
//! ```
//!
//! Every profile's numbers are derived from hardware datasheets and model shapes (facts) and a
//! few efficiency assumptions; the derivations are in each profile's `description` and in the
//! crate README. Every parameter can be overridden from the config
//! ([`kvmesh_config::TimingOverrides`]).

use kvmesh_config::TimingOverrides;

/// Composition of one engine step, the input of [`TimingProfile::step_micros`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchShape {
    /// Prompt (or recomputed) tokens computed in this step, over all prefill chunks.
    pub prefill_tokens: u64,
    /// Σ over prefill chunks of `chunk_tokens × (context before the chunk + chunk_tokens / 2)`:
    /// the (query, key) pairs of causal attention.
    pub prefill_attention_pairs: u64,
    /// Sequences decoding one token in this step.
    pub decode_seqs: u64,
    /// Σ over decoding sequences of the context they attend to (including the new token).
    pub decode_context_tokens: u64,
}

impl BatchShape {
    /// Tokens scheduled in the step (prefill tokens + one per decoding sequence).
    pub fn scheduled_tokens(&self) -> u64 {
        self.prefill_tokens + self.decode_seqs
    }

    /// True when nothing was scheduled.
    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

/// A named set of timing parameters (see the module docs for the formula).
#[derive(Debug, Clone, PartialEq)]
pub struct TimingProfile {
    /// Profile name, e.g. `h100-8b`.
    pub name: String,
    /// Fixed cost of a step (weights streamed from HBM once per forward pass), ms.
    pub step_base_ms: f64,
    /// Linear-layer cost per prefill token, µs.
    pub prefill_token_us: f64,
    /// Attention cost per (query token, key token) pair in prefill, ns.
    pub prefill_attention_ns: f64,
    /// Marginal cost per decoding sequence, µs.
    pub decode_seq_us: f64,
    /// KV-cache read cost per context token attended by a decoding sequence, ns.
    pub decode_context_ns: f64,
    /// Where each number comes from (facts vs assumptions).
    pub description: String,
}

struct ProfileDef {
    name: &'static str,
    step_base_ms: f64,
    prefill_token_us: f64,
    prefill_attention_ns: f64,
    decode_seq_us: f64,
    decode_context_ns: f64,
    description: &'static str,
}

const PROFILES: &[ProfileDef] = &[
    ProfileDef {
        name: "h100-8b",
        step_base_ms: 5.5,
        prefill_token_us: 40.0,
        prefill_attention_ns: 1.5,
        decode_seq_us: 30.0,
        decode_context_ns: 49.0,
        description: "8B dense model (Qwen3-8B / Llama-3.1-8B class) in bf16 on one H100 SXM5 80GB. \
FACTS: H100 SXM5 HBM3 3.35 TB/s and 989 TFLOP/s dense BF16 (NVIDIA datasheet); Qwen3-8B has \
8.2e9 parameters (16.4 GB bf16), 36 layers, 32 query heads, 8 KV heads, head_dim 128, so KV per \
token = 2*36*8*128*2 B = 147,456 B (144 KiB). ASSUMPTIONS: memory-bound kernels reach 90% of peak \
bandwidth; prefill GEMMs and FlashAttention reach ~40% of peak FLOP/s; decode GEMMs ~55%. \
DERIVED: step_base_ms = 16.4 GB / (0.9*3.35 TB/s) = 5.4 ms (+0.1 ms host overhead) = 5.5; \
prefill_token_us = 2*8.2e9 FLOP / (0.4*989 TFLOP/s) = 41 -> 40; prefill_attention_ns = \
4*36*32*128 = 589,824 FLOP per query-key pair / (0.4*989 TFLOP/s) = 1.5; decode_seq_us = \
2*8.2e9 FLOP / (0.55*989 TFLOP/s) = 30; decode_context_ns = 147,456 B / (0.9*3.35 TB/s) = 49. \
CHECKS: a 2,000-token uncached prefill takes ~88 ms (~22k prefill tokens/s); a decode step of \
64 sequences at 1.5k context takes ~12 ms.",
    },
    ProfileDef {
        name: "a100-8b",
        step_base_ms: 9.0,
        prefill_token_us: 130.0,
        prefill_attention_ns: 4.7,
        decode_seq_us: 95.0,
        decode_context_ns: 80.0,
        description: "8B dense model (Qwen3-8B class, 16.4 GB bf16, 144 KiB KV per token) on one \
A100 SXM4 80GB. FACTS: A100 HBM2e 2.039 TB/s, 312 TFLOP/s dense BF16 (NVIDIA datasheet). \
ASSUMPTIONS: same efficiencies as h100-8b (90% bandwidth, 40% prefill MFU, 55% decode MFU). \
DERIVED: step_base_ms = 16.4 GB / (0.9*2.039 TB/s) = 8.9 -> 9.0; prefill_token_us = 16.4 GFLOP / \
(0.4*312 TFLOP/s) = 131 -> 130; prefill_attention_ns = 589,824 FLOP / (0.4*312 TFLOP/s) = 4.7; \
decode_seq_us = 16.4 GFLOP / (0.55*312 TFLOP/s) = 96 -> 95; decode_context_ns = 147,456 B / \
(0.9*2.039 TB/s) = 80.",
    },
    ProfileDef {
        name: "h100-70b-tp4",
        step_base_ms: 13.0,
        prefill_token_us: 100.0,
        prefill_attention_ns: 1.7,
        decode_seq_us: 65.0,
        decode_context_ns: 27.0,
        description: "70B dense model (Llama-3.1-70B) in bf16, tensor-parallel over 4 H100 SXM5 \
(NVLink). FACTS: 70.6e9 parameters (141 GB bf16), 80 layers, 64 query heads, 8 KV heads, \
head_dim 128, KV per token = 2*80*8*128*2 B = 327,680 B (320 KiB), split over 4 GPUs; 4 GPUs give \
13.4 TB/s and 3,958 TFLOP/s BF16. ASSUMPTIONS: 90% bandwidth; ~8 us per all-reduce, 2 per layer; \
prefill MFU 35% (TP communication), attention 40%, decode 55%. DERIVED: step_base_ms = 141 GB / \
(0.9*13.4 TB/s) = 11.7 ms + 160 all-reduces * 8 us = 1.3 ms -> 13.0; prefill_token_us = \
2*70.6e9 FLOP / (0.35*3,958 TFLOP/s) = 102 -> 100; prefill_attention_ns = 4*80*64*128 = 2,621,440 \
FLOP / (0.4*3,958 TFLOP/s) = 1.7; decode_seq_us = 141 GFLOP / (0.55*3,958 TFLOP/s) = 65; \
decode_context_ns = 327,680 B / (0.9*13.4 TB/s) = 27.",
    },
    ProfileDef {
        name: "instant",
        step_base_ms: 0.0,
        prefill_token_us: 0.0,
        prefill_attention_ns: 0.0,
        decode_seq_us: 0.0,
        decode_context_ns: 0.0,
        description: "Every step takes zero time: an infinitely fast engine, to measure what the \
router itself costs. Not a model of any hardware.",
    },
];

const NAMES: &[&str] = &["h100-8b", "a100-8b", "h100-70b-tp4", "instant"];

impl TimingProfile {
    /// The built-in profile with this name, or `None`.
    pub fn by_name(name: &str) -> Option<TimingProfile> {
        PROFILES
            .iter()
            .find(|p| p.name == name)
            .map(|p| TimingProfile {
                name: p.name.to_string(),
                step_base_ms: p.step_base_ms,
                prefill_token_us: p.prefill_token_us,
                prefill_attention_ns: p.prefill_attention_ns,
                decode_seq_us: p.decode_seq_us,
                decode_context_ns: p.decode_context_ns,
                description: p.description.to_string(),
            })
    }

    /// Names of the built-in profiles (the first is the default).
    pub fn names() -> &'static [&'static str] {
        NAMES
    }

    /// This profile with the set fields of `o` replacing its parameters (the description says
    /// which were overridden).
    pub fn with_overrides(mut self, o: &TimingOverrides) -> TimingProfile {
        let mut changed = Vec::new();
        for (name, slot, v) in [
            ("step_base_ms", &mut self.step_base_ms, o.step_base_ms),
            (
                "prefill_token_us",
                &mut self.prefill_token_us,
                o.prefill_token_us,
            ),
            (
                "prefill_attention_ns",
                &mut self.prefill_attention_ns,
                o.prefill_attention_ns,
            ),
            ("decode_seq_us", &mut self.decode_seq_us, o.decode_seq_us),
            (
                "decode_context_ns",
                &mut self.decode_context_ns,
                o.decode_context_ns,
            ),
        ] {
            if let Some(v) = v {
                *slot = v;
                changed.push(format!("{name}={v}"));
            }
        }
        if !changed.is_empty() {
            self.description = format!(
                "{} OVERRIDDEN from the config: {}.",
                self.description,
                changed.join(", ")
            );
        }
        self
    }

    /// Duration of one step of the given composition, in µs (before any slowdown factor).
    pub fn step_micros(&self, batch: &BatchShape) -> f64 {
        if batch.is_empty() {
            return 0.0;
        }
        self.step_base_ms * 1000.0
            + batch.prefill_tokens as f64 * self.prefill_token_us
            + batch.prefill_attention_pairs as f64 * self.prefill_attention_ns / 1000.0
            + batch.decode_seqs as f64 * self.decode_seq_us
            + batch.decode_context_tokens as f64 * self.decode_context_ns / 1000.0
    }
}

impl Default for TimingProfile {
    /// The default profile, `h100-8b`.
    fn default() -> Self {
        TimingProfile::by_name(NAMES[0]).expect("the default profile exists")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_resolves_and_table_matches() {
        assert_eq!(NAMES.len(), PROFILES.len());
        for n in TimingProfile::names() {
            let p = TimingProfile::by_name(n).unwrap();
            assert_eq!(&p.name, n);
            assert!(!p.description.is_empty());
        }
        assert!(TimingProfile::by_name("nope").is_none());
    }

    #[test]
    fn overrides_replace_only_set_fields() {
        let p = TimingProfile::default().with_overrides(&TimingOverrides {
            step_base_ms: Some(1.0),
            ..Default::default()
        });
        assert_eq!(p.step_base_ms, 1.0);
        assert_eq!(p.prefill_token_us, 40.0);
        assert!(p.description.contains("step_base_ms=1"));
    }

    #[test]
    fn formula() {
        let p = TimingProfile::default();
        let b = BatchShape {
            prefill_tokens: 2000,
            prefill_attention_pairs: 2000 * 1000,
            decode_seqs: 0,
            decode_context_tokens: 0,
        };
        let us = p.step_micros(&b);
        assert!((us - (5500.0 + 80_000.0 + 3000.0)).abs() < 1e-6, "{us}");
        assert_eq!(p.step_micros(&BatchShape::default()), 0.0);
    }
}
