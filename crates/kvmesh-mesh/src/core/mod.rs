//! The mesh node, sans-IO: SWIM membership (foca, [`crate::membership`]), the replicated state
//! (`kvmesh-state`), ingest ownership and dissemination in one deterministic state machine.
//! Time (`now_us`, cluster time) and randomness (a seed) are passed in; what it wants done
//! comes out as [`Output`]s — packets to send and changes to apply to the router — on the
//! model of foca's `AccumulatingRuntime`. The tokio shell ([`crate::node`]) and the
//! simulations (`tests/cluster_sim.rs`, `benches`) drive the same code.
//!
//! Dissemination:
//! * local changes (marks, load, registry, feed batches) wait in an outbox and go out every
//!   `flush_us` as one envelope per member (a unidirectional stream in the shell);
//! * every `anti_entropy_us` this node sends its digests to one random member, which answers
//!   with the parts that differ and its own digests, so both sides repair in one round trip;
//!   feed sources announce their settled heads to every member, and receivers behind pull;
//! * a member that joins gets this node's whole state at once; a joining node is warm (ready)
//!   at the first whole state it receives, or after `warm_bound_us`.

mod engines;
mod feeds;
mod gossip;
mod local;
mod members;
pub mod sim;

use crate::membership::{Membership, MeshId};
use bytes::Bytes;
use kvmesh_metrics::Histogram;
use kvmesh_state::{
    Control, Delta, EngineRecord, FeedApply, FeedIn, FeedOut, FeedSnapshot, LoadMap, MarkDelta,
    MarkMap, NodeId, RegistrySet, StateDigest,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

pub use engines::ORPHAN_ENGINES_MAX;
pub use gossip::{DELTAS_PER_ENVELOPE, DIGESTS_PER_PEER_PERIOD};

/// Buckets (seconds) of [`MeshCore::envelope_age`]: 25 µs to 1 s.
pub const ENVELOPE_AGE_BUCKETS: &[f64] = &[
    25e-6, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0,
];

/// How a node behaves (the router's `[serve.mesh]` section fills it).
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// The cluster's id on the wire.
    pub cluster_id: u64,
    /// Outbox flush period (µs) up to 16 routers (see [`MeshCore::flush_period`]).
    pub flush_us: u64,
    /// In-flight changes go out at once, not a whole flush period later, as long as this
    /// router's envelopes stay under one per this long × routers (µs; at most the flush
    /// period) with bursts of `load_burst`: peers hear of a request routed or finished
    /// within the network's delay, not a flush later. 0 = with the flush period.
    pub load_flush_us: u64,
    /// Envelopes in-flight changes may send back to back before `load_flush_us` spaces
    /// them (at least 1); the long-run rate stays one per spacing.
    pub load_burst: u64,
    /// Anti-entropy period (µs).
    pub anti_entropy_us: u64,
    /// Owners reading each engine's KV events (0 = every router).
    pub ingest_replicas: usize,
    /// Speculative marks per engine at most.
    pub mark_capacity: usize,
    /// Blocks per engine a feed holds at most.
    pub feed_capacity: usize,
    /// The lifetimes marks are made with (µs): anti-entropy leaves out the expiry buckets
    /// where the newest marks land (their deltas are in flight, not lost).
    pub mark_ttls_us: Vec<u64>,
    /// Expected cluster size (foca's timings; grows as members join).
    pub expected_size: u32,
    /// A joining node serves without a peer's state after this long (µs).
    pub warm_bound_us: u64,
    /// The node has no seeds: it is the first, warm from the start.
    pub first: bool,
    /// The envelope version this node writes (`kvmesh_state::WIRE_VERSIONS`; it reads all).
    pub wire_version: u8,
    /// A feed snapshot of more blocks goes in parts of this many (version 2 only;
    /// `kvmesh_state::SNAPSHOT_PART_BLOCKS` but in tests, which split small feeds).
    pub snapshot_part_blocks: usize,
}

