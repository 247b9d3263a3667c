//! What routers' configs have put in the registry: per engine, the digests of the config
//! records that a router seeded (or found in place) at its start. A router's config engine is
//! planted only when its record is not among them, so a router that restarts with the config
//! it had leaves the run-time changes made since (an engine removed, a weight set through the
//! admin API) as they are, and one whose config changed an engine's record puts the new
//! record in.
//!
//! A note outlives its engine's removal (that is its purpose). Join: the union of the notes,
//! each with the newest time it was noted, cut to the [`SEEDED_MAX`] newest by (time, engine,
//! digest). The cut depends on the union only, so the join stays commutative, associative and
//! idempotent; a note cut is as if never made (its config record would be planted again).

use super::EngineRecord;
use crate::{digest_of, part};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Notes kept at most: the newest go on (a config record planted long ago and cut is planted
/// again at the next start of a router whose config has it).
pub const SEEDED_MAX: usize = 16_384;

/// A config record of an engine that a router's config put in the registry, or found there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Seeded {
    /// The engine.
    pub engine: u64,
    /// [`EngineRecord::digest`] of the config's record.
    pub record: u64,
    /// When it was noted (cluster µs).
    pub at_us: u64,
}

impl EngineRecord {
    /// A stable digest of the record (blake3 over its fields, lengths first).
    pub fn digest(&self) -> u64 {
        let mut h = blake3::Hasher::new();
        h.update(b"kvmesh/engine-record/v1");
        for s in [&self.url, &self.kv_events, &self.kv_replay] {
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        h.update(&self.weight_milli.to_le_bytes());
        h.update(&(self.models.len() as u64).to_le_bytes());
        for m in &self.models {
            h.update(&(m.len() as u64).to_le_bytes());
            h.update(m.as_bytes());
        }
        let mut x = [0u8; 8];
        x.copy_from_slice(&h.finalize().as_bytes()[..8]);
        u64::from_le_bytes(x)
    }
}

/// The notes, with an index by time for the cut.
#[derive(Debug, Clone, Default)]
pub(super) struct SeededLog {
    /// (engine, record digest) → newest time noted.
    notes: BTreeMap<(u64, u64), u64>,
    /// (time, engine, record digest) of every note.
    by_time: BTreeSet<(u64, u64, u64)>,
    /// (engine, record digest) → the earliest time this node has seen it noted. Not in the
    /// digest; a whole state sends it as a second note of the key ([`Self::iter_with_earliest`]);
    /// it only decreases, and goes with its note when the note is cut. A plant of a record
    /// noted before it is void ([`super::planted`]), also when the earlier note was made by a
    /// build before plants were told.
    earliest: BTreeMap<(u64, u64), u64>,
}

impl SeededLog {
    /// Whether the config record `record` of `engine` was noted.
    pub(super) fn contains(&self, engine: u64, record: u64) -> bool {
        self.notes.contains_key(&(engine, record))
    }

    /// The earliest time this node has seen `engine`'s `record` noted, if noted.
    pub(super) fn earliest(&self, engine: u64, record: u64) -> Option<u64> {
        self.earliest.get(&(engine, record)).copied()
    }

    /// Merges a note; true when it changed the log (a cut note changes nothing).
    pub(super) fn merge(&mut self, s: Seeded) -> bool {
        let key = (s.engine, s.record);
        let e = self.earliest.entry(key).or_insert(s.at_us);
        *e = (*e).min(s.at_us);
        match self.notes.get(&key) {
            Some(&at) if at >= s.at_us => return false,
            Some(&at) => {
                self.by_time.remove(&(at, s.engine, s.record));
            }
            None => {}
        }
        self.notes.insert(key, s.at_us);
        self.by_time.insert((s.at_us, s.engine, s.record));
        let mut cut_itself = false;
        while self.notes.len() > SEEDED_MAX {
            let Some((at, engine, record)) = self.by_time.pop_first() else {
                break;
            };
            self.notes.remove(&(engine, record));
            self.earliest.remove(&(engine, record));
            cut_itself |= (engine, record) == key && at == s.at_us;
        }
        !cut_itself
    }

