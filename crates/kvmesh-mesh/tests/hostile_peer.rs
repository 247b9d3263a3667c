//! A member that sends well-formed envelopes full of extreme values (a buggy or compromised
//! router holding a valid certificate: what the decoder lets through, the state must survive).
//! Every delta and control kind, with fields drawn from the edges (0, 1, `u32::MAX`,
//! `u64::MAX`, times far past and far future, ids of routers and engines that do not exist),
//! delivered to one node of a running 3-node cluster in virtual time. Checked: no panic, the
//! node's state stays within its bounds while it is flooded, and once the flood stops the
//! cluster still agrees (the honest nodes' digests equal, every engine owned), no mark
//! outlives the longest mark lifetime (a mark expiring past it is refused) and no count or
//! mark of an engine that exists nowhere is left.

use kvmesh_mesh::core::sim::{NetConfig, Rng, Sim};
use kvmesh_mesh::core::{
    CoreConfig, DIGESTS_PER_PEER_PERIOD, MARK_CLOCK_ALLOWANCE_US, ORPHAN_ENGINES_MAX,
};
use kvmesh_state::{
    Control, Delta, Dot, EngineRecord, Envelope, EnvelopeKind, EnvelopeV1, FeedBatch, FeedBatches,
    FeedHead, FeedId, FeedPull, FeedSnapshot, LoadBatch, LoadDelta, MarkDelta, NodeId, Planted,
    RegistryAdd, RegistryDelta, Seeded, SnapBlock, Span, Stamp, StateDigest, Version, WireOp,
    encode,
};

const CLUSTER: u64 = 77;
const MARK_CAPACITY: usize = 2_048;
const APPROXIMATE_US: u64 = 120_000_000;
const FEED_CAPACITY: usize = 2_048;

fn cfg() -> CoreConfig {
    CoreConfig {
        cluster_id: CLUSTER,
        flush_us: 5_000,
        load_flush_us: 100,
        load_burst: 8,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: MARK_CAPACITY,
        feed_capacity: FEED_CAPACITY,
        mark_ttls_us: vec![2_000_000, APPROXIMATE_US],
        expected_size: 3,
        warm_bound_us: 1_000_000,
        wire_version: 1,
        snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
        first: false,
    }
}

const NET: NetConfig = NetConfig::LOSSLESS;

/// Values from the edges, the real ones (engines, nodes, now) among them.
struct Gen {
    rng: Rng,
    now: u64,
    engines: Vec<u64>,
    /// The honest nodes, and the sender itself.
    nodes: Vec<NodeId>,
    /// The envelopes' sender: `None` = any of `nodes` or any id (impersonation).
    from: Option<NodeId>,
}

impl Gen {
    /// An index below `n`.
    fn index(&mut self, n: usize) -> usize {
        self.rng.below(n as u64) as usize
    }

    fn u64(&mut self) -> u64 {
        let now = self.now;
        match self.rng.below(12) {
            0 => 0,
            1 => 1,
            2 => u64::MAX,
            3 => u64::MAX - self.rng.below(3),
            4 => u64::from(u32::MAX),
            5 => i64::MAX as u64 + self.rng.below(2),
            6 => now,
            7 => now.wrapping_add(self.rng.below(300_000_000)),
            8 => now.saturating_sub(self.rng.below(300_000_000)),
            9 => self.rng.below(16),
            _ => self.rng.next_u64(),
        }
    }

    fn u32(&mut self) -> u32 {
        match self.rng.below(5) {
            0 => 0,
            1 => u32::MAX,
            2 => 1,
            _ => self.rng.next_u64() as u32,
        }
    }

    fn engine(&mut self) -> u64 {
        if self.rng.below(3) == 0 {
            self.u64()
        } else {
            let i = self.index(self.engines.len());
            self.engines[i]
        }
    }

    fn node(&mut self) -> NodeId {
        if self.rng.below(3) == 0 {
            NodeId(self.u64())
        } else {
            let i = self.index(self.nodes.len());
            self.nodes[i]
        }
    }

    fn len(&mut self, max: u64) -> usize {
        match self.rng.below(4) {
            0 => 0,
            1 => max as usize,
            _ => self.rng.below(max + 1) as usize,
        }
    }

