//! Configuration: plain serde structs, every default in the `Default` impls below.
//!
//! They are meant to be embedded in the project's one config struct (e.g. per model under
//! `[serve.models.<name>.routing]`): every struct is `#[serde(default, deny_unknown_fields)]`,
//! so a missing key takes the default documented here and a typo is an error. Durations are in
//! milliseconds in the config (humans write them) and in microseconds in the APIs (`now_us`).
//! The README explains where each default comes from.

use serde::{Deserialize, Serialize};

mod health;

pub use health::{
    ActiveHealthConfig, AutoWeightConfig, BreakerConfig, EjectionConfig, HealthConfig,
    LatencyConfig, SlowStartConfig, UnansweredConfig,
};

/// The largest number of candidates (first choice + fallbacks) a policy returns.
pub const MAX_CANDIDATES: usize = 8;

/// A configuration value out of its allowed range; `key` is the dotted path of the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid value for `{key}`: {message}")]
pub struct ConfigInvalid {
    /// Dotted path of the key, e.g. `routing.policy.candidates`.
    pub key: String,
    /// What is wrong and what is allowed.
    pub message: String,
}

pub(crate) fn check(ok: bool, at: &str, key: &str, message: &str) -> Result<(), ConfigInvalid> {
    if ok {
        Ok(())
    } else {
        Err(ConfigInvalid {
            key: format!("{at}.{key}"),
            message: message.to_string(),
        })
    }
}

pub(crate) fn finite_in(x: f64, lo: f64, hi: f64) -> bool {
    x.is_finite() && x >= lo && x <= hi
}

/// Everything this crate reads: the policy of one model, per-engine health and the retry budget.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingConfig {
    /// Which policy picks engines, and its parameters.
    pub policy: PolicyConfig,
    /// Breakers, health checks, slow start, automatic weights, latency tracking.
    pub health: HealthConfig,
    /// How many retries the router may add on top of requests.
    pub retry_budget: RetryBudgetConfig,
}

impl RoutingConfig {
    /// Checks every value; the error names the first bad key under `at` (e.g. `"routing"`).
    pub fn validate(&self, at: &str) -> Result<(), ConfigInvalid> {
        self.policy.validate(&format!("{at}.policy"))?;
        self.health.validate(&format!("{at}.health"))?;
        self.retry_budget.validate(&format!("{at}.retry_budget"))
    }
}

/// The routing policies (`policy = "power_of_two"` in TOML).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each engine in turn, ignoring weights and load.
    RoundRobin,
    /// A uniformly random engine, ignoring weights and load.
    Random,
    /// Smooth weighted round robin (earliest-deadline-first over effective weights).
    WeightedRoundRobin,
    /// The engine with the fewest requests in flight per unit of weight (scans the fleet, or
    /// a random window of `least_request.max_scan` engines).
    LeastRequest,
    /// The less loaded (per unit of weight) of two random engines. The default: O(1) at any
    /// fleet size, and load-aware.
    #[default]
    PowerOfTwo,
    /// The lower `latency × (load + 1) / weight` of two random engines (Finagle/Linkerd peak
    /// EWMA).
    PeakEwma,
    /// Consistent hashing with bounded loads on a per-request key.
    ConsistentHash,
    /// The engine holding the longest cached prefix of the prompt, unless it is overloaded
    /// (`prefix` guard); otherwise least request. Matches come from the gateway's own record
    /// of where it sent earlier prompts (an approximate radix tree, as SGLang's router keeps).
    CacheAware,
    /// The same algorithm as `cache_aware`, but the matches come from the engines' own KV
    /// events (blocks stored and evicted, as llm-d's precise prefix-cache scorer uses): exact
    /// where `cache_aware` guesses.
    Precise,
    /// The best weighted score of prefix match, queue, KV utilisation, in-flight load and
    /// latency over the matched engines and a window of the fleet (llm-d's scorer chain).
    Scored,
}

impl PolicyKind {
    /// The config spelling of this policy (also a good metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::WeightedRoundRobin => "weighted_round_robin",
            PolicyKind::LeastRequest => "least_request",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::PeakEwma => "peak_ewma",
            PolicyKind::ConsistentHash => "consistent_hash",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::Precise => "precise",
            PolicyKind::Scored => "scored",
        }
    }

    /// True for the cache-aware policies (`cache_aware`, `precise`, `scored`): they read
    /// [`RequestCtx::prefix`](crate::RequestCtx), so the gateway should compute the prefix
    /// matches for them (and may skip that work for the others).
    pub fn uses_prefix(self) -> bool {
        matches!(
            self,
            PolicyKind::CacheAware | PolicyKind::Precise | PolicyKind::Scored
        )
    }

    /// Every policy, in config order.
    pub const ALL: [PolicyKind; 10] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::WeightedRoundRobin,
        PolicyKind::LeastRequest,
        PolicyKind::PowerOfTwo,
        PolicyKind::PeakEwma,
        PolicyKind::ConsistentHash,
        PolicyKind::CacheAware,
        PolicyKind::Precise,
        PolicyKind::Scored,
    ];
}

