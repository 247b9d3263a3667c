//! What the router itself changes, as the node takes it: its speculative marks (only what
//! travels as news, compactly), its in-flight counts, engines added or removed through it,
//! and the ops it derives from the KV events of the engines it owns. Each goes into the
//! outbox for the next flush.

use super::{Apply, MeshCore, Output};
use kvmesh_state::{Delta, EngineRecord, MarkDelta};

impl MeshCore {
    /// This router's speculative mark of a prompt's chain `keys` (from its first block); the
    /// decision found the engine holding the first `known` keys. What travels is news only,
    /// and compact: the top key of each anchor window (`kvmesh_state::covering_keys`) that
    /// holds a position past `known` the cluster does not already cover for at least half the
    /// mark's lifetime, and of the first `known` only approximate marks about to lapse (a
    /// conversation's follow-up, or a sibling of a shared prompt, re-marks a long prefix of
    /// which only the last blocks are new; the prefix a speculative mark found is confirmed by
    /// KV events in every router's index already).
    ///
    /// A speculative mark that extends a prefix the engine was found holding (`known > 0`), on
    /// an engine whose feed this router has in sync, does not travel at all: the engine's own
    /// events reach every router's index a few ms after its prefill, and meanwhile a sibling
    /// at another router finds the engine by the prefix the decision found. A new prompt's
    /// mark (`known == 0`) travels: until the events come it is how siblings at other routers
    /// find the engine. Warm extensions were half of what a router received under precise
    /// routing (`--bench mesh_scale` with `KVMESH_SCALE_KINDS=1`).
    pub fn local_mark(&mut self, engine: u64, keys: Vec<u64>, known: usize, expiry_us: u64) {
        let ttl = expiry_us.saturating_sub(self.now);
        let fresh_enough = expiry_us.saturating_sub(ttl / 2);
        // A mark shorter than the longest lifetime is speculative: its engine's KV events are
        // read, so the prefix the decision found is confirmed in every router's index.
        let speculative = self
            .cfg
            .mark_ttls_us
            .iter()
            .any(|&t| t > ttl.saturating_add(1_000));
        if speculative && known > 0 && self.feeds.feed_in(engine).is_some_and(|f| !f.is_stale()) {
            self.counters.marks_kept += 1;
            return;
        }
        // Positions are covered by a mark of a later key of their window (block keys are
        // chained); the mark names the top of each window it covers, not every key.
        let cover = self.st.marks.covered_expiries(engine, &keys);
        let needed = (0..keys.len()).filter(|&i| {
            if i < known && speculative {
                return false;
            }
            match cover[i] {
                Some(e) => e < fresh_enough,
                None => i >= known,
            }
        });
        let keys = kvmesh_state::covering_keys(&keys, needed);
        if keys.is_empty() {
            return;
        }
        let d = MarkDelta {
            engine,
            keys,
            expiry_us,
        };
        self.st.marks.merge(&d);
        self.outbox.push(Delta::Mark(d));
    }

    /// This router's in-flight count on an engine (nothing to send when it is the count
    /// already recorded).
    pub fn local_load(&mut self, engine: u64, in_flight: u32) {
        if self.st.load.of(self.me, engine) == Some(in_flight) {
            return;
        }
        let d = self
            .st
            .load
            .set_local(self.me, self.incarnation, engine, in_flight);
        self.outbox.push(Delta::Load(d));
        self.load_news = true;
    }

    /// An engine added (or its record changed) through this router.
    ///
    /// The router changed its engines before telling this node, so a peer's change of the
    /// same engine applied in between is what the router holds now, whichever of the two the
    /// registry keeps: the router is told the registry's record (a no-op when it holds it
    /// already). Without this, two changes of one engine made at once through two routers
    /// could leave one router on the change the cluster dropped, for good (QA), as the
    /// digests, read from the registry, agreed.
    pub fn local_engine_add(&mut self, engine: u64, record: EngineRecord, now_us: u64) {
        self.at(now_us);
        self.supersede_seed(engine, now_us);
        let d = self.st.registry.add(self.me, now_us, engine, record);
        self.outbox.push(Delta::Registry(d));
        self.tell_engine(engine);
    }

    /// An engine removed through this router (the router is told what the registry holds
    /// after it, as for [`MeshCore::local_engine_add`]).
    pub fn local_engine_remove(&mut self, engine: u64, now_us: u64) {
        self.at(now_us);
        self.supersede_seed(engine, now_us);
        if let Some(d) = self.st.registry.remove(engine) {
            self.outbox.push(Delta::Registry(d));
        }
        self.tell_engine(engine);
    }

    /// A change through this router to an engine of its config that has not entered the
    /// registry yet (the seeds wait for the cluster's): the seed is dropped (the later word
    /// holds), and its record noted as seeded, so that a router joining later with the same
    /// config does not plant it over the change (a router alone, its changes undone by the
    /// next to join).
    fn supersede_seed(&mut self, engine: u64, now_us: u64) {
        let Some(i) = self.seeds.iter().position(|(e, _)| *e == engine) else {
            return;
        };
        let (_, record) = self.seeds.remove(i);
        if let Some(d) = self.st.registry.note_seeded(now_us, engine, &record) {
            self.outbox.push(Delta::Registry(d));
        }
    }

    /// Ops this router (an owner) derived from an engine's events; `meta[i]` is the engine's
    /// hash and the chain position of the `i`-th `Stored` op's block. Ignored when this router
    /// does not own the engine.
    pub fn local_feed(
        &mut self,
        engine: u64,
        ops: &[kvmesh_state::WireOp],
        meta: &[(u64, u32)],
        stale: bool,
        next_seq: Option<u64>,
    ) {
        let live = self.live_ids();
        let mut applies = Vec::new();
        if let Some(b) = self
            .feeds
            .local(engine, ops, meta, stale, next_seq, &mut applies)
        {
            self.counters.feed_batches += 1;
            // The engine's first owner sends its batches with everything else (one envelope
            // per member and flush); the other owners follow their own feeds and ignore it.
            if self.feeds.owners_of(engine, &live).first() == Some(&self.me) {
                self.outbox.push(Delta::Feed(b));
            }
        }
        self.out
            .extend(applies.into_iter().map(|a| Output::Apply(Apply::Feed(a))));
    }
}
