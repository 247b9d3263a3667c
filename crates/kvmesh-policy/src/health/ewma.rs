//! Time-decayed averages: peak-EWMA latency and the error rate.

use crate::config::{AutoWeightConfig, LatencyConfig};

/// An exponentially weighted moving average in continuous time.
///
/// * A sample `s` at time `t` moves the estimate by `α = 1 − exp(−Δt / τ)` toward `s`
///   (Δt since the previous sample), so the average covers about the last τ of time whatever
///   the request rate (Finagle/Linkerd/tower semantics).
/// * **Peak** mode: a sample above the estimate replaces it at once; only the way down is
///   smoothed. One slow response makes an engine look slow immediately.
/// * Between samples the estimate drifts back toward `rest` with the same τ, so an engine that
///   got no traffic since it looked bad (or good) is retried as an average one eventually.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeakEwma {
    est: f64,
    at_us: u64,
    tau_us: f64,
    rest: f64,
    peak: bool,
}

impl PeakEwma {
    /// An estimate starting at (and decaying toward) `rest`, with time constant `tau_us`;
    /// `peak` = jump up at once on a higher sample.
    pub fn new(rest: f64, tau_us: u64, peak: bool, now_us: u64) -> Self {
        PeakEwma {
            est: rest,
            at_us: now_us,
            tau_us: (tau_us.max(1)) as f64,
            rest,
            peak,
        }
    }

    /// The estimate at `now_us` (pure: includes the drift toward `rest` since the last
    /// sample).
    #[inline]
    pub fn value(&self, now_us: u64) -> f64 {
        let dt = now_us.saturating_sub(self.at_us) as f64;
        if dt == 0.0 {
            return self.est;
        }
        self.rest + (self.est - self.rest) * (-dt / self.tau_us).exp()
    }

    /// Records a sample taken at `now_us`. Times going backwards count as no elapsed time.
    pub fn observe(&mut self, now_us: u64, sample: f64) {
        if !sample.is_finite() {
            return;
        }
        // Blend from the last estimate, not from its drifted reading: blending from the
        // drifted value would pull every sample toward `rest`, and under steady traffic the
        // estimate would settle halfway between `rest` and the true latency. The drift is only
        // for reading an engine that gets no samples; after a long gap α ≈ 1 anyway.
        let base = self.est;
        let dt = now_us.saturating_sub(self.at_us) as f64;
        self.est = if self.peak && sample > base {
            sample
        } else {
            let alpha = 1.0 - (-dt / self.tau_us).exp();
            base + (sample - base) * alpha
        };
        self.at_us = self.at_us.max(now_us);
    }
}

/// Latency of one engine: TTFT (peak EWMA: queueing shows up there first) and end-to-end
/// (plain EWMA: its spread is dominated by output length, so one long answer must not make an
/// engine look slow). A failure counts as a very slow sample in both.
///
/// `latency_us = ttft + e2e_weight × e2e` is what `peak_ewma` multiplies by `(load + 1)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyTracker {
    ttft: PeakEwma,
    e2e: PeakEwma,
    cfg: LatencyConfig,
    /// A sample was recorded (a first byte, an end or a failure).
    sampled: bool,
}

impl LatencyTracker {
    /// A tracker at the configured initial values.
    pub fn new(cfg: &LatencyConfig, now_us: u64) -> Self {
        let tau = cfg.decay_ms.saturating_mul(1000);
        LatencyTracker {
            ttft: PeakEwma::new(cfg.initial_ttft_ms as f64 * 1e3, tau, true, now_us),
            e2e: PeakEwma::new(cfg.initial_e2e_ms as f64 * 1e3, tau, false, now_us),
            cfg: *cfg,
            sampled: false,
        }
    }

    /// The first data frame of a response arrived `ttft_us` after the request was sent.
    pub fn on_ttft(&mut self, now_us: u64, ttft_us: u64) {
        self.sampled = true;
        self.ttft.observe(now_us, ttft_us as f64);
    }

    /// A response completed `e2e_us` after the request was sent.
    pub fn on_end(&mut self, now_us: u64, e2e_us: u64) {
        self.sampled = true;
        self.e2e.observe(now_us, e2e_us as f64);
    }

    /// A request failed (connect error, 5xx, timeout, broken stream): recorded as a very slow
    /// sample, so an engine that fails fast looks slow, not fast. The sample is
    /// `factor × current`, at least `failure_penalty_ms`, and at most
    /// `max(factor × failure_penalty_ms, current)`: a run of failures cannot grow the estimate
    /// without bound (which would keep the engine out long after it recovered).
    pub fn on_failure(&mut self, now_us: u64) {
        let floor = self.cfg.failure_penalty_ms as f64 * 1e3;
        let f = self.cfg.failure_penalty_factor;
        let penalty = |cur: f64| (f * cur).min((f * floor).max(cur)).max(floor);
        let t = penalty(self.ttft.value(now_us));
        let e = penalty(self.e2e.value(now_us));
        self.sampled = true;
        self.ttft.observe(now_us, t);
        self.e2e.observe(now_us, e);
    }

    /// TTFT estimate (µs).
    pub fn ttft_us(&self, now_us: u64) -> f64 {
        self.ttft.value(now_us)
    }

    /// End-to-end estimate (µs).
    pub fn e2e_us(&self, now_us: u64) -> f64 {
        self.e2e.value(now_us)
    }

    /// The combined latency estimate (µs) on its own: drifting toward the configured initial
    /// values while the engine gets no samples.
    pub fn latency_us(&self, now_us: u64) -> f64 {
        self.ttft.value(now_us) + self.cfg.e2e_weight * self.e2e.value(now_us)
    }