/// What a leaving node handed over ([`MeshCore::bequeath`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bequeathed {
    /// Engines whose KV events it read.
    pub reads: usize,
    /// Engines whose feed (read, or kept for a handover) it handed over.
    pub engines: usize,
    /// Routers it handed them to.
    pub routers: usize,
}

/// What the router must apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Apply {
    /// A peer's mark (into the local index).
    Mark {
        /// The mark.
        mark: MarkDelta,
        /// It is news: it came in a peer's flush, or it was made within the last moments
        /// (`MeshCore::settle_us`). Otherwise it is an old decision in a transfer of state
        /// (an anti-entropy repair, a joining router's snapshot), possibly one of many.
        live: bool,
    },
    /// The other routers' in-flight on an engine changed.
    PeerLoad {
        /// The engine.
        engine: u64,
        /// Σ of the other routers' entries.
        others: u64,
    },
    /// An engine is in the replicated registry with this record.
    EngineUpsert {
        /// The engine.
        engine: u64,
        /// Its record.
        record: EngineRecord,
    },
    /// An engine was removed from the replicated registry.
    EngineRemoved {
        /// The engine.
        engine: u64,
    },
    /// Precise ops of an engine, versioned (see `kvmesh_state::feeds`).
    Feed(FeedApply),
    /// This router now reads the engine's KV events; `from` is the handover snapshot of
    /// another owner (resume from its `next_seq` with its blocks), or none (start afresh).
    Own {
        /// The engine.
        engine: u64,
        /// The handover.
        from: Option<Box<FeedSnapshot>>,
    },
    /// This router no longer reads the engine's KV events.
    Disown {
        /// The engine.
        engine: u64,
    },
    /// The set of live members changed.
    Members,
    /// The node holds the cluster's state: report ready.
    Warm {
        /// A peer's whole state came in (`false`: the warm-up time passed without one — the
        /// node is alone, or its peers did not answer).
        received: bool,
    },
}

/// What the node wants done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// A SWIM packet (a QUIC datagram).
    Datagram(SocketAddr, Bytes),
    /// An encoded envelope (a unidirectional stream).
    Envelope(SocketAddr, Bytes),
    /// An encoded envelope of in-flight counts only, at most [`LOAD_DATAGRAM_BYTES`]: a
    /// datagram (unreliable — the next change or anti-entropy repairs a lost one), sent as an
    /// [`Output::Envelope`] when no datagram can carry it.
    LoadDatagram(SocketAddr, Bytes),
    /// A change for the router.
    Apply(Apply),
}

/// The largest envelope of in-flight counts sent as a datagram (bytes): under the 1,200-byte
/// QUIC minimum path size less its headers, so that it fits on any path.
pub const LOAD_DATAGRAM_BYTES: usize = 1_100;

/// Counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CoreCounters {
    /// Envelopes sent, received, dropped (undecodable, oversized, other cluster).
    pub envelopes_sent: u64,
    /// See `envelopes_sent`.
    pub envelopes_received: u64,
    /// See `envelopes_sent`.
    pub envelopes_dropped: u64,
    /// Envelope bytes sent and received.
    pub bytes_sent: u64,
    /// See `bytes_sent`.
    pub bytes_received: u64,
    /// Deltas that changed the state.
    pub deltas_applied: u64,
    /// Anti-entropy rounds started.
    pub anti_entropy_rounds: u64,
    /// State parts sent because a peer's digest differed.
    pub repairs: u64,
    /// Engines this node started or stopped reading.
    pub ownership_moves: u64,
    /// Feed pulls sent.
    pub feed_pulls: u64,
    /// Feeds handed to the routers that read their engines next, on leaving (one per feed
    /// and router).
    pub feed_bequests: u64,
    /// Feeds this node took up from a leaving router instead of reading the engine afresh.
    pub bequests_taken: u64,
    /// Parts of feed snapshots too large for one envelope received.
    pub snapshot_parts: u64,
    /// Feed batches this node produced as an owner.
    pub feed_batches: u64,
    /// Speculative marks kept local (their engine's feed is in sync: see
    /// [`MeshCore::local_mark`]).
    pub marks_kept: u64,
    /// Digests not answered: more than [`DIGESTS_PER_PEER_PERIOD`] from one address within an
    /// anti-entropy period.
    pub digests_ignored: u64,
    /// Parts of version 2 envelopes skipped: a kind of delta or control message this build
    /// does not know (a later build's), or bytes that are none.
    pub parts_skipped: u64,
    /// Counts and marks dropped because their engine is not the router's (see the `engines`
    /// module): past [`MeshCore::orphan_grace_us`], or past [`ORPHAN_ENGINES_MAX`] engines.
    pub orphan_entries_dropped: u64,
    /// Deltas refused though well formed: a mark expiring past the horizon (the longest mark
    /// lifetime + [`MARK_CLOCK_ALLOWANCE_US`] from now: only a router whose clock is far
    /// ahead, or a broken one, sends that); a feed's batches, snapshot or head from a router
    /// other than the feed's source (every router sends only its own feeds); a count or mark
    /// of an engine the router does not have while [`ORPHAN_ENGINES_MAX`] such are kept.
    pub deltas_refused: u64,
    /// Engines of the router's config it added to the registry (absent there, or held with
    /// another record: see [`MeshCore::seed_engines`]).
    pub engines_seeded: u64,
    /// Engines of the router's config left as the cluster has them: a config seeded this
    /// record before, and it was removed or changed at run time since.
    pub seeds_superseded: u64,
}

/// How far ahead of this router's clock a peer's clock may be before its marks are refused
/// (they would outlive every lifetime a mark is made with here). NTP keeps routers within a
/// few ms; 10 s leaves room for far worse while a clock a day ahead cannot pin marks in
/// every router's state until their engine goes.
pub const MARK_CLOCK_ALLOWANCE_US: u64 = 10_000_000;

/// Up to this many routers, in-flight changes take the short way: an envelope per change
/// (spaced `load_flush_us` × routers, in bursts of `load_burst`); beyond, they go with the
/// flush period.
const SHORT_WAY_ROUTERS: u64 = 16;

/// Per peer: when its last envelope arrived and how old it was.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerLag {
    /// Cluster time of the last envelope's arrival.
    pub last_us: u64,
    /// Arrival − the sender's send time (includes clock skew).
    pub lag_us: i64,
}

/// The replicated state this node holds.
struct Replicated {
    load: LoadMap,
    marks: MarkMap,
    registry: RegistrySet,
}

