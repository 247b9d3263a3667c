//! Speculative prefix marks from routing decisions: (engine, block key) → expiry (cluster time,
//! µs), join = max. Expired marks are dropped by [`MarkMap::expire`] at a given `now`
//! (deterministic: the same `now` drops the same marks everywhere), and each engine keeps at
//! most `per_engine` marks (past it, the marks expiring first go — a bound that, under
//! overflow only, can make two routers keep different marks until those expire).
//!
//! # Covering marks
//!
//! Block keys are chained: an engine sent a prompt up to chain position `q` holds every
//! earlier position too. So a mark names only the *top* key of each anchor window it covers
//! (windows end at positions that are multiples of [`MARK_WINDOW`], or at the chain's last
//! key): a mark of a 72-block prompt's last 8 blocks names 2 keys, of a new 4,000-token
//! prompt 32 of 250. The receiving router's index lets a live speculative entry vouch for the
//! earlier positions of its window (`kvmesh_prefix::PrefixIndex::held_prefix`), and this map
//! answers "until when is position `i` of this chain covered" the same way
//! ([`MarkMap::covered_expiries`]), so that what travels is what the cluster lacks.

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

/// Width of the expiry buckets anti-entropy compares (µs): marks made at about the same time
/// share a bucket, so two routers that differ only by the marks of the last instant exchange
/// only those.
pub const MARK_BUCKET_US: u64 = 1_000_000;

#[inline]
fn mix(engine: u64, key: u64, expiry: u64) -> u64 {
    let mut x = engine ^ key.rotate_left(21) ^ expiry.rotate_left(42) ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 32)
}

/// Width of the anchor windows marks cover: equal to `kvmesh_prefix::ANCHOR_STRIDE` (the
/// gateway, which depends on both crates, asserts it at compile time).
pub const MARK_WINDOW: usize = 8;

/// The top of chain position `i`'s window in a chain of `len` keys: the next multiple of
/// [`MARK_WINDOW`] at or after `i`, or the chain's last position when the chain ends first.
#[inline]
pub fn window_top(i: usize, len: usize) -> Option<usize> {
    if i >= len {
        return None;
    }
    Some(i.next_multiple_of(MARK_WINDOW).min(len - 1))
}

/// The keys a mark names to cover the chain positions `needed` (ascending) of `keys`: the top
/// of each window holding a needed position, in chain order, each once.
pub fn covering_keys(keys: &[u64], needed: impl IntoIterator<Item = usize>) -> Vec<u64> {
    let mut out = Vec::new();
    let mut last = None;
    for i in needed {
        let Some(top) = window_top(i, keys.len()) else {
            continue;
        };
        if last != Some(top) {
            out.push(keys[top]);
            last = Some(top);
        }
    }
    out
}

/// Every engine's marks.
#[derive(Debug, Clone)]
pub struct MarkMap {
    by_engine: HashMap<u64, HashMap<u64, u64>>,
    per_engine: usize,
    len: usize,
    /// Expiry bucket → (xor of its marks' hashes, count): maintained at every change.
    buckets: BTreeMap<u64, (u64, u64)>,
}

impl MarkMap {
    /// An empty map keeping at most `per_engine` marks per engine.
    pub fn new(per_engine: usize) -> MarkMap {
        MarkMap {
            by_engine: HashMap::new(),
            per_engine: per_engine.max(1),
            len: 0,
            buckets: BTreeMap::new(),
        }
    }

