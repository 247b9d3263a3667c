//! The mesh in the router: a thin adapter between the gateway and the mesh node
//! (`kvmesh_mesh::node`, a tokio driver of the sans-IO `MeshCore`).
//!
//! * In: this router's speculative marks (an index sink on the request path: a `try_send`,
//!   never a wait), admin engine changes, the set of engines with KV events, and — for the
//!   engines this router owns — the ops its ingestion derives from their events. Its in-flight
//!   count per engine takes the short way ([`LoadLink`]): the engine signals the node's task,
//!   which reads the count itself.
//! * Out: the other routers' in-flight and their marks onto the engines and the index by the
//!   short way too, set by the node's thread in the order each peer made them (policies read
//!   own + peers'; a mark for an engine not known here yet, and the old marks of a repair or
//!   a joining router's snapshot, take the long way); applied in
//!   order by this router's task: engines added or removed through a peer, every
//!   engine's precise ops from its owner's feed into the index (versioned: applied once, in
//!   order; a snapshot replaces the engine's blocks), ownership moves (start or stop reading
//!   an engine, resuming from the previous owner's handover), readiness.
//!
//! No routing decision waits for any of it: decisions read the local index and atomics only.

use crate::engine::Source;
use crate::gateway::{Gateway, MeshHook};
use crate::{ingest, probe};
use kvmesh_config::{EngineEntry, MeshConfig};
use kvmesh_mesh::core::{Apply, CoreConfig, MeshCore};
use kvmesh_mesh::membership::{MeshId, rank_among};
use kvmesh_mesh::node::{Input, LoadLink, MeshNode, NowFn, Seeds};
use kvmesh_mesh::tls_watch::TlsWatch;
use kvmesh_mesh::transport::Transport;
use kvmesh_metrics::Histogram;
use kvmesh_policy::RouterSlot;
use kvmesh_prefix::{BlockKey, EngineId, IndexOp, IndexSink, OpVersion, Target};
use kvmesh_state::{EngineRecord, MarkDelta, NodeId, WireOp};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::mpsc;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The other routers' total in flight on an engine (ignored for an engine not known here).
fn set_peer_load(gw: &Gateway, engine: u64, others: u64) {
    if let Some(e) = gw.registry.get(EngineId(engine)) {
        e.peer_in_flight
            .store(u32::try_from(others).unwrap_or(u32::MAX), Relaxed);
    }
}

/// A peer's mark into the index; `false` when the engine is not known here (yet).
fn apply_mark(gw: &Gateway, m: &MarkDelta) -> bool {
    let Some(e) = gw.registry.get(EngineId(m.engine)) else {
        return false;
    };
    let keys: Vec<BlockKey> = m.keys.iter().map(|k| BlockKey(*k)).collect();
    gw.registry
        .prefix
        .remote_mark(e.target(), &keys, m.expiry_us, gw.clock.now_us());
    true
}

/// This router's part in the mesh.
pub struct Cluster {
    me: NodeId,
    name: String,
    node: Mutex<Option<MeshNode>>,
    core: Arc<Mutex<MeshCore>>,
    input: mpsc::Sender<Input>,
    members: tokio::sync::watch::Receiver<Vec<MeshId>>,
    transport: Arc<Transport>,
    /// Ages of the envelopes received (the node's histogram, read without locking it).
    envelope_age: Arc<Histogram>,
    /// Holds the cluster's state; `/health` says ready only then.
    warm: AtomicBool,
    /// Marks not sent because the mesh's input was full (anti-entropy repairs them).
    dropped_marks: Arc<AtomicU64>,
    /// The node's thread runs at real-time priority (`mesh.realtime_priority` granted).
    realtime: bool,
    /// The envelope version this router writes (`mesh.wire_version`).
    wire_version: u8,
    /// Engines of the cluster's registry this router refuses as its own address (a peer's
    /// admin API took the router for an engine). The peers route to them, so the node is
    /// told them as the router's engines: it keeps and passes on their counts as any
    /// engine's, where it would drop them as an orphan's every ten anti-entropy periods and
    /// be repaired (QA26: load digests apart for over 70 s, repairs rising).
    own_address_engines: Mutex<BTreeSet<u64>>,
    now: NowFn,
}

