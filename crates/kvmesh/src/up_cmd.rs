//! `kvmesh up`: a local cluster on loopback — simulated engines and routers in front of them —
//! with a demo workload (shared-prefix multi-turn chats) that serves real requests through the
//! routers. Routers do not share state yet (the mesh comes later): each routes on its own view.

use clap::Args;
use kvmesh_bench::{LoadOptions, SharedPrefixWorkload, Targets};
use kvmesh_config::{EngineEntry, PolicyKind, ServeConfig, SimConfig};
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
    /// Routers to start in front of all engines (0 = clients spread requests over the engines
    /// round robin, the no-router baseline).
    #[arg(long, default_value_t = 1)]
    pub routers: u32,
    #[arg(long, value_name = "NAME", value_parser = parse_policy, help = format!("Routing policy of the routers [default: {}]", ServeConfig::default().routing.policy.policy.as_str()))]
    pub policy: Option<PolicyKind>,
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

fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    PolicyKind::ALL
        .iter()
        .copied()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| format!("unknown policy `{s}`"))
}

/// Runs the local cluster and the demo.
pub async fn run(a: UpArgs) -> Result<(), String> {
    if a.engines == 0 {
        return Err("--engines must be at least 1".into());
    }
    let mut sims = Vec::new();
    for i in 0..a.engines {
        let cfg = SimConfig {
            listen: "127.0.0.1:0".into(),
            time_scale: a.time_scale,
            seed: i as u64,
            ..SimConfig::default()
        };
        let s = kvmesh_sim::start(cfg).await.map_err(|e| e.to_string())?;
        eprintln!("engine {i}: {}", s.base_url());
        sims.push(s);
    }
    let mut routers = Vec::new();
    for i in 0..a.routers {
        let mut cfg = ServeConfig {
            listen: "127.0.0.1:0".into(),
            engines: sims
                .iter()
                .map(|s| EngineEntry {
                    url: s.base_url(),
                    ..EngineEntry::default()
                })
                .collect(),
            seed: 1 + i as u64,
            ..ServeConfig::default()
        };
        if let Some(p) = a.policy {
            cfg.routing.policy.policy = p;
        }
        let r = kvmesh_gateway::start(cfg)
            .await
            .map_err(|e| e.to_string())?;
        eprintln!("router {i}: {}", r.base_url());
        routers.push(r);
    }
    let targets = if routers.is_empty() {
        Targets::RoundRobin(sims.iter().map(|s| s.base_url()).collect())
    } else {
        Targets::RoundRobin(routers.iter().map(|r| r.base_url()).collect())
    };
    let model = SimConfig::default().model;
    let wl = SharedPrefixWorkload {
        groups: a.groups.unwrap_or(w().groups),
        users: a.users.unwrap_or(w().users),
        turns: a.turns.unwrap_or(w().turns),
        ..w()
    };
    eprintln!(
        "demo: {} conversations × {} turns ({} requests), {} groups sharing system prompts, {} engines, {}",
        wl.groups * wl.users,
        wl.turns,
        wl.requests(),
        wl.groups,
        a.engines,
        if routers.is_empty() {
            "no router (clients round robin over the engines)".to_string()
        } else {
            format!(
                "{} router(s), policy {}",
                routers.len(),
                a.policy.unwrap_or_default().as_str()
            )
        }
    );
    let report = kvmesh_bench::run_shared_prefix(
        &wl,
        targets,
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
    for r in routers {
        r.shutdown().await;
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