    /// The notes, by engine.
    pub(super) fn iter(&self) -> impl Iterator<Item = Seeded> + '_ {
        self.notes.iter().map(|(&(engine, record), &at_us)| Seeded {
            engine,
            record,
            at_us,
        })
    }

    /// The notes as a whole state sends them: each with its newest time and, when this node
    /// has seen it noted earlier, once more with its earliest time. The second is the same
    /// kind of note (builds that keep only the newest time merge it as nothing new), and it
    /// carries what a later plant is judged by ([`super::planted`]), so that a join of whole
    /// states keeps it.
    pub(super) fn iter_with_earliest(&self) -> impl Iterator<Item = Seeded> + '_ {
        self.iter().flat_map(|n| {
            let earlier = self
                .earliest(n.engine, n.record)
                .filter(|&t| t < n.at_us)
                .map(|at_us| Seeded { at_us, ..n });
            std::iter::once(n).chain(earlier)
        })
    }

    /// How many notes.
    pub(super) fn len(&self) -> usize {
        self.notes.len()
    }

    /// A digest of the notes.
    pub(super) fn digest(&self) -> u64 {
        digest_of(
            b"kvmesh/registry/seeded",
            self.iter().map(|s| part(s.engine, s.record, s.at_us, 0)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(engine: u64, record: u64, at_us: u64) -> Seeded {
        Seeded {
            engine,
            record,
            at_us,
        }
    }

    #[test]
    fn a_note_keeps_its_newest_time_and_merges_idempotently() {
        let mut l = SeededLog::default();
        assert!(l.merge(note(1, 7, 10)));
        assert!(!l.merge(note(1, 7, 10)));
        assert!(!l.merge(note(1, 7, 5)));
        assert!(l.merge(note(1, 7, 20)));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![note(1, 7, 20)]);
        assert!(l.contains(1, 7) && !l.contains(1, 8) && !l.contains(2, 7));
    }

    #[test]
    fn the_cut_keeps_the_newest_whatever_the_order() {
        let n = SEEDED_MAX + 10;
        let notes: Vec<Seeded> = (0..n as u64).map(|i| note(i, i * 3, 1_000 + i)).collect();
        let mut fwd = SeededLog::default();
        notes.iter().for_each(|&s| {
            fwd.merge(s);
        });
        let mut back = SeededLog::default();
        notes.iter().rev().for_each(|&s| {
            back.merge(s);
        });
        assert_eq!(fwd.len(), SEEDED_MAX);
        assert_eq!(fwd.digest(), back.digest());
        assert!(!fwd.contains(9, 27) && fwd.contains(10, 30));
        // A cut note that comes again changes nothing.
        assert!(!back.merge(note(0, 0, 1_000)));
        assert_eq!(fwd.digest(), back.digest());
    }

    #[test]
    fn the_record_digest_tells_every_field_apart() {
        let r = EngineRecord {
            url: "http://a:8000".into(),
            weight_milli: 1_000,
            kv_events: String::new(),
            kv_replay: String::new(),
            models: vec!["m".into()],
        };
        let mut variants = vec![r.clone()];
        variants.push(EngineRecord {
            weight_milli: 2_000,
            ..r.clone()
        });
        variants.push(EngineRecord {
            kv_events: "tcp://a:5557".into(),
            ..r.clone()
        });
        variants.push(EngineRecord {
            kv_replay: "tcp://a:5558".into(),
            ..r.clone()
        });
        variants.push(EngineRecord {
            models: vec![],
            ..r.clone()
        });
        variants.push(EngineRecord {
            url: "http://a:8001".into(),
            ..r.clone()
        });
        let digests: BTreeSet<u64> = variants.iter().map(EngineRecord::digest).collect();
        assert_eq!(digests.len(), variants.len());
        assert_eq!(r.digest(), r.clone().digest());
    }
}
