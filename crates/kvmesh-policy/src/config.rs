//! Configuration: plain serde structs, every default in the `Default` impls below.
//!
//! They are meant to be embedded in the project's one config struct (e.g. per model under
//! `[serve.models.<name>.routing]`): every struct is `#[serde(default, deny_unknown_fields)]`,
//! so a missing key takes the default documented here and a typo is an error. Durations are in
//! milliseconds in the config (humans write them) and in microseconds in the APIs (`now_us`).
//! The README explains where each default comes from.

use serde::{Deserialize, Serialize};

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

fn check(ok: bool, at: &str, key: &str, message: &str) -> Result<(), ConfigInvalid> {
    if ok {
        Ok(())
    } else {
        Err(ConfigInvalid {
            key: format!("{at}.{key}"),
            message: message.to_string(),
        })
    }
}

fn finite_in(x: f64, lo: f64, hi: f64) -> bool {
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
}

impl Default for LeastRequestConfig {
    fn default() -> Self {
        LeastRequestConfig { max_scan: 512 }
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
    /// burst of 16 siblings sharing a new prefix may all go to one engine). Default 16.
    pub balance_abs_threshold: u32,
    /// Above the floor, an engine is overloaded past this × the mean load (per unit of
    /// weight, counting the new request). Default 1.5 (SGLang's `balance_rel_threshold`).
    pub balance_rel_threshold: f64,
    /// A cached prefix shorter than this fraction of the prompt's full blocks does not
    /// outweigh load (SGLang's `cache_threshold`). Default 0.3.
    pub min_match_ratio: f64,
    /// ... and shorter than this many blocks neither. Default 1.
    pub min_match_blocks: u32,
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
    /// `ceil((1 + ε) × average)` (weighted). Default 0.25.
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

/// Per-engine health and load bookkeeping.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// The passive circuit breaker of each engine.
    pub breaker: BreakerConfig,
    /// The cap on how much of the fleet breakers may take out at once.
    pub ejection: EjectionConfig,
    /// Active `/health` checks (run by the gateway; thresholds applied here).
    pub active: ActiveHealthConfig,
    /// Ramp-up of new and recovered engines.
    pub slow_start: SlowStartConfig,
    /// Automatic weight factor from error rate, latency and KV utilisation.
    pub auto_weight: AutoWeightConfig,
    /// Peak-EWMA latency tracking (TTFT and end to end).
    pub latency: LatencyConfig,
}

impl HealthConfig {
    /// Checks every value; the error names the first bad key under `at`.
    pub fn validate(&self, at: &str) -> Result<(), ConfigInvalid> {
        let b = &self.breaker;
        check(
            b.consecutive_failures >= 1,
            at,
            "breaker.consecutive_failures",
            "must be at least 1",
        )?;
        check(
            finite_in(b.failure_ratio, 0.01, 1.0),
            at,
            "breaker.failure_ratio",
            "must be between 0.01 and 1",
        )?;
        check(
            b.window_ms >= 10,
            at,
            "breaker.window_ms",
            "must be at least 10 ms",
        )?;
        check(
            b.min_requests >= 1,
            at,
            "breaker.min_requests",
            "must be at least 1",
        )?;
        check(
            b.open_ms >= 1,
            at,
            "breaker.open_ms",
            "must be at least 1 ms",
        )?;
        check(
            b.open_max_ms >= b.open_ms,
            at,
            "breaker.open_max_ms",
            "must be at least breaker.open_ms",
        )?;
        check(
            finite_in(b.open_multiplier, 1.0, 100.0),
            at,
            "breaker.open_multiplier",
            "must be between 1 and 100",
        )?;
        check(
            b.half_open_probes >= 1,
            at,
            "breaker.half_open_probes",
            "must be at least 1",
        )?;
        check(
            b.close_after_successes >= 1,
            at,
            "breaker.close_after_successes",
            "must be at least 1",
        )?;
        check(
            self.ejection.max_ejected_percent <= 100,
            at,
            "ejection.max_ejected_percent",
            "must be between 0 and 100",
        )?;
        let a = &self.active;
        check(
            a.interval_ms >= 100,
            at,
            "active.interval_ms",
            "must be at least 100 ms",
        )?;
        check(
            a.timeout_ms >= 1 && a.timeout_ms <= a.interval_ms,
            at,
            "active.timeout_ms",
            "must be between 1 ms and active.interval_ms",
        )?;
        check(
            a.unhealthy_threshold >= 1,
            at,
            "active.unhealthy_threshold",
            "must be at least 1",
        )?;
        check(
            a.healthy_threshold >= 1,
            at,
            "active.healthy_threshold",
            "must be at least 1",
        )?;
        check(
            a.path.starts_with('/'),
            at,
            "active.path",
            "must start with '/'",
        )?;
        let s = &self.slow_start;
        check(
            finite_in(s.aggression, 0.01, 100.0),
            at,
            "slow_start.aggression",
            "must be between 0.01 and 100 (1 = linear)",
        )?;
        check(
            (1..=100).contains(&s.min_weight_percent),
            at,
            "slow_start.min_weight_percent",
            "must be between 1 and 100",
        )?;
        let w = &self.auto_weight;
        check(
            finite_in(w.error_rate_zero, 0.01, 1.0),
            at,
            "auto_weight.error_rate_zero",
            "must be between 0.01 and 1",
        )?;
        check(
            finite_in(w.latency_tolerance, 0.0, 100.0),
            at,
            "auto_weight.latency_tolerance",
            "must be between 0 and 100",
        )?;
        check(
            finite_in(w.utilisation_headroom, 0.001, 1.0),
            at,
            "auto_weight.utilisation_headroom",
            "must be between 0.001 and 1",
        )?;
        check(
            finite_in(w.utilisation_min_factor, 0.0, 1.0),
            at,
            "auto_weight.utilisation_min_factor",
            "must be between 0 and 1",
        )?;
        check(
            w.error_decay_ms >= 1,
            at,
            "auto_weight.error_decay_ms",
            "must be at least 1 ms",
        )?;
        check(
            finite_in(w.error_min_step, 0.0, 1.0),
            at,
            "auto_weight.error_min_step",
            "must be between 0 and 1",
        )?;
        check(
            finite_in(w.min_factor, 0.0001, 1.0),
            at,
            "auto_weight.min_factor",
            "must be between 0.0001 and 1",
        )?;
        let l = &self.latency;
        check(
            l.decay_ms >= 1,
            at,
            "latency.decay_ms",
            "must be at least 1 ms",
        )?;
        check(
            l.initial_ttft_ms >= 1,
            at,
            "latency.initial_ttft_ms",
            "must be at least 1 ms",
        )?;
        check(
            finite_in(l.e2e_weight, 0.0, 10.0),
            at,
            "latency.e2e_weight",
            "must be between 0 and 10",
        )?;
        check(
            finite_in(l.failure_penalty_factor, 1.0, 1000.0),
            at,
            "latency.failure_penalty_factor",
            "must be between 1 and 1000",
        )
    }
}

/// The circuit breaker of each engine (closed → open → half-open → closed).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Off = engines are never ejected by failures (auto weights still react). Default true.
    pub enabled: bool,
    /// Open after this many failures in a row. Default 5 (Envoy's `consecutive_5xx`; SGLang
    /// uses 10, LiteLLM 3).
    pub consecutive_failures: u32,
    /// ... or when this fraction of the requests in the window failed. Default 0.5.
    pub failure_ratio: f64,
    /// The sliding window of the failure ratio. Default 10,000 ms.
    pub window_ms: u64,
    /// The ratio is only judged over at least this many requests in the window. Default 20.
    pub min_requests: u32,
    /// How long the first trip keeps the engine out. Default 5,000 ms (LiteLLM's cooldown).
    pub open_ms: u64,
    /// Each further trip multiplies the open time by this. Default 2.
    pub open_multiplier: f64,
    /// The open time never exceeds this. Default 60,000 ms (SGLang's fixed open time).
    pub open_max_ms: u64,
    /// Trips are forgotten (the open time back to `open_ms`) after this long without one.
    /// Default 300,000 ms.
    pub backoff_reset_ms: u64,
    /// Requests let through at once while half-open. Default 1.
    pub half_open_probes: u32,
    /// Successful probes that close the breaker. Default 3 (SGLang).
    pub close_after_successes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            enabled: true,
            consecutive_failures: 5,
            failure_ratio: 0.5,
            window_ms: 10_000,
            min_requests: 20,
            open_ms: 5_000,
            open_multiplier: 2.0,
            open_max_ms: 60_000,
            backoff_reset_ms: 300_000,
            half_open_probes: 1,
            close_after_successes: 3,
        }
    }
}