    fn version(&mut self) -> Version {
        Version {
            incarnation: self.u64(),
            counter: self.u64(),
        }
    }

    fn feed(&mut self) -> FeedId {
        FeedId {
            source: self.node(),
            incarnation: self.u64(),
        }
    }

    fn op(&mut self) -> WireOp {
        match self.rng.below(5) {
            0 => WireOp::Cleared,
            1 | 2 => WireOp::Removed(self.u64()),
            _ => WireOp::Stored(self.u64()),
        }
    }

    fn ops(&mut self) -> Vec<WireOp> {
        (0..self.len(64)).map(|_| self.op()).collect()
    }

    fn record(&mut self) -> EngineRecord {
        EngineRecord {
            url: [
                "",
                "http://127.0.0.1:1",
                "not a url",
                "http://[::1]:65535/v1",
            ][self.rng.below(4) as usize]
                .to_string(),
            weight_milli: self.u32(),
            kv_events: ["", "tcp://127.0.0.1:1", "garbage"][self.rng.below(3) as usize].into(),
            kv_replay: String::new(),
            models: (0..self.len(3)).map(|i| format!("m{i}")).collect(),
        }
    }

    fn delta(&mut self) -> Delta {
        match self.rng.below(8) {
            0 => Delta::Load(LoadDelta {
                node: self.node(),
                engine: self.engine(),
                version: self.version(),
                in_flight: self.u32(),
            }),
            1 => Delta::LoadBatch(LoadBatch {
                node: self.node(),
                incarnation: self.u64(),
                items: (0..self.len(32))
                    .map(|_| (self.engine(), self.u64() as i64, self.u32()))
                    .collect(),
            }),
            2 => Delta::Mark(MarkDelta {
                engine: self.engine(),
                keys: (0..self.len(40)).map(|_| self.u64()).collect(),
                expiry_us: self.u64(),
            }),
            3 => Delta::Registry(RegistryDelta {
                adds: (0..self.len(4))
                    .map(|_| RegistryAdd {
                        engine: self.engine(),
                        dot: Dot {
                            node: self.node(),
                            counter: self.u64(),
                        },
                        stamp: Stamp {
                            at_us: self.u64(),
                            node: self.node(),
                        },
                        record: self.record(),
                    })
                    .collect(),
                seen: (0..self.len(4))
                    .map(|_| {
                        let (a, b) = (self.u64(), self.u64());
                        Span {
                            node: self.node(),
                            lo: a.min(b),
                            hi: if self.rng.below(4) == 0 { a } else { a.max(b) },
                        }
                    })
                    .collect(),
                seeded: (0..self.len(4))
                    .map(|_| Seeded {
                        engine: self.engine(),
                        record: self.u64(),
                        at_us: self.u64(),
                    })
                    .collect(),
            }),
            4 => Delta::Feed(FeedBatch {
                engine: self.engine(),
                feed: self.feed(),
                n: self.u64(),
                stale: self.rng.below(2) == 0,
                ops: self.ops(),
            }),
            5 => Delta::FeedSnapshot(FeedSnapshot {
                engine: self.engine(),
                feed: self.feed(),
                n: self.u64(),
                stale: self.rng.below(2) == 0,
                next_seq: (self.rng.below(2) == 0).then(|| self.u64()),
                blocks: (0..self.len(64))
                    .map(|_| SnapBlock {
                        key: self.u64(),
                        engine_hash: self.u64(),
                        pos: self.u32(),
                        copies: self.u32(),
                    })
                    .collect(),
            }),
            6 => Delta::Planted(
                (0..self.len(8))
                    .map(|_| Planted {
                        engine: self.engine(),
                        record: self.u64(),
                        at_us: self.u64(),
                        dot: Dot {
                            node: self.node(),
                            counter: self.u64(),
                        },
                    })
                    .collect(),
            ),
            _ => Delta::FeedBatches(FeedBatches {
                feed: self.feed(),
                items: (0..self.len(8))
                    .map(|_| {
                        (
                            self.engine(),
                            self.u64(),
                            self.rng.below(2) == 0,
                            self.ops(),
                        )
                    })
                    .collect(),
            }),
        }
    }

