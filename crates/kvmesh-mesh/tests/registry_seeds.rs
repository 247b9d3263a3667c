//! The engines of a router's config seed the replicated registry once the router holds the
//! cluster's: a router of the cluster's config adds nothing; an engine the cluster lacks, or
//! holds with another record, is added as that router's config has it, unless a config seeded
//! that record before: a router restarting with its config leaves the run-time changes made
//! since (a removal, a weight), one whose config changed the record puts it in. An engine
//! added or removed through the router before it is warm is no longer its seed. A removal
//! through one router reaches every router, whichever router's config seeded the engine; so
//! does a change of weight. Seeded, sans-IO.

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

/// Starts node `i` (seeded by `seed_node`) with `seeds` as its config's engines, which its
/// router has from the start (as the gateway adds its config's engines before the mesh).
fn start(s: &mut Sim, i: usize, seed_node: Option<usize>, seeds: Vec<(u64, EngineRecord)>) {
    s.start(i, seed_node);
    let now = s.now;
    let n = node(s, i);
    n.index.registry.extend(seeds.iter().cloned());
    n.core.seed_engines(seeds, now);
}

fn node(s: &mut Sim, i: usize) -> &mut kvmesh_mesh::core::sim::SimNode {
    s.nodes[i].as_mut().expect("alive")
}

/// Every live node warm, in one membership, with equal digests, and every node
/// told the registry `want` (the writers of changes included: see
/// `changes_of_one_engine_made_at_once_through_two_routers_end_the_same_everywhere`).
fn settled(s: &mut Sim, want: &BTreeMap<u64, EngineRecord>) -> bool {
    let ds = s.digests();
    s.membership_converged()
        && ds.windows(2).all(|w| w[0] == w[1])
        && s.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
            .all(|(_, n)| n.core.is_warm() && &n.index.registry == want)
}

/// Three routers of [`config`], settled. Router 0 is the first (no seeds): warm at once, its
/// config waits for the cluster's registry like every router's.
fn three_of_one_config(seed: u64) -> Sim {
    three_of_one_config_with(cfg(), seed)
}

/// [`three_of_one_config`] with the nodes' configuration `c`.
fn three_of_one_config_with(c: CoreConfig, seed: u64) -> Sim {
    three_started_together(c, seed, config())
}

/// Three routers with `engines` as their config, started together (router 0 without seeds,
/// the others seeded by it), settled.
fn three_started_together(c: CoreConfig, seed: u64, engines: Vec<(u64, EngineRecord)>) -> Sim {
    let mut s = Sim::new(3, 0, c, NetConfig::default(), seed);
    start(&mut s, 0, None, engines.clone());
    start(&mut s, 1, Some(0), engines.clone());
    start(&mut s, 2, Some(0), engines.clone());
    let all: BTreeMap<u64, EngineRecord> = engines.into_iter().collect();
    assert!(
        s.until(30_000_000, |s| settled(s, &all)).is_some(),
        "seed {seed}: the cluster did not settle\n{}",
        s.explain()
    );
    s
}

/// Per router of the first `n`, the removals its node told it of engines it held.
fn removals(s: &Sim, n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| s.nodes[i].as_ref().expect("alive").index.removals)
        .collect()
}

/// At run time, X removed through router `remove_at` and Y's weight set to 2.5 through
/// `reweigh_at`; returns the registry that follows.
fn change(s: &mut Sim, remove_at: usize, reweigh_at: usize) -> BTreeMap<u64, EngineRecord> {
    let now = s.now;
    node(s, remove_at).core.local_engine_remove(X, now);
    node(s, reweigh_at)
        .core
        .local_engine_add(Y, record(Y, 2_500), now);
    [(Y, record(Y, 2_500))].into()
}

/// Asserts that every router comes to hold `want` (the writers of changes too) within
/// `within_us`, and still does 3 s later.
fn holds(s: &mut Sim, want: &BTreeMap<u64, EngineRecord>, within_us: u64, what: &str) {
    assert!(
        s.until(within_us, |s| settled(s, want)).is_some(),
        "{what}\n{}",
        s.explain()
    );
    s.run(3_000_000, |_| {});
    assert!(settled(s, want), "{what}: 3 s later");
}

