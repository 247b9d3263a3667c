//! The cache-aware policies (`cache_aware`, `precise`, `scored`) over simulated snapshots and
//! prefix matches: affinity versus the load guard, sibling bursts, minimum matches, random
//! ties, eligibility, malformed matches, weights, scoring, candidate lists and determinism.

use kvmesh_policy::{
    EngineMember, EngineSet, EngineView, MAX_CANDIDATES, Policy, PolicyConfig, PolicyKind,
    PrefixInput, PrefixMatch, Reason, RequestCtx, Rng, Totals, stable_hash,
};
use proptest::prelude::*;
use std::cell::Cell;

const AFFINITY: [PolicyKind; 2] = [PolicyKind::CacheAware, PolicyKind::Precise];
const ALL_PREFIX: [PolicyKind; 3] = [
    PolicyKind::CacheAware,
    PolicyKind::Precise,
    PolicyKind::Scored,
];

fn members(n: usize) -> Vec<EngineMember> {
    (0..n)
        .map(|i| EngineMember::new(stable_hash(format!("http://10.1.0.{i}:8000").as_bytes())))
        .collect()
}

fn cfg(kind: PolicyKind, candidates: usize) -> PolicyConfig {
    PolicyConfig {
        policy: kind,
        candidates,
        ..PolicyConfig::default()
    }
}

fn policy(kind: PolicyKind, n: usize, candidates: usize) -> Policy {
    Policy::new(&cfg(kind, candidates), &members(n), 7)
}

fn view(load: u32) -> EngineView {
    let mut v = EngineView::new(1.0);
    v.in_flight = load;
    v.latency_us = 100_000.0;
    v
}

fn views(loads: &[u32]) -> Vec<EngineView> {
    loads.iter().map(|&l| view(l)).collect()
}

fn m(engine: u32, blocks: u32) -> PrefixMatch {
    PrefixMatch { engine, blocks }
}

fn ctx<'a>(seed: u64, total_blocks: u32, matches: &'a [PrefixMatch]) -> RequestCtx<'a> {
    RequestCtx::new(seed, 1_000).with_prefix(PrefixInput {
        total_blocks,
        matches,
        cold_key: 0,
    })
}

fn pick<S: EngineSet + ?Sized>(p: &Policy, e: &S, c: &RequestCtx<'_>) -> (Reason, Vec<usize>) {
    let mut out = Vec::with_capacity(MAX_CANDIDATES);
    let r = p.pick(e, c, &mut out);
    (r, out)
}

fn assert_distinct(out: &[usize], what: &str) {
    let mut d = out.to_vec();
    d.sort_unstable();
    d.dedup();
    assert_eq!(d.len(), out.len(), "{what}: duplicates in {out:?}");
}

/// An engine set with chosen totals (as a gateway's running sums would report them) that
/// counts the views read.
struct Fleet {
    views: Vec<EngineView>,
    totals: Totals,
    reads: Cell<usize>,
}

impl Fleet {
    fn new(views: Vec<EngineView>) -> Self {
        let totals = views.as_slice().totals();
        Fleet {
            views,
            totals,
            reads: Cell::new(0),
        }
    }
}

impl EngineSet for Fleet {
    fn len(&self) -> usize {
        self.views.len()
    }
    fn view(&self, i: usize) -> EngineView {
        self.reads.set(self.reads.get() + 1);
        self.views[i]
    }
    fn totals(&self) -> Totals {
        self.totals
    }
}

#[test]
fn prefix_match_wins_over_load_under_the_guard() {
    // Engine 5 holds the whole prompt with 10 in flight; the others are idle.
    let mut vs = views(&[0; 8]);
    vs[5].in_flight = 10;
    let matches = [m(5, 40), m(2, 4)];
    for kind in AFFINITY {
        let p = policy(kind, 8, 3);
        for s in 0..200 {
            let (r, out) = pick(&p, &vs, &ctx(s, 40, &matches));
            assert_eq!(r, Reason::PrefixMatch, "{kind:?}");
            assert_eq!(out[0], 5, "{kind:?}");
            // Engine 2's 4 of 40 blocks are under min_match_ratio (need 12): not a fallback
            // by prefix, but it is idle, so it may come back as a least-load fallback.
            assert_eq!(out.len(), 3);
            assert_distinct(&out, kind.as_str());
        }
    }
    let p = policy(PolicyKind::Scored, 8, 3);
    for s in 0..200 {
        let (r, out) = pick(&p, &vs, &ctx(s, 40, &matches));
        assert_eq!((r, out[0]), (Reason::Scored, 5));
    }
}

