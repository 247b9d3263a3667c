//! Cluster time: microseconds since the Unix epoch, read from the wall clock once at start and
//! advanced by a monotonic clock — the time base of every pure state machine the gateway
//! drives, and the one expiries on the wire are written in (ARCHITECTURE.md, "Time").
//!
//! The monotonic part is tokio's clock, so tests that pause tokio's time (`start_paused`)
//! drive timeouts, breakers, backoffs and retry budgets in virtual time.

use std::time::{SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

/// A clock (cheap to copy): µs since the Unix epoch, monotonic.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    t0: Instant,
    unix_at_t0_us: u64,
}

impl Default for Clock {
    fn default() -> Self {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        Clock {
            t0: Instant::now(),
            unix_at_t0_us: unix,
        }
    }
}

impl Clock {
    /// Now, in µs since the Unix epoch (never goes back).
    pub fn now_us(&self) -> u64 {
        self.unix_at_t0_us + self.t0.elapsed().as_micros() as u64
    }

    /// The instant `us` µs since the Unix epoch stands for (the clock's start at the latest).
    pub fn instant_at(&self, us: u64) -> Instant {
        self.t0 + std::time::Duration::from_micros(us.saturating_sub(self.unix_at_t0_us))
    }

    /// The same instant as `at`, in µs since the Unix epoch.
    pub fn at_us(&self, at: Instant) -> u64 {
        self.unix_at_t0_us + at.saturating_duration_since(self.t0).as_micros() as u64
    }
}