/// The policy of one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Which policy. Default `power_of_two`.
    pub policy: PolicyKind,
    /// How many distinct engines a decision returns: the first choice plus fallbacks for
    /// retries. Default 3 (one try + up to two retries); at most [`MAX_CANDIDATES`].
    pub candidates: usize,
    /// `least_request` parameters.
    pub least_request: LeastRequestConfig,
    /// `consistent_hash` parameters.
    pub consistent_hash: ConsistentHashConfig,
    /// Prefix affinity and its load guard: `cache_aware`, `precise`, and the guard of `scored`.
    pub prefix: PrefixAffinityConfig,
    /// `scored` weights.
    pub scored: ScoredConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            policy: PolicyKind::PowerOfTwo,
            candidates: 3,
            least_request: LeastRequestConfig::default(),
            consistent_hash: ConsistentHashConfig::default(),
            prefix: PrefixAffinityConfig::default(),
            scored: ScoredConfig::default(),
        }
    }
}

impl PolicyConfig {
    /// Checks every value; the error names the first bad key under `at`.
    pub fn validate(&self, at: &str) -> Result<(), ConfigInvalid> {
        check(
            (1..=MAX_CANDIDATES).contains(&self.candidates),
            at,
            "candidates",
            "must be between 1 and 8",
        )?;
        check(
            self.least_request.max_scan >= 2,
            at,
            "least_request.max_scan",
            "must be at least 2",
        )?;
        check(
            (0.0..=1000.0).contains(&self.least_request.own_bias()),
            at,
            "least_request.own_bias",
            "must be between 0 and 1000",
        )?;
        let ch = &self.consistent_hash;
        check(
            (1..=1024).contains(&ch.virtual_nodes),
            at,
            "consistent_hash.virtual_nodes",
            "must be between 1 and 1024",
        )?;
        check(
            finite_in(ch.balance_factor, 0.01, 100.0),
            at,
            "consistent_hash.balance_factor",
            "must be between 0.01 and 100 (0.25 = no engine above 1.25 x the average load)",
        )?;
        check(
            !ch.header.is_empty() || ch.use_user_field,
            at,
            "consistent_hash.header",
            "a key source is needed: set a header name or use_user_field = true",
        )?;
        check(
            ch.header
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_!#$%&'*+.^`|~".contains(&b)),
            at,
            "consistent_hash.header",
            "must be a header name (letters, digits and -_!#$%&'*+.^`|~; no spaces)",
        )?;
        let px = &self.prefix;
        check(
            finite_in(px.balance_rel_threshold, 1.0, 100.0),
            at,
            "prefix.balance_rel_threshold",
            "must be between 1 and 100 (1.5 = no engine above 1.5 x the mean load once past \
             balance_abs_threshold)",
        )?;
        check(
            finite_in(px.min_match_ratio, 0.0, 1.0),
            at,
            "prefix.min_match_ratio",
            "must be between 0 and 1",
        )?;
        check(
            px.min_match_blocks >= 1,
            at,
            "prefix.min_match_blocks",
            "must be at least 1",
        )?;
        check(
            finite_in(px.cold_prefix_slack, 0.0, 1e6),
            at,
            "prefix.cold_prefix_slack",
            "must be between 0 and 1000000 (1 = the home among the engines within one request \
             of the least loaded)",
        )?;
        check(
            px.cold_prefix_blocks >= 1,
            at,
            "prefix.cold_prefix_blocks",
            "must be at least 1",
        )?;
        let sc = &self.scored;
        for (key, w) in [
            ("scored.prefix", sc.prefix),
            ("scored.queue", sc.queue),
            ("scored.kv_usage", sc.kv_usage),
            ("scored.in_flight", sc.in_flight),
            ("scored.latency", sc.latency),
        ] {
            check(
                finite_in(w, 0.0, f64::MAX),
                at,
                key,
                "must be a finite number, at least 0",
            )?;
        }
        check(
            sc.prefix > 0.0
                || sc.queue > 0.0
                || sc.kv_usage > 0.0
                || sc.in_flight > 0.0
                || sc.latency > 0.0,
            at,
            "scored",
            "at least one weight must be above 0",
        )
    }
}

