//! A deterministic simulation of many mesh nodes in one process: virtual time, a seeded
//! network that loses, delays, duplicates and reorders SWIM datagrams and loses or delays
//! state envelopes (a broken connection), partitions and heals, kills and restarts; engines
//! whose KV events the owners read. Used by the test suite (`tests/cluster_sim.rs`) and the
//! scale command (`benches/mesh_scale.rs`). No sockets, no clock.

use super::{Apply, CoreConfig, MeshCore, Output};
use crate::membership::MeshId;
use kvmesh_state::{EngineRecord, FeedApply, NodeId, StateDigest, WireOp};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr};

/// The simulated network's behaviour.
#[derive(Debug, Clone, Copy)]
pub struct NetConfig {
    /// Datagrams lost, percent.
    pub datagram_loss: u64,
    /// Envelopes lost, percent (a stream on a connection that broke).
    pub envelope_loss: u64,
    /// One-way delay: base + uniform jitter (µs).
    pub delay_us: u64,
    /// See `delay_us`.
    pub jitter_us: u64,
    /// Datagrams duplicated, per mille.
    pub dup_per_mille: u64,
}

impl NetConfig {
    /// A LAN that loses nothing: 300–600 µs one way.
    pub const LOSSLESS: NetConfig = NetConfig {
        datagram_loss: 0,
        envelope_loss: 0,
        delay_us: 300,
        jitter_us: 300,
        dup_per_mille: 0,
    };
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            datagram_loss: 10,
            envelope_loss: 2,
            delay_us: 300,
            jitter_us: 4_000,
            dup_per_mille: 20,
        }
    }
}

/// The node configuration the simulations start from: a 20 ms flush, in-flight changes
/// spaced 100 µs in bursts of 8, anti-entropy every second, 2 ingest owners per engine, 512
/// marks and 4,096 feed blocks per engine, 10 s marks, a 5 s warm-up bound; a test changes
/// what it studies (`CoreConfig { mark_ttls_us: …, ..sim_config(7, 32) }`).
pub fn sim_config(cluster_id: u64, expected_size: u32) -> CoreConfig {
    CoreConfig {
        cluster_id,
        flush_us: 20_000,
        load_flush_us: 100,
        load_burst: 8,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: 512,
        feed_capacity: 4_096,
        mark_ttls_us: vec![10_000_000],
        expected_size,
        warm_bound_us: 5_000_000,
        // As `serve.mesh.wire_version` by default.
        wire_version: 2,
        snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
        first: false,
    }
}

/// A seeded xorshift generator.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform below `n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// The address of node `i`.
pub fn addr(i: usize) -> SocketAddr {
    let i = i as u32 + 1;
    SocketAddr::from((Ipv4Addr::from(0x7F00_0000 | i), 7946))
}

fn index_of(a: SocketAddr) -> usize {
    match a.ip() {
        std::net::IpAddr::V4(v) => (u32::from(v) & 0x00FF_FFFF) as usize - 1,
        std::net::IpAddr::V6(_) => usize::MAX,
    }
}

/// A batch of an engine's events: its ops, and the engine hash and chain position of each
/// stored block.
pub type SimBatch = (Vec<WireOp>, Vec<(u64, u32)>);
/// A feed's version as applied: (epoch, n).
pub type FeedVersion = (u32, u64);
/// Blocks held: key → copies.
pub type Blocks = BTreeMap<u64, u32>;
/// A message on the simulated network: (due, order, to, from, is a datagram, bytes).
/// How a message travels: a SWIM datagram, an envelope on a stream, or an envelope of
/// in-flight counts as a datagram (lost, duplicated like the SWIM ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Way {
    Swim,
    Stream,
    LoadDatagram,
}

impl Way {
    fn datagram(self) -> bool {
        self != Way::Stream
    }
}

type InFlight = (u64, u64, usize, usize, Way, Vec<u8>);

/// An engine's KV-event stream: every batch kept (the sim's replay socket), and its truth.
#[derive(Debug, Clone, Default)]
pub struct SimEngine {
    /// (ops, engine hash and position of each stored block) per seq.
    pub batches: Vec<SimBatch>,
    /// Its blocks now: key → copies.
    pub truth: BTreeMap<u64, u32>,
}

