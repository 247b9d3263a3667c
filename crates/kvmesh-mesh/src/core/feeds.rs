//! Ingest ownership and the precise feeds, as one node sees them.
//!
//! Each engine with KV events is read by its owners (`r` routers by rendezvous hashing with
//! bounded loads over the live members, [`Ownership`]; every router when `r = 0`). An owner
//! keeps a [`FeedOut`] and follows its own feed; every other router follows the engine's first
//! live owner. A router that becomes an owner asks the engine's other owners (and the source it
//! followed) for a handover snapshot — the blocks with the engine's own hashes and the seq to
//! resume at — and starts reading the engine with it ([`Apply::Own`]); with nobody to ask, or
//! nobody answering within [`HANDOVER_WAIT_US`], it starts afresh (the engine is stale until
//! its stream is exact again). A router that stops owning keeps its feed for [`RETIRED_TICKS`]
//! periods to serve the next owner's handover. A router that leaves hands each feed it reads
//! to the routers that read the engine without it ([`Feeds::bequeath`]): when the engine's
//! other owners leave with it, there is nobody left to ask, and the next owner takes up the
//! bequest instead of reading the engine afresh.

use super::Apply;
use kvmesh_state::{
    Delta, FeedApply, FeedBatch, FeedHead, FeedId, FeedIn, FeedOut, FeedPull, FeedSnapshot, NodeId,
    Ownership, WireOp, ownership::sorted,
};
use std::collections::{BTreeSet, HashMap};

/// How long a new owner waits for a handover before starting afresh (µs of cluster time;
/// it asks again every anti-entropy period meanwhile).
pub const HANDOVER_WAIT_US: u64 = 3_000_000;
/// Anti-entropy periods a former owner keeps its feed for the next owner's handover.
pub const RETIRED_TICKS: u32 = 5;
/// Owners asked for a handover at most.
const HANDOVER_ASKED: usize = 2;
/// Anti-entropy periods a leaving router's feed (a bequest) is kept for this node to take up
/// when it comes to own the engine; and periods during which a feed this node started afresh
/// is replaced by a bequest that comes (the leave may arrive before it).
const BEQUEST_TICKS: u32 = 3;
/// Routers remembered per engine that asked for its feed while this node waited for its
/// handover (answered once it starts), at most.
const ASKED_WHILE_WAITING: usize = 1_024;
/// A feed's head is announced to its receivers when it has settled (not moved for a whole
/// period: every batch up to it has been flushed, so a receiver behind it lost one), once more
/// [`SETTLED_AGAIN_TICKS`] periods later, and every `HEAD_REFRESH_TICKS` periods the head it
/// had a period earlier (a feed that keeps moving shows a lost batch by the next one's gap;
/// announcing the newest head would race its batch, still in the outbox or on another stream,
/// and make receivers pull what is already on its way).
const HEAD_REFRESH_TICKS: u32 = 10;
/// See [`HEAD_REFRESH_TICKS`].
const SETTLED_AGAIN_TICKS: u32 = 3;

/// An owned feed's head over the last anti-entropy periods (see [`HEAD_REFRESH_TICKS`]).
#[derive(Debug, Clone, Copy)]
struct HeadWatch {
    /// The head at the previous period (`u64::MAX`: none yet).
    prev: u64,
    /// Periods it has not moved.
    still: u32,
    /// Periods since it was last announced.
    since: u32,
}

impl HeadWatch {
    const NEW: HeadWatch = HeadWatch {
        prev: u64::MAX,
        still: 0,
        since: HEAD_REFRESH_TICKS,
    };

    /// One period passed with the feed at `head`; the head to announce, if any. `first`: this
    /// node is the engine's first owner (its receivers' source); the other owners' feeds are
    /// followed only by routers whose view of the members differs, told at the refresh.
    fn period(&mut self, head: u64, first: bool) -> Option<u64> {
        let prev = self.prev;
        self.still = if head == prev {
            self.still.saturating_add(1)
        } else {
            0
        };
        self.prev = head;
        self.since = self.since.saturating_add(1);
        let settled = first && (self.still == 1 || self.still == SETTLED_AGAIN_TICKS);
        let h = if settled {
            Some(head)
        } else if self.since >= HEAD_REFRESH_TICKS && prev != u64::MAX {
            Some(prev)
        } else {
            None
        };
        if h.is_some() {
            self.since = 0;
        }
        h
    }
}

