//! `kvmesh up`'s demonstration: the same shared-prefix chat workload twice on the same
//! engines — first as a plain round-robin load balancer would send it (straight to the
//! engines, in turn), then through kvmesh's routers — with the engines' caches reset in
//! between, and the difference: the engines' own prefix-cache hit rate, TTFT p50/p99 and
//! throughput, then per router what it served and per engine its requests. The load client,
//! engine counters and cache reset are the benchmark harness's (`kvmesh_bench`,
//! [`crate::bench_cmd::reset_caches`]).

use crate::up_cmd::{Cluster, UpArgs};
use indicatif::{ProgressBar, ProgressStyle};
use kvmesh_bench::{EngineCounters, LoadOptions, LoadReport, SharedPrefixWorkload, Targets};
use kvmesh_config::SimConfig;
use std::sync::Arc;
use std::time::Duration;

/// Engines' time scale in the demo (real time).
pub const TIME_SCALE: f64 = 1.0;
/// KV blocks per engine: ≈ 4 groups' system prompts, so that where a conversation lands
/// matters (round robin spreads every group over every engine and evicts).
pub const KV_BLOCKS: u32 = 600;
/// Conversations in flight.
pub const CONCURRENCY: usize = 32;

/// The demo workload: 16 groups × 3 users × 3 turns = 144 chat requests, ≈ 2,600-token system
/// prompts per group.
pub fn workload() -> SharedPrefixWorkload {
    SharedPrefixWorkload {
        groups: 16,
        users: 3,
        turns: 3,
        system_words: 2_000,
        question_words: 60,
        max_tokens: 24,
        seed: 1,
    }
}

/// One leg's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct Leg {
    /// How it was routed.
    pub name: String,
    /// Engine-reported hit rate (Δhits / Δqueries over every engine).
    pub hit_rate: f64,
    /// TTFT percentiles, wall ms.
    pub ttft_p50_ms: f64,
    /// See `ttft_p50_ms`.
    pub ttft_p99_ms: f64,
    /// Output tokens per wall second.
    pub tokens_per_s: f64,
    /// Requests answered, failed.
    pub ok: usize,
    /// See `ok`.
    pub errors: usize,
    /// Wall seconds.
    pub seconds: f64,
}

impl Leg {
    fn of(name: String, r: &LoadReport, engines: &EngineCounters) -> Leg {
        Leg {
            name,
            hit_rate: engines.hit_rate(),
            ttft_p50_ms: r.ttft_percentile(50.0).as_secs_f64() * 1e3,
            ttft_p99_ms: r.ttft_percentile(99.0).as_secs_f64() * 1e3,
            tokens_per_s: r.output_tokens_per_sec(),
            ok: r.samples.len(),
            errors: r.errors.len(),
            seconds: r.elapsed.as_secs_f64(),
        }
    }
}

/// The two legs side by side, and the difference in one line.
pub fn format_legs(rr: &Leg, km: &Leg) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "  {:<34} {:>9} {:>11} {:>11} {:>13} {:>10}",
        "", "hit rate", "TTFT p50", "TTFT p99", "output tok/s", "ok/errors"
    );
    for l in [rr, km] {
        let _ = writeln!(
            s,
            "  {:<34} {:>8.1}% {:>8.0} ms {:>8.0} ms {:>13.0} {:>10}",
            l.name,
            l.hit_rate * 100.0,
            l.ttft_p50_ms,
            l.ttft_p99_ms,
            l.tokens_per_s,
            format!("{}/{}", l.ok, l.errors)
        );
    }
    let times = |a: f64, b: f64| {
        if b > 0.0 {
            format!("{:.1}×", a / b)
        } else {
            "n/a".into()
        }
    };
    // Round robin's time over kvmesh's: "N× lower" when kvmesh is faster, else "N× higher";
    // within 5% "about the same" (QA35: "1.0× lower, 1.0× higher").
    let lower = |rr_ms: f64, km_ms: f64| {
        let (lo, hi) = (rr_ms.min(km_ms), rr_ms.max(km_ms));
        if lo > 0.0 && hi < lo * 1.05 {
            "about the same".into()
        } else if rr_ms >= km_ms || rr_ms.is_nan() || rr_ms <= 0.0 {
            format!("{} lower", times(rr_ms, km_ms))
        } else {
            format!("{} higher", times(km_ms, rr_ms))
        }
    };
    let _ = writeln!(
        s,
        "  kvmesh against round robin: hit rate {:+.1} points, TTFT p50 {}, p99 {}, \
         throughput {}",
        (km.hit_rate - rr.hit_rate) * 100.0,
        lower(rr.ttft_p50_ms, km.ttft_p50_ms),
        lower(rr.ttft_p99_ms, km.ttft_p99_ms),
        times(km.tokens_per_s, rr.tokens_per_s),
    );
    s
}

