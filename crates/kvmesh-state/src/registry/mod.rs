//! The engine registry: an add-wins observed-remove set of engines with a causal context, as
//! in ORSWOT and Almeida et al.'s delta-state OR-set. Each add carries a unique dot (router,
//! counter) and the engine's attributes; the registry keeps the adds present and, in a
//! causal context, every dot it has seen. A dot seen but not present was removed —
//! no tombstone per removed add. An add also removes the adds of the engine its router had
//! seen (an update replaces the record it saw), a remove names the dots it saw, so an add
//! concurrent with a remove survives it. An engine's record is that of its present add with the
//! newest stamp (cluster time, node): two writes at the same instant are ordered by node id,
//! never by arrival; an add's stamp is above every stamp of the engine its router had seen, so
//! the newest record is also the latest in causal order.
//!
//! Every delta is a fragment of a registry state (adds present + dots seen, [`RegistryDelta`])
//! and merge is the causal join: present in the result = present on one side and not seen by
//! the other, or present on both. A whole state travels as fragments, one per add present with
//! the dots seen of its router's counters up to it ([`RegistrySet::deltas`]), each correct on
//! its own, so a snapshot's parts may arrive in any order, split over envelopes, repeated or
//! mixed with other deltas.
//!
//! Memory: the adds present (about one per engine and router that added it concurrently,
//! each with its record) plus the context: per router and run of that router (a restart is a
//! new run), one counter interval, and a few more while an add is missing (they merge when it
//! arrives). Removed engines leave nothing else behind: their records go with their last add,
//! but for the notes of what routers' configs seeded (module `seeded`: at most [`SEEDED_MAX`])
//! and the first plant of each config record (module `planted`: as many).
//!
//! Plants of config records ([`RegistrySet::plant`]) are adds that the first plant of the same
//! record voids: see the module `planted`. They travel as their own kind of delta ([`Planted`]), beside
//! their add.

mod context;
mod planted;
mod seeded;

pub use context::Span;
pub use planted::{PLANTED_MAX, Planted};
pub use seeded::{SEEDED_MAX, Seeded};

use crate::ids::NodeId;
use crate::{digest_of, part};
use context::CausalContext;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Context spans per fragment of a whole state at most ([`RegistrySet::deltas`]).
const SPANS_PER_FRAGMENT: usize = 256;

/// Seed notes per fragment of a whole state at most ([`RegistrySet::deltas`]).
const NOTES_PER_FRAGMENT: usize = 64;

/// A unique add: (node, that node's counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Dot {
    /// The router that added.
    pub node: NodeId,
    /// Its counter.
    pub counter: u64,
}

/// A last-writer-wins stamp: cluster time, then the writer's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Stamp {
    /// Cluster time of the write (µs).
    pub at_us: u64,
    /// The writer.
    pub node: NodeId,
}

/// What the routers know of an engine.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EngineRecord {
    /// Base URL.
    pub url: String,
    /// Configured weight, in thousandths (integral: the record must hash and compare).
    pub weight_milli: u32,
    /// KV-event endpoint, or empty.
    pub kv_events: String,
    /// KV-event replay endpoint, or empty.
    pub kv_replay: String,
    /// Models given in its entry (empty = discovered).
    pub models: Vec<String>,
}

/// One add: the engine is present with this record.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegistryAdd {
    /// The engine (`kvmesh_prefix::EngineId`'s value).
    pub engine: u64,
    /// This add's dot.
    pub dot: Dot,
    /// When it was written (and by whom).
    pub stamp: Stamp,
    /// The engine's attributes.
    pub record: EngineRecord,
}

