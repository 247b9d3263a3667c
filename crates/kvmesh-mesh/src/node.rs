//! The tokio shell of one mesh node: a thin driver of the sans-IO [`MeshCore`]. The
//! transport's datagrams and streams go in, the router's local changes come in on a channel,
//! the core's timer runs on the given clock; the packets it wants sent go out through the
//! transport and the changes it wants applied go to the router on a channel. Seeds (static
//! addresses, or a DNS name re-resolved) are asked again while the node knows nobody; the live
//! members are published on a `watch`; leaving is graceful.

use crate::certs::NodeTls;
use crate::core::{Apply, CoreConfig, MeshCore, Output};
use crate::membership::MeshId;
use crate::realtime;
use crate::transport::{Class, Inbound, Transport, TransportError};
use crate::warn_every::WarnEvery;
use kvmesh_state::{EngineRecord, MarkDelta, WireOp};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

/// How a node finds the cluster.
#[derive(Debug, Clone, Default)]
pub struct Seeds {
    /// `host:port` addresses (resolved at each attempt).
    pub addrs: Vec<String>,
    /// A DNS name (`name:port`) whose addresses are all seeds, re-resolved at each attempt
    /// (a Kubernetes headless Service).
    pub dns: Option<String>,
}

/// A change of the router's that the cluster must learn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A speculative mark from a routing decision.
    Mark {
        /// The engine.
        engine: u64,
        /// Block keys.
        keys: Vec<u64>,
        /// Leading keys the decision found the engine holding.
        known: u32,
        /// Until when (cluster time, µs).
        expiry_us: u64,
    },
    /// This router's in-flight count on an engine.
    Load {
        /// The engine.
        engine: u64,
        /// In flight.
        in_flight: u32,
    },
    /// An engine added (or changed) through this router.
    EngineAdd {
        /// The engine.
        engine: u64,
        /// Its record.
        record: EngineRecord,
    },
    /// An engine removed through this router.
    EngineRemove {
        /// The engine.
        engine: u64,
    },
    /// The engines of the router's own config: they seed the replicated registry once the
    /// node is warm (`MeshCore::seed_engines`).
    SeedEngines(Vec<(u64, EngineRecord)>),
    /// The router's engines, and those of them with KV events (ownership follows).
    Engines {
        /// Every engine of the router's registry.
        all: BTreeSet<u64>,
        /// Those with KV events.
        events: BTreeSet<u64>,
    },
    /// Ops this router derived from an engine's events (it owns the engine).
    Feed {
        /// The engine.
        engine: u64,
        /// The ops.
        ops: Vec<WireOp>,
        /// Engine hash and chain position of each stored block.
        meta: Vec<(u64, u32)>,
        /// The engine's blocks are not exactly known.
        stale: bool,
        /// The engine seq expected next.
        next_seq: Option<u64>,
    },
}

/// Cluster time (µs since the Unix epoch) as the router keeps it.
pub type NowFn = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Sets the other routers' total on an engine (the router's side of the short way).
pub type SetPeers = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// Applies a peer's mark on the router at once; `false` when it cannot (the engine is not
/// known there yet: the mark then goes the long way, behind the engine's addition).
pub type ApplyMark = Arc<dyn Fn(&MarkDelta) -> bool + Send + Sync>;

/// The short way between the router and its node, without the [`Input`] and [`Apply`]
/// channels and the router's tasks behind them: this router's in-flight counts out, the
/// peers' counts and marks in, each set by the node's thread itself. A count is stale for
/// as long as it travels, and a router deciding meanwhile may place a request where another
/// just did. Marks and counts come in the order the peer made them (an envelope carries its
/// marks before its counts) and take the same way, so a router never sees a peer's request
/// for a new prompt as load on an engine before it sees the mark that says the engine is
/// getting that prompt (a router's tasks may run late, the node's thread does not wait for
/// them).
pub struct LoadLink {
    /// Engines whose count changed: each is signalled once until [`LoadLink::read`] reads it.
    pub changed: mpsc::UnboundedReceiver<u64>,
    /// An engine's count now (and its signal re-armed); `None` for an unknown engine.
    pub read: Arc<dyn Fn(u64) -> Option<u32> + Send + Sync>,
    /// Sets the other routers' total on an engine (what [`Apply::PeerLoad`] would carry).
    pub peers: SetPeers,
    /// Applies a peer's live mark (what [`Apply::Mark`] would carry; the marks of a
    /// transfer of state take the queue).
    pub marks: ApplyMark,
}

