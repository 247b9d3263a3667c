//! The retry budget: retries cannot amplify an overload.

use crate::config::RetryBudgetConfig;
use std::sync::atomic::{AtomicU64, Ordering};

/// A token bucket of retries: every request deposits `ratio` of a token, every retry takes a
/// whole one, and `min_per_second` tokens trickle in regardless of traffic (so a quiet router
/// can still retry); the bucket holds at most `max_tokens`. Over any period, retries are thus
/// at most `ratio × requests + min_per_second × seconds + max_tokens`.
///
/// One budget per router (or per model); the gateway keeps it behind a short `Mutex`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryBudget {
    cfg: RetryBudgetConfig,
    tokens: f64,
    at_us: u64,
}

impl RetryBudget {
    /// A bucket holding one second of the floor (`min_per_second`, at most `max_tokens`).
    pub fn new(cfg: &RetryBudgetConfig, now_us: u64) -> Self {
        RetryBudget {
            cfg: *cfg,
            tokens: cfg.min_per_second.min(cfg.max_tokens).max(0.0),
            at_us: now_us,
        }
    }

    fn refill(&mut self, now_us: u64) {
        if now_us > self.at_us {
            let dt = (now_us - self.at_us) as f64 * 1e-6;
            self.tokens = (self.tokens + dt * self.cfg.min_per_second).min(self.cfg.max_tokens);
            self.at_us = now_us;
        }
    }

    /// A new request (not a retry) arrived: deposit `ratio`.
    pub fn on_request(&mut self, now_us: u64) {
        self.refill(now_us);
        self.tokens = (self.tokens + self.cfg.ratio).min(self.cfg.max_tokens);
    }

    /// Asks for one retry: true (and a token is spent) or false (fail instead of retrying).
    pub fn try_retry(&mut self, now_us: u64) -> bool {
        self.refill(now_us);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Tokens available at `now_us` (for metrics).
    pub fn available(&self, now_us: u64) -> f64 {
        let mut b = *self;
        b.refill(now_us);
        b.tokens
    }
}

/// The same token bucket as [`RetryBudget`], shared by every request of a router without a
/// lock: tokens (in thousandths) and the last refill time (ms since the bucket's creation,
/// wrapping) packed in one `AtomicU64`, updated with compare-and-swap.
#[derive(Debug)]
pub struct AtomicRetryBudget {
    cfg: RetryBudgetConfig,
    t0_us: u64,
    /// High 32 bits: milli-tokens; low 32 bits: ms since `t0_us` of the last refill.
    state: AtomicU64,
}

const MILLI: f64 = 1000.0;

impl AtomicRetryBudget {
    /// A bucket holding one second of the floor (`min_per_second`, at most `max_tokens`).
    pub fn new(cfg: &RetryBudgetConfig, now_us: u64) -> Self {
        let tokens = cfg.min_per_second.min(cfg.max_tokens).max(0.0);
        AtomicRetryBudget {
            cfg: *cfg,
            t0_us: now_us,
            state: AtomicU64::new(pack(to_milli(tokens), 0)),
        }
    }

    fn now_ms(&self, now_us: u64) -> u32 {
        (now_us.saturating_sub(self.t0_us) / 1000) as u32
    }

    fn max_milli(&self) -> u32 {
        to_milli(self.cfg.max_tokens)
    }

    /// Applies the refill up to `now` and then `f` (None = leave unchanged); returns f's verdict.
    fn update(&self, now_us: u64, f: impl Fn(u32) -> Option<u32>) -> bool {
        let now_ms = self.now_ms(now_us);
        let mut cur = self.state.load(Ordering::Relaxed);
        loop {
            let (milli, at_ms) = unpack(cur);
            let dt = now_ms.wrapping_sub(at_ms);
            // A clock read older than the last refill (another thread got there first):
            // no refill, keep the newer time.
            let (dt, at) = if dt > u32::MAX / 2 {
                (0, at_ms)
            } else {
                (dt, now_ms)
            };
            let refill = (f64::from(dt) * self.cfg.min_per_second).max(0.0);
            let filled = (f64::from(milli) + refill).min(f64::from(self.max_milli())) as u32;
            let (next, ok) = match f(filled) {
                Some(v) => (v.min(self.max_milli()), true),
                None => (filled, false),
            };
            let new = pack(next, at);
            if new == cur {
                return ok;
            }
            match self
                .state
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return ok,
                Err(x) => cur = x,
            }
        }
    }

    /// A new request (not a retry) arrived: deposit `ratio`.
    pub fn on_request(&self, now_us: u64) {
        let add = to_milli(self.cfg.ratio);
        self.update(now_us, |m| Some(m.saturating_add(add)));
    }

