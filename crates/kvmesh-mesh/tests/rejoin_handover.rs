//! A router that restarts (the cluster's seed included), or joins a running cluster, takes
//! the engines it comes to own by handover from their owners — never by reading them afresh
//! while it is still alone. (A
//! joining router used to own every engine alone at its start, before it met anyone; once it
//! met the cluster, the engines it kept were followed from those new feeds, and what the
//! engines' replay no longer held vanished from every router's index.) Seeded, sans-IO.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim, sim_config};

const ENGINES: u64 = 24;

fn cfg(ingest_replicas: usize) -> CoreConfig {
    CoreConfig {
        ingest_replicas,
        ..sim_config(9, 4)
    }
}

fn events(s: &mut Sim) {
    let engines: Vec<u64> = s.engines.keys().copied().collect();
    let e = engines[s.rng.below(engines.len() as u64) as usize];
    s.engine_event(e);
}

#[test]
fn a_restarted_or_new_router_takes_its_engines_by_handover() {
    for seed in 1..=16 {
        let r = 1 + (seed as usize % 2);
        let mut s = Sim::in_sync(4, ENGINES, cfg(r), NetConfig::LOSSLESS, seed).expect("formed");
        s.run(1_000_000, events);
        // Routers 2 and 3 are killed; the others see them go and take their engines over.
        s.kill(2);
        s.kill(3);
        let gone = s.until(30_000_000, |s| s.membership_converged() && s.converged());
        assert!(
            gone.is_some(),
            "seed {seed}: no convergence after the kill\n{}",
            s.explain()
        );
        s.run(1_000_000, events);
        // They come back (new incarnations), one seeded by router 0, the other by router 1.
        let fresh_before: Vec<u64> = s.nodes.iter().flatten().map(|n| n.fresh_starts).collect();
        s.start(2, Some(0));
        s.run(200_000, events);
        s.start(3, Some(1));
        let back = s.until(30_000_000, |s| s.membership_converged() && s.converged());
        assert!(
            back.is_some(),
            "seed {seed}: no convergence after the rejoin\n{}",
            s.explain()
        );
        for i in [2, 3] {
            let n = s.nodes[i].as_ref().expect("alive");
            assert!(
                !n.reading.is_empty(),
                "seed {seed}: router {i} owns engines ({} of {ENGINES} among 4 routers)",
                n.reading.len()
            );
            assert_eq!(
                n.fresh_starts, 0,
                "seed {seed}: router {i} read {} engine(s) afresh instead of taking them over",
                n.fresh_starts
            );
        }
        let fresh_after: Vec<u64> = s.nodes.iter().flatten().map(|n| n.fresh_starts).collect();
        assert_eq!(
            fresh_before,
            fresh_after[..2],
            "seed {seed}: the routers that stayed started nothing afresh"
        );
        // The first router (no seeds of its own: the others' seed) comes back.
        s.run(1_000_000, events);
        s.kill(0);
        let gone = s.until(30_000_000, |s| s.membership_converged() && s.converged());
        assert!(
            gone.is_some(),
            "seed {seed}: no convergence after the seed's kill"
        );
        s.run(1_000_000, events);
        s.start(0, None);
        let back = s.until(30_000_000, |s| s.membership_converged() && s.converged());
        assert!(
            back.is_some(),
            "seed {seed}: the seed did not come back\n{}",
            s.explain()
        );
        let n = s.nodes[0].as_ref().expect("alive");
        assert_eq!(
            n.fresh_starts, 0,
            "seed {seed}: the restarted seed read {} engine(s) afresh",
            n.fresh_starts
        );
    }
}

#[test]
fn a_router_whose_seeds_never_answer_takes_every_engine_after_the_warm_up() {
    let mut s = Sim::new(2, ENGINES, cfg(2), NetConfig::LOSSLESS, 4);
    // Its seed (router 1) is never started.
    s.start(0, Some(1));
    s.run(1_000_000, events);
    let n = s.nodes[0].as_ref().expect("alive");
    assert!(n.reading.is_empty(), "alone and cold, it owns nothing yet");
    assert!(!n.warm);
    let at = s.until(10_000_000, |s| {
        s.nodes[0]
            .as_ref()
            .is_some_and(|n| n.warm && n.reading.len() == ENGINES as usize)
    });
    assert!(
        at.is_some(),
        "after the warm-up it is the cluster and reads every engine"
    );
    s.run(1_000_000, events);
    assert!(s.indexes_exact(), "{}", s.explain());
}

