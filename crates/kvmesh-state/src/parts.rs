//! Feed snapshots too large for one envelope, sent in parts and put together again.
//!
//! An engine's snapshot holds every block its feed knows (up to `engine_capacity_blocks`,
//! about 22 bytes each encoded): past [`SNAPSHOT_PART_BLOCKS`] blocks it would outgrow the
//! envelope bound ([`crate::MAX_ENVELOPE_BYTES`]), and a handover, a bequest or a follower's
//! resync of such an engine could never be sent. The sender splits it
//! ([`FeedSnapshot::into_parts`]); the receiver keeps the parts of each (sender, engine) in an
//! [`Assembly`] until it holds them all, then applies the whole snapshot as if it had come in
//! one piece. Hostile parts change nothing but the assemblies: bounded in number, in parts and
//! in blocks, aged out when incomplete, a newer snapshot's parts replacing an older one's.

use crate::feeds::FeedSnapshot;
use crate::ids::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// Blocks per part of a snapshot sent in parts (about 1.4 MB encoded).
pub const SNAPSHOT_PART_BLOCKS: usize = 65_536;

/// Snapshots being put together at once, at most (a part of another is dropped, counted: its
/// receiver asks again).
pub const ASSEMBLIES_MAX: usize = 16;

/// Anti-entropy periods an incomplete snapshot is kept for.
pub const ASSEMBLY_TICKS: u32 = 3;

/// One part of a feed snapshot sent in parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotPart {
    /// The whole is a leaving router's bequest ([`crate::Delta::Bequest`]), not a
    /// [`crate::Delta::FeedSnapshot`].
    pub bequest: bool,
    /// This part's index (from 0).
    pub part: u32,
    /// The number of parts.
    pub parts: u32,
    /// The snapshot's header, and this part's blocks (the whole's, sorted, are the parts'
    /// in order).
    pub snap: FeedSnapshot,
}

impl FeedSnapshot {
    /// This snapshot in parts of at most `per_part` blocks (one part when it fits in one).
    pub fn into_parts(mut self, bequest: bool, per_part: usize) -> Vec<SnapshotPart> {
        let per_part = per_part.max(1);
        let blocks = std::mem::take(&mut self.blocks);
        let parts = blocks.len().div_ceil(per_part).max(1) as u32;
        let mut out = Vec::with_capacity(parts as usize);
        let mut rest = blocks.into_iter();
        for part in 0..parts {
            let mut snap = self.clone();
            snap.blocks = rest.by_ref().take(per_part).collect();
            out.push(SnapshotPart {
                bequest,
                part,
                parts,
                snap,
            });
        }
        out
    }
}

/// Why a part was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartDropped {
    /// Its numbers are impossible (part ≥ parts, too many parts or blocks).
    Malformed,
    /// [`ASSEMBLIES_MAX`] other snapshots are being put together.
    Full,
}

struct Partial {
    /// The whole's header (blocks empty): a part of another header starts over.
    head: FeedSnapshot,
    parts: u32,
    got: BTreeMap<u32, FeedSnapshot>,
    /// Blocks in `got`.
    blocks: usize,
    ticks: u32,
}

/// The snapshots a node is putting together, by (sender, engine, bequest).
#[derive(Default)]
pub struct Assembly {
    partial: HashMap<(NodeId, u64, bool), Partial>,
    max_blocks: usize,
}

impl Assembly {
    /// Snapshots of at most `max_blocks` blocks (the node gives twice its feed capacity: a
    /// sender's may differ a little, and the feed keeps what fits).
    pub fn new(max_blocks: usize) -> Assembly {
        Assembly {
            partial: HashMap::new(),
            max_blocks: max_blocks.max(1),
        }
    }

