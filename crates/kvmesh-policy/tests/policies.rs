//! Every policy over simulated snapshots: candidate lists, fairness, ties, weights,
//! power-of-two, panic mode and determinism.

use kvmesh_policy::{
    EngineMember, EngineView, MAX_CANDIDATES, Policy, PolicyConfig, PolicyKind, PrefixInput,
    PrefixMatch, Reason, RequestCtx, Rng, stable_hash,
};
use proptest::prelude::*;

fn members(n: usize) -> Vec<EngineMember> {
    (0..n)
        .map(|i| EngineMember::new(stable_hash(format!("http://10.0.0.{i}:8000").as_bytes())))
        .collect()
}

fn policy(kind: PolicyKind, n: usize, candidates: usize, seed: u64) -> Policy {
    let cfg = PolicyConfig {
        policy: kind,
        candidates,
        ..PolicyConfig::default()
    };
    Policy::new(&cfg, &members(n), seed)
}

fn view(load: u32, weight: f64, eligible: bool, latency_us: f64) -> EngineView {
    let mut v = EngineView::new(weight);
    v.in_flight = load;
    v.eligible = eligible;
    v.latency_us = latency_us;
    v
}

fn ctx(seed: u64) -> RequestCtx<'static> {
    RequestCtx::new(seed, 1_000).with_hash_key(stable_hash(&seed.to_le_bytes()))
}

/// Counts of first choices over `rounds` decisions.
fn first_choices(p: &Policy, views: &[EngineView], rounds: u64) -> Vec<u64> {
    let mut counts = vec![0; views.len()];
    let mut out = Vec::with_capacity(MAX_CANDIDATES);
    for s in 0..rounds {
        p.pick(views, &ctx(s), &mut out);
        counts[out[0]] += 1;
    }
    counts
}

