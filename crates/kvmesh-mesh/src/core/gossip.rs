//! Dissemination of one node: what a peer's deltas change (and what is refused), the
//! outbox's flush, anti-entropy by digests, the welcome a joining node asks for, the control
//! messages, and the encoding of envelopes.

use super::{Apply, MARK_CLOCK_ALLOWANCE_US, MeshCore, Output};
use bytes::Bytes;
use kvmesh_state::{Control, Delta, EnvelopeKind, EnvelopeV1, NodeId, encode_as};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

/// Deltas per envelope at most (a whole state is chunked).
pub const DELTAS_PER_ENVELOPE: usize = 2_048;

/// Digests answered per peer address and anti-entropy period, at most.
pub const DIGESTS_PER_PEER_PERIOD: u32 = 8;

impl MeshCore {
    /// Merges a delta from peer `sender`; `live`: it came as news, not in a transfer of
    /// state. Refused (counted in `deltas_refused`): a mark expiring past the horizon, a
    /// feed's part from another router than its source, a count or mark of an engine the
    /// router does not have past [`super::ORPHAN_ENGINES_MAX`] such engines (see the
    /// `engines` module).
    pub(super) fn merge(&mut self, sender: NodeId, d: Delta, live: bool, now_us: u64) {
        let source = match &d {
            Delta::Feed(b) => Some(b.feed.source),
            Delta::FeedBatches(b) => Some(b.feed.source),
            Delta::FeedSnapshot(s) | Delta::Bequest(s) => Some(s.feed.source),
            Delta::SnapshotPart(p) => Some(p.snap.feed.source),
            Delta::Load(_)
            | Delta::LoadBatch(_)
            | Delta::Mark(_)
            | Delta::Registry(_)
            | Delta::Planted(_) => None,
        };
        if source.is_some_and(|s| s != sender) {
            self.counters.deltas_refused += 1;
            return;
        }
        match d {
            Delta::Mark(mark) => {
                let longest = self.cfg.mark_ttls_us.iter().copied().max().unwrap_or(0);
                let horizon = now_us
                    .saturating_add(longest)
                    .saturating_add(MARK_CLOCK_ALLOWANCE_US);
                if mark.expiry_us > horizon || !self.admit_engine(mark.engine, now_us) {
                    self.counters.deltas_refused += 1;
                    return;
                }
                if self.st.marks.merge(&mark) {
                    self.counters.deltas_applied += 1;
                    if mark.expiry_us > now_us {
                        // A recent decision is news even in a repair (two routers meeting
                        // after a partition exchange the marks made in its last moments, with
                        // the counts made after them).
                        let live = live || self.is_recent(mark.expiry_us, now_us);
                        self.out.push(Output::Apply(Apply::Mark { mark, live }));
                    }
                }
            }
            Delta::LoadBatch(b) => {
                for l in b.deltas() {
                    self.merge(sender, Delta::Load(l), live, now_us);
                }
            }
            Delta::Load(l) => {
                // This router is the only writer of its counts: one of an earlier life (a
                // peer's state, sent before the peers saw the restart) is not its count now;
                // the peers drop them too once they see the restart.
                if l.node == self.me && l.version.incarnation < self.incarnation {
                    return;
                }
                if !self.admit_engine(l.engine, now_us) {
                    self.counters.deltas_refused += 1;
                    return;
                }
                if self.st.load.merge(&l) {
                    self.counters.deltas_applied += 1;
                    let others = self.st.load.others(self.me, l.engine);
                    self.out.push(Output::Apply(Apply::PeerLoad {
                        engine: l.engine,
                        others,
                    }));
                }
            }
            Delta::Registry(r) => {
                // A delta may touch several engines (a whole state's fragment).
                let mut touched = BTreeSet::new();
                let changed = self.st.registry.merge_noting(&r, &mut touched);
                self.registry_merged(changed, touched);
            }
            Delta::Planted(ps) => {
                // A plant may void a router's add of its config record (see the registry).
                let mut touched = BTreeSet::new();
                let changed = self.st.registry.merge_planted(&ps, &mut touched);
                self.registry_merged(changed, touched);
            }
            Delta::FeedBatches(g) => {
                for b in g.batches() {
                    self.merge(sender, Delta::Feed(b), live, now_us);
                }
            }
            Delta::Feed(b) => {
                let mut applies = Vec::new();
                let pull = self.feeds.on_batch(b, &mut applies);
                self.out
                    .extend(applies.into_iter().map(|a| Output::Apply(Apply::Feed(a))));
                if let Some(p) = pull {
                    self.send_pulls(vec![(p.feed.source, p)], now_us);
                }
            }
            Delta::FeedSnapshot(s) => {
                let mut applies = Vec::new();
                let live = self.live();
                let moves = self.feeds.on_snapshot(s, &live, &mut applies);
                self.counters.ownership_moves += moves;
                self.out.extend(applies.into_iter().map(Output::Apply));
            }
            Delta::SnapshotPart(p) => {
                // The whole, once every part is in, is taken as if it had come in one piece.
                self.counters.snapshot_parts += 1;
                let (engine, part, parts) = (p.snap.engine, p.part, p.parts);
                match self.parts.add(sender, p) {
                    Ok(Some((bequest, s))) => {
                        tracing::debug!(engine = %format_args!("{:016x}", engine), parts, blocks = s.blocks.len(), bequest, "feed snapshot put together from its parts");
                        let d = if bequest {
                            Delta::Bequest(s)
                        } else {
                            Delta::FeedSnapshot(s)
                        };
                        self.merge(sender, d, live, now_us);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::debug!(engine = %format_args!("{:016x}", engine), part, parts, why = ?e, "feed snapshot part dropped");
                        self.counters.deltas_refused += 1;
                    }
                }
            }
            Delta::Bequest(s) => {
                let mut applies = Vec::new();
                let live = self.live();
                let moves = self.feeds.on_bequest(s, &live, &mut applies);
                self.counters.ownership_moves += moves;
                self.counters.bequests_taken = self.feeds.taken;
                self.out.extend(applies.into_iter().map(Output::Apply));
            }
        }
    }

