//! `kvmesh up`: a local cluster on loopback, with a demo workload that serves real requests.
//!
//! Today the cluster is N simulated engines and the demo spreads a shared-prefix multi-turn
//! chat workload over them round robin (what independent replicas behind DNS give); the
//! routers join this command as they land.

use clap::Args;
use kvmesh_bench::{LoadOptions, SharedPrefixWorkload, Targets};
use kvmesh_config::SimConfig;
use std::time::Duration;

fn w() -> SharedPrefixWorkload {
    SharedPrefixWorkload::default()
}

/// Flags of `kvmesh up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Simulated engines to start.
    #[arg(long, default_value_t = 4)]
    pub engines: u32,
    /// Time scale of the engines (0.1 = ten times faster than real time).
    #[arg(long, default_value_t = 0.1)]
    pub time_scale: f64,
    #[arg(long, help = format!("Demo workload: groups sharing a system prompt [default: {}]", w().groups))]
    pub groups: Option<u32>,
    #[arg(long, help = format!("Demo workload: users per group [default: {}]", w().users))]
    pub users: Option<u32>,
    #[arg(long, help = format!("Demo workload: turns per conversation [default: {}]", w().turns))]
    pub turns: Option<u32>,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// After the demo, keep the cluster serving until Ctrl-C.
    #[arg(long)]
    pub serve: bool,
}

/// Runs the local cluster and the demo.
pub async fn run(a: UpArgs) -> Result<(), String> {
    if a.engines == 0 {
        return Err("--engines must be at least 1".into());
    }
    let mut sims = Vec::new();
    for i in 0..a.engines {
        let mut cfg = SimConfig::default();
        cfg.listen = "127.0.0.1:0".into();
        cfg.time_scale = a.time_scale;
        cfg.seed = i as u64;
        let s = kvmesh_sim::start(cfg).await.map_err(|e| e.to_string())?;
        eprintln!("engine {i}: {}", s.base_url());
        sims.push(s);
    }
    let model = SimConfig::default().model;
    let wl = SharedPrefixWorkload {
        groups: a.groups.unwrap_or(w().groups),
        users: a.users.unwrap_or(w().users),
        turns: a.turns.unwrap_or(w().turns),
        ..w()
    };
    eprintln!(
        "demo: {} conversations × {} turns ({} requests), {} groups sharing system prompts, round robin over {} engines",
        wl.groups * wl.users,
        wl.turns,
        wl.requests(),
        wl.groups,
        a.engines
    );
    let report = kvmesh_bench::run_shared_prefix(
        &wl,
        Targets::RoundRobin(sims.iter().map(|s| s.base_url()).collect()),
        LoadOptions {
            model,
            concurrency: a.concurrency,
            request_timeout: Duration::from_secs(120),
            deadline: Duration::from_secs(600),
        },
    )
    .await;
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
    for s in sims {
        s.shutdown(Duration::from_secs(5)).await;
    }
    if report.errors.is_empty() {
        Ok(())
    } else {
        Err(format!("{} requests failed", report.errors.len()))
    }
}
