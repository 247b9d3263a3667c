//! The mesh in the router: this router's marks, load and admin changes become `kvmesh-state`
//! deltas batched to every live member every `flush_ms`; the deltas peers send are merged into
//! the replicated state and applied locally (marks into the prefix index, peers' load onto the
//! engines, registry changes into the registry); every `anti_entropy_ms` the whole state goes
//! to one random member (repairs what was lost); a member that leaves or dies takes its load
//! entries with it. No routing decision waits for any of it: decisions read the local index
//! and atomics only.

use crate::engine::Source;
use crate::gateway::{Gateway, MeshHook};
use crate::probe;
use kvmesh_config::{EngineEntry, MeshConfig};
use kvmesh_mesh::certs::NodeTls;
use kvmesh_mesh::membership::MeshId;
use kvmesh_mesh::node::{DeltaIn, MeshNode, Seeds};
use kvmesh_prefix::{BlockKey, EngineId, IndexOp, IndexSink, OpVersion, Target};
use kvmesh_state::{
    Delta, EngineRecord, Envelope, EnvelopeV1, LoadMap, MarkDelta, MarkMap, NodeId, RegistryDelta,
    RegistrySet, decode, encode,
};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::mpsc;

/// Deltas per envelope at most (an anti-entropy round is chunked).
const DELTAS_PER_ENVELOPE: usize = 2_048;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counters of the mesh in this router.
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// Envelopes sent / received.
    pub envelopes_sent: AtomicU64,
    /// See `envelopes_sent`.
    pub envelopes_received: AtomicU64,
    /// Envelopes dropped: undecodable, oversized, or of another cluster.
    pub envelopes_dropped: AtomicU64,
    /// Deltas that changed the state.
    pub deltas_applied: AtomicU64,
    /// Anti-entropy rounds sent.
    pub anti_entropy_rounds: AtomicU64,
}

/// The replicated state of the cluster as this router holds it.
struct Replicated {
    load: LoadMap,
    marks: MarkMap,
    registry: RegistrySet,
}

/// This router's part in the mesh.
pub struct Cluster {
    me: NodeId,
    incarnation: u64,
    cluster_id: u64,
    node: Mutex<Option<MeshNode>>,
    members: tokio::sync::watch::Receiver<Vec<MeshId>>,
    transport: Arc<kvmesh_mesh::transport::Transport>,
    state: Mutex<Replicated>,
    outbox: Arc<Mutex<Vec<Delta>>>,
    /// Warm: this router holds the cluster's state (it is the first, it received a peer's
    /// whole state, or the warm-up bound passed); `/health` says ready only then.
    warm: std::sync::atomic::AtomicBool,
    /// Counters.
    pub counters: ClusterCounters,
}

/// The cluster id on the wire: 64 bits of blake3 over the configured string.
fn cluster_id(s: &str) -> u64 {
    let h = blake3::hash(format!("kvmesh/cluster/v1\0{s}").as_bytes());
    let mut x = [0u8; 8];
    x.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(x)
}

/// Local index changes that other routers must learn: speculative marks (the KV-event batches
/// are read by every router while `ingest_replicas = 0`).
struct Outbox(Arc<Mutex<Vec<Delta>>>);

impl IndexSink for Outbox {
    fn apply_batch(&mut self, _: Target, _: OpVersion, _: &[IndexOp]) -> bool {
        true
    }

    fn mark(&mut self, t: Target, keys: &[BlockKey], expiry_us: u64, _now_us: u64) {
        lock(&self.0).push(Delta::Mark(MarkDelta {
            engine: t.engine.0,
            keys: keys.iter().map(|k| k.0).collect(),
            expiry_us,
        }));
    }

    fn clear(&mut self, _: Target) {}
}