/// A node's local index as its applies left it: per engine (version, blocks).
#[derive(Debug, Clone, Default)]
pub struct SimIndex {
    /// Per engine: last (epoch, n) applied and the blocks.
    pub engines: HashMap<u64, (FeedVersion, Blocks)>,
    /// Marks received from peers as news (their flushes).
    pub marks: u64,
    /// Keys the marks received as news named.
    pub mark_keys: u64,
    /// Keys of the marks received in transfers of state (snapshots, repairs).
    pub transferred_keys: u64,
    /// Σ others' in-flight per engine as last applied.
    pub peer_load: HashMap<u64, u64>,
    /// The last marks and counts applied, in order: (`b'm'` or `b'l'`, engine); at most 64.
    pub order: std::collections::VecDeque<(u8, u64)>,
    /// The registry's engines as the node told them (upserts and removals applied).
    pub registry: BTreeMap<u64, EngineRecord>,
    /// Removals told of engines the registry above held (a router drops the engine's object,
    /// its breaker and latency with it).
    pub removals: u64,
}

impl SimIndex {
    fn noted(&mut self, kind: u8, engine: u64) {
        if self.order.len() == 64 {
            self.order.pop_front();
        }
        self.order.push_back((kind, engine));
    }

    fn apply(&mut self, a: &FeedApply) {
        let e = self.engines.entry(a.engine).or_default();
        if (a.epoch, a.n) <= e.0 && e.0 != (0, 0) {
            return;
        }
        e.0 = (a.epoch, a.n);
        kvmesh_state::feeds::apply_ops(&mut e.1, &a.ops);
    }
}

/// One simulated router: its core, its index, and per owned engine the next seq it reads.
pub struct SimNode {
    /// The node.
    pub core: MeshCore,
    /// What it applied.
    pub index: SimIndex,
    /// Owned engines → next seq to read.
    pub reading: BTreeMap<u64, u64>,
    /// Warm reported.
    pub warm: bool,
    /// Engines it started reading from their start: no handover (the first owner of an
    /// engine, or nobody answered).
    pub fresh_starts: u64,
}

/// The simulation.
pub struct Sim {
    /// Virtual time (µs).
    pub now: u64,
    /// Its random source.
    pub rng: Rng,
    /// Nodes by index (None: dead).
    pub nodes: Vec<Option<SimNode>>,
    /// Partition group of each node: traffic between groups is dropped.
    pub group: Vec<u8>,
    /// The network.
    pub net: NetConfig,
    /// Engines with KV events.
    pub engines: BTreeMap<u64, SimEngine>,
    /// The core configuration of every node.
    pub cfg: CoreConfig,
    /// In flight: (due, seq, to, from, is_datagram, bytes).
    queue: std::collections::BinaryHeap<std::cmp::Reverse<InFlight>>,
    order: u64,
    /// Bytes delivered per node (received).
    pub bytes_in: Vec<u64>,
    /// When set, bytes delivered by kind, all nodes together (decoded by `tally`).
    pub by_kind: Option<BTreeMap<&'static str, u64>>,
    seed: u64,
}

impl Sim {
    /// `n` nodes (none started), engines `0..engines` with events.
    pub fn new(n: usize, engines: u64, cfg: CoreConfig, net: NetConfig, seed: u64) -> Sim {
        Sim {
            now: 1_000_000,
            rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            nodes: (0..n).map(|_| None).collect(),
            group: vec![0; n],
            net,
            engines: (0..engines)
                .map(|e| (e.wrapping_mul(0x9E37_79B9) | 1, SimEngine::default()))
                .collect(),
            cfg,
            queue: std::collections::BinaryHeap::new(),
            order: 0,
            bytes_in: vec![0; n],
            by_kind: None,
            seed,
        }
    }

    /// `n` nodes started (node 0 the seed of the others), their membership formed, every
    /// engine's first batch published and everything converged within 20 s each, or what
    /// did not ([`Sim::explain`]).
    pub fn in_sync(
        n: usize,
        engines: u64,
        cfg: CoreConfig,
        net: NetConfig,
        seed: u64,
    ) -> Result<Sim, String> {
        let mut s = Sim::new(n, engines, cfg, net, seed);
        s.start_all();
        if s.until(20_000_000, |s| s.membership_converged()).is_none() {
            return Err(format!("seed {seed}: membership did not form"));
        }
        let ids: Vec<u64> = s.engines.keys().copied().collect();
        for e in ids {
            s.engine_event(e);
        }
        if s.until(20_000_000, |s| s.converged()).is_none() {
            return Err(format!("seed {seed}: no convergence\n{}", s.explain()));
        }
        Ok(s)
    }

