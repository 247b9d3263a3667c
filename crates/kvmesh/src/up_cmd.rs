//! `kvmesh up`: a local cluster on loopback — simulated engines and routers in front of them —
//! with a demo workload (shared-prefix multi-turn chats) that serves real requests through the
//! routers. Several routers form a mesh by default (certificates generated on the fly): they
//! share their routing decisions and load; `--no-mesh` runs them as independent replicas.
//!
//! `--compare p1,p2,...` runs the same workload once per policy, each on fresh engines (empty
//! caches), and prints one row per policy: the engines' own prefix-cache hit rate, the
//! client-side cached-token rate, TTFT and the worst sampled in-flight imbalance.

use crate::fleet;
use clap::Args;
use kvmesh_bench::{
    CompareRow, EngineCounters, InFlightSampler, LoadOptions, LoadReport, SharedPrefixWorkload,
    Targets,
};
use kvmesh_config::{PolicyKind, ServeConfig, SimConfig};
use kvmesh_gateway::GatewayServer;
use std::time::Duration;

fn w() -> SharedPrefixWorkload {
    SharedPrefixWorkload::default()
}

/// The most requests in flight the cache-aware policies' load guard lets one engine hold with
/// `concurrency` requests at most in flight in total: `max(balance_abs_threshold,
/// ⌊balance_rel_threshold × (concurrency + 1) / engines⌋)` (default guard: 16 and 1.5).
fn guard_cap(a: &UpArgs) -> u32 {
    let g = ServeConfig::default().routing.policy.prefix;
    let rel = g.balance_rel_threshold * (a.concurrency as f64 + 1.0) / f64::from(a.engines.max(1));
    g.balance_abs_threshold.max(rel.floor() as u32)
}

/// In-flight samples whose mean per engine is below half the guard's cap are not counted in
/// the imbalance figure: the guard bounds load when it routes (≤ 16 in flight is never
/// overloaded; above, ≤ 1.5 × the mean then), so at lower means an engine may hold more than
/// 2 × the mean by design, and when the other engines drain, its share grows.
fn min_mean_in_flight(a: &UpArgs) -> f64 {
    f64::from(guard_cap(a)) / 2.0
}

/// Flags of `kvmesh up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Simulated engines to start.
    #[arg(long, default_value_t = 4)]
    pub engines: u32,
    /// Routers to start in front of all engines, meshed (0 = clients spread requests over the
    /// engines round robin, the no-router baseline). Clients spread over them as DNS would.
    #[arg(long, default_value_t = 3)]
    pub routers: u32,
    /// Run the routers as independent replicas (no shared state).
    #[arg(long)]
    pub no_mesh: bool,
    /// Routing policy of the routers [default: precise, with the engines publishing KV events].
    #[arg(long, value_name = "NAME", value_parser = parse_policy)]
    pub policy: Option<PolicyKind>,
    /// Run the workload once per policy (comma-separated), each on fresh engines, and print a
    /// comparison table (e.g. round_robin,least_request,cache_aware,precise,scored).
    #[arg(long, value_name = "P1,P2,...", value_delimiter = ',', value_parser = parse_policy, conflicts_with_all = ["policy", "serve"])]
    pub compare: Vec<PolicyKind>,
    /// Time scale of the engines (0.1 = ten times faster than real time).
    #[arg(long, default_value_t = 0.1)]
    pub time_scale: f64,
    /// KV-cache capacity of each engine in blocks of 16 tokens [default: 24000, an H100 with
    /// an 8B model]. Small values make the cache hold only part of the workload's prompts.
    #[arg(long, value_name = "BLOCKS")]
    pub kv_blocks: Option<u32>,
    #[arg(long, help = format!("Demo workload: groups sharing a system prompt [default: {}]", w().groups))]
    pub groups: Option<u32>,
    #[arg(long, help = format!("Demo workload: users per group [default: {}]", w().users))]
    pub users: Option<u32>,
    #[arg(long, help = format!("Demo workload: turns per conversation [default: {}]", w().turns))]
    pub turns: Option<u32>,
    #[arg(long, help = format!("Demo workload: words per system prompt, ≈ 1.3 tokens each [default: {}]", w().system_words))]
    pub system_words: Option<u32>,
    #[arg(long, help = format!("Demo workload: words per question [default: {}]", w().question_words))]
    pub question_words: Option<u32>,
    #[arg(long, help = format!("Demo workload: completion tokens per turn [default: {}]", w().max_tokens))]
    pub max_tokens: Option<u32>,
    #[arg(long, help = format!("Demo workload: seed of the texts [default: {}]", w().seed))]
    pub workload_seed: Option<u64>,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Interval of the routers' in-flight samples, milliseconds.
    #[arg(long, default_value_t = 20)]
    pub sample_ms: u64,
    /// After the demo, keep the cluster serving until Ctrl-C.
    #[arg(long)]
    pub serve: bool,
}