impl Cluster {
    /// Joins the mesh as `cfg` says and starts its tasks in the gateway's task set.
    pub async fn start(gw: &Arc<Gateway>, cfg: &MeshConfig) -> Result<Arc<Cluster>, String> {
        let tls =
            NodeTls::load(Path::new(&cfg.tls_dir), &cfg.node_id).map_err(|e| e.to_string())?;
        let listen: SocketAddr = cfg
            .listen
            .parse()
            .map_err(|e| format!("serve.mesh.listen {}: {e}", cfg.listen))?;
        let seeds = Seeds {
            addrs: cfg.seeds.clone(),
            dns: (!cfg.seed_dns.is_empty()).then(|| cfg.seed_dns.clone()),
        };
        let (node, deltas) =
            MeshNode::start(&cfg.node_id, listen, &tls, seeds, cfg.expected_routers)
                .await
                .map_err(|e| format!("mesh: {e}"))?;
        let outbox = Arc::new(Mutex::new(Vec::new()));
        let c = Arc::new(Cluster {
            me: NodeId::from_name(&cfg.node_id),
            incarnation: node.id.bump,
            cluster_id: cluster_id(&cfg.cluster_id),
            members: node.members.clone(),
            transport: node.transport.clone(),
            node: Mutex::new(Some(node)),
            state: Mutex::new(Replicated {
                load: LoadMap::new(),
                marks: MarkMap::new(gw.cfg.prefix.engine_capacity_blocks as usize),
                registry: RegistrySet::new(),
            }),
            outbox: outbox.clone(),
            warm: std::sync::atomic::AtomicBool::new(
                cfg.seeds.is_empty() && cfg.seed_dns.is_empty(),
            ),
            counters: ClusterCounters::default(),
        });
        gw.registry
            .prefix
            .set_delta_sink(Some(Box::new(Outbox(outbox))));
        let _ = gw.mesh.set(c.clone());
        tracing::info!(node = %cfg.node_id, addr = %c.transport.local_addr().map(|a| a.to_string()).unwrap_or_default(), "joined the mesh");
        let flush = Duration::from_millis(cfg.flush_ms);
        let ae = Duration::from_millis(cfg.anti_entropy_ms);
        let (g, cl) = (gw.clone(), c.clone());
        gw.tasks.spawn(async move { cl.flush_loop(g, flush).await });
        let (g, cl) = (gw.clone(), c.clone());
        gw.tasks
            .spawn(async move { cl.inbound_loop(g, deltas).await });
        let (g, cl) = (gw.clone(), c.clone());
        gw.tasks
            .spawn(async move { cl.anti_entropy_loop(g, ae).await });
        let (g, cl) = (gw.clone(), c.clone());
        gw.tasks.spawn(async move { cl.membership_loop(g).await });
        // A router whose peers never answer still serves after the warm-up bound (logged).
        let (cl, bound) = (c.clone(), ae * 5);
        gw.tasks.spawn(async move {
            tokio::time::sleep(bound).await;
            if !cl.warm.swap(true, Relaxed) {
                tracing::warn!(?bound, "no peer's state received: serving without it");
            }
        });
        Ok(c)
    }

    /// This router holds the cluster's state (see [`Cluster::warm`]).
    pub fn is_warm(&self) -> bool {
        self.warm.load(Relaxed)
    }

    /// This router's whole replicated state as deltas.
    fn whole_state(&self, now_us: u64) -> Vec<Delta> {
        let mut st = lock(&self.state);
        st.marks.expire(now_us);
        let mut v: Vec<Delta> = st.load.deltas().into_iter().map(Delta::Load).collect();
        v.extend(st.marks.deltas().into_iter().map(Delta::Mark));
        v.extend(st.registry.deltas().into_iter().map(Delta::Registry));
        v
    }

    /// The live members (not this router).
    pub fn members(&self) -> Vec<MeshId> {
        self.members.borrow().clone()
    }