    fn control(&mut self) -> Control {
        match self.rng.below(5) {
            0 => Control::Digest {
                digest: StateDigest {
                    load: self.u64(),
                    marks: self.u64(),
                    registry: self.u64(),
                },
                load_nodes: (0..self.len(8))
                    .map(|_| (self.node(), self.u64(), self.version()))
                    .collect(),
                mark_buckets: (0..self.len(16))
                    .map(|_| (self.u64(), self.u64()))
                    .collect(),
                reply: self.rng.below(2) == 0,
                met: self.rng.below(2) == 0,
            },
            1 => Control::WantState,
            2 => Control::WholeState { chunks: self.u32() },
            3 => Control::Pull(FeedPull {
                engine: self.engine(),
                feed: self.feed(),
                after: self.u64(),
                snapshot: self.rng.below(2) == 0,
            }),
            _ => Control::Heads(
                (0..self.len(8))
                    .map(|_| FeedHead {
                        engine: self.engine(),
                        feed: self.feed(),
                        head: self.u64(),
                    })
                    .collect(),
            ),
        }
    }

    fn envelope(&mut self) -> Vec<u8> {
        let env = EnvelopeV1 {
            cluster_id: CLUSTER,
            from: self.from.unwrap_or_else(|| self.node()),
            kind: [
                EnvelopeKind::Live,
                EnvelopeKind::Repair,
                EnvelopeKind::Snapshot,
            ][self.rng.below(3) as usize],
            sent_us: self.u64(),
            deltas: (0..self.len(6)).map(|_| self.delta()).collect(),
            control: (0..self.len(3)).map(|_| self.control()).collect(),
        };
        encode(&Envelope::V1(env)).expect("the test's envelopes stay within the wire's bounds")
    }
}

/// A 3-node cluster in sync, its engines' feeds read.
fn cluster(seed: u64) -> Sim {
    Sim::in_sync(3, 6, cfg(), NET, seed).unwrap_or_else(|e| panic!("{e}"))
}

/// Rounds of flood, 10 ms of virtual time each.
const ROUNDS: u64 = 100;
/// Envelopes per round.
const PER_ROUND: u64 = 10;

/// 1 s of flood: 10 envelopes every 10 ms from node 0's address to node 1, while the
/// engines keep publishing. Node 1's state stays within bounds throughout.
fn flood(s: &mut Sim, seed: u64, from: Option<NodeId>) {
    let engines: Vec<u64> = s.engines.keys().copied().collect();
    let mut nodes: Vec<NodeId> = (0..3)
        .map(|i| s.nodes[i].as_ref().unwrap().core.id())
        .collect();
    nodes.extend(from);
    let mut g = Gen {
        rng: Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1),
        now: s.now,
        engines: engines.clone(),
        nodes,
        from,
    };
    let received = s.nodes[1]
        .as_ref()
        .unwrap()
        .core
        .counters()
        .envelopes_received;
    for round in 0..ROUNDS {
        g.now = s.now;
        for _ in 0..PER_ROUND {
            let bytes = g.envelope();
            s.deliver(1, 0, &bytes);
        }
        if round % 5 == 0 {
            let e = engines[(round / 5) as usize % engines.len()];
            s.engine_event(e);
        }
        s.run(10_000, |_| {});
        let core = &s.nodes[1].as_ref().unwrap().core;
        let (load, _, registry, blocks) = core.sizes();
        let strays = core
            .held_engines()
            .into_iter()
            .filter(|e| !s.engines.contains_key(e))
            .count();
        assert!(
            strays <= ORPHAN_ENGINES_MAX,
            "{strays} made-up engines held"
        );
        assert!(load <= 100_000, "load entries {load}");
        assert!(registry <= 100_000, "registry entries {registry}");
        assert!(blocks <= 1_000_000, "feed blocks {blocks}");
    }
    let c = s.nodes[1].as_ref().unwrap().core.counters();
    assert!(
        c.envelopes_received - received >= ROUNDS * PER_ROUND,
        "every crafted envelope decodes"
    );
    assert!(
        c.deltas_refused > 0,
        "marks expiring past the horizon were sent"
    );
}

