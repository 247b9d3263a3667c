//! The last routing decisions, for the status page: a small bounded ring, written on the
//! request path with `try_lock` (a contended write is skipped and counted, never waited for),
//! read by `GET /status.json`. The lock is a plain mutex held for a few stores, never across
//! an await, and a full ring reuses its slots' string buffers: no allocation once warm.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// How many decisions the ring keeps.
pub const CAPACITY: usize = 64;

/// One routing decision as the status page shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecentDecision {
    /// When (cluster µs since the Unix epoch).
    pub at_us: u64,
    /// The model asked for.
    pub model: String,
    /// The engine chosen first (its URL).
    pub engine: String,
    /// Why it was chosen (the metric label of `kvmesh_routing_decisions_total`).
    pub reason: &'static str,
    /// Prompt tokens the router saw (cache-aware routes), else 0.
    pub prompt_tokens: u32,
    /// Prompt tokens the router predicted the engine holds (cache-aware routes), else 0.
    pub predicted_cached_tokens: u64,
}

/// A bounded ring of the last [`CAPACITY`] decisions.
#[derive(Debug, Default)]
pub struct Recent {
    ring: Mutex<Ring>,
    skipped: AtomicU64,
    total: AtomicU64,
}

#[derive(Debug, Default)]
struct Ring {
    items: Vec<RecentDecision>,
    next: usize,
}

impl Recent {
    /// Remembers a decision, unless another thread is writing or reading at this instant
    /// (then it is skipped: the page shows a sample, the request never waits for it).
    pub fn record(
        &self,
        at_us: u64,
        model: &str,
        engine: &str,
        reason: &'static str,
        prompt_tokens: u32,
        predicted_cached_tokens: u64,
    ) {
        self.total.fetch_add(1, Relaxed);
        let Ok(mut r) = self.ring.try_lock() else {
            self.skipped.fetch_add(1, Relaxed);
            return;
        };
        let i = r.next;
        if r.items.len() < CAPACITY {
            r.items.push(RecentDecision {
                at_us,
                model: model.to_string(),
                engine: engine.to_string(),
                reason,
                prompt_tokens,
                predicted_cached_tokens,
            });
        } else {
            let slot = &mut r.items[i];
            slot.at_us = at_us;
            slot.model.clear();
            slot.model.push_str(model);
            slot.engine.clear();
            slot.engine.push_str(engine);
            slot.reason = reason;
            slot.prompt_tokens = prompt_tokens;
            slot.predicted_cached_tokens = predicted_cached_tokens;
        }
        r.next = (i + 1) % CAPACITY;
    }

    /// The decisions held, newest first.
    pub fn newest_first(&self) -> Vec<RecentDecision> {
        let r = match self.ring.lock() {
            Ok(r) => r,
            Err(p) => p.into_inner(),
        };
        let n = r.items.len();
        // The newest is just before `next` (k ≤ n ≤ CAPACITY: no underflow).
        (1..=n)
            .map(|k| r.items[(r.next + CAPACITY - k) % CAPACITY].clone())
            .collect()
    }

    /// Decisions recorded in total, and how many of them the ring skipped (contention).
    pub fn counts(&self) -> (u64, u64) {
        (self.total.load(Relaxed), self.skipped.load(Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(r: &Recent, i: u64) {
        r.record(i, "m", &format!("e{i}"), "round_robin", 0, i * 16);
    }

    #[test]
    fn keeps_the_newest_first_and_stays_bounded() {
        let r = Recent::default();
        assert!(r.newest_first().is_empty());
        for i in 0..3 {
            d(&r, i);
        }
        let v: Vec<u64> = r.newest_first().iter().map(|x| x.at_us).collect();
        assert_eq!(v, vec![2, 1, 0]);
        for i in 3..(CAPACITY as u64 * 2 + 5) {
            d(&r, i);
        }
        let v: Vec<u64> = r.newest_first().iter().map(|x| x.at_us).collect();
        assert_eq!(v.len(), CAPACITY);
        let last = CAPACITY as u64 * 2 + 4;
        let want: Vec<u64> = (0..CAPACITY as u64).map(|k| last - k).collect();
        assert_eq!(v, want);
        let newest = &r.newest_first()[0];
        assert_eq!(
            (newest.engine.as_str(), newest.predicted_cached_tokens),
            (format!("e{last}").as_str(), last * 16)
        );
        assert_eq!(r.counts(), (last + 1, 0));
    }

    #[test]
    fn a_held_lock_skips_the_write_instead_of_waiting() {
        let r = Recent::default();
        let g = r.ring.lock().expect("lock");
        d(&r, 1);
        drop(g);
        assert_eq!(r.counts(), (1, 1));
        assert!(r.newest_first().is_empty());
    }
}
