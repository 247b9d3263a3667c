//! Precise prefix feeds: an engine's KV-event ops as its ingest owner derived them, numbered
//! contiguously by that owner, so that every other router can apply them in order, notice a
//! loss, and catch up from the owner's log or a snapshot.
//!
//! * A **source** (an ingest owner of the engine) keeps a [`FeedOut`]: the engine's blocks as
//!   the ops left them (key → copies, with the engine's own hash so that another owner can
//!   take the stream over exactly), a bounded log of its last batches, and a counter `n`.
//! * A **receiver** keeps a [`FeedIn`] per engine: which source it follows, the last batch
//!   applied, a bounded buffer of batches that arrived ahead of a gap, and a local epoch that
//!   grows at each snapshot (the index applies `(epoch, n)` versions: a snapshot replaces the
//!   engine's blocks, a batch is applied once).
//!
//! Ops are idempotent by version: any duplication or reordering of batches and snapshots of
//! one source ends as applying each batch once, in order (property-tested). A source that
//! restarts is a new feed (`FeedId` carries its incarnation): receivers resynchronise from a
//! snapshot instead of mixing numbers.

use crate::ids::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// Batches a source keeps for receivers that lost some (beyond: a snapshot).
pub const LOG_BATCHES: usize = 256;
/// Batches a receiver buffers ahead of a gap (beyond: it waits for the snapshot).
pub const PENDING_BATCHES: usize = 64;

/// One precise op as it travels (router block keys, never the engine's hashes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WireOp {
    /// One more copy of the block.
    Stored(u64),
    /// One copy fewer.
    Removed(u64),
    /// The engine's blocks are all gone.
    Cleared,
}

/// A feed: one incarnation of one source router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FeedId {
    /// The owner that reads the engine.
    pub source: NodeId,
    /// Its incarnation.
    pub incarnation: u64,
}

impl FeedId {
    /// A later incarnation of `other`'s source: the same router, renewed or restarted.
    pub fn succeeds(&self, other: FeedId) -> bool {
        self.source == other.source && self.incarnation > other.incarnation
    }
}

/// A batch of an engine's ops from one feed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeedBatch {
    /// The engine.
    pub engine: u64,
    /// The feed.
    pub feed: FeedId,
    /// Its number in the feed (1, 2, 3, … without gaps).
    pub n: u64,
    /// The source's blocks of this engine are not exactly known (its event stream had a gap
    /// it could not fill): route the engine approximately.
    pub stale: bool,
    /// The ops.
    pub ops: Vec<WireOp>,
}

/// Several batches of one feed, as they travel (its id once, not per batch: a flush carries
/// the batches of every engine its sender is the first owner of, all of one feed id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeedBatches {
    /// The feed.
    pub feed: FeedId,
    /// (engine, n, stale, ops) of each batch, in the sender's order.
    pub items: Vec<(u64, u64, bool, Vec<WireOp>)>,
}

impl FeedBatches {
    /// Groups batches by feed, keeping their order within each group.
    pub fn compact(batches: impl IntoIterator<Item = FeedBatch>) -> Vec<FeedBatches> {
        let mut out: Vec<FeedBatches> = Vec::new();
        for b in batches {
            let item = (b.engine, b.n, b.stale, b.ops);
            match out.iter_mut().find(|g| g.feed == b.feed) {
                Some(g) => g.items.push(item),
                None => out.push(FeedBatches {
                    feed: b.feed,
                    items: vec![item],
                }),
            }
        }
        out
    }

    /// The batches it carries.
    pub fn batches(self) -> impl Iterator<Item = FeedBatch> {
        let feed = self.feed;
        self.items
            .into_iter()
            .map(move |(engine, n, stale, ops)| FeedBatch {
                engine,
                feed,
                n,
                stale,
                ops,
            })
    }

    /// Ops carried (an envelope's weight).
    pub fn ops(&self) -> usize {
        self.items.iter().map(|i| 1 + i.3.len()).sum()
    }
}

