//! Counts and marks of engines a router does not have (see `kvmesh_mesh::core`'s `engines`
//! module): kept a while, never passed on, bounded in number, gone after their grace; handed
//! to the router when the engine becomes its. Sans-IO, in virtual time.

use kvmesh_mesh::core::sim::{NetConfig, Sim};
use kvmesh_mesh::core::{CoreConfig, ORPHAN_ENGINES_MAX};
use kvmesh_state::{
    Delta, Envelope, EnvelopeKind, EnvelopeV1, LoadDelta, MarkDelta, NodeId, Version, encode,
};
use std::collections::BTreeSet;

const CLUSTER: u64 = 78;
const AE_US: u64 = 1_000_000;
/// An engine no router has at first.
const E: u64 = 0xdead_beef_0000_0001;

fn cfg() -> CoreConfig {
    CoreConfig {
        cluster_id: CLUSTER,
        flush_us: 5_000,
        load_flush_us: 100,
        load_burst: 8,
        anti_entropy_us: AE_US,
        ingest_replicas: 2,
        mark_capacity: 1_024,
        feed_capacity: 1_024,
        mark_ttls_us: vec![2_000_000, 60_000_000],
        expected_size: 3,
        warm_bound_us: 1_000_000,
        wire_version: 1,
        snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
        first: false,
    }
}

const NET: NetConfig = NetConfig::LOSSLESS;

fn cluster(seed: u64) -> Sim {
    Sim::in_sync(3, 4, cfg(), NET, seed).unwrap_or_else(|e| panic!("{e}"))
}

fn sim_engines(s: &Sim) -> BTreeSet<u64> {
    s.engines.keys().copied().collect()
}

fn with(s: &Sim, extra: u64) -> BTreeSet<u64> {
    let mut all = sim_engines(s);
    all.insert(extra);
    all
}

/// Engines node `i` holds something of that are not among the simulation's.
fn strays(s: &Sim, i: usize) -> BTreeSet<u64> {
    let known = sim_engines(s);
    s.nodes[i]
        .as_ref()
        .unwrap()
        .core
        .held_engines()
        .into_iter()
        .filter(|e| !known.contains(e))
        .collect()
}

/// An engine is removed from every router while a count of it is on its way: the receivers
/// keep it a while as an orphan, then drop it; it does not come back through repairs, and
/// the digests agree again. (Before orphans were dropped, such a count stayed in every
/// router's state until its writer left.)
#[test]
fn a_count_that_outlives_its_engine_goes() {
    for seed in 1..=8 {
        let mut s = cluster(seed);
        for i in 0..3 {
            let all = with(&s, E);
            s.set_engines(i, all);
        }
        s.nodes[0].as_mut().unwrap().core.local_load(E, 3);
        assert!(s.until(5_000_000, |s| s.converged()).is_some());
        for i in 0..3 {
            assert!(
                s.nodes[i]
                    .as_ref()
                    .unwrap()
                    .core
                    .held_engines()
                    .contains(&E)
            );
        }
        // Removed at 1 and 2; node 0's next count is already on its way when it removes it.
        for i in [1, 2] {
            let all = sim_engines(&s);
            s.set_engines(i, all);
            assert!(strays(&s, i).is_empty(), "seed {seed}: removed at once");
        }
        s.nodes[0].as_mut().unwrap().core.local_load(E, 2);
        s.run(20_000, |_| {});
        let all = sim_engines(&s);
        s.set_engines(0, all);
        s.run(100_000, |_| {});
        assert!(
            strays(&s, 1).contains(&E),
            "seed {seed}: the late count came"
        );
        let grace = s.nodes[1].as_ref().unwrap().core.orphan_grace_us();
        s.run(grace + 3 * AE_US, |_| {});
        for i in 0..3 {
            assert!(
                strays(&s, i).is_empty(),
                "seed {seed}: node {i} still holds E"
            );
        }
        let dropped: u64 = (1..3)
            .map(|i| {
                s.nodes[i]
                    .as_ref()
                    .unwrap()
                    .core
                    .counters()
                    .orphan_entries_dropped
            })
            .sum();
        assert!(dropped >= 2, "seed {seed}: {dropped} dropped");
        assert!(
            s.until(5_000_000, |s| s.converged()).is_some(),
            "seed {seed}"
        );
    }
}

