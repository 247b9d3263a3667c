//! Membership changes as the node's state sees them: who is live (load entries of routers
//! gone are dropped, an identity renewed rewrites this node's entries), whom it has just met
//! (digests at once, feed heads), and the ingest ownership that follows.

use super::{Apply, MeshCore, Output};
use crate::membership::{Effect, MeshId};
use kvmesh_state::{Control, Delta, EnvelopeKind, NodeId};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

/// Members declared down (or gone) that a node remembers, at most: the newest.
pub const DOWN_MEMBERS_MAX: usize = 256;

impl MeshCore {
    /// Members declared down or gone (not back since), with when (cluster time, µs); at most
    /// `DOWN_MEMBERS_MAX`, the newest.
    pub fn down_members(&self) -> impl Iterator<Item = &(MeshId, u64)> {
        self.down.values()
    }

    /// Names that more than one live router holds (this router's among them), each with
    /// their addresses and since when (cluster time, µs). Node ids must be unique: two
    /// routers of one name are one node to the state (its load, marks and feeds). A router
    /// that restarted on another address shows here until its old identity is declared
    /// down (the failure-detection time).
    pub fn name_conflicts(&self) -> impl Iterator<Item = (&String, &(BTreeSet<SocketAddr>, u64))> {
        self.conflicts.iter()
    }

    fn find_conflicts(&mut self) {
        let me = self.membership.identity();
        let mut by_name: BTreeMap<String, BTreeSet<SocketAddr>> = BTreeMap::new();
        by_name.entry(me.name.clone()).or_default().insert(me.addr);
        for m in self.membership.live() {
            by_name.entry(m.name.clone()).or_default().insert(m.addr);
        }
        by_name.retain(|_, a| a.len() > 1);
        let now = self.now;
        let old = std::mem::take(&mut self.conflicts);
        self.conflicts = by_name
            .into_iter()
            .map(|(n, a)| {
                let since = old.get(&n).map_or(now, |(_, s)| *s);
                (n, (a, since))
            })
            .collect();
    }