    /// Starts every node at once, node 0 the seed of the others.
    pub fn start_all(&mut self) {
        self.start(0, None);
        for i in 1..self.nodes.len() {
            self.start(i, Some(0));
        }
    }

    /// Starts (or restarts, with a higher bump) node `i`, announcing to `seed_node`.
    pub fn start(&mut self, i: usize, seed_node: Option<usize>) {
        self.start_named(i, &format!("r{i}"), seed_node);
    }

    /// [`Sim::start`] with another name than `r{i}` (a misconfigured router that takes
    /// another's).
    pub fn start_named(&mut self, i: usize, name: &str, seed_node: Option<usize>) {
        let id = MeshId {
            name: name.to_string(),
            addr: addr(i),
            bump: self.now,
        };
        let mut cfg = self.cfg.clone();
        cfg.first = seed_node.is_none();
        let mut core = MeshCore::new(id, cfg, self.seed ^ (i as u64 * 7919) ^ self.now, self.now);
        let engines: BTreeSet<u64> = self.engines.keys().copied().collect();
        core.set_engines(engines.clone(), engines, self.now);
        if let Some(s) = seed_node {
            core.announce(addr(s), self.now);
        }
        self.nodes[i] = Some(SimNode {
            core,
            index: SimIndex::default(),
            reading: BTreeMap::new(),
            warm: false,
            fresh_starts: 0,
        });
        self.collect(i);
    }

    /// Nodes `i` and `j` open a new connection to each other, as the transport does when a
    /// link comes back after a silence (`MeshCore::peer_connected` on both sides).
    pub fn reconnect(&mut self, i: usize, j: usize) {
        let now = self.now;
        for (a, b) in [(i, j), (j, i)] {
            if let Some(n) = self.nodes[a].as_mut() {
                n.core.peer_connected(addr(b), now);
                self.collect(a);
            }
        }
    }

    /// Node `to` receives `bytes` as an envelope from node `from`'s address, now (what a
    /// peer sends, whatever it is: the hostile-peer test crafts its own).
    pub fn deliver(&mut self, to: usize, from: usize, bytes: &[u8]) {
        let now = self.now;
        if let Some(n) = self.nodes[to].as_mut() {
            let _ = n.core.handle_envelope(addr(from), bytes, now);
            self.collect(to);
        }
    }

    /// Node `i`'s router now has the engines `all` (those of the simulation's among them with
    /// KV events).
    pub fn set_engines(&mut self, i: usize, all: BTreeSet<u64>) {
        let now = self.now;
        let events = all
            .iter()
            .copied()
            .filter(|e| self.engines.contains_key(e))
            .collect();
        if let Some(n) = self.nodes[i].as_mut() {
            n.core.set_engines(all, events, now);
            self.collect(i);
        }
    }

    /// Node `i` leaves the cluster (what a router does on shutdown): its leave goes out, then
    /// it is gone.
    pub fn leave(&mut self, i: usize) {
        let now = self.now;
        if let Some(n) = self.nodes[i].as_mut() {
            n.core.leave(now);
            self.collect(i);
        }
        self.nodes[i] = None;
    }

