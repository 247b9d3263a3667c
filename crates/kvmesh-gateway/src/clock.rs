//! Monotonic time in microseconds since the router started: the time base of every pure
//! state machine the gateway drives.

use std::time::Instant;

/// A monotonic clock (cheap to copy).
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    t0: Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Clock { t0: Instant::now() }
    }
}

impl Clock {
    /// Microseconds since the clock started.
    pub fn now_us(&self) -> u64 {
        self.t0.elapsed().as_micros() as u64
    }

    /// Microseconds from the clock's start to `at`.
    pub fn at_us(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.t0).as_micros() as u64
    }
}