    /// A registry merge done: counted if it `changed` the set, and the router told what the
    /// registry now holds of each engine it `touched`.
    fn registry_merged(&mut self, changed: bool, touched: BTreeSet<u64>) {
        if changed {
            self.counters.deltas_applied += 1;
        }
        // Told once the run of registry deltas is in (see `touched`).
        self.touched.extend(touched);
    }

    /// A control message from peer `sender` at `from`.
    pub(super) fn control(&mut self, from: SocketAddr, sender: NodeId, c: Control, now_us: u64) {
        match c {
            Control::Digest {
                digest,
                load_nodes,
                mark_buckets,
                reply,
                met,
            } => {
                if !self.digest_credit(from, now_us) {
                    self.counters.digests_ignored += 1;
                    return;
                }
                let mine = self.digest(now_us);
                let mut parts = Vec::new();
                let mut differs = false;
                if digest.load != mine.load {
                    differs = true;
                    // Per router: what is newer than the peer's newest (it is behind: in
                    // flight, or lost), or everything when the newest agree but not the rest.
                    let theirs: BTreeMap<NodeId, (u64, kvmesh_state::Version)> = load_nodes
                        .into_iter()
                        .map(|(n, h, v)| (n, (h, v)))
                        .collect();
                    for (n, h, v) in self.st.load.node_digests() {
                        let send = match theirs.get(&n) {
                            None => self.st.load.deltas_of(n),
                            Some(&(th, _)) if th == h => continue,
                            Some(&(_, tv)) if v > tv => self.st.load.deltas_of_since(n, tv),
                            Some(&(_, tv)) if v == tv => self.st.load.deltas_of(n),
                            Some(_) => continue,
                        };
                        if !send.is_empty() {
                            self.counters.repairs += 1;
                            parts.extend(send.into_iter().map(Delta::Load));
                        }
                    }
                }
                if digest.marks != mine.marks {
                    differs = true;
                    // Buckets where marks made in the last moments land are left out: their
                    // deltas are in flight, not lost — unless the two have just met, when
                    // those deltas went to the members the peer was not one of.
                    let theirs: BTreeMap<u64, u64> = mark_buckets.into_iter().collect();
                    // (`lo` cannot overflow, a bucket being an expiry divided by its width; the
                    // last bucket's end can, for a peer's mark expiring near the end of time.)
                    let young = |b: u64| {
                        let lo = b * kvmesh_state::marks::MARK_BUCKET_US;
                        let hi = lo.saturating_add(kvmesh_state::marks::MARK_BUCKET_US);
                        self.recent_expiries(lo, hi, now_us)
                    };
                    let want: BTreeSet<u64> = self
                        .st
                        .marks
                        .buckets()
                        .into_iter()
                        .filter(|(b, h)| theirs.get(b) != Some(h) && (met || !young(*b)))
                        .map(|(b, _)| b)
                        .collect();
                    if !want.is_empty() {
                        self.counters.repairs += 1;
                        parts.extend(self.st.marks.deltas_in(&want).into_iter().map(Delta::Mark));
                    }
                }
                if digest.registry != mine.registry {
                    differs = true;
                    self.counters.repairs += 1;
                    parts.extend(self.registry_deltas());
                } else {
                    // This node holds the peer's registry: seeds waiting for the cluster's go in.
                    self.plant_waiting_seeds(now_us);
                }
                self.own_engines_only(&mut parts);
                let ctl = if reply && differs {
                    vec![self.digest_msg(now_us, false, met)]
                } else {
                    Vec::new()
                };
                if !parts.is_empty() || !ctl.is_empty() {
                    self.send_to(from, parts, ctl, EnvelopeKind::Repair, now_us);
                }
            }
            Control::WholeState { .. } => {}
            Control::WantState => {
                if self.warm {
                    let all = self.whole_state(now_us);
                    self.send_to(from, all, Vec::new(), EnvelopeKind::Snapshot, now_us);
                }
            }
            Control::Pull(p) => {
                let d = self.feeds.serve_pull(sender, &p);
                // (Fields are evaluated only when debug is on.)
                tracing::debug!(
                    engine = %format_args!("{:016x}", p.engine),
                    from = %from,
                    after = p.after,
                    snapshot = p.snapshot,
                    answers = d.len(),
                    snapshot_blocks = d
                        .iter()
                        .map(|d| match d {
                            Delta::FeedSnapshot(s) => s.blocks.len(),
                            _ => 0,
                        })
                        .sum::<usize>(),
                    "feed pull served"
                );
                if !d.is_empty() {
                    self.direct.entry(from).or_default().0.extend(d);
                }
            }
            Control::Heads(heads) => {
                let mut pulls = Vec::new();
                for h in heads {
                    // Only a feed's source announces its head.
                    if h.feed.source != sender {
                        self.counters.deltas_refused += 1;
                        continue;
                    }
                    if let Some(p) = self.feeds.on_head(h.engine, h.feed, h.head) {
                        pulls.push((h.feed.source, p));
                    }
                }
                self.send_pulls(pulls, now_us);
            }
        }
    }

