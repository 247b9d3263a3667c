//! The engine registry: an add-wins observed-remove set of engines (each add carries a unique
//! dot, a remove names the dots it saw, so an add concurrent with a remove survives it), with
//! the engine's attributes as a last-writer-wins register stamped (cluster time, node): two
//! writes at the same instant are ordered by node id, never by arrival.
//!
//! Memory: one entry per engine present plus the removed dots (tombstones, 16 bytes each; a
//! router collects those every router has seen — causal stability — which the mesh knows from
//! its digests; [`RegistrySet::prune_tombstones`]).

use crate::ids::NodeId;
use crate::{digest_of, part};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

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

/// A change to the registry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RegistryDelta {
    /// The engine is present with this record (an add, or an update of its attributes).
    Add {
        /// The engine (`kvmesh_prefix::EngineId`'s value).
        engine: u64,
        /// This add's dot.
        dot: Dot,
        /// The record and its stamp.
        record: EngineRecord,
        /// When it was written.
        stamp: Stamp,
    },
    /// The engine is removed as far as these adds go.
    Remove {
        /// The engine.
        engine: u64,
        /// The dots of the adds the remover had seen.
        dots: Vec<Dot>,
    },
}

/// The replicated engine registry.
#[derive(Debug, Clone, Default)]
pub struct RegistrySet {
    /// Live adds per present engine.
    entries: BTreeMap<u64, BTreeSet<Dot>>,
    /// The newest record of every engine ever added (kept through removes, so the register's
    /// value does not depend on when a remove arrived; collected with the tombstones).
    records: BTreeMap<u64, (Stamp, EngineRecord)>,
    /// Removed dots and their engine.
    removed: BTreeMap<Dot, u64>,
    counter: u64,
}

impl RegistrySet {
    /// An empty registry.
    pub fn new() -> RegistrySet {
        RegistrySet::default()
    }

    /// The local router adds (or updates) an engine: returns the delta to send.
    pub fn add(
        &mut self,
        me: NodeId,
        now_us: u64,
        engine: u64,
        record: EngineRecord,
    ) -> RegistryDelta {
        self.counter += 1;
        let d = RegistryDelta::Add {
            engine,
            dot: Dot {
                node: me,
                counter: self.counter,
            },
            record,
            stamp: Stamp {
                at_us: now_us,
                node: me,
            },
        };
        self.merge(&d);
        d
    }

    /// The local router removes an engine (the adds it has seen): returns the delta to send,
    /// or `None` when the engine is not present.
    pub fn remove(&mut self, engine: u64) -> Option<RegistryDelta> {
        let dots = self.entries.get(&engine)?;
        let d = RegistryDelta::Remove {
            engine,
            dots: dots.iter().copied().collect(),
        };
        self.merge(&d);
        Some(d)
    }

    /// Merges a delta; true when it changed the set.
    pub fn merge(&mut self, d: &RegistryDelta) -> bool {
        match d {
            RegistryDelta::Add {
                engine,
                dot,
                record,
                stamp,
            } => {
                // LWW by (time, node); the same stamp from the same node is the same write
                // (a record compare breaks a forged tie deterministically). Kept even when
                // the add itself was already removed.
                let mut changed = match self.records.get(engine) {
                    Some((st, r)) if (st, r) >= (stamp, record) => false,
                    _ => {
                        self.records.insert(*engine, (*stamp, record.clone()));
                        true
                    }
                };
                if !self.removed.contains_key(dot) {
                    changed |= self.entries.entry(*engine).or_default().insert(*dot);
                }
                changed
            }
            RegistryDelta::Remove { engine, dots } => {
                let mut changed = false;
                for dot in dots {
                    changed |= self.removed.insert(*dot, *engine).is_none();
                }
                if let Some(live) = self.entries.get_mut(engine) {
                    for dot in dots {
                        changed |= live.remove(dot);
                    }
                    if live.is_empty() {
                        self.entries.remove(engine);
                    }
                }
                changed
            }
        }
    }

    /// Whether the engine is present.
    pub fn contains(&self, engine: u64) -> bool {
        self.entries.contains_key(&engine)
    }

    /// The engine's record, if present.
    pub fn get(&self, engine: u64) -> Option<&EngineRecord> {
        if !self.contains(engine) {
            return None;
        }
        self.records.get(&engine).map(|(_, r)| r)
    }