    /// Digests of the replicated state (load, marks, registry): equal on routers that agree.
    pub fn digests(&self) -> (u64, u64, u64) {
        let s = lock(&self.state);
        (s.load.digest(), s.marks.digest(), s.registry.digest())
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

    fn send(&self, to: Vec<SocketAddr>, deltas: Vec<Delta>, snapshot: bool) {
        // An empty state still goes (as one empty snapshot): it warms the joining router.
        let chunks: Vec<&[Delta]> = if deltas.is_empty() {
            vec![&[]]
        } else {
            deltas.chunks(DELTAS_PER_ENVELOPE).collect()
        };
        for chunk in chunks {
            let env = Envelope::V1(EnvelopeV1 {
                cluster_id: self.cluster_id,
                from: self.me,
                snapshot,
                deltas: chunk.to_vec(),
            });
            let Ok(bytes) = encode(&env) else { continue };
            let bytes = Arc::new(bytes);
            for &peer in &to {
                let (t, b) = (self.transport.clone(), bytes.clone());
                self.counters.envelopes_sent.fetch_add(1, Relaxed);
                tokio::spawn(async move {
                    let _ = t.send_delta(peer, &b).await;
                });
            }
        }
    }

    /// Every `every`: this router's load changes, then the batched deltas, to every member.
    async fn flush_loop(self: Arc<Self>, gw: Arc<Gateway>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sent: HashMap<EngineId, u32> = HashMap::new();
        loop {
            tick.tick().await;
            let mut load = Vec::new();
            {
                let mut st = lock(&self.state);
                for e in gw.registry.members() {
                    let now = e.in_flight.load(Relaxed);
                    if sent.get(&e.id) != Some(&now) {
                        sent.insert(e.id, now);
                        load.push(Delta::Load(st.load.set_local(
                            self.me,
                            self.incarnation,
                            e.id.0,
                            now,
                        )));
                    }
                }
            }
            let mut deltas = std::mem::take(&mut *lock(&self.outbox));
            {
                let mut st = lock(&self.state);
                for d in &deltas {
                    match d {
                        Delta::Mark(m) => {
                            st.marks.merge(m);
                        }
                        Delta::Registry(r) => {
                            st.registry.merge(r);
                        }
                        Delta::Load(_) => {}
                    }
                }
            }
            deltas.extend(load);
            if deltas.is_empty() {
                continue;
            }
            let to: Vec<SocketAddr> = self.members().iter().map(|m| m.addr).collect();
            if !to.is_empty() {
                self.send(to, deltas, false);
            }
        }
    }

    /// Every `every`: the whole state to one random member.
    async fn anti_entropy_loop(self: Arc<Self>, gw: Arc<Gateway>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut turn = 0usize;
        loop {
            tick.tick().await;
            let members = self.members();
            // A router still warming up has no whole state to offer.
            if members.is_empty() || !self.is_warm() {
                continue;
            }
            turn = turn.wrapping_add(1 + (gw.next_seed() as usize % members.len()));
            let peer = members[turn % members.len()].addr;
            let all = self.whole_state(gw.clock.now_us());
            self.counters.anti_entropy_rounds.fetch_add(1, Relaxed);
            self.send(vec![peer], all, true);
        }
    }

    /// Peers' deltas: merged into the state, applied locally when they changed it.
    async fn inbound_loop(self: Arc<Self>, gw: Arc<Gateway>, mut rx: mpsc::Receiver<DeltaIn>) {
        while let Some(d) = rx.recv().await {
            let env = match decode(&d.payload, self.cluster_id) {
                Ok(e) => e,
                Err(e) => {
                    self.counters.envelopes_dropped.fetch_add(1, Relaxed);
                    tracing::debug!(from = %d.from, error = %e, "mesh envelope dropped");
                    continue;
                }
            };
            self.counters.envelopes_received.fetch_add(1, Relaxed);
            if env.from == self.me {
                continue;
            }
            for delta in &env.deltas {
                self.apply(&gw, delta).await;
            }
            if env.snapshot && !self.warm.swap(true, Relaxed) {
                tracing::info!(from = %d.from, "warm: a peer's whole state received");
            }
        }
    }

    async fn apply(&self, gw: &Arc<Gateway>, delta: &Delta) {
        let now = gw.clock.now_us();
        match delta {
            Delta::Mark(m) => {
                if !lock(&self.state).marks.merge(m) {
                    return;
                }
                if let Some(e) = gw.registry.get(EngineId(m.engine)) {
                    let keys: Vec<BlockKey> = m.keys.iter().map(|k| BlockKey(*k)).collect();
                    gw.registry
                        .prefix
                        .remote_mark(e.target(), &keys, m.expiry_us, now);
                }
            }
            Delta::Load(l) => {
                let others = {
                    let mut st = lock(&self.state);
                    if !st.load.merge(l) {
                        return;
                    }
                    st.load.others(self.me, l.engine)
                };
                if let Some(e) = gw.registry.get(EngineId(l.engine)) {
                    e.peer_in_flight
                        .store(u32::try_from(others).unwrap_or(u32::MAX), Relaxed);
                }
            }
            Delta::Registry(r) => {
                let (changed, present, record) = {
                    let mut st = lock(&self.state);
                    let changed = st.registry.merge(r);
                    let engine = match r {
                        RegistryDelta::Add { engine, .. }
                        | RegistryDelta::Remove { engine, .. } => *engine,
                    };
                    (
                        changed,
                        st.registry.contains(engine),
                        st.registry.get(engine).cloned(),
                    )
                };
                if !changed {
                    return;
                }
                match (present, record) {
                    (true, Some(rec)) => {
                        let entry = EngineEntry {
                            url: rec.url.clone(),
                            weight: f64::from(rec.weight_milli) / 1000.0,
                            kv_events: rec.kv_events.clone(),
                            kv_replay: rec.kv_replay.clone(),
                            models: rec.models.clone(),
                        };
                        if gw.registry.get(EngineId::from_url(&rec.url)).is_none() {
                            match probe::add_engine(gw, &entry, Source::Mesh, true) {
                                Ok(e) => {
                                    tracing::info!(engine = %e.url, "engine added by a peer");
                                    probe::discover(gw, &e).await;
                                }
                                Err(err) => {
                                    tracing::warn!(error = %err, "engine from a peer refused")
                                }
                            }
                        }
                    }
                    _ => {
                        if let RegistryDelta::Remove { .. } = r
                            && let Some(url) = gw
                                .registry
                                .members()
                                .iter()
                                .find(|e| {
                                    !lock(&self.state).registry.contains(e.id.0)
                                        && e.source == Source::Mesh
                                })
                                .map(|e| e.url.clone())
                        {
                            gw.registry.remove(&url);
                        }
                    }
                }
            }
        }
    }

    /// Members that leave or die take their load entries with them.
    async fn membership_loop(self: Arc<Self>, gw: Arc<Gateway>) {
        let mut rx = self.members.clone();
        let mut known: BTreeSet<(String, u64)> = BTreeSet::new();
        loop {
            let now: BTreeSet<(String, u64)> = rx
                .borrow_and_update()
                .iter()
                .map(|m| (m.name.clone(), m.bump))
                .collect();
            // A newcomer gets this router's whole state at once (it is warm from the first).
            let joined: Vec<SocketAddr> = rx
                .borrow()
                .iter()
                .filter(|m| !known.contains(&(m.name.clone(), m.bump)))
                .map(|m| m.addr)
                .collect();
            if !joined.is_empty() && self.is_warm() {
                self.send(joined, self.whole_state(gw.clock.now_us()), true);
            }
            let gone: Vec<(String, u64)> = known.difference(&now).cloned().collect();
            if !gone.is_empty() {
                let mut st = lock(&self.state);
                for (name, bump) in &gone {
                    st.load.remove_node(NodeId::from_name(name), *bump);
                    tracing::info!(node = %name, "mesh member gone: its load entries dropped");
                }
                for e in gw.registry.members() {
                    let others = st.load.others(self.me, e.id.0);
                    e.peer_in_flight
                        .store(u32::try_from(others).unwrap_or(u32::MAX), Relaxed);
                }
            }
            known = now;
            if rx.changed().await.is_err() {
                break;
            }
        }
    }
}

/// The mesh's counters at one instant, as metric families.
#[derive(Debug)]
struct MeshMetrics {
    members: i64,
    envelopes: [(&'static str, u64); 3],
    bytes: [(&'static str, &'static str, u64); 4],
    anti_entropy: u64,
    handshake_failures: u64,
}

impl prometheus_client::collector::Collector for MeshMetrics {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::encoding::NoLabelSet;
        use prometheus_client::metrics::MetricType::{Counter, Gauge};
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_members",
            "Live members of the mesh besides this router",
            None,
            Gauge,
        )?;
        m.encode_gauge(&self.members)?;
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_envelopes",
            "State envelopes by direction (dropped: undecodable, oversized or of another cluster)",
            None,
            Counter,
        )?;
        for (dir, v) in &self.envelopes {
            let labels = [("direction", *dir)];
            m.encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(v, None)?;
        }
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_bytes",
            "Mesh bytes by traffic class and direction",
            None,
            Counter,
        )?;
        for (class, dir, v) in &self.bytes {
            let labels = [("class", *class), ("direction", *dir)];
            m.encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(v, None)?;
        }
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_anti_entropy_rounds",
            "Whole-state exchanges sent to a random member",
            None,
            Counter,
        )?;
        m.encode_counter::<NoLabelSet, _, u64>(&self.anti_entropy, None)?;
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_handshake_failures",
            "Mesh handshakes refused (certificate not from the cluster CA, garbage)",
            None,
            Counter,
        )?;
        m.encode_counter::<NoLabelSet, _, u64>(&self.handshake_failures, None)
    }
}

