//! Per-engine health and load bookkeeping: pure state machines driven with `now_us`.

mod breaker;
mod ewma;

pub use breaker::{BreakerEvent, BreakerState, CircuitBreaker, EjectionGuard, Permit};
pub use ewma::{ErrorRate, LatencyTracker, PeakEwma};

use crate::config::{
    ActiveHealthConfig, AutoWeightConfig, HealthConfig, SlowStartConfig, UnansweredConfig,
};
use crate::view::EngineView;

/// Slow start: the weight factor of an engine that just joined or recovered.
///
/// `factor = max(min_weight_percent / 100, (elapsed / window)^(1 / aggression))`, 1 once the
/// window has passed (Envoy's formula). Not started = 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlowStart {
    since_us: Option<u64>,
}

impl SlowStart {
    /// Not ramping (factor 1).
    pub fn new() -> Self {
        SlowStart { since_us: None }
    }

    /// Starts (or restarts) the ramp at `now_us`.
    pub fn start(&mut self, now_us: u64) {
        self.since_us = Some(now_us);
    }

    /// When the current ramp started, if any.
    pub fn since_us(&self) -> Option<u64> {
        self.since_us
    }

    /// The factor at `now_us`, in `(0, 1]`.
    pub fn factor(&self, cfg: &SlowStartConfig, now_us: u64) -> f64 {
        slow_start_factor(cfg, self.since_us, now_us)
    }
}

/// The slow-start factor for a ramp that started at `since_us` (`None` = 1). A free function
/// so a gateway can keep `since_us` in an atomic.
pub fn slow_start_factor(cfg: &SlowStartConfig, since_us: Option<u64>, now_us: u64) -> f64 {
    let Some(since) = since_us else { return 1.0 };
    let window = cfg.window_ms.saturating_mul(1000);
    let elapsed = now_us.saturating_sub(since);
    if window == 0 || elapsed >= window {
        return 1.0;
    }
    let min = f64::from(cfg.min_weight_percent.clamp(1, 100)) / 100.0;
    let t = (elapsed.max(1) as f64) / window as f64;
    t.powf(1.0 / cfg.aggression.max(0.01)).max(min).min(1.0)
}

/// The automatic weight factor in `[min_factor, 1]`: `f_err × f_lat × f_util` with
///
/// * `f_err = 1 − error_rate / error_rate_zero` (0 at a 50% error rate by default),
/// * `f_lat = min(1, (1 + latency_tolerance) / latency_ratio)`, where `latency_ratio` is the
///   engine's latency over the fleet's median (a gray engine 5× slower gets 0.24),
/// * `f_util = clamp((1 − kv_usage) / utilisation_headroom, utilisation_min_factor, 1)` (only
///   the last 5% of KV cache counts, and it can at most halve the weight).
///
/// Pass `latency_ratio = 1` and `kv_usage = None` when unknown.
pub fn auto_weight_factor(
    cfg: &AutoWeightConfig,
    error_rate: f64,
    latency_ratio: f64,
    kv_usage: Option<f32>,
) -> f64 {
    if !cfg.enabled {
        return 1.0;
    }
    let f_err = error_term(cfg, error_rate);
    let f_lat = if latency_ratio.is_finite() && latency_ratio > 0.0 {
        ((1.0 + cfg.latency_tolerance) / latency_ratio).min(1.0)
    } else {
        1.0
    };
    let f_util = match kv_usage {
        Some(u) if u.is_finite() => {
            ((1.0 - f64::from(u)) / cfg.utilisation_headroom).clamp(cfg.utilisation_min_factor, 1.0)
        }
        _ => 1.0,
    };
    (f_err * f_lat * f_util).clamp(cfg.min_factor, 1.0)
}

/// The automatic weight's error term, `1 − rate / error_rate_zero` in `[0, 1]`
/// ([`auto_weight_factor`]; alone, [`EngineView::error_factor`]).
fn error_term(cfg: &AutoWeightConfig, rate: f64) -> f64 {
    (1.0 - rate / cfg.error_rate_zero).clamp(0.0, 1.0)
}