/// The cap on hard ejections (open breakers, failed health checks) across the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EjectionConfig {
    /// At most this percentage of the fleet may be ejected by breakers at once (at least one
    /// engine always may). Default 30.
    pub max_ejected_percent: u32,
}

impl Default for EjectionConfig {
    fn default() -> Self {
        EjectionConfig {
            max_ejected_percent: 30,
        }
    }
}

/// Active health checks: the gateway sends the requests, [`ActiveHealth`](crate::ActiveHealth)
/// applies the thresholds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActiveHealthConfig {
    /// Off = every engine counts as healthy for checks (breakers still apply). Default true.
    pub enabled: bool,
    /// Path requested on each engine. Default `/health` (vLLM's).
    pub path: String,
    /// Time between checks of one engine. Default 5,000 ms.
    pub interval_ms: u64,
    /// A check not answered within this is a failure. Default 2,000 ms.
    pub timeout_ms: u64,
    /// Failed checks in a row that mark an engine unhealthy. Default 3 (HAProxy's `fall`).
    pub unhealthy_threshold: u32,
    /// Passed checks in a row that mark it healthy again. Default 2 (HAProxy's `rise`).
    pub healthy_threshold: u32,
    /// A new engine counts as healthy before its first check. Default true (slow start
    /// limits what it gets until checks and traffic confirm it).
    pub start_healthy: bool,
}

