//! The virtual-time evaluator: the oracle bounds every real policy's hit rate; runs are
//! deterministic; closed and open loops both finish every job.

use kvmesh_bench::SharedPrefixWorkload;
use kvmesh_bench::eval::{Contender, EvalConfig, evaluate};
use kvmesh_bench::jobs::{BUNDLED_TRACE, parse_trace, shared_prefix_jobs, trace_jobs};
use kvmesh_config::{ServeConfig, SimConfig};
use kvmesh_engine::EngineParams;
use kvmesh_policy::PolicyKind;
use kvmesh_route::TtlPlan;

fn config(kv_blocks: u32, concurrency: usize, seed: u64) -> EvalConfig {
    let mut sim = SimConfig::default();
    sim.engine.num_blocks = kv_blocks;
    let max_len = kv_blocks * sim.engine.block_size;
    let serve = ServeConfig::default();
    EvalConfig {
        engines: 4,
        params: EngineParams::from_config(&sim.engine, max_len, 0).unwrap(),
        routing: serve.routing.policy.clone(),
        ttl: TtlPlan {
            speculative_us: serve.prefix.speculative_ttl_ms * 1_000,
            approximate_us: serve.prefix.approximate_ttl_ms * 1_000,
        },
        concurrency,
        speedup: 2.0,
        seed,
    }
}

const REAL: [PolicyKind; 6] = [
    PolicyKind::RoundRobin,
    PolicyKind::Random,
    PolicyKind::LeastRequest,
    PolicyKind::CacheAware,
    PolicyKind::Precise,
    PolicyKind::Scored,
];

#[test]
fn the_oracle_hit_rate_bounds_every_policy_on_shared_prefix() {
    for seed in [1, 2] {
        let set = shared_prefix_jobs(&SharedPrefixWorkload {
            groups: 8,
            users: 3,
            turns: 3,
            system_words: 1_500,
            question_words: 40,
            max_tokens: 16,
            seed,
        });
        let cfg = config(900, 12, seed);
        let oracle = evaluate(&set, Contender::Oracle, &cfg);
        assert_eq!(oracle.requests, set.jobs.len() as u64);
        for p in REAL {
            let r = evaluate(&set, Contender::Policy(p), &cfg);
            println!(
                "seed {seed} {:14} hit {:.3} (oracle {:.3}) ttft p99 {:.0} ms spread {:.2}",
                r.name, r.hit_rate, oracle.hit_rate, r.ttft_p99_ms, r.load_spread
            );
            assert_eq!(r.requests + r.rejected, set.jobs.len() as u64, "{p:?}");
            assert!(
                oracle.hit_rate >= r.hit_rate,
                "seed {seed}: {p:?} {} above the oracle's {}",
                r.hit_rate,
                oracle.hit_rate
            );
        }
    }
}

#[test]
fn the_oracle_bounds_every_policy_on_the_trace_excerpt() {
    let lines = parse_trace(BUNDLED_TRACE).unwrap();
    let cfg = config(4_000, 1, 3);
    let set = trace_jobs(&lines, 80, 4_000 * 16);
    let oracle = evaluate(&set, Contender::Oracle, &cfg);
    for p in REAL {
        let r = evaluate(&set, Contender::Policy(p), &cfg);
        println!(
            "trace {:14} hit {:.3} (oracle {:.3})",
            r.name, r.hit_rate, oracle.hit_rate
        );
        assert!(
            oracle.hit_rate >= r.hit_rate,
            "{p:?}: {} > {}",
            r.hit_rate,
            oracle.hit_rate
        );
    }
}

#[test]
fn evaluations_are_deterministic() {
    let set = shared_prefix_jobs(&SharedPrefixWorkload {
        groups: 3,
        users: 2,
        turns: 2,
        system_words: 300,
        question_words: 20,
        max_tokens: 8,
        seed: 5,
    });
    let cfg = config(600, 4, 9);
    for c in [Contender::Oracle, Contender::Policy(PolicyKind::Precise)] {
        let a = evaluate(&set, c, &cfg);
        let b = evaluate(&set, c, &cfg);
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
        assert_eq!(a.requests, 12);
        assert!(a.hit_rate > 0.0);
    }
}