    fn note_down(&mut self, m: MeshId, now_us: u64) {
        self.down.insert(NodeId::from_name(&m.name), (m, now_us));
        if self.down.len() > DOWN_MEMBERS_MAX
            && let Some(oldest) = self
                .down
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(n, _)| *n)
        {
            self.down.remove(&oldest);
        }
    }

    pub(super) fn drain_membership(&mut self) {
        let mut changed = false;
        for e in self.membership.take_effects() {
            match e {
                Effect::Send(to, data) => self.out.push(Output::Datagram(to, data)),
                Effect::Up(_) | Effect::Down(_) | Effect::Renamed(_) => changed = true,
            }
        }
        // Declared down while alive (a partition, a long pause), foca renewed this node's
        // identity to rejoin: its entries are rewritten under the new incarnation, which the
        // others accept over the tombstone of the old one.
        let bump = self.membership.identity().bump;
        if bump != self.incarnation {
            self.incarnation = bump;
            for d in self.st.load.renew(self.me, bump) {
                self.outbox.push(Delta::Load(d));
            }
            let mut applies = Vec::new();
            self.feeds.renew(bump, &mut applies);
            self.out.extend(applies.into_iter().map(Output::Apply));
        }
        if !changed {
            return;
        }
        self.find_conflicts();
        let live: BTreeMap<NodeId, MeshId> = self
            .membership
            .live()
            .map(|m| (NodeId::from_name(&m.name), m.clone()))
            .collect();
        if live == self.peers {
            return;
        }
        let now = self.now;
        let mut touched = BTreeSet::new();
        let mut gone = Vec::new();
        for (n, m) in &self.peers {
            if live.get(n).is_none_or(|x| x.bump != m.bump) {
                if !live.contains_key(n) {
                    gone.push(m.clone());
                }
                // Gone: its load entries go with its incarnation; restarted: those of every
                // earlier life (as it never takes them back itself), so that all agree.
                let upto = live
                    .get(n)
                    .map_or(m.bump, |x| x.bump.saturating_sub(1).max(m.bump));
                touched.extend(self.st.load.engines_of(*n));
                self.st.load.remove_node(*n, upto);
                self.departed_at.insert(*n, now);
                self.lag.remove(n);
            }
        }
        // This router's own name is never a member down: an earlier life of it (a restart on
        // another address) that was seen, then declared down, is this router now.
        let me = self.me;
        for m in gone
            .into_iter()
            .filter(|m| NodeId::from_name(&m.name) != me)
        {
            self.note_down(m, now);
        }
        self.down.retain(|n, _| !live.contains_key(n) && *n != me);
        let mut joined_ids = BTreeSet::new();
        for (n, m) in &live {
            if self.peers.get(n).is_none_or(|x| x.bump != m.bump) {
                joined_ids.insert(*n);
                // Met for the first time here: counts of its earlier lives (a peer's state
                // that still held them) are not its counts now: they go, and stay gone.
                // (A member seen here in another life had them dropped above.) Without
                // this, two routers restarted together that met each other first kept
                // each other's dead counts for good.
                if let Some(before) = m.bump.checked_sub(1)
                    && *n != me
                    && !self.peers.contains_key(n)
                {
                    touched.extend(self.st.load.engines_of(*n));
                    self.st.load.remove_node(*n, before);
                }
            }
        }
        self.peers = live;
        // The owners table follows the members (what `meet` below and `rebalance` read).
        let ids = self.live_ids();
        self.feeds.refresh(&ids);
        self.out.push(Output::Apply(Apply::Members));
        for engine in touched {
            let others = self.st.load.others(self.me, engine);
            self.out
                .push(Output::Apply(Apply::PeerLoad { engine, others }));
        }
        // A cold node asks one member for its whole state (again every anti-entropy period
        // until it has one); members never push whole states, so a healed partition costs
        // digests, not N² snapshots.
        if !joined_ids.is_empty() && !self.warm {
            self.want_state(now);
        }
        if !joined_ids.is_empty() {
            self.feeds.refresh_heads();
        }
        self.meet(&joined_ids, now);
        self.rebalance(now);
    }

    /// Members this node has just met (a join, a rejoin after a partition, a new connection
    /// after a silence): a warm node compares digests with each at once — one round trip
    /// repairs both sides, the newest marks included (they were flushed to members the other
    /// was not one of), instead of waiting for anti-entropy to pick them at random; and the
    /// heads of the feeds this node owns go to them with the next flush, so that a router back
    /// from a partition pulls what it missed at once.
    pub(super) fn meet(&mut self, ids: &BTreeSet<NodeId>, now_us: u64) {
        if ids.is_empty() {
            return;
        }
        let mut heads: BTreeMap<NodeId, Vec<_>> = BTreeMap::new();
        for (n, h) in self.feeds.heads_for(&self.live(), ids) {
            heads.entry(n).or_default().push(h);
        }
        for (n, h) in heads {
            if let Some(m) = self.peers.get(&n) {
                self.direct
                    .entry(m.addr)
                    .or_default()
                    .1
                    .push(Control::Heads(h));
            }
        }
        if !self.warm {
            return;
        }
        let addrs: Vec<SocketAddr> = ids
            .iter()
            .filter_map(|n| self.peers.get(n).map(|m| m.addr))
            .collect();
        for a in addrs {
            self.counters.anti_entropy_rounds += 1;
            let msg = self.digest_msg(now_us, true, true);
            self.send_to(a, Vec::new(), vec![msg], EnvelopeKind::Repair, now_us);
        }
    }

    /// Ownership and following after a change of members or engines.
    ///
    /// A router that has just started takes no engine while it knows no member: alone, it
    /// would start reading every engine afresh, and once it met the cluster, the engines it
    /// kept would be followed from its new feeds — what the engine's replay no longer holds
    /// gone from every router's index. That holds for the first router too (no seeds: a
    /// cluster's seed restarted is one, and its peers, announcing to it, meet it within a
    /// second). It waits for the members (then the engines' owners hand their feeds over) or
    /// for the warm-up time to pass without any (then it is the cluster: [`MeshCore::tick`]).
    pub(super) fn rebalance(&mut self, now_us: u64) {
        // The owners table follows the engines (and the members), even while this node
        // takes none (what `MeshCore::owners` reads).
        let ids = self.live_ids();
        self.feeds.refresh(&ids);
        if self.peers.is_empty() && !self.alone_over {
            return;
        }
        let live = self.live();
        let mut pulls = Vec::new();
        let mut applies = Vec::new();
        let moves = self
            .feeds
            .rebalance(now_us, &live, &mut pulls, &mut applies);
        self.counters.ownership_moves += moves;
        self.counters.bequests_taken = self.feeds.taken;
        self.out.extend(applies.into_iter().map(Output::Apply));
        self.send_pulls(pulls, now_us);
    }
}