#[test]
fn usable_matches_rank_by_blocks_then_load_then_fill_with_least_load() {
    let vs = views(&[4, 0, 9, 2, 7, 1, 3, 5]);
    // Need = ceil(0.3 × 20) = 6 blocks.
    let matches = [m(2, 20), m(4, 12), m(6, 12), m(0, 5), m(7, 6)];
    for kind in AFFINITY {
        let p = policy(kind, 8, 6);
        let (r, out) = pick(&p, &vs, &ctx(1, 20, &matches));
        assert_eq!(r, Reason::PrefixMatch);
        // 20 blocks; 12 blocks at load 3 before load 7; 6 blocks; then least load (1, 5).
        assert_eq!(out, [2, 6, 4, 7, 1, 5], "{kind:?}");
    }
}

#[test]
fn overloaded_holder_is_skipped() {
    // Engine 5 holds everything but has 40 in flight; mean after = (40 + 7×2 + 1) / 8 ≈ 6.9,
    // so its bound is max(16, 1.5 × 6.9) = 16 < 41.
    let mut vs = views(&[2; 8]);
    vs[5].in_flight = 40;
    let matches = [m(5, 30)];
    for kind in AFFINITY {
        let p = policy(kind, 8, 3);
        for s in 0..200 {
            let (r, out) = pick(&p, &vs, &ctx(s, 30, &matches));
            assert_eq!(r, Reason::PrefixOverloaded, "{kind:?}");
            assert!(!out.contains(&5), "{kind:?} {out:?}");
        }
        // Just at the floor (15 in flight + the new one = 16): affinity wins.
        let mut at = vs.clone();
        at[5].in_flight = 15;
        let (r, out) = pick(&p, &at, &ctx(3, 30, &matches));
        assert_eq!((r, out[0]), (Reason::PrefixMatch, 5));
        // One more, and the fleet mean is too low for the relative bound to allow it.
        at[5].in_flight = 16;
        let (r, out) = pick(&p, &at, &ctx(3, 30, &matches));
        assert_eq!(r, Reason::PrefixOverloaded);
        assert_ne!(out[0], 5);
    }
}

#[test]
fn relative_bound_allows_a_holder_above_the_floor_on_a_busy_fleet() {
    // Every engine at 30: mean after ≈ 30.1, bound 1.5 × 30.1 ≈ 45 > 31.
    let mut vs = views(&[30; 8]);
    vs[1].in_flight = 40;
    let matches = [m(1, 30)];
    for kind in AFFINITY {
        let p = policy(kind, 8, 3);
        let (r, out) = pick(&p, &vs, &ctx(1, 30, &matches));
        assert_eq!((r, out[0]), (Reason::PrefixMatch, 1), "{kind:?}");
        vs[1].in_flight = 50; // 51 > 1.5 × (260 + 1) / 8 ≈ 49
        let (r, out) = pick(&p, &vs, &ctx(1, 30, &matches));
        assert_eq!(r, Reason::PrefixOverloaded);
        assert_ne!(out[0], 1);
        vs[1].in_flight = 40;
    }
}

