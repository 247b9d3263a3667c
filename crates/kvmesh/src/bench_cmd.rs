//! `kvmesh bench`: contenders side by side on one local simulated fleet (or on `--target`
//! URLs), interleaved, same workload and seed, engine caches reset between runs; the
//! virtual-time evaluator over the same jobs (every policy and the oracle); a report as
//! `report.json`, `report.md` and SVG plots under `--out`.

use crate::bench_routers::{self, contender_name};
use crate::fleet;
use crate::load_decisions::LoadDecisions;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvmesh_bench::eval::{Contender, EvalConfig, EvalResult, evaluate};
use kvmesh_bench::jobs::{self, JobSet};
use kvmesh_bench::replay::{PromptMode, ReplayOptions, replay};
use kvmesh_bench::report::{ContenderRow, Report, ratios};
use kvmesh_bench::settings::BenchSettings;
use kvmesh_bench::{EngineCounters, InFlightSampler, Targets};
use kvmesh_config::{EngineEntry, PolicyKind, ServeConfig, SimConfig};
use kvmesh_engine::EngineParams;
use kvmesh_route::TtlPlan;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// Groups sharing a long system prompt, multi-turn conversations (closed loop).
    SharedPrefix,
    /// Mooncake-format trace replay (open loop, timestamps ÷ the speed-up).
    Trace,
    /// Tiny prompts, one output token: what the router costs.
    Overhead,
}

/// Prompt encodings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Prompts {
    /// Token-id prompts to `/v1/completions`.
    Tokens,
    /// Text prompts, a word per token.
    Text,
}

/// How often the routers' in-flight count per engine is sampled during a run.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);

fn q() -> BenchSettings {
    BenchSettings::quick()
}
fn f() -> BenchSettings {
    BenchSettings::full()
}

/// Flags of `kvmesh bench`. Unset flags take the mode's value (kvmesh_bench::settings).
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Quick mode (≤ 2 minutes on a shared 2-core VM; CI smoke); default is full mode.
    #[arg(long)]
    pub quick: bool,
    /// Directory for report.json, report.md and the SVG plots.
    #[arg(long, default_value = "bench-report")]
    pub out: PathBuf,
    /// Workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::SharedPrefix)]
    pub workload: WorkloadKind,
    /// Mooncake JSONL trace for `--workload trace` [default: the bundled 600-line excerpt].
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Prompts as token ids or as text (a word per token).
    #[arg(long, value_enum, default_value_t = Prompts::Tokens)]
    pub prompts: Prompts,
    #[arg(long = "policy", value_name = "NAME", help = format!(
        "Contender policy, repeatable (round_robin is always run first as the baseline; \
         `oracle` is always reported, from the virtual-time evaluator) [default: {}; full: {}]",
        q().policies.join(","), f().policies.join(",")))]
    pub policies: Vec<String>,
    #[arg(long = "routers", value_name = "N[:mesh|:no-mesh]", value_parser = bench_routers::parse, help = format!(
        "Routers per contender, repeatable: every policy (and SMG) runs with each, interleaved in \
         every repeat. `3` = 3 meshed routers (independent with --no-mesh), `3:no-mesh` = 3 \
         independent replicas, `3:mesh` = meshed even with --no-mesh; 0 = clients straight to \
         the engines [default: {}]", q().routers))]
    pub routers: Vec<bench_routers::RouterSpec>,
    /// Routers given as a bare count run as independent replicas (no shared state).
    #[arg(long)]
    pub no_mesh: bool,
    /// With several routers: each client keeps one router for all its conversations (as a
    /// client that resolves DNS once and holds a keep-alive connection); default: every
    /// request goes to the next router, so a conversation's turns cross routers.
    #[arg(long)]
    pub sticky_clients: bool,
    /// Add SMG contenders (`smg` on PATH).
    #[arg(long)]
    pub smg: bool,
    /// Measure these OpenAI-compatible endpoints instead of a local fleet (repeatable; clients
    /// spread requests over them round robin, as DNS would).
    #[arg(long = "target", value_name = "URL")]
    pub targets: Vec<String>,
    #[arg(long, help = format!("Simulated engines [default: {}]", q().engines))]
    pub engines: Option<u32>,
    #[arg(long, help = format!("KV-cache blocks (16 tokens) per engine [default: {} quick, {} full; trace {}]", q().kv_blocks, f().kv_blocks, q().trace_kv_blocks))]
    pub kv_blocks: Option<u32>,
    #[arg(long, help = format!("Seed of the workload and the routers [default: {}]", q().seed))]
    pub seed: Option<u64>,
    #[arg(long, help = format!("Repeats of every contender [default: {} quick, {} full]", q().repeats, f().repeats))]
    pub repeats: Option<u32>,
    #[arg(long, help = format!("Closed loop: conversations at once [default: {} quick, {} full]", q().concurrency, f().concurrency))]
    pub concurrency: Option<usize>,
    #[arg(long, value_name = "MS", help = format!("Closed loop: a client's mean pause after each request before its next, ms (each pause uniform in [0, 2 × MS], fixed by the job; 0 = at once) [default: {}]", q().think_ms))]
    pub think_ms: Option<u64>,
    #[arg(long, help = format!("Engines' time scale [default: {}]", q().time_scale))]
    pub time_scale: Option<f64>,
    #[arg(long, help = format!("Trace lines / overhead requests [default: {}/{} quick, {}/{} full]", q().trace_requests, q().overhead_requests, f().trace_requests, f().overhead_requests))]
    pub requests: Option<usize>,
    #[arg(long, help = format!("Shared-prefix groups [default: {} quick, {} full]", q().shared_prefix.groups, f().shared_prefix.groups))]
    pub groups: Option<u32>,
    #[arg(long, help = format!("Trace speed-up (wall = trace time ÷ this) [default: {} quick, {} full]", q().trace_speedup, f().trace_speedup))]
    pub speedup: Option<f64>,
    /// Only the virtual-time evaluator (no fleet, no real requests).
    #[arg(long)]
    pub eval_only: bool,
}