#[test]
fn config_engines_seed_the_registry_and_admin_changes_reach_every_router() {
    for seed in 1..=8 {
        let mut s = three_of_one_config(seed);
        let seeded = |s: &mut Sim, i| node(s, i).core.counters().engines_seeded;
        // The routers that held the (empty) registry first put the config in, the same
        // records (a router without seeds waits for the cluster's registry too, so routers
        // joining it at once may each plant them); none adds anything else.
        let counts: Vec<u64> = (0..3).map(|i| seeded(&mut s, i)).collect();
        assert!(
            counts.iter().all(|&c| c <= 2) && counts.contains(&2),
            "seed {seed}: {counts:?}"
        );

        // Router 1 removes X (an engine of everyone's config); router 2 sets Y's weight.
        {
            let now = s.now;
            node(&mut s, 1).core.local_engine_remove(X, now);
        }
        let now = s.now;
        node(&mut s, 2)
            .core
            .local_engine_add(Y, record(Y, 2_500), now);
        let changed: BTreeMap<u64, EngineRecord> = [(Y, record(Y, 2_500))].into();
        assert!(
            s.until(30_000_000, |s| settled(s, &changed)).is_some(),
            "seed {seed}: the removal and the weight did not reach every router\n{}",
            s.explain()
        );
        assert_eq!(
            node(&mut s, 1).index.registry.get(&Y),
            Some(&record(Y, 2_500)),
            "seed {seed}: router 1 took router 2's weight"
        );

        // Router 2 restarts with its config unchanged: the run-time changes hold (X stays
        // removed, Y at 2.5); a config record seeded before is not planted again.
        s.kill(2);
        s.run(200_000, |_| {});
        start(&mut s, 2, Some(0), config());
        assert!(
            s.until(30_000_000, |s| settled(s, &changed)).is_some(),
            "seed {seed}: a restart with the same config undid the run-time changes\n{}",
            s.explain()
        );
        s.run(1_000_000, |_| {});
        assert_eq!(
            node(&mut s, 2).index.registry,
            changed,
            "seed {seed}: after 1 s"
        );
        assert_eq!(seeded(&mut s, 2), 0, "seed {seed}: nothing planted");
        assert_eq!(
            node(&mut s, 2).core.counters().seeds_superseded,
            2,
            "seed {seed}: X removed and Y changed since they were seeded"
        );

        // Router 2 restarts with Y's weight changed in its config: the new record is put in.
        s.kill(2);
        s.run(200_000, |_| {});
        let y3 = vec![(X, record(X, 1_000)), (Y, record(Y, 3_000))];
        start(&mut s, 2, Some(0), y3);
        let only_y3: BTreeMap<u64, EngineRecord> = [(Y, record(Y, 3_000))].into();
        assert!(
            s.until(30_000_000, |s| settled(s, &only_y3)).is_some(),
            "seed {seed}: the changed config record did not take effect\n{}",
            s.explain()
        );
        assert_eq!(seeded(&mut s, 2), 1, "seed {seed}: Y's new record only");

        // Router 1 restarts with Z in its config as well, and Z is removed through it
        // before it is warm: Z is not added.
        s.kill(1);
        s.run(200_000, |_| {});
        let mut with_z = config();
        with_z.push((Z, record(Z, 1_000)));
        start(&mut s, 1, Some(0), with_z);
        // (An admin removal takes the engine out of the router's own registry at once.)
        node(&mut s, 1).index.registry.remove(&Z);
        {
            let now = s.now;
            node(&mut s, 1).core.local_engine_remove(Z, now);
        }
        assert!(
            s.until(30_000_000, |s| settled(s, &only_y3)).is_some(),
            "seed {seed}: no agreement after the last restart\n{}",
            s.explain()
        );
        s.run(1_000_000, |_| {});
        for i in 0..3 {
            let reg = &node(&mut s, i).index.registry;
            assert_eq!(reg, &only_y3, "seed {seed}: router {i}'s registry");
        }
    }
}

/// A router that restarts cut off from every peer warms up by the warm-up time without the
/// cluster's state. Its config's engines are its to route to meanwhile, but they enter the
/// registry only once it holds the cluster's: when the partition heals, the run-time changes
/// (an engine removed, a weight set) hold, and its config plants nothing they superseded.
/// (Found by QA across builds: planted at the warm-up time, they were new writes that undid
/// the admin's weights on every router.)
#[test]
fn a_router_restarted_alone_does_not_undo_run_time_changes_when_it_meets_the_cluster() {
    for seed in 1..=8 {
        let mut s = three_of_one_config(seed);
        // At run time: X removed through router 0, Y's weight set through router 1.
        let changed = change(&mut s, 0, 1);
        let what = format!("seed {seed}: the changes did not spread");
        holds(&mut s, &changed, 30_000_000, &what);
        // Router 2 restarts behind a partition: no peer answers within its warm-up time.
        s.kill(2);
        s.run(200_000, |_| {});
        s.group[2] = 1;
        start(&mut s, 2, Some(0), config());
        assert!(
            s.until(30_000_000, |s| node(s, 2).core.is_warm()).is_some(),
            "seed {seed}: router 2 never served alone"
        );
        s.run(2_000_000, |_| {});
        assert_eq!(
            node(&mut s, 2).core.counters().engines_seeded,
            0,
            "seed {seed}: nothing planted without the cluster's registry"
        );
        // The partition heals: the cluster keeps its run-time changes, router 2 takes them.
        s.group[2] = 0;
        let what = format!("seed {seed}: the run-time changes did not hold");
        holds(&mut s, &changed, 60_000_000, &what);
        assert_eq!(
            node(&mut s, 2).core.counters().engines_seeded,
            0,
            "seed {seed}"
        );
    }
}

