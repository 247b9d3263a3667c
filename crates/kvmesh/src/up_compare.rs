//! `kvmesh up --compare p1,p2,...`: the same workload once per policy, each on fresh engines
//! (empty caches), one row per policy: the engines' own prefix-cache hit rate, the
//! client-side cached-token rate, TTFT and the worst sampled in-flight imbalance.

use crate::fleet;
use crate::up_cmd::UpArgs;
use kvmesh_bench::{
    CompareRow, EngineCounters, InFlightSampler, LoadOptions, LoadReport, SharedPrefixWorkload,
    Targets,
};
use kvmesh_config::{PolicyKind, ServeConfig, SimConfig};
use kvmesh_gateway::GatewayServer;
use std::time::Duration;

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
            kv_blocks: Some(a.kv_blocks()),
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

/// `--compare`: one run per policy on fresh engines, then the table.
pub async fn compare(a: &UpArgs, wl: &SharedPrefixWorkload) -> Result<(), String> {
    let shape = &format!(
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
        a.kv_blocks(),
        a.concurrency,
        a.time_scale
    );
    eprintln!("comparison: {shape}, {} router(s)", a.routers);
    if let Some(p) = crate::up_cmd::log_file(a) {
        eprintln!("logs: {} (-v prints them here)", p.display());
    }
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
