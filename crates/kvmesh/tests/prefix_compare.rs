//! The cache-aware routing acceptance check, in-process: 8 simulated engines, a shared-prefix
//! multi-turn workload (the llm-d benchmark shape scaled down: many groups × few users, a long
//! system prompt per group, several turns), the same workload once per policy on fresh engines
//! (empty caches), and the engines' own prefix-cache counters as the judge.
//!
//! Asserted (engine-reported hit rate = Δ`vllm:prefix_cache_hits_total` /
//! Δ`vllm:prefix_cache_queries_total` over all engines):
//! `precise ≥ cache_aware > least_request ≥ round_robin` (`precise ≥ cache_aware` within
//! [`TIE`]: both reach the workload's ceiling, see the assertion), `precise ≥ 2 × round_robin`,
//! `scored > round_robin`; and for the cache-aware policies, at every sampled moment (every
//! 20 ms), no engine above the load guard's cap ([`guard_cap`]) nor, once the mean is at least
//! [`MIN_MEAN`], above 2 × the mean in-flight load (see [`MIN_MEAN`] for why not below).
//!
//! The table is printed (`cargo test -p kvmesh --test prefix_compare -- --nocapture`); the same
//! comparison by hand:
//! `kvmesh up --engines 8 --compare round_robin,least_request,cache_aware,precise,scored
//!  --groups 48 --users 3 --turns 3 --system-words 1800 --question-words 60 --max-tokens 32
//!  --kv-blocks 1200 --concurrency 96 --time-scale 1`.

use kvmesh_bench::{
    CompareRow, InFlightSampler, InFlightSamples, LoadOptions, SharedPrefixWorkload, Targets,
};
use kvmesh_config::{PolicyKind, ServeConfig, SimConfig};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ENGINES: u32 = 8;

/// 48 groups × 3 users × 3 turns = 432 requests; 1,800-word system prompts are ≈ 2,030 tokens
/// (≈ 127 blocks of 16) with the bundled Qwen3 tokenizer (1,500 words measured 1,774 prompt
/// tokens with one question and the chat template).
fn workload() -> SharedPrefixWorkload {
    SharedPrefixWorkload {
        groups: 48,
        users: 3,
        turns: 3,
        system_words: 1800,
        question_words: 60,
        max_tokens: 32,
        seed: 1,
    }
}

/// KV capacity per engine, in blocks of 16 tokens. A policy that partitions the groups puts
/// 48 / 8 = 6 group prompts (≈ 760 blocks) on each engine: 1,200 blocks hold ≈ 1.5 × that
/// share (the rest goes to the conversations' own tails, ~10-20 blocks per request).
/// Round robin sends every group to every engine, so each engine would need all 48 prompts
/// (≈ 6,100 blocks): it keeps evicting them.
const KV_BLOCKS: u32 = 1200;

/// Conversations in flight at once: 96 over 8 engines, a mean of up to 12 requests in flight
/// per engine, enough that the policies' load guard (an engine with ≤ 16 in flight is never
/// overloaded; above that, ≤ 1.5 × the mean) is exercised.
const CONCURRENCY: usize = 96;

/// Simulated time runs at real speed. With a faster clock (0.05) a request spends less wall
/// time in the engine than the debug-build router and load client spend on it in CPU, so the
/// in-flight counts measure CPU queueing on this 2-core machine, not the engines' load.
const TIME_SCALE: f64 = 1.0;

/// Tolerance of `precise ≥ cache_aware` (hit-rate fraction, 1 point): both reach the
/// workload's ceiling and differ by timing only; see the assertion.
const TIE: f64 = 0.01;

const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// The most requests the cache-aware policies' load guard lets one engine hold:
/// `max(balance_abs_threshold, ⌊balance_rel_threshold × (total + 1) / engines⌋)` with the
/// default guard (16, 1.5) and at most [`CONCURRENCY`] requests in flight in total (one per
/// conversation): max(16, ⌊1.5 × 97 / 8⌋) = 18. Asserted (+ 1, see there) at every sampled
/// moment.
fn guard_cap() -> u32 {
    let g = ServeConfig::default().routing.policy.prefix;
    let rel = g.balance_rel_threshold * (CONCURRENCY as f64 + 1.0) / f64::from(ENGINES);
    g.balance_abs_threshold.max(rel.floor() as u32)
}