/// The fleet's reference latency for [`auto_weight_factor`]: the median of the sampled
/// engines' latency estimates ([`LatencyTracker::sampled_us`]; reorders `latencies`; O(n)).
/// Compute it off the request path, often enough to follow the whole fleet (the gateway: every `auto_weight.reference_refresh_ms`),
/// and hand it to every [`EngineTracker::view`]. 0 for an empty slice.
pub fn fleet_reference_latency(latencies: &mut [f64]) -> f64 {
    if latencies.is_empty() {
        return 0.0;
    }
    let mid = latencies.len() / 2;
    let (_, m, _) = latencies.select_nth_unstable_by(mid, |a, b| a.total_cmp(b));
    *m
}

/// Active health-check thresholds: unhealthy after `unhealthy_threshold` failed checks in a
/// row, healthy again after `healthy_threshold` passed ones. The gateway sends the checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActiveHealth {
    healthy: bool,
    ok_streak: u32,
    fail_streak: u32,
    unhealthy_threshold: u32,
    healthy_threshold: u32,
    enabled: bool,
}

/// A change of active health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEvent {
    /// The engine failed enough checks in a row.
    BecameUnhealthy,
    /// The engine passed enough checks in a row.
    BecameHealthy,
}

impl ActiveHealth {
    /// Healthy or not according to `start_healthy`.
    pub fn new(cfg: &ActiveHealthConfig) -> Self {
        ActiveHealth {
            healthy: cfg.start_healthy || !cfg.enabled,
            ok_streak: 0,
            fail_streak: 0,
            unhealthy_threshold: cfg.unhealthy_threshold.max(1),
            healthy_threshold: cfg.healthy_threshold.max(1),
            enabled: cfg.enabled,
        }
    }

    /// Whether the engine counts as healthy.
    pub fn is_healthy(&self) -> bool {
        self.healthy
    }

    /// Records one check result (`ok` = answered 200 within the timeout).
    pub fn on_check(&mut self, ok: bool) -> Option<HealthEvent> {
        if !self.enabled {
            return None;
        }
        if ok {
            self.fail_streak = 0;
            self.ok_streak = self.ok_streak.saturating_add(1);
            if !self.healthy && self.ok_streak >= self.healthy_threshold {
                self.healthy = true;
                return Some(HealthEvent::BecameHealthy);
            }
        } else {
            self.ok_streak = 0;
            self.fail_streak = self.fail_streak.saturating_add(1);
            if self.healthy && self.fail_streak >= self.unhealthy_threshold {
                self.healthy = false;
                return Some(HealthEvent::BecameUnhealthy);
            }
        }
        None
    }
}

/// Everything the router tracks about one engine, in one place: breaker, active health,
/// latency, error rate and slow start. Pure: the gateway keeps one per engine (in a short
/// `Mutex`, or copies the values it needs into atomics) and calls:
///
/// 1. [`try_acquire`](Self::try_acquire) before sending (None = try the next candidate);
/// 2. [`on_first_byte`](Self::on_first_byte) at the first data frame (TTFT);
/// 3. exactly one of [`on_success`](Self::on_success) (end of stream),
///    [`on_failure`](Self::on_failure) or [`on_cancel`](Self::on_cancel) — when the client
///    went away while waiting, a failure if [`went_silent`](Self::went_silent), else a cancel;
/// 4. [`on_health_check`](Self::on_health_check) with each active check result;
/// 5. [`view`](Self::view) to build the [`EngineView`] a policy reads.
///
/// A recovered engine (breaker closed again, or healthy again) restarts slow start.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineTracker {
    breaker: CircuitBreaker,
    health: ActiveHealth,
    latency: LatencyTracker,
    errors: ErrorRate,
    slow_start: SlowStart,
    slow_cfg: SlowStartConfig,
    auto_cfg: AutoWeightConfig,
    unanswered_cfg: UnansweredConfig,
    /// When the engine last answered at this router: a first byte or a finished answer.
    answered_us: u64,
}

/// What the engine's own metrics showed of its work, as the router's scrapes read them (for
/// [`EngineTracker::went_silent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Its metrics have no work counter (tokens generated, prompt tokens, engine steps): only
    /// this router's answers tell whether it works.
    Unknown,
    /// Its work counters, read at every scrape: each pair of scrapes in a row tells whether
    /// the engine worked between them.
    Counted {
        /// Where the last such span that saw them change began (the scrape before the one
        /// that found the change; 0 = never changed): the last work seen came after it.
        worked_after_us: u64,
        /// When the scrape before the last one was made (0 = fewer than two scrapes).
        prev_scrape_us: u64,
    },
}

