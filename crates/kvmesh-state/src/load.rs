//! Per-(router, engine) in-flight load: each router is the single writer of its own entries;
//! an entry keeps the newest version; the entries of a router that left vanish and stay gone
//! (a tombstone by incarnation stops late deltas of that incarnation from bringing them back).
//!
//! A router's view of an engine's load = its own in-flight + the sum of the others' entries
//! ([`LoadMap::others`]) + what the engine reports.

use crate::ids::{NodeId, Version};
use crate::{digest_of, part};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// One router's in-flight count on one engine at one version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoadDelta {
    /// The writer.
    pub node: NodeId,
    /// The engine (`kvmesh_prefix::EngineId`'s value).
    pub engine: u64,
    /// The writer's version of this entry.
    pub version: Version,
    /// Requests the writer has in flight to the engine.
    pub in_flight: u32,
}

/// Several in-flight counts of one router's incarnation, as they travel (the router and its
/// incarnation once, not per engine).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoadBatch {
    /// The router.
    pub node: NodeId,
    /// Its incarnation.
    pub incarnation: u64,
    /// (engine, counter within the incarnation − the previous item's (the first: − 0), in
    /// flight). A router's changes are numbered one by one, so a flush's counters differ by
    /// little: a byte each on the wire instead of the counter's three to five.
    pub items: Vec<(u64, i64, u32)>,
}

impl LoadBatch {
    /// Groups deltas by (router, incarnation), keeping their order within each group.
    pub fn compact(deltas: impl IntoIterator<Item = LoadDelta>) -> Vec<LoadBatch> {
        // Per batch: the counter of its last item.
        let mut out: Vec<(LoadBatch, u64)> = Vec::new();
        for d in deltas {
            let c = d.version.counter;
            match out
                .iter_mut()
                .find(|(b, _)| b.node == d.node && b.incarnation == d.version.incarnation)
            {
                Some((b, last)) => {
                    b.items
                        .push((d.engine, c.wrapping_sub(*last) as i64, d.in_flight));
                    *last = c;
                }
                None => out.push((
                    LoadBatch {
                        node: d.node,
                        incarnation: d.version.incarnation,
                        items: vec![(d.engine, c as i64, d.in_flight)],
                    },
                    c,
                )),
            }
        }
        out.into_iter().map(|(b, _)| b).collect()
    }

    /// The deltas it carries.
    pub fn deltas(&self) -> impl Iterator<Item = LoadDelta> + '_ {
        let mut counter = 0u64;
        self.items.iter().map(move |&(engine, diff, in_flight)| {
            counter = counter.wrapping_add(diff as u64);
            LoadDelta {
                node: self.node,
                engine,
                version: Version {
                    incarnation: self.incarnation,
                    counter,
                },
                in_flight,
            }
        })
    }
}

/// An entry as the delta that carries it.
fn as_delta((&(node, engine), e): (&(NodeId, u64), &Entry)) -> LoadDelta {
    LoadDelta {
        node,
        engine,
        version: e.version,
        in_flight: e.in_flight,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    version: Version,
    in_flight: u32,
}

/// Per router: the xor of its entries' hashes, its newest version and its entry count, kept
/// at every change (what anti-entropy compares: O(routers), not O(entries), at each digest).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct NodeSum {
    hash: u64,
    newest: Version,
    count: usize,
}

/// An entry's part of its router's hash.
#[inline]
fn entry_hash(engine: u64, e: &Entry) -> u64 {
    let mut x = engine
        ^ e.version.incarnation.rotate_left(17)
        ^ e.version.counter.rotate_left(34)
        ^ u64::from(e.in_flight).rotate_left(51);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    x
}

/// The load entries of every router.
#[derive(Debug, Clone, Default)]
pub struct LoadMap {
    entries: BTreeMap<(NodeId, u64), Entry>,
    /// Per engine, the sum over routers (kept: reads are O(1)).
    totals: HashMap<u64, u64>,
    /// Per router, its entries' digest (kept).
    sums: BTreeMap<NodeId, NodeSum>,
    /// Per engine, how many entries name it (kept).
    per_engine: HashMap<u64, usize>,
    /// Routers that left: deltas of these incarnations (and older) are dropped.
    departed: BTreeMap<NodeId, u64>,
    /// The local writer's counter.
    counter: u64,
}

impl LoadMap {
    /// An empty map.
    pub fn new() -> LoadMap {
        LoadMap::default()
    }