struct Plan {
    s: BenchSettings,
    sticky_clients: bool,
    /// (routers, meshed) per contender group, in the order given; meshed only when > 1.
    routers: Vec<(u32, bool)>,
    set: JobSet,
    kv_blocks: u32,
    policies: Vec<PolicyKind>,
    prompts: PromptMode,
    notes: Vec<String>,
}

fn plan(a: &BenchArgs) -> Result<Plan, String> {
    let mut s = if a.quick { q() } else { f() };
    let mut notes = Vec::new();
    for (flag, zero) in [
        ("--engines", a.engines == Some(0)),
        ("--repeats", a.repeats == Some(0)),
        ("--concurrency", a.concurrency == Some(0)),
        ("--groups", a.groups == Some(0)),
        ("--requests", a.requests == Some(0)),
    ] {
        if zero {
            return Err(format!("{flag} must be at least 1"));
        }
    }
    // Flags that would do nothing in the combination given are refused, not ignored (QA).
    if a.trace.is_some() && !matches!(a.workload, WorkloadKind::Trace) {
        return Err("--trace is read with --workload trace only".into());
    }
    if !a.targets.is_empty() {
        for (flag, given) in [
            ("--engines", a.engines.is_some()),
            ("--routers", !a.routers.is_empty()),
            ("--kv-blocks", a.kv_blocks.is_some()),
            ("--smg", a.smg),
        ] {
            if given {
                return Err(format!(
                    "{flag} sets up the local fleet, which --target replaces: give one or the other"
                ));
            }
        }
    }
    s.engines = a.engines.unwrap_or(s.engines);
    let routers = bench_routers::resolve(&a.routers, s.routers, a.no_mesh);
    if a.sticky_clients && a.targets.is_empty() && routers.iter().all(|&(n, _)| n <= 1) {
        return Err("--sticky-clients needs more than one router (--routers N)".into());
    }
    s.routers = routers[0].0;
    s.repeats = a.repeats.unwrap_or(s.repeats);
    s.seed = a.seed.unwrap_or(s.seed);
    s.concurrency = a.concurrency.unwrap_or(s.concurrency);
    s.think_ms = a.think_ms.unwrap_or(s.think_ms);
    s.time_scale = a.time_scale.unwrap_or(s.time_scale);
    s.trace_speedup = a.speedup.unwrap_or(s.trace_speedup);
    s.shared_prefix.seed = s.seed;
    if let Some(g) = a.groups {
        s.shared_prefix.groups = g;
    }
    if let Some(n) = a.requests {
        s.trace_requests = n;
        s.overhead_requests = n;
    }
    if !(s.time_scale > 0.0 && s.time_scale <= 10.0) {
        return Err("--time-scale must be in (0, 10]".into());
    }
    if a.kv_blocks
        .is_some_and(|b| !(2..=kvmesh_config::MAX_NUM_BLOCKS).contains(&b))
    {
        return Err(format!(
            "--kv-blocks must be from 2 to {}",
            kvmesh_config::MAX_NUM_BLOCKS
        ));
    }
    if !(s.trace_speedup > 0.0 && s.trace_speedup.is_finite()) {
        return Err("--speedup must be above 0".into());
    }
    for t in &a.targets {
        if !kvmesh_config::valid_base_url(&kvmesh_config::canonical_base_url(t)) {
            return Err(format!(
                "--target {t}: not an http://HOST:PORT base URL (the endpoint's address, without /v1)"
            ));
        }
    }
    let kv_blocks = a.kv_blocks.unwrap_or(match a.workload {
        WorkloadKind::Trace => s.trace_kv_blocks,
        _ => s.kv_blocks,
    });
    let max_model_len = kv_blocks.saturating_mul(SimConfig::default().engine.block_size);
    let set = match a.workload {
        WorkloadKind::SharedPrefix => jobs::shared_prefix_jobs(&s.shared_prefix),
        WorkloadKind::Overhead => jobs::overhead_jobs(s.overhead_requests, s.seed),
        WorkloadKind::Trace => {
            let text = match &a.trace {
                Some(p) => std::fs::read_to_string(p)
                    .map_err(|e| format!("--trace {}: {e}", p.display()))?,
                None => jobs::BUNDLED_TRACE.to_string(),
            };
            let lines = jobs::parse_trace(&text)?;
            let set = jobs::trace_jobs(&lines, s.trace_requests, max_model_len);
            if set.jobs.is_empty() {
                return Err(match set.skipped {
                    0 => "the trace has no requests".into(),
                    n => format!(
                        "the trace has no usable request: {n} skipped, prompt + completion above {max_model_len} tokens (the engines' KV cache: --kv-blocks {kv_blocks} × 16 tokens)"
                    ),
                });
            }
            if set.skipped > 0 {
                notes.push(format!(
                    "{} trace lines skipped: prompt + completion above {max_model_len} tokens (the engines' KV cache)",
                    set.skipped
                ));
            }
            set
        }
    };
    // The engines' context is their KV cache (bench starts them so): a request longer than
    // that would only be refused.
    if a.targets.is_empty()
        && let Some(j) = set
            .jobs
            .iter()
            .max_by_key(|j| j.prompt.len() as u64 + u64::from(j.max_tokens))
        && j.prompt.len() as u64 + u64::from(j.max_tokens) > u64::from(max_model_len)
    {
        return Err(format!(
            "--kv-blocks {kv_blocks} holds {max_model_len} tokens per engine, and the workload's longest request needs {} (prompt + completion): give more blocks",
            j.prompt.len() as u64 + u64::from(j.max_tokens)
        ));
    }
    let names = if a.policies.is_empty() {
        s.policies.clone()
    } else {
        a.policies.clone()
    };
    let mut policies = Vec::new();
    for n in names {
        if n.trim() == "oracle" {
            continue; // always in the evaluator's rows
        }
        let p = crate::up_cmd::parse_policy(&n)?;
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    policies.retain(|p| *p != PolicyKind::RoundRobin);
    policies.insert(0, PolicyKind::RoundRobin);
    let prompts = match a.prompts {
        Prompts::Tokens => PromptMode::Tokens,
        Prompts::Text => PromptMode::Text,
    };
    Ok(Plan {
        s,
        sticky_clients: a.sticky_clients,
        routers,
        set,
        kv_blocks,
        policies,
        prompts,
        notes,
    })
}

fn engine_spec(p: &Plan) -> fleet::EngineSpec {
    fleet::EngineSpec {
        engines: p.s.engines,
        time_scale: p.s.time_scale,
        kv_blocks: Some(p.kv_blocks),
        max_model_len: Some(u32::MAX),
        // The overhead workload measures the router: engines answer at once.
        profile: (p.set.name == "overhead").then(|| "instant".to_string()),
        kv_events: true,
        log: false,
    }
}

/// Runs the evaluator for every policy and the oracle (in a blocking thread).
async fn run_evaluator(p: &Plan, closed_concurrency: usize) -> Result<Vec<EvalResult>, String> {
    let sim = engine_spec(p).config(0);
    let params = EngineParams::from_config(&sim.engine, sim.max_model_len, 0)?;
    let serve = ServeConfig::default();
    let cfg = EvalConfig {
        engines: p.s.engines as usize,
        params,
        routing: serve.routing.policy.clone(),
        ttl: TtlPlan {
            speculative_us: serve.prefix.speculative_ttl_ms * 1_000,
            approximate_us: serve.prefix.approximate_ttl_ms * 1_000,
        },
        concurrency: closed_concurrency,
        // Arrivals in simulated time: trace time ÷ (speed-up × time scale).
        speedup: p.s.trace_speedup * p.s.time_scale,
        seed: p.s.seed,
    };
    let mut contenders: Vec<Contender> = p.policies.iter().map(|&k| Contender::Policy(k)).collect();
    contenders.push(Contender::Oracle);
    let set = Arc::new(p.set.clone());
    let bar = ProgressBar::new(contenders.len() as u64);
    bar.set_style(style("evaluator (virtual time)"));
    let mut out = Vec::new();
    for c in contenders {
        bar.set_message(c.name());
        let (set, cfg) = (set.clone(), cfg.clone());
        let r = tokio::task::spawn_blocking(move || evaluate(&set, c, &cfg))
            .await
            .map_err(|e| format!("evaluator: {e}"))?;
        out.push(r);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

fn style(prefix: &str) -> ProgressStyle {
    ProgressStyle::with_template(&format!(
        "{prefix} {{msg:>24}} [{{bar:30}}] {{pos}}/{{len}} {{elapsed}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
}

/// POST `{url}/reset_prefix_cache` on every engine (retried while requests drain, bounded).
pub(crate) async fn reset_caches(urls: &[String]) -> Result<(), String> {
    for u in urls {
        let mut last = String::new();
        let mut ok = false;
        for _ in 0..50 {
            match kvmesh_bench::replay::post_empty(
                &format!("{u}/reset_prefix_cache"),
                Duration::from_secs(5),
            )
            .await
            {
                Ok(()) => {
                    ok = true;
                    break;
                }
                Err(e) => {
                    last = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        if !ok {
            return Err(format!("cannot reset the prefix cache of {u}: {last}"));
        }
    }
    Ok(())
}

fn replay_opts(p: &Plan) -> ReplayOptions {
    let overhead = p.set.name == "overhead";
    ReplayOptions {
        model: SimConfig::default().model,
        prompts: p.prompts,
        concurrency: if overhead {
            p.s.overhead_concurrency
        } else {
            p.s.concurrency
        },
        max_in_flight: p.s.trace_max_in_flight,
        speedup: p.s.trace_speedup,
        request_timeout: Duration::from_secs(p.s.request_timeout_s),
        deadline: Duration::from_secs(p.s.run_deadline_s),
        sticky_clients: p.sticky_clients,
        think: Duration::from_millis(p.s.think_ms),
    }
}

/// One contender's run against `targets`; `engine_urls` are read for the counters (empty with
/// external targets: the hit rate is then the client-side one).
async fn measure(
    p: &Plan,
    name: &str,
    targets: Targets,
    engine_urls: &[String],
    prompts: PromptMode,
    sampler: Option<InFlightSampler>,
) -> Result<ContenderRow, String> {
    let each = |urls: &[String]| {
        let urls = urls.to_vec();
        async move { kvmesh_bench::engine_counters_each(&urls, Duration::from_secs(10)).await }
    };
    let before = each(engine_urls).await?;
    let bar = ProgressBar::new(p.set.jobs.len() as u64);
    bar.set_style(style("real time"));
    bar.set_message(name.to_string());
    let b = bar.clone();
    let opts = ReplayOptions {
        prompts,
        ..replay_opts(p)
    };
    let (records, elapsed) = replay(&p.set, targets, &opts, Arc::new(move || b.inc(1))).await;
    bar.finish_and_clear();
    let (spread, shape, steady) = match sampler {
        // Under load only: the samples whose mean in flight per engine is at least half the
        // run's highest (the ramp-up and the drain at the end measure the order requests
        // finish in, not the balancing).
        Some(s) => {
            let s = s.stop().await;
            let peak = s.moments().map(|m| m.mean).fold(0.0, f64::max);
            let under_load = (peak / 2.0).max(1.0);
            // The steady part: at least 90% of the highest mean (the ramp and the drain out).
            let steady = s.shape((0.9 * peak).max(1.0)).map(|(_, excess)| excess);
            (s.spread(under_load), s.shape(under_load), steady)
        }
        None => (None, None, None),
    };
    let after = each(engine_urls).await?;
    let deltas: Vec<(String, EngineCounters)> = engine_urls
        .iter()
        .zip(after.iter().zip(&before))
        .map(|(u, (a, b))| (u.clone(), a.since(b)))
        .collect();
    let mut row = ContenderRow::from_records(&records, elapsed.as_secs_f64(), &deltas);
    if engine_urls.is_empty() {
        row.hit_rate = row.client_hit_rate;
    }
    row.inflight_spread = spread.map(|(mean, _)| mean);
    row.inflight_spread_p99 = spread.map(|(_, p99)| p99);
    row.inflight_mean = shape.map(|(mean, _)| mean);
    row.inflight_excess = shape.map(|(_, excess)| excess);
    row.inflight_excess_steady = steady;
    if let Some(e) = records.iter().find_map(|r| r.error.as_ref()) {
        eprintln!("{name}: {} errors, first: {e}", row.errors);
    }
    Ok(row)
}

/// Notes a contender left out of one repeat.
fn skipped(failures: &mut Vec<String>, rep: u32, name: &str, what: &str, e: &str) {
    let msg = format!("repeat {rep}: `{name}` {what}, left out of this repeat: {e}");
    eprintln!("{msg}");
    failures.push(msg);
}

/// Runs `kvmesh bench`.
pub async fn run(a: BenchArgs) -> Result<(), String> {
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut p = plan(&a)?;
    // Read before the run: the tree may change while it goes on.
    let commit = crate::bench_env::commit();
    crate::bench_env::check_out_dir(&a.out)?;
    eprintln!(
        "workload {}: {} requests, {} prompt tokens{}",
        p.set.name,
        p.set.jobs.len(),
        p.set.prompt_tokens(),
        if p.set.skipped > 0 {
            format!(", {} skipped", p.set.skipped)
        } else {
            String::new()
        }
    );
    let smg_bin = if a.smg { crate::smg::find() } else { None };
    if a.smg {
        p.notes.push(match &smg_bin {
            Some(b) => format!(
                "SMG contender: `{} launch --policy cache_aware` in front of the same engines, sent text prompts (SMG tokenizes text; for a like-for-like comparison run every contender with --prompts text)",
                b.display()
            ),
            None => "--smg: `smg` is not on PATH (pip install smg): no SMG contender was run".into(),
        });
        if smg_bin.is_none() {
            eprintln!(
                "warning: --smg: `smg` is not on PATH (pip install smg): no SMG contender will run"
            );
        }
    }
    // The overhead workload puts nginx `proxy_pass` beside the routers when it is installed.
    let nginx_bin = if p.set.name == "overhead" && a.targets.is_empty() {
        crate::nginx::find()
    } else {
        None
    };
    if p.set.name == "overhead" && a.targets.is_empty() {
        p.notes.push(match &nginx_bin {
            Some(b) => format!(
                "nginx contender: `{}` with a generated config (upstream keep-alive to the same engines, round robin, proxy_buffering off)",
                b.display()
            ),
            None => "nginx is not installed (apt-get install nginx-light; scripts/overhead.sh installs it): no nginx row".into(),
        });
    }
    let closed_concurrency = if p.set.name == "overhead" {
        p.s.overhead_concurrency
    } else {
        p.s.concurrency
    };
    let evaluator = if p.set.name == "overhead" {
        p.notes.push("overhead workload: no evaluator rows (it measures the router's own cost, which the virtual-time evaluator does not model)".into());
        Vec::new()
    } else if a.targets.is_empty() {
        run_evaluator(&p, closed_concurrency).await?
    } else {
        p.notes.push("external targets: no evaluator rows (the fleet behind them is unknown); hit rate is client-side (usage cached tokens / prompt tokens)".into());
        Vec::new()
    };
    let mut runs: Vec<ContenderRow> = Vec::new();
    if a.eval_only {
        p.notes.push("--eval-only: no real-time runs".into());
    } else if !a.targets.is_empty() {
        for rep in 0..p.s.repeats {
            let mut row = measure(
                &p,
                "target",
                Targets::RoundRobin(a.targets.clone()),
                &[],
                p.prompts,
                None,
            )
            .await?;
            row.name = "target".into();
            row.policy = "external".into();
            row.repeat = Some(rep);
            runs.push(row);
        }
    } else {
        let engines = fleet::start_engines(&engine_spec(&p)).await?;
        let urls = engines.urls();
        // Contenders: (policy, routers, meshed) for every router spec; the overhead workload
        // adds the engines directly.
        let mut plan_runs: Vec<(PolicyKind, u32, bool)> = Vec::new();
        for &(n, mesh) in &p.routers {
            if n == 0 {
                plan_runs.push((PolicyKind::RoundRobin, 0, false)); // the same for every policy
                continue;
            }
            plan_runs.extend(p.policies.iter().map(|&k| (k, n, mesh)));
        }
        if p.set.name == "overhead" && !plan_runs.iter().any(|r| r.1 == 0) {
            plan_runs.push((PolicyKind::RoundRobin, 0, false));
        }
        // SMG: as many gateways as each router spec (at least one), meshed when it is.
        let mut smg_runs: Vec<(usize, bool)> = Vec::new();
        for &(n, mesh) in &p.routers {
            let v = (n.max(1) as usize, mesh);
            if !smg_runs.contains(&v) {
                smg_runs.push(v);
            }
        }
        // A contender that fails to start or to be measured in one repeat is left out of that
        // repeat (said in the report's notes); the others still run.
        let mut failures: Vec<String> = Vec::new();
        let result = async {
            for rep in 0..p.s.repeats {
                for &(policy, n_routers, mesh) in &plan_runs {
                    reset_caches(&urls).await?;
                    let reads_events = matches!(policy, PolicyKind::Precise | PolicyKind::Scored);
                    let entries: Vec<EngineEntry> = engines
                        .entries
                        .iter()
                        .map(|e| {
                            let mut e = e.clone();
                            if !reads_events {
                                e.kv_events.clear();
                                e.kv_replay.clear();
                            }
                            e
                        })
                        .collect();
                    let name = contender_name(policy, n_routers, mesh);
                    let routers = match fleet::start_routers(&entries, n_routers, mesh, policy, p.s.seed, false).await {
                        Ok(r) => r,
                        Err(e) => {
                            skipped(&mut failures, rep, &name, "did not start", &e);
                            continue;
                        }
                    };
                    let sampler = fleet::in_flight_sampler(&routers, &urls, SAMPLE_EVERY);
                    let decisions = LoadDecisions::watch(&routers);
                    fleet::reset_envelope_ages(&routers);
                    let row = measure(&p, &name, fleet::targets(&routers, &urls), &urls, p.prompts, sampler).await;
                    let age = fleet::envelope_age(&routers);
                    fleet::shutdown_routers(routers).await;
                    let mut row = match row {
                        Ok(r) => r,
                        Err(e) => {
                            skipped(&mut failures, rep, &name, "was not measured", &e);
                            continue;
                        }
                    };
                    row.name = name;
                    row.policy = if n_routers == 0 { "direct".into() } else { policy.as_str().into() };
                    row.routers = n_routers;
                    row.mesh = mesh;
                    row.repeat = Some(rep);
                    row.least_load_decisions = decisions.map(|d| d.counts()).filter(|c| c.0 > 0);
                    row.mesh_envelope_age_ms = age;
                    eprintln!(
                        "repeat {rep} {}: {:.0} out tok/s, hit {:.1}%, TTFT p99 {:.0} ms, in flight max/mean {}, {} errors",
                        row.name, row.output_tokens_per_s, row.hit_rate * 100.0, row.ttft_p99_ms,
                        row.inflight_spread.map_or("–".into(), |x| format!("{x:.2}")), row.errors
                    );
                    runs.push(row);
                }
                if let Some(bin) = &nginx_bin {
                    reset_caches(&urls).await?;
                    let name = "nginx proxy_pass".to_string();
                    let row = match crate::nginx::start(bin, &urls).await {
                        Ok(nginx) => measure(&p, &name, Targets::Single(nginx.url.clone()), &urls, p.prompts, None).await,
                        Err(e) => Err(format!("did not start: {e}")),
                    };
                    match row {
                        Ok(mut row) => {
                            row.name = name;
                            row.policy = "nginx".into();
                            row.routers = 1;
                            row.repeat = Some(rep);
                            eprintln!(
                                "repeat {rep} {}: {:.0} req/s, TTFT p50 {:.2} ms, p99 {:.2} ms, {} errors",
                                row.name, row.requests_per_s, row.ttft_p50_ms, row.ttft_p99_ms, row.errors
                            );
                            runs.push(row);
                        }
                        Err(e) => skipped(&mut failures, rep, &name, "failed", &e),
                    }
                }
                let Some(bin) = &smg_bin else { continue };
                for &(n, meshed) in &smg_runs {
                    reset_caches(&urls).await?;
                    let name = match (n, meshed) {
                        (1, _) => "smg cache_aware".to_string(),
                        (n, true) => format!("smg cache_aware ×{n} meshed"),
                        (n, false) => format!("smg cache_aware ×{n} no-mesh"),
                    };
                    let started = if meshed {
                        crate::smg::start_mesh(bin, &urls, "cache_aware", n).await
                    } else {
                        let mut v = Vec::new();
                        let mut err = None;
                        for _ in 0..n {
                            match crate::smg::start(bin, &urls, "cache_aware").await {
                                Ok(s) => v.push(s),
                                Err(e) => {
                                    err = Some(e);
                                    break;
                                }
                            }
                        }
                        match err {
                            Some(e) => Err(e),
                            None => Ok(v),
                        }
                    };
                    let smgs = match started {
                        Ok(s) => s,
                        Err(e) => {
                            skipped(&mut failures, rep, &name, "did not start", &e);
                            continue;
                        }
                    };
                    let targets = if n == 1 {
                        Targets::Single(smgs[0].url.clone())
                    } else {
                        Targets::RoundRobin(smgs.iter().map(|s| s.url.clone()).collect())
                    };
                    let row = measure(&p, &name, targets, &urls, PromptMode::Text, None).await;
                    drop(smgs);
                    let mut row = match row {
                        Ok(r) => r,
                        Err(e) => {
                            skipped(&mut failures, rep, &name, "was not measured", &e);
                            continue;
                        }
                    };
                    row.name = name;
                    row.policy = "smg_cache_aware".into();
                    row.routers = n as u32;
                    row.mesh = meshed;
                    row.repeat = Some(rep);
                    eprintln!(
                        "repeat {rep} {}: {:.0} out tok/s, hit {:.1}%, TTFT p99 {:.0} ms, {} errors",
                        row.name, row.output_tokens_per_s, row.hit_rate * 100.0, row.ttft_p99_ms, row.errors
                    );
                    runs.push(row);
                }
            }
            Ok::<(), String>(())
        }
        .await;
        engines.shutdown(Duration::from_secs(5)).await;
        p.notes.extend(failures);
        result?;
    }
    let mut names: Vec<String> = Vec::new();
    for r in &runs {
        if !names.contains(&r.name) {
            names.push(r.name.clone());
        }
    }
    let contenders: Vec<ContenderRow> = names
        .iter()
        .map(|n| {
            let rs: Vec<ContenderRow> = runs.iter().filter(|r| &r.name == n).cloned().collect();
            ContenderRow::median_of(&rs)
        })
        .collect();
    let baseline = names.first().cloned().unwrap_or_default();
    let report = Report {
        machine: crate::bench_env::machine(),
        commit,
        seed: p.s.seed,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started_unix,
        workload: serde_json::json!({
            "name": p.set.name,
            "requests": p.set.jobs.len(),
            "skipped": p.set.skipped,
            "prompt_tokens": p.set.prompt_tokens(),
            "arrival": p.set.arrival,
            "prompts": p.prompts,
            "concurrency": closed_concurrency,
            "sticky_clients": p.sticky_clients,
            "think_ms": p.s.think_ms,
            "shared_prefix": if p.set.name == "shared-prefix" { serde_json::to_value(&p.s.shared_prefix).unwrap_or_default() } else { serde_json::Value::Null },
            "trace_speedup": if p.set.name == "trace" { serde_json::json!(p.s.trace_speedup) } else { serde_json::Value::Null },
            "mode": if a.quick { "quick" } else { "full" },
        }),
        fleet: if a.targets.is_empty() {
            serde_json::json!({
                "engines": p.s.engines,
                "kv_blocks": p.kv_blocks,
                "block_size": SimConfig::default().engine.block_size,
                "time_scale": p.s.time_scale,
                "profile": SimConfig::default().engine.profile,
                "routers": p.routers.iter().map(|&(n, mesh)| serde_json::json!({ "routers": n, "mesh": mesh })).collect::<Vec<_>>(),
            })
        } else {
            serde_json::json!({ "targets": a.targets })
        },
        repeats: p.s.repeats,
        ratios: ratios(&runs, &baseline),
        contenders,
        runs,
        evaluator,
        notes: p.notes.clone(),
    };
    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    let write = |name: &str, body: &str| {
        std::fs::write(a.out.join(name), body)
            .map_err(|e| format!("{}: {e}", a.out.join(name).display()))
    };
    write("report.json", &json)?;
    let md = report.markdown();
    write("report.md", &md)?;
    let plots = kvmesh_bench::plot::write_all(&report, &a.out)?;
    println!("{md}");
    eprintln!(
        "wrote {}: report.json, report.md, {}",
        a.out.display(),
        plots.join(", ")
    );
    let errors: u64 = report.contenders.iter().map(|c| c.errors).sum();
    if errors > 0 {
        eprintln!(
            "{errors} requests failed (each contender's first error: `first_error` in report.json)"
        );
    }
    // A contender none of whose requests was answered measured nothing: the run failed.
    if let Some(c) = report
        .contenders
        .iter()
        .find(|c| c.requests == 0 && c.errors > 0)
    {
        return Err(format!(
            "every request of `{}` failed ({} of them); the first: {}",
            c.name,
            c.errors,
            c.first_error.as_deref().unwrap_or("unknown")
        ));
    }
    Ok(())
}