#[test]
fn guard_lets_a_burst_of_16_siblings_stack_on_one_engine() {
    // 16 requests sharing a new 32-block prefix arrive one after another at 8 idle engines.
    // Each decision sees the in-flight counts of the previous ones, and the engines picked so
    // far as holding the whole prefix (the gateway's tree or the engines' KV events).
    for kind in ALL_PREFIX {
        for seed in 0..50u64 {
            let p = Policy::new(&cfg(kind, 3), &members(8), seed);
            let mut vs = views(&[0; 8]);
            let mut holders: Vec<PrefixMatch> = Vec::new();
            let mut firsts = Vec::new();
            for r in 0..17u64 {
                let (reason, out) = pick(&p, &vs, &ctx(seed * 1_000 + r, 32, &holders));
                let e = out[0];
                if r < 16 {
                    let expect = match (kind, r) {
                        (PolicyKind::Scored, _) => Reason::Scored,
                        (_, 0) => Reason::PrefixNone,
                        _ => Reason::PrefixMatch,
                    };
                    assert_eq!(reason, expect, "{kind:?} seed {seed} request {r}");
                    firsts.push(e);
                } else {
                    // The 17th would make 17 > 16 on one engine while the mean is ~2.1.
                    assert_ne!(e, firsts[0], "{kind:?} seed {seed}: the 17th stacked too");
                    if kind != PolicyKind::Scored {
                        assert_eq!(reason, Reason::PrefixOverloaded);
                    }
                }
                vs[e].in_flight += 1;
                if !holders.iter().any(|h| h.engine as usize == e) {
                    holders.push(m(e as u32, 32));
                }
            }
            assert!(
                firsts.iter().all(|&e| e == firsts[0]),
                "{kind:?} seed {seed}: {firsts:?}"
            );
        }
    }
}

#[test]
fn a_match_below_the_minimum_is_ignored() {
    // 20 blocks: need ceil(0.3 × 20) = 6. Engine 2 holds 5 and is busier than the rest.
    let mut vs = views(&[0; 8]);
    vs[2].in_flight = 1;
    for kind in AFFINITY {
        let p = policy(kind, 8, 3);
        for s in 0..300 {
            let (r, out) = pick(&p, &vs, &ctx(s, 20, &[m(2, 5)]));
            assert_eq!(r, Reason::PrefixNone, "{kind:?}");
            assert_ne!(out[0], 2);
            let (r, out) = pick(&p, &vs, &ctx(s, 20, &[m(2, 6)]));
            assert_eq!((r, out[0]), (Reason::PrefixMatch, 2), "{kind:?}");
        }
        // min_match_blocks applies on top of the ratio.
        let mut c = cfg(kind, 3);
        c.prefix.min_match_blocks = 8;
        let p = Policy::new(&c, &members(8), 1);
        let (r, _) = pick(&p, &vs, &ctx(1, 20, &[m(2, 7)]));
        assert_eq!(r, Reason::PrefixNone);
        let (r, out) = pick(&p, &vs, &ctx(1, 20, &[m(2, 8)]));
        assert_eq!((r, out[0]), (Reason::PrefixMatch, 2));
    }
}

#[test]
fn ties_are_broken_at_random() {
    // Engines 1 and 6 hold the same blocks at the same load.
    let vs = views(&[3; 8]);
    let matches = [m(6, 10), m(1, 10)];
    for kind in ALL_PREFIX {
        let p = policy(kind, 8, 3);
        let mut count = [0u32; 8];
        for s in 0..4_000 {
            let (_, out) = pick(&p, &vs, &ctx(s, 10, &matches));
            count[out[0]] += 1;
            // The other tied holder is the first fallback.
            assert!(
                out[..2].contains(&1) && out[..2].contains(&6),
                "{kind:?} {out:?}"
            );
        }
        assert_eq!(count[1] + count[6], 4_000, "{kind:?} {count:?}");
        assert!(
            (1_800..=2_200).contains(&count[1]),
            "{kind:?}: engine 1 first {} of 4000",
            count[1]
        );
    }
}

#[test]
fn equal_holders_with_different_load_go_to_the_less_loaded_per_weight() {
    let mut vs = views(&[3, 2, 3, 3]);
    vs[3].weight = 4.0; // (3 + 1) / 4 = 1 < (2 + 1) / 1
    let matches = [m(1, 10), m(3, 10)];
    for kind in AFFINITY {
        let (_, out) = pick(&policy(kind, 4, 2), &vs, &ctx(5, 10, &matches));
        assert_eq!(out, [3, 1]);
    }
}

#[test]
fn an_ineligible_holder_is_never_chosen_unless_all_are_ineligible() {
    let mut vs = views(&[0; 6]);
    vs[3].eligible = false;
    let matches = [m(3, 50)];
    for kind in ALL_PREFIX {
        let p = policy(kind, 6, 3);
        for s in 0..300 {
            let (r, out) = pick(&p, &vs, &ctx(s, 50, &matches));
            assert!(!out.contains(&3), "{kind:?} {out:?}");
            assert_ne!(r, Reason::AllIneligible);
            if kind != PolicyKind::Scored {
                assert_eq!(r, Reason::PrefixNone);
            }
        }
        // Panic mode: every engine ineligible; the policy runs over all of them, prefix
        // affinity included.
        let mut all = vs.clone();
        for v in &mut all {
            v.eligible = false;
        }
        let (r, out) = pick(&p, &all, &ctx(9, 50, &matches));
        assert_eq!(r, Reason::AllIneligible);
        assert_eq!(out[0], 3, "{kind:?}");
        assert_eq!(out.len(), 3);
        assert_distinct(&out, kind.as_str());
    }
}