    /// Asks for one retry: true (and a token is spent) or false (fail instead of retrying).
    pub fn try_retry(&self, now_us: u64) -> bool {
        self.update(now_us, |m| m.checked_sub(1000))
    }

    /// Tokens available at `now_us` (for metrics).
    pub fn available(&self, now_us: u64) -> f64 {
        let (milli, at_ms) = unpack(self.state.load(Ordering::Relaxed));
        let dt = self.now_ms(now_us).wrapping_sub(at_ms);
        let dt = if dt > u32::MAX / 2 { 0 } else { dt };
        ((f64::from(milli) + f64::from(dt) * self.cfg.min_per_second) / MILLI)
            .min(self.cfg.max_tokens)
    }
}

fn to_milli(tokens: f64) -> u32 {
    (tokens.max(0.0) * MILLI).min(f64::from(u32::MAX)) as u32
}

fn pack(milli: u32, at_ms: u32) -> u64 {
    (u64::from(milli) << 32) | u64::from(at_ms)
}

fn unpack(v: u64) -> (u32, u32) {
    ((v >> 32) as u32, v as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_bounded_by_ratio_and_floor() {
        let cfg = RetryBudgetConfig::default();
        let mut b = RetryBudget::new(&cfg, 0);
        // 1,000 requests per second for 10 s, every one wanting a retry.
        let (mut requests, mut retries) = (0u64, 0u64);
        for ms in 0..10_000u64 {
            let now = ms * 1_000;
            b.on_request(now);
            requests += 1;
            if b.try_retry(now) {
                retries += 1;
            }
        }
        let bound = 0.2 * requests as f64 + 10.0 * 10.0 + 10.0;
        assert!(retries as f64 <= bound, "{retries} > {bound}");
        assert!(retries as f64 >= 0.2 * requests as f64, "{retries}");
    }

    #[test]
    fn quiet_router_gets_the_floor_but_never_more_than_max() {
        let cfg = RetryBudgetConfig::default();
        let mut b = RetryBudget::new(&cfg, 0);
        assert_eq!(b.available(3_600_000_000), 100.0);
        let mut n = 0;
        while b.try_retry(3_600_000_000) {
            n += 1;
        }
        assert_eq!(n, 100);
        assert!(!b.try_retry(3_600_000_000));
        assert!(!b.try_retry(3_600_050_000)); // 0.05 s × 10/s = half a token
        assert!(b.try_retry(3_600_150_000)); // 1.5 tokens
    }
}

#[cfg(test)]
mod atomic_tests {
    use super::*;

    #[test]
    fn atomic_budget_bounds_retries_like_the_plain_one() {
        let cfg = RetryBudgetConfig::default();
        let b = AtomicRetryBudget::new(&cfg, 0);
        let (mut requests, mut retries) = (0u64, 0u64);
        for ms in 0..10_000u64 {
            let now = ms * 1_000;
            b.on_request(now);
            requests += 1;
            if b.try_retry(now) {
                retries += 1;
            }
        }
        let bound = 0.2 * requests as f64 + 10.0 * 10.0 + 10.0;
        assert!(retries as f64 <= bound, "{retries} > {bound}");
        assert!(retries as f64 >= 0.2 * requests as f64, "{retries}");
        // Quiet for an hour: full, never above max.
        assert_eq!(b.available(3_600_000_000), 100.0);
        let mut n = 0;
        while b.try_retry(3_600_000_000) {
            n += 1;
        }
        assert_eq!(n, 100);
        assert!(!b.try_retry(3_600_050_000)); // 0.05 s × 10/s = half a token
        assert!(b.try_retry(3_600_150_000)); // 1.5 tokens
    }

    #[test]
    fn atomic_budget_is_shared_by_threads_and_never_overspent() {
        let cfg = RetryBudgetConfig {
            ratio: 0.0,
            min_per_second: 0.0,
            max_tokens: 50.0,
        };
        let b = AtomicRetryBudget::new(&cfg, 0);
        // Starts with min(min_per_second, max) = 0 tokens: deposit 50 by hand.
        let cfg2 = RetryBudgetConfig { ratio: 1.0, ..cfg };
        let b2 = AtomicRetryBudget::new(&cfg2, 0);
        for _ in 0..50 {
            b2.on_request(0);
        }
        assert!(!b.try_retry(0));
        let got = std::sync::atomic::AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        if b2.try_retry(0) {
                            got.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(got.load(Ordering::Relaxed), 50);
    }
}