impl MeshHook for Cluster {
    fn is_warm(&self) -> bool {
        Cluster::is_warm(self)
    }

    fn collector(&self) -> Box<dyn prometheus_client::collector::Collector> {
        let c = &self.counters;
        let t = self.transport.counters();
        Box::new(MeshMetrics {
            members: self.members().len() as i64,
            envelopes: [
                ("sent", c.envelopes_sent.load(Relaxed)),
                ("received", c.envelopes_received.load(Relaxed)),
                ("dropped", c.envelopes_dropped.load(Relaxed)),
            ],
            bytes: [
                ("swim", "sent", t.bytes_sent[0].load(Relaxed)),
                ("swim", "received", t.bytes_received[0].load(Relaxed)),
                ("delta", "sent", t.bytes_sent[1].load(Relaxed)),
                ("delta", "received", t.bytes_received[1].load(Relaxed)),
            ],
            anti_entropy: c.anti_entropy_rounds.load(Relaxed),
            handshake_failures: t.handshake_failures.load(Relaxed),
        })
    }

    fn status(&self) -> serde_json::Value {
        let (load, marks, registry) = self.digests();
        let c = &self.counters;
        let t = self.transport.counters();
        serde_json::json!({
            "node": format!("{:016x}", self.me.0),
            "warm": self.is_warm(),
            "addr": self.addr().map(|a| a.to_string()),
            "members": self.members().iter().map(|m| serde_json::json!({
                "name": m.name, "addr": m.addr.to_string(), "incarnation": m.bump,
            })).collect::<Vec<_>>(),
            "digests": {
                "load": format!("{load:016x}"),
                "marks": format!("{marks:016x}"),
                "registry": format!("{registry:016x}"),
            },
            "envelopes": {
                "sent": c.envelopes_sent.load(Relaxed),
                "received": c.envelopes_received.load(Relaxed),
                "dropped": c.envelopes_dropped.load(Relaxed),
            },
            "anti_entropy_rounds": c.anti_entropy_rounds.load(Relaxed),
            "bytes": {
                "datagram_sent": t.bytes_sent[0].load(Relaxed),
                "datagram_received": t.bytes_received[0].load(Relaxed),
                "delta_sent": t.bytes_sent[1].load(Relaxed),
                "delta_received": t.bytes_received[1].load(Relaxed),
            },
            "handshake_failures": t.handshake_failures.load(Relaxed),
        })
    }

    fn engine_added(&self, entry: &EngineEntry) {
        let rec = EngineRecord {
            url: entry.url.trim_end_matches('/').to_string(),
            weight_milli: (entry.weight * 1000.0)
                .round()
                .clamp(1.0, f64::from(u32::MAX)) as u32,
            kv_events: entry.kv_events.clone(),
            kv_replay: entry.kv_replay.clone(),
            models: entry.models.clone(),
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let d = lock(&self.state)
            .registry
            .add(self.me, now, EngineId::from_url(&rec.url).0, rec);
        lock(&self.outbox).push(Delta::Registry(d));
    }

    fn engine_removed(&self, url: &str) {
        let d = lock(&self.state).registry.remove(EngineId::from_url(url).0);
        if let Some(d) = d {
            lock(&self.outbox).push(Delta::Registry(d));
        }
    }
}
