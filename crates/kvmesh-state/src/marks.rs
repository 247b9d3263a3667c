//! Speculative prefix marks from routing decisions: (engine, block key) → expiry (cluster time,
//! µs), join = max. Expired marks are dropped by [`MarkMap::expire`] at a given `now`
//! (deterministic: the same `now` drops the same marks everywhere), and each engine keeps at
//! most `per_engine` marks (past it, the marks expiring first go — a bound that, under
//! overflow only, can make two routers keep different marks until those expire).
//!
//! On the wire a mark lists its keys: block keys are chained, so a mark of a prompt's first
//! `n` blocks could name only its last key, but the receiving router needs every key for its
//! index (lookups walk keys in chain order). 8 bytes per 16-token block: a 4,000-token prompt
//! is 2 KB, once per decision, batched with the other deltas.

use crate::{digest_of, part};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// "Engine `engine` holds these blocks until `expiry_us`."
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MarkDelta {
    /// The engine (`kvmesh_prefix::EngineId`'s value).
    pub engine: u64,
    /// The blocks' keys (`kvmesh_prefix::BlockKey` values), in chain order.
    pub keys: Vec<u64>,
    /// Until when (cluster time, µs).
    pub expiry_us: u64,
}

/// Every engine's marks.
#[derive(Debug, Clone)]
pub struct MarkMap {
    by_engine: HashMap<u64, HashMap<u64, u64>>,
    per_engine: usize,
    len: usize,
}

impl MarkMap {
    /// An empty map keeping at most `per_engine` marks per engine.
    pub fn new(per_engine: usize) -> MarkMap {
        MarkMap {
            by_engine: HashMap::new(),
            per_engine: per_engine.max(1),
            len: 0,
        }
    }

    /// Merges a mark: each key's expiry becomes the max of both. True when anything changed.
    pub fn merge(&mut self, d: &MarkDelta) -> bool {
        let m = self.by_engine.entry(d.engine).or_default();
        let mut changed = false;
        for &k in &d.keys {
            match m.get_mut(&k) {
                Some(e) if *e >= d.expiry_us => {}
                Some(e) => {
                    *e = d.expiry_us;
                    changed = true;
                }
                None => {
                    m.insert(k, d.expiry_us);
                    self.len += 1;
                    changed = true;
                }
            }
        }
        if m.len() > self.per_engine {
            let over = m.len() - self.per_engine;
            let mut by_expiry: Vec<(u64, u64)> = m.iter().map(|(k, e)| (*e, *k)).collect();
            by_expiry.sort_unstable();
            for (_, k) in by_expiry.into_iter().take(over) {
                m.remove(&k);
            }
            self.len -= over;
        }
        changed
    }

    /// Drops every mark expired at `now_us` (expiry ≤ now). Returns how many.
    pub fn expire(&mut self, now_us: u64) -> usize {
        let mut dropped = 0;
        self.by_engine.retain(|_, m| {
            let before = m.len();
            m.retain(|_, e| *e > now_us);
            dropped += before - m.len();
            !m.is_empty()
        });
        self.len -= dropped;
        dropped
    }

    /// An engine was removed: its marks go.
    pub fn remove_engine(&mut self, engine: u64) -> usize {
        let n = self.by_engine.remove(&engine).map_or(0, |m| m.len());
        self.len -= n;
        n
    }

    /// Whether `engine` holds `key` live at `now_us`.
    pub fn holds(&self, engine: u64, key: u64, now_us: u64) -> bool {
        self.by_engine
            .get(&engine)
            .and_then(|m| m.get(&key))
            .is_some_and(|e| *e > now_us)
    }

    /// Marks held (live or not yet expired by [`Self::expire`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no mark is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole map as deltas, one per (engine, expiry) (a snapshot; a repair).
    pub fn deltas(&self) -> Vec<MarkDelta> {
        let mut out = Vec::new();
        for (&engine, m) in &self.by_engine {
            let mut by_exp: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
            for (&k, &e) in m {
                by_exp.entry(e).or_default().push(k);
            }
            for (expiry_us, mut keys) in by_exp {
                keys.sort_unstable();
                out.push(MarkDelta {
                    engine,
                    keys,
                    expiry_us,
                });
            }
        }
        out.sort_by_key(|d| (d.engine, d.expiry_us));
        out
    }

    /// A digest of the marks (equal digests: equal maps).
    pub fn digest(&self) -> u64 {
        let mut all: Vec<(u64, u64, u64)> = self
            .by_engine
            .iter()
            .flat_map(|(&eng, m)| m.iter().map(move |(&k, &e)| (eng, k, e)))
            .collect();
        all.sort_unstable();
        digest_of(
            b"kvmesh/marks/v1",
            all.into_iter().map(|(a, b, c)| part(a, b, c, 0)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_is_max_expiry_and_expiry_is_deterministic() {
        let mut m = MarkMap::new(100);
        assert!(m.merge(&MarkDelta {
            engine: 1,
            keys: vec![10, 11],
            expiry_us: 50,
        }));
        assert!(!m.merge(&MarkDelta {
            engine: 1,
            keys: vec![10],
            expiry_us: 40,
        }));
        assert!(m.merge(&MarkDelta {
            engine: 1,
            keys: vec![11],
            expiry_us: 90,
        }));
        assert!(m.holds(1, 10, 49) && !m.holds(1, 10, 50));
        assert!(m.holds(1, 11, 89));
        assert_eq!(m.expire(50), 1);
        assert_eq!(m.len(), 1);
        assert_eq!(m.remove_engine(1), 1);
        assert!(m.is_empty());
    }

    #[test]
    fn the_per_engine_bound_keeps_the_latest_expiring_marks() {
        let mut m = MarkMap::new(3);
        for (k, e) in [(1, 10), (2, 20), (3, 30), (4, 40), (5, 5)] {
            m.merge(&MarkDelta {
                engine: 9,
                keys: vec![k],
                expiry_us: e,
            });
        }
        assert_eq!(m.len(), 3);
        assert!(m.holds(9, 4, 0) && m.holds(9, 3, 0) && m.holds(9, 2, 0));
        assert!(!m.holds(9, 1, 0) && !m.holds(9, 5, 0));
    }
}