/// One block in a snapshot: the router's key, the engine's own hash and the block's position
/// in its chain (so that a new owner can follow the engine's stream from there), the copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SnapBlock {
    /// Router block key.
    pub key: u64,
    /// The engine's hash of the block (as u64), 0 when unknown.
    pub engine_hash: u64,
    /// The block's position in its chain (0 = the prompt's first block).
    pub pos: u32,
    /// Copies the engine holds.
    pub copies: u32,
}

/// An engine's whole block set as a feed holds it after batch `n`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeedSnapshot {
    /// The engine.
    pub engine: u64,
    /// The feed.
    pub feed: FeedId,
    /// The last batch it includes.
    pub n: u64,
    /// See [`FeedBatch::stale`].
    pub stale: bool,
    /// The engine's next event seq as the source expects it (a new owner resumes there).
    pub next_seq: Option<u64>,
    /// The blocks, sorted by key.
    pub blocks: Vec<SnapBlock>,
}

/// Applies `ops` to a block map (key → copies): what an index does with a feed's ops, for
/// checks and simulations.
pub fn apply_ops(blocks: &mut BTreeMap<u64, u32>, ops: &[WireOp]) {
    for op in ops {
        match *op {
            WireOp::Stored(k) => *blocks.entry(k).or_insert(0) += 1,
            WireOp::Removed(k) => {
                if let Some(c) = blocks.get_mut(&k) {
                    *c -= 1;
                    if *c == 0 {
                        blocks.remove(&k);
                    }
                }
            }
            WireOp::Cleared => blocks.clear(),
        }
    }
}

/// The source side of one engine's feed.
#[derive(Debug, Clone)]
pub struct FeedOut {
    engine: u64,
    feed: FeedId,
    n: u64,
    stale: bool,
    next_seq: Option<u64>,
    /// key → (engine hash, position, copies).
    blocks: HashMap<u64, (u64, u32, u32)>,
    log: VecDeque<FeedBatch>,
    capacity: usize,
}