/// `least_request` parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeastRequestConfig {
    /// Fleets up to this size are scanned whole; larger ones through a window of this many
    /// engines starting at a random position, so a decision stays bounded at 4,096 engines.
    /// Default 512.
    pub max_scan: usize,
    /// How much more each of this router's own requests in flight to an engine counts than
    /// one its peers report: engines rank by `(load + own_bias × own + 1) / weight` (in
    /// `least_request` and wherever the prefix policies fall back to it). A peer's count
    /// arrives after the mesh's delay; routers that rank by the same late sum take the same
    /// least loaded engine when they decide at the same moment, and pile onto it. Counting
    /// their own requests first keeps each router's own share spread, so the sum stays even.
    /// A router whose own requests are all the load it knows of (alone, no other clients)
    /// ranks exactly as with 0; a difference in the sum larger than `own_bias` still wins over
    /// one own request more. 0 = every request alike. The bias pays while peers' counts are
    /// late; once they are not, it only turns a router away from the least loaded engine
    /// (clients sprayed over the routers drift each router's own share). Unset (default): 0
    /// when the router's mesh thread runs at real-time priority (`mesh.realtime_priority`
    /// granted: counts arrive within ~0.2 ms), 4 otherwise. Whatever the bias, engines equal
    /// in the ranking go first to the one holding fewer of this router's own requests.
    pub own_bias: Option<f64>,
}

impl LeastRequestConfig {
    /// `own_bias` when unset and peers' counts may be late (the mesh thread at normal
    /// priority, or no mesh: alone, the bias changes nothing).
    pub const OWN_BIAS_LATE: f64 = 4.0;

    /// The bias in force: as set, else [`Self::OWN_BIAS_LATE`].
    pub fn own_bias(&self) -> f64 {
        self.own_bias.unwrap_or(Self::OWN_BIAS_LATE)
    }
}

impl Default for LeastRequestConfig {
    fn default() -> Self {
        LeastRequestConfig {
            max_scan: 512,
            own_bias: None,
        }
    }
}

/// Prefix affinity (`cache_aware`, `precise`) and the load guard they share with `scored`.
///
/// An engine is **overloaded** when its load counting the new request exceeds both the
/// absolute floor and its weighted share of the relative bound:
/// `load + 1 > max(balance_abs_threshold, balance_rel_threshold × mean_after × weight /
/// mean_weight)`, where `mean_after = (Σ load + 1) / eligible` and `mean_weight = Σ weight /
/// eligible` over the eligible engines ([`EngineSet::totals`](crate::EngineSet::totals)).
/// With no eligible engine (panic mode) only the absolute floor applies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixAffinityConfig {
    /// An engine with at most this many requests in flight, counting the new one, is never
    /// overloaded: engines batch dozens of sequences, and below this cache affinity wins (a
    /// burst of 16 siblings sharing a new prefix may all go to one engine). So an engine
    /// added or restarted empty takes new prefixes and the overflow, not the prompts other
    /// engines hold, until they pass this: at light load it may idle; lower it to spread
    /// sooner, at the cost of cache hits. Default 16.
    pub balance_abs_threshold: u32,
    /// Above the floor, an engine is overloaded past this × the mean load (per unit of
    /// weight, counting the new request). Default 1.5 (SGLang's `balance_rel_threshold`).
    pub balance_rel_threshold: f64,
    /// A cached prefix shorter than this fraction of the prompt's full blocks does not
    /// outweigh load (SGLang's `cache_threshold`). Default 0.3.
    pub min_match_ratio: f64,
    /// ... and shorter than this many blocks neither. Default 1.
    pub min_match_blocks: u32,
    /// A prompt no engine holds a usable part of goes to the rendezvous home of its leading
    /// blocks (weighted rendezvous hashing over the stable ids of the engines within
    /// `cold_prefix_slack` of the least loaded, inside the load guard) instead of to least
    /// request's pick: routers whose views of the loads agree pick the same engine for it
    /// without talking, so siblings of a new prefix arriving at several routers (or at one
    /// router faster than its marks) land together. Default false, and on whenever the mesh
    /// is (ARCHITECTURE.md): one router's marks are visible to its next decision, and there
    /// least request balances new prefixes at least as well (hashing alone, before the
    /// slack, cost 2.5 points of hit rate on the 8-engine shared-prefix comparison: 85.8% →
    /// 83.1–83.4%, through uneven cache occupancy).
    pub cold_prefix_rendezvous: bool,
    /// How far above the least loaded engine a cold prompt's home may be, in `(in flight + 1)
    /// / weight` (the routers' own counts, which the mesh shares within a fraction of a
    /// millisecond; not the engine-reported load, which each router scrapes at its own
    /// moments): the rendezvous hashing ranks only the engines this close to the least
    /// loaded. 0 = the least loaded alone (routers' views differing by one request part
    /// siblings); larger = routers agree on views that differ more, new prefixes spread less
    /// by load (very large = hashing alone). 1, on the 8-engine shared-prefix comparison with
    /// 3 meshed routers: every sibling burst of the mesh test on one engine, the busiest
    /// engine's in-flight from 2.2 to 1.3-1.5 × the mean, output from 89–92% to 97–99% of
    /// one router's (BENCHMARKS.md). Default 1.
    pub cold_prefix_slack: f64,
    /// The leading blocks that name a cold prompt's home: its block key at depth
    /// `min(total, cold_prefix_blocks)`. Prompts that share this many blocks (512 tokens at
    /// the default block size) share a home. Default 32.
    pub cold_prefix_blocks: u32,
}