fn bar(len: u64, name: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("  {msg:<34} [{bar:32}] {pos}/{len} requests {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b.set_message(name.to_string());
    b
}

/// Runs the workload against `targets` with a progress bar; the report and the engines'
/// counters over the run.
async fn leg(
    a: &UpArgs,
    wl: &SharedPrefixWorkload,
    name: &str,
    targets: Targets,
    engine_urls: &[String],
) -> Result<(LoadReport, EngineCounters), String> {
    let before = kvmesh_bench::engine_counters(engine_urls, Duration::from_secs(10)).await?;
    let b = bar(wl.requests(), name);
    let p = b.clone();
    let report = kvmesh_bench::run_shared_prefix_with_progress(
        wl,
        targets,
        LoadOptions {
            model: SimConfig::default().model,
            concurrency: a.concurrency,
            request_timeout: Duration::from_secs(120),
            deadline: Duration::from_secs(300),
        },
        Arc::new(move || p.inc(1)),
    )
    .await;
    b.finish_and_clear();
    let after = kvmesh_bench::engine_counters(engine_urls, Duration::from_secs(10)).await?;
    println!(
        "  {name:<34} done: {} requests in {:.1} s",
        report.samples.len() + report.errors.len(),
        report.elapsed.as_secs_f64()
    );
    for e in report.errors.iter().take(3) {
        println!("    error: {e}");
    }
    Ok((report, after.since(&before)))
}

/// Waits until no router's prefix index holds anything of the first leg. The routers read
/// the engines' KV events, and a reset reaches their indexes after it returns, through each
/// engine's owners and the mesh (1,800–3,000 entries gone 3–7 ms later in 6 runs); a
/// conversation placed meanwhile would go by blocks its engine no longer holds. Bounded:
/// after 10 s the leg starts anyway, said so.
async fn forget_first_leg(c: &Cluster) {
    let held = || -> usize {
        c.routers
            .iter()
            .map(|r| r.gateway.registry.prefix.index().len())
            .sum()
    };
    let t0 = std::time::Instant::now();
    while held() > 0 {
        if t0.elapsed() > Duration::from_secs(10) {
            println!(
                "  (the routers' indexes still hold {} entries of the first leg after 10 s)",
                held()
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The demonstration.
pub async fn run(a: &UpArgs, c: &Cluster, wl: &SharedPrefixWorkload) -> Result<(), String> {
    let urls = c.engine_urls();
    if c.routers.is_empty() {
        println!("\ndemo: none: no router (--routers 0), nothing to compare round robin with");
        return Ok(());
    }
    println!(
        "\ndemo: {} chat requests ({} groups × {} users × {} turns; each group shares a \
         {}-word system prompt, every turn resends the conversation), {} conversations at \
         once, run twice on the same engines, their caches reset in between:",
        wl.requests(),
        wl.groups,
        wl.users,
        wl.turns,
        wl.system_words,
        a.concurrency.min((wl.groups * wl.users) as usize)
    );
    let rr_name = "round robin (straight to engines)";
    let (rr_report, rr_engines) =
        leg(a, wl, rr_name, Targets::RoundRobin(urls.clone()), &urls).await?;
    crate::bench_cmd::reset_caches(&urls).await?;
    forget_first_leg(c).await;
    let served_before: Vec<u64> = c
        .routers
        .iter()
        .map(|r| r.gateway.metrics.requests.get())
        .collect();
    let km_name = format!(
        "kvmesh ({}, {} router{})",
        c.policy.as_str(),
        c.routers.len(),
        if c.routers.len() == 1 { "" } else { "s" }
    );
    let targets = Targets::RoundRobin(c.routers.iter().map(|r| r.base_url()).collect());
    let (km_report, km_engines) = leg(a, wl, &km_name, targets, &urls).await?;
    let rr = Leg::of(rr_name.to_string(), &rr_report, &rr_engines);
    let km = Leg::of(km_name, &km_report, &km_engines);
    println!(
        "\nresult (hit rate: the engines' own vllm:prefix_cache_hits / queries; TTFT: wall \
         time on this machine, engines at time scale {}):",
        a.time_scale
    );
    print!("{}", format_legs(&rr, &km));
    println!("  per router (clients spread over the routers as DNS would):");
    for (r, before) in c.routers.iter().zip(&served_before) {
        let mesh = r
            .gateway
            .mesh
            .get()
            .map(|m| {
                let s = m.status(r.gateway.registry.router_slot(), &|_| None);
                let peers = s["members"].as_array().map_or(0, Vec::len);
                let owned = s["ingest"]["owned"].as_u64().unwrap_or(0);
                format!(
                    "; meshed with {peers} peer{}, reads the KV events of {owned} engine{}",
                    if peers == 1 { "" } else { "s" },
                    if owned == 1 { "" } else { "s" },
                )
            })
            .unwrap_or_default();
        let name = r
            .cluster
            .as_ref()
            .map(|_| r.gateway.cfg.mesh.node_id.clone())
            .unwrap_or_else(|| "router".into());
        println!(
            "    {name} {}: served {} requests{mesh}",
            r.base_url(),
            r.gateway.metrics.requests.get().saturating_sub(*before)
        );
    }
    println!("  per engine (kvmesh leg: requests, hit rate of their prompt tokens):");
    let per = km_report.per_endpoint();
    for u in &urls {
        match per.iter().find(|(e, _, _)| e == u) {
            Some((_, n, hit)) => println!("    {u}: {n} requests, {:.1}% cached", hit * 100.0),
            // The explanation holds only when the leg served its requests elsewhere.
            None if km.ok > 0 && km.errors == 0 => println!(
                "    {u}: none — every group's conversations went where its system prompt was \
                 cached, and no engine was overloaded enough for the load guard to send work here"
            ),
            None => println!("    {u}: none"),
        }
    }
    if rr.errors + km.errors > 0 {
        return Err(format!("{} requests failed", rr.errors + km.errors));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_difference_line_reads_the_two_legs() {
        let rr = Leg {
            name: "round robin".into(),
            hit_rate: 0.2,
            ttft_p50_ms: 700.0,
            ttft_p99_ms: 1200.0,
            tokens_per_s: 800.0,
            ok: 144,
            errors: 0,
            seconds: 5.0,
        };
        let km = Leg {
            name: "kvmesh".into(),
            hit_rate: 0.85,
            ttft_p50_ms: 50.0,
            ttft_p99_ms: 400.0,
            tokens_per_s: 2400.0,
            ..rr.clone()
        };
        let s = format_legs(&rr, &km);
        assert!(s.contains("hit rate +65.0 points"), "{s}");
        assert!(s.contains("TTFT p50 14.0× lower, p99 3.0× lower"), "{s}");
        assert!(s.contains("throughput 3.0×"), "{s}");
        assert!(s.contains("20.0%") && s.contains("85.0%"), "{s}");
        // Slower is said so (found by QA: "0.9× lower").
        let slow = Leg {
            ttft_p50_ms: 770.0,
            ..km.clone()
        };
        let s = format_legs(&rr, &slow);
        assert!(s.contains("TTFT p50 1.1× higher, p99 3.0× lower"), "{s}");
        // Level is said so (QA35: "1.0× lower, p99 1.0× higher").
        let level = Leg {
            ttft_p50_ms: 720.0,
            ttft_p99_ms: 1_230.0,
            ..km.clone()
        };
        let s = format_legs(&rr, &level);
        assert!(
            s.contains("TTFT p50 about the same, p99 about the same"),
            "{s}"
        );
    }
}