    /// A part from `sender`: the whole snapshot (and whether it is a bequest) once every
    /// part is in.
    pub fn add(
        &mut self,
        sender: NodeId,
        p: SnapshotPart,
    ) -> Result<Option<(bool, FeedSnapshot)>, PartDropped> {
        let most = u32::try_from(self.max_blocks).unwrap_or(u32::MAX);
        if p.part >= p.parts || p.parts > most || p.snap.blocks.len() > SNAPSHOT_PART_BLOCKS {
            return Err(PartDropped::Malformed);
        }
        let key = (sender, p.snap.engine, p.bequest);
        let mut head = p.snap.clone();
        head.blocks = Vec::new();
        let fresh = match self.partial.get(&key) {
            Some(q) if q.head == head && q.parts == p.parts => false,
            // Another snapshot of the same feed while one started this period is still
            // coming (a receiver that asked twice): the first is completed, not thrown away
            // for each newer one whose parts interleave with it (it would never complete
            // while the engine is busy); the held batches bring it up to date. One that has
            // waited a period lost a part, and the newer one replaces it.
            Some(q) if q.head.feed == head.feed && q.ticks == ASSEMBLY_TICKS => {
                return Ok(None);
            }
            Some(_) => true,
            None => {
                if self.partial.len() >= ASSEMBLIES_MAX {
                    return Err(PartDropped::Full);
                }
                true
            }
        };
        if fresh {
            self.partial.insert(
                key,
                Partial {
                    head,
                    parts: p.parts,
                    got: BTreeMap::new(),
                    blocks: 0,
                    ticks: ASSEMBLY_TICKS,
                },
            );
        }
        let q = self.partial.get_mut(&key).ok_or(PartDropped::Full)?;
        let n = p.snap.blocks.len();
        if let Some(was) = q.got.insert(p.part, p.snap) {
            q.blocks -= was.blocks.len();
        }
        q.blocks += n;
        if q.blocks > self.max_blocks {
            self.partial.remove(&key);
            return Err(PartDropped::Malformed);
        }
        if q.got.len() < q.parts as usize {
            return Ok(None);
        }
        let q = self.partial.remove(&key).ok_or(PartDropped::Full)?;
        let mut whole = q.head;
        whole.blocks.reserve(q.blocks);
        for (_, s) in q.got {
            whole.blocks.extend(s.blocks);
        }
        Ok(Some((p.bequest, whole)))
    }

    /// An anti-entropy period passed: snapshots incomplete for [`ASSEMBLY_TICKS`] periods
    /// go (their receivers ask again).
    pub fn age(&mut self) {
        self.partial.retain(|_, q| {
            q.ticks = q.ticks.saturating_sub(1);
            q.ticks > 0
        });
    }

    /// Snapshots being put together.
    pub fn len(&self) -> usize {
        self.partial.len()
    }

    /// None being put together.
    pub fn is_empty(&self) -> bool {
        self.partial.is_empty()
    }

