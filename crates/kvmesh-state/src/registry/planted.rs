//! Which add planted each config record first. A router plants its config's engines once it
//! believes it holds the cluster's registry; routers restarted together can believe so
//! wrongly (they meet each other first, each with an empty registry), and their plants would
//! be new writes over the run-time changes that a router still running holds (an engine
//! removed, a weight set). So every plant is told ([`Planted`]: the config record, when, and
//! the dot of the add), and per (engine, config record) only the first plant counts, by
//! (time, dot): the later ones are void, removed as a remove of their dot would (their dot is
//! seen, their add is not present). So is a plant of a record noted as seeded before it
//! ([`super::seeded`]: a node keeps the earliest time it has seen each note made), which
//! covers records first planted by builds that did not tell their plants. The routers that
//! met only each other keep their plants until they meet a router that remembers the first
//! one or the earlier note; then their adds go, and what the cluster changed since holds.
//!
//! Join: per (engine, record) the least plant of the union, cut to the [`PLANTED_MAX`] newest
//! keys by (time, engine, record) as the seed notes are ([`super::seeded`]); the void dots are
//! removes, and removes join as the registry's adds and context do, so the registry stays a
//! join. A key cut is as if never planted: a later plant of it counts (like a note cut, the
//! config record would be planted again).

use super::Dot;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Keys kept at most (the newest first plants; as many as seed notes).
pub const PLANTED_MAX: usize = super::SEEDED_MAX;

/// An add of a router's config record: the add of `dot` put config record `record` (its
/// [`super::EngineRecord::digest`]) of `engine` in at `at_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Planted {
    /// The engine.
    pub engine: u64,
    /// The config record's digest.
    pub record: u64,
    /// When (cluster µs).
    pub at_us: u64,
    /// The add.
    pub dot: Dot,
}

/// The first plant of each config record, with an index by time for the cut.
#[derive(Debug, Clone, Default)]
pub(super) struct PlantedLog {
    /// (engine, record) → the first plant's (time, dot).
    first: BTreeMap<(u64, u64), (u64, Dot)>,
    /// (time, engine, record) of every key.
    by_time: BTreeSet<(u64, u64, u64)>,
}

/// What a plant did to the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Known already (or cut at once): nothing changed.
    Known,
    /// The first plant of its record: its add counts.
    First,
    /// A later plant of its record, or an earlier one that makes the first so far later:
    /// this dot's add is void.
    Void(Dot),
}

impl PlantedLog {
    /// Merges a plant.
    pub(super) fn merge(&mut self, p: Planted) -> Outcome {
        let key = (p.engine, p.record);
        let out = match self.first.get(&key) {
            Some(&(at, dot)) if (at, dot) == (p.at_us, p.dot) => return Outcome::Known,
            Some(&(at, dot)) if (at, dot) < (p.at_us, p.dot) => return Outcome::Void(p.dot),
            Some(&(at, dot)) => {
                self.by_time.remove(&(at, p.engine, p.record));
                Outcome::Void(dot)
            }
            None => Outcome::First,
        };
        self.first.insert(key, (p.at_us, p.dot));
        self.by_time.insert((p.at_us, p.engine, p.record));
        let mut cut_itself = false;
        while self.first.len() > PLANTED_MAX {
            let Some((at, engine, record)) = self.by_time.pop_first() else {
                break;
            };
            self.first.remove(&(engine, record));
            cut_itself |= (engine, record) == key && at == p.at_us;
        }
        match out {
            Outcome::First if cut_itself => Outcome::Known,
            o => o,
        }
    }

    /// The first plant of `engine`'s `record`: (time, dot).
    pub(super) fn first(&self, engine: u64, record: u64) -> Option<(u64, Dot)> {
        self.first.get(&(engine, record)).copied()
    }

    /// The first plants, by engine.
    pub(super) fn iter(&self) -> impl Iterator<Item = Planted> + '_ {
        self.first
            .iter()
            .map(|(&(engine, record), &(at_us, dot))| Planted {
                engine,
                record,
                at_us,
                dot,
            })
    }

    /// How many keys.
    pub(super) fn len(&self) -> usize {
        self.first.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::NodeId;

    fn plant(engine: u64, record: u64, at_us: u64, node: &str) -> Planted {
        Planted {
            engine,
            record,
            at_us,
            dot: Dot {
                node: NodeId::from_name(node),
                counter: at_us,
            },
        }
    }

    #[test]
    fn the_first_plant_of_a_record_counts_whatever_the_order() {
        let first = plant(1, 7, 10, "a");
        let later = plant(1, 7, 20, "b");
        let other = plant(1, 8, 30, "b");
        let mut x = PlantedLog::default();
        assert_eq!(x.merge(first), Outcome::First);
        assert_eq!(x.merge(later), Outcome::Void(later.dot));
        assert_eq!(x.merge(first), Outcome::Known);
        assert_eq!(
            x.merge(other),
            Outcome::First,
            "another record of the engine"
        );
        let mut y = PlantedLog::default();
        assert_eq!(y.merge(later), Outcome::First);
        assert_eq!(y.merge(first), Outcome::Void(later.dot));
        assert_eq!(y.merge(later), Outcome::Void(later.dot), "still void");
        y.merge(other);
        assert_eq!(x.iter().collect::<Vec<_>>(), y.iter().collect::<Vec<_>>());
        assert_eq!(x.len(), 2);
    }

    #[test]
    fn the_cut_keeps_the_newest_keys() {
        let mut l = PlantedLog::default();
        for i in 0..(PLANTED_MAX as u64 + 5) {
            l.merge(plant(i, i, 1_000 + i, "a"));
        }
        assert_eq!(l.len(), PLANTED_MAX);
        assert_eq!(
            l.merge(plant(0, 0, 1_000, "a")),
            Outcome::Known,
            "cut at once"
        );
        assert_eq!(
            l.merge(plant(5, 5, 1, "b")),
            Outcome::Void(plant(5, 5, 1_005, "a").dot)
        );
    }
}