/// One mesh node. See the module docs.
pub struct MeshCore {
    cfg: CoreConfig,
    membership: Membership,
    me: NodeId,
    incarnation: u64,
    /// Live members (not this node) by stable id.
    peers: BTreeMap<NodeId, MeshId>,
    st: Replicated,
    outbox: Vec<Delta>,
    /// Per destination: deltas only it needs (feed repairs), sent with the next flush.
    direct: BTreeMap<SocketAddr, (Vec<Delta>, Vec<Control>)>,
    feeds: feeds::Feeds,
    /// The router's engines (see [`MeshCore::set_engines`]); `None` until it says.
    engines: Option<BTreeSet<u64>>,
    /// Engines not the router's with peers' counts or marks here, since when (µs).
    orphans: BTreeMap<u64, u64>,
    /// The router's config engines, added to the registry once warm (`seed_engines`).
    seeds: Vec<(u64, EngineRecord)>,
    /// Warm by the warm-up time, without a peer's state: the seeds wait until the node holds
    /// the cluster's registry (a peer's repair of it, or digests that agree), or they would be
    /// new writes over the cluster's run-time changes once it meets the cluster.
    seeds_wait: bool,
    /// Engines whose registry record the run of registry deltas being received changed: the
    /// router is told each once, what the registry holds after the run (a peer's plant voids
    /// this router's add of the same record in one delta and brings its own in the next:
    /// told one by one, the router would drop the engine and add it back).
    touched: BTreeSet<u64>,
    warm: bool,
    warm_at: u64,
    /// `warm_at` has passed: a node that knows no member is the cluster and reads every
    /// engine (until then it takes none: see `rebalance`).
    alone_over: bool,
    /// This node has handed its feeds over ([`MeshCore::bequeath`]).
    bequeathed: bool,
    /// Feed snapshots arriving in parts.
    parts: kvmesh_state::Assembly,
    /// The latest time an input carried.
    now: u64,
    /// Whole-state envelopes received per sender, and how many it said there are.
    welcome: BTreeMap<NodeId, (u32, Option<u32>)>,
    /// Per peer address: the start of its digest window and the digests answered in it.
    digest_window: BTreeMap<SocketAddr, (u64, u32)>,
    /// Routers gone (or restarted), with when: their load tombstones are kept a while so
    /// that a late delta cannot bring their entries back.
    departed_at: BTreeMap<NodeId, u64>,
    /// Members declared down or gone, not back since (see [`MeshCore::down_members`]).
    down: BTreeMap<NodeId, (MeshId, u64)>,
    /// Names of more than one live router (see [`MeshCore::name_conflicts`]).
    conflicts: BTreeMap<String, (BTreeSet<SocketAddr>, u64)>,
    next_flush: u64,
    /// The envelope rate's theoretical arrival time (µs, the generic cell rate algorithm):
    /// each flush that sends the members an envelope moves it one
    /// [`MeshCore::load_flush_spacing`] past `max(it, now)`; an in-flight change flushes once
    /// it is at most `load_burst - 1` spacings ahead of now (up to 16 routers; beyond, 0).
    load_tat: u64,
    /// Whether an in-flight change waits in the outbox.
    load_news: bool,
    next_ae: u64,
    rng: u64,
    lag: BTreeMap<NodeId, PeerLag>,
    out: Vec<Output>,
    counters: CoreCounters,
    envelope_age: Arc<Histogram>,
}

impl MeshCore {
    /// A node of identity `id` (its name gives the stable id, its bump the incarnation).
    pub fn new(id: MeshId, cfg: CoreConfig, seed: u64, now_us: u64) -> MeshCore {
        let me = NodeId::from_name(&id.name);
        let incarnation = id.bump;
        let membership = Membership::new(id, cfg.expected_size, seed);
        let warm = cfg.first;
        MeshCore {
            feeds: feeds::Feeds::new(me, incarnation, cfg.ingest_replicas, cfg.feed_capacity),
            st: Replicated {
                load: LoadMap::new(),
                marks: MarkMap::new(cfg.mark_capacity),
                registry: RegistrySet::new(),
            },
            warm_at: now_us.saturating_add(cfg.warm_bound_us),
            alone_over: false,
            bequeathed: false,
            parts: kvmesh_state::Assembly::new(cfg.feed_capacity.saturating_mul(2)),
            next_flush: now_us.saturating_add(cfg.flush_us),
            load_tat: now_us,
            load_news: false,
            next_ae: now_us.saturating_add(cfg.anti_entropy_us),
            cfg,
            membership,
            me,
            incarnation,
            peers: BTreeMap::new(),
            outbox: Vec::new(),
            direct: BTreeMap::new(),
            engines: None,
            orphans: BTreeMap::new(),
            seeds: Vec::new(),
            // Without seeds it is warm at once (nobody to wait for), but its config's engines
            // still wait for the cluster's registry: a first router restarted into a running
            // cluster must not plant them as new writes over the run-time changes there.
            seeds_wait: warm,
            touched: BTreeSet::new(),
            warm,
            now: now_us,
            welcome: BTreeMap::new(),
            departed_at: BTreeMap::new(),
            down: BTreeMap::new(),
            conflicts: BTreeMap::new(),
            digest_window: BTreeMap::new(),
            rng: seed | 1,
            lag: BTreeMap::new(),
            out: Vec::new(),
            counters: CoreCounters::default(),
            envelope_age: Arc::new(Histogram::new(ENVELOPE_AGE_BUCKETS)),
        }
    }