/// A change to the registry, as a fragment of a registry state: the adds it holds present, and
/// the dots it has seen. Every dot `seen` covers that is not among `adds` is removed as far as
/// this fragment goes (an add's own dot counts as seen even when `seen` omits it). An add is
/// `adds` = the new add, `seen` = its dot, the counters its router skipped, and the engine's
/// dots it replaces; a remove is `adds` empty, `seen` = the engine's dots; a whole state is
/// a fragment per router and counter range. `seeded` carries notes of config records seeded
/// (a grow-only part beside the set, see [`Seeded`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct RegistryDelta {
    /// Adds present.
    pub adds: Vec<RegistryAdd>,
    /// Dots seen.
    pub seen: Vec<Span>,
    /// Config records seeded.
    pub seeded: Vec<Seeded>,
}

/// A present add's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    engine: u64,
    stamp: Stamp,
    record: EngineRecord,
}

/// The replicated engine registry.
#[derive(Debug, Clone, Default)]
pub struct RegistrySet {
    /// The adds present.
    dots: BTreeMap<Dot, Entry>,
    /// Per present engine, its present adds.
    engines: BTreeMap<u64, BTreeSet<Dot>>,
    /// Every dot seen, present or removed.
    ctx: CausalContext,
    /// The last counter this router issued since it started (0: none yet).
    issued: u64,
    /// The config records routers seeded.
    seeded: seeded::SeededLog,
    /// The first plant of each config record.
    planted: planted::PlantedLog,
    /// [`RegistrySet::digest`] as last computed, until the next change (anti-entropy asks
    /// for it at every digest exchange, and the registry seldom changes).
    digest: std::cell::Cell<Option<u64>>,
}

impl RegistrySet {
    /// An empty registry.
    pub fn new() -> RegistrySet {
        RegistrySet::default()
    }

    /// The local router adds (or updates) an engine: returns the delta to send.
    ///
    /// The counter. A router's id is its stable name, so a restarted router writes dots of the
    /// same id with an empty registry: a counter starting again at 1 would reuse dots the
    /// cluster has seen, and its adds would be silently ignored (or, worse, two adds would
    /// share a dot). So the counter is at least the cluster time in µs (`now_us`), above the
    /// last one issued, and above the highest dot of this router seen so far (learned from
    /// peers: covers a clock set back while this registry has already heard of the previous
    /// run). Unique as long as one process at a time runs under a name, the clock does not go
    /// back across a restart by more than the downtime, and a run does not add more than one
    /// engine per µs on average (which would run its counter ahead of the clock). The
    /// alternative, continuing from the cluster's highest dot once warm, would have to hold
    /// back adds until then and still reuse a dot its welcome missed. The counters skipped since
    /// this run's previous add are claimed seen by this add (no dot of them exists: earlier
    /// runs used counters below this run's first), which keeps a run's dots one interval; the
    /// first add of a run claims only its own dot (earlier runs' dots may still be present).
    pub fn add(
        &mut self,
        me: NodeId,
        now_us: u64,
        engine: u64,
        record: EngineRecord,
    ) -> RegistryDelta {
        self.digest.set(None);
        let top = self.ctx.top(me);
        let counter = self
            .issued
            .saturating_add(1)
            .max(now_us)
            .max(top.saturating_add(1));
        let lo = if self.issued == 0 {
            counter
        } else {
            self.issued.max(top).saturating_add(1).min(counter)
        };
        self.issued = counter;
        let dot = Dot { node: me, counter };
        // Above every stamp this router saw for the engine: the replacing write is the newest.
        let at_us = self
            .engines
            .get(&engine)
            .into_iter()
            .flatten()
            .filter_map(|d| self.dots.get(d))
            .map(|e| e.stamp.at_us.saturating_add(1))
            .fold(now_us, u64::max);
        let mut seen = vec![Span {
            node: me,
            lo,
            hi: counter,
        }];
        seen.extend(self.dots_of(engine).into_iter().map(Span::dot));
        let d = RegistryDelta {
            adds: vec![RegistryAdd {
                engine,
                dot,
                stamp: Stamp { at_us, node: me },
                record,
            }],
            seen,
            seeded: Vec::new(),
        };
        self.merge(&d);
        d
    }