    /// Blocks held in incomplete snapshots.
    pub fn blocks(&self) -> usize {
        self.partial.values().map(|q| q.blocks).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feeds::{FeedId, SnapBlock};

    fn snap(blocks: usize, n: u64) -> FeedSnapshot {
        FeedSnapshot {
            engine: 7,
            feed: FeedId {
                source: NodeId(1),
                incarnation: 1,
            },
            n,
            stale: false,
            next_seq: Some(n + 100),
            blocks: (0..blocks as u64)
                .map(|k| SnapBlock {
                    key: k,
                    engine_hash: k * 3,
                    pos: 0,
                    copies: 1,
                })
                .collect(),
        }
    }

    #[test]
    fn parts_in_any_order_make_the_whole_again() {
        let whole = snap(10, 4);
        let mut parts = whole.clone().into_parts(true, 3);
        assert_eq!(parts.len(), 4);
        parts.reverse();
        let mut a = Assembly::new(100);
        let mut got = None;
        for p in parts {
            got = a.add(NodeId(1), p).expect("kept");
        }
        assert_eq!(got, Some((true, whole)));
        assert!(a.is_empty());
        // One part when it fits.
        assert_eq!(snap(3, 1).into_parts(false, 3).len(), 1);
        assert_eq!(snap(0, 1).into_parts(false, 3).len(), 1);
    }

    #[test]
    fn interleaved_snapshots_complete_the_first_and_a_stalled_one_gives_way() {
        let mut a = Assembly::new(100);
        let old = snap(10, 4).into_parts(false, 5);
        let new = snap(10, 5).into_parts(false, 5);
        // Two answers to two asks, their parts interleaved: the first completes.
        assert_eq!(a.add(NodeId(1), old[0].clone()), Ok(None));
        assert_eq!(a.add(NodeId(1), new[0].clone()), Ok(None));
        assert_eq!(a.add(NodeId(1), new[1].clone()), Ok(None));
        assert_eq!(
            a.add(NodeId(1), old[1].clone()),
            Ok(Some((false, snap(10, 4))))
        );
        assert!(a.is_empty());
        // One that lost a part gives way to a newer one after a period, and ages out.
        assert_eq!(a.add(NodeId(1), old[0].clone()), Ok(None));
        a.age();
        assert_eq!(a.add(NodeId(1), new[0].clone()), Ok(None));
        assert_eq!(
            a.add(NodeId(1), new[1].clone()),
            Ok(Some((false, snap(10, 5))))
        );
        assert_eq!(a.add(NodeId(1), old[0].clone()), Ok(None));
        assert_eq!(a.len(), 1);
        for _ in 0..ASSEMBLY_TICKS {
            a.age();
        }
        assert!(a.is_empty());
        // Another source's (or incarnation's) snapshot replaces at once.
        let mut other = snap(10, 1);
        other.feed.incarnation = 2;
        assert_eq!(a.add(NodeId(1), old[0].clone()), Ok(None));
        let parts = other.clone().into_parts(false, 5);
        assert_eq!(a.add(NodeId(1), parts[0].clone()), Ok(None));
        assert_eq!(a.add(NodeId(1), parts[1].clone()), Ok(Some((false, other))));
    }

    /// A snapshot of 200,000 blocks does not fit one envelope (about 4.3 MB); each of its
    /// parts does, and decodes.
    #[test]
    fn a_large_snapshot_s_parts_each_fit_an_envelope() {
        use crate::wire::{Delta, EnvelopeKind, EnvelopeV1, decode, encode_as};
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut whole = snap(0, 9);
        whole.blocks = (0..200_000u32)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                SnapBlock {
                    key: x,
                    engine_hash: x.rotate_left(7),
                    pos: i % 2_000,
                    copies: 1,
                }
            })
            .collect();
        whole.blocks.sort_unstable();
        let env = |d: Delta| EnvelopeV1 {
            cluster_id: 1,
            from: NodeId(1),
            kind: EnvelopeKind::Live,
            sent_us: 0,
            deltas: vec![d],
            control: Vec::new(),
        };
        let one = encode_as(env(Delta::FeedSnapshot(whole.clone())), 2).expect("encodes");
        assert!(one.len() > crate::MAX_ENVELOPE_BYTES, "{} bytes", one.len());
        let mut a = Assembly::new(400_000);
        let mut got = None;
        for p in whole.clone().into_parts(false, SNAPSHOT_PART_BLOCKS) {
            let bytes = encode_as(env(Delta::SnapshotPart(p)), 2).expect("encodes");
            assert!(
                bytes.len() < crate::MAX_ENVELOPE_BYTES / 2,
                "{} bytes",
                bytes.len()
            );
            let mut e = decode(&bytes, 1).expect("decodes");
            let Some(Delta::SnapshotPart(p)) = e.deltas.pop() else {
                panic!("a part")
            };
            got = a.add(NodeId(1), p).expect("kept");
        }
        assert_eq!(got, Some((false, whole)));
    }

    #[test]
    fn hostile_parts_are_dropped_and_bounded() {
        let mut a = Assembly::new(4);
        let mut p = snap(1, 1).into_parts(false, 1).remove(0);
        p.part = 3;
        p.parts = 2;
        assert_eq!(a.add(NodeId(1), p.clone()), Err(PartDropped::Malformed));
        p.part = 0;
        p.parts = 5; // more parts than blocks allowed
        assert_eq!(a.add(NodeId(1), p.clone()), Err(PartDropped::Malformed));
        // More blocks than allowed, over several parts: the snapshot goes.
        let big = snap(6, 1).into_parts(false, 2);
        assert_eq!(a.add(NodeId(1), big[0].clone()), Ok(None));
        assert_eq!(a.add(NodeId(1), big[1].clone()), Ok(None));
        assert_eq!(
            a.add(NodeId(1), big[2].clone()),
            Err(PartDropped::Malformed)
        );
        assert!(a.is_empty());
        p.parts = 2;
        for s in 0..ASSEMBLIES_MAX as u64 {
            assert_eq!(a.add(NodeId(s), p.clone()), Ok(None));
        }
        assert_eq!(a.add(NodeId(999), p), Err(PartDropped::Full));
        assert_eq!(a.len(), ASSEMBLIES_MAX);
        assert_eq!(a.blocks(), ASSEMBLIES_MAX);
    }
}