/// Sampled moments whose mean in flight per engine is below this do not count for the
/// "no engine above 2 × the mean" check; it is half of [`guard_cap`] (9), so that check is
/// exactly what the guard promises. Why not every moment (mean ≥ 1, say): the guard bounds
/// load *when it routes* (an engine with ≤ 16 in flight is never overloaded; above that, at
/// most 1.5 × the mean at that moment), and a request cannot move once sent. In this
/// closed-loop workload the conversations' turns end in waves: the total in flight drops from
/// ~96 to ~60 within 100 ms while an engine keeps the 15 it was rightly given at a mean of 11.5
/// (15 / 7.5 = 2×); near the start and the end a few groups' siblings share their group's
/// engine at a mean of 1–4 (9 / 1.1). Round robin and least request show the same drift
/// (their moments above 2 × the mean at means ≥ 1 are printed too).
const MIN_MEAN: f64 = 9.0;

struct Run {
    row: CompareRow,
    samples: InFlightSamples,
    /// Per sample and engine: the policy's load and effective weight.
    views: Vec<EngineViews>,
    /// The router's decisions by reason.
    decisions: Vec<String>,
}

/// Per engine: the policy's load and effective weight.
type EngineViews = Vec<(u32, f64)>;

/// One policy on fresh engines: start 8 sims and a router, run the workload while sampling the
/// router's in-flight count per engine, read the engines' counters, shut everything down.
async fn run_policy(policy: PolicyKind) -> Run {
    let events = matches!(policy, PolicyKind::Precise | PolicyKind::Scored);
    let fleet = kvmesh_sim::start_fleet(ENGINES as usize, events, |i| {
        let mut cfg = SimConfig {
            time_scale: TIME_SCALE,
            seed: i as u64,
            max_model_len: KV_BLOCKS * 16,
            ..SimConfig::default()
        };
        cfg.engine.num_blocks = KV_BLOCKS;
        cfg
    })
    .await
    .expect("start sims");
    let entries = fleet.entries.clone();
    let sims = fleet.sims;
    let urls: Vec<String> = sims.iter().map(|s| s.base_url()).collect();
    let mut cfg = ServeConfig {
        listen: "127.0.0.1:0".into(),
        engines: entries,
        seed: 1,
        ..ServeConfig::default()
    };
    cfg.routing.policy.policy = policy;
    let router = kvmesh_gateway::start(cfg).await.expect("start router");

    let before = kvmesh_bench::engine_counters(&urls, Duration::from_secs(10))
        .await
        .expect("engine metrics");
    let gw = router.gateway.clone();
    let order = urls.clone();
    // Alongside each sample: what the policy saw of each engine then (its load, which is
    // max(in flight, engine-reported running + waiting), and its effective weight).
    let views: Arc<Mutex<Vec<EngineViews>>> = Arc::default();
    let log = views.clone();
    let sampler = InFlightSampler::start(SAMPLE_EVERY, move || {
        let mut v = vec![0u32; order.len()];
        let mut seen = vec![(0u32, 0.0f64); order.len()];
        let (now, fleet) = (gw.clock.now_us(), gw.registry.fleet_latency_us());
        for e in gw.registry.members() {
            if let Some(i) = order.iter().position(|u| *u == e.url) {
                v[i] = e.in_flight.load(Ordering::Relaxed);
                let view = e.view(now, fleet);
                seen[i] = (view.load(), view.weight);
            }
        }
        log.lock().unwrap().push(seen);
        v
    });
    let report = kvmesh_bench::run_shared_prefix(
        &workload(),
        Targets::Single(router.base_url()),
        LoadOptions {
            model: SimConfig::default().model,
            concurrency: CONCURRENCY,
            request_timeout: Duration::from_secs(30),
            deadline: Duration::from_secs(60),
        },
    )
    .await;
    let samples = sampler.stop().await;
    let engines = kvmesh_bench::engine_counters(&urls, Duration::from_secs(10))
        .await
        .expect("engine metrics")
        .since(&before);
    // The router's decision reasons (prefix_match, prefix_overloaded, prefix_none, ...).
    let decisions: Vec<String> = kvmesh_bench::fetch_text(
        &format!("{}/metrics", router.base_url()),
        Duration::from_secs(10),
    )
    .await
    .unwrap_or_default()
    .lines()
    .filter(|l| l.starts_with("kvmesh_routing_decisions_total{"))
    .filter_map(|l| {
        let reason = l.split("reason=\"").nth(1)?.split('"').next()?;
        Some(format!("{reason} {}", l.rsplit(' ').next()?))
    })
    .collect();
    router.shutdown().await;
    for s in sims {
        s.shutdown(Duration::from_secs(2)).await;
    }
    for e in report.errors.iter().take(5) {
        eprintln!("{}: error: {e}", policy.as_str());
    }
    let row = CompareRow {
        policy: policy.as_str().to_string(),
        engine_hit_rate: engines.hit_rate(),
        client_cached_rate: report.hit_rate(),
        prediction_ratio: report.prediction_ratio(),
        preemptions: engines.preemptions,
        ttft_p50: report.ttft_percentile(50.0),
        ttft_p99: report.ttft_percentile(99.0),
        worst: samples.worst(MIN_MEAN),
        max_in_flight: samples.moments().map(|m| m.max).max(),
        mean_in_flight: samples.average_mean(),
        samples_counted: samples.count_over(MIN_MEAN, f64::INFINITY).0,
        samples_total: samples.samples.len(),
        ok: report.samples.len(),
        errors: report.errors.len(),
        elapsed: report.elapsed,
    };
    let views = std::mem::take(&mut *views.lock().unwrap());
    Run {
        row,
        samples,
        views,
        decisions,
    }
}

