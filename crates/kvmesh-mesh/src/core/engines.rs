//! The router's engines, and what the node holds of engines that are not among them.
//!
//! Peers' in-flight counts and marks name an engine by id, and an id is only the sender's
//! word. The router tells the node its engines ([`MeshCore::set_engines`]); a count or mark of
//! another engine (an *orphan*: added elsewhere and not yet heard of here, removed here while
//! a count was on its way, or made up by a broken member) is kept for a while and never
//! passed on in a repair or a snapshot (only a router that has the engine does), so that
//! orphans cannot travel from router to router. A peer's count or mark of a new orphan is
//! refused while [`ORPHAN_ENGINES_MAX`] are kept. Past [`MeshCore::orphan_grace_us`] they go.
//! An engine that joins the router's has what the node held of it handed over.
//!
//! The engines of the router's own config seed the replicated registry: once the node holds
//! the cluster's registry (warm), each config record that no router's config seeded before is
//! added where the registry lacks it or holds another record, and noted
//! ([`MeshCore::seed_engines`]). A node warm by the warm-up time, without a peer's state (every
//! peer unreachable, or of a build whose envelopes it cannot read), holds its seeds until a
//! peer's repair of the registry arrives or their registry digests agree: planted before, they
//! would be new writes over whatever the cluster changed at run time. A record seeded before is left as the cluster has it since:
//! a router that restarts with its config does not undo what the admin API changed at run
//! time (an engine removed, a weight set); one whose config changed an engine's record puts
//! the new record in. Routers of one config add nothing.

use super::{Apply, MeshCore, Output};
use kvmesh_state::{Delta, EngineRecord};
use std::collections::BTreeSet;

/// Engines the router does not have whose counts and marks a node keeps, at most: a member
/// cannot grow the state with made-up engine ids.
pub const ORPHAN_ENGINES_MAX: usize = 64;

impl MeshCore {
    /// The router's engines (`all`: its registry, from config, DNS, admin and peers) and
    /// those of them with KV events (`events`: ownership follows). The counts and marks of an
    /// engine that leaves `all` go; those of an engine that joins it are handed to the router
    /// (they may have come before the engine did). Until the first call every engine is taken
    /// as the router's.
    pub fn set_engines(&mut self, all: BTreeSet<u64>, events: BTreeSet<u64>, now_us: u64) {
        self.at(now_us);
        let old = self.engines.replace(all);
        let all = self.engines.as_ref().expect("just set");
        let joined: Vec<u64> = match &old {
            Some(old) => {
                for &e in old.difference(all) {
                    self.st.load.remove_engine(e);
                    self.st.marks.remove_engine(e);
                }
                all.difference(old).copied().collect()
            }
            None => all.iter().copied().collect(),
        };
        for e in joined {
            self.orphans.remove(&e);
            if self.st.load.has_engine(e) {
                let others = self.st.load.others(self.me, e);
                self.out
                    .push(Output::Apply(Apply::PeerLoad { engine: e, others }));
            }
            for mark in self.st.marks.deltas_of_engine(e) {
                if mark.expiry_us > now_us {
                    self.out
                        .push(Output::Apply(Apply::Mark { mark, live: false }));
                }
            }
        }
        // An engine gone that this node read is an ownership move too (it stops reading it).
        self.counters.ownership_moves += self.feeds.set_engines(events);
        self.rebalance(now_us);
    }

    /// The engines of the router's own config, to be added to the replicated registry once
    /// the node is warm (at once if it is), each where the registry does not hold this
    /// record of it and no router's config seeded this record before. An engine added or
    /// removed through this router before then is no longer a seed (the later word holds).
    pub fn seed_engines(&mut self, engines: Vec<(u64, EngineRecord)>, now_us: u64) {
        self.at(now_us);
        self.seeds = engines;
        if self.warm && !self.seeds_wait {
            self.plant_seeds(now_us);
        }
    }

    /// The seeds that waited for the cluster's registry ([`MeshCore::tick`]: warm by the
    /// warm-up time), now that the node holds it.
    pub(super) fn plant_waiting_seeds(&mut self, now_us: u64) {
        if self.seeds_wait {
            self.seeds_wait = false;
            self.plant_seeds(now_us);
        }
    }

