//! Decision time per policy at 64 and 4,096 engines.
//!
//! `cargo bench -p kvmesh-policy --bench decision`. The engine set keeps running totals, as
//! the gateway will (`consistent_hash` reads them once per decision); `consistent_hash/scan`
//! shows the cost without them. `tracker_view` is the cost of building one engine's view
//! from its `EngineTracker`. The cache-aware policies (`cache_aware`, `precise`, `scored`) get
//! precomputed prefix matches (8 matched engines at 64, 64 at 4,096; the index lookup that
//! produces them is benchmarked in kvmesh-prefix) of a 64-block prompt. `least_request/even`
//! and `least_request/even_split` run it over engines of equal weight (so loads tie, as in a
//! uniform fleet), alone and as router 1 of 3 (ties split by rank: the tied engines kept
//! during the one scan, then sorted by the order the routers share).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvmesh_policy::{
    EngineMember, EngineSet, EngineTracker, EngineView, HealthConfig, MAX_CANDIDATES, Policy,
    PolicyConfig, PolicyKind, PrefixInput, PrefixMatch, RequestCtx, Rng, RouterSlot, Totals,
    stable_hash,
};
use std::hint::black_box;
use std::time::Duration;

struct Fleet {
    views: Vec<EngineView>,
    totals: Totals,
}

impl EngineSet for Fleet {
    fn len(&self) -> usize {
        self.views.len()
    }
    fn view(&self, i: usize) -> EngineView {
        self.views[i]
    }
    fn totals(&self) -> Totals {
        self.totals
    }
}

fn fleet(n: usize) -> (Fleet, Vec<EngineMember>) {
    let mut rng = Rng::new(n as u64);
    let views: Vec<EngineView> = (0..n)
        .map(|_| {
            let mut v = EngineView::new(0.5 + rng.unit());
            v.in_flight = rng.below(32) as u32;
            v.eligible = rng.unit() < 0.98;
            v.latency_us = 1e5 * (1.0 + rng.unit());
            v.waiting = Some(rng.below(4) as u32);
            v.kv_usage = Some(rng.unit() as f32);
            v
        })
        .collect();
    let totals = views.as_slice().totals();
    let members = (0..n)
        .map(|i| EngineMember::new(stable_hash(format!("http://engine-{i}:8000").as_bytes())))
        .collect();
    (Fleet { views, totals }, members)
}

/// Prompt length of the benchmarked requests, in blocks.
const PROMPT_BLOCKS: u32 = 64;

/// 16 precomputed match lists of `n / 8` (64 engines) or `n / 64` (4,096) distinct engines
/// each, holding 1–64 blocks of the prompt.
fn match_sets(n: usize) -> Vec<Vec<PrefixMatch>> {
    let per = if n <= 64 { n / 8 } else { n / 64 };
    let mut rng = Rng::new(n as u64 ^ 0xB10C);
    (0..16)
        .map(|_| {
            let mut set: Vec<PrefixMatch> = Vec::with_capacity(per);
            while set.len() < per {
                let engine = rng.below(n) as u32;
                if set.iter().all(|m| m.engine != engine) {
                    set.push(PrefixMatch {
                        engine,
                        blocks: 1 + rng.below(PROMPT_BLOCKS as usize) as u32,
                    });
                }
            }
            set
        })
        .collect()
}

fn decision(c: &mut Criterion) {
    for n in [64usize, 4096] {
        let (fleet, members) = fleet(n);
        let sets = match_sets(n);
        let mut group = c.benchmark_group(format!("decision/{n}"));
        for kind in PolicyKind::ALL {
            let cfg = PolicyConfig {
                policy: kind,
                ..PolicyConfig::default()
            };
            let policy = Policy::new(&cfg, &members, 1);
            let mut out = Vec::with_capacity(MAX_CANDIDATES);
            let mut seed = 0u64;
            group.bench_function(BenchmarkId::from_parameter(kind.as_str()), |b| {
                b.iter(|| {
                    seed = seed.wrapping_add(1);
                    let mut ctx = RequestCtx::new(seed, seed)
                        .with_hash_key(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    if kind.uses_prefix() {
                        ctx = ctx.with_prefix(PrefixInput {
                            total_blocks: PROMPT_BLOCKS,
                            matches: &sets[(seed % 16) as usize],
                            cold_key: 0,
                        });
                    }
                    black_box(policy.pick(&fleet, &ctx, &mut out));
                    black_box(out.first().copied())
                })
            });
        }
        let even = Fleet {
            views: fleet
                .views
                .iter()
                .map(|v| {
                    let mut e = *v;
                    e.weight = 1.0;
                    e
                })
                .collect(),
            totals: fleet.totals,
        };
        let cfg = PolicyConfig {
            policy: PolicyKind::LeastRequest,
            ..PolicyConfig::default()
        };
        for (name, slot) in [
            ("least_request/even", RouterSlot::ALONE),
            (
                "least_request/even_split",
                RouterSlot {
                    rank: 1,
                    routers: 3,
                },
            ),
        ] {
            let policy = Policy::new(&cfg, &members, 1).with_router_slot(slot);
            let mut out = Vec::with_capacity(MAX_CANDIDATES);
            let mut seed = 0u64;
            group.bench_function(name, |b| {
                b.iter(|| {
                    seed = seed.wrapping_add(1);
                    black_box(policy.pick(&even, &RequestCtx::new(seed, seed), &mut out))
                })
            });
        }
        // A prompt no engine holds at a meshed router: its rendezvous home among the
        // engines near the least loaded (two scans of the fleet).
        let mut cfg = PolicyConfig {
            policy: PolicyKind::CacheAware,
            ..PolicyConfig::default()
        };
        cfg.prefix.cold_prefix_rendezvous = true;
        let policy = Policy::new(&cfg, &members, 1);
        let mut out = Vec::with_capacity(MAX_CANDIDATES);
        let mut seed = 0u64;
        group.bench_function("cache_aware/cold_home", |b| {
            b.iter(|| {
                seed = seed.wrapping_add(1);
                let ctx = RequestCtx::new(seed, seed).with_prefix(PrefixInput {
                    total_blocks: PROMPT_BLOCKS,
                    matches: &[],
                    cold_key: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
                });
                black_box(policy.pick(&fleet, &ctx, &mut out))
            })
        });
        let cfg = PolicyConfig {
            policy: PolicyKind::ConsistentHash,
            ..PolicyConfig::default()
        };
        let policy = Policy::new(&cfg, &members, 1);
        let mut out = Vec::with_capacity(MAX_CANDIDATES);
        let mut seed = 0u64;
        group.bench_function("consistent_hash/scan_totals", |b| {
            b.iter(|| {
                seed = seed.wrapping_add(1);
                let ctx = RequestCtx::new(seed, seed)
                    .with_hash_key(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                black_box(policy.pick(fleet.views.as_slice(), &ctx, &mut out))
            })
        });
        group.finish();
    }
    let tracker = EngineTracker::new(&HealthConfig::default(), 0, true);
    let mut now = 0u64;
    c.bench_function("tracker_view", |b| {
        b.iter(|| {
            now += 1_000;
            black_box(tracker.view(black_box(now), 1.0, 3, Some(4), Some(0.5), 300_000.0))
        })
    });
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = decision
}
criterion_main!(benches);