    /// This node's stable id.
    pub fn id(&self) -> NodeId {
        self.me
    }

    /// This node's membership identity.
    pub fn identity(&self) -> &MeshId {
        self.membership.identity()
    }

    /// The live members (not this node).
    pub fn members(&self) -> impl Iterator<Item = &MeshId> {
        self.peers.values()
    }

    /// Holds the cluster's state (see the module docs).
    pub fn is_warm(&self) -> bool {
        self.warm
    }

    /// Ages of the envelopes received from peers, at their handling here (the sender's clock
    /// at sending against this node's): how late peers' counts and marks arrive. Shared, so
    /// that it can be read without the node.
    pub fn envelope_age(&self) -> &Arc<Histogram> {
        &self.envelope_age
    }

    /// Routers reading each engine's events, as this router counts them (0 = every router).
    pub fn ingest_replicas(&self) -> usize {
        self.cfg.ingest_replicas
    }

    /// Counters.
    pub fn counters(&self) -> &CoreCounters {
        &self.counters
    }

    /// Per live peer: its last envelope's arrival and lag.
    pub fn lags(&self) -> impl Iterator<Item = (&MeshId, PeerLag)> {
        self.peers
            .iter()
            .map(|(n, m)| (m, self.lag.get(n).copied().unwrap_or_default()))
    }

    /// SWIM packets or timers the membership refused.
    pub fn membership_errors(&self) -> u64 {
        self.membership.errors()
    }

    /// What the membership holds of the member at `addr` (see `Membership::state_of`).
    pub fn membership_state_of(&self, addr: SocketAddr) -> Option<(MeshId, u16, &'static str)> {
        self.membership.state_of(addr)
    }

    /// The digests of the replicated state (expired marks dropped first; marks that lapse
    /// within the next whole second left out: see `MarkMap::digest_beyond`).
    pub fn digest(&mut self, now_us: u64) -> StateDigest {
        self.st.marks.expire(now_us);
        StateDigest {
            load: self.st.load.digest(),
            marks: self.st.marks.digest_beyond(now_us),
            registry: self.st.registry.digest(),
        }
    }

    /// Entries held: (load, marks, registry adds + context intervals, feed blocks).
    pub fn sizes(&self) -> (usize, usize, usize, usize) {
        (
            self.st.load.len(),
            self.st.marks.len(),
            self.st.registry.adds() + self.st.registry.context_len(),
            self.feeds.blocks() + self.parts.blocks(),
        )
    }

    /// The owners of an engine's KV events in this node's view, best first.
    pub fn owners(&self, engine: u64) -> Vec<NodeId> {
        self.feeds.owners_of(engine, &self.live_ids())
    }