// The mesh names a mark by the top key of each anchor window it covers; the index lets such a
// key vouch for its window. Both must mean the same windows (the two pure crates do not depend
// on each other, so each has its `window_top`; the test below holds them equal).
const _: () = assert!(kvmesh_state::MARK_WINDOW == kvmesh_prefix::ANCHOR_STRIDE);
// `serve.mesh.wire_version` is checked against 1..=2 in the config crate (which does not
// depend on the state crate): the versions this build writes.
const _: () =
    assert!(*kvmesh_state::WIRE_VERSIONS.start() == 1 && *kvmesh_state::WIRE_VERSIONS.end() == 2);

/// The index sink that tells the mesh of this router's marks (the KV-event batches go to
/// the mesh from the ingestion of the engines this router owns).
struct Outbox {
    input: mpsc::Sender<Input>,
    dropped: Arc<AtomicU64>,
}

impl IndexSink for Outbox {
    fn apply_batch(&mut self, _: Target, _: OpVersion, _: &[IndexOp]) -> bool {
        true
    }

    fn mark(&mut self, t: Target, keys: &[BlockKey], known: usize, expiry_us: u64, _now_us: u64) {
        // Speculative marks of engines whose events are read travel too: until the engine has
        // computed a new prompt (its events come after the prefill), they are how siblings
        // arriving at other routers find it.
        let m = Input::Mark {
            engine: t.engine.0,
            keys: keys.iter().map(|k| k.0).collect(),
            known: known.min(keys.len()) as u32,
            expiry_us,
        };
        if self.input.try_send(m).is_err() {
            self.dropped.fetch_add(1, Relaxed);
        }
    }

    fn clear(&mut self, _: Target) {}
}

/// A peer's engine as this router's entry: checked as the admin API checks one (a peer's
/// record is its word: its weight may be 0, its URL anything), and its id must be its URL's
/// (as every router derives it), or the engine would never be found under it.
fn peer_entry(engine: u64, record: &EngineRecord) -> Result<EngineEntry, String> {
    let entry = EngineEntry {
        url: record.url.clone(),
        weight: f64::from(record.weight_milli) / 1000.0,
        kv_events: record.kv_events.clone(),
        kv_replay: record.kv_replay.clone(),
        models: record.models.clone(),
    };
    entry
        .validate("engine from a peer")
        .map_err(|e| e.to_string())?;
    // Builds before URLs had one spelling could send another (`http://LOCALHOST:09101`):
    // this router would keep it under the id of its own spelling, which no peer knows.
    if kvmesh_config::canonical_base_url(&entry.url) != entry.url {
        return Err(format!(
            "engine from a peer: {} is not spelt as this build spells it (lower case, the port as a number)",
            entry.url
        ));
    }
    if EngineId::from_url(&entry.url).0 != engine {
        return Err(format!(
            "engine from a peer: id {engine:016x} is not that of {}",
            entry.url
        ));
    }
    Ok(entry)
}

/// A peer's record of an engine: added if this router lacks it; else its weight taken (any
/// router's admin API or config sets the cluster's). Its endpoints and models are each
/// router's own once it has the engine: a difference is logged, not applied (the admin
/// API removes and adds an engine to change them).
fn upsert(gw: &Arc<Gateway>, engine: u64, record: &EngineRecord) -> bool {
    let entry = match peer_entry(engine, record) {
        Ok(e) => e,
        Err(err) => {
            tracing::warn!(error = %err, "engine from a peer refused");
            return false;
        }
    };
    if let Some(e) = gw.registry.get(EngineId(engine)) {
        let before = e.base_weight();
        gw.registry.set_weight(e.id, entry.weight);
        if e.base_weight() != before {
            tracing::info!(engine = %e.url, from = before, to = e.base_weight(), "engine weight set by the cluster");
        }
        if (&e.kv_events, &e.kv_replay, &e.static_models)
            != (&entry.kv_events, &entry.kv_replay, &entry.models)
        {
            tracing::warn!(engine = %e.url, kv_events = %entry.kv_events, kv_replay = %entry.kv_replay, models = ?entry.models, "the cluster's record of this engine has other endpoints or models than this router's: this router keeps its own");
        }
        return false;
    }
    match probe::add_engine(gw, &entry, Source::Mesh, true) {
        Ok(e) => {
            tracing::info!(engine = %e.url, "engine added by a peer");
            let g = gw.clone();
            tokio::spawn(async move { probe::discover(&g, &e).await });
            true
        }
        Err(err) => {
            tracing::warn!(error = %err, "engine from a peer refused");
            false
        }
    }
}