    /// Whether a digest from `from` is answered: at most [`DIGESTS_PER_PEER_PERIOD`] per
    /// anti-entropy period from one address. A digest costs its sender a few bytes and its
    /// answer may be the whole state: a broken member sending them as fast as it can must not
    /// make this router send its state as fast. Honest peers send about two a period (their
    /// round, their reply to this node's) and more when they meet this node again after a
    /// partition (with a budget of 4, one of the 50 seeds of `tests/cluster_sim.rs` went past
    /// it once; with 8, none does, and the test checks it).
    fn digest_credit(&mut self, from: SocketAddr, now_us: u64) -> bool {
        let period = self.cfg.anti_entropy_us.max(1);
        let w = self.digest_window.entry(from).or_insert((now_us, 0));
        if now_us.saturating_sub(w.0) >= period {
            *w = (now_us, 0);
        }
        if w.1 >= DIGESTS_PER_PEER_PERIOD {
            return false;
        }
        w.1 += 1;
        true
    }

    pub(super) fn whole_state(&mut self, now_us: u64) -> Vec<Delta> {
        self.st.marks.expire(now_us);
        let mut v: Vec<Delta> = self.st.load.deltas().into_iter().map(Delta::Load).collect();
        v.extend(self.st.marks.deltas().into_iter().map(Delta::Mark));
        v.extend(self.registry_deltas());
        self.own_engines_only(&mut v);
        v
    }