    /// The local router (`me`, in its `incarnation`) now has `in_flight` requests on `engine`:
    /// records it and returns the delta to send to the others.
    pub fn set_local(
        &mut self,
        me: NodeId,
        incarnation: u64,
        engine: u64,
        in_flight: u32,
    ) -> LoadDelta {
        self.counter += 1;
        let d = LoadDelta {
            node: me,
            engine,
            version: Version {
                incarnation,
                counter: self.counter,
            },
            in_flight,
        };
        self.merge(&d);
        d
    }

    /// Whether any router has an entry for `engine`.
    pub fn has_engine(&self, engine: u64) -> bool {
        self.per_engine.contains_key(&engine)
    }

    /// The engines some router has an entry for (O(engines), not O(entries)).
    pub fn engines(&self) -> impl Iterator<Item = u64> + '_ {
        self.per_engine.keys().copied()
    }

    /// `node`'s in-flight count on `engine`, if it has an entry.
    pub fn of(&self, node: NodeId, engine: u64) -> Option<u32> {
        self.entries.get(&(node, engine)).map(|e| e.in_flight)
    }

    /// Merges a delta; true when it changed the map (newer than the entry, not from a
    /// departed incarnation).
    pub fn merge(&mut self, d: &LoadDelta) -> bool {
        if self
            .departed
            .get(&d.node)
            .is_some_and(|&inc| d.version.incarnation <= inc)
        {
            return false;
        }
        let key = (d.node, d.engine);
        let new = Entry {
            version: d.version,
            in_flight: d.in_flight,
        };
        // Newest version wins; an equal version from the single writer carries the same value
        // (the max makes a forged duplicate deterministic anyway).
        if let Some(o) = self.entries.get(&key)
            && (o.version, o.in_flight) >= (new.version, new.in_flight)
        {
            return false;
        }
        self.put(key, new);
        true
    }

    /// Sets an entry, keeping the totals and its router's sum.
    fn put(&mut self, key: (NodeId, u64), e: Entry) {
        let old = self.entries.insert(key, e);
        let sum = self.sums.entry(key.0).or_default();
        sum.hash ^= entry_hash(key.1, &e);
        sum.newest = sum.newest.max(e.version);
        match old {
            Some(o) => {
                sum.hash ^= entry_hash(key.1, &o);
                self.sub(key.1, o.in_flight);
            }
            None => {
                sum.count += 1;
                *self.per_engine.entry(key.1).or_default() += 1;
            }
        }
        *self.totals.entry(key.1).or_default() += u64::from(e.in_flight);
    }

    /// Removes entries, keeping the totals and their routers' sums.
    fn take(&mut self, keys: &[(NodeId, u64)]) {
        let mut newest_gone = Vec::new();
        for &key in keys {
            let Some(o) = self.entries.remove(&key) else {
                continue;
            };
            self.sub(key.1, o.in_flight);
            if let Some(n) = self.per_engine.get_mut(&key.1) {
                *n -= 1;
                if *n == 0 {
                    self.per_engine.remove(&key.1);
                }
            }
            if let Some(sum) = self.sums.get_mut(&key.0) {
                sum.hash ^= entry_hash(key.1, &o);
                sum.count -= 1;
                if sum.count == 0 {
                    self.sums.remove(&key.0);
                } else if o.version == sum.newest {
                    newest_gone.push(key.0);
                }
            }
        }
        // A router whose newest entry went: its newest is found again among what is left.
        newest_gone.dedup();
        for node in newest_gone {
            let newest = self
                .entries
                .range((node, 0)..=(node, u64::MAX))
                .map(|(_, e)| e.version)
                .max();
            if let (Some(sum), Some(v)) = (self.sums.get_mut(&node), newest) {
                sum.newest = v;
            }
        }
    }

    fn sub(&mut self, engine: u64, n: u32) {
        if let Some(t) = self.totals.get_mut(&engine) {
            *t = t.saturating_sub(u64::from(n));
            if *t == 0 {
                self.totals.remove(&engine);
            }
        }
    }

    /// A router left (or was declared down) in `incarnation`: its entries go, and deltas of
    /// that incarnation or older are dropped from now on. Returns the entries removed.
    pub fn remove_node(&mut self, node: NodeId, incarnation: u64) -> usize {
        let e = self.departed.entry(node).or_insert(incarnation);
        *e = (*e).max(incarnation);
        let gone: Vec<(NodeId, u64)> = self
            .entries
            .range((node, 0)..=(node, u64::MAX))
            .filter(|(_, v)| v.version.incarnation <= incarnation)
            .map(|(k, _)| *k)
            .collect();
        self.take(&gone);
        gone.len()
    }

    /// An engine was removed from the registry: its entries go.
    pub fn remove_engine(&mut self, engine: u64) -> usize {
        if !self.has_engine(engine) {
            return 0;
        }
        let gone: Vec<(NodeId, u64)> = self
            .entries
            .keys()
            .filter(|k| k.1 == engine)
            .copied()
            .collect();
        self.take(&gone);
        gone.len()
    }

    /// Forgets the tombstones of nodes `keep` rejects (bounded memory: call with the nodes
    /// that left long enough ago that none of their deltas can still be in flight).
    pub fn prune_departed(&mut self, keep: impl Fn(NodeId) -> bool) {
        self.departed.retain(|n, _| keep(*n));
    }

    /// `me` restarted its numbering under `incarnation` (it was declared down and rejoined):
    /// its entries are rewritten under it; the deltas to send.
    pub fn renew(&mut self, me: NodeId, incarnation: u64) -> Vec<LoadDelta> {
        let mine: Vec<(u64, u32)> = self
            .entries
            .range((me, 0)..=(me, u64::MAX))
            .map(|(k, v)| (k.1, v.in_flight))
            .collect();
        mine.into_iter()
            .map(|(engine, n)| self.set_local(me, incarnation, engine, n))
            .collect()
    }

    /// Per router: a hash of its entries and their newest version (what anti-entropy
    /// compares).
    pub fn node_digests(&self) -> Vec<(NodeId, u64, Version)> {
        self.sums
            .iter()
            .map(|(&n, sum)| (n, sum.hash, sum.newest))
            .collect()
    }

    /// [`LoadMap::node_digests`] computed from the entries (what the kept sums must equal).
    #[cfg(test)]
    fn node_digests_from_entries(&self) -> Vec<(NodeId, u64, Version)> {
        let mut out: Vec<(NodeId, u64, Version)> = Vec::new();
        for (&(n, e), v) in &self.entries {
            let x = entry_hash(e, v);
            match out.last_mut() {
                Some((m, h, mv)) if *m == n => {
                    *h ^= x;
                    *mv = (*mv).max(v.version);
                }
                _ => out.push((n, x, v.version)),
            }
        }
        out
    }

    /// `node`'s entries newer than `after` as deltas (what a peer that is behind lacks).
    pub fn deltas_of_since(&self, node: NodeId, after: Version) -> Vec<LoadDelta> {
        self.entries
            .range((node, 0)..=(node, u64::MAX))
            .filter(|(_, e)| e.version > after)
            .map(as_delta)
            .collect()
    }

    /// `node`'s entries as deltas (a repair): all of them, whatever their version (a
    /// `Version::default()` one too, which no router writes but a peer may send).
    pub fn deltas_of(&self, node: NodeId) -> Vec<LoadDelta> {
        self.entries
            .range((node, 0)..=(node, u64::MAX))
            .map(as_delta)
            .collect()
    }

    /// The routers with entries.
    pub fn nodes(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self.entries.keys().map(|k| k.0).collect();
        v.dedup();
        v
    }

    /// Drops `node`'s entries without a tombstone (a router this one does not know as a
    /// member: its entries came through a third router that had not yet seen it go). They
    /// return only from a router that still holds them live, that is, while it is a member.
    pub fn forget_node(&mut self, node: NodeId) -> Vec<u64> {
        let gone: Vec<(NodeId, u64)> = self
            .entries
            .range((node, 0)..=(node, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        self.take(&gone);
        gone.into_iter().map(|k| k.1).collect()
    }

    /// The engines `node` has entries for.
    pub fn engines_of(&self, node: NodeId) -> Vec<u64> {
        self.entries
            .range((node, 0)..=(node, u64::MAX))
            .map(|(k, _)| k.1)
            .collect()
    }

    /// The sum of every router's in-flight count on `engine`.
    pub fn total(&self, engine: u64) -> u64 {
        self.totals.get(&engine).copied().unwrap_or(0)
    }

    /// The others' in-flight count on `engine` (the total minus `me`'s entry).
    pub fn others(&self, me: NodeId, engine: u64) -> u64 {
        let mine = self.entries.get(&(me, engine)).map_or(0, |e| e.in_flight);
        self.total(engine).saturating_sub(u64::from(mine))
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The whole map as deltas (a snapshot for a joining router; anti-entropy's repair).
    pub fn deltas(&self) -> Vec<LoadDelta> {
        self.entries.iter().map(as_delta).collect()
    }

    /// Per router, its newest version (what anti-entropy compares first).
    pub fn versions(&self) -> BTreeMap<NodeId, Version> {
        self.sums.iter().map(|(&n, sum)| (n, sum.newest)).collect()
    }

    /// A digest of the entries (equal digests: equal maps).
    pub fn digest(&self) -> u64 {
        digest_of(
            b"kvmesh/load/v2",
            self.node_digests()
                .into_iter()
                .map(|(n, h, _)| part(n.0, h, 0, 0)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_wins_totals_follow_and_a_departed_incarnation_stays_gone() {
        let (a, b) = (NodeId::from_name("a"), NodeId::from_name("b"));
        let mut m = LoadMap::new();
        let d1 = m.set_local(a, 1, 7, 3);
        let d2 = m.set_local(a, 1, 7, 5);
        assert_eq!(m.total(7), 5);
        // Another router sees them in the other order.
        let mut n = LoadMap::new();
        assert!(n.merge(&d2));
        assert!(!n.merge(&d1), "older version");
        assert_eq!(n.total(7), 5);
        n.merge(&LoadDelta {
            node: b,
            engine: 7,
            version: Version {
                incarnation: 9,
                counter: 1,
            },
            in_flight: 2,
        });
        assert_eq!(n.total(7), 7);
        assert_eq!(n.others(b, 7), 5);
        // a leaves: its entries go, and a late delta of that incarnation cannot return.
        assert_eq!(n.remove_node(a, 1), 1);
        assert_eq!(n.total(7), 2);
        assert!(!n.merge(&d2));
        // a restarts (incarnation 2): its new entries count again.
        let mut d3 = d2;
        d3.version = Version {
            incarnation: 2,
            counter: 1,
        };
        assert!(n.merge(&d3));
        assert_eq!(n.total(7), 7);
        assert_eq!(n.remove_engine(7), 2);
        assert_eq!(n.total(7), 0);
        assert!(n.is_empty());
    }

    #[test]
    fn a_repair_of_a_router_carries_every_entry_even_of_the_lowest_version() {
        let a = NodeId::from_name("a");
        let mut m = LoadMap::new();
        let zero = LoadDelta {
            node: a,
            engine: 1,
            version: Version::default(),
            in_flight: 3,
        };
        assert!(m.merge(&zero));
        m.set_local(a, 1, 2, 4);
        let all = m.deltas_of(a);
        assert_eq!(all.len(), 2, "{all:?}");
        assert!(all.contains(&zero));
        assert_eq!(m.deltas_of_since(a, Version::default()).len(), 1);
    }

    /// One step on a map: a delta merged, a router gone, forgotten or renewed, an engine
    /// removed, a local count.
    #[derive(Debug, Clone)]
    enum Op {
        Merge(u8, u8, u64, u64, u32),
        RemoveNode(u8, u64),
        Forget(u8),
        RemoveEngine(u8),
        Local(u8, u32),
        Renew(u64),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0u8..4, 0u8..6, 0u64..3, 0u64..12, 0u32..4)
                .prop_map(|(n, e, i, c, f)| Op::Merge(n, e, i, c, f)),
            1 => (0u8..4, 0u64..3).prop_map(|(n, i)| Op::RemoveNode(n, i)),
            1 => (0u8..4).prop_map(Op::Forget),
            1 => (0u8..6).prop_map(Op::RemoveEngine),
            2 => (0u8..6, 0u32..4).prop_map(|(e, f)| Op::Local(e, f)),
            1 => (0u64..4).prop_map(Op::Renew),
        ]
    }

    proptest::proptest! {
        #[test]
        fn kept_sums_equal_the_entries_after_any_steps(
            ops in proptest::collection::vec(op(), 0..60),
        ) {
            let node = |n: u8| NodeId(u64::from(n) + 1);
            let me = node(0);
            let mut m = LoadMap::new();
            for op in ops {
                match op {
                    Op::Merge(n, e, i, c, f) => {
                        m.merge(&LoadDelta {
                            node: node(n),
                            engine: u64::from(e),
                            version: Version { incarnation: i, counter: c },
                            in_flight: f,
                        });
                    }
                    Op::RemoveNode(n, i) => {
                        m.remove_node(node(n), i);
                    }
                    Op::Forget(n) => {
                        m.forget_node(node(n));
                    }
                    Op::RemoveEngine(e) => {
                        m.remove_engine(u64::from(e));
                    }
                    Op::Local(e, f) => {
                        m.set_local(me, 5, u64::from(e), f);
                    }
                    Op::Renew(i) => {
                        m.renew(me, i);
                    }
                }
                proptest::prop_assert_eq!(m.node_digests(), m.node_digests_from_entries());
                let engines: std::collections::BTreeSet<u64> =
                    m.entries.keys().map(|k| k.1).collect();
                for e in engines {
                    let sum: u64 = m
                        .entries
                        .iter()
                        .filter(|(k, _)| k.1 == e)
                        .map(|(_, v)| u64::from(v.in_flight))
                        .sum();
                    proptest::prop_assert_eq!(m.total(e), sum);
                }
            }
        }
    }
}