/// A live router: stable id and incarnation.
pub type Live = (NodeId, u64);

pub(super) struct Feeds {
    me: NodeId,
    incarnation: u64,
    r: usize,
    capacity: usize,
    engines: BTreeSet<u64>,
    ins: HashMap<u64, FeedIn>,
    outs: HashMap<u64, FeedOut>,
    /// Engines this node should own, waiting for a handover: until when.
    handover: HashMap<u64, u64>,
    /// Former feeds kept for a handover: periods left.
    retired: HashMap<u64, (FeedOut, u32)>,
    /// Per owned engine: what its head did over the last periods.
    announced: HashMap<u64, HeadWatch>,
    /// Per engine: the source of the last head heard of its feeds (a router that held the
    /// engine's feed then: a new owner asks it for a handover too).
    holders: HashMap<u64, NodeId>,
    /// The owners of every engine, for the members in `table_for` (as last given) and the
    /// engines of `engines` (none since they changed): [`Feeds::refresh`].
    table: Option<Ownership>,
    table_for: Vec<NodeId>,
    /// Per engine this node owned under its current feed id and no longer holds a feed of:
    /// the last number that feed gave (a new feed of the same id starts past it).
    numbered: HashMap<u64, u64>,
    /// Per engine this node waits to be handed: the routers that asked for its feed
    /// meanwhile (their pull had nothing to answer; they get its snapshot once it starts).
    asked: HashMap<u64, BTreeSet<NodeId>>,
    /// Those snapshots, to send.
    answers: Vec<(NodeId, Delta)>,
    /// Feeds leaving routers handed to this node ([`Feeds::on_bequest`]): periods left.
    bequests: HashMap<u64, (FeedSnapshot, u32)>,
    /// Engines this node started reading afresh lately: periods left.
    afresh: HashMap<u64, u32>,
    /// Bequests taken up.
    pub(super) taken: u64,
}

impl Feeds {
    pub(super) fn new(me: NodeId, incarnation: u64, r: usize, capacity: usize) -> Feeds {
        Feeds {
            me,
            incarnation,
            r,
            capacity,
            engines: BTreeSet::new(),
            ins: HashMap::new(),
            outs: HashMap::new(),
            handover: HashMap::new(),
            retired: HashMap::new(),
            announced: HashMap::new(),
            holders: HashMap::new(),
            table: None,
            table_for: Vec::new(),
            numbered: HashMap::new(),
            asked: HashMap::new(),
            answers: Vec::new(),
            bequests: HashMap::new(),
            afresh: HashMap::new(),
            taken: 0,
        }
    }

    fn my_feed(&self) -> FeedId {
        FeedId {
            source: self.me,
            incarnation: self.incarnation,
        }
    }

    /// The owners of every engine for the members `live`: what the node calls whenever its
    /// members or engines change (the table is recomputed only when the set of members or
    /// the engines did).
    pub(super) fn refresh(&mut self, live: &[NodeId]) {
        if self.table.is_some() && self.table_for == live {
            return;
        }
        let members = sorted(live);
        if self.table.as_ref().is_none_or(|t| t.members() != members) {
            let engines: Vec<u64> = self.engines.iter().copied().collect();
            self.table = Some(Ownership::new(&engines, &members, self.r));
        }
        self.table_for = live.to_vec();
    }

    /// The owners of `engine` among the members `live`, first owner first (from the table
    /// when [`Feeds::refresh`] was given these members last; computed afresh otherwise).
    pub(super) fn owners_of(&self, engine: u64, live: &[NodeId]) -> Vec<NodeId> {
        if let Some(t) = &self.table
            && self.table_for == live
        {
            return t.owners(engine).to_vec();
        }
        let engines: Vec<u64> = self.engines.iter().copied().collect();
        Ownership::new(&engines, live, self.r)
            .owners(engine)
            .to_vec()
    }