pub(crate) fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    PolicyKind::ALL
        .iter()
        .copied()
        .find(|p| p.as_str() == s.trim())
        .ok_or_else(|| {
            let all: Vec<_> = PolicyKind::ALL.iter().map(|p| p.as_str()).collect();
            format!("unknown policy `{s}` (one of {})", all.join(", "))
        })
}

/// Engines and routers on loopback (see [`crate::fleet`]).
struct Cluster {
    sims: kvmesh_sim::LocalFleet,
    routers: Vec<GatewayServer>,
    engine_urls: Vec<String>,
}

impl Cluster {
    /// Starts `a.engines` fresh engines (publishing KV events when `policy` reads them) and
    /// `a.routers` routers with `policy` in front of all of them.
    async fn start(a: &UpArgs, policy: PolicyKind) -> Result<Cluster, String> {
        let spec = fleet::EngineSpec {
            engines: a.engines,
            time_scale: a.time_scale,
            kv_blocks: a.kv_blocks,
            max_model_len: None,
            profile: None,
            kv_events: matches!(policy, PolicyKind::Precise | PolicyKind::Scored),
            log: true,
        };
        let sims = fleet::start_engines(&spec).await?;
        let routers =
            match fleet::start_routers(&sims.entries, a.routers, !a.no_mesh, policy, 1, true).await
            {
                Ok(r) => r,
                Err(e) => {
                    sims.shutdown(Duration::from_secs(5)).await;
                    return Err(e);
                }
            };
        let engine_urls = sims.urls();
        Ok(Cluster {
            sims,
            routers,
            engine_urls,
        })
    }

    fn targets(&self) -> Targets {
        fleet::targets(&self.routers, &self.engine_urls)
    }

    /// Samples the routers' in-flight count per engine (summed over routers), or `None`
    /// without routers.
    fn sampler(&self, every: Duration) -> Option<InFlightSampler> {
        fleet::in_flight_sampler(&self.routers, &self.engine_urls, every)
    }

    async fn counters(&self) -> Result<EngineCounters, String> {
        fleet::counters(&self.engine_urls).await
    }

    async fn shutdown(self) {
        fleet::shutdown_routers(self.routers).await;
        self.sims.shutdown(Duration::from_secs(5)).await;
    }
}

