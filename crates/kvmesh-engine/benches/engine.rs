//! Engine benchmarks: `cargo bench -p kvmesh-engine --bench engine`.
//!
//! * `step/decode_256x1k`: one engine step with 256 running sequences (1k-token prompts from
//!   16 shared system prompts, decoding), i.e. a full `max_num_seqs` batch.
//! * `driver/shared_prefix_10k`: 10,000 requests through the virtual-time driver.
//! * A one-shot run of 100,000 requests (printed, not a criterion measurement: one run takes
//!   seconds) reporting wall time, simulated virtual time and hit rate.

use criterion::{BatchSize, Criterion, Throughput};
use kvmesh_engine::{Engine, EngineParams, Micros, RequestSpec, drive};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

/// Shared-prefix workload, generated lazily: `groups` system prompts of `sys` tokens, each
/// request = one group's system prompt + `user` fresh tokens, `out` output tokens, Poisson
/// arrivals at `rate` requests/s.
fn shared_prefix(
    n: u64,
    groups: u64,
    sys: u32,
    user: u32,
    out: u32,
    rate: f64,
    seed: u64,
) -> impl Iterator<Item = (Micros, RequestSpec)> {
    let mut rng = Rng(seed);
    let mut t = 0.0f64;
    (0..n).map(move |id| {
        t += -rng.unit().ln() / rate * 1e6;
        let g = rng.next() % groups;
        let mut prompt: Vec<u32> = (0..sys)
            .map(|i| ((g * 1_000_003 + i as u64 * 7919) % 150_000) as u32)
            .collect();
        prompt.extend((0..user).map(|_| (rng.next() % 150_000) as u32));
        (t as Micros, RequestSpec::new(id, prompt, out))
    })
}

fn loaded_engine() -> (Engine, Micros) {
    let mut e = Engine::new(EngineParams::default());
    let mut now = 0;
    for (_, spec) in shared_prefix(256, 16, 768, 256, 400, 1e9, 1) {
        e.add_request(spec, 0).expect("fits");
    }
    // Step until every request is decoding.
    while e.stats().running < 256 || e.stats().waiting > 0 {
        now += e.step(now).duration_us;
    }
    for _ in 0..5 {
        now += e.step(now).duration_us;
    }
    (e, now)
}

fn bench_steps(c: &mut Criterion) {
    let (warm, now) = loaded_engine();
    let mut g = c.benchmark_group("step");
    const STEPS: u64 = 64;
    g.throughput(Throughput::Elements(STEPS));
    g.bench_function("decode_256x1k", |b| {
        b.iter_batched(
            || warm.clone(),
            |mut e| {
                let mut t = now;
                for _ in 0..STEPS {
                    let o = e.step(t);
                    t += o.duration_us;
                    black_box(&o);
                }
                e
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn bench_driver(c: &mut Criterion) {
    let mut g = c.benchmark_group("driver");
    g.sample_size(10);
    g.throughput(Throughput::Elements(10_000));
    g.bench_function("shared_prefix_10k", |b| {
        b.iter(|| {
            let mut e = Engine::new(EngineParams::default());
            let r = drive::run(&mut e, shared_prefix(10_000, 100, 768, 256, 64, 50.0, 7));
            black_box(r.end)
        })
    });
    g.finish();
}

/// One run of 100k requests: wall time vs simulated time.
fn one_shot_100k() {
    let n = 100_000;
    let mut e = Engine::new(EngineParams::default());
    let mut steps = 0u64;
    let start = Instant::now();
    let r = drive::run_with(
        &mut e,
        shared_prefix(n, 100, 768, 256, 64, 50.0, 7),
        |_, _| steps += 1,
    );
    let wall = start.elapsed();
    let s = &r.stats;
    let virt = r.end as f64 / 1e6;
    let ttft: Vec<u64> = {
        let mut v: Vec<u64> = r
            .finished
            .iter()
            .map(|f| f.first_token_at - f.arrival)
            .collect();
        v.sort_unstable();
        v
    };
    println!(
        "one_shot_100k: {} requests (1,024-token prompts = 768 shared by one of 100 groups + 256 \
         unique, 64 output tokens, Poisson 50 req/s, h100-8b, 24,000 blocks x 16)",
        r.finished.len()
    );
    println!(
        "  wall {:.2} s | virtual {:.1} s ({:.0}x real time) | {} steps ({:.0} steps/s wall) | \
         {:.0} requests/s wall",
        wall.as_secs_f64(),
        virt,
        virt / wall.as_secs_f64(),
        steps,
        steps as f64 / wall.as_secs_f64(),
        n as f64 / wall.as_secs_f64()
    );
    println!(
        "  hit rate {:.3} | preemptions {} | TTFT p50 {:.1} ms p99 {:.1} ms",
        s.prefix_cache_hits as f64 / s.prefix_cache_queries as f64,
        s.preemptions,
        ttft[ttft.len() / 2] as f64 / 1e3,
        ttft[ttft.len() * 99 / 100] as f64 / 1e3
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes --bench; `cargo test --benches` does not (then skip the long run).
    let bench_mode = args.iter().any(|a| a == "--bench");
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-'));
    if bench_mode && filter.is_none_or(|f| "one_shot_100k".contains(f.as_str())) {
        one_shot_100k();
    }
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .configure_from_args();
    bench_steps(&mut c);
    bench_driver(&mut c);
    c.final_summary();
}
