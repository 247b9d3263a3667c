//! The engines of a router's config seed the replicated registry once the router holds the
//! cluster's: a router of the cluster's config adds nothing; an engine the cluster lacks, or
//! holds with another record, is added as that router's config has it (its config takes
//! effect at its start); an engine added or removed through the router before it is warm
//! is no longer its seed. A removal through one router reaches every router, whichever
//! router's config seeded the engine; so does a change of weight. Seeded, sans-IO.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim, sim_config};
use kvmesh_state::EngineRecord;
use std::collections::BTreeMap;

const X: u64 = 1 << 40;
const Y: u64 = (1 << 40) + 1;
const Z: u64 = (1 << 40) + 2;

fn cfg() -> CoreConfig {
    sim_config(11, 3)
}

fn record(engine: u64, weight_milli: u32) -> EngineRecord {
    EngineRecord {
        url: format!("http://engine-{engine}:8000"),
        weight_milli,
        kv_events: String::new(),
        kv_replay: String::new(),
        models: vec![],
    }
}

/// The config every router of the test has: X and Y at weight 1.
fn config() -> Vec<(u64, EngineRecord)> {
    vec![(X, record(X, 1_000)), (Y, record(Y, 1_000))]
}

/// Starts node `i` (seeded by `seed_node`) with `seeds` as its config's engines.
fn start(s: &mut Sim, i: usize, seed_node: Option<usize>, seeds: Vec<(u64, EngineRecord)>) {
    s.start(i, seed_node);
    let now = s.now;
    node(s, i).core.seed_engines(seeds, now);
}

fn node(s: &mut Sim, i: usize) -> &mut kvmesh_mesh::core::sim::SimNode {
    s.nodes[i].as_mut().expect("alive")
}

/// Every live node warm, in one membership, with equal digests, and every node but
/// `except` told the registry `want` (the writer of the last change is not told its own).
fn settled(s: &mut Sim, want: &BTreeMap<u64, EngineRecord>, except: &[usize]) -> bool {
    let ds = s.digests();
    s.membership_converged()
        && ds.windows(2).all(|w| w[0] == w[1])
        && s.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
            .all(|(i, n)| n.core.is_warm() && (except.contains(&i) || &n.index.registry == want))
}

#[test]
fn config_engines_seed_the_registry_and_admin_changes_reach_every_router() {
    for seed in 1..=8 {
        let mut s = Sim::new(3, 0, cfg(), NetConfig::default(), seed);
        start(&mut s, 0, None, config());
        start(&mut s, 1, Some(0), config());
        start(&mut s, 2, Some(0), config());
        let both: BTreeMap<u64, EngineRecord> = config().into_iter().collect();
        // Router 0 is the first: its config is the registry, which routers 1 and 2 get
        // whole at their warm-up and find as their configs have it.
        assert!(
            s.until(30_000_000, |s| settled(s, &both, &[])).is_some(),
            "seed {seed}: the cluster did not settle\n{}",
            s.explain()
        );
        let seeded = |s: &mut Sim, i| node(s, i).core.counters().engines_seeded;
        assert_eq!(seeded(&mut s, 0), 2, "seed {seed}: the first router seeds");
        assert_eq!(
            seeded(&mut s, 1),
            0,
            "seed {seed}: the same config adds nothing"
        );
        assert_eq!(
            seeded(&mut s, 2),
            0,
            "seed {seed}: the same config adds nothing"
        );

        // Router 1 removes X (an engine of everyone's config); router 2 sets Y's weight.
        node(&mut s, 1).core.local_engine_remove(X);
        let now = s.now;
        node(&mut s, 2)
            .core
            .local_engine_add(Y, record(Y, 2_500), now);
        let changed: BTreeMap<u64, EngineRecord> = [(Y, record(Y, 2_500))].into();
        assert!(
            s.until(30_000_000, |s| settled(s, &changed, &[1, 2]))
                .is_some(),
            "seed {seed}: the removal and the weight did not reach every router\n{}",
            s.explain()
        );
        assert_eq!(
            node(&mut s, 1).index.registry.get(&Y),
            Some(&record(Y, 2_500)),
            "seed {seed}: router 1 took router 2's weight"
        );

        // Router 2 restarts with the config: X comes back, Y at its config's weight.
        s.kill(2);
        s.run(200_000, |_| {});
        start(&mut s, 2, Some(0), config());
        assert!(
            s.until(30_000_000, |s| settled(s, &both, &[2])).is_some(),
            "seed {seed}: the restarted router's config did not take effect\n{}",
            s.explain()
        );
        assert_eq!(
            seeded(&mut s, 2),
            2,
            "seed {seed}: X absent, Y another record"
        );

        // Router 1 restarts with Z in its config as well, and Z is removed through it
        // before it is warm: Z is not added. X is removed through router 0 meanwhile.
        s.kill(1);
        s.run(200_000, |_| {});
        let mut with_z = config();
        with_z.push((Z, record(Z, 1_000)));
        start(&mut s, 1, Some(0), with_z);
        node(&mut s, 1).core.local_engine_remove(Z);
        node(&mut s, 0).core.local_engine_remove(X);
        let only_y: BTreeMap<u64, EngineRecord> = [(Y, record(Y, 1_000))].into();
        // Router 1 may have seeded X back if it was warm before the removal reached it;
        // either way every router ends with one registry, without Z.
        assert!(
            s.until(30_000_000, |s| {
                let ds = s.digests();
                s.membership_converged()
                    && ds.windows(2).all(|w| w[0] == w[1])
                    && s.nodes.iter().flatten().all(|n| n.core.is_warm())
            })
            .is_some(),
            "seed {seed}: no agreement after the second restart\n{}",
            s.explain()
        );
        for i in [0, 2] {
            let reg = &node(&mut s, i).index.registry;
            assert!(!reg.contains_key(&Z), "seed {seed}: Z reached router {i}");
            assert_eq!(reg.get(&Y), only_y.get(&Y), "seed {seed}: router {i}'s Y");
        }
    }
}