    /// Kills node `i` without a word.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i] = None;
    }

    /// The live node indices.
    pub fn alive(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].is_some())
            .collect()
    }

    /// Engine `e` (its id) emits a batch: a new block (chained under a random existing one)
    /// or the eviction of one.
    pub fn engine_event(&mut self, engine: u64) {
        let r = self.rng.next_u64();
        let Some(en) = self.engines.get_mut(&engine) else {
            return;
        };
        let mut ops = Vec::new();
        let mut hashes = Vec::new();
        if r.is_multiple_of(4) && !en.truth.is_empty() {
            let k = *en
                .truth
                .keys()
                .nth((r >> 8) as usize % en.truth.len())
                .unwrap_or(&0);
            ops.push(WireOp::Removed(k));
            if let Some(c) = en.truth.get_mut(&k) {
                *c -= 1;
                if *c == 0 {
                    en.truth.remove(&k);
                }
            }
        } else {
            for j in 0..1 + (r >> 20) % 4 {
                let k = (r ^ j.wrapping_mul(0xA24B_AED4_963E_E407)) | 1;
                ops.push(WireOp::Stored(k));
                hashes.push((k.rotate_left(17), j as u32));
                *en.truth.entry(k).or_insert(0) += 1;
            }
        }
        en.batches.push((ops, hashes));
    }

    /// Every owner reads its engines' new batches.
    fn read_events(&mut self) {
        for i in 0..self.nodes.len() {
            let Some(n) = self.nodes[i].as_mut() else {
                continue;
            };
            for (&engine, next) in n.reading.iter_mut() {
                let Some(en) = self.engines.get(&engine) else {
                    continue;
                };
                while (*next as usize) < en.batches.len() {
                    let (ops, hashes) = &en.batches[*next as usize];
                    *next += 1;
                    n.core.local_feed(engine, ops, hashes, false, Some(*next));
                }
            }
        }
        for i in 0..self.nodes.len() {
            self.collect(i);
        }
    }

    fn collect(&mut self, i: usize) {
        let Some(n) = self.nodes[i].as_mut() else {
            return;
        };
        let outs = n.core.take_outputs();
        let mut sends = Vec::new();
        for o in outs {
            match o {
                Output::Datagram(to, b) => sends.push((to, Way::Swim, b.to_vec())),
                Output::Envelope(to, b) => sends.push((to, Way::Stream, b.to_vec())),
                Output::LoadDatagram(to, b) => sends.push((to, Way::LoadDatagram, b.to_vec())),
                Output::Apply(a) => match a {
                    Apply::Feed(f) => n.index.apply(&f),
                    Apply::Mark { mark, live } => {
                        if live {
                            n.index.marks += 1;
                            n.index.mark_keys += mark.keys.len() as u64;
                            n.index.noted(b'm', mark.engine);
                        } else {
                            n.index.transferred_keys += mark.keys.len() as u64;
                        }
                    }
                    Apply::PeerLoad { engine, others } => {
                        n.index.peer_load.insert(engine, others);
                        n.index.noted(b'l', engine);
                    }
                    Apply::Own { engine, from } => {
                        // Resume at the handover's seq, else read the engine from its start
                        // (the sim's replay socket keeps everything).
                        let at = from.and_then(|s| s.next_seq).unwrap_or(0);
                        n.fresh_starts += u64::from(at == 0);
                        n.reading.insert(engine, at);
                    }
                    Apply::Disown { engine } => {
                        n.reading.remove(&engine);
                    }
                    Apply::Warm { .. } => n.warm = true,
                    Apply::EngineUpsert { engine, record } => {
                        n.index.registry.insert(engine, record);
                    }
                    Apply::EngineRemoved { engine } => {
                        if n.index.registry.remove(&engine).is_some() {
                            n.index.removals += 1;
                        }
                    }
                    Apply::Members => {}
                },
            }
        }
        for (to, way, bytes) in sends {
            let dgram = way.datagram();
            let j = index_of(to);
            if j >= self.nodes.len() || self.group[i] != self.group[j] {
                continue;
            }
            let loss = if dgram {
                self.net.datagram_loss
            } else {
                self.net.envelope_loss
            };
            if self.rng.below(100) < loss {
                continue;
            }
            let due = self.now + self.net.delay_us + self.rng.below(self.net.jitter_us + 1);
            if dgram && self.rng.below(1000) < self.net.dup_per_mille {
                let d2 = due + self.rng.below(20_000);
                self.order += 1;
                self.queue.push(std::cmp::Reverse((
                    d2,
                    self.order,
                    j,
                    i,
                    way,
                    bytes.clone(),
                )));
            }
            self.order += 1;
            self.queue
                .push(std::cmp::Reverse((due, self.order, j, i, way, bytes)));
        }
    }

    /// Runs `for_us` of virtual time; `activity(sim)` is called every 10 ms of it.
    pub fn run(&mut self, for_us: u64, mut activity: impl FnMut(&mut Sim)) {
        let end = self.now + for_us;
        let mut next_activity = self.now;
        while self.now < end {
            // The next event: a delivery, a node's timer, or the activity tick.
            let mut t = end.min(next_activity);
            if let Some(std::cmp::Reverse(q)) = self.queue.peek() {
                t = t.min(q.0);
            }
            for n in self.nodes.iter().flatten() {
                t = t.min(n.core.next_due());
            }
            self.now = t.max(self.now);
            while let Some(std::cmp::Reverse(q)) = self.queue.peek() {
                if q.0 > self.now {
                    break;
                }
                let Some(std::cmp::Reverse((_, _, to, from, way, bytes))) = self.queue.pop() else {
                    break;
                };
                if self.group[to] != self.group[from] {
                    continue;
                }
                let now = self.now;
                if let Some(n) = self.nodes[to].as_mut() {
                    self.bytes_in[to] += bytes.len() as u64;
                    if let Some(k) = self.by_kind.as_mut() {
                        tally(k, way == Way::Swim, &bytes, self.cfg.cluster_id);
                    }
                    if way == Way::Swim {
                        n.core.handle_datagram(&bytes, now);
                    } else {
                        let _ = n.core.handle_envelope(addr(from), &bytes, now);
                    }
                    self.collect(to);
                }
            }
            for i in 0..self.nodes.len() {
                let now = self.now;
                if let Some(n) = self.nodes[i].as_mut()
                    && n.core.next_due() <= now
                {
                    n.core.tick(now);
                    // A node alone asks its seed again every second, as the shell does.
                    if n.core.is_alone() && i != 0 && now % 1_000_000 < 10_000 {
                        n.core.announce(addr(0), now);
                    }
                    self.collect(i);
                }
            }
            if self.now >= next_activity {
                next_activity = self.now + 10_000;
                activity(self);
                self.read_events();
            }
        }
    }

    /// Runs until `ok` (checked every 100 ms), at most `max_us`; how long it took.
    pub fn until(&mut self, max_us: u64, mut ok: impl FnMut(&mut Sim) -> bool) -> Option<u64> {
        let start = self.now;
        while self.now - start < max_us {
            if ok(self) {
                return Some(self.now - start);
            }
            self.run(100_000, |_| {});
        }
        ok(self).then(|| self.now - start)
    }

    /// Node `i`'s view of the live members (indices).
    pub fn view(&self, i: usize) -> BTreeSet<usize> {
        self.nodes[i]
            .as_ref()
            .map(|n| n.core.members().map(|m| index_of(m.addr)).collect())
            .unwrap_or_default()
    }

    /// Every live node sees every other live node and no dead one.
    pub fn membership_converged(&self) -> bool {
        let alive = self.alive();
        alive.iter().all(|&i| {
            let want: BTreeSet<usize> = alive.iter().copied().filter(|&j| j != i).collect();
            self.view(i) == want
        })
    }

    /// The live nodes' digests (at the current instant).
    pub fn digests(&mut self) -> Vec<StateDigest> {
        let now = self.now;
        self.nodes
            .iter_mut()
            .flatten()
            .map(|n| n.core.digest(now))
            .collect()
    }

    /// Every live node's index holds exactly every engine's blocks.
    pub fn indexes_exact(&self) -> bool {
        self.nodes.iter().flatten().all(|n| {
            self.engines.iter().all(|(e, en)| {
                n.index
                    .engines
                    .get(e)
                    .map_or(en.truth.is_empty(), |x| x.1 == en.truth)
            })
        })
    }

    /// Every engine has at least one live owner that reads it, in every live node's view.
    pub fn ownership_covered(&self) -> bool {
        let live: BTreeSet<NodeId> = self.nodes.iter().flatten().map(|n| n.core.id()).collect();
        let readers: HashMap<NodeId, &BTreeMap<u64, u64>> = self
            .nodes
            .iter()
            .flatten()
            .map(|n| (n.core.id(), &n.reading))
            .collect();
        self.nodes.iter().flatten().all(|n| {
            self.engines.keys().all(|e| {
                let owners = n.core.owners(*e);
                !owners.is_empty()
                    && owners.iter().any(|o| {
                        live.contains(o) && readers.get(o).is_some_and(|r| r.contains_key(e))
                    })
            })
        })
    }

    /// The first few index mismatches, for a failure message.
    pub fn explain(&self) -> String {
        let mut out = String::new();
        let mut n_bad = 0;
        for (i, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            for (e, en) in &self.engines {
                let got = n.index.engines.get(e);
                if got.map_or(en.truth.is_empty(), |x| x.1 == en.truth) {
                    continue;
                }
                n_bad += 1;
                if n_bad <= 6 {
                    let f = n.core.feed_status(*e);
                    out.push_str(&format!(
                        "node {i} engine {e:x}: index {:?} blocks {} vs truth {}; follows {:?} synced {:?} applied {:?}; owners {:?}; reads {:?}; source head {:?}\n",
                        got.map(|x| x.0),
                        got.map_or(0, |x| x.1.len()),
                        en.truth.len(),
                        f.and_then(|f| f.feed()).map(|x| (x.source.0 % 1000, x.incarnation)),
                        f.map(|f| f.is_synced()),
                        f.map(|f| f.applied()),
                        n.core.owners(*e).iter().map(|o| o.0 % 1000).collect::<Vec<_>>(),
                        n.reading.get(e),
                        f.and_then(|f| f.feed()).and_then(|fid| self.nodes.iter().flatten().find(|m| m.core.id() == fid.source)).and_then(|m| m.core.feed_out(*e)).map(|o| (o.id().incarnation, o.head(), o.len())),
                    ));
                }
            }
        }
        // Membership: who misses whom, who holds whom gone (the first few).
        let alive = self.alive();
        let mut views = Vec::new();
        for &i in &alive {
            let want: BTreeSet<usize> = alive.iter().copied().filter(|&j| j != i).collect();
            let view = self.view(i);
            if view != want {
                let missing: Vec<usize> = want.difference(&view).copied().take(4).collect();
                let extra: Vec<usize> = view.difference(&want).copied().take(4).collect();
                let states: Vec<String> = missing
                    .iter()
                    .map(|&j| {
                        let me = self.nodes[i].as_ref();
                        let them = self.nodes[j].as_ref();
                        format!(
                            "{j}: held as {:?}, is {:?}, holds {i} as {:?}",
                            me.and_then(|n| n.core.membership_state_of(addr(j)))
                                .map(|(m, inc, st)| (m.bump, inc, st)),
                            them.map(|n| n.core.identity().bump),
                            them.and_then(|n| n.core.membership_state_of(addr(i)))
                                .map(|(m, inc, st)| (m.bump, inc, st)),
                        )
                    })
                    .collect();
                views.push(format!(
                    "node {i} (incarnation {}) misses {missing:?} holds {extra:?}; {}",
                    self.nodes[i].as_ref().map_or(0, |n| n.core.identity().bump),
                    states.join("; ")
                ));
            }
        }
        let n_views = views.len();
        views.truncate(6);
        format!(
            "{n_bad} mismatches\n{out}{n_views} membership views differ\n{}",
            views.join("\n")
        )
    }

    /// All converged: membership, digests, indexes, ownership.
    pub fn converged(&mut self) -> bool {
        if !self.membership_converged() || !self.indexes_exact() || !self.ownership_covered() {
            return false;
        }
        let d = self.digests();
        d.windows(2).all(|w| w[0] == w[1])
    }
}