    /// The whole registry as deltas: its fragments, then the first plants.
    fn registry_deltas(&self) -> impl Iterator<Item = Delta> {
        let reg = &self.st.registry;
        let fragments = reg.deltas().into_iter().map(Delta::Registry);
        fragments.chain(reg.planted().into_iter().map(Delta::Planted))
    }

    pub(super) fn send_pulls(
        &mut self,
        pulls: Vec<(NodeId, kvmesh_state::FeedPull)>,
        _now_us: u64,
    ) {
        for (to, p) in pulls {
            let Some(m) = self.peers.get(&to) else {
                tracing::debug!(engine = %format_args!("{:016x}", p.engine), to = %format_args!("{:016x}", to.0), "feed pull not sent: the router is not a member here");
                continue;
            };
            tracing::debug!(engine = %format_args!("{:016x}", p.engine), to = %m.addr, after = p.after, snapshot = p.snapshot, "feed pull sent");
            self.counters.feed_pulls += 1;
            self.direct
                .entry(m.addr)
                .or_default()
                .1
                .push(Control::Pull(p));
        }
    }

    /// The snapshots owed to routers that asked for a feed while this node waited for its
    /// handover (see `Feeds::serve_pull`), with the other direct messages of the flush.
    pub(super) fn send_feed_answers(&mut self) {
        for (to, d) in self.feeds.take_answers() {
            if let Some(m) = self.peers.get(&to) {
                self.direct.entry(m.addr).or_default().0.push(d);
            }
        }
    }

    pub(super) fn flush(&mut self, now_us: u64) {
        self.load_news = false;
        let deltas = std::mem::take(&mut self.outbox);
        self.send_feed_answers();
        let direct = std::mem::take(&mut self.direct);
        let addrs: Vec<SocketAddr> = self.peers.values().map(|m| m.addr).collect();
        // What every member gets is encoded once; what only some need goes separately.
        // In-flight counts alone, small enough, go as a datagram (the quickest way across).
        if !deltas.is_empty() && !addrs.is_empty() {
            // An envelope to every member: one of the load spacing's credits.
            self.load_tat = self.load_tat.max(now_us) + self.load_flush_spacing();
            let load_only = deltas.iter().all(|d| matches!(d, Delta::Load(_)));
            for bytes in self.encode_chunks(deltas, Vec::new(), EnvelopeKind::Live, now_us) {
                let dgram = load_only && bytes.len() <= super::LOAD_DATAGRAM_BYTES;
                for &a in &addrs {
                    self.counters.envelopes_sent += 1;
                    self.counters.bytes_sent += bytes.len() as u64;
                    self.out.push(if dgram {
                        Output::LoadDatagram(a, bytes.clone())
                    } else {
                        Output::Envelope(a, bytes.clone())
                    });
                }
            }
        }
        for (a, (d, ctl)) in direct {
            if self.peers.values().any(|m| m.addr == a) && (!d.is_empty() || !ctl.is_empty()) {
                self.send_to(a, d, ctl, EnvelopeKind::Live, now_us);
            }
        }
    }

    pub(super) fn want_state(&mut self, now_us: u64) {
        if self.peers.is_empty() {
            return;
        }
        let i = (self.next_rand() % self.peers.len() as u64) as usize;
        if let Some(a) = self.peers.values().nth(i).map(|m| m.addr) {
            self.send_to(
                a,
                Vec::new(),
                vec![Control::WantState],
                EnvelopeKind::Live,
                now_us,
            );
        }
    }

