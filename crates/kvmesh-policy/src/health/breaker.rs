//! The per-engine circuit breaker (passive outlier detection) and the fleet ejection guard.

use crate::config::{BreakerConfig, EjectionConfig};

/// The breaker's state as seen from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Traffic flows; failures are counted.
    Closed,
    /// No traffic until `until_us`; then the next request is a probe.
    Open {
        /// When the open period ends (µs).
        until_us: u64,
    },
    /// Up to `half_open_probes` requests at a time test the engine.
    HalfOpen,
}

/// What a result changed, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerEvent {
    /// The breaker opened for this long (µs).
    Opened {
        /// Length of the open period (µs).
        for_us: u64,
    },
    /// The breaker closed after enough successful probes.
    Closed,
    /// The breaker would have opened but the [`EjectionGuard`] refused (too much of the fleet
    /// is out already); it stays closed and asks again on the next failure.
    OpenSuppressed,
}

/// Permission to send one request, from [`CircuitBreaker::try_acquire`]; hand it back with
/// the result. A permit from before a state change (e.g. a response arriving after the breaker
/// opened) changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permit {
    epoch: u32,
    probe: bool,
}

impl Permit {
    /// True when this request is a half-open probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }
}

const BUCKETS: usize = 10;

/// Request outcomes over a sliding window, in ten buckets.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Window {
    bucket_us: u64,
    cur: u64,
    ok: [u32; BUCKETS],
    fail: [u32; BUCKETS],
}

impl Window {
    fn new(window_ms: u64) -> Self {
        Window {
            bucket_us: (window_ms.saturating_mul(1000) / BUCKETS as u64).max(1),
            cur: 0,
            ok: [0; BUCKETS],
            fail: [0; BUCKETS],
        }
    }

    fn record(&mut self, now_us: u64, failed: bool) {
        let b = now_us / self.bucket_us;
        if b > self.cur {
            let steps = (b - self.cur).min(BUCKETS as u64);
            for s in 1..=steps {
                let i = ((self.cur + s) % BUCKETS as u64) as usize;
                self.ok[i] = 0;
                self.fail[i] = 0;
            }
            self.cur = b;
        }
        let i = (self.cur % BUCKETS as u64) as usize;
        if failed {
            self.fail[i] += 1;
        } else {
            self.ok[i] += 1;
        }
    }

    fn totals(&self) -> (u32, u32) {
        (self.ok.iter().sum(), self.fail.iter().sum())
    }

    fn clear(&mut self) {
        self.ok = [0; BUCKETS];
        self.fail = [0; BUCKETS];
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Closed,
    Open { until_us: u64 },
    HalfOpen { probes_out: u32, successes: u32 },
}

/// Closed → open after `consecutive_failures` in a row or a `failure_ratio` over the window
/// (with at least `min_requests`); open for `open_ms × open_multiplier^(trips − 1)` (capped
/// at `open_max_ms`); then half-open: `half_open_probes` requests at a time; closed again
/// after `close_after_successes` successful probes, open again (longer) on a failed one.
///
/// Driving it: `try_acquire(now)` before sending (None = skip this engine), then exactly one
/// of `on_success` / `on_failure` / `on_cancel` with the permit. What counts as a failure is
/// the gateway's call; the README suggests connect errors, 5xx and timeouts, not 4xx or 429.
#[derive(Debug, Clone, PartialEq)]
pub struct CircuitBreaker {
    cfg: BreakerConfig,
    state: State,
    epoch: u32,
    consecutive: u32,
    window: Window,
    trips: u32,
    last_trip_us: Option<u64>,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(cfg: &BreakerConfig) -> Self {
        CircuitBreaker {
            cfg: *cfg,
            state: State::Closed,
            epoch: 0,
            consecutive: 0,
            window: Window::new(cfg.window_ms),
            trips: 0,
            last_trip_us: None,
        }
    }

    /// The state at `now_us` (an open breaker past its period reports `HalfOpen`).
    pub fn state(&self, now_us: u64) -> BreakerState {
        match self.state {
            State::Closed => BreakerState::Closed,
            State::Open { until_us } if now_us < until_us => BreakerState::Open { until_us },
            _ => BreakerState::HalfOpen,
        }
    }

    /// True while the engine is out of normal rotation (open or half-open): what the
    /// [`EjectionGuard`] counts.
    pub fn is_ejected(&self) -> bool {
        self.cfg.enabled && self.state != State::Closed
    }

    /// Whether a request could be sent now (pure; for [`EngineView::eligible`](crate::EngineView)).
    pub fn allows(&self, now_us: u64) -> bool {
        if !self.cfg.enabled {
            return true;
        }
        match self.state {
            State::Closed => true,
            State::Open { until_us } => now_us >= until_us,
            State::HalfOpen { probes_out, .. } => probes_out < self.cfg.half_open_probes,
        }
    }