impl Work {
    /// Whether the engine was seen idle over a wait that began at `since_us`: no span that
    /// saw its counters change began after it, and a whole span since it saw none (the last
    /// two scrapes were made since). The span around `since_us` may show the work done just
    /// before it — a stream that stopped when its engine hung. Always true when the counters
    /// are unknown (nothing says otherwise).
    pub fn idle_since(self, since_us: u64) -> bool {
        match self {
            Work::Unknown => true,
            Work::Counted {
                worked_after_us,
                prev_scrape_us,
            } => worked_after_us < since_us && prev_scrape_us >= since_us,
        }
    }
}

impl EngineTracker {
    /// A tracker for an engine that appears at `now_us`. `ramp`: start slow start now (true
    /// for an engine added to a running router; false for the engines present at start-up,
    /// which would otherwise all ramp together for nothing).
    pub fn new(cfg: &HealthConfig, now_us: u64, ramp: bool) -> Self {
        let mut slow_start = SlowStart::new();
        if ramp {
            slow_start.start(now_us);
        }
        EngineTracker {
            breaker: CircuitBreaker::new(&cfg.breaker),
            health: ActiveHealth::new(&cfg.active),
            latency: LatencyTracker::new(&cfg.latency, now_us),
            errors: ErrorRate::new(&cfg.auto_weight, now_us),
            slow_start,
            slow_cfg: cfg.slow_start,
            auto_cfg: cfg.auto_weight,
            unanswered_cfg: cfg.unanswered,
            answered_us: now_us,
        }
    }

    /// The breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// The active-health state.
    pub fn health(&self) -> &ActiveHealth {
        &self.health
    }

    /// The latency estimates.
    pub fn latency(&self) -> &LatencyTracker {
        &self.latency
    }

    /// The error rate at `now_us`.
    pub fn error_rate(&self, now_us: u64) -> f64 {
        self.errors.value(now_us)
    }

    /// When the engine last answered at this router: a first byte or a finished answer (its
    /// creation time before any).
    pub fn answered_us(&self) -> u64 {
        self.answered_us
    }

    /// The slow-start state.
    pub fn slow_start(&self) -> &SlowStart {
        &self.slow_start
    }

    /// Whether a policy may choose this engine now (healthy and the breaker allows).
    pub fn eligible(&self, now_us: u64) -> bool {
        self.health.is_healthy() && self.breaker.allows(now_us)
    }

    /// Automatic factor × slow-start factor, given the fleet's median latency
    /// ([`fleet_reference_latency`]; 0 = unknown) and the engine's KV usage.
    pub fn weight_factor(&self, now_us: u64, fleet_latency_us: f64, kv_usage: Option<f32>) -> f64 {
        let rate = self.errors.value(now_us);
        let latency = self.latency.estimate_us(now_us, fleet_latency_us);
        self.factor_at(now_us, rate, latency, fleet_latency_us, kv_usage)
    }

    /// [`EngineTracker::weight_factor`] at the error rate `rate` and the latency estimate
    /// `latency_us` (each read once per view).
    fn factor_at(
        &self,
        now_us: u64,
        rate: f64,
        latency_us: f64,
        fleet_latency_us: f64,
        kv: Option<f32>,
    ) -> f64 {
        let ratio = if fleet_latency_us > 0.0 {
            latency_us / fleet_latency_us
        } else {
            1.0
        };
        let auto = auto_weight_factor(&self.auto_cfg, rate, ratio, kv);
        auto * self.slow_start.factor(&self.slow_cfg, now_us)
    }

    /// The view of this engine for a policy. `in_flight`: the routers' count of requests in
    /// flight to it; `engine_load` / `kv_usage`: what the engine last reported, if anything.
    pub fn view(
        &self,
        now_us: u64,
        base_weight: f64,
        in_flight: u32,
        engine_load: Option<u32>,
        kv_usage: Option<f32>,
        fleet_latency_us: f64,
    ) -> EngineView {
        let rate = self.errors.value(now_us);
        let latency = self.latency.estimate_us(now_us, fleet_latency_us);
        let factor = self.factor_at(now_us, rate, latency, fleet_latency_us, kv_usage);
        let mut v = EngineView::new(base_weight * factor);
        v.base_weight = base_weight;
        let cfg = &self.auto_cfg;
        v.error_factor = if cfg.enabled {
            error_term(cfg, rate).max(cfg.min_factor)
        } else {
            1.0
        };
        v.eligible = self.eligible(now_us);
        v.in_flight = in_flight;
        v.engine_load = engine_load;
        v.kv_usage = kv_usage;
        v.latency_us = latency;
        v
    }