#[test]
fn out_of_range_and_odd_matches_are_ignored() {
    let vs = views(&[1; 4]);
    let junk = [
        m(4, 10),
        m(100, 10),
        m(u32::MAX, u32::MAX),
        m(2, 0),
        m(1, 2), // below the minimum of 3
    ];
    for kind in ALL_PREFIX {
        let p = policy(kind, 4, 4);
        for s in 0..100 {
            let (r, out) = pick(&p, &vs, &ctx(s, 10, &junk));
            assert_eq!(out.len(), 4);
            assert!(out.iter().all(|&i| i < 4));
            assert_distinct(&out, kind.as_str());
            if kind != PolicyKind::Scored {
                assert_eq!(r, Reason::PrefixNone);
            }
        }
        // A valid match among the junk, listed twice, with blocks above the prompt's.
        let mixed = [m(9, 10), m(2, 3), m(2, 1_000), m(u32::MAX, 1)];
        let (r, out) = pick(&p, &vs, &ctx(1, 10, &mixed));
        assert_eq!(out[0], 2, "{kind:?}");
        assert_distinct(&out, kind.as_str());
        if kind != PolicyKind::Scored {
            assert_eq!(r, Reason::PrefixMatch);
        }
    }
}

#[test]
fn no_prefix_input_behaves_like_least_request() {
    let mut rng = Rng::new(4);
    let vs: Vec<EngineView> = (0..40)
        .map(|_| {
            let mut v = view(rng.below(10) as u32);
            v.eligible = rng.unit() < 0.8;
            v.weight = 0.5 + rng.unit();
            v
        })
        .collect();
    let least = policy(PolicyKind::LeastRequest, 40, 3);
    for kind in ALL_PREFIX {
        let p = policy(kind, 40, 3);
        let none = if kind == PolicyKind::Scored {
            Reason::Scored
        } else {
            Reason::PrefixNone
        };
        for s in 0..200 {
            let plain = RequestCtx::new(s, 1_000);
            let (_, want) = pick(&least, &vs, &plain);
            assert_eq!(pick(&p, &vs, &plain), (none, want.clone()), "{kind:?}");
            // total_blocks = 0 (a prompt shorter than a block): same.
            let empty = ctx(s, 0, &[]);
            assert_eq!(pick(&p, &vs, &empty), (none, want), "{kind:?}");
        }
    }
}

#[test]
fn weighted_guard_scales_the_bound_by_weight_share() {
    // Engine 0 holds the prompt with 30 in flight; the others have 10. Totals: load 60,
    // weight 7 with engine 0 at weight 4: its bound is max(16, 1.5 × 61 × 4 / 7) ≈ 52 ≥ 31.
    let mut vs = views(&[30, 10, 10, 10]);
    vs[0].weight = 4.0;
    let matches = [m(0, 20)];
    for kind in AFFINITY {
        let (r, out) = pick(&policy(kind, 4, 2), &vs, &ctx(1, 20, &matches));
        assert_eq!((r, out[0]), (Reason::PrefixMatch, 0), "{kind:?}");
    }
    // At weight 1 its bound is max(16, 1.5 × 61 / 4) ≈ 23 < 31: overloaded.
    vs[0].weight = 1.0;
    for kind in AFFINITY {
        let (r, out) = pick(&policy(kind, 4, 2), &vs, &ctx(1, 20, &matches));
        assert_eq!(r, Reason::PrefixOverloaded, "{kind:?}");
        assert_ne!(out[0], 0);
    }
    // Weight only matters above the absolute floor: a weight-0.1 holder at 10 in flight
    // (11 ≤ 16) keeps its affinity.
    let mut vs = views(&[10, 10, 10, 10]);
    vs[0].weight = 0.1;
    for kind in AFFINITY {
        let (r, out) = pick(&policy(kind, 4, 2), &vs, &ctx(1, 20, &matches));
        assert_eq!((r, out[0]), (Reason::PrefixMatch, 0), "{kind:?}");
    }
}