    pub(super) fn owned(&self) -> impl Iterator<Item = u64> + '_ {
        self.outs.keys().copied()
    }

    pub(super) fn feed_in(&self, engine: u64) -> Option<&FeedIn> {
        self.ins.get(&engine)
    }

    pub(super) fn feed_out(&self, engine: u64) -> Option<&FeedOut> {
        self.outs.get(&engine)
    }

    pub(super) fn followed(&self) -> HashMap<u64, Option<FeedId>> {
        self.ins.iter().map(|(e, f)| (*e, f.feed())).collect()
    }

    /// Blocks held by this node's feeds (owned, retired and bequeathed to it).
    pub(super) fn blocks(&self) -> usize {
        self.outs.values().map(FeedOut::len).sum::<usize>()
            + self.retired.values().map(|r| r.0.len()).sum::<usize>()
            + self
                .bequests
                .values()
                .map(|b| b.0.blocks.len())
                .sum::<usize>()
    }

    /// This node's incarnation changed: its feeds continue under the new id (receivers
    /// follow the new one and resynchronise from its snapshot).
    pub(super) fn renew(&mut self, incarnation: u64, applies: &mut Vec<Apply>) {
        self.incarnation = incarnation;
        self.numbered.clear();
        let feed = self.my_feed();
        let engines: Vec<u64> = self.outs.keys().copied().collect();
        for e in engines {
            if let Some(old) = self.outs.remove(&e) {
                let out = FeedOut::resume(feed, self.capacity, &old.snapshot());
                if let Some(fin) = self.ins.get_mut(&e)
                    && fin.follow(feed).is_some()
                {
                    let mut a = Vec::new();
                    fin.on_snapshot(&out.snapshot(), &mut a);
                    applies.extend(a.into_iter().map(Apply::Feed));
                }
                self.outs.insert(e, out);
            }
        }
    }

    /// The engines with events changed: the feeds of those gone go. Returns how many of them
    /// this node read.
    pub(super) fn set_engines(&mut self, engines: BTreeSet<u64>) -> u64 {
        let gone: Vec<u64> = self.engines.difference(&engines).copied().collect();
        let mut stopped = 0;
        for e in &gone {
            self.ins.remove(e);
            stopped += u64::from(self.outs.remove(e).is_some());
            self.handover.remove(e);
            self.retired.remove(e);
            self.holders.remove(e);
            self.numbered.remove(e);
            self.asked.remove(e);
            self.bequests.remove(e);
            self.afresh.remove(e);
        }
        if engines != self.engines {
            self.table = None;
        }
        self.engines = engines;
        stopped
    }

    /// Ownership and following after a membership or engine change. Returns the moves.
    pub(super) fn rebalance(
        &mut self,
        now_us: u64,
        live: &[Live],
        pulls: &mut Vec<(NodeId, FeedPull)>,
        applies: &mut Vec<Apply>,
    ) -> u64 {
        let ids: Vec<NodeId> = live.iter().map(|l| l.0).collect();
        let mut moves = 0;
        let engines: Vec<u64> = self.engines.iter().copied().collect();
        for engine in engines {
            let owners = self.owners_of(engine, &ids);
            let should = owners.contains(&self.me);
            let waiting = self.handover.contains_key(&engine);
            let has = self.outs.contains_key(&engine) || waiting;
            if should && (!has || waiting) {
                let bequest = self.bequests.remove(&engine);
                let ask = match bequest {
                    Some(_) => Vec::new(),
                    None => self.handover_asks(engine, &owners, &ids),
                };
                if let Some((b, _)) = bequest {
                    self.start(engine, Some(b), applies);
                    self.taken += 1;
                    moves += 1;
                } else if ask.is_empty() && !waiting {
                    self.start(engine, None, applies);
                    moves += 1;
                } else {
                    // Waiting already: the members changed, and with them whom to ask (a
                    // router that has just joined asked the owners among the members it knew
                    // then; a member that owns nothing has no feed to hand over).
                    self.handover
                        .entry(engine)
                        .or_insert(now_us.saturating_add(HANDOVER_WAIT_US));
                    for o in ask {
                        pulls.push((o, handover_pull(engine, o)));
                    }
                }
            } else if !should && has {
                self.handover.remove(&engine);
                self.asked.remove(&engine);
                if let Some(out) = self.outs.remove(&engine) {
                    self.retired.insert(engine, (out, RETIRED_TICKS));
                    applies.push(Apply::Disown { engine });
                    moves += 1;
                }
            }
            self.follow(engine, &owners, live, pulls, applies);
        }
        moves
    }

    /// Whom a new owner of `engine` asks for its feed: the engine's other owners, the
    /// owners it had without this node and the next two in rank (those that read it until
    /// this node came: a router that joins, or comes back, and outranks them), the source
    /// this node followed, and the last router heard announcing a head of the engine's feed
    /// (when several routers came at once, the owners without this node may be others that
    /// just came).
    fn handover_asks(&self, engine: u64, owners: &[NodeId], ids: &[NodeId]) -> Vec<NodeId> {
        let mut ask: Vec<NodeId> = owners
            .iter()
            .copied()
            .filter(|&o| o != self.me)
            .take(HANDOVER_ASKED)
            .collect();
        let others: Vec<NodeId> = ids.iter().copied().filter(|&n| n != self.me).collect();
        // Two more than the owners: when routers come back together, the ones that read the
        // engine until then rank just below the others that came.
        let wide = if self.r == 0 {
            HANDOVER_ASKED
        } else {
            self.r + HANDOVER_ASKED
        };
        for o in kvmesh_state::owners(engine, &others, wide) {
            if !ask.contains(&o) {
                ask.push(o);
            }
        }
        if let Some(f) = self.ins.get(&engine).and_then(FeedIn::feed)
            && f.source != self.me
            && ids.contains(&f.source)
            && !ask.contains(&f.source)
        {
            ask.push(f.source);
        }
        if let Some(&h) = self.holders.get(&engine)
            && h != self.me
            && ids.contains(&h)
            && !ask.contains(&h)
        {
            ask.push(h);
        }
        ask
    }

    /// Follows this node's own feed when it owns the engine, else the first live owner.
    fn follow(
        &mut self,
        engine: u64,
        owners: &[NodeId],
        live: &[Live],
        pulls: &mut Vec<(NodeId, FeedPull)>,
        applies: &mut Vec<Apply>,
    ) {
        let mine = self.my_feed();
        let fin = self
            .ins
            .entry(engine)
            .or_insert_with(|| FeedIn::new(engine));
        if let Some(out) = self.outs.get(&engine) {
            // A new feed of this id (owned again) is numbered past the earlier one's.
            if fin.follow(mine).is_some() || fin.applied() < out.head() {
                let mut a = Vec::new();
                fin.on_snapshot(&out.snapshot(), &mut a);
                applies.extend(a.into_iter().map(Apply::Feed));
            }
            return;
        }
        let src = owners
            .iter()
            .find(|&&o| o != self.me)
            .and_then(|o| live.iter().find(|l| l.0 == *o));
        match src {
            Some(&(source, incarnation)) => {
                if let Some(p) = fin.follow(FeedId {
                    source,
                    incarnation,
                }) {
                    pulls.push((source, p));
                }
            }
            None => fin.unfollow(),
        }
    }

    fn start(&mut self, engine: u64, from: Option<FeedSnapshot>, applies: &mut Vec<Apply>) {
        let feed = self.my_feed();
        let out = match &from {
            Some(s) => FeedOut::resume(feed, self.capacity, s),
            None => FeedOut::new(engine, feed, self.capacity),
        };
        // Past every number an earlier feed of this id gave the engine (see
        // `FeedOut::numbered_from`), the one it replaces included.
        let before = self
            .retired
            .get(&engine)
            .map(|r| r.0.head())
            .max(self.numbered.get(&engine).copied())
            .max(self.outs.get(&engine).map(FeedOut::head));
        if from.is_some() {
            self.afresh.remove(&engine);
        } else {
            self.afresh.insert(engine, BEQUEST_TICKS);
        }
        let out = match before {
            Some(n) => out.numbered_from(n + 1),
            None => out,
        };
        if let Some(who) = self.asked.remove(&engine) {
            let snap = out.snapshot();
            self.answers.extend(
                who.into_iter()
                    .map(|n| (n, Delta::FeedSnapshot(snap.clone()))),
            );
        }
        self.outs.insert(engine, out);
        self.handover.remove(&engine);
        applies.push(Apply::Own {
            engine,
            from: from.map(Box::new),
        });
    }

    /// This node's own ops for an engine it owns: numbered, applied locally, returned for the
    /// receivers.
    pub(super) fn local(
        &mut self,
        engine: u64,
        ops: &[WireOp],
        meta: &[(u64, u32)],
        stale: bool,
        next_seq: Option<u64>,
        applies: &mut Vec<FeedApply>,
    ) -> Option<FeedBatch> {
        let out = self.outs.get_mut(&engine)?;
        let b = out.push(ops, meta, stale, next_seq);
        if let Some(fin) = self.ins.get_mut(&engine) {
            fin.on_batch(b.clone(), applies);
        }
        Some(b)
    }

    pub(super) fn on_batch(
        &mut self,
        b: FeedBatch,
        applies: &mut Vec<FeedApply>,
    ) -> Option<FeedPull> {
        self.ins.get_mut(&b.engine)?.on_batch(b, applies)
    }

    /// A snapshot: a handover this node waits for, and/or a resync of the feed it follows.
    /// Returns the ownership moves.
    pub(super) fn on_snapshot(
        &mut self,
        s: FeedSnapshot,
        live: &[Live],
        applies: &mut Vec<Apply>,
    ) -> u64 {
        if !self.engines.contains(&s.engine) {
            return 0;
        }
        let mut moves = 0;
        if self.handover.contains_key(&s.engine) && s.feed.source != self.me {
            let engine = s.engine;
            self.start(engine, Some(s.clone()), applies);
            moves += 1;
            let ids: Vec<NodeId> = live.iter().map(|l| l.0).collect();
            let owners = self.owners_of(engine, &ids);
            let mut pulls = Vec::new();
            self.follow(engine, &owners, live, &mut pulls, applies);
        }
        if let Some(fin) = self.ins.get_mut(&s.engine) {
            let mut a = Vec::new();
            fin.on_snapshot(&s, &mut a);
            applies.extend(a.into_iter().map(Apply::Feed));
        }
        moves
    }

    /// What this node, leaving, hands over: each feed it reads, or read until lately (kept
    /// for a handover: the new owner's ask may not have reached it yet), to the routers that
    /// read the engine once it is gone, and the next in rank (the engine's other owners may
    /// be leaving too). Owners in this node's view included: one that has just come still
    /// waits for a handover (QA: a router ready a moment before both readers of an engine
    /// stopped was handed nothing and read the engine afresh); one that reads the engine
    /// already ignores it. Nothing when every router reads every engine.
    pub(super) fn bequeath(&self, live: &[Live]) -> Vec<(NodeId, Delta)> {
        let ids: Vec<NodeId> = live.iter().map(|l| l.0).collect();
        let rest: Vec<NodeId> = ids.iter().copied().filter(|&n| n != self.me).collect();
        if self.r == 0 || rest.is_empty() {
            return Vec::new();
        }
        let engines: Vec<u64> = self.engines.iter().copied().collect();
        let after = Ownership::new(&engines, &sorted(&rest), self.r);
        let feeds = self
            .outs
            .iter()
            .chain(self.retired.iter().map(|(e, (out, _))| (e, out)))
            .filter(|(e, _)| self.engines.contains(e));
        let mut v = Vec::new();
        for (&engine, out) in feeds {
            let mut to: Vec<NodeId> = after.owners(engine).to_vec();
            for n in kvmesh_state::owners(engine, &rest, self.r + 1) {
                if !to.contains(&n) {
                    to.push(n);
                }
            }
            let snap = out.snapshot();
            v.extend(to.into_iter().map(|n| (n, Delta::Bequest(snap.clone()))));
        }
        v
    }

    /// A leaving router's feed of an engine: taken up at once when this node waits for the
    /// engine's handover or has just started reading it afresh (the leave came first), kept
    /// for [`BEQUEST_TICKS`] periods otherwise (for when this node comes to own it), ignored
    /// when this node reads the engine already. Returns the ownership moves.
    pub(super) fn on_bequest(
        &mut self,
        s: FeedSnapshot,
        live: &[Live],
        applies: &mut Vec<Apply>,
    ) -> u64 {
        let engine = s.engine;
        if !self.engines.contains(&engine) || s.feed.source == self.me {
            return 0;
        }
        let waiting = self.handover.contains_key(&engine);
        let fresh = self.outs.contains_key(&engine) && self.afresh.contains_key(&engine);
        if waiting || fresh {
            self.start(engine, Some(s), applies);
            self.taken += 1;
            let ids: Vec<NodeId> = live.iter().map(|l| l.0).collect();
            let owners = self.owners_of(engine, &ids);
            self.follow(engine, &owners, live, &mut Vec::new(), applies);
            return u64::from(waiting);
        }
        if self.outs.contains_key(&engine) {
            return 0;
        }
        let newer = self
            .bequests
            .get(&engine)
            .is_none_or(|(b, _)| s.next_seq > b.next_seq);
        if newer {
            self.bequests.insert(engine, (s, BEQUEST_TICKS));
        }
        0
    }

    pub(super) fn on_head(&mut self, engine: u64, feed: FeedId, head: u64) -> Option<FeedPull> {
        if self.engines.contains(&engine) && feed.source != self.me {
            self.holders.insert(engine, feed.source);
        }
        self.ins.get_mut(&engine)?.on_head(feed, head)
    }

    /// What a pull from `from` asks of this node: batches from the log, or a snapshot. A
    /// node that waits to be handed the engine remembers who asked, and answers with its
    /// snapshot once it starts ([`Feeds::take_answers`]): the asker follows it as the engine's
    /// owner and would otherwise wait for the next anti-entropy period to ask again.
    pub(super) fn serve_pull(&mut self, from: NodeId, p: &FeedPull) -> Vec<Delta> {
        let out = match self.outs.get(&p.engine) {
            Some(o) => o,
            None => match self.retired.get(&p.engine) {
                Some((o, _)) => o,
                None => {
                    if self.handover.contains_key(&p.engine) && from != self.me {
                        let who = self.asked.entry(p.engine).or_default();
                        if who.len() < ASKED_WHILE_WAITING {
                            who.insert(from);
                        }
                    }
                    return Vec::new();
                }
            },
        };
        if !p.snapshot
            && p.feed == out.id()
            && let Some(batches) = out.since(p.after)
        {
            return batches.into_iter().map(Delta::Feed).collect();
        }
        vec![Delta::FeedSnapshot(out.snapshot())]
    }

    /// Members joined: every owned feed's head (as of the previous period) goes out with the
    /// next period, to every receiver (a newcomer the meeting's heads missed would otherwise
    /// learn a quiet feed's head only at its refresh, `HEAD_REFRESH_TICKS` periods later).
    pub(super) fn refresh_heads(&mut self) {
        for a in self.announced.values_mut() {
            a.since = HEAD_REFRESH_TICKS;
        }
    }

    /// The heads of every owned feed that `to` receive (they do not own its engine): what
    /// routers that just joined are told at once.
    pub(super) fn heads_for(
        &self,
        live: &[Live],
        to: &BTreeSet<NodeId>,
    ) -> Vec<(NodeId, FeedHead)> {
        let ids: Vec<NodeId> = live.iter().map(|l| l.0).collect();
        let mut v = Vec::new();
        for (&engine, out) in &self.outs {
            let owners = self.owners_of(engine, &ids);
            let head = FeedHead {
                engine,
                feed: out.id(),
                head: out.head(),
            };
            v.extend(
                to.iter()
                    .filter(|n| !owners.contains(n))
                    .map(|n| (*n, head)),
            );
        }
        v
    }

    /// Every anti-entropy period: heads to announce (with their receivers: the live routers
    /// that do not own the engine), pulls of unsynced feeds, handovers asked again, retired
    /// feeds aging.
    #[allow(clippy::type_complexity)]
    pub(super) fn periodic(
        &mut self,
        live: &[Live],
    ) -> (Vec<(Vec<NodeId>, FeedHead)>, Vec<(NodeId, FeedPull)>) {
        let ids: Vec<NodeId> = live.iter().map(|l| l.0).collect();
        let mut heads = Vec::new();
        self.announced.retain(|e, _| self.outs.contains_key(e));
        for (&engine, out) in &self.outs {
            let owners = self.owners_of(engine, &ids);
            let first = owners.first() == Some(&self.me);
            let a = self.announced.entry(engine).or_insert(HeadWatch::NEW);
            let Some(head) = a.period(out.head(), first) else {
                continue;
            };
            let receivers: Vec<NodeId> = ids
                .iter()
                .copied()
                .filter(|n| !owners.contains(n))
                .collect();
            if !receivers.is_empty() {
                heads.push((
                    receivers,
                    FeedHead {
                        engine,
                        feed: out.id(),
                        head,
                    },
                ));
            }
        }
        let mut pulls = Vec::new();
        for (&engine, fin) in &self.ins {
            if let Some(f) = fin.feed()
                && f.source != self.me
                && !fin.is_synced()
            {
                pulls.push((
                    f.source,
                    FeedPull {
                        engine,
                        feed: f,
                        after: fin.applied(),
                        snapshot: !fin.has_snapshot(),
                    },
                ));
            }
        }
        // Not answered yet: asked again (whom to ask may have changed, or the one asked was
        // itself waiting for the feed then).
        let waiting: Vec<u64> = self.handover.keys().copied().collect();
        for e in waiting {
            let owners = self.owners_of(e, &ids);
            for o in self.handover_asks(e, &owners, &ids) {
                pulls.push((o, handover_pull(e, o)));
            }
        }
        let age = |t: &mut u32| {
            *t = t.saturating_sub(1);
            *t > 0
        };
        self.bequests.retain(|_, (_, t)| age(t));
        self.afresh.retain(|_, t| age(t));
        let numbered = &mut self.numbered;
        self.retired.retain(|&e, (out, t)| {
            *t = t.saturating_sub(1);
            if *t == 0 {
                let n = numbered.entry(e).or_default();
                *n = (*n).max(out.head());
            }
            *t > 0
        });
        (heads, pulls)
    }
}