/// A count and a mark of an engine come before the router has the engine (added through
/// another router's admin API, its record not yet here): once the router has it, both are
/// handed over.
#[test]
fn what_came_before_the_engine_is_handed_over() {
    let mut s = cluster(21);
    for i in [0, 2] {
        let all = with(&s, E);
        s.set_engines(i, all);
    }
    let now = s.now;
    {
        let c = &mut s.nodes[0].as_mut().unwrap().core;
        c.local_load(E, 4);
        c.local_mark(E, vec![11, 12, 13], 0, now + 50_000_000);
    }
    s.run(200_000, |_| {});
    assert_eq!(strays(&s, 1), BTreeSet::from([E]));
    let n1 = s.nodes[1].as_mut().unwrap();
    n1.index.peer_load.clear();
    let transferred = n1.index.transferred_keys;
    let all = with(&s, E);
    s.set_engines(1, all);
    let n1 = s.nodes[1].as_ref().unwrap();
    assert_eq!(
        n1.index.peer_load.get(&E),
        Some(&4),
        "the count handed over"
    );
    assert!(
        n1.index.transferred_keys > transferred,
        "the mark handed over"
    );
    assert_eq!(n1.core.orphan_engines(), 0);
}

/// A member (a broken build) sends counts of a thousand engines that exist nowhere: the
/// receiver keeps those of at most `ORPHAN_ENGINES_MAX` engines and refuses the rest, passes
/// none of them on (the other routers never hold one), and after the grace holds none; the
/// cluster agrees again.
#[test]
fn made_up_engines_stay_bounded_and_local() {
    for seed in 31..=36 {
        let mut s = cluster(seed);
        let n0 = s.nodes[0].as_ref().unwrap().core.identity().clone();
        let from = NodeId::from_name(&n0.name);
        let refused = s.nodes[1].as_ref().unwrap().core.counters().deltas_refused;
        for round in 0..20u64 {
            let deltas: Vec<Delta> = (0..50u64)
                .flat_map(|i| {
                    let engine = (seed << 32) | (round * 50 + i) | 1 << 63;
                    [
                        Delta::Load(LoadDelta {
                            node: from,
                            engine,
                            version: Version {
                                incarnation: n0.bump,
                                counter: 1_000_000 + round * 50 + i,
                            },
                            in_flight: 7,
                        }),
                        Delta::Mark(MarkDelta {
                            engine,
                            keys: vec![engine ^ 5],
                            expiry_us: s.now + 30_000_000,
                        }),
                    ]
                })
                .collect();
            let env = Envelope::V1(EnvelopeV1 {
                cluster_id: CLUSTER,
                from,
                kind: EnvelopeKind::Live,
                sent_us: s.now,
                deltas,
                control: Vec::new(),
            });
            s.deliver(1, 0, &encode(&env).unwrap());
            s.run(50_000, |_| {});
            assert!(strays(&s, 1).len() <= ORPHAN_ENGINES_MAX, "seed {seed}");
            for i in [0, 2] {
                assert!(
                    strays(&s, i).is_empty(),
                    "seed {seed}: node {i} got an orphan"
                );
            }
        }
        let c = s.nodes[1].as_ref().unwrap().core.counters();
        assert!(
            c.deltas_refused - refused >= 2 * (1_000 - ORPHAN_ENGINES_MAX as u64),
            "seed {seed}: refused {}",
            c.deltas_refused - refused
        );
        let grace = s.nodes[1].as_ref().unwrap().core.orphan_grace_us();
        s.run(grace + 3 * AE_US, |_| {});
        for i in 0..3 {
            assert!(
                strays(&s, i).is_empty(),
                "seed {seed}: node {i} holds orphans"
            );
        }
        assert!(
            s.until(10_000_000, |s| s.converged()).is_some(),
            "seed {seed}: {:?}",
            s.digests()
        );
    }
}