/// Runs the workload against the cluster: the load report and its comparison row.
async fn run_load(
    c: &Cluster,
    a: &UpArgs,
    wl: &SharedPrefixWorkload,
    policy: &str,
) -> Result<(LoadReport, CompareRow), String> {
    let before = c.counters().await?;
    let sampler = c.sampler(Duration::from_millis(a.sample_ms.max(1)));
    let report = kvmesh_bench::run_shared_prefix(
        wl,
        c.targets(),
        LoadOptions {
            model: SimConfig::default().model,
            concurrency: a.concurrency,
            request_timeout: Duration::from_secs(120),
            deadline: Duration::from_secs(600),
        },
    )
    .await;
    let samples = match sampler {
        Some(s) => Some(s.stop().await),
        None => None,
    };
    let engines = c.counters().await?.since(&before);
    let floor = min_mean_in_flight(a);
    let (counted, total) = samples.as_ref().map_or((0, 0), |s| {
        (s.count_over(floor, f64::INFINITY).0, s.samples.len())
    });
    let row = CompareRow {
        policy: policy.to_string(),
        engine_hit_rate: engines.hit_rate(),
        client_cached_rate: report.hit_rate(),
        prediction_ratio: report.prediction_ratio(),
        preemptions: engines.preemptions,
        ttft_p50: report.ttft_percentile(50.0),
        ttft_p99: report.ttft_percentile(99.0),
        worst: samples.as_ref().and_then(|s| s.worst(floor)),
        max_in_flight: samples
            .as_ref()
            .and_then(|s| s.moments().map(|m| m.max).max()),
        mean_in_flight: samples.as_ref().map_or(0.0, |s| s.average_mean()),
        samples_counted: counted,
        samples_total: total,
        ok: report.samples.len(),
        errors: report.errors.len(),
        elapsed: report.elapsed,
    };
    Ok((report, row))
}

/// Runs the local cluster and the demo (or the comparison).
pub async fn run(a: UpArgs) -> Result<(), String> {
    if a.engines == 0 {
        return Err("--engines must be at least 1".into());
    }
    if !a.compare.is_empty() && a.routers == 0 {
        return Err("--compare needs at least one router (--routers 1)".into());
    }
    let d = w();
    let wl = SharedPrefixWorkload {
        groups: a.groups.unwrap_or(d.groups),
        users: a.users.unwrap_or(d.users),
        turns: a.turns.unwrap_or(d.turns),
        system_words: a.system_words.unwrap_or(d.system_words),
        question_words: a.question_words.unwrap_or(d.question_words),
        max_tokens: a.max_tokens.unwrap_or(d.max_tokens),
        seed: a.workload_seed.unwrap_or(d.seed),
    };
    let shape = format!(
        "{} conversations × {} turns ({} requests), {} groups sharing {}-word system prompts, \
         {}-word questions, {} completion tokens, {} engines of {} KV blocks, concurrency {}, \
         time scale {}",
        wl.groups * wl.users,
        wl.turns,
        wl.requests(),
        wl.groups,
        wl.system_words,
        wl.question_words,
        wl.max_tokens,
        a.engines,
        a.kv_blocks
            .unwrap_or(SimConfig::default().engine.num_blocks),
        a.concurrency,
        a.time_scale
    );
    if !a.compare.is_empty() {
        return compare(&a, &wl, &shape).await;
    }
    let policy = a.policy.unwrap_or(PolicyKind::Precise);
    let c = Cluster::start(&a, policy).await?;
    eprintln!(
        "demo: {shape}, {}",
        if c.routers.is_empty() {
            "no router (clients round robin over the engines)".to_string()
        } else {
            format!("{} router(s), policy {}", c.routers.len(), policy.as_str())
        }
    );
    let (report, row) = match run_load(&c, &a, &wl, policy.as_str()).await {
        Ok(x) => x,
        Err(e) => {
            c.shutdown().await;
            return Err(e);
        }
    };
    println!(
        "requests ok {} / errors {} in {:.1}s; prefix-cache hit rate {:.1}%; TTFT p50 {:.1} ms, p99 {:.1} ms (wall, time scale {})",
        report.samples.len(),
        report.errors.len(),
        report.elapsed.as_secs_f64(),
        report.hit_rate() * 100.0,
        report.ttft_percentile(50.0).as_secs_f64() * 1e3,
        report.ttft_percentile(99.0).as_secs_f64() * 1e3,
        a.time_scale
    );
    println!(
        "engine-reported prefix-cache hit rate {:.1}% (Δhits/Δqueries of the engines' /metrics), {} preemptions",
        row.engine_hit_rate * 100.0,
        row.preemptions
    );
    if c.routers.is_empty() {
        println!("in flight per engine: not sampled (no router)");
    } else {
        let worst = match row.worst {
            Some(w) => format!(
                "worst max/mean {:.2} ({} vs mean {:.1}) over {} samples with mean ≥ {}",
                w.ratio(),
                w.max,
                w.mean,
                row.samples_counted,
                min_mean_in_flight(&a)
            ),
            None => format!("no sample with mean ≥ {}", min_mean_in_flight(&a)),
        };
        println!(
            "in flight per engine (router view, every {} ms, {} samples): mean {:.1}, most on one engine {} (load guard cap {}); {worst}",
            a.sample_ms,
            row.samples_total,
            row.mean_in_flight,
            row.max_in_flight.unwrap_or(0),
            guard_cap(&a),
        );
    }
    for (i, r) in c.routers.iter().enumerate() {
        let mesh = r
            .gateway
            .mesh
            .get()
            .map(|m| {
                let s = m.status();
                format!(
                    ", mesh: {} members, reads the KV events of {} engines",
                    s["members"].as_array().map_or(0, Vec::len),
                    s["ingest"]["owned"].as_u64().unwrap_or(0)
                )
            })
            .unwrap_or_default();
        println!(
            "  router {} ({}): served {} requests{mesh}",
            i + 1,
            r.base_url(),
            r.gateway.metrics.requests.get()
        );
    }
    for (engine, n, hit) in report.per_endpoint() {
        println!("  {engine}: {n} requests, hit rate {:.1}%", hit * 100.0);
    }
    for e in report.errors.iter().take(5) {
        eprintln!("  error: {e}");
    }
    if a.serve {
        eprintln!("serving until Ctrl-C");
        crate::wait_for_signal().await;
    }
    c.shutdown().await;
    if report.errors.is_empty() {
        Ok(())
    } else {
        Err(format!("{} requests failed", report.errors.len()))
    }
}