    fn touch(
        buckets: &mut BTreeMap<u64, (u64, u64)>,
        engine: u64,
        key: u64,
        expiry: u64,
        add: bool,
    ) {
        let b = buckets.entry(expiry / MARK_BUCKET_US).or_insert((0, 0));
        b.0 ^= mix(engine, key, expiry);
        if add {
            b.1 += 1;
        } else {
            b.1 -= 1;
            if b.1 == 0 {
                buckets.remove(&(expiry / MARK_BUCKET_US));
            }
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
                    Self::touch(&mut self.buckets, d.engine, k, *e, false);
                    *e = d.expiry_us;
                    Self::touch(&mut self.buckets, d.engine, k, d.expiry_us, true);
                    changed = true;
                }
                None => {
                    m.insert(k, d.expiry_us);
                    Self::touch(&mut self.buckets, d.engine, k, d.expiry_us, true);
                    self.len += 1;
                    changed = true;
                }
            }
        }
        if m.len() > self.per_engine {
            // Down to 7/8 of the bound at once (not one by one per merge), the marks that
            // expire first going first.
            let keep = self.per_engine - self.per_engine / 8;
            let over = m.len() - keep;
            let mut by_expiry: Vec<(u64, u64)> = m.iter().map(|(k, e)| (*e, *k)).collect();
            by_expiry.select_nth_unstable(over - 1);
            for &(e, k) in &by_expiry[..over] {
                m.remove(&k);
                Self::touch(&mut self.buckets, d.engine, k, e, false);
            }
            self.len -= over;
        }
        changed
    }

    /// Drops every mark expired at `now_us` (expiry ≤ now). Returns how many.
    pub fn expire(&mut self, now_us: u64) -> usize {
        // Nothing to do unless the oldest bucket holds a mark that expired.
        if self
            .buckets
            .keys()
            .next()
            .is_none_or(|&b| b * MARK_BUCKET_US > now_us)
        {
            return 0;
        }
        let mut dropped = 0;
        let buckets = &mut self.buckets;
        self.by_engine.retain(|&engine, m| {
            let before = m.len();
            m.retain(|&k, e| {
                let live = *e > now_us;
                if !live {
                    Self::touch(buckets, engine, k, *e, false);
                }
                live
            });
            dropped += before - m.len();
            !m.is_empty()
        });
        self.len -= dropped;
        dropped
    }

    /// An engine was removed: its marks go.
    pub fn remove_engine(&mut self, engine: u64) -> usize {
        let Some(m) = self.by_engine.remove(&engine) else {
            return 0;
        };
        for (k, e) in &m {
            Self::touch(&mut self.buckets, engine, *k, *e, false);
        }
        self.len -= m.len();
        m.len()
    }

    /// Per expiry bucket: a hash of its marks (what anti-entropy compares).
    pub fn buckets(&self) -> Vec<(u64, u64)> {
        self.buckets
            .iter()
            .map(|(&b, &(x, n))| (b, x ^ n.rotate_left(48)))
            .collect()
    }

    /// The marks of the given expiry buckets as deltas (a repair).
    pub fn deltas_in(&self, buckets: &std::collections::BTreeSet<u64>) -> Vec<MarkDelta> {
        self.deltas_where(|expiry| buckets.contains(&(expiry / MARK_BUCKET_US)))
    }

    /// `engine`'s marks as deltas (expired or not).
    pub fn deltas_of_engine(&self, engine: u64) -> Vec<MarkDelta> {
        let mut out = Vec::new();
        if let Some(m) = self.by_engine.get(&engine) {
            Self::engine_deltas(engine, m, &|_| true, &mut out);
        }
        out
    }

    /// Whether `engine` has a mark.
    pub fn has_engine(&self, engine: u64) -> bool {
        self.by_engine.contains_key(&engine)
    }

    /// The engines with a mark.
    pub fn engines(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_engine.keys().copied()
    }

    /// The marks whose expiry passes `keep`, one delta per (engine, expiry), sorted.
    fn deltas_where(&self, keep: impl Fn(u64) -> bool) -> Vec<MarkDelta> {
        let mut out = Vec::new();
        for (&engine, m) in &self.by_engine {
            Self::engine_deltas(engine, m, &keep, &mut out);
        }
        out.sort_by_key(|d| (d.engine, d.expiry_us));
        out
    }

    /// `engine`'s marks `m` whose expiry passes `keep`, one delta per expiry, into `out`.
    fn engine_deltas(
        engine: u64,
        m: &HashMap<u64, u64>,
        keep: &impl Fn(u64) -> bool,
        out: &mut Vec<MarkDelta>,
    ) {
        let mut by_exp: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (&k, &e) in m {
            if keep(e) {
                by_exp.entry(e).or_default().push(k);
            }
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

    /// The expiry of `engine`'s mark of `key`, if any (expired or not).
    pub fn expiry(&self, engine: u64, key: u64) -> Option<u64> {
        self.by_engine
            .get(&engine)
            .and_then(|m| m.get(&key))
            .copied()
    }

    /// Per position of the chain `keys` (from its first block): until when this map's marks
    /// of `engine` cover it — the latest expiry among the marks of the position and of the
    /// later positions of its window (expired or not) — or `None`.
    pub fn covered_expiries(&self, engine: u64, keys: &[u64]) -> Vec<Option<u64>> {
        let mut out = vec![None; keys.len()];
        let Some(m) = self.by_engine.get(&engine) else {
            return out;
        };
        for i in (0..keys.len()).rev() {
            let own = m.get(&keys[i]).copied();
            // Position i + 1 is in i's window unless i is a window's top (an anchor).
            let later = if i % MARK_WINDOW != 0 {
                out.get(i + 1).copied().flatten()
            } else {
                None
            };
            out[i] = own.max(later);
        }
        out
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
        self.deltas_where(|_| true)
    }

    /// A digest of the marks (equal digests: equal maps, with the odds of a 64-bit hash).
    pub fn digest(&self) -> u64 {
        self.digest_from_bucket(0)
    }

    /// A digest of the marks that outlive the next whole expiry bucket after `now_us`: what
    /// routers compare. Marks about to lapse are left out, so routers whose clocks differ by
    /// less than a bucket (1 s) agree except while a bucket boundary lies between their
    /// clocks (a fraction skew / 1 s of the time), instead of whenever any mark expires
    /// between them; and nobody repairs a mark that lapses within two seconds anyway.
    pub fn digest_beyond(&self, now_us: u64) -> u64 {
        self.digest_from_bucket(now_us / MARK_BUCKET_US + 2)
    }

    fn digest_from_bucket(&self, first: u64) -> u64 {
        digest_of(
            b"kvmesh/marks/v2",
            self.buckets
                .range(first..)
                .map(|(&b, &(x, n))| part(b, x ^ n.rotate_left(48), 0, 0)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routers_compare_only_marks_that_outlive_the_next_second() {
        let s = MARK_BUCKET_US;
        let far = MarkDelta {
            engine: 1,
            keys: vec![1, 2],
            expiry_us: 10 * s + 5,
        };
        let (mut a, mut b) = (MarkMap::new(100), MarkMap::new(100));
        a.merge(&far);
        b.merge(&far);
        // Only A still holds a mark lapsing at 6.5 s (B's clock, ahead, expired it).
        a.merge(&MarkDelta {
            engine: 1,
            keys: vec![3],
            expiry_us: 6 * s + s / 2,
        });
        assert_ne!(a.digest(), b.digest());
        // At 5.2 s on A and 5.4 s on B: both leave out buckets before 7 s.
        assert_eq!(
            a.digest_beyond(5 * s + s / 5),
            b.digest_beyond(5 * s + 2 * s / 5)
        );
        // A mark that outlives the next second counts.
        a.merge(&MarkDelta {
            engine: 1,
            keys: vec![4],
            expiry_us: 8 * s,
        });
        assert_ne!(a.digest_beyond(5 * s), b.digest_beyond(5 * s));
    }

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

    #[test]
    fn a_mark_names_the_top_of_each_window_it_covers() {
        let keys: Vec<u64> = (100..172).collect(); // 72 positions: windows end at 0, 8, .., 64, 71
        assert_eq!(covering_keys(&keys, 64..72), vec![164, 171]);
        assert_eq!(covering_keys(&keys, [0]), vec![100]);
        assert_eq!(covering_keys(&keys, 0..72).len(), 10, "0, 8, .., 64 and 71");
        assert_eq!(covering_keys(&keys, [3, 5, 9]), vec![108, 116]);
        assert_eq!(covering_keys(&keys, [80]), Vec::<u64>::new());
        assert_eq!(window_top(0, 1), Some(0));
        assert_eq!(window_top(1, 3), Some(2));
        assert_eq!(window_top(8, 20), Some(8));
        assert_eq!(window_top(9, 20), Some(16));
        assert_eq!(window_top(20, 20), None);
    }

    #[test]
    fn a_window_top_covers_its_window_and_nothing_before_it() {
        let keys: Vec<u64> = (100..120).collect(); // 20 positions
        let mut m = MarkMap::new(100);
        m.merge(&MarkDelta {
            engine: 1,
            keys: covering_keys(&keys, 9..20),
            expiry_us: 50,
        });
        m.merge(&MarkDelta {
            engine: 1,
            keys: vec![keys[12]],
            expiry_us: 70,
        });
        let c = m.covered_expiries(1, &keys);
        assert_eq!(&c[..9], &[None; 9], "position 8 is its own window's top");
        assert_eq!(&c[9..13], &[Some(70); 4], "12 vouches for 9..=12 until 70");
        assert_eq!(&c[13..17], &[Some(50); 4], "16 for 13..=16");
        assert_eq!(&c[17..], &[Some(50); 3], "19 (the last) for 17..=19");
        assert_eq!(m.covered_expiries(2, &keys), vec![None; 20]);
    }
}