/// Spellings of this router's own address kept as engines of its node, at most (each is an
/// engine id; a member cannot grow the set without bound).
const OWN_ADDRESS_ENGINES_MAX: usize = 16;

/// Whether a peer's record of `engine` is well formed and names this router's own address.
fn is_own_address(gw: &Gateway, engine: u64, record: &EngineRecord) -> bool {
    peer_entry(engine, record).is_ok() && gw.registry.refuse_own_address(&record.url).is_err()
}

fn record(entry: &EngineEntry) -> EngineRecord {
    EngineRecord {
        url: kvmesh_config::canonical_base_url(&entry.url),
        weight_milli: kvmesh_config::weight_milli(entry.weight),
        kv_events: entry.kv_events.clone(),
        kv_replay: entry.kv_replay.clone(),
        models: entry.models.clone(),
    }
}

impl Cluster {
    /// Joins the mesh as `cfg` says and starts its tasks in the gateway's task set.
    pub async fn start(gw: &Arc<Gateway>, cfg: &MeshConfig) -> Result<Arc<Cluster>, String> {
        let pair = if cfg.cert_name.is_empty() {
            &cfg.node_id
        } else {
            &cfg.cert_name
        };
        let (watch, tls) = TlsWatch::new(Path::new(&cfg.tls_dir), pair, &cfg.node_id);
        // Named as `--check-config` names it (QA33: start-up said only the file).
        let tls = tls.map_err(|e| format!("serve.mesh.tls_dir {}: {e}", cfg.tls_dir))?;
        let listen: SocketAddr = cfg
            .listen
            .parse()
            .map_err(|e| format!("serve.mesh.listen {}: {e}", cfg.listen))?;
        let seeds = Seeds {
            addrs: cfg.seeds.clone(),
            dns: (!cfg.seed_dns.is_empty()).then(|| cfg.seed_dns.clone()),
        };
        let cap = gw.cfg.prefix.engine_capacity_blocks as usize;
        let core_cfg = CoreConfig {
            cluster_id: kvmesh_mesh::transport::cluster_id(&cfg.cluster_id),
            flush_us: cfg.flush_ms * 1_000,
            load_flush_us: cfg.load_flush_us,
            load_burst: u64::from(cfg.load_burst),
            anti_entropy_us: cfg.anti_entropy_ms * 1_000,
            ingest_replicas: cfg.ingest_replicas as usize,
            mark_capacity: cap,
            feed_capacity: cap,
            mark_ttls_us: vec![
                gw.cfg.prefix.speculative_ttl_ms * 1_000,
                gw.cfg.prefix.approximate_ttl_ms * 1_000,
            ],
            expected_size: cfg.expected_routers,
            warm_bound_us: cfg.anti_entropy_ms * 5_000,
            wire_version: cfg.wire_version,
            snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
            first: cfg.seeds.is_empty() && cfg.seed_dns.is_empty(),
        };
        let clock = gw.clock;
        let now: NowFn = Arc::new(move || clock.now_us());
        let link = gw.registry.load_signal.connect().map(|changed| {
            let (g1, g2, g3) = (Arc::downgrade(gw), Arc::downgrade(gw), Arc::downgrade(gw));
            LoadLink {
                changed,
                read: Arc::new(move |id| {
                    let e = g1.upgrade()?.registry.get(EngineId(id))?;
                    Some(e.read_load_change())
                }) as Arc<dyn Fn(u64) -> Option<u32> + Send + Sync>,
                peers: Arc::new(move |id, others| {
                    if let Some(g) = g2.upgrade() {
                        set_peer_load(&g, id, others);
                    }
                }),
                // A router gone has nothing to apply: taken as done.
                marks: Arc::new(move |m| g3.upgrade().is_none_or(|g| apply_mark(&g, m))),
            }
        });
        let (node, applies) = MeshNode::start(
            &cfg.node_id,
            listen,
            &tls,
            seeds,
            core_cfg,
            now.clone(),
            link,
            cfg.realtime_priority,
        )
        .await
        .map_err(|e| format!("mesh: {e}"))?;
        let realtime = node.realtime;
        gw.registry.set_mesh_realtime(realtime);
        let dropped = Arc::new(AtomicU64::new(0));
        let (warm, envelope_age) = {
            let core = lock(&node.core);
            (core.is_warm(), core.envelope_age().clone())
        };
        let c = Arc::new(Cluster {
            me: NodeId::from_name(&cfg.node_id),
            name: cfg.node_id.clone(),
            core: node.core.clone(),
            input: node.input.clone(),
            members: node.members.clone(),
            transport: node.transport.clone(),
            envelope_age,
            node: Mutex::new(Some(node)),
            warm: AtomicBool::new(warm),
            dropped_marks: dropped.clone(),
            realtime,
            wire_version: cfg.wire_version,
            own_address_engines: Mutex::new(BTreeSet::new()),
            now,
        });
        gw.registry.prefix.set_delta_sink(Some(Box::new(Outbox {
            input: c.input.clone(),
            dropped,
        })));
        let _ = gw.mesh.set(c.clone());
        // The engines of this router's config seed the cluster's registry once it holds it.
        let seeds: Vec<(u64, EngineRecord)> = gw
            .registry
            .members()
            .iter()
            .filter(|e| e.source == Source::Static)
            .map(|e| (e.id.0, record(&e.entry())))
            .collect();
        c.input
            .send(Input::SeedEngines(seeds))
            .await
            .map_err(|_| "mesh: the node stopped at its start".to_string())?;
        tracing::info!(node = %cfg.node_id, addr = %c.addr().map(|a| a.to_string()).unwrap_or_default(), "mesh node started: joining through its seeds (see /admin/cluster for its members)");
        let flush = Duration::from_millis(cfg.flush_ms);
        let (g, cl) = (gw.clone(), c.clone());
        gw.tasks.spawn(async move { cl.local_loop(g, flush).await });
        let (g, cl) = (gw.clone(), c.clone());
        gw.tasks
            .spawn(async move { cl.apply_loop(g, applies).await });
        let (g, cl) = (gw.clone(), c.clone());
        gw.tasks.spawn(async move { cl.slot_loop(g).await });
        if cfg.tls_reload_ms > 0 {
            let (cl, every) = (c.clone(), Duration::from_millis(cfg.tls_reload_ms));
            gw.tasks
                .spawn(async move { cl.tls_loop(watch, every).await });
        }
        Ok(c)
    }