impl Feeds {
    /// Handovers that waited past [`HANDOVER_WAIT_US`] at `now_us` start afresh.
    pub(super) fn expire_handovers(
        &mut self,
        now_us: u64,
        live: &[Live],
        applies: &mut Vec<Apply>,
    ) {
        if self.handover.values().all(|&until| until > now_us) {
            return;
        }
        let late: Vec<u64> = self
            .handover
            .iter()
            .filter(|&(_, &until)| until <= now_us)
            .map(|(&e, _)| e)
            .collect();
        let ids: Vec<NodeId> = live.iter().map(|l| l.0).collect();
        for e in late {
            self.start(e, None, applies);
            let owners = self.owners_of(e, &ids);
            let mut p = Vec::new();
            self.follow(e, &owners, live, &mut p, applies);
        }
    }

    /// Snapshots owed to routers that asked while this node waited for a handover.
    pub(super) fn take_answers(&mut self) -> Vec<(NodeId, Delta)> {
        std::mem::take(&mut self.answers)
    }

    /// Whether a handover waits.
    pub(super) fn waits_for_handovers(&self) -> bool {
        !self.handover.is_empty()
    }
}

fn handover_pull(engine: u64, from: NodeId) -> FeedPull {
    FeedPull {
        engine,
        feed: FeedId {
            source: from,
            incarnation: 0,
        },
        after: 0,
        snapshot: true,
    }
}

#[cfg(test)]
#[path = "feeds_tests.rs"]
mod tests;