/// QA: two routers that owned an engine stopped together (a rolling restart two at a time, a
/// scale-down): the router that came to own it had nobody to ask for its feed and read it
/// afresh, routed approximately until the engine's next cache reset. A router that leaves
/// now hands each feed it reads to the routers that read it without it.
#[test]
fn routers_that_leave_together_bequeath_their_feeds() {
    for seed in 1..=16 {
        let mut s = Sim::in_sync(5, ENGINES, cfg(2), NetConfig::LOSSLESS, seed).expect("formed");
        s.run(1_000_000, events);
        let fresh_before: Vec<u64> = s.nodes.iter().flatten().map(|n| n.fresh_starts).collect();
        // Routers 3 and 4 stop at the same moment; 0, 1 and 2 take over what they read (some
        // engines were read by both).
        s.leave(3);
        s.leave(4);
        let gone = s.until(30_000_000, |s| s.membership_converged() && s.converged());
        assert!(
            gone.is_some(),
            "seed {seed}: no convergence after the leave\n{}",
            s.explain()
        );
        s.run(1_000_000, events);
        // Quiet for a moment: the last batches arrive.
        s.run(500_000, |_| {});
        assert!(s.indexes_exact(), "seed {seed}: {}", s.explain());
        let fresh_after: Vec<u64> = s.nodes.iter().flatten().map(|n| n.fresh_starts).collect();
        let taken: u64 = s
            .nodes
            .iter()
            .flatten()
            .map(|n| n.core.counters().bequests_taken)
            .sum();
        assert!(taken > 0, "seed {seed}: no bequest taken up");
        assert_eq!(
            fresh_before[..3],
            fresh_after,
            "seed {seed}: the routers that stayed read engines afresh instead of taking the \
             leavers' feeds"
        );
    }
}

/// Feeds too large for one envelope go in parts (here parts of 4 blocks, so that the sim's
/// small feeds are split): handovers, bequests and followers' resyncs put them together and
/// end as exact as whole snapshots do.
#[test]
fn feeds_sent_in_parts_hand_over_and_resynchronise_exactly() {
    for seed in 1..=8 {
        let cfg = CoreConfig {
            snapshot_part_blocks: 4,
            ..cfg(2)
        };
        let mut s = Sim::in_sync(5, ENGINES, cfg, NetConfig::LOSSLESS, seed).expect("formed");
        s.run(1_000_000, events);
        let fresh_before: Vec<u64> = s.nodes.iter().flatten().map(|n| n.fresh_starts).collect();
        s.leave(3);
        s.leave(4);
        let gone = s.until(30_000_000, |s| s.membership_converged() && s.converged());
        assert!(gone.is_some(), "seed {seed}: {}", s.explain());
        // A router comes back: it is handed the engines it comes to own, and follows the rest.
        s.start(3, Some(0));
        let back = s.until(30_000_000, |s| s.membership_converged() && s.converged());
        assert!(back.is_some(), "seed {seed}: {}", s.explain());
        s.run(1_000_000, events);
        s.run(500_000, |_| {});
        assert!(s.indexes_exact(), "seed {seed}: {}", s.explain());
        let fresh_after: Vec<u64> = s.nodes.iter().flatten().map(|n| n.fresh_starts).collect();
        assert_eq!(fresh_before[..3], fresh_after[..3], "seed {seed}");
        assert_eq!(
            fresh_after[3], 0,
            "seed {seed}: the new router took its engines over"
        );
        let parts: u64 = s
            .nodes
            .iter()
            .flatten()
            .map(|n| n.core.counters().snapshot_parts)
            .sum();
        assert!(parts > 0, "seed {seed}: no snapshot went in parts");
        let refused: u64 = s
            .nodes
            .iter()
            .flatten()
            .map(|n| n.core.counters().deltas_refused)
            .sum();
        assert_eq!(refused, 0, "seed {seed}");
    }
}

/// QA: a router restarted, and the two routers that read an engine stopped together the
/// moment it was ready: in their view it read the engine already (it was one of its owners),
/// so neither handed the engine to it, while it still waited for their handover — and read
/// the engine afresh once they were gone.
#[test]
fn routers_that_leave_as_a_restarted_router_waits_for_their_handover_bequeath_it() {
    for seed in 1..=16 {
        let mut s = Sim::in_sync(3, ENGINES, cfg(2), NetConfig::LOSSLESS, seed).expect("formed");
        s.run(1_000_000, events);
        s.kill(0);
        let gone = s.until(30_000_000, |s| s.membership_converged() && s.converged());
        assert!(gone.is_some(), "seed {seed}: {}", s.explain());
        s.run(500_000, events);
        s.start(0, Some(1));
        // The moment it is warm and both others know it (they count it among the engines'
        // owners): its handovers are still on their way.
        let warm = s.until(10_000_000, |s| {
            s.nodes[0].as_ref().is_some_and(|n| n.warm)
                && s.view(1).contains(&0)
                && s.view(2).contains(&0)
        });
        assert!(warm.is_some(), "seed {seed}: router 0 never warm");
        s.leave(1);
        s.leave(2);
        s.run(10_000_000, |_| {});
        let n = s.nodes[0].as_ref().expect("alive");
        assert_eq!(
            n.reading.len(),
            ENGINES as usize,
            "seed {seed}: router 0 reads every engine"
        );
        assert_eq!(
            n.fresh_starts, 0,
            "seed {seed}: router 0 read {} engine(s) afresh",
            n.fresh_starts
        );
    }
}