    /// Reserves a request to this engine (see [`CircuitBreaker::try_acquire`]); `None` when
    /// unhealthy or the breaker refuses.
    pub fn try_acquire(&mut self, now_us: u64) -> Option<Permit> {
        if !self.health.is_healthy() {
            return None;
        }
        self.breaker.try_acquire(now_us)
    }

    /// Like [`try_acquire`](Self::try_acquire) but ignoring active health: for panic mode,
    /// when every engine is ineligible and the request tries them anyway (the breaker still
    /// applies).
    pub fn try_acquire_ignoring_health(&mut self, now_us: u64) -> Option<Permit> {
        self.breaker.try_acquire(now_us)
    }

    /// The first data frame arrived `ttft_us` after sending.
    pub fn on_first_byte(&mut self, now_us: u64, ttft_us: u64) {
        self.answered_us = self.answered_us.max(now_us);
        self.latency.on_ttft(now_us, ttft_us);
    }

    /// The stream ended well, `e2e_us` after sending.
    pub fn on_success(&mut self, now_us: u64, permit: Permit, e2e_us: u64) -> Option<BreakerEvent> {
        self.answered_us = self.answered_us.max(now_us);
        self.latency.on_end(now_us, e2e_us);
        self.errors.observe(now_us, false);
        let ev = self.breaker.on_success(now_us, permit);
        if ev == Some(BreakerEvent::Closed) {
            self.slow_start.start(now_us);
        }
        ev
    }

    /// The request failed (before or during the stream). `may_open`: from
    /// [`EjectionGuard::may_eject`].
    pub fn on_failure(
        &mut self,
        now_us: u64,
        permit: Permit,
        may_open: bool,
    ) -> Option<BreakerEvent> {
        self.latency.on_failure(now_us);
        self.errors.observe(now_us, true);
        self.breaker.on_failure(now_us, permit, may_open)
    }

    /// The request ended without a verdict (client disconnected).
    pub fn on_cancel(&mut self, permit: Permit) {
        self.breaker.on_cancel(permit);
    }

    /// Whether the engine went silent on an attempt whose client went away while it waited:
    /// since `since_us` (when it was sent, or when the last data of its answer came: a stream
    /// that stopped). `work`: what the engine's metrics showed of its work. A wait of at
    /// least `unanswered.after_ms` during which the engine answered nothing at this router
    /// and was seen idle ([`Work::idle_since`]: two scrapes since, no change) makes the
    /// attempt a failure (see [`UnansweredConfig`]: a hung engine that passes its health
    /// checks); anything else a cancel (a busy engine in a long prefill steps, and its
    /// counters change). A query: the caller then calls [`on_failure`](Self::on_failure) or
    /// [`on_cancel`](Self::on_cancel) (the ejection cap, which reads every engine, is only
    /// asked for a failure).
    pub fn went_silent(&self, now_us: u64, since_us: u64, work: Work) -> bool {
        let cfg = &self.unanswered_cfg;
        let waited = now_us.saturating_sub(since_us);
        cfg.enabled
            && waited >= cfg.after_ms.saturating_mul(1000)
            && self.answered_us <= since_us
            && work.idle_since(since_us)
    }