/// `--compare`: one run per policy on fresh engines, then the table.
async fn compare(a: &UpArgs, wl: &SharedPrefixWorkload, shape: &str) -> Result<(), String> {
    eprintln!("comparison: {shape}, {} router(s)", a.routers);
    let mut rows = Vec::new();
    for &p in &a.compare {
        let c = Cluster::start(a, p).await?;
        let r = run_load(&c, a, wl, p.as_str()).await;
        c.shutdown().await;
        let (report, row) = r?;
        eprintln!(
            "{}: engine-reported hit rate {:.1}%, {} ok / {} errors in {:.1}s",
            p.as_str(),
            row.engine_hit_rate * 100.0,
            row.ok,
            row.errors,
            row.elapsed.as_secs_f64()
        );
        for e in report.errors.iter().take(3) {
            eprintln!("  error: {e}");
        }
        rows.push(row);
    }
    println!("{shape}");
    println!(
        "engine_hit = Δvllm:prefix_cache_hits_total / Δqueries over all engines; client_hit = \
         usage cached_tokens / prompt_tokens; pred/real = the router's predicted cached tokens \
         (x-kvmesh-predicted-cached-tokens) / the engines' cached tokens; TTFT in wall time (÷ time scale = simulated); \
         mean_inflt = mean in flight per engine over the samples (router view, every {} ms); \
         worst_max/mean = worst sampled max/mean among samples with mean ≥ {} (half the load \
         guard's cap); max_inflt = most in flight on one engine (guard cap {})",
        a.sample_ms,
        min_mean_in_flight(a),
        guard_cap(a)
    );
    print!("{}", kvmesh_bench::format_compare_table(&rows));
    let errors: usize = rows.iter().map(|r| r.errors).sum();
    if errors == 0 {
        Ok(())
    } else {
        Err(format!("{errors} requests failed"))
    }
}