fn ratio_at(s: &InFlightSamples, floor: f64) -> String {
    let (n, over) = s.count_over(floor, 2.0);
    match s.worst(floor) {
        Some(w) => format!(
            "{:.2} ({}/{:.1}, {over} of {n} over 2×)",
            w.ratio(),
            w.max,
            w.mean
        ),
        None => "none".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_policies_beat_load_only_ones_on_shared_prefixes() {
    assert_eq!(
        MIN_MEAN,
        f64::from(guard_cap()) / 2.0,
        "keep MIN_MEAN at half the cap"
    );
    let t0 = Instant::now();
    let policies = [
        PolicyKind::RoundRobin,
        PolicyKind::LeastRequest,
        PolicyKind::CacheAware,
        PolicyKind::Precise,
        PolicyKind::Scored,
    ];
    let mut runs = Vec::new();
    for p in policies {
        runs.push(run_policy(p).await);
    }
    let w = workload();
    println!(
        "{} engines × {KV_BLOCKS} KV blocks, {} groups × {} users × {} turns, {}-word system \
         prompts, {}-word questions, {} output tokens, concurrency {CONCURRENCY}, time scale \
         {TIME_SCALE}; worst max/mean over samples with mean ≥ {MIN_MEAN}",
        ENGINES, w.groups, w.users, w.turns, w.system_words, w.question_words, w.max_tokens
    );
    let rows: Vec<CompareRow> = runs.iter().map(|r| r.row.clone()).collect();
    print!("{}", kvmesh_bench::format_compare_table(&rows));
    for r in &runs {
        println!(
            "{:<14} in-flight worst max/mean at mean ≥ 1: {}; ≥ 4: {}; ≥ {MIN_MEAN}: {}; max {}; samples {}",
            r.row.policy,
            ratio_at(&r.samples, 1.0),
            ratio_at(&r.samples, 4.0),
            ratio_at(&r.samples, MIN_MEAN),
            r.samples.moments().map(|m| m.max).max().unwrap_or(0),
            r.samples.samples.len()
        );
        println!("{:<14} decisions: {}", "", r.decisions.join(", "));
        if let Some(w) = r.samples.worst(MIN_MEAN)
            && let (Some(inf), Some(v)) = (r.samples.samples.get(w.at), r.views.get(w.at))
        {
            let detail: Vec<String> = inf
                .iter()
                .zip(v)
                .map(|(i, (l, wt))| format!("{i}/{l}/{wt:.2}"))
                .collect();
            println!(
                "{:<14} at its worst moment, per engine in flight/policy load/weight: {}",
                "",
                detail.join(" ")
            );
            // The busiest engine's count and the total in flight around that moment (does the
            // ratio come from the engine gaining requests or from the others draining?).
            let e = inf.iter().position(|&x| x == w.max).unwrap_or(0);
            let around: Vec<String> = (w.at.saturating_sub(8)
                ..(w.at + 4).min(r.samples.samples.len()))
                .map(|k| {
                    let s = &r.samples.samples[k];
                    format!("{}/{}", s[e], s.iter().sum::<u32>())
                })
                .collect();
            println!(
                "{:<14} busiest engine / total in flight, samples {}..: {}",
                "",
                w.at.saturating_sub(8),
                around.join(" ")
            );
        }
    }
    println!("took {:.1}s", t0.elapsed().as_secs_f64());

    let hit = |p: PolicyKind| {
        runs.iter()
            .find(|r| r.row.policy == p.as_str())
            .map(|r| r.row.engine_hit_rate)
            .unwrap()
    };
    for r in &runs {
        assert_eq!(r.row.errors, 0, "{}: requests failed", r.row.policy);
        assert_eq!(r.row.ok as u64, w.requests(), "{}", r.row.policy);
    }
    let (rr, lr, ca, pr, sc) = (
        hit(PolicyKind::RoundRobin),
        hit(PolicyKind::LeastRequest),
        hit(PolicyKind::CacheAware),
        hit(PolicyKind::Precise),
        hit(PolicyKind::Scored),
    );
    // precise and cache_aware both reach this workload's ceiling, 85.8% (48 `prefix_none`
    // decisions, one per group; every later request hits its whole shared prefix): with one
    // router and caches that hold each engine's share of the groups, cache_aware's record of
    // its own decisions is exact, so precise has nothing to correct. Either may fall a few
    // tenths of a point below it when the load guard diverts a request (`prefix_overloaded`).
    // (Before lookup, decision and mark shared one index lock, two concurrent siblings could
    // both miss: measured precise − cache_aware then −0.21 to +0.44 points.) Precise must not
    // be worse than that.
    println!(
        "engine-reported hit rates: round_robin {rr:.4}, least_request {lr:.4}, cache_aware \
         {ca:.4}, precise {pr:.4}, scored {sc:.4}"
    );
    assert!(
        pr >= ca - TIE,
        "precise {pr:.4} < cache_aware {ca:.4} - {TIE}"
    );
    assert!(ca > lr, "cache_aware {ca:.4} <= least_request {lr:.4}");
    assert!(lr >= rr, "least_request {lr:.4} < round_robin {rr:.4}");
    assert!(pr >= 2.0 * rr, "precise {pr:.4} < 2 × round_robin {rr:.4}");
    assert!(sc > rr, "scored {sc:.4} <= round_robin {rr:.4}");
    for r in &runs {
        let p = r.row.policy.as_str();
        if !["cache_aware", "precise", "scored"].contains(&p) {
            continue;
        }
        // + 1: the guard reads max(router in flight, engine-reported running + waiting), which
        // may lag the router's own count by a request (decisions and the in-flight count are
        // serialised under the index lock; seen at most 18 = the cap in our runs).
        let cap = guard_cap() + 1;
        let top = r.samples.moments().map(|m| m.max).max().unwrap_or(0);
        assert!(
            top <= cap,
            "{p}: an engine had {top} requests in flight, above the load guard's {} + 1",
            guard_cap()
        );
        let (n, over) = r.samples.count_over(MIN_MEAN, 2.0);
        assert!(n > 0, "{p}: no in-flight sample with mean ≥ {MIN_MEAN}");
        assert_eq!(
            over,
            0,
            "{p}: {over} of {n} sampled moments with an engine above 2 × the mean in flight \
             (worst {:?})",
            r.samples.worst(MIN_MEAN)
        );
    }
}