    /// Engines whose events this node reads.
    pub fn owned(&self) -> impl Iterator<Item = u64> + '_ {
        self.feeds.owned()
    }

    /// Per engine with events: the feed followed, whether synced and stale.
    pub fn feed_status(&self, engine: u64) -> Option<&FeedIn> {
        self.feeds.feed_in(engine)
    }

    /// The members suspected of being down (see `Membership::suspects`).
    pub fn suspects(&self) -> BTreeSet<NodeId> {
        self.membership
            .suspects()
            .map(|m| NodeId::from_name(&m.name))
            .collect()
    }

    /// Whether the engine's feed followed here is live (`suspects`: [`MeshCore::suspects`]):
    /// followed, not stale, and from a source not suspected of being down. A source killed
    /// sends nothing more, and its followers switch to another owner only once it is
    /// declared down (seconds later); meanwhile the engine counts as one whose events are
    /// stale: shown so, and this router's decisions on it are remembered for the approximate
    /// TTL. The blocks already indexed are kept (a router's death does not change an
    /// engine's cache), so a change of the engine's cache in that window is seen only once
    /// the next owner's feed is followed.
    pub fn feed_live(&self, engine: u64, suspects: &BTreeSet<NodeId>) -> bool {
        self.feeds.feed_in(engine).is_some_and(|f| {
            f.feed().is_some_and(|id| !suspects.contains(&id.source)) && !f.is_stale()
        })
    }

    /// The outputs accumulated since the last call.
    pub fn take_outputs(&mut self) -> Vec<Output> {
        self.drain_membership();
        std::mem::take(&mut self.out)
    }

    /// The outbox's period: `flush_us` up to 16 routers, then growing with the cluster (each
    /// flush is an envelope to every member: a router sends about 16 / `flush_us` of them
    /// whatever the size, and the delay grows only past 16 routers).
    pub fn flush_period(&self) -> u64 {
        let n = self.peers.len() as u64 + 1;
        self.cfg.flush_us.saturating_mul(n.div_ceil(16).max(1))
    }

    /// The spacing of envelopes that in-flight changes keep to over time (µs; bursts of
    /// `load_burst` go at once): `load_flush_us` × routers up to 16 routers (a router's
    /// envelope rate stays about `1 / load_flush_us` per second), at most the flush period.
    /// Beyond 16 routers, the flush period: there each router holds a small share of an
    /// engine's load, and an envelope per change to every member would multiply the bytes
    /// (at 128 routers and 10k requests/s, about one envelope per change instead of one per
    /// 160 ms).
    pub fn load_flush_spacing(&self) -> u64 {
        let n = self.peers.len() as u64 + 1;
        let period = self.flush_period();
        match self.cfg.load_flush_us {
            0 => period,
            _ if n > SHORT_WAY_ROUTERS => period,
            us => us.saturating_mul(n).min(period),
        }
    }

    /// When a waiting in-flight change may go (µs): at once while this router's envelopes
    /// are under the rate of one per [`MeshCore::load_flush_spacing`] with bursts of
    /// `load_burst` (completions come in bursts: an engine ends several requests in one
    /// decode step, and their clients' next turns arrive together at other routers); with
    /// the flush period when `load_flush_us` is 0. Beyond 16 routers there are no bursts
    /// (changes go with the flush period's spacing, as the short way is for small clusters):
    /// at 128 routers, bursts of 8 slowed the agreement after a partition heals from 1.6 to
    /// 2.3–2.6 s (`mesh_scale`, seeds 2 and 3).
    fn load_due(&self) -> u64 {
        if self.cfg.load_flush_us == 0 {
            return self.next_flush;
        }
        let burst = if self.peers.len() as u64 + 1 > SHORT_WAY_ROUTERS {
            1
        } else {
            self.cfg.load_burst.max(1)
        };
        let slack = self.load_flush_spacing().saturating_mul(burst - 1);
        self.load_tat.saturating_sub(slack)
    }

    /// When [`MeshCore::tick`] wants to run next (µs).
    pub fn next_due(&self) -> u64 {
        let mut t = self.next_flush.min(self.next_ae);
        if self.load_news {
            t = t.min(self.load_due());
        }
        if let Some(m) = self.membership.next_due() {
            t = t.min(m);
        }
        if !self.warm {
            t = t.min(self.warm_at);
        }
        if !self.alone_over {
            t = t.min(self.warm_at);
        }
        t
    }

    // ---- inputs ------------------------------------------------------------------------

    /// Asks `seed` to let this node in.
    pub fn announce(&mut self, seed: SocketAddr, now_us: u64) {
        self.at(now_us);
        self.membership.announce(seed, now_us);
    }

    /// Writes version 1 envelopes (`serve.mesh.wire_version`), which carry no bequests.
    pub fn writes_version_1(&self) -> bool {
        self.cfg.wire_version < 2
    }

    /// Knows no live member (the shell asks its seeds again).
    pub fn is_alone(&self) -> bool {
        self.peers.is_empty()
    }

    /// A SWIM datagram from the network.
    pub fn handle_datagram(&mut self, data: &[u8], now_us: u64) {
        self.at(now_us);
        self.membership.handle_data(data, now_us);
        self.drain_membership();
    }

    /// A new connection with `from` (the transport closes one silent for a while, so after a
    /// partition too short for SWIM to declare anyone down the link comes back as a new
    /// connection): if it is a member, the two meet as after a join — digests compared at
    /// once, the newest marks included, the heads of the feeds this node owns sent.
    pub fn peer_connected(&mut self, from: SocketAddr, now_us: u64) {
        self.at(now_us);
        let Some(id) = self
            .peers
            .iter()
            .find(|(_, m)| m.addr == from)
            .map(|(n, _)| *n)
        else {
            return;
        };
        self.meet(&BTreeSet::from([id]), now_us);
    }

    /// An envelope from the network (hostile bytes: bounded, never panics, counted). Bytes
    /// that do not decode are dropped and their error returned (the shell says it: a peer of
    /// another build whose mesh format differs sends such envelopes).
    pub fn handle_envelope(
        &mut self,
        from: SocketAddr,
        bytes: &[u8],
        now_us: u64,
    ) -> Result<(), kvmesh_state::WireError> {
        self.at(now_us);
        let env = match kvmesh_state::decode_counting(bytes, self.cfg.cluster_id) {
            Ok((e, skipped)) => {
                self.counters.parts_skipped += skipped as u64;
                e
            }
            Err(e) => {
                self.counters.envelopes_dropped += 1;
                return Err(e);
            }
        };
        self.counters.envelopes_received += 1;
        self.counters.bytes_received += bytes.len() as u64;
        if env.from == self.me {
            return Ok(());
        }
        // The sender's clock is its own (and its bytes hostile): any difference, clamped.
        let lag_us = (i128::from(now_us) - i128::from(env.sent_us))
            .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        // A negative age (clock skew) counts as 0.
        self.envelope_age
            .observe_us(u64::try_from(lag_us).unwrap_or(0));
        // Kept for members only (a sender's id is its word: strangers' would pile up).
        if self.peers.contains_key(&env.from) {
            self.lag.insert(
                env.from,
                PeerLag {
                    last_us: now_us,
                    lag_us,
                },
            );
        }
        let live = !env.kind.is_transfer();
        let registry_repair = env.kind == kvmesh_state::EnvelopeKind::Repair
            && env.deltas.iter().any(|d| matches!(d, Delta::Registry(_)));
        for d in env.deltas {
            // A run of registry deltas is told as one; what follows it (an engine's marks,
            // its feed) finds the router told of the engine.
            if !matches!(d, Delta::Registry(_) | Delta::Planted(_)) {
                self.tell_touched();
            }
            self.merge(env.from, d, live, now_us);
        }
        self.tell_touched();
        if registry_repair {
            // A peer sent its registry (its digest differed): the cluster's is here now.
            self.plant_waiting_seeds(now_us);
        }
        if env.kind == kvmesh_state::EnvelopeKind::Snapshot && !self.warm {
            let w = self.welcome.entry(env.from).or_insert((0, None));
            w.0 += 1;
            for c in &env.control {
                if let Control::WholeState { chunks } = c {
                    w.1 = Some(*chunks);
                }
            }
            // Warm once every envelope of a peer's whole state is in (streams may arrive in
            // any order).
            if w.1.is_some_and(|total| w.0 >= total) {
                self.warm = true;
                self.welcome.clear();
                self.plant_seeds(now_us);
                self.out.push(Output::Apply(Apply::Warm { received: true }));
            }
        }
        for c in env.control {
            self.control(from, env.from, c, now_us);
        }
        Ok(())
    }

    /// Runs what is due at `now_us`: membership timers, the flush, anti-entropy.
    pub fn tick(&mut self, now_us: u64) {
        self.at(now_us);
        self.membership.advance(now_us);
        self.drain_membership();
        if !self.warm && now_us >= self.warm_at {
            self.warm = true;
            // It serves with its config's engines meanwhile (the router has them from its
            // start); they enter the registry once it holds the cluster's.
            self.seeds_wait = true;
            self.out
                .push(Output::Apply(Apply::Warm { received: false }));
        }
        if !self.alone_over && now_us >= self.warm_at {
            self.alone_over = true;
            // Alone until now, it owned nothing (see `rebalance`): it takes its engines.
            self.rebalance(now_us);
        }
        if self.feeds.waits_for_handovers() {
            let live = self.live();
            let mut applies = Vec::new();
            self.feeds.expire_handovers(now_us, &live, &mut applies);
            self.counters.ownership_moves += applies
                .iter()
                .filter(|a| matches!(a, Apply::Own { .. }))
                .count() as u64;
            self.out.extend(applies.into_iter().map(Output::Apply));
        }
        if now_us >= self.next_flush {
            self.next_flush = now_us + self.flush_period();
            self.flush(now_us);
        } else if self.load_news && now_us >= self.load_due() {
            self.flush(now_us);
        }
        if now_us >= self.next_ae {
            self.next_ae = now_us + self.cfg.anti_entropy_us;
            self.anti_entropy(now_us);
        }
    }

    /// Hands every feed this node reads to the routers that will read its engine once this
    /// node is gone (see `Feeds::bequeath`), sent at once: what a router does before it
    /// leaves. The shell waits for those envelopes to be delivered before it sends the leave,
    /// so that a router that comes to own the engine has the feed when it learns of it (it
    /// takes it up either way). Once: returns what it handed over, nothing the second time.
    pub fn bequeath(&mut self, now_us: u64) -> Bequeathed {
        if std::mem::replace(&mut self.bequeathed, true) {
            return Bequeathed::default();
        }
        let mut b = Bequeathed {
            reads: self.feeds.owned().count(),
            ..Bequeathed::default()
        };
        self.at(now_us);
        // Version 1 envelopes carry no bequests (the builds before them read only those).
        if self.writes_version_1() {
            return b;
        }
        let live = self.live();
        let (mut engines, mut routers) = (BTreeSet::new(), BTreeSet::new());
        for (to, d) in self.feeds.bequeath(&live) {
            if let Some(m) = self.peers.get(&to) {
                self.counters.feed_bequests += 1;
                if let Delta::Bequest(s) = &d {
                    engines.insert(s.engine);
                }
                routers.insert(to);
                self.direct.entry(m.addr).or_default().0.push(d);
            }
        }
        (b.engines, b.routers) = (engines.len(), routers.len());
        self.flush(now_us);
        b
    }

    /// Leaves the cluster (the others see it at once), its feeds bequeathed first (unless
    /// already).
    pub fn leave(&mut self, now_us: u64) {
        self.bequeath(now_us);
        self.at(now_us);
        self.flush(now_us);
        self.membership.leave(now_us);
        self.drain_membership();
    }

    // ---- internals ---------------------------------------------------------------------

    fn live_ids(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self.peers.keys().copied().collect();
        v.push(self.me);
        v
    }

    fn live(&self) -> Vec<feeds::Live> {
        let mut v: Vec<feeds::Live> = self.peers.iter().map(|(n, m)| (*n, m.bump)).collect();
        v.push((self.me, self.incarnation));
        v
    }

    fn at(&mut self, now_us: u64) {
        self.now = self.now.max(now_us);
    }

    fn next_rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// Test and bench hook: the feed side's own view (engines followed and their feeds).
    pub fn feeds_followed(&self) -> HashMap<u64, Option<kvmesh_state::FeedId>> {
        self.feeds.followed()
    }

    /// Test and bench hook: an owner's feed of an engine.
    pub fn feed_out(&self, engine: u64) -> Option<&FeedOut> {
        self.feeds.feed_out(engine)
    }
}