impl Default for ActiveHealthConfig {
    fn default() -> Self {
        ActiveHealthConfig {
            enabled: true,
            path: "/health".to_string(),
            interval_ms: 5_000,
            timeout_ms: 2_000,
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            start_healthy: true,
        }
    }
}

/// Slow start: a new or recovered engine's weight ramps up instead of jumping to full.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SlowStartConfig {
    /// Length of the ramp; 0 = no slow start. Default 30,000 ms.
    pub window_ms: u64,
    /// Shape: factor = (elapsed / window)^(1 / aggression); 1 = linear, above 1 ramps faster
    /// early. Default 1 (Envoy's default).
    pub aggression: f64,
    /// The factor never goes below this percentage. Default 10 (Envoy's default).
    pub min_weight_percent: u32,
}

impl Default for SlowStartConfig {
    fn default() -> Self {
        SlowStartConfig {
            window_ms: 30_000,
            aggression: 1.0,
            min_weight_percent: 10,
        }
    }
}

/// Automatic weight factor: `f_err × f_lat × f_util`, never below `min_factor`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AutoWeightConfig {
    /// Off = the factor is always 1. Default true.
    pub enabled: bool,
    /// Error rate at which the error term reaches zero: `f_err = 1 − rate / this`.
    /// Default 0.5 (an engine failing half its requests gets the minimum weight).
    pub error_rate_zero: f64,
    /// How much slower than the fleet median an engine may be before it loses weight:
    /// `f_lat = min(1, (1 + this) / (latency / median))`. Default 0.2.
    pub latency_tolerance: f64,
    /// KV-cache utilisation headroom: `f_util = (1 − usage) / this`, clamped to
    /// `[utilisation_min_factor, 1]`. Default 0.05 (only the last 5% of the cache counts).
    pub utilisation_headroom: f64,
    /// The utilisation term never goes below this. Default 0.5.
    pub utilisation_min_factor: f64,
    /// Time constant of the error-rate average (it also decays toward 0 while an engine gets
    /// no requests). Default 30,000 ms.
    pub error_decay_ms: u64,
    /// Smallest weight a single result has in the error-rate average, so a burst of failures
    /// registers within a few requests however fast they come. Default 0.1.
    pub error_min_step: f64,
    /// The whole factor never goes below this. Default 0.01.
    pub min_factor: f64,
}

impl Default for AutoWeightConfig {
    fn default() -> Self {
        AutoWeightConfig {
            enabled: true,
            error_rate_zero: 0.5,
            latency_tolerance: 0.2,
            utilisation_headroom: 0.05,
            utilisation_min_factor: 0.5,
            error_decay_ms: 30_000,
            error_min_step: 0.1,
            min_factor: 0.01,
        }
    }
}

/// Peak-EWMA latency tracking.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LatencyConfig {
    /// Time constant τ of the averages and of their decay toward the initial values while an
    /// engine gets no samples. Default 10,000 ms (Finagle's and Linkerd's decay time).
    pub decay_ms: u64,
    /// TTFT assumed for an engine without samples. Default 200 ms.
    pub initial_ttft_ms: u64,
    /// End-to-end latency assumed for an engine without samples. Default 2,000 ms.
    pub initial_e2e_ms: u64,
    /// latency = TTFT + this × end-to-end. Default 0.1 (end to end is typically 10–50× TTFT,
    /// so both terms weigh about the same).
    pub e2e_weight: f64,
    /// A failure is recorded as a sample of at least this. Default 10,000 ms.
    pub failure_penalty_ms: u64,
    /// ... and at least this times the current estimate. Default 2.
    pub failure_penalty_factor: f64,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        LatencyConfig {
            decay_ms: 10_000,
            initial_ttft_ms: 200,
            initial_e2e_ms: 2_000,
            e2e_weight: 0.1,
            failure_penalty_ms: 10_000,
            failure_penalty_factor: 2.0,
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