/// The first router (no seeds, warm at once) restarted into the running cluster with its
/// config unchanged: the run-time changes made meanwhile hold. (Found by QA: it planted its
/// config at its start, before meeting a peer, as new writes that undid the admin's removal
/// and weight on every router.)
#[test]
fn the_first_router_restarted_does_not_undo_run_time_changes() {
    for seed in 1..=8 {
        let mut s = three_of_one_config(seed);
        let changed = change(&mut s, 1, 2);
        let what = format!("seed {seed}: the changes did not spread");
        holds(&mut s, &changed, 30_000_000, &what);
        s.kill(0);
        s.run(200_000, |_| {});
        start(&mut s, 0, None, config());
        let what = format!("seed {seed}: the first router's restart undid the run-time changes");
        holds(&mut s, &changed, 30_000_000, &what);
        assert_eq!(
            node(&mut s, 0).core.counters().engines_seeded,
            0,
            "seed {seed}: nothing planted over the changes"
        );
    }
}

/// A router serving alone (its seeds unreachable, warm by its warm-up time) takes run-time
/// changes of its config's engines; a router of the same config joining it later does not
/// plant that config over them. (Found by QA: the joining router put back the removed
/// engine and the old weight, on both.)
#[test]
fn changes_made_on_a_router_alone_hold_when_another_joins() {
    for seed in 1..=8 {
        let mut s = Sim::new(2, 0, cfg(), NetConfig::default(), seed);
        start(&mut s, 0, Some(1), config());
        assert!(
            s.until(30_000_000, |s| node(s, 0).core.is_warm()).is_some(),
            "seed {seed}: router 0 never warmed alone"
        );
        node(&mut s, 0).index.registry.remove(&X);
        let changed = change(&mut s, 0, 0);
        s.run(1_000_000, |_| {});
        start(&mut s, 1, Some(0), config());
        let what = format!("seed {seed}: the joining router undid the changes");
        holds(&mut s, &changed, 30_000_000, &what);
    }
}

/// Kills routers 0 and 1 and starts them again together: router 0 without seeds (odd seeds)
/// or seeded by router 1 (even seeds: the README's layout), router 1 seeded by router 0.
fn restart_two_together(s: &mut Sim, seed: u64) {
    s.kill(0);
    s.kill(1);
    s.run(200_000, |_| {});
    start(s, 0, seed.is_multiple_of(2).then_some(1), config());
    start(s, 1, Some(0), config());
}

/// Two routers restarted together while the third runs on with the run-time changes: the
/// first (no seeds) and one whose seed is the first, or two whose seeds are each other (the
/// README's layout). The two meet each other first, find each other's registry empty and
/// plant their config; those plants lose to the config's first planting, which the third
/// router remembers, so the run-time changes hold on every router. (Found by QA, 3 of 3 runs:
/// the removed engine and the old weight came back everywhere.)
#[test]
fn two_routers_restarted_together_do_not_undo_run_time_changes() {
    for seed in 1..=16 {
        let mut s = three_of_one_config(seed);
        let changed = change(&mut s, 1, 2);
        let what = format!("seed {seed}: the changes did not spread");
        holds(&mut s, &changed, 30_000_000, &what);
        restart_two_together(&mut s, seed);
        let what = format!("seed {seed}: two routers restarted together undid the changes");
        holds(&mut s, &changed, 60_000_000, &what);
        // Each restarted router was told to remove X (removed at run time), and nothing else:
        // Y, whose weight changed, was updated in place.
        assert_eq!(removals(&s, 2), [1, 1], "seed {seed}: removals told");
    }
}