fn assert_even(counts: &[u64], tolerance: f64, what: &str) {
    let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
    for (i, &c) in counts.iter().enumerate() {
        assert!(
            (c as f64 - mean).abs() <= tolerance * mean,
            "{what}: engine {i} got {c}, mean {mean}: {counts:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Candidates are distinct, valid, eligible when any engine is, and as many as asked
    /// (bounded by the number of usable engines).
    #[test]
    fn candidate_lists_are_well_formed(
        engines in prop::collection::vec((0u32..20, 0.1f64..4.0, prop::bool::weighted(0.7), 1.0f64..1e6), 1..40),
        k in 1usize..=MAX_CANDIDATES,
        seed in any::<u64>(),
    ) {
        let views: Vec<EngineView> =
            engines.iter().map(|&(l, w, e, lat)| view(l, w, e, lat)).collect();
        let eligible = views.iter().filter(|v| v.eligible).count();
        for kind in PolicyKind::ALL {
            let p = policy(kind, views.len(), k, seed);
            let mut out = Vec::new();
            let reason = p.pick(&views, &ctx(seed), &mut out);
            let mut d = out.clone();
            d.sort_unstable();
            d.dedup();
            prop_assert_eq!(d.len(), out.len(), "{:?} duplicates {:?}", kind, out);
            prop_assert!(out.iter().all(|&i| i < views.len()));
            if eligible > 0 {
                prop_assert!(out.iter().all(|&i| views[i].eligible), "{:?} {:?}", kind, out);
                prop_assert_eq!(out.len(), k.min(eligible), "{:?}", kind);
                prop_assert_ne!(reason, Reason::AllIneligible);
            } else {
                prop_assert_eq!(reason, Reason::AllIneligible);
                prop_assert_eq!(out.len(), k.min(views.len()), "{:?}", kind);
            }
        }
    }

    /// Power of two: the first choice is never the worse of the two drawn (with 2 candidates
    /// the list is exactly the pair), for both load and latency costs.
    #[test]
    fn power_of_two_never_picks_the_worse_of_its_two(
        engines in prop::collection::vec((0u32..50, 0.1f64..4.0, 1.0f64..1e6), 2..64),
        seed in any::<u64>(),
    ) {
        let views: Vec<EngineView> =
            engines.iter().map(|&(l, w, lat)| view(l, w, true, lat)).collect();
        let load = |v: &EngineView| (f64::from(v.load()) + 1.0) / v.weight;
        let cost = |v: &EngineView| v.latency_us * (f64::from(v.load()) + 1.0) / v.weight;
        let mut out = Vec::new();
        let p = policy(PolicyKind::PowerOfTwo, views.len(), 2, seed);
        p.pick(&views, &ctx(seed), &mut out);
        prop_assert!(load(&views[out[0]]) <= load(&views[out[1]]));
        let p = policy(PolicyKind::PeakEwma, views.len(), 2, seed);
        p.pick(&views, &ctx(seed), &mut out);
        prop_assert!(cost(&views[out[0]]) <= cost(&views[out[1]]));
    }
}

#[test]
fn the_most_loaded_engine_never_wins_power_of_two() {
    let views: Vec<EngineView> = (0..16).map(|i| view(i, 1.0, true, 1.0)).collect();
    let counts = first_choices(&policy(PolicyKind::PowerOfTwo, 16, 3, 1), &views, 20_000);
    assert_eq!(counts[15], 0, "{counts:?}");
    // The least loaded wins whenever drawn: about 2/16 of the time.
    assert!(counts[0] > 2_000, "{counts:?}");
}

#[test]
fn ties_are_spread_evenly_in_every_policy() {
    // Identical engines: no policy may favour any index (in particular not index 0).
    let views = vec![view(3, 1.0, true, 50_000.0); 8];
    for kind in PolicyKind::ALL {
        let counts = first_choices(&policy(kind, 8, 3, 9), &views, 16_000);
        // Consistent hashing follows the keys, whose ring shares vary by about ±9% with 128
        // virtual nodes; every other policy must be even up to sampling noise.
        let tolerance = if kind == PolicyKind::ConsistentHash {
            0.3
        } else {
            0.12
        };
        assert_even(&counts, tolerance, kind.as_str());
    }
}

#[test]
fn least_request_picks_the_least_loaded_per_weight() {
    let views = vec![
        view(4, 1.0, true, 0.0),
        view(2, 1.0, false, 0.0), // least loaded, but ineligible
        view(9, 4.0, true, 0.0),  // (9+1)/4 = 2.5: best
        view(3, 1.0, true, 0.0),  // 4
        view(5, 1.0, true, 0.0),  // 6
    ];
    let p = policy(PolicyKind::LeastRequest, 5, 3, 1);
    let mut out = Vec::new();
    assert_eq!(p.pick(&views, &ctx(1), &mut out), Reason::LeastLoad);
    assert_eq!(out, [2, 3, 0]);
}

#[test]
fn least_request_counts_engine_reported_load() {
    let mut views = vec![view(1, 1.0, true, 0.0); 2];
    views[0].engine_load = Some(7); // other clients queue on engine 0
    let p = policy(PolicyKind::LeastRequest, 2, 1, 1);
    let mut out = Vec::new();
    p.pick(&views, &ctx(1), &mut out);
    assert_eq!(out, [1]);
}

#[test]
fn least_request_on_a_large_fleet_scans_a_bounded_window() {
    let mut views: Vec<EngineView> = (0..4096)
        .map(|i| view(10 + i % 7, 1.0, true, 0.0))
        .collect();
    views[4000].in_flight = 0;
    let p = policy(PolicyKind::LeastRequest, 4096, 1, 1);
    let mut out = Vec::new();
    let mut found = 0;
    for s in 0..1_000 {
        p.pick(&views, &ctx(s), &mut out);
        assert!(views[out[0]].in_flight <= 10);
        found += usize::from(out[0] == 4000);
    }
    // A window of 512 of 4,096 engines holds engine 4000 about 1/8 of the time.
    assert!((60..200).contains(&found), "{found}");
}

#[test]
fn round_robin_cycles_and_spreads_an_ejected_engines_turns() {
    let mut views = vec![view(0, 1.0, true, 0.0); 5];
    let p = policy(PolicyKind::RoundRobin, 5, 1, 3);
    let counts = first_choices(&p, &views, 50);
    assert_eq!(counts, [10; 5]);
    views[2].eligible = false;
    let counts = first_choices(&p, &views, 40_000);
    assert_eq!(counts[2], 0);
    // Engine 3 (after the ejected one) gets no more than the others.
    let rest: Vec<u64> = [0, 1, 3, 4].iter().map(|&i| counts[i]).collect();
    assert_even(&rest, 0.05, "round robin with one engine out");
}

#[test]
fn random_is_uniform_and_ignores_load() {
    let views: Vec<EngineView> = (0..10).map(|i| view(i * 10, 1.0, true, 0.0)).collect();
    let counts = first_choices(&policy(PolicyKind::Random, 10, 2, 4), &views, 50_000);
    assert_even(&counts, 0.06, "random");
}

#[test]
fn weighted_round_robin_proportions_and_smoothness() {
    let weights = [1.0, 2.0, 3.0, 4.0, 10.0];
    let views: Vec<EngineView> = weights.iter().map(|&w| view(0, w, true, 0.0)).collect();
    let p = policy(PolicyKind::WeightedRoundRobin, 5, 2, 5);
    let total: f64 = weights.iter().sum();
    let mut out = Vec::new();
    let mut seq = Vec::new();
    for s in 0..20_000 {
        assert_eq!(
            p.pick(&views, &ctx(s), &mut out),
            Reason::WeightedRoundRobin
        );
        seq.push(out[0]);
    }
    for (i, &w) in weights.iter().enumerate() {
        let got = seq.iter().filter(|&&e| e == i).count() as f64 / seq.len() as f64;
        assert!((got - w / total).abs() < 0.002, "engine {i}: {got}");
        // Smooth: the gap between two picks of an engine stays within twice its period, and
        // no engine gets more consecutive picks than its weight over the others' (+ 1).
        let period = (total / w).ceil() as usize;
        let picks: Vec<usize> = (0..seq.len()).filter(|&j| seq[j] == i).collect();
        let max_gap = picks.windows(2).map(|x| x[1] - x[0]).max().unwrap();
        assert!(
            max_gap <= 2 * period,
            "engine {i}: gap {max_gap} > 2 x {period}"
        );
        let max_run = (w / (total - w)).ceil() as usize + 1;
        let mut run = 0;
        for &e in &seq {
            run = if e == i { run + 1 } else { 0 };
            assert!(run <= max_run, "engine {i}: {run} picks in a row");
        }
    }
}

#[test]
fn weighted_round_robin_follows_weight_changes() {
    let mut views = vec![view(0, 1.0, true, 0.0); 4];
    let p = policy(PolicyKind::WeightedRoundRobin, 4, 1, 6);
    first_choices(&p, &views, 100);
    views[1].weight = 0.1; // e.g. slow start or a high error rate
    let counts = first_choices(&p, &views, 31_000);
    let share = counts[1] as f64 / 31_000.0;
    assert!((share - 0.1 / 3.1).abs() < 0.005, "{share}");
}

#[test]
fn peak_ewma_prefers_low_latency_cost() {
    // Engine 1 is 5x slower: cost 5 × (0+1) loses to 1 × (3+1) until the others hold 4+.
    let mut views = vec![view(3, 1.0, true, 100_000.0); 4];
    views[1] = view(0, 1.0, true, 500_000.0);
    let counts = first_choices(&policy(PolicyKind::PeakEwma, 4, 2, 7), &views, 10_000);
    assert_eq!(counts[1], 0, "{counts:?}");
    views[1].latency_us = 300_000.0;
    let counts = first_choices(&policy(PolicyKind::PeakEwma, 4, 2, 7), &views, 10_000);
    assert!(counts[1] > 4_000, "{counts:?}"); // wins whenever drawn (half the draws)
}

#[test]
fn every_policy_routes_somewhere_when_every_engine_is_ineligible() {
    let views = vec![view(1, 1.0, false, 1.0); 6];
    for kind in PolicyKind::ALL {
        let p = policy(kind, 6, 3, 8);
        let mut out = Vec::new();
        assert_eq!(
            p.pick(&views, &ctx(8), &mut out),
            Reason::AllIneligible,
            "{kind:?}"
        );
        assert_eq!(out.len(), 3, "{kind:?}");
        let empty: Vec<EngineView> = Vec::new();
        assert_eq!(p.pick(&empty, &ctx(8), &mut out), Reason::NoEngines);
        assert!(out.is_empty());
    }
}

#[test]
fn same_seed_same_decisions() {
    let mut rng = Rng::new(99);
    let views: Vec<EngineView> = (0..50)
        .map(|_| {
            view(
                rng.below(20) as u32,
                0.5 + rng.unit(),
                rng.unit() < 0.9,
                1e5 * (1.0 + rng.unit()),
            )
        })
        .collect();
    for kind in PolicyKind::ALL {
        let (a, b) = (policy(kind, 50, 3, 42), policy(kind, 50, 3, 42));
        let (mut oa, mut ob) = (Vec::new(), Vec::new());
        for s in 0..500 {
            let ra = a.pick(&views, &ctx(s), &mut oa);
            let rb = b.pick(&views, &ctx(s), &mut ob);
            assert_eq!((ra, &oa), (rb, &ob), "{kind:?}");
        }
    }
}

#[test]
fn prefix_input_changes_nothing_for_the_other_policies() {
    let views = vec![view(2, 1.0, true, 1e5); 8];
    let matches = [PrefixMatch {
        engine: 3,
        blocks: 40,
    }];
    for kind in PolicyKind::ALL.into_iter().filter(|k| !k.uses_prefix()) {
        let (a, b) = (policy(kind, 8, 3, 1), policy(kind, 8, 3, 1));
        let (mut oa, mut ob) = (Vec::new(), Vec::new());
        for s in 0..100 {
            a.pick(&views, &ctx(s), &mut oa);
            let with = ctx(s).with_prefix(PrefixInput {
                total_blocks: 50,
                matches: &matches,
                cold_key: 0,
            });
            b.pick(&views, &with, &mut ob);
            assert_eq!(oa, ob);
        }
    }
}

#[test]
fn reasons_have_stable_labels() {
    assert_eq!(Reason::AllIneligible.as_str(), "fallback_all_unhealthy");
    assert_eq!(Reason::LeastLoad.as_str(), "least_load");
    assert_eq!(Reason::Hash.as_str(), "hash");
    assert_eq!(PolicyKind::PeakEwma.as_str(), "peak_ewma");
    assert_eq!(PolicyKind::CacheAware.as_str(), "cache_aware");
    assert_eq!(PolicyKind::Precise.as_str(), "precise");
    assert_eq!(PolicyKind::Scored.as_str(), "scored");
    assert_eq!(Reason::PrefixMatch.as_str(), "prefix_match");
    assert_eq!(Reason::PrefixNone.as_str(), "prefix_none");
    assert_eq!(Reason::PrefixOverloaded.as_str(), "prefix_overloaded");
    assert_eq!(Reason::Scored.as_str(), "scored");
    let prefix: Vec<PolicyKind> = PolicyKind::ALL
        .into_iter()
        .filter(|k| k.uses_prefix())
        .collect();
    assert_eq!(
        prefix,
        [
            PolicyKind::CacheAware,
            PolicyKind::Precise,
            PolicyKind::Scored
        ]
    );
}

#[test]
fn policy_and_state_can_be_shared_between_tasks() {
    fn shared<T: Send + Sync>() {}
    shared::<Policy>();
    shared::<kvmesh_policy::EngineTracker>();
    shared::<kvmesh_policy::RetryBudget>();
}