    /// Adds the seeds the registry does not hold as they are, unless a config seeded that
    /// record before (a run-time change since holds), notes each, and tells the router each
    /// record it added (its own engine may have taken a peer's record meanwhile). The router
    /// has its config's engines from its start: of a seed superseded, it is told what the
    /// cluster holds (the engine removed, or its record).
    pub(super) fn plant_seeds(&mut self, now_us: u64) {
        for (engine, record) in std::mem::take(&mut self.seeds) {
            let held = self.st.registry.get(engine) == Some(&record);
            if self.st.registry.was_seeded(engine, &record) {
                if !held {
                    self.counters.seeds_superseded += 1;
                    self.tell_engine(engine);
                }
                continue;
            }
            let note = self.st.registry.note_seeded(now_us, engine, &record);
            if held {
                self.outbox.extend(note.map(Delta::Registry));
                continue;
            }
            let (mut d, p) = self
                .st
                .registry
                .plant(self.me, now_us, engine, record.clone());
            // The note travels in the add's delta (a receiver merges the add first): a peer
            // that met the note alone would void its own, later plant of the record, before
            // this add reached it.
            if let Some(n) = note {
                d.seeded.extend(n.seeded);
            }
            self.outbox.push(Delta::Registry(d));
            self.outbox.push(Delta::Planted(vec![p]));
            self.counters.engines_seeded += 1;
            self.out
                .push(Output::Apply(Apply::EngineUpsert { engine, record }));
        }
    }

    /// Tells the router what the registry holds of each engine a run of registry deltas
    /// changed (see `touched`).
    pub(super) fn tell_touched(&mut self) {
        for engine in std::mem::take(&mut self.touched) {
            self.tell_engine(engine);
        }
    }

    /// Tells the router what the registry holds of `engine`: its record, or its removal.
    pub(super) fn tell_engine(&mut self, engine: u64) {
        let a = match self.st.registry.get(engine) {
            Some(rec) => Apply::EngineUpsert {
                engine,
                record: rec.clone(),
            },
            None => Apply::EngineRemoved { engine },
        };
        self.out.push(Output::Apply(a));
    }

    /// Whether `engine` is the router's (or the router has not said which are).
    pub(super) fn has_engine(&self, engine: u64) -> bool {
        self.engines.as_ref().is_none_or(|a| a.contains(&engine))
    }

    /// Whether a peer's count or mark of `engine` is taken: an engine of the router's, an
    /// orphan already kept or one more while fewer than [`ORPHAN_ENGINES_MAX`] are, anything
    /// while the node is not warm (a joining router's snapshot brings the records of engines
    /// added through the admin API with their counts, in any order; the first round after it
    /// counts the orphans).
    pub(super) fn admit_engine(&mut self, engine: u64, now_us: u64) -> bool {
        if !self.warm || self.has_engine(engine) || self.orphans.contains_key(&engine) {
            return true;
        }
        if self.orphans.len() >= ORPHAN_ENGINES_MAX {
            return false;
        }
        self.orphans.insert(engine, now_us);
        true
    }

    /// How long counts and marks of an engine that is not the router's are kept: ten
    /// anti-entropy periods (an engine's record reaches every router within about one, and
    /// the router tells the node within its flush period).
    pub fn orphan_grace_us(&self) -> u64 {
        self.cfg.anti_entropy_us.saturating_mul(10)
    }

    /// Engines not the router's whose counts or marks the node holds (as of the last
    /// anti-entropy round, and those admitted since).
    pub fn orphan_engines(&self) -> usize {
        self.orphans.len()
    }

    /// The engines the node holds counts or marks of.
    pub fn held_engines(&self) -> BTreeSet<u64> {
        self.st
            .load
            .engines()
            .chain(self.st.marks.engines())
            .collect()
    }

    /// Drops what the node holds of `engine`; counted.
    fn drop_orphan(&mut self, engine: u64) {
        self.orphans.remove(&engine);
        let n = self.st.load.remove_engine(engine) + self.st.marks.remove_engine(engine);
        self.counters.orphan_entries_dropped += n as u64;
    }

    /// Each anti-entropy round: the orphans counted afresh (those the node holds that the
    /// router does not have: this node's own counts among them, and what came while it was
    /// not warm), those past their grace dropped. O(engines held).
    pub(super) fn sweep_orphans(&mut self, now_us: u64) {
        let Some(all) = &self.engines else {
            return;
        };
        let held: BTreeSet<u64> = self
            .st
            .load
            .engines()
            .chain(self.st.marks.engines())
            .filter(|e| !all.contains(e))
            .collect();
        self.orphans.retain(|e, _| held.contains(e));
        for e in held {
            self.orphans.entry(e).or_insert(now_us);
        }
        let grace = self.orphan_grace_us();
        let due: Vec<u64> = self
            .orphans
            .iter()
            .filter(|&(_, &since)| now_us.saturating_sub(since) >= grace)
            .map(|(&e, _)| e)
            .collect();
        for e in due {
            self.drop_orphan(e);
        }
    }

    /// Keeps, of state about to be passed on, what is of the router's engines.
    pub(super) fn own_engines_only(&self, parts: &mut Vec<Delta>) {
        if self.engines.is_none() {
            return;
        }
        parts.retain(|d| match d {
            Delta::Load(l) => self.has_engine(l.engine),
            Delta::Mark(m) => self.has_engine(m.engine),
            _ => true,
        });
    }
}