    /// The combined estimate as the last sample left it (no drift), if there was one: what
    /// the fleet's reference latency is made of.
    pub fn sampled_us(&self) -> Option<f64> {
        self.sampled
            .then_some(self.ttft.est + self.cfg.e2e_weight * self.e2e.est)
    }

    /// The combined estimate (µs) for [`EngineView::latency_us`](crate::EngineView) and the
    /// automatic weight, against the fleet's reference `reference_us` (the median of the
    /// sampled engines, [`crate::fleet_reference_latency`]; 0 = unknown). An engine without
    /// samples is as fast as the fleet, and a sampled one's distance from the fleet fades
    /// with τ while it gets no samples. Drifting toward the fixed initial values instead, an
    /// engine a policy stopped choosing (it had no samples yet, or one slow answer) never
    /// got the sample that would clear it where the fleet is faster than those values (QA:
    /// an idle engine of a fresh router starved by its weight, 0 of 180 sequential requests).
    /// Without a reference, [`LatencyTracker::latency_us`].
    pub fn estimate_us(&self, now_us: u64, reference_us: f64) -> f64 {
        if !(reference_us.is_finite() && reference_us > 0.0) {
            return self.latency_us(now_us);
        }
        let Some(est) = self.sampled_us() else {
            return reference_us;
        };
        let last = self.ttft.at_us.max(self.e2e.at_us);
        let age = now_us.saturating_sub(last) as f64;
        reference_us + (est - reference_us) * (-age / self.ttft.tau_us).exp()
    }
}

/// The recent error rate of one engine, in `[0, 1]`.
///
/// Each result moves the rate by `max(error_min_step, 1 − exp(−Δt/τ))` toward 1 (failure) or
/// 0 (success): time-based like [`PeakEwma`] at low rates, but a burst of failures registers
/// within a few requests even at thousands per second. Without results it decays toward 0
/// (forgiveness), so an engine pushed out by its error rate is tried again later.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorRate {
    rate: f64,
    at_us: u64,
    tau_us: f64,
    min_step: f64,
}

impl ErrorRate {
    /// A zero error rate.
    pub fn new(cfg: &AutoWeightConfig, now_us: u64) -> Self {
        ErrorRate {
            rate: 0.0,
            at_us: now_us,
            tau_us: (cfg.error_decay_ms.max(1) * 1000) as f64,
            min_step: cfg.error_min_step.clamp(0.0, 1.0),
        }
    }

    /// The rate at `now_us`.
    #[inline]
    pub fn value(&self, now_us: u64) -> f64 {
        let dt = now_us.saturating_sub(self.at_us) as f64;
        self.rate * (-dt / self.tau_us).exp()
    }

    /// Records one result.
    pub fn observe(&mut self, now_us: u64, failed: bool) {
        let cur = self.value(now_us);
        let dt = now_us.saturating_sub(self.at_us) as f64;
        let alpha = (1.0 - (-dt / self.tau_us).exp()).max(self.min_step);
        let x = if failed { 1.0 } else { 0.0 };
        self.rate = (cur + (x - cur) * alpha).clamp(0.0, 1.0);
        self.at_us = self.at_us.max(now_us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_jumps_up_and_decays_down() {
        let mut e = PeakEwma::new(100.0, 10_000_000, true, 0);
        e.observe(1_000, 1_000.0);
        assert_eq!(e.value(1_000), 1_000.0);
        // A lower sample right after barely moves it.
        e.observe(2_000, 10.0);
        assert!(e.value(2_000) > 990.0);
        // Long after, the estimate has drifted back to rest.
        assert!((e.value(1_000_000_000) - 100.0).abs() < 1e-6);
        // After a long gap, a low sample dominates.
        e.observe(1_000_000_000, 50.0);
        assert!(e.value(1_000_000_000) < 51.0);
    }

    #[test]
    fn steady_samples_converge_to_the_true_latency() {
        // 5 ms samples every 10 ms from a 200 ms start, τ = 10 s: after two minutes the estimate
        // is the latency (within e^-12 of the start), not halfway between the two.
        for peak in [true, false] {
            let mut e = PeakEwma::new(200_000.0, 10_000_000, peak, 0);
            for i in 1..=12_000u64 {
                e.observe(i * 10_000, 5_000.0);
            }
            let v = e.value(120_000_000);
            assert!((v - 5_000.0).abs() < 50.0, "peak={peak}: {v}");
        }
    }

    #[test]
    fn symmetric_mode_smooths_both_ways() {
        let mut e = PeakEwma::new(100.0, 10_000_000, false, 0);
        e.observe(1_000_000, 1_000.0); // α = 1 − e^-0.1 ≈ 0.095
        let v = e.value(1_000_000);
        assert!((180.0..200.0).contains(&v), "{v}");
    }

    #[test]
    fn failure_looks_slow() {
        let mut l = LatencyTracker::new(&LatencyConfig::default(), 0);
        l.on_ttft(1_000, 50_000);
        l.on_failure(2_000);
        assert!(l.ttft_us(2_000) >= 10_000_000.0);
        // A run of failures is bounded: factor × floor = 20 s.
        for i in 0..50 {
            l.on_failure(3_000 + i);
        }
        assert_eq!(l.ttft_us(3_049), 20_000_000.0);
    }

    #[test]
    fn error_rate_rises_within_a_burst_and_decays_when_idle() {
        let cfg = AutoWeightConfig::default();
        let mut r = ErrorRate::new(&cfg, 0);
        for i in 0..20 {
            r.observe(1_000 + i, true);
        }
        assert!(r.value(1_020) > 0.85, "{}", r.value(1_020));
        assert!(r.value(1_020 + 60_000_000) < 0.15);
        for i in 0..40 {
            r.observe(2_000 + i, false);
        }
        assert!(r.value(2_040) < 0.02);
    }
}