#[test]
fn scored_prefers_cache_but_a_heavily_queued_engine_loses_to_an_idle_one() {
    let p = policy(PolicyKind::Scored, 4, 4);
    let mut vs = views(&[1, 1, 2, 1]);
    for v in &mut vs {
        v.kv_usage = Some(0.2);
        v.waiting = Some(0);
    }
    // Engine 2 holds 80% of the prompt with a bit more load: 3 × 0.8 − 0.4 − 1 − 1 = 0
    // against −0.4 − 0.5 − 1 for the others (kv, in flight, latency).
    let matches = [m(2, 16)];
    for s in 0..100 {
        let (r, out) = pick(&p, &vs, &ctx(s, 20, &matches));
        assert_eq!((r, out[0]), (Reason::Scored, 2));
    }
    // Now it has 50 requests queued and a nearly full cache: 2.4 − 2 − 1.8 − 1 − 1 = −3.4.
    vs[2].waiting = Some(50);
    vs[2].kv_usage = Some(0.9);
    for s in 0..100 {
        let (r, out) = pick(&p, &vs, &ctx(s, 20, &matches));
        assert_eq!(r, Reason::Scored);
        assert_ne!(out[0], 2);
        assert_eq!(out[3], 2, "the worst score comes last: {out:?}");
    }
    // Latency counts too: a holder 10× slower than the others loses a small match.
    let mut vs = views(&[0; 4]);
    vs[1].latency_us = 1_000_000.0;
    let (_, out) = pick(&p, &vs, &ctx(1, 20, &[m(1, 4)])); // 3 × 0.2 − 1 < 0 − 0.1
    assert_ne!(out[0], 1);
    let (_, out) = pick(&p, &vs, &ctx(1, 20, &[m(1, 20)])); // 3 − 1 > −0.1
    assert_eq!(out[0], 1);
}

#[test]
fn scored_terms_follow_their_weights() {
    // With only the queue weighted, the shortest queue wins whatever the prefix.
    let mut c = cfg(PolicyKind::Scored, 3);
    c.scored.prefix = 0.0;
    c.scored.kv_usage = 0.0;
    c.scored.in_flight = 0.0;
    c.scored.latency = 0.0;
    let p = Policy::new(&c, &members(4), 1);
    let mut vs = views(&[0; 4]);
    for (v, q) in vs.iter_mut().zip([5, 3, 9, 4]) {
        v.waiting = Some(q);
    }
    let (_, out) = pick(&p, &vs, &ctx(1, 10, &[m(2, 10)]));
    assert_eq!(out, [1, 3, 0]);
    // Unknown queues count as empty.
    vs[2].waiting = None;
    let (_, out) = pick(&p, &vs, &ctx(1, 10, &[m(2, 10)]));
    assert_eq!(out[0], 2);
}

#[test]
fn scored_load_guard_excludes_overloaded_engines_unless_all_are() {
    // The gateway's running totals say the fleet (beyond these four) is nearly idle, so the
    // bound is the absolute floor of 16.
    let mut fleet = Fleet::new(views(&[20, 5, 5, 5]));
    fleet.totals = Totals {
        eligible: 100,
        load: 35,
        weight: 100.0,
        base_weight: 100.0,
    };
    let p = policy(PolicyKind::Scored, 4, 4);
    let matches = [m(0, 20)];
    for s in 0..100 {
        let (r, out) = pick(&p, &fleet, &ctx(s, 20, &matches));
        assert_eq!(r, Reason::Scored);
        assert_ne!(out[0], 0);
        assert_eq!(
            out[3], 0,
            "the overloaded holder is the last fallback: {out:?}"
        );
    }
    // Every considered engine overloaded: the best score again (the holder).
    for v in &mut fleet.views {
        v.in_flight = 20;
    }
    for s in 0..100 {
        let (_, out) = pick(&p, &fleet, &ctx(s, 20, &matches));
        assert_eq!(out[0], 0);
    }
}

