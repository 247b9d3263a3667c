//! The whole mesh node (foca membership + replicated state + ingest ownership + feeds +
//! dissemination) simulated in virtual time: 32 nodes over a lossy, delaying, duplicating,
//! reordering network, for 50 seeds. Each seed: the cluster forms; engines publish KV events
//! that their owners read while routers write load and marks and add, update and remove
//! registry engines; two routers are killed (one
//! comes back with a new incarnation); the cluster is split in halves and healed. After the
//! heal every live node must agree — same membership, identical state digests, every
//! engine's blocks exactly in every node's index, every engine read by a live owner — and
//! what it holds must stay bounded. Seeded, bounded loops; no sockets, no clock.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim, sim_config};
use kvmesh_state::EngineRecord;

const N: usize = 32;

/// Engines of the replicated registry (ids apart from the sim's event engines), added,
/// updated and removed by random routers all along: about 1 400 changes a seed, half of
/// them removes, which the registry must not keep.
const REGISTRY_ENGINES: u64 = 8;

fn cfg() -> CoreConfig {
    CoreConfig {
        mark_ttls_us: vec![600_000_000],
        ..sim_config(7, N as u32)
    }
}

/// Routers write load and marks, engines publish events, while `busy`.
fn activity(s: &mut Sim) {
    let alive = s.alive();
    if alive.is_empty() {
        return;
    }
    let engines: Vec<u64> = s.engines.keys().copied().collect();
    for _ in 0..2 {
        let e = engines[s.rng.below(engines.len() as u64) as usize];
        s.engine_event(e);
    }
    let i = alive[s.rng.below(alive.len() as u64) as usize];
    let e = engines[s.rng.below(engines.len() as u64) as usize];
    let load = s.rng.below(8) as u32;
    let key = s.rng.next_u64();
    let now = s.now;
    if let Some(n) = s.nodes[i].as_mut() {
        n.core.local_load(e, load);
        // Long-lived marks, so that the check after the heal sees them all.
        n.core
            .local_mark(e, vec![key | 1, key | 3], 0, now + 600_000_000);
    }
    if s.rng.below(4) == 0 {
        let i = alive[s.rng.below(alive.len() as u64) as usize];
        let engine = (1 << 40) + s.rng.below(REGISTRY_ENGINES);
        let remove = s.rng.below(2) == 0;
        let weight_milli = 500 * (1 + s.rng.below(4) as u32);
        if let Some(n) = s.nodes[i].as_mut() {
            if remove {
                n.core.local_engine_remove(engine, s.now);
            } else {
                let record = EngineRecord {
                    url: format!("http://engine-{engine}"),
                    weight_milli,
                    kv_events: String::new(),
                    kv_replay: String::new(),
                    models: vec!["m".into()],
                };
                n.core.local_engine_add(engine, record, now);
            }
        }
    }
}

fn scenario(seed: u64) -> (f64, f64) {
    let mut s = Sim::new(N, 24, cfg(), NetConfig::default(), seed);
    s.start_all();
    s.run(5_000_000, activity);
    let formed = s
        .until(60_000_000, |s| s.membership_converged())
        .unwrap_or_else(|| panic!("seed {seed}: the cluster never formed"));
    let cold: Vec<usize> = s
        .alive()
        .into_iter()
        .filter(|&i| s.nodes[i].as_ref().is_some_and(|n| !n.core.is_warm()))
        .collect();
    assert!(
        cold.is_empty(),
        "seed {seed}: never warm: {cold:?} at {} µs",
        s.now
    );
    s.run(10_000_000, activity);
    // Kill two routers; one comes back as a new incarnation.
    s.kill(3);
    s.kill(17);
    s.run(15_000_000, activity);
    s.start(3, Some(0));
    s.run(5_000_000, activity);
    // Partition into halves, busy on both sides.
    for i in 0..N {
        s.group[i] = u8::from(i >= N / 2);
    }
    s.run(20_000_000, activity);
    for g in &mut s.group {
        *g = 0;
    }
    s.run(2_000_000, activity);
    // Quiet: check that everything converges.
    let healed = s
        .until(90_000_000, |s| s.converged())
        .unwrap_or_else(|| {
            let d = s.digests();
            panic!(
                "seed {seed}: no convergence after the heal: membership {}, indexes {}, ownership {}, digests equal {}\n{}",
                s.membership_converged(),
                s.indexes_exact(),
                s.ownership_covered(),
                d.windows(2).all(|w| w[0] == w[1]),
                s.explain()
            )
        });
    // Bounded: marks within their per-engine bound, feeds within their capacity per owned
    // engine, no load entry of a dead router.
    let live = s.alive().len();
    for n in s.nodes.iter().flatten() {
        let (load, marks, registry, feed_blocks) = n.core.sizes();
        // The registry: its adds present (at most one per engine and router run that wrote
        // it concurrently) and one counter interval per router run (33: router 3 restarted),
        // not a tombstone per remove.
        let runs = N + 1;
        assert!(
            registry <= (REGISTRY_ENGINES as usize + 1) * runs,
            "seed {seed}: {registry} registry entries"
        );
        assert!(
            load <= live * s.engines.len(),
            "seed {seed}: {load} load entries"
        );
        assert!(marks <= 512 * s.engines.len(), "seed {seed}: {marks} marks");
        assert!(feed_blocks <= 4_096 * s.engines.len(), "seed {seed}");
        assert_eq!(n.core.membership_errors(), 0, "seed {seed}");
        // Honest peers stay within the digest budget, partitions and heals included.
        assert_eq!(n.core.counters().digests_ignored, 0, "seed {seed}");
    }
    // From the heal itself: 2 s of load ran after it before the check began.
    (formed as f64 / 1e6, healed as f64 / 1e6 + 2.0)
}

/// Seeds `from..=to` (the suite runs 1..=50 in two tests, one per test thread);
/// `KVMESH_SIM_SEEDS=n` runs only the first `n` of them.
fn seeds(from: u64, to: u64) {
    let limit: u64 = std::env::var("KVMESH_SIM_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX);
    let to = to.min(from.saturating_add(limit).saturating_sub(1));
    let mut heals = Vec::new();
    for seed in from..=to {
        let (formed, healed) = scenario(seed);
        heals.push(healed);
        println!(
            "seed {seed}: formed {formed:.1} s, converged {healed:.1} s after the heal (virtual)"
        );
    }
    heals.sort_by(|a, b| a.total_cmp(b));
    println!(
        "convergence after heal, seeds {from}..={to}: p50 {:.1} s, max {:.1} s (virtual)",
        heals[heals.len() / 2],
        heals[heals.len() - 1]
    );
}

#[test]
fn thirty_two_nodes_converge_after_kills_and_a_partition_seeds_1_to_25() {
    seeds(1, 25);
}

#[test]
fn thirty_two_nodes_converge_after_kills_and_a_partition_seeds_26_to_50() {
    seeds(26, 50);
}