    /// The local router plants its config's `record` of `engine` (an [`RegistrySet::add`]
    /// that says it came from a config): returns the add's delta and the plant to send. A
    /// plant of this record made before voids it wherever the two meet (module `planted`).
    pub fn plant(
        &mut self,
        me: NodeId,
        now_us: u64,
        engine: u64,
        record: EngineRecord,
    ) -> (RegistryDelta, Planted) {
        let digest = record.digest();
        let d = self.add(me, now_us, engine, record);
        let p = Planted {
            engine,
            record: digest,
            at_us: now_us,
            dot: d.adds[0].dot,
        };
        self.merge_planted(&[p], &mut BTreeSet::new());
        (d, p)
    }

    /// Merges plants; true when they changed the registry. An add a plant voids is removed
    /// (its dot seen, not present), and its engine goes in `touched`.
    pub fn merge_planted(&mut self, ps: &[Planted], touched: &mut BTreeSet<u64>) -> bool {
        let mut changed = false;
        for &p in ps {
            match self.planted.merge(p) {
                planted::Outcome::Known => {}
                planted::Outcome::First => changed = true,
                planted::Outcome::Void(dot) => changed |= self.void(dot, touched),
            }
            // Noted before it was planted: a plant made without the cluster's registry.
            if self
                .seeded
                .earliest(p.engine, p.record)
                .is_some_and(|t| t < p.at_us)
            {
                changed |= self.void(p.dot, touched);
            }
        }
        changed
    }

    /// Voids a plant's add: its dot seen, its add dropped. True when that changed the set.
    fn void(&mut self, dot: Dot, touched: &mut BTreeSet<u64>) -> bool {
        self.digest.set(None);
        let mut changed = self.ctx.insert(Span::dot(dot));
        if let Some(engine) = self.drop_add(dot) {
            changed = true;
            touched.insert(engine);
        }
        changed
    }

    /// The first plants of config records, for a whole state (in parts of at most
    /// `NOTES_PER_FRAGMENT`).
    pub fn planted(&self) -> Vec<Vec<Planted>> {
        let all: Vec<Planted> = self.planted.iter().collect();
        all.chunks(NOTES_PER_FRAGMENT)
            .map(<[Planted]>::to_vec)
            .collect()
    }

    /// First plants kept.
    pub fn planted_len(&self) -> usize {
        self.planted.len()
    }

    /// Notes that a router's config seeded `engine` with `record` (or found it so), at
    /// `now_us`: returns the delta to send, or `None` when the note was made before.
    pub fn note_seeded(
        &mut self,
        now_us: u64,
        engine: u64,
        record: &EngineRecord,
    ) -> Option<RegistryDelta> {
        let note = Seeded {
            engine,
            record: record.digest(),
            at_us: now_us,
        };
        if self.seeded.contains(engine, note.record) {
            return None;
        }
        let d = RegistryDelta {
            seeded: vec![note],
            ..RegistryDelta::default()
        };
        self.merge(&d);
        Some(d)
    }

    /// Whether some router's config seeded `engine` with `record` (noted, and not cut since).
    pub fn was_seeded(&self, engine: u64, record: &EngineRecord) -> bool {
        self.seeded.contains(engine, record.digest())
    }

    /// Notes of config records seeded.
    pub fn seeded_len(&self) -> usize {
        self.seeded.len()
    }

    /// The local router removes an engine (the adds it has seen): returns the delta to send,
    /// or `None` when the engine is not present.
    pub fn remove(&mut self, engine: u64) -> Option<RegistryDelta> {
        self.digest.set(None);
        if !self.contains(engine) {
            return None;
        }
        let d = RegistryDelta {
            seen: self.dots_of(engine).into_iter().map(Span::dot).collect(),
            ..RegistryDelta::default()
        };
        self.merge(&d);
        Some(d)
    }