/// A running mesh node.
pub struct MeshNode {
    /// The transport.
    pub transport: Arc<Transport>,
    /// The live members (not this node).
    pub members: watch::Receiver<Vec<MeshId>>,
    /// This node's identity at start.
    pub id: MeshId,
    /// The node's state (read it briefly: status pages, tests).
    pub core: Arc<Mutex<MeshCore>>,
    /// Where the router's changes go (bounded; a full channel drops, anti-entropy repairs).
    pub input: mpsc::Sender<Input>,
    /// The node's thread runs at real-time priority (it asked and was allowed).
    pub realtime: bool,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    /// The thread the node runs on (held for its drop: the runtime stops with the node).
    _thread: NodeThread,
}

/// The node's own thread and single-threaded runtime: the node's wake-ups (a peer's count
/// arriving, one of ours to send) never queue behind the router's request work on the
/// router's runtime, so a count reaches the peers in about the same time at any request
/// load. Dropping it stops the runtime (the node's tasks end where they are).
struct NodeThread {
    handle: tokio::runtime::Handle,
    stop: Option<oneshot::Sender<()>>,
}

impl NodeThread {
    /// Starts the thread; it asks for real-time scheduling at `priority` first (0: never;
    /// see [`crate::realtime`]) and tells through the receiver whether it got it (a refusal
    /// is logged, not an error).
    fn spawn(name: &str, priority: u8) -> std::io::Result<(NodeThread, oneshot::Receiver<bool>)> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let (raised_tx, raised) = oneshot::channel();
        let node = name.to_string();
        std::thread::Builder::new()
            .name(format!("mesh-{name}"))
            .spawn(move || {
                let realtime = priority > 0
                    && match realtime::raise_current_thread(priority) {
                        Ok(()) => {
                            tracing::info!(node, priority, "mesh thread runs at real-time priority (SCHED_FIFO)");
                            true
                        }
                        Err(e) => {
                            tracing::warn!(
                                node,
                                priority,
                                error = %e,
                                "mesh thread stays at normal priority (real-time needs CAP_SYS_NICE): peers' in-flight counts may wait behind busy threads"
                            );
                            false
                        }
                    };
                let _ = raised_tx.send(realtime);
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        Ok((
            NodeThread {
                handle,
                stop: Some(stop),
            },
            raised,
        ))
    }
}

impl Drop for NodeThread {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

fn lock(m: &Mutex<MeshCore>) -> MutexGuard<'_, MeshCore> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The seeds' addresses (this node's own left out). A seed that does not resolve is logged
/// when it starts failing and when it resolves again (`failing` holds those failing now), not
/// at every attempt: a node alone tries every second.
async fn resolve(
    seeds: &Seeds,
    me: SocketAddr,
    failing: &mut std::collections::BTreeSet<String>,
) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for s in seeds.addrs.iter().chain(seeds.dns.iter()) {
        match tokio::net::lookup_host(s.as_str()).await {
            Ok(it) => {
                if failing.remove(s) {
                    tracing::info!(seed = %s, "mesh seed resolves again");
                }
                out.extend(it.filter(|a| *a != me));
            }
            Err(e) => {
                if failing.insert(s.clone()) {
                    tracing::warn!(seed = %s, error = %e, "mesh seed does not resolve: this router stays alone until it does");
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Feeds the router's changes already waiting (at most 1,024: one hold of the core's lock).
fn feed_waiting(core: &mut MeshCore, rx: &mut mpsc::Receiver<Input>, now: u64) {
    for _ in 0..1024 {
        match rx.try_recv() {
            Ok(i) => feed(core, i, now),
            Err(_) => break,
        }
    }
}

fn feed(core: &mut MeshCore, i: Input, now: u64) {
    match i {
        Input::Mark {
            engine,
            keys,
            known,
            expiry_us,
        } => core.local_mark(engine, keys, known as usize, expiry_us),
        Input::Load { engine, in_flight } => core.local_load(engine, in_flight),
        Input::EngineAdd { engine, record } => core.local_engine_add(engine, record, now),
        Input::EngineRemove { engine } => core.local_engine_remove(engine, now),
        Input::SeedEngines(engines) => core.seed_engines(engines, now),
        Input::Engines { all, events } => core.set_engines(all, events, now),
        Input::Feed {
            engine,
            ops,
            meta,
            stale,
            next_seq,
        } => core.local_feed(engine, &ops, &meta, stale, next_seq),
    }
}

impl MeshNode {
    /// Binds `listen`, starts the node as `name` (its incarnation: the start time, so a
    /// restart wins over the old identity) on a thread of its own (see `NodeThread`; real-time
    /// at `realtime_priority` if allowed, 0 = never asked) and returns it with the receiver of
    /// the changes the router must apply.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        name: &str,
        listen: SocketAddr,
        tls: &NodeTls,
        seeds: Seeds,
        cfg: CoreConfig,
        now: NowFn,
        link: Option<LoadLink>,
        realtime_priority: u8,
    ) -> Result<(MeshNode, mpsc::Receiver<Apply>), TransportError> {
        let (thread, raised) = NodeThread::spawn(name, realtime_priority)?;
        let realtime = raised.await.unwrap_or(false);
        // Everything the node starts (the endpoint's driver, its tasks) runs on its thread.
        let handle = thread.handle.clone();
        let _on_thread = handle.enter();
        let (transport, mut inbound) = Transport::bind(listen, tls, cfg.cluster_id, 4096)?;
        let addr = transport.local_addr()?;
        let t0 = now();
        let id = MeshId {
            name: name.to_string(),
            addr,
            bump: t0.max(1),
        };
        let seed = id.bump ^ u64::from(addr.port()).rotate_left(40);
        let core = Arc::new(Mutex::new(MeshCore::new(id.clone(), cfg, seed, t0)));
        let (members_tx, members) = watch::channel(Vec::new());
        let (apply_tx, applies) = mpsc::channel(65_536);
        let (input, mut input_rx) = mpsc::channel::<Input>(65_536);
        let (stop, mut stopped) = oneshot::channel::<()>();
        let (t, c) = (transport.clone(), core.clone());
        // The router's side of the short way: its signals with the reader of its counts, and
        // the hooks that set the peers' counts and marks on it.
        let (mut counts, short) = match link {
            Some(l) => (Some((l.changed, l.read)), Some((l.peers, l.marks))),
            None => (None, None),
        };
        let task = tokio::spawn(async move {
            let mut ids: Vec<u64> = Vec::new();
            let out = Out {
                t: &t,
                applies: &apply_tx,
                members: &members_tx,
                core: &c,
                short: short.as_ref(),
            };
            let mut failing = std::collections::BTreeSet::new();
            let mut drops = WarnEvery::default();
            let mut reseed = tokio::time::interval(Duration::from_secs(1));
            reseed.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Whether the previous turn ran a due tick without waiting (never twice in a row).
            let mut ticked = false;
            loop {
                // What is due now runs now: an in-flight change is due at once while the
                // envelope rate has credit (`load_flush_us`, `load_burst`), and a timer would
                // add up to a millisecond (tokio rounds deadlines up to the next one) to every
                // change a peer waits for.
                let (wait, due_now) = {
                    let mut core = lock(&c);
                    let n = now();
                    let due = core.next_due();
                    if due <= n && !ticked {
                        core.tick(n);
                        (Duration::ZERO, true)
                    } else {
                        (
                            Duration::from_micros(due.saturating_sub(n).min(1_000_000)),
                            false,
                        )
                    }
                };
                ticked = due_now;
                if due_now {
                    let outs = lock(&c).take_outputs();
                    out.run(outs).await;
                    continue;
                }
                tokio::select! {
                    _ = &mut stopped => {
                        // The feeds this router reads go to the routers that read their
                        // engines next, delivered before the leave is sent (see
                        // `MeshCore::bequeath`).
                        let (outs, b, v1) = {
                            let mut core = lock(&c);
                            let b = core.bequeath(now());
                            (core.take_outputs(), b, core.writes_version_1())
                        };
                        let delivered = out.run_delivered(outs, BEQUEST_WAIT).await;
                        if v1 && b.reads > 0 {
                            tracing::info!(engines = b.reads, "leaving: serve.mesh.wire_version = 1 carries no hand-over of kv-event feeds: the routers that read this router's engines next take them from their other readers, or read them afresh");
                        } else if b.engines > 0 && delivered {
                            tracing::info!(engines = b.engines, routers = b.routers, "leaving: the kv-event feeds this router read handed to the routers that read their engines next");
                        } else if b.reads > 0 && b.routers == 0 {
                            tracing::info!(engines = b.reads, "leaving: no router left to hand this router's kv-event feeds to");
                        }
                        let outs = {
                            let mut core = lock(&c);
                            core.leave(now());
                            core.take_outputs()
                        };
                        out.run(outs).await;
                        break;
                    }
                    msg = inbound.recv() => {
                        let Some(Inbound { from, class, payload }) = msg else { break };
                        let dropped = {
                            let mut core = lock(&c);
                            match class {
                                Class::Datagram => {
                                    core.handle_datagram(&payload, now());
                                    None
                                }
                                Class::Delta | Class::Load => {
                                    core.handle_envelope(from, &payload, now()).err()
                                }
                                Class::Connected => {
                                    core.peer_connected(from, now());
                                    None
                                }
                            }
                        };
                        if let Some(e) = dropped {
                            warn_dropped(&mut drops, from, &e);
                        }
                    }
                    Some(id) = async {
                        match counts.as_mut() {
                            Some((r, _)) => r.recv().await,
                            None => std::future::pending().await,
                        }
                    } => {
                        if let Some((r, read)) = counts.as_mut() {
                            ids.clear();
                            ids.push(id);
                            while ids.len() < 4096 {
                                match r.try_recv() {
                                    Ok(id) => ids.push(id),
                                    Err(_) => break,
                                }
                            }
                            let mut core = lock(&c);
                            // The marks the router made before these counts go with them (it
                            // reserves a request's count after marking its prompt).
                            feed_waiting(&mut core, &mut input_rx, now());
                            for &id in &ids {
                                if let Some(v) = read(id) {
                                    core.local_load(id, v);
                                }
                            }
                        }
                    }
                    i = input_rx.recv() => {
                        let Some(i) = i else { break };
                        let mut core = lock(&c);
                        let n = now();
                        feed(&mut core, i, n);
                        // What else is waiting goes in the same hold of the lock.
                        feed_waiting(&mut core, &mut input_rx, n);
                    }
                    _ = tokio::time::sleep(wait) => lock(&c).tick(now()),
                    _ = reseed.tick() => {
                        if lock(&c).is_alone() {
                            let found = resolve(&seeds, addr, &mut failing).await;
                            let mut core = lock(&c);
                            for s in found {
                                core.announce(s, now());
                            }
                        }
                    }
                }
                let outs = lock(&c).take_outputs();
                out.run(outs).await;
            }
        });
        Ok((
            MeshNode {
                transport,
                members,
                id,
                core,
                input,
                realtime,
                stop: Some(stop),
                task,
                _thread: thread,
            },
            applies,
        ))
    }

    /// Leaves the cluster (the others see this node down at once) and closes the endpoint.
    pub async fn leave(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut self.task).await;
        self.transport.close().await;
    }

    /// Stops without telling anyone (a crash, for tests): the others must detect it. Its
    /// runtime stops with it: nothing reads or answers on its socket any more.
    pub fn kill(self) {
        self.task.abort();
    }
}

/// Where the core's outputs go.
struct Out<'a> {
    t: &'a Arc<Transport>,
    applies: &'a mpsc::Sender<Apply>,
    members: &'a watch::Sender<Vec<MeshId>>,
    core: &'a Arc<Mutex<MeshCore>>,
    /// The router's hooks for peers' counts and marks.
    short: Option<&'a (SetPeers, ApplyMark)>,
}

/// How long a leaving router waits for its bequests to be delivered, at most (the task that
/// leaves has 2 s: [`MeshNode::leave`]).
const BEQUEST_WAIT: Duration = Duration::from_secs(1);

impl Out<'_> {
    /// [`Out::run`], the envelopes awaited until delivered (within `wait`): whether they all
    /// were.
    async fn run_delivered(&self, outs: Vec<Output>, wait: Duration) -> bool {
        let mut sends = tokio::task::JoinSet::new();
        let mut rest = Vec::new();
        for o in outs {
            match o {
                Output::Envelope(to, data) => {
                    let t = self.t.clone();
                    sends.spawn(async move { t.send_delta_delivered(to, &data).await });
                }
                o => rest.push(o),
            }
        }
        let n = sends.len();
        let delivered = tokio::time::timeout(wait, async {
            let mut ok = 0;
            while let Some(r) = sends.join_next().await {
                ok += usize::from(matches!(r, Ok(Ok(()))));
            }
            ok
        })
        .await;
        let all = matches!(delivered, Ok(ok) if ok == n);
        match delivered {
            Ok(ok) if ok == n => {}
            Ok(ok) => tracing::warn!(
                delivered = ok,
                sent = n,
                "leaving: not every peer could be sent its last state (a kv-event feed it did not get, it takes from the engine's other readers, or reads afresh)"
            ),
            Err(_) => {
                tracing::warn!(sent = n, wait = ?wait, "leaving: not every peer acknowledged its last state in time (a kv-event feed it did not get, it takes from the engine's other readers, or reads afresh)")
            }
        }
        self.run(rest).await;
        all
    }

    async fn run(&self, outs: Vec<Output>) {
        let (t, applies, members, core) = (self.t, self.applies, self.members, self.core);
        let mut changed = false;
        for o in outs {
            match o {
                Output::Datagram(to, data) => {
                    // Lost packets are SWIM's business (it probes again); a peer that cannot be
                    // reached is what failure detection is for.
                    if !t.datagram_now(to, Class::Datagram, &data) {
                        let t = t.clone();
                        tokio::spawn(async move {
                            let _ = t.send_datagram(to, data).await;
                        });
                    }
                }
                Output::LoadDatagram(to, data) => {
                    // At once on the open connection; else (none yet, or too big for the path)
                    // on a stream like any envelope.
                    if !t.datagram_now(to, Class::Load, &data) {
                        let t = t.clone();
                        tokio::spawn(async move {
                            let _ = t.send_delta(to, &data).await;
                        });
                    }
                }
                Output::Envelope(to, data) => {
                    // One stream per envelope; a lost one is repaired (digests, feed pulls).
                    // None is larger than the bound (snapshots go in parts): one that is
                    // would never arrive, said rather than dropped in silence.
                    if data.len() > crate::transport::MAX_DELTA_BYTES {
                        tracing::warn!(peer = %to, bytes = data.len(), "mesh envelope over the size bound not sent");
                        continue;
                    }
                    let t = t.clone();
                    tokio::spawn(async move {
                        let _ = t.send_delta(to, &data).await;
                    });
                }
                Output::Apply(a) => {
                    // Peers' counts and live marks go straight onto the router when it gave
                    // the hooks, in the order they came. The old marks of a transfer of state
                    // (a joining router's snapshot: chunks of about 16,000 keys; a repair
                    // after a partition) take the router's queue, so that the node's thread
                    // does not spend itself inserting them at real-time priority while SWIM
                    // waits (`--bench mesh_join`, a 1M-entry join: ready in 1.14–1.25 s with
                    // every mark inserted here, 0.96–1.02 s through the queue; 3 runs each).
                    if let Some((peers, marks)) = self.short {
                        match &a {
                            Apply::PeerLoad { engine, others } => {
                                peers(*engine, *others);
                                continue;
                            }
                            Apply::Mark { mark, live: true } if marks(mark) => continue,
                            _ => {}
                        }
                    }
                    changed |= matches!(a, Apply::Members);
                    // The router applies in order; backpressure rather than loss.
                    if applies.send(a).await.is_err() {
                        return;
                    }
                }
            }
        }
        if changed || members.borrow().is_empty() {
            let live: Vec<MeshId> = lock(core).members().cloned().collect();
            members.send_if_modified(|cur| {
            if *cur == live {
                false
            } else {
                for m in live.iter().filter(|m| !cur.contains(m)) {
                    tracing::info!(member = %m.name, addr = %m.addr, incarnation = m.bump, "mesh member up");
                }
                for m in cur.iter().filter(|m| !live.contains(m)) {
                    tracing::info!(member = %m.name, addr = %m.addr, incarnation = m.bump, "mesh member down");
                }
                *cur = live;
                true
            }
        });
        }
    }
}

/// An envelope from a member that does not decode, said as a warning at most once a minute
/// per address (such a peer keeps sending them; each is counted as dropped).
fn warn_dropped(warned: &mut WarnEvery, from: SocketAddr, e: &kvmesh_state::WireError) {
    if !warned.due(from, std::time::Instant::now()) {
        tracing::debug!(peer = %from, error = %e, "mesh envelope dropped");
        return;
    }
    tracing::warn!(
        peer = %from,
        error = %e,
        "mesh envelope dropped: it does not decode (a router of another kvmesh build whose \
         mesh format differs, see README \"Upgrades\", or corrupt bytes); said at most once a \
         minute per address"
    );
}