    pub(super) fn anti_entropy(&mut self, now_us: u64) {
        self.parts.age();
        if !self.warm {
            self.want_state(now_us);
            return;
        }
        // Expired marks are dropped by every node alike; so are, in time, counts and marks
        // of engines the router does not have.
        self.st.marks.expire(now_us);
        self.sweep_orphans(now_us);
        // Tombstones of routers gone long enough ago are forgotten (bounded memory).
        let horizon = now_us.saturating_sub(self.cfg.anti_entropy_us.saturating_mul(30));
        self.departed_at.retain(|_, t| *t >= horizon);
        let addrs: BTreeSet<SocketAddr> = self.peers.values().map(|m| m.addr).collect();
        self.digest_window.retain(|a, _| addrs.contains(a));
        let keep = self.departed_at.clone();
        let live: BTreeSet<NodeId> = self.peers.keys().copied().collect();
        self.st
            .load
            .prune_departed(|n| keep.contains_key(&n) || live.contains(&n));
        // Load entries of routers that are not members here (they came through a router that
        // had not yet seen them go) are dropped.
        let strangers: Vec<NodeId> = self
            .st
            .load
            .nodes()
            .into_iter()
            .filter(|n| *n != self.me && !self.peers.contains_key(n))
            .collect();
        for n in strangers {
            for engine in self.st.load.forget_node(n) {
                let others = self.st.load.others(self.me, engine);
                self.out
                    .push(Output::Apply(Apply::PeerLoad { engine, others }));
            }
        }
        // Feed sources announce their heads; receivers still unsynced and owners waiting for
        // a handover ask again.
        let live = self.live();
        let (heads, pulls) = self.feeds.periodic(&live);
        self.send_pulls(pulls, now_us);
        if !heads.is_empty() {
            for (n, m) in self.peers.clone() {
                let h: Vec<_> = heads
                    .iter()
                    .filter(|(receivers, _)| receivers.contains(&n))
                    .map(|(_, h)| *h)
                    .collect();
                if !h.is_empty() {
                    self.direct
                        .entry(m.addr)
                        .or_default()
                        .1
                        .push(Control::Heads(h));
                }
            }
        }
        if self.peers.is_empty() {
            return;
        }
        let i = (self.next_rand() % self.peers.len() as u64) as usize;
        let Some(peer) = self.peers.values().nth(i).map(|m| m.addr) else {
            return;
        };
        self.counters.anti_entropy_rounds += 1;
        let msg = self.digest_msg(now_us, true, false);
        self.send_to(peer, Vec::new(), vec![msg], EnvelopeKind::Repair, now_us);
    }

    /// How long a mark is news (µs): anti-entropy leaves out the buckets of marks made this
    /// recently (their deltas are in flight, not lost), and a router applies them at once
    /// whatever brought them.
    pub(super) fn settle_us(&self) -> u64 {
        self.cfg.flush_us.saturating_mul(10).max(1_000_000)
    }

    /// A mark expiring at `expiry_us` was made within [`MeshCore::settle_us`] (with one of
    /// the lifetimes marks are made with).
    pub(super) fn is_recent(&self, expiry_us: u64, now_us: u64) -> bool {
        self.recent_expiries(expiry_us, expiry_us, now_us)
    }

    /// Some expiry between `lo` and `hi` is that of a mark made within
    /// [`MeshCore::settle_us`] (an expiry bucket's bounds; one expiry when equal).
    fn recent_expiries(&self, lo: u64, hi: u64, now_us: u64) -> bool {
        let settle = self.settle_us();
        self.cfg.mark_ttls_us.iter().any(|&ttl| {
            let newest = now_us.saturating_add(ttl);
            hi > newest.saturating_sub(settle) && lo <= newest
        })
    }

    /// This node's digests with the detail a peer needs to send only what differs.
    /// `met`: the peer has just joined (see [`Control::Digest`]).
    pub(super) fn digest_msg(&mut self, now_us: u64, reply: bool, met: bool) -> Control {
        Control::Digest {
            digest: self.digest(now_us),
            load_nodes: self.st.load.node_digests(),
            mark_buckets: self.st.marks.buckets(),
            reply,
            met,
        }
    }

    pub(super) fn send_to(
        &mut self,
        to: SocketAddr,
        deltas: Vec<Delta>,
        control: Vec<Control>,
        kind: EnvelopeKind,
        now_us: u64,
    ) {
        for bytes in self.encode_chunks(deltas, control, kind, now_us) {
            self.counters.envelopes_sent += 1;
            self.counters.bytes_sent += bytes.len() as u64;
            self.out.push(Output::Envelope(to, bytes));
        }
    }