impl PrefixAffinityConfig {
    /// The shortest match (in blocks) `cache_aware` and `precise` use for a prompt of
    /// `total_blocks` blocks: `max(min_match_blocks, ceil(min_match_ratio × total))`, at least
    /// 1. Shorter matches are ignored, so a gateway may skip looking them up.
    pub fn min_blocks(&self, total_blocks: u32) -> u32 {
        crate::policy::min_blocks(self, total_blocks)
    }
}

impl Default for PrefixAffinityConfig {
    fn default() -> Self {
        PrefixAffinityConfig {
            balance_abs_threshold: 16,
            balance_rel_threshold: 1.5,
            min_match_ratio: 0.3,
            min_match_blocks: 1,
            cold_prefix_rendezvous: false,
            cold_prefix_slack: 1.0,
            cold_prefix_blocks: 32,
        }
    }
}

/// `scored` weights: `score = prefix × blocks / total_blocks − queue × waiting / max_waiting −
/// kv_usage × kv_usage − in_flight × load_per_weight / max_load_per_weight − latency ×
/// latency / max_latency`, the maxima over the engines considered for the request.
/// Each ≥ 0, at least one above 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoredConfig {
    /// Weight of the cached fraction of the prompt. Default 3 (llm-d's prefix-cache scorer).
    pub prefix: f64,
    /// Weight of the engine-reported waiting queue. Default 2 (llm-d's queue scorer).
    pub queue: f64,
    /// Weight of the KV-cache utilisation. Default 2 (llm-d's kv-cache utilisation scorer).
    pub kv_usage: f64,
    /// Weight of the requests in flight per unit of weight. Default 1.
    pub in_flight: f64,
    /// Weight of the latency estimate. Default 1.
    pub latency: f64,
}

impl Default for ScoredConfig {
    fn default() -> Self {
        ScoredConfig {
            prefix: 3.0,
            queue: 2.0,
            kv_usage: 2.0,
            in_flight: 1.0,
            latency: 1.0,
        }
    }
}

/// `consistent_hash` parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsistentHashConfig {
    /// Request header whose value is the key (hashed by the gateway with
    /// [`stable_hash`](crate::stable_hash)). Default `x-session-id`; empty = no header.
    pub header: String,
    /// When the header is absent, use the OpenAI `user` field of the body. Default true.
    pub use_user_field: bool,
    /// Points on the ring per engine of base weight 1 (scaled by base weight, the ring capped
    /// at 2^20 points). Default 128: about ±9% spread of key share per engine before bounded
    /// loads even out the rest.
    pub virtual_nodes: u32,
    /// ε of bounded loads: no engine takes a key while its load is above
    /// `ceil((1 + ε) × average)` (by configured weights). Default 0.25.
    pub balance_factor: f64,
}

impl Default for ConsistentHashConfig {
    fn default() -> Self {
        ConsistentHashConfig {
            header: "x-session-id".to_string(),
            use_user_field: true,
            virtual_nodes: 128,
            balance_factor: 0.25,
        }
    }
}

/// The retry budget (a token bucket).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryBudgetConfig {
    /// Each request deposits this fraction of a retry. Default 0.2 (Finagle's and Linkerd's
    /// `percentCanRetry` / `retryRatio`).
    pub ratio: f64,
    /// Retries allowed per second regardless of traffic. Default 10 (Finagle, Linkerd).
    pub min_per_second: f64,
    /// The bucket holds at most this many retries. Default 100.
    pub max_tokens: f64,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        RetryBudgetConfig {
            ratio: 0.2,
            min_per_second: 10.0,
            max_tokens: 100.0,
        }
    }
}

impl RetryBudgetConfig {
    /// Checks every value; the error names the first bad key under `at`.
    pub fn validate(&self, at: &str) -> Result<(), ConfigInvalid> {
        check(
            finite_in(self.ratio, 0.0, 10.0),
            at,
            "ratio",
            "must be between 0 and 10",
        )?;
        check(
            finite_in(self.min_per_second, 0.0, 1e6),
            at,
            "min_per_second",
            "must be between 0 and 1000000",
        )?;
        check(
            finite_in(self.max_tokens, 1.0, 1e9),
            at,
            "max_tokens",
            "must be at least 1",
        )
    }
}
