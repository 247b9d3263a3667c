//! The routing policies and per-engine health/load bookkeeping of the kvmesh router.
//!
//! **Pure**: no I/O, no threads, no clock. Time comes in as `now_us` (µs on the caller's
//! clock) and randomness as seeds, so the same inputs always give the same decisions, and a
//! virtual-time simulation can drive it as well as the hyper gateway.
//!
//! * **Policies** ([`Policy`]): built once per membership version
//!   ([`Policy::new`]), then [`Policy::pick`] per request reads engines lazily through an
//!   [`EngineSet`] of [`EngineView`]s and writes an ordered list of distinct candidates (first
//!   choice, then fallbacks) without allocating, returning a [`Reason`] for metrics.
//!   `round_robin`, `random`, `weighted_round_robin` (smooth, EDF), `least_request`,
//!   `power_of_two`, `peak_ewma`, `consistent_hash` (bounded loads), and the cache-aware ones,
//!   which read the request's [`PrefixInput`] (how many leading blocks of the prompt each
//!   engine holds; [`PolicyKind::uses_prefix`]): `cache_aware` and `precise` (the longest
//!   usable cached prefix unless that engine is overloaded, else least request; the matches
//!   come from the gateway's own decisions or from engine KV events) and `scored` (a weighted
//!   sum of prefix match, queue, KV utilisation, load and latency). Ties are broken at
//!   random, except that meshed routers split engines tied for least loaded by their rank
//!   ([`Policy::with_router_slot`]); when no engine is eligible the policy runs over all of
//!   them (panic mode).
//! * **Health** ([`EngineTracker`] bundles them): [`CircuitBreaker`] (closed / open /
//!   half-open, growing open periods) with the fleet-wide [`EjectionGuard`],
//!   [`ActiveHealth`] thresholds, [`LatencyTracker`] (peak EWMA of TTFT and end to end;
//!   failures count as slow), [`ErrorRate`], [`SlowStart`], [`auto_weight_factor`].
//! * **Retries**: [`RetryBudget`], a token bucket bounding retries to a fraction of requests.
//! * **Config**: [`RoutingConfig`] and its parts, serde structs with documented defaults.
//!
//! The crate README documents every default, its source, and how a gateway drives each part.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod health;
mod policy;
mod retry;
mod rng;
mod view;

pub use config::{
    ActiveHealthConfig, AutoWeightConfig, BreakerConfig, ConfigInvalid, ConsistentHashConfig,
    EjectionConfig, HealthConfig, LatencyConfig, LeastRequestConfig, MAX_CANDIDATES, PolicyConfig,
    PolicyKind, PrefixAffinityConfig, RetryBudgetConfig, RoutingConfig, ScoredConfig,
    SlowStartConfig, UnansweredConfig,
};
pub use health::{
    ActiveHealth, BreakerEvent, BreakerState, CircuitBreaker, EjectionGuard, EngineTracker,
    ErrorRate, HealthEvent, LatencyTracker, PeakEwma, Permit, SlowStart, Work, auto_weight_factor,
    fleet_reference_latency, slow_start_factor,
};
pub use policy::{Policy, load_score};
pub use retry::{AtomicRetryBudget, RetryBudget};
pub use rng::{Rng, mix64, stable_hash, unit_f64};
pub use view::{
    EngineMember, EngineSet, EngineView, PrefixInput, PrefixMatch, Reason, RequestCtx, RouterSlot,
    Totals,
};