/// A member of its own identity: whatever it sends, once it stops the honest nodes agree
/// again (whatever it left in the shared state, each holds the same), every engine has a
/// live owner and every index matches its engine (no feed of an honest owner was taken over:
/// a feed's parts count only from its source), and no mark outlives the longest lifetime +
/// the clock allowance (the honest nodes made none).
#[test]
fn a_member_sending_extreme_values_breaks_nothing() {
    for seed in 1..=16 {
        let mut s = cluster(seed);
        flood(&mut s, seed, Some(NodeId::from_name("intruder")));
        let settled = s.until(60_000_000, |s| s.converged());
        assert!(
            settled.is_some(),
            "seed {seed}: no agreement after the flood\n{}\nmembers {} owners {} digests {:?} sizes {:?}",
            s.explain(),
            s.membership_converged(),
            s.ownership_covered(),
            s.digests(),
            (0..3)
                .map(|i| s.nodes[i].as_ref().unwrap().core.sizes())
                .collect::<Vec<_>>()
        );
        s.run(APPROXIMATE_US + MARK_CLOCK_ALLOWANCE_US, |_| {});
        for i in 0..3 {
            let core = &s.nodes[i].as_ref().unwrap().core;
            let (_, marks, _, _) = core.sizes();
            assert_eq!(marks, 0, "seed {seed}: node {i} still holds {marks} marks");
            let strays: Vec<u64> = core
                .held_engines()
                .into_iter()
                .filter(|e| !s.engines.contains_key(e))
                .collect();
            assert!(strays.is_empty(), "seed {seed}: node {i} holds {strays:x?}");
        }
    }
}

/// A member that signs as the others (the envelope's sender is its own word: mutual TLS
/// admits members of the cluster, it does not tell them apart when they share a certificate)
/// can feed forged batches of their feeds; the receiver still never panics and stays within
/// its bounds.
#[test]
fn a_member_impersonating_the_others_panics_nothing() {
    for seed in 101..=112 {
        let mut s = cluster(seed);
        flood(&mut s, seed, None);
        s.run(5_000_000, |_| {});
    }
}

/// A member asking for repairs as fast as it can (a digest that matches nothing, 400 in 1 s)
/// gets at most [`DIGESTS_PER_PEER_PERIOD`] answers per anti-entropy period: a digest costs a
/// few bytes, its answer the router's whole state. The honest nodes still agree afterwards.
#[test]
fn a_member_asking_for_repairs_as_fast_as_it_can_gets_a_few() {
    for seed in 201..=204 {
        let mut s = cluster(seed);
        let from = s.nodes[0].as_ref().unwrap().core.id();
        let before = s.nodes[1].as_ref().unwrap().core.counters().digests_ignored;
        let sent: u64 = 400;
        for round in 0..40 {
            for _ in 0..sent / 40 {
                let env = EnvelopeV1 {
                    cluster_id: CLUSTER,
                    from,
                    kind: EnvelopeKind::Live,
                    sent_us: s.now,
                    deltas: Vec::new(),
                    control: vec![Control::Digest {
                        digest: StateDigest {
                            load: round,
                            marks: 0,
                            registry: 0,
                        },
                        load_nodes: Vec::new(),
                        mark_buckets: Vec::new(),
                        reply: true,
                        met: true,
                    }],
                };
                s.deliver(1, 0, &encode(&Envelope::V1(env)).unwrap());
            }
            s.run(25_000, |_| {});
        }
        let ignored = s.nodes[1].as_ref().unwrap().core.counters().digests_ignored - before;
        // The flood spans at most two periods of node 0's window (its honest digests share it).
        let answered = sent - ignored.min(sent);
        assert!(
            answered <= 2 * u64::from(DIGESTS_PER_PEER_PERIOD) && answered <= 16,
            "seed {seed}: {answered} of {sent} answered"
        );
        assert!(
            s.until(10_000_000, |s| s.converged()).is_some(),
            "seed {seed}: {}",
            s.explain()
        );
    }
}