    fn dots_of(&self, engine: u64) -> Vec<Dot> {
        self.engines
            .get(&engine)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Merges a delta; true when it changed the set (its adds or what it has seen).
    pub fn merge(&mut self, d: &RegistryDelta) -> bool {
        self.merge_noting(d, &mut BTreeSet::new())
    }

    /// Merges a delta (the causal join); true when it changed the set. `touched` gets the
    /// engines whose adds changed (added, removed or replaced).
    pub fn merge_noting(&mut self, d: &RegistryDelta, touched: &mut BTreeSet<u64>) -> bool {
        self.digest.set(None);
        let mut changed = false;
        let theirs: BTreeSet<Dot> = d
            .adds
            .iter()
            .map(|a| a.dot)
            .filter(|x| x.counter > 0)
            .collect();
        // Present here, seen there and not present there: removed.
        let mut gone = Vec::new();
        for s in d.seen.iter().filter_map(|s| s.normalized()) {
            let from = Dot {
                node: s.node,
                counter: s.lo,
            };
            let to = Dot {
                node: s.node,
                counter: s.hi,
            };
            gone.extend(
                self.dots
                    .range(from..=to)
                    .map(|(x, _)| *x)
                    .filter(|x| !theirs.contains(x)),
            );
        }
        for x in gone {
            if let Some(engine) = self.drop_add(x) {
                changed = true;
                touched.insert(engine);
            }
        }
        // Present there, never seen here: added.
        for a in &d.adds {
            if a.dot.counter == 0 || self.ctx.covers(a.dot) || self.dots.contains_key(&a.dot) {
                continue;
            }
            changed = true;
            touched.insert(a.engine);
            self.dots.insert(
                a.dot,
                Entry {
                    engine: a.engine,
                    stamp: a.stamp,
                    record: a.record.clone(),
                },
            );
            self.engines.entry(a.engine).or_default().insert(a.dot);
        }
        // Seen: the union.
        for s in d
            .seen
            .iter()
            .copied()
            .chain(theirs.iter().map(|x| Span::dot(*x)))
        {
            changed |= self.ctx.insert(s);
        }
        for &n in &d.seeded {
            let before = self.seeded.earliest(n.engine, n.record);
            changed |= self.seeded.merge(n);
            let after = self.seeded.earliest(n.engine, n.record);
            // Noted earlier than this node knew: the first plant of the record, if later, is
            // void (the later plants are already).
            if let Some(t) = after
                && after != before
                && let Some((at, dot)) = self.planted.first(n.engine, n.record)
                && at > t
            {
                changed |= self.void(dot, touched);
            }
        }
        changed
    }

    /// Drops the add of `dot` if present: returns its engine.
    fn drop_add(&mut self, dot: Dot) -> Option<u64> {
        let e = self.dots.remove(&dot)?;
        if let Some(set) = self.engines.get_mut(&e.engine) {
            set.remove(&dot);
            if set.is_empty() {
                self.engines.remove(&e.engine);
            }
        }
        Some(e.engine)
    }

    /// Whether the add of this dot was seen (present, or removed since).
    pub fn has_seen(&self, d: Dot) -> bool {
        self.ctx.covers(d)
    }

    /// Whether the engine is present.
    pub fn contains(&self, engine: u64) -> bool {
        self.engines.contains_key(&engine)
    }

    /// The engine's record, if present: its present add's with the newest stamp.
    pub fn get(&self, engine: u64) -> Option<&EngineRecord> {
        self.newest(engine).map(|e| &e.record)
    }

    fn newest(&self, engine: u64) -> Option<&Entry> {
        self.engines
            .get(&engine)?
            .iter()
            .filter_map(|d| self.dots.get(d))
            .max_by(|a, b| (a.stamp, &a.record).cmp(&(b.stamp, &b.record)))
    }

    /// The engines present, by id.
    pub fn engines(&self) -> impl Iterator<Item = (u64, &EngineRecord)> {
        self.engines
            .keys()
            .filter_map(|&k| self.newest(k).map(|e| (k, &e.record)))
    }

    /// Adds present (an engine added concurrently by several routers counts once per add).
    pub fn adds(&self) -> usize {
        self.dots.len()
    }

    /// Intervals of the causal context (what the registry keeps besides its adds: about one
    /// per router run that added an engine).
    pub fn context_len(&self) -> usize {
        self.ctx.len()
    }

    /// The whole registry as deltas (a snapshot; a repair): per router, a fragment per add
    /// present, holding it and the dots seen from the router's previous present add up to
    /// it (then one for the dots seen above its last), at most `SPANS_PER_FRAGMENT` spans
    /// each. Each fragment is a part of this state that merges correctly on its own; like a
    /// local add, it carries one record (the mesh packs deltas by count).
    pub fn deltas(&self) -> Vec<RegistryDelta> {
        let mut out = Vec::new();
        for node in self.ctx.routers() {
            let from = Dot { node, counter: 1 };
            let to = Dot {
                node,
                counter: u64::MAX,
            };
            let mut lo = 1;
            let present = self
                .dots
                .range(from..=to)
                .map(|(d, e)| (d.counter, Some((d, e))));
            for (hi, add) in present.chain(std::iter::once((u64::MAX, None))) {
                let seen = self.ctx.within(node, lo, hi);
                let mut parts: Vec<Vec<Span>> = seen
                    .chunks(SPANS_PER_FRAGMENT)
                    .map(<[Span]>::to_vec)
                    .collect();
                let last = parts.pop().unwrap_or_default();
                out.extend(parts.into_iter().map(|seen| RegistryDelta {
                    seen,
                    ..RegistryDelta::default()
                }));
                let adds: Vec<RegistryAdd> = add
                    .map(|(d, e)| RegistryAdd {
                        engine: e.engine,
                        dot: *d,
                        stamp: e.stamp,
                        record: e.record.clone(),
                    })
                    .into_iter()
                    .collect();
                if !adds.is_empty() || !last.is_empty() {
                    out.push(RegistryDelta {
                        adds,
                        seen: last,
                        seeded: Vec::new(),
                    });
                }
                lo = hi.saturating_add(1);
            }
        }
        let notes: Vec<Seeded> = self.seeded.iter_with_earliest().collect();
        out.extend(notes.chunks(NOTES_PER_FRAGMENT).map(|n| RegistryDelta {
            seeded: n.to_vec(),
            ..RegistryDelta::default()
        }));
        out
    }

    /// A digest of the set: the adds present with their records, the context and the seed
    /// notes.
    pub fn digest(&self) -> u64 {
        if let Some(d) = self.digest.get() {
            return d;
        }
        let d = self.compute_digest();
        self.digest.set(Some(d));
        d
    }

    fn compute_digest(&self) -> u64 {
        let adds = self.dots.iter().map(|(d, e)| {
            let mut h = blake3::Hasher::new();
            h.update(&e.stamp.at_us.to_le_bytes());
            h.update(&e.stamp.node.0.to_le_bytes());
            h.update(format!("{:?}", e.record).as_bytes());
            let mut r = [0u8; 8];
            r.copy_from_slice(&h.finalize().as_bytes()[..8]);
            part(e.engine, d.node.0, d.counter, u64::from_le_bytes(r))
        });
        let adds = digest_of(b"kvmesh/registry/adds", adds);
        let seen = digest_of(
            b"kvmesh/registry/seen",
            self.ctx.spans().map(|s| part(s.node.0, s.lo, s.hi, 0)),
        );
        digest_of(
            b"kvmesh/registry/v3",
            std::iter::once(part(adds, seen, self.seeded.digest(), 0)),
        )
    }
}

#[cfg(test)]
mod tests;