    /// Every `every`: the certificate files again, taken when they changed (a renewed pair,
    /// a CA rotation); files that do not load are said once and change nothing.
    async fn tls_loop(self: Arc<Self>, mut watch: TlsWatch, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(loaded) = watch.check() else {
                continue;
            };
            let taken = loaded.map_err(|e| e.to_string()).and_then(|tls| {
                let cas = tls.cas.len();
                self.transport
                    .reload_tls(&tls)
                    .map(|changed| (cas, changed))
                    .map_err(|e| e.to_string())
            });
            match taken {
                Ok((cas, changed)) => tracing::info!(
                    cas,
                    trusted_changed = changed,
                    "mesh certificates reloaded{}",
                    if changed {
                        "; connections closed, each peer is verified again"
                    } else {
                        ""
                    }
                ),
                Err(error) => {
                    let c = self.transport.counters();
                    c.tls_reload_failures.fetch_add(1, Relaxed);
                    tracing::warn!(
                        error,
                        "mesh certificate files changed but are not usable: keeping the ones loaded before"
                    );
                }
            }
        }
    }

    /// This router holds the cluster's state (see [`Cluster::warm`]).
    pub fn is_warm(&self) -> bool {
        self.warm.load(Relaxed)
    }

    /// The live members (not this router).
    pub fn members(&self) -> Vec<MeshId> {
        self.members.borrow().clone()
    }

    /// The engines the mesh state holds peers' counts or marks of (this router's among them).
    pub fn held_engines(&self) -> BTreeSet<u64> {
        lock(&self.core).held_engines()
    }

    /// Digests of the replicated state (load, marks, registry): equal on routers that agree.
    pub fn digests(&self) -> (u64, u64, u64) {
        let now = (self.now)();
        let d = lock(&self.core).digest(now);
        (d.load, d.marks, d.registry)
    }

    /// Ages of the envelopes received from peers (see [`MeshCore::envelope_age`]).
    pub fn envelope_age(&self) -> &Arc<Histogram> {
        &self.envelope_age
    }

    /// The mesh transport's counters (bytes by class, handshakes refused, certificate
    /// reloads).
    pub fn transport_counters(&self) -> &kvmesh_mesh::transport::Counters {
        self.transport.counters()
    }

    /// This router's mesh address.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.transport.local_addr().ok()
    }

    /// Leaves the mesh (the others see it at once).
    pub async fn leave(&self) {
        let node = lock(&self.node).take();
        if let Some(n) = node {
            n.leave().await;
        }
    }

    /// Every `every`: the engines, and those with KV events, when they changed, and whether
    /// each engine's feed is live here.
    async fn local_loop(self: Arc<Self>, gw: Arc<Gateway>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut told: Option<(BTreeSet<u64>, BTreeSet<u64>)> = None;
        let mut conflicts_warned: Option<std::time::Instant> = None;
        loop {
            tick.tick().await;
            self.warn_name_conflicts(&mut conflicts_warned);
            let members = gw.registry.members();
            let mut all: BTreeSet<u64> = members.iter().map(|e| e.id.0).collect();
            all.extend(lock(&self.own_address_engines).iter().copied());
            let events: BTreeSet<u64> = members
                .iter()
                .filter(|e| !e.kv_events.is_empty())
                .map(|e| e.id.0)
                .collect();
            if told.as_ref().is_none_or(|(a, e)| *a != all || *e != events) {
                told = Some((all.clone(), events.clone()));
                if self
                    .input
                    .send(Input::Engines { all, events })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            // Engines read elsewhere: routed precisely only while their feed is synced here,
            // from a source not suspected of being down.
            {
                let core = lock(&self.core);
                let suspects = core.suspects();
                for e in &members {
                    if e.kv_events.is_empty() {
                        continue;
                    }
                    let live = core.feed_live(e.id.0, &suspects);
                    e.ingest.mesh_live.store(live, Relaxed);
                }
            }
        }
    }

    /// Warns (at most once a minute) while two live routers have had one name for 10 s or
    /// more: longer than a restart on another address takes to resolve.
    fn warn_name_conflicts(&self, warned: &mut Option<std::time::Instant>) {
        if warned.is_some_and(|w| w.elapsed() < Duration::from_secs(60)) {
            return;
        }
        let now = (self.now)();
        let lasting: Vec<String> = lock(&self.core)
            .name_conflicts()
            .filter(|(_, (_, since))| now.saturating_sub(*since) >= 10_000_000)
            .map(|(name, (addrs, _))| {
                let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
                format!("{name} at {}", addrs.join(" and "))
            })
            .collect();
        if !lasting.is_empty() {
            *warned = Some(std::time::Instant::now());
            tracing::error!(routers = %lasting.join("; "), "two live routers have one node id: give each router its own --node-id (the mesh's state takes them for one router)");
        }
    }

    /// Keeps the registry told where this router stands among the live routers (its rank by
    /// name), which `least_request` splits ties by.
    async fn slot_loop(self: Arc<Self>, gw: Arc<Gateway>) {
        let mut members = self.members.clone();
        loop {
            let (rank, routers) = rank_among(&self.name, members.borrow_and_update().iter());
            gw.registry.set_router_slot(RouterSlot { rank, routers });
            if members.changed().await.is_err() {
                return;
            }
        }
    }

    /// Keeps `engine` among the node's engines if its record names this router's address.
    fn note_own_address(&self, gw: &Gateway, engine: u64, record: &EngineRecord) {
        let mut own = lock(&self.own_address_engines);
        if own.len() < OWN_ADDRESS_ENGINES_MAX && is_own_address(gw, engine, record) {
            own.insert(engine);
        }
    }

    /// What the mesh says, applied in order.
    async fn apply_loop(self: Arc<Self>, gw: Arc<Gateway>, mut rx: mpsc::Receiver<Apply>) {
        let ctx = probe::ingest_ctx(&gw, Some(self.input.clone()));
        while let Some(a) = rx.recv().await {
            match a {
                Apply::Mark { mark, .. } => {
                    apply_mark(&gw, &mark);
                }
                Apply::PeerLoad { engine, others } => set_peer_load(&gw, engine, others),
                Apply::EngineUpsert { engine, record } => {
                    // An engine removed and added back by peers (through the admin API, or
                    // a peer's record of it removed and its config's planted again) is a
                    // new engine here, without the reader the old one had;
                    // its owners did not change, so no `Own` follows: read it again if it is
                    // this router's (QA: a router read nothing while reporting it did).
                    let reads = upsert(&gw, engine, &record)
                        && lock(&self.core).owned().any(|o| o == engine);
                    self.note_own_address(&gw, engine, &record);
                    if let Some(e) = gw.registry.get(EngineId(engine)).filter(|_| reads) {
                        tracing::info!(engine = %e.url, "reading this engine's kv events again");
                        // The reader starts over from the engine's replay: its feed starts
                        // over too, so that a follower that kept the engine does not count
                        // its blocks twice.
                        let clear = Input::Feed {
                            engine,
                            ops: vec![WireOp::Cleared],
                            meta: Vec::new(),
                            stale: false,
                            next_seq: None,
                        };
                        if self.input.send(clear).await.is_err() {
                            return;
                        }
                        ingest::spawn(&ctx, &gw.tasks, &e, None);
                    }
                }
                Apply::EngineRemoved { engine } => {
                    lock(&self.own_address_engines).remove(&engine);
                    let Some(e) = gw.registry.get(EngineId(engine)) else {
                        continue;
                    };
                    if let Source::Dns(name) = &e.source {
                        // Its DNS name rules: it would come back at the next resolution. The
                        // weight a peer's record gave it goes: the name's is its own.
                        tracing::warn!(engine = %e.url, dns = %name, "engine removed by a peer kept: this router resolves it from DNS");
                        if let Some(d) = gw.cfg.dns.iter().find(|d| &d.name == name) {
                            gw.registry.set_weight(e.id, d.weight);
                        }
                    } else {
                        let url = e.url.clone();
                        gw.registry.remove(&url);
                        tracing::info!(engine = %url, "engine removed by a peer");
                    }
                }
                Apply::Feed(f) => {
                    if let Some(e) = gw.registry.get(EngineId(f.engine)) {
                        let ops: Vec<IndexOp> = f
                            .ops
                            .iter()
                            .map(|op| match *op {
                                WireOp::Stored(k) => IndexOp::Stored(BlockKey(k)),
                                WireOp::Removed(k) => IndexOp::Removed(BlockKey(k)),
                                WireOp::Cleared => IndexOp::Cleared,
                            })
                            .collect();
                        let v = OpVersion {
                            epoch: f.epoch,
                            seq: Some(f.n),
                        };
                        gw.registry.prefix.apply_batch(e.target(), v, &ops);
                    }
                }
                Apply::Own { engine, from } => {
                    if let Some(e) = gw.registry.get(EngineId(engine)) {
                        tracing::info!(engine = %e.url, handover = from.is_some(), "reading this engine's kv events");
                        ingest::spawn(&ctx, &gw.tasks, &e, from.as_deref());
                    }
                }
                Apply::Disown { engine } => {
                    if let Some(e) = gw.registry.get(EngineId(engine)) {
                        tracing::info!(engine = %e.url, "no longer reading this engine's kv events");
                        ingest::stop(&e);
                    }
                }
                Apply::Members => {}
                Apply::Warm { received } => {
                    if !self.warm.swap(true, Relaxed) {
                        if received {
                            tracing::info!("warm: the cluster's state received");
                        } else if lock(&self.core).is_alone() {
                            tracing::warn!(
                                "no peer answered within the warm-up time: serving alone and reporting ready (are the seeds up, is this router's certificate from the cluster's CA, is its cluster id theirs? see kvmesh_mesh_handshake_failures_total)"
                            );
                        } else {
                            tracing::info!(
                                "warm: the warm-up time passed without a peer's whole state"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A peer's display name by stable id.
    fn name_of(&self, n: NodeId, members: &[MeshId]) -> String {
        if n == self.me {
            return self.name.clone();
        }
        members
            .iter()
            .find(|m| NodeId::from_name(&m.name) == n)
            .map(|m| m.name.clone())
            .unwrap_or_else(|| format!("{:016x}", n.0))
    }
}

mod status;

impl MeshHook for Cluster {
    fn is_warm(&self) -> bool {
        Cluster::is_warm(self)
    }

    fn collector(&self) -> Box<dyn prometheus_client::collector::Collector> {
        status::collector(self)
    }

    fn status(
        &self,
        slot: RouterSlot,
        url_of: &dyn Fn(u64) -> Option<String>,
    ) -> serde_json::Value {
        status::status(self, slot, url_of)
    }

    fn engine_added(&self, entry: &EngineEntry) {
        let rec = record(entry);
        self.send_change(Input::EngineAdd {
            engine: EngineId::from_url(&rec.url).0,
            record: rec,
        });
    }

    fn engine_removed(&self, url: &str) {
        self.send_change(Input::EngineRemove {
            engine: EngineId::from_url(url).0,
        });
    }
}

impl Cluster {
    /// A registry change made here, for the mesh node: never dropped (changes are rare; a
    /// full queue is waited on by a task of its own, not by the caller).
    fn send_change(&self, change: Input) {
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(change)) =
            self.input.try_send(change)
        {
            let input = self.input.clone();
            tokio::spawn(async move {
                let _ = input.send(change).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{EngineId, EngineRecord, peer_entry};

    #[test]
    fn a_peers_engine_is_checked_like_an_admin_one() {
        let url = "http://127.0.0.1:8001";
        let good = EngineRecord {
            url: url.into(),
            weight_milli: 1_500,
            kv_events: String::new(),
            kv_replay: String::new(),
            models: vec![],
        };
        let id = EngineId::from_url(url).0;
        let e = peer_entry(id, &good).expect("a well-formed engine");
        assert_eq!((e.url.as_str(), e.weight), (url, 1.5));
        assert!(peer_entry(id ^ 1, &good).is_err(), "id not its URL's");
        let bad = |f: fn(&mut EngineRecord)| {
            let mut r = good.clone();
            f(&mut r);
            peer_entry(EngineId::from_url(&r.url).0, &r)
        };
        assert!(bad(|r| r.weight_milli = 0).is_err(), "weight 0");
        assert!(bad(|r| r.url = "not a url".into()).is_err());
        assert!(bad(|r| r.url = "http://h:1/v1/x".into()).is_err());
        assert!(bad(|r| r.kv_events = "garbage".into()).is_err());
        assert!(
            bad(|r| r.kv_replay = "tcp://h:2".into()).is_err(),
            "replay without events"
        );
        assert!(
            bad(|r| r.weight_milli = u32::MAX).is_err(),
            "4.3e6 > 1e6: too heavy"
        );
    }

    #[test]
    fn the_mesh_and_the_index_mean_the_same_windows() {
        for len in 0..40 {
            for i in 0..=len {
                assert_eq!(
                    kvmesh_state::window_top(i, len),
                    kvmesh_prefix::window_top(i, len),
                    "position {i} of {len}"
                );
            }
        }
    }
}