    /// Deltas as envelopes of bounded size, each of `kind`; the control goes with the last.
    /// The last envelope of a whole state says how many there are.
    pub(super) fn encode_chunks(
        &self,
        deltas: Vec<Delta>,
        control: Vec<Control>,
        kind: EnvelopeKind,
        now_us: u64,
    ) -> Vec<Bytes> {
        // In-flight counts travel grouped by router (its id and incarnation once), feed
        // batches by feed (its id once). Counts last: a receiver applies an envelope in
        // order, and must not see a request's count before the mark of its prompt (a
        // sibling of a new prefix would go elsewhere).
        // Plants and bequests go in version 2 only (they came after it: builds before them
        // skip the part, while a version 1 envelope would be dropped whole).
        let plants = self.cfg.wire_version >= 2;
        // A snapshot too large for one envelope goes in parts (version 2 only as well).
        let per_part = self.cfg.snapshot_part_blocks.max(1);
        let mut loads = Vec::new();
        let mut batches = Vec::new();
        let mut rest = Vec::new();
        for d in deltas {
            match d {
                Delta::Load(l) => loads.push(l),
                Delta::Feed(b) => batches.push(b),
                Delta::Planted(_) | Delta::Bequest(_) | Delta::SnapshotPart(_) if !plants => {}
                Delta::FeedSnapshot(s) if plants && s.blocks.len() > per_part => rest.extend(
                    s.into_parts(false, per_part)
                        .into_iter()
                        .map(Delta::SnapshotPart),
                ),
                // (Version 1 dropped bequests above; a snapshot goes whole in it.)
                Delta::Bequest(s) if s.blocks.len() > per_part => rest.extend(
                    s.into_parts(true, per_part)
                        .into_iter()
                        .map(Delta::SnapshotPart),
                ),
                d => rest.push(d),
            }
        }
        let deltas = rest
            .into_iter()
            .chain(
                kvmesh_state::FeedBatches::compact(batches)
                    .into_iter()
                    .map(Delta::FeedBatches),
            )
            .chain(
                kvmesh_state::LoadBatch::compact(loads)
                    .into_iter()
                    .map(Delta::LoadBatch),
            );
        let mut chunks: Vec<Vec<Delta>> = Vec::new();
        let mut cur = Vec::new();
        let mut weight = 0usize;
        for d in deltas {
            // A plant stays with the add before it: a receiver that met a peer's plant
            // without its add would void its own add of the record and tell its router the
            // engine gone, to add it back when the peer's add came.
            let plant_after_add = matches!(d, Delta::Planted(_))
                && matches!(cur.last(), Some(Delta::Registry(r)) if !r.adds.is_empty());
            if weight >= DELTAS_PER_ENVELOPE && !plant_after_add {
                chunks.push(std::mem::take(&mut cur));
                weight = 0;
            }
            // Large deltas count for what they carry.
            weight += match &d {
                Delta::FeedSnapshot(s) | Delta::Bequest(s) => 1 + s.blocks.len() / 8,
                Delta::SnapshotPart(p) => 1 + p.snap.blocks.len() / 8,
                Delta::Mark(m) => 1 + m.keys.len() / 8,
                Delta::LoadBatch(b) => 1 + b.items.len() / 4,
                Delta::FeedBatches(b) => 1 + b.ops() / 8,
                Delta::Planted(p) => 1 + p.len() / 8,
                _ => 1,
            };
            cur.push(d);
        }
        if !cur.is_empty() || chunks.is_empty() {
            chunks.push(cur);
        }
        let last = chunks.len() - 1;
        let mut control = Some(control);
        if kind == EnvelopeKind::Snapshot
            && let Some(c) = control.as_mut()
        {
            c.push(Control::WholeState {
                chunks: chunks.len() as u32,
            });
        }
        let mut out = Vec::with_capacity(chunks.len());
        for (i, chunk) in chunks.into_iter().enumerate() {
            let env = EnvelopeV1 {
                cluster_id: self.cfg.cluster_id,
                from: self.me,
                kind,
                sent_us: now_us,
                deltas: chunk,
                control: if i == last {
                    control.take().unwrap_or_default()
                } else {
                    Vec::new()
                },
            };
            if let Ok(bytes) = encode_as(env, self.cfg.wire_version) {
                out.push(Bytes::from(bytes));
            }
        }
        out
    }
}
