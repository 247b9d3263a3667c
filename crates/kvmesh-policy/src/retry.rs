//! The retry budget: retries cannot amplify an overload.

use crate::config::RetryBudgetConfig;

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