    /// The engines present, by id.
    pub fn engines(&self) -> impl Iterator<Item = (u64, &EngineRecord)> {
        self.entries
            .keys()
            .filter_map(|k| self.records.get(k).map(|(_, r)| (*k, r)))
    }

    /// Removed dots kept (tombstones).
    pub fn tombstones(&self) -> usize {
        self.removed.len()
    }

    /// Forgets tombstones `keep` rejects (dots every router has seen removed).
    pub fn prune_tombstones(&mut self, keep: impl Fn(&Dot) -> bool) {
        self.removed.retain(|d, _| keep(d));
        // Records of engines neither present nor named by a tombstone go too.
        let named: BTreeSet<u64> = self.removed.values().copied().collect();
        let entries = &self.entries;
        self.records
            .retain(|e, _| entries.contains_key(e) || named.contains(e));
    }

    /// The whole registry as deltas (a snapshot; a repair): the adds present, and a remove
    /// carrying every tombstone.
    pub fn deltas(&self) -> Vec<RegistryDelta> {
        // Every add present carries the newest record; the remove of each engine's tombstones
        // follows (a record of an engine with no live add rides on a removed dot's add).
        let mut out: Vec<RegistryDelta> = Vec::new();
        for (&engine, (stamp, record)) in &self.records {
            let live = self.entries.get(&engine);
            let dots: Vec<Dot> = match live {
                Some(d) => d.iter().copied().collect(),
                None => self
                    .removed
                    .iter()
                    .filter(|(_, e)| **e == engine)
                    .map(|(d, _)| *d)
                    .take(1)
                    .collect(),
            };
            for dot in dots {
                out.push(RegistryDelta::Add {
                    engine,
                    dot,
                    record: record.clone(),
                    stamp: *stamp,
                });
            }
        }
        let mut by_engine: BTreeMap<u64, Vec<Dot>> = BTreeMap::new();
        for (d, e) in &self.removed {
            by_engine.entry(*e).or_default().push(*d);
        }
        out.extend(
            by_engine
                .into_iter()
                .map(|(engine, dots)| RegistryDelta::Remove { engine, dots }),
        );
        out
    }

    /// A digest of the set (present engines with their dots and records, and tombstones).
    pub fn digest(&self) -> u64 {
        let mut parts = Vec::new();
        for (&engine, (stamp, record)) in &self.records {
            let rec = blake3::hash(format!("{record:?}").as_bytes());
            let mut r = [0u8; 8];
            r.copy_from_slice(&rec.as_bytes()[..8]);
            parts.push(part(
                engine,
                stamp.at_us,
                stamp.node.0,
                u64::from_le_bytes(r),
            ));
        }
        for (&engine, dots) in &self.entries {
            for d in dots {
                parts.push(part(engine, d.node.0, d.counter, 1));
            }
        }
        for (d, e) in &self.removed {
            parts.push(part(*e, d.node.0, d.counter, 2));
        }
        digest_of(b"kvmesh/registry/v1", parts.into_iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(url: &str, w: u32) -> EngineRecord {
        EngineRecord {
            url: url.into(),
            weight_milli: w,
            kv_events: String::new(),
            kv_replay: String::new(),
            models: vec![],
        }
    }

    #[test]
    fn an_add_concurrent_with_a_remove_wins_and_attributes_are_lww() {
        let a = NodeId::from_name("a");
        let mut ra = RegistrySet::new();
        let mut rb = RegistrySet::new();
        let add1 = ra.add(a, 10, 7, rec("http://e:1", 1000));
        rb.merge(&add1);
        // b removes what it saw while a concurrently updates the weight (a new add).
        let rm = rb.remove(7).expect("present");
        let add2 = ra.add(a, 20, 7, rec("http://e:1", 2000));
        rb.merge(&add2);
        ra.merge(&rm);
        assert!(ra.contains(7) && rb.contains(7), "add wins");
        assert_eq!(ra.get(7).map(|r| r.weight_milli), Some(2000));
        assert_eq!(ra.digest(), rb.digest());
        // A remove after seeing both adds removes it everywhere.
        let rm2 = rb.remove(7).expect("present");
        ra.merge(&rm2);
        assert!(!ra.contains(7) && !rb.contains(7));
        assert_eq!(ra.digest(), rb.digest());
        // A late duplicate of an old add does not resurrect it.
        assert!(!ra.merge(&add1));
        assert!(!ra.contains(7));
    }
}