impl FeedOut {
    /// An empty feed of `engine` from `feed`, holding at most `capacity` blocks.
    pub fn new(engine: u64, feed: FeedId, capacity: usize) -> FeedOut {
        FeedOut {
            engine,
            feed,
            n: 0,
            stale: false,
            next_seq: None,
            blocks: HashMap::new(),
            log: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// A feed that takes over from another owner's snapshot: the same blocks, the engine's
    /// stream resumed at the snapshot's `next_seq`, numbered afresh.
    pub fn resume(feed: FeedId, capacity: usize, from: &FeedSnapshot) -> FeedOut {
        let mut f = FeedOut::new(from.engine, feed, capacity);
        for b in from.blocks.iter().take(f.capacity) {
            f.blocks
                .insert(b.key, (b.engine_hash, b.pos, b.copies.max(1)));
        }
        f.stale = from.stale;
        f.next_seq = from.next_seq;
        f
    }

    /// The same feed numbered from `n`: its snapshot is `n` and its first batch `n + 1`. A
    /// router that owns an engine again under the same [`FeedId`] starts past everything its
    /// earlier feed of that id numbered: a receiver still following the earlier one (its view
    /// of the members never moved it away) then takes the new feed's snapshot, or pulls it at
    /// the first gap, instead of ignoring the new numbers it had already applied and adding
    /// the new feed's batches to the earlier feed's blocks.
    pub fn numbered_from(mut self, n: u64) -> FeedOut {
        self.n = n;
        self
    }

    /// The last batch number.
    pub fn head(&self) -> u64 {
        self.n
    }

    /// The feed's id.
    pub fn id(&self) -> FeedId {
        self.feed
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// No block held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Records a batch the owner derived from the engine's events and returns it numbered.
    /// `meta[i]` is the engine's hash and the chain position of the block of the `i`-th
    /// `Stored` op (may be shorter: unknown). `next_seq` is the engine seq the owner expects
    /// next.
    pub fn push(
        &mut self,
        ops: &[WireOp],
        meta: &[(u64, u32)],
        stale: bool,
        next_seq: Option<u64>,
    ) -> FeedBatch {
        let mut stored = 0usize;
        for op in ops {
            match *op {
                WireOp::Stored(k) => {
                    let (h, pos) = meta.get(stored).copied().unwrap_or((0, 0));
                    stored += 1;
                    if let Some(e) = self.blocks.get_mut(&k) {
                        e.2 = e.2.saturating_add(1);
                        if h != 0 {
                            (e.0, e.1) = (h, pos);
                        }
                    } else if self.blocks.len() < self.capacity {
                        self.blocks.insert(k, (h, pos, 1));
                    }
                }
                WireOp::Removed(k) => {
                    if let Some(e) = self.blocks.get_mut(&k) {
                        e.2 = e.2.saturating_sub(1);
                        if e.2 == 0 {
                            self.blocks.remove(&k);
                        }
                    }
                }
                WireOp::Cleared => self.blocks.clear(),
            }
        }
        self.n += 1;
        self.stale = stale;
        self.next_seq = next_seq;
        let b = FeedBatch {
            engine: self.engine,
            feed: self.feed,
            n: self.n,
            stale,
            ops: ops.to_vec(),
        };
        if self.log.len() == LOG_BATCHES {
            self.log.pop_front();
        }
        self.log.push_back(b.clone());
        b
    }

    /// The batches after `n` if the log still has all of them (else a snapshot is needed).
    pub fn since(&self, n: u64) -> Option<Vec<FeedBatch>> {
        if n >= self.n {
            return Some(Vec::new());
        }
        let first = self.log.front()?.n;
        if n + 1 < first {
            return None;
        }
        Some(self.log.iter().filter(|b| b.n > n).cloned().collect())
    }

    /// The engine's whole block set as this feed holds it.
    pub fn snapshot(&self) -> FeedSnapshot {
        let mut blocks: Vec<SnapBlock> = self
            .blocks
            .iter()
            .map(|(&key, &(engine_hash, pos, copies))| SnapBlock {
                key,
                engine_hash,
                pos,
                copies,
            })
            .collect();
        blocks.sort_unstable();
        FeedSnapshot {
            engine: self.engine,
            feed: self.feed,
            n: self.n,
            stale: self.stale,
            next_seq: self.next_seq,
            blocks,
        }
    }
}

/// What a receiver must do to the engine's entries in its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedApply {
    /// The engine.
    pub engine: u64,
    /// The local version: a newer `epoch` replaces the engine's blocks (a snapshot), `n`
    /// orders batches within it.
    pub epoch: u32,
    /// See `epoch`.
    pub n: u64,
    /// Route the engine approximately.
    pub stale: bool,
    /// Ops to apply (a snapshot starts with `Cleared`).
    pub ops: Vec<WireOp>,
}

/// What a receiver asks of a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FeedPull {
    /// The engine.
    pub engine: u64,
    /// The feed asked.
    pub feed: FeedId,
    /// The last batch the receiver applied (0 with `snapshot`).
    pub after: u64,
    /// A whole snapshot is wanted (the receiver has nothing from this feed).
    pub snapshot: bool,
}

/// The receiver side of one engine's feed.
#[derive(Debug, Clone)]
pub struct FeedIn {
    engine: u64,
    feed: Option<FeedId>,
    synced: bool,
    n: u64,
    epoch: u32,
    stale: bool,
    pending: BTreeMap<u64, FeedBatch>,
}

impl FeedIn {
    /// Follows nobody yet.
    pub fn new(engine: u64) -> FeedIn {
        FeedIn {
            engine,
            feed: None,
            synced: false,
            n: 0,
            epoch: 0,
            stale: true,
            pending: BTreeMap::new(),
        }
    }

    /// The feed followed.
    pub fn feed(&self) -> Option<FeedId> {
        self.feed
    }

    /// A snapshot of the followed feed has been applied and nothing is missing since.
    pub fn is_synced(&self) -> bool {
        self.synced && self.pending.is_empty()
    }