/// The same after an upgrade: the config's records were planted by routers that did not
/// tell their plants (envelope version 1, as builds before plants were), then every router
/// was restarted on version 2, one at a time. No router remembers a first plant of those
/// records, but their notes say when they were first seeded: a later plant of one is void
/// all the same. (QA: 2 of 2 runs undone after a rolling upgrade.)
#[test]
fn two_routers_restarted_together_after_an_upgrade_do_not_undo_run_time_changes() {
    for seed in 1..=8 {
        let v1 = CoreConfig {
            wire_version: 1,
            ..cfg()
        };
        let mut s = three_of_one_config_with(v1, seed);
        let both: BTreeMap<u64, EngineRecord> = config().into_iter().collect();
        let what = format!("seed {seed}: the cluster did not hold its config");
        holds(&mut s, &both, 30_000_000, &what);
        let changed = change(&mut s, 1, 2);
        let what = format!("seed {seed}: the changes did not spread");
        holds(&mut s, &changed, 30_000_000, &what);
        // The rolling upgrade: each router restarted with the same config, writing version 2.
        s.cfg.wire_version = 2;
        for (i, seed_node) in [(0, Some(1)), (1, Some(0)), (2, Some(0))] {
            s.kill(i);
            s.run(200_000, |_| {});
            start(&mut s, i, seed_node, config());
            let what = format!("seed {seed}: router {i}'s upgrade undid the changes");
            holds(&mut s, &changed, 30_000_000, &what);
        }
        restart_two_together(&mut s, seed);
        let what = format!("seed {seed}: two routers restarted together undid the changes");
        holds(&mut s, &changed, 60_000_000, &what);
    }
}

/// Routers of one config started together plant it concurrently; the plants after the first
/// are void. A router whose own plant a peer's voids still holds the engine (the peer's add
/// comes with it), so it is never told to remove a config engine: that drops the router's
/// engine object (its breaker, latency and slow start, the reader of its KV events) to add
/// it back a moment later. (QA: routers cold-started together removed and re-added their
/// config engines as they warmed.)
#[test]
fn routers_started_together_never_drop_their_config_engines() {
    for seed in 1..=32 {
        let s = three_of_one_config(seed);
        let what = format!("seed {seed}: config engines told removed");
        assert_eq!(removals(&s, 3), [0, 0, 0], "{what}");
    }
    // A config of 1,500 engines: a router's plants fill more than one envelope, and the
    // envelopes of a flush arrive in any order.
    let big: Vec<(u64, EngineRecord)> = (0..1_500).map(|i| (X + i, record(X + i, 1_000))).collect();
    for seed in 1..=4 {
        let s = three_started_together(cfg(), seed, big.clone());
        let what = format!("seed {seed}: 1,500 config engines: told removed");
        assert_eq!(removals(&s, 3), [0, 0, 0], "{what}");
    }
}

/// Two changes of one engine made at once through two routers: each router changes its own
/// engines first and tells its node after, so the peer's change can reach a router in
/// between. Whichever change the registry keeps, every router comes to hold it, the writers
/// included (QA: a router kept the change the cluster dropped, for good, while every digest
/// agreed). Both orders of the two changes' times, a weight against a weight and a removal
/// against a weight.
#[test]
fn changes_of_one_engine_made_at_once_through_two_routers_end_the_same_everywhere() {
    for seed in 1..=8 {
        for (remove, first) in [(false, 0usize), (false, 1), (true, 0), (true, 1)] {
            let mut s = three_of_one_config(seed);
            let (a, b) = (first, 1 - first);
            let now = s.now;
            // Router a's change, in its router first.
            if remove {
                node(&mut s, a).index.registry.remove(&Y);
            } else {
                node(&mut s, a).index.registry.insert(Y, record(Y, 2_000));
            }
            // Router b's change, made a moment later, reaches a's router before a's node
            // hears of a's own.
            node(&mut s, b).index.registry.insert(Y, record(Y, 3_000));
            node(&mut s, b)
                .core
                .local_engine_add(Y, record(Y, 3_000), now + 1);
            assert!(
                s.until(5_000_000, |s| node(s, a).index.registry.get(&Y)
                    == Some(&record(Y, 3_000)))
                    .is_some(),
                "seed {seed}: b's change reached a"
            );
            let now = s.now;
            if remove {
                node(&mut s, a).core.local_engine_remove(Y, now);
            } else {
                node(&mut s, a)
                    .core
                    .local_engine_add(Y, record(Y, 2_000), now);
            }
            assert!(
                s.until(10_000_000, |s| {
                    let ds = s.digests();
                    let want = &node(s, 0).index.registry.clone();
                    ds.windows(2).all(|w| w[0] == w[1])
                        && (0..3).all(|i| &node(s, i).index.registry == want)
                })
                .is_some(),
                "seed {seed}, remove {remove}, first {first}: the routers hold different registries: {:?}",
                (0..3)
                    .map(|i| node(&mut s, i).index.registry.get(&Y).cloned())
                    .collect::<Vec<_>>()
            );
        }
    }
}