/// Adds a delivered packet's bytes to `kinds`: SWIM datagrams, each delta and control message
/// by its kind, and what the envelope adds around them.
fn tally(kinds: &mut BTreeMap<&'static str, u64>, dgram: bool, bytes: &[u8], cluster_id: u64) {
    use kvmesh_state::{Control, Delta, encoded_len};
    let mut add = |k: &'static str, n: usize| *kinds.entry(k).or_insert(0) += n as u64;
    if dgram {
        add("swim datagrams", bytes.len());
        return;
    }
    let Ok(env) = kvmesh_state::decode(bytes, cluster_id) else {
        add("undecodable", bytes.len());
        return;
    };
    let mut parts = 0;
    for d in &env.deltas {
        let n = encoded_len(d);
        parts += n;
        add(
            match d {
                Delta::Load(_) | Delta::LoadBatch(_) => "load",
                Delta::Mark(_) => "marks",
                Delta::Registry(_) | Delta::Planted(_) => "registry",
                Delta::Feed(_) | Delta::FeedBatches(_) => "feed batches",
                Delta::FeedSnapshot(_) | Delta::Bequest(_) | Delta::SnapshotPart(_) => {
                    "feed snapshots"
                }
            },
            n,
        );
    }
    for c in &env.control {
        let n = encoded_len(c);
        parts += n;
        add(
            match c {
                Control::Digest { .. } => "digests",
                Control::Heads(_) => "feed heads",
                Control::Pull(_) => "feed pulls",
                _ => "other control",
            },
            n,
        );
    }
    add("envelope", bytes.len().saturating_sub(parts));
}