    /// A snapshot of the followed feed has been applied (batches may still be missing).
    pub fn has_snapshot(&self) -> bool {
        self.synced
    }

    /// The last batch applied.
    pub fn applied(&self) -> u64 {
        self.n
    }

    /// Route approximately: not synced, or the source itself is stale.
    pub fn is_stale(&self) -> bool {
        !self.is_synced() || self.stale
    }

    /// Follow `feed` (the engine's current source). A new feed asks for its snapshot; the
    /// engine's blocks from the old one stay until the snapshot replaces them. An older
    /// incarnation of the source followed is not gone back to (a view of the members that
    /// has not yet seen the source renew its identity).
    pub fn follow(&mut self, feed: FeedId) -> Option<FeedPull> {
        if self.feed.is_some_and(|f| f == feed || f.succeeds(feed)) {
            return None;
        }
        self.feed = Some(feed);
        self.synced = false;
        self.n = 0;
        self.pending.clear();
        Some(FeedPull {
            engine: self.engine,
            feed,
            after: 0,
            snapshot: true,
        })
    }

    /// Follows nobody (no live owner): the blocks stay, routed approximately.
    pub fn unfollow(&mut self) {
        self.feed = None;
        self.synced = false;
        self.pending.clear();
    }

    /// `feed` is a later incarnation of the source followed: the same router renewed its
    /// identity (it was declared down while alive) and its feed goes on under the new one —
    /// followed at once, before this router's view of the members has the new identity
    /// (which can take SWIM seconds in a large cluster: until then the old feed, which no
    /// longer moves, would be followed and the engine's blocks stay behind).
    fn renewed(&mut self, feed: FeedId) -> Option<FeedPull> {
        if self.feed.is_some_and(|f| feed.succeeds(f)) {
            self.follow(feed)
        } else {
            None
        }
    }

    /// A batch arrived. Applies it (and what it unblocked) in order; asks for what is missing.
    pub fn on_batch(&mut self, b: FeedBatch, out: &mut Vec<FeedApply>) -> Option<FeedPull> {
        if let Some(p) = self.renewed(b.feed) {
            self.hold(b);
            return Some(p);
        }
        if Some(b.feed) != self.feed || b.n <= self.n && self.synced {
            return None;
        }
        if !self.synced {
            self.hold(b);
            return None;
        }
        if Some(b.n) == self.n.checked_add(1) {
            self.apply(b, out);
            self.drain(out);
            return None;
        }
        let after = self.n;
        self.hold(b);
        Some(FeedPull {
            engine: self.engine,
            feed: self.feed?,
            after,
            snapshot: false,
        })
    }

    /// A snapshot arrived: replaces the engine's blocks if it is of the feed followed and newer
    /// than what was applied.
    pub fn on_snapshot(&mut self, s: &FeedSnapshot, out: &mut Vec<FeedApply>) {
        let _ = self.renewed(s.feed);
        if Some(s.feed) != self.feed || self.synced && s.n <= self.n {
            return;
        }
        self.epoch = self.epoch.wrapping_add(1);
        self.n = s.n;
        self.synced = true;
        self.stale = s.stale;
        let mut ops = Vec::with_capacity(1 + s.blocks.len());
        ops.push(WireOp::Cleared);
        for b in &s.blocks {
            for _ in 0..b.copies.min(64) {
                ops.push(WireOp::Stored(b.key));
            }
        }
        out.push(FeedApply {
            engine: self.engine,
            epoch: self.epoch,
            n: self.n,
            stale: self.stale,
            ops,
        });
        self.pending.retain(|&n, _| n > s.n);
        self.drain(out);
    }

    /// The source says its feed is at `head`: a pull if this receiver is behind with nothing
    /// in hand to close the gap.
    pub fn on_head(&mut self, feed: FeedId, head: u64) -> Option<FeedPull> {
        if let Some(p) = self.renewed(feed) {
            return Some(p);
        }
        if Some(feed) != self.feed {
            return None;
        }
        if !self.synced {
            return Some(FeedPull {
                engine: self.engine,
                feed,
                after: 0,
                snapshot: true,
            });
        }
        (head > self.n).then_some(FeedPull {
            engine: self.engine,
            feed,
            after: self.n,
            snapshot: false,
        })
    }