    /// Reserves the right to send one request now, or `None` (try the next candidate). Moves
    /// an expired open breaker to half-open (the permit is then a probe).
    pub fn try_acquire(&mut self, now_us: u64) -> Option<Permit> {
        if !self.cfg.enabled {
            return Some(self.permit(false));
        }
        match &mut self.state {
            State::Closed => Some(self.permit(false)),
            State::Open { until_us } => {
                if now_us < *until_us {
                    return None;
                }
                self.epoch = self.epoch.wrapping_add(1);
                self.state = State::HalfOpen {
                    probes_out: 1,
                    successes: 0,
                };
                Some(self.permit(true))
            }
            State::HalfOpen { probes_out, .. } => {
                if *probes_out >= self.cfg.half_open_probes {
                    return None;
                }
                *probes_out += 1;
                Some(self.permit(true))
            }
        }
    }

    fn permit(&self, probe: bool) -> Permit {
        Permit {
            epoch: self.epoch,
            probe,
        }
    }

    /// The request of `permit` succeeded.
    pub fn on_success(&mut self, now_us: u64, permit: Permit) -> Option<BreakerEvent> {
        if !self.cfg.enabled || permit.epoch != self.epoch {
            return None;
        }
        match &mut self.state {
            State::Closed => {
                self.consecutive = 0;
                self.window.record(now_us, false);
                None
            }
            State::HalfOpen {
                probes_out,
                successes,
            } if permit.probe => {
                *probes_out = probes_out.saturating_sub(1);
                *successes += 1;
                if *successes >= self.cfg.close_after_successes {
                    self.close();
                    Some(BreakerEvent::Closed)
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    /// The request of `permit` failed. `may_open`: the [`EjectionGuard`] allows one more
    /// engine out (ignored when already half-open).
    pub fn on_failure(
        &mut self,
        now_us: u64,
        permit: Permit,
        may_open: bool,
    ) -> Option<BreakerEvent> {
        if !self.cfg.enabled || permit.epoch != self.epoch {
            return None;
        }
        match self.state {
            State::Closed => {
                self.consecutive += 1;
                self.window.record(now_us, true);
                let (ok, fail) = self.window.totals();
                let total = ok + fail;
                let trip = self.consecutive >= self.cfg.consecutive_failures
                    || (total >= self.cfg.min_requests
                        && f64::from(fail) >= self.cfg.failure_ratio * f64::from(total));
                if !trip {
                    None
                } else if may_open {
                    Some(self.open(now_us))
                } else {
                    Some(BreakerEvent::OpenSuppressed)
                }
            }
            State::HalfOpen { .. } if permit.probe => Some(self.open(now_us)),
            _ => None,
        }
    }

    /// The request of `permit` ended without a verdict (client went away): frees its probe slot.
    pub fn on_cancel(&mut self, permit: Permit) {
        if permit.epoch != self.epoch || !permit.probe {
            return;
        }
        if let State::HalfOpen { probes_out, .. } = &mut self.state {
            *probes_out = probes_out.saturating_sub(1);
        }
    }

    fn open(&mut self, now_us: u64) -> BreakerEvent {
        let reset_us = self.cfg.backoff_reset_ms.saturating_mul(1000);
        if self
            .last_trip_us
            .is_some_and(|t| now_us.saturating_sub(t) > reset_us)
        {
            self.trips = 0;
        }
        self.trips = self.trips.saturating_add(1);
        let base = self.cfg.open_ms as f64 * 1e3;
        let max = self.cfg.open_max_ms as f64 * 1e3;
        let exp = (self.trips - 1).min(64) as i32;
        let for_us = (base * self.cfg.open_multiplier.powi(exp)).min(max) as u64;
        self.state = State::Open {
            until_us: now_us.saturating_add(for_us),
        };
        self.epoch = self.epoch.wrapping_add(1);
        self.consecutive = 0;
        self.window.clear();
        self.last_trip_us = Some(now_us);
        BreakerEvent::Opened { for_us }
    }

    fn close(&mut self) {
        self.state = State::Closed;
        self.epoch = self.epoch.wrapping_add(1);
        self.consecutive = 0;
        self.window.clear();
    }
}

/// Never lets breakers take out more than `max_ejected_percent` of the fleet (at least one
/// engine always may go, as in Envoy): when errors come from overload rather than broken
/// engines, ejecting many would push the rest over the edge too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectionGuard {
    max_percent: u32,
}

impl EjectionGuard {
    /// A guard with the configured cap.
    pub fn new(cfg: &EjectionConfig) -> Self {
        EjectionGuard {
            max_percent: cfg.max_ejected_percent.min(100),
        }
    }

    /// How many of `fleet` engines may be ejected at once.
    pub fn max_ejected(&self, fleet: usize) -> usize {
        (fleet * self.max_percent as usize / 100).max(1)
    }

    /// Whether one more engine may be ejected while `ejected_now` of `fleet` are: pass the
    /// answer as `may_open` to [`CircuitBreaker::on_failure`].
    pub fn may_eject(&self, ejected_now: usize, fleet: usize) -> bool {
        ejected_now < self.max_ejected(fleet)
    }
}