#[test]
fn candidate_lists_never_hold_duplicates() {
    let vs = views(&[0, 1, 2, 3, 4, 5, 6, 7]);
    // Every engine listed, some twice, in shuffled order.
    let matches = [
        m(3, 8),
        m(0, 8),
        m(3, 8),
        m(7, 2),
        m(1, 5),
        m(5, 8),
        m(0, 3),
        m(2, 8),
        m(4, 6),
        m(6, 8),
        m(7, 8),
        m(1, 8),
    ];
    for kind in ALL_PREFIX {
        let p = policy(kind, 8, MAX_CANDIDATES);
        for s in 0..200 {
            let (_, out) = pick(&p, &vs, &ctx(s, 8, &matches));
            assert_eq!(out.len(), 8, "{kind:?}");
            assert_distinct(&out, kind.as_str());
            let (_, out) = pick(&p, &vs, &ctx(s, 8, &matches[..3]));
            assert_eq!(out.len(), 8, "{kind:?}");
            assert_distinct(&out, kind.as_str());
        }
    }
}

#[test]
fn same_seed_same_picks() {
    let mut rng = Rng::new(77);
    let vs: Vec<EngineView> = (0..50)
        .map(|_| {
            let mut v = view(rng.below(20) as u32);
            v.eligible = rng.unit() < 0.9;
            v.waiting = Some(rng.below(5) as u32);
            v.kv_usage = Some(rng.unit() as f32);
            v
        })
        .collect();
    let matches: Vec<PrefixMatch> = (0..10)
        .map(|_| m(rng.below(60) as u32, rng.below(40) as u32))
        .collect();
    for kind in ALL_PREFIX {
        let (a, b) = (policy(kind, 50, 3), policy(kind, 50, 3));
        let mut firsts = std::collections::HashSet::new();
        for s in 0..500 {
            let c = ctx(s, 32, &matches);
            let ra = pick(&a, &vs, &c);
            assert_eq!(ra, pick(&b, &vs, &c), "{kind:?}");
            assert_eq!(ra, pick(&a, &vs, &c), "{kind:?}");
            firsts.insert(ra.1[0]);
        }
        assert!(!firsts.is_empty());
    }
}

#[test]
fn affinity_reads_only_the_matched_engines_when_they_fill_the_list() {
    let fleet = Fleet::new(views(&[1; 4096]));
    let matches: Vec<PrefixMatch> = (0..64).map(|j| m(j * 61, 32)).collect();
    for kind in AFFINITY {
        let p = policy(kind, 4096, 3);
        fleet.reads.set(0);
        let (r, out) = pick(&p, &fleet, &ctx(1, 32, &matches));
        assert_eq!(r, Reason::PrefixMatch);
        assert_eq!(out.len(), 3);
        assert_eq!(fleet.reads.get(), 64, "{kind:?}");
        // No usable match: the matches plus a window of max_scan engines.
        fleet.reads.set(0);
        let (r, _) = pick(&p, &fleet, &ctx(1, 1_000, &matches));
        assert_eq!(r, Reason::PrefixNone);
        assert!(fleet.reads.get() <= 512, "{}", fleet.reads.get());
    }
    let p = policy(PolicyKind::Scored, 4096, 3);
    fleet.reads.set(0);
    pick(&p, &fleet, &ctx(1, 32, &matches));
    assert!(fleet.reads.get() <= 2 * (64 + 512), "{}", fleet.reads.get());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Random fleets and matches (out-of-range indices, duplicates, blocks above the prompt):
    /// candidates are distinct, in range, eligible when any engine is, and as many as asked
    /// (bounded by the usable engines).
    #[test]
    fn candidate_lists_are_well_formed(
        engines in prop::collection::vec(
            (0u32..40, 0.1f64..4.0, prop::bool::weighted(0.7), prop::option::of(0u32..20),
             prop::option::of(0.0f32..1.0), 0.0f64..1e6),
            1..40),
        raw in prop::collection::vec((0u32..50, 0u32..80), 0..24),
        total in 0u32..64,
        k in 1usize..=MAX_CANDIDATES,
        abs in 0u32..20,
        seed in any::<u64>(),
    ) {
        let views: Vec<EngineView> = engines
            .iter()
            .map(|&(l, w, e, q, kv, lat)| {
                let mut v = EngineView::new(w);
                v.in_flight = l;
                v.eligible = e;
                v.waiting = q;
                v.kv_usage = kv;
                v.latency_us = lat;
                v
            })
            .collect();
        let matches: Vec<PrefixMatch> = raw.iter().map(|&(e, b)| m(e, b)).collect();
        let n = views.len();
        let eligible = views.iter().filter(|v| v.eligible).count();
        for kind in ALL_PREFIX {
            let mut c = cfg(kind, k);
            c.prefix.balance_abs_threshold = abs;
            let p = Policy::new(&c, &members(n), seed);
            let (reason, out) = pick(&p, &views, &ctx(seed, total, &matches));
            let mut d = out.clone();
            d.sort_unstable();
            d.dedup();
            prop_assert_eq!(d.len(), out.len(), "{:?} duplicates {:?}", kind, out);
            prop_assert!(out.iter().all(|&i| i < n));
            if eligible > 0 {
                prop_assert!(views[out[0]].eligible, "{:?} {:?}", kind, out);
                prop_assert!(out.iter().all(|&i| views[i].eligible), "{:?} {:?}", kind, out);
                prop_assert_eq!(out.len(), k.min(eligible), "{:?}", kind);
                prop_assert_ne!(reason, Reason::AllIneligible);
            } else {
                prop_assert_eq!(reason, Reason::AllIneligible);
                prop_assert_eq!(out.len(), k.min(n), "{:?}", kind);
            }
        }
    }
}