    fn hold(&mut self, b: FeedBatch) {
        if self.pending.len() < PENDING_BATCHES || self.pending.contains_key(&b.n) {
            self.pending.insert(b.n, b);
        }
    }

    fn apply(&mut self, b: FeedBatch, out: &mut Vec<FeedApply>) {
        self.n = b.n;
        self.stale = b.stale;
        out.push(FeedApply {
            engine: self.engine,
            epoch: self.epoch,
            n: b.n,
            stale: b.stale,
            ops: b.ops,
        });
    }

    fn drain(&mut self, out: &mut Vec<FeedApply>) {
        self.pending.retain(|&n, _| n > self.n);
        // A batch past `u64::MAX` cannot exist (only a hostile peer sends that number).
        while let Some(next) = self.n.checked_add(1)
            && let Some(b) = self.pending.remove(&next)
        {
            self.apply(b, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(i: u64) -> FeedId {
        FeedId {
            source: NodeId(i),
            incarnation: 1,
        }
    }

    /// The blocks a receiver ends with, replaying its applies.
    fn replay(applies: &[FeedApply]) -> BTreeMap<u64, u32> {
        let mut m = BTreeMap::new();
        let mut last = (0u32, 0u64);
        for a in applies {
            assert!((a.epoch, a.n) > last, "versions only grow");
            last = (a.epoch, a.n);
            apply_ops(&mut m, &a.ops);
        }
        m
    }

    fn blocks(s: &FeedSnapshot) -> BTreeMap<u64, u32> {
        s.blocks.iter().map(|b| (b.key, b.copies)).collect()
    }

    #[test]
    fn lost_batches_are_pulled_from_the_log_and_a_snapshot_catches_up_after_it() {
        let mut src = FeedOut::new(9, feed(1), 1_000);
        let mut rx = FeedIn::new(9);
        let mut out = Vec::new();
        let pull = rx.follow(feed(1)).expect("snapshot wanted");
        assert!(pull.snapshot);
        rx.on_snapshot(&src.snapshot(), &mut out);
        assert!(rx.is_synced());
        let b1 = src.push(
            &[WireOp::Stored(1), WireOp::Stored(2)],
            &[(11, 0), (12, 1)],
            false,
            Some(1),
        );
        let _lost = src.push(&[WireOp::Removed(1)], &[], false, Some(2));
        let b3 = src.push(&[WireOp::Stored(3)], &[(13, 0)], false, Some(3));
        assert_eq!(rx.on_batch(b1, &mut out), None);
        let pull = rx.on_batch(b3, &mut out).expect("gap");
        assert_eq!(pull.after, 1);
        assert!(!rx.is_synced());
        for b in src.since(pull.after).expect("in the log") {
            rx.on_batch(b, &mut out);
        }
        assert!(rx.is_synced());
        assert_eq!(replay(&out), blocks(&src.snapshot()));
        // Far behind: the log no longer covers it, a snapshot does.
        for i in 0..(LOG_BATCHES as u64 + 10) {
            src.push(&[WireOp::Stored(100 + i)], &[], false, None);
        }
        assert!(src.since(rx.applied()).is_none());
        rx.on_snapshot(&src.snapshot(), &mut out);
        assert_eq!(replay(&out), blocks(&src.snapshot()));
        assert_eq!(rx.on_head(feed(1), src.head()), None);
    }

    #[test]
    fn another_feed_is_ignored_until_followed_and_then_replaces_the_blocks() {
        let mut a = FeedOut::new(9, feed(1), 100);
        let mut b = FeedOut::new(9, feed(2), 100);
        let mut rx = FeedIn::new(9);
        let mut out = Vec::new();
        rx.follow(feed(1));
        rx.on_snapshot(&a.snapshot(), &mut out);
        let x = a.push(&[WireOp::Stored(1)], &[], false, None);
        let y = b.push(&[WireOp::Stored(1), WireOp::Stored(2)], &[], false, None);
        rx.on_batch(y.clone(), &mut out);
        rx.on_batch(x, &mut out);
        assert_eq!(replay(&out), blocks(&a.snapshot()));
        assert!(rx.follow(feed(2)).is_some());
        assert!(rx.is_stale());
        rx.on_batch(y, &mut out);
        rx.on_snapshot(&b.snapshot(), &mut out);
        assert_eq!(replay(&out), blocks(&b.snapshot()));
        assert!(!rx.is_stale());
    }

    #[test]
    fn capacity_bounds_the_source_and_the_stale_flag_travels() {
        let mut src = FeedOut::new(1, feed(1), 3);
        let ops: Vec<WireOp> = (0..10).map(WireOp::Stored).collect();
        let b = src.push(&ops, &[], true, None);
        assert_eq!(src.len(), 3);
        assert!(b.stale && src.snapshot().stale);
    }

    #[test]
    fn a_source_that_renewed_its_identity_is_followed_before_the_members_say_so() {
        let mut src = FeedOut::new(9, feed(1), 1_000);
        let mut rx = FeedIn::new(9);
        let mut out = Vec::new();
        rx.follow(feed(1));
        rx.on_snapshot(&src.snapshot(), &mut out);
        let b1 = src.push(&[WireOp::Stored(1)], &[(11, 0)], false, Some(1));
        rx.on_batch(b1, &mut out);
        // Its last batches are lost; it is declared down, renews, and goes on as incarnation 2.
        let _lost = src.push(&[WireOp::Stored(2)], &[(12, 1)], false, Some(2));
        let renewed = FeedId {
            source: NodeId(1),
            incarnation: 2,
        };
        let src2 = FeedOut::resume(renewed, 1_000, &src.snapshot());
        // Its head reaches the receiver, whose view of the members still has incarnation 1.
        let pull = rx
            .on_head(renewed, src2.head())
            .expect("the new feed's snapshot");
        assert!(pull.snapshot && pull.feed == renewed);
        assert_eq!(
            rx.follow(feed(1)),
            None,
            "no going back to the old incarnation"
        );
        assert_eq!(rx.feed(), Some(renewed));
        rx.on_snapshot(&src2.snapshot(), &mut out);
        assert!(rx.is_synced());
        assert_eq!(replay(&out), blocks(&src2.snapshot()));
        assert_eq!(replay(&out).len(), 2, "the lost batch's block is there");
        // Another source, or an older incarnation, changes nothing.
        assert_eq!(rx.on_head(feed(1), 7), None);
        assert_eq!(rx.on_head(feed(3), 7), None);
        assert_eq!(rx.feed(), Some(renewed));
    }

    #[test]
    fn a_feed_numbered_at_the_end_of_u64_stops_there_without_overflow() {
        let mut rx = FeedIn::new(9);
        let mut out = Vec::new();
        rx.follow(feed(1));
        let snap = FeedSnapshot {
            engine: 9,
            feed: feed(1),
            n: u64::MAX - 1,
            stale: false,
            next_seq: None,
            blocks: Vec::new(),
        };
        let batch = |n| FeedBatch {
            engine: 9,
            feed: feed(1),
            n,
            stale: false,
            ops: vec![WireOp::Stored(n)],
        };
        // Held before the snapshot, drained after it: the last number there is.
        rx.on_batch(batch(u64::MAX), &mut out);
        rx.on_snapshot(&snap, &mut out);
        assert_eq!(rx.applied(), u64::MAX);
        assert!(rx.is_synced());
        // Nothing comes after it, and nothing panics.
        assert_eq!(rx.on_batch(batch(u64::MAX), &mut out), None);
        assert_eq!(rx.on_head(feed(1), u64::MAX), None);
        assert_eq!(out.len(), 2);
    }
}