    /// One active health-check result.
    pub fn on_health_check(&mut self, now_us: u64, ok: bool) -> Option<HealthEvent> {
        let ev = self.health.on_check(ok);
        if ev == Some(HealthEvent::BecameHealthy) {
            self.slow_start.start(now_us);
        }
        ev
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_start_ramps_from_min_to_one() {
        let cfg = SlowStartConfig::default();
        let mut s = SlowStart::new();
        assert_eq!(s.factor(&cfg, 5), 1.0);
        s.start(1_000_000);
        assert_eq!(s.factor(&cfg, 1_000_000), 0.1);
        let mid = s.factor(&cfg, 1_000_000 + 15_000_000);
        assert!((mid - 0.5).abs() < 1e-9, "{mid}");
        assert_eq!(s.factor(&cfg, 1_000_000 + 30_000_000), 1.0);
        let fast = SlowStartConfig {
            aggression: 2.0,
            ..cfg
        };
        assert!(s.factor(&fast, 1_000_000 + 7_500_000) > 0.49);
    }

    #[test]
    fn auto_weight_terms() {
        let c = AutoWeightConfig::default();
        assert_eq!(auto_weight_factor(&c, 0.0, 1.0, None), 1.0);
        assert!((auto_weight_factor(&c, 0.25, 1.0, None) - 0.5).abs() < 1e-9);
        assert_eq!(auto_weight_factor(&c, 0.9, 1.0, None), c.min_factor);
        assert_eq!(auto_weight_factor(&c, 0.0, 1.2, None), 1.0);
        assert!((auto_weight_factor(&c, 0.0, 5.0, None) - 0.24).abs() < 1e-9);
        assert_eq!(auto_weight_factor(&c, 0.0, 1.0, Some(0.9)), 1.0);
        assert!((auto_weight_factor(&c, 0.0, 1.0, Some(0.99)) - 0.5).abs() < 1e-6);
        let off = AutoWeightConfig {
            enabled: false,
            ..c
        };
        assert_eq!(auto_weight_factor(&off, 1.0, 9.0, Some(1.0)), 1.0);
    }

    #[test]
    fn active_health_thresholds() {
        let mut h = ActiveHealth::new(&ActiveHealthConfig::default());
        assert!(h.is_healthy());
        assert_eq!(h.on_check(false), None);
        assert_eq!(h.on_check(false), None);
        assert_eq!(h.on_check(true), None); // streak broken
        assert_eq!(h.on_check(false), None);
        assert_eq!(h.on_check(false), None);
        assert_eq!(h.on_check(false), Some(HealthEvent::BecameUnhealthy));
        assert_eq!(h.on_check(true), None);
        assert_eq!(h.on_check(true), Some(HealthEvent::BecameHealthy));
    }

    /// A hung engine (takes requests, never answers) whose clients give up after 2 s: each
    /// abandoned attempt is a failure, and the breaker opens after `consecutive_failures`.
    #[test]
    fn clients_leaving_a_silent_engine_open_its_breaker() {
        let cfg = HealthConfig::default();
        let mut t = EngineTracker::new(&cfg, 0, false);
        let mut now = 1_000_000;
        let mut events = Vec::new();
        for _ in 0..cfg.breaker.consecutive_failures {
            let p = t.try_acquire(now).expect("closed");
            let work = Work::Counted {
                worked_after_us: 0,
                prev_scrape_us: now + 1_000_000,
            };
            let left = now + 2_000_000;
            assert!(t.went_silent(left, now, work), "a silent engine's attempt");
            events.push(t.on_failure(left, p, true));
            now += 100_000;
        }
        assert!(matches!(
            events.last(),
            Some(Some(BreakerEvent::Opened { .. }))
        ));
        assert!(!t.eligible(now + 2_000_000));
        // Its half-open probe left unanswered as well: open again, for longer.
        let later = now + 2_000_000 + cfg.breaker.open_ms * 1000;
        let p = t.try_acquire(later).expect("half-open probe");
        assert!(p.is_probe());
        assert!(t.went_silent(later + 1_500_000, later, Work::Unknown));
        let out = t.on_failure(later + 1_500_000, p, true);
        assert!(
            matches!(out, Some(BreakerEvent::Opened { for_us }) if for_us > cfg.breaker.open_ms * 1000),
            "{out:?}"
        );
    }

    /// An engine that answers others while one client waits is busy, not hung; a short wait,
    /// an engine seen generating, or the switch off are cancels too.
    #[test]
    fn only_a_long_wait_on_a_silent_engine_is_held_against_it() {
        let cfg = HealthConfig::default();
        let sent = 10_000_000;
        let left = sent + 5_000_000;
        // Scrapes every second found nothing grown since before the attempt was sent.
        // (The span from 0.5 s before it was sent saw work: done before the wait.)
        let idle = Work::Counted {
            worked_after_us: sent - 500_000,
            prev_scrape_us: left - 1_000_000,
        };
        let silent = |t: &EngineTracker, work: Work| t.went_silent(left, sent, work);
        let fresh = || EngineTracker::new(&cfg, 0, false);
        assert!(silent(&fresh(), idle));
        assert!(silent(&fresh(), Work::Unknown));
        // Another request's first byte during the wait.
        let mut t = fresh();
        t.on_first_byte(sent + 1, 300_000);
        assert!(!silent(&t, idle));
        // Another request finished during the wait.
        let mut t = fresh();
        let q = t.try_acquire(sent).unwrap();
        t.on_success(sent + 3_000_000, q, 4_000_000);
        assert!(!silent(&t, idle));
        // The engine's counters changed during the wait (a long prefill steps too).
        let worked = Work::Counted {
            worked_after_us: sent + 2_000_000,
            prev_scrape_us: left - 1_000_000,
        };
        assert!(!silent(&fresh(), worked));
        // Fewer than two scrapes since it was sent: the counters cannot tell yet.
        let early = Work::Counted {
            worked_after_us: 0,
            prev_scrape_us: sent - 1,
        };
        assert!(!silent(&fresh(), early));
        // An answer before the attempt was sent says nothing about the wait.
        let mut t = fresh();
        t.on_first_byte(sent - 1, 300_000);
        assert!(silent(&t, idle));
        // Shorter than `after_ms`.
        let short = sent + cfg.unanswered.after_ms * 1000 - 1;
        assert!(!fresh().went_silent(short, sent, Work::Unknown));
        // Switched off.
        let mut off = cfg.clone();
        off.unanswered.enabled = false;
        assert!(!silent(&EngineTracker::new(&off, 0, false), idle));
    }

    /// A fleet much faster than the configured initial latencies (200 ms TTFT, 2 s end to
    /// end): an engine that has no samples yet is weighed as the fleet's median, and one that
    /// looked slow once regains its weight without samples, as its distance fades (QA: a fresh
    /// router's idle engine, weighed at the initial latencies, lost weight to engines
    /// answering in 5 ms, and no policy chose it again: 0 of 180 sequential requests).
    #[test]
    fn an_engine_without_recent_samples_is_weighed_as_the_fleet() {
        let cfg = HealthConfig::default();
        let tau = cfg.latency.decay_ms * 1000;
        let mut fast = EngineTracker::new(&cfg, 0, false);
        let mut idle = EngineTracker::new(&cfg, 0, false);
        let mut now = 1_000_000;
        // Long enough (10 τ) for its estimate to come down from the initial values.
        for _ in 0..2_000 {
            fast.on_first_byte(now, 5_000);
            let p = fast.try_acquire(now).expect("closed");
            fast.on_success(now + 20_000, p, 20_000);
            now += 50_000;
        }
        assert_eq!(idle.latency().sampled_us(), None);
        let sampled = fast.latency().sampled_us().expect("sampled");
        let fleet = fleet_reference_latency(&mut [sampled]);
        assert!(fleet < 8_000.0, "{fleet}");
        assert_eq!(idle.weight_factor(now, fleet, None), 1.0);
        assert_eq!(fast.weight_factor(now, fleet, None), 1.0);
        let view = idle.view(now, 1.0, 0, None, None, fleet);
        assert_eq!(view.latency_us, fleet, "as fast as the fleet for peak_ewma");
        // One slow answer (2 s to its first byte): the engine loses weight at once...
        idle.on_first_byte(now, 2_000_000);
        let slow = idle.weight_factor(now, fleet, None);
        assert!(slow < 0.1, "{slow}");
        // ...and, given no more samples, regains it as its distance from the fleet fades
        // (a 300-fold one, in about 7 τ).
        let rising = idle.weight_factor(now + 3 * tau, fleet, None);
        assert!(rising > 2.0 * slow, "{rising} against {slow}");
        let back = idle.weight_factor(now + 10 * tau, fleet, None);
        assert!(back > 0.99, "{back}");
        // Without a reference (no engine sampled), the initial values stand.
        let none = EngineTracker::new(&cfg, 0, false);
        let initial = (cfg.latency.initial_ttft_ms as f64
            + cfg.latency.e2e_weight * cfg.latency.initial_e2e_ms as f64)
            * 1e3;
        assert!((none.latency().estimate_us(now, 0.0) - initial).abs() < 1e-6);
    }

    #[test]
    fn median() {
        assert_eq!(fleet_reference_latency(&mut [5.0, 1.0, 3.0]), 3.0);
        assert_eq!(fleet_reference_latency(&mut []), 0.0);
    }
}