fn cold_policy(seed: u64, ms: &[EngineMember]) -> Policy {
    let mut c = cfg(PolicyKind::CacheAware, 3);
    c.prefix.cold_prefix_rendezvous = true;
    Policy::new(&c, ms, seed)
}

fn cold_ctx<'a>(seed: u64, cold_key: u64, matches: &'a [PrefixMatch]) -> RequestCtx<'a> {
    RequestCtx::new(seed, 1_000).with_prefix(PrefixInput {
        total_blocks: 40,
        matches,
        cold_key,
    })
}

#[test]
fn a_cold_prompt_goes_to_the_same_home_on_every_router_whatever_the_engine_order_or_seed() {
    // Two "routers" list the same 8 engines in different orders, pick with different seeds
    // and see the same loads (or loads that differ by less than the slack on the engines near
    // the least loaded): the home engine is the same member.
    let ms = members(8);
    let mut rev = ms.clone();
    rev.reverse();
    for kind in [PolicyKind::CacheAware, PolicyKind::Precise] {
        let mut c = cfg(kind, 3);
        c.prefix.cold_prefix_rendezvous = true;
        let a = Policy::new(&c, &ms, 1);
        let b = Policy::new(&c, &rev, 2);
        let mut homes = std::collections::BTreeSet::new();
        for key in 1..200u64 {
            let loads: Vec<u32> = (0..8).map(|i| (i * 3 + key as u32) % 7).collect();
            let mut loads_rev = loads.clone();
            loads_rev.reverse();
            let (ra, oa) = pick(&a, &views(&loads), &cold_ctx(key, key, &[]));
            let (rb, ob) = pick(&b, &views(&loads_rev), &cold_ctx(key * 7, key, &[]));
            assert_eq!(ra, Reason::PrefixCold, "{kind:?}");
            assert_eq!(rb, Reason::PrefixCold, "{kind:?}");
            assert_eq!(ms[oa[0]].id, rev[ob[0]].id, "{kind:?} key {key}");
            assert_distinct(&oa, "cold");
            homes.insert(ms[oa[0]].id);
            // Idle: the home among all 8, whatever the router.
            let (_, oi) = pick(&a, &views(&[0; 8]), &cold_ctx(key, key, &[]));
            let (_, oj) = pick(&b, &views(&[0; 8]), &cold_ctx(key * 3, key, &[]));
            assert_eq!(ms[oi[0]].id, rev[oj[0]].id, "{kind:?} key {key}");
        }
        assert_eq!(homes.len(), 8, "199 keys spread over every engine");
    }
}

