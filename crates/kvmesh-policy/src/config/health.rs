//! `health`: breakers, the ejection cap, active health checks, slow start, automatic weights
//! and latency tracking (every default in the `Default` impls below).

use super::{ConfigInvalid, check, finite_in};
use serde::{Deserialize, Serialize};

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
    /// Attempts whose client gave up before any answer while the engine answered nothing.
    pub unanswered: UnansweredConfig,
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
        check(
            (10..=60_000).contains(&w.reference_refresh_ms),
            at,
            "auto_weight.reference_refresh_ms",
            "must be between 10 and 60,000 ms",
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
        )?;
        check(
            self.unanswered.after_ms >= 1,
            at,
            "unanswered.after_ms",
            "must be at least 1 ms",
        )
    }
}

/// An attempt whose client went away while it waited for the engine — for the first byte
/// of the answer, or for more of a stream that stopped — for `after_ms` or more, in which the
/// engine answered nobody at this router and its metrics showed no work (two scrapes of its
/// work counters, none changed; engines without them: this router's answers alone): counted
/// as a failed attempt (`kvmesh_engine_errors_total{kind="unanswered"}`: breaker, error rate,
/// latency). This is how a hung engine is found that accepts requests and passes its health
/// checks but never answers, when clients give up long before `timeouts.first_byte_ms`. An
/// engine that answers others or works meanwhile (a long prefill steps) is busy, not hung:
/// the attempt is a cancel.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UnansweredConfig {
    /// A client that goes away after waiting `after_ms` or more for the answer (or for more
    /// of it) while the engine answered nobody at this router and its metrics showed no
    /// work (two scrapes of its work counters, tokens and steps, none changed) counts as a
    /// failed attempt of kind `unanswered` (breaker, error rate, latency): how a hung engine
    /// that passes its health checks is found when clients give up long before
    /// `timeouts.first_byte_ms`. Engines without such counters: this router's answers alone
    /// tell. Off = never held against the engine. Default true.
    pub enabled: bool,
    /// The least wait that counts. Default 1,000 ms.
    pub after_ms: u64,
}

impl Default for UnansweredConfig {
    fn default() -> Self {
        UnansweredConfig {
            enabled: true,
            after_ms: 1_000,
        }
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
    /// Length of the ramp; 0 = no slow start (`consistent_hash` places keys by configured
    /// weights and has none, as Envoy's ring hash). Default 30,000 ms.
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
    /// Off = the factor is always 1 (`consistent_hash` uses its error term only: keys follow
    /// configured weights, the same on every router, and leave an engine failing its
    /// requests). Default true.
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
    /// How often a router recomputes the fleet's median latency, the reference of `f_lat`.
    /// A stale median turns a slowdown of the whole fleet (a burst, the warm-up) into
    /// per-engine weight loss that differs from engine to engine. Default 100 ms.
    pub reference_refresh_ms: u64,
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
            reference_refresh_ms: 100,
        }
    }
}

/// Peak-EWMA latency tracking.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LatencyConfig {
    /// Time constant τ of the averages and of the fading, while an engine gets no samples,
    /// of its distance from the fleet's median latency (so an engine no policy chooses, for
    /// looking slow once, is retried as an average one). Default 10,000 ms (Finagle's and
    /// Linkerd's decay time).
    pub decay_ms: u64,
    /// TTFT an engine's average starts from (its first samples pull it down within τ). An
    /// engine without samples is weighed as the median of the engines with samples; these
    /// values stand only while none has any. Default 200 ms.
    pub initial_ttft_ms: u64,
    /// End-to-end latency an engine's average starts from (as `initial_ttft_ms`). Default
    /// 2,000 ms.
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