#[test]
fn a_cold_prompts_home_is_among_the_engines_within_the_slack_of_the_least_loaded() {
    let p = cold_policy(7, &members(4));
    let key = 0xBEEF;
    let (_, o) = pick(&p, &views(&[0, 0, 0, 0]), &cold_ctx(1, key, &[]));
    let home = o[0];
    // One request above the least loaded (the default slack of 1): still the home, so
    // routers that saw one sibling more or less on it agree.
    let mut loads = [3u32; 4];
    loads[home] = 4;
    let (r, o) = pick(&p, &views(&loads), &cold_ctx(1, key, &[]));
    assert_eq!((r, o[0]), (Reason::PrefixCold, home));
    // Two above: the home among the others (all at the least load), the same on every
    // router that sees these loads.
    loads[home] = 5;
    let (r, o) = pick(&p, &views(&loads), &cold_ctx(1, key, &[]));
    assert_eq!(r, Reason::PrefixCold);
    assert_ne!(o[0], home);
    let (_, o2) = pick(&p, &views(&loads), &cold_ctx(99, key, &[]));
    assert_eq!(o[0], o2[0], "the seed does not move it");
    // The engine-reported load, which each router scrapes at its own moments, does not move
    // it either: only the routers' in-flight counts, which they see alike.
    let mut vs = views(&[3, 3, 3, 3]);
    vs[home].engine_load = Some(9);
    let (r, o) = pick(&p, &vs, &cold_ctx(1, key, &[]));
    assert_eq!((r, o[0]), (Reason::PrefixCold, home));
    // Only the least loaded qualifies when the others are all busier: new prefixes fill the
    // emptiest engine as least request would.
    let (_, o) = pick(&p, &views(&[6, 6, 1, 6]), &cold_ctx(1, key, &[]));
    assert_eq!(o[0], 2);
    // A slack of 0 takes the least loaded alone; a very large one is hashing alone (under
    // the guard's floor).
    let with_slack = |slack: f64| {
        let mut c = cfg(PolicyKind::CacheAware, 3);
        c.prefix.cold_prefix_rendezvous = true;
        c.prefix.cold_prefix_slack = slack;
        Policy::new(&c, &members(4), 7)
    };
    let mut loads = [1u32; 4];
    loads[home] = 2;
    let (_, o) = pick(&with_slack(0.0), &views(&loads), &cold_ctx(1, key, &[]));
    assert_ne!(o[0], home, "slack 0: one request above the least is out");
    let mut loads = [0u32; 4];
    loads[home] = 14;
    let (_, o) = pick(&with_slack(1e6), &views(&loads), &cold_ctx(1, key, &[]));
    assert_eq!(o[0], home, "a very large slack keeps the home");
}

#[test]
fn a_cold_prompts_home_respects_the_guard_and_eligibility_and_can_be_switched_off() {
    let p = cold_policy(7, &members(4));
    let key = 0xC01D;
    let (_, o) = pick(&p, &views(&[0, 0, 0, 0]), &cold_ctx(1, key, &[]));
    let home = o[0];
    // The home overloaded (above the floor of 16 and 1.5 × the mean): the next in
    // rendezvous order instead, still a cold decision.
    let mut loads = [1u32; 4];
    loads[home] = 40;
    let (r, o) = pick(&p, &views(&loads), &cold_ctx(1, key, &[]));
    assert_eq!(r, Reason::PrefixCold);
    assert_ne!(o[0], home);
    // The home ineligible: skipped.
    let mut vs = views(&[0, 0, 0, 0]);
    vs[home].eligible = false;
    let (r, o) = pick(&p, &vs, &cold_ctx(1, key, &[]));
    assert_eq!(r, Reason::PrefixCold);
    assert_ne!(o[0], home);
    // No cold key, or switched off: least request as before.
    let (r, _) = pick(&p, &views(&[0, 0, 0, 0]), &cold_ctx(1, 0, &[]));
    assert_eq!(r, Reason::PrefixNone);
    let off = policy(PolicyKind::CacheAware, 4, 3);
    let (r, _) = pick(&off, &views(&[0, 0, 0, 0]), &cold_ctx(1, key, &[]));
    assert_eq!(r, Reason::PrefixNone);
    // A usable match still wins over the cold home.
    let other = (home + 1) % 4;
    let (r, o) = pick(
        &p,
        &views(&[0, 0, 0, 0]),
        &cold_ctx(1, key, &[m(other as u32, 30)]),
    );
    assert_eq!(r, Reason::PrefixMatch);
    assert_eq!(o[0], other);
}
