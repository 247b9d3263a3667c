//! Acceptance 3: how much traffic a bad engine still gets, per policy.
//!
//! * One engine of four slowed ×5 (fault injection): under `peak_ewma` it receives ≤ 10% of
//!   the attempts.
//! * One engine of four failing every request instantly with 500: it receives ≤ 5% of the
//!   attempts under every policy with breakers on, and under the load-aware policies with
//!   breakers off (the automatic weight drives it down); `round_robin` and `random` with
//!   breakers off keep sending it its fair share (they ignore weights on purpose) and the
//!   retries hide it from clients as far as the retry budget allows.
//!
//! "Receives" = attempts the router sent to it (`kvmesh_engine_requests_total`) over all
//! attempts. Shares are printed (`cargo test -- --nocapture`) for the report.

mod common;

use common::*;
use kvmesh_config::ServeConfig;
use kvmesh_policy::PolicyKind;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// What one run measured.
struct Run {
    /// Attempts per engine.
    attempts: Vec<f64>,
    /// Client-visible failures.
    failures: Vec<String>,
    /// Requests sent.
    requests: usize,
    retries: f64,
    budget_exhausted: f64,
}

impl Run {
    fn share(&self, i: usize) -> f64 {
        let total: f64 = self.attempts.iter().sum();
        self.attempts[i] / total.max(1.0)
    }
}

async fn run(cfg: ServeConfig, load: &Load, max_tokens: u32) -> Run {
    let engines: Vec<String> = cfg.engines.iter().map(|e| e.url.clone()).collect();
    let router = start_router_with(cfg, "test-model", 4).await;
    let base = router.base_url();
    let c = client();
    let make: MakeRequest = Arc::new(move |i| {
        (
            vec![("x-session-id".to_string(), format!("session-{i}"))],
            completion_body(
                "test-model",
                &format!("request number {i}"),
                max_tokens,
                false,
            ),
        )
    });
    let replies = run_load(
        &c,
        &format!("{base}/v1/completions"),
        load,
        Arc::new(AtomicBool::new(false)),
        make,
    )
    .await;
    let page = scrape(&c, &base).await;
    router.shutdown().await;
    Run {
        attempts: attempts(&page, &engines),
        failures: failures(&replies),
        requests: replies.len(),
        retries: metric(&page, "kvmesh_retries_total"),
        budget_exhausted: metric(&page, "kvmesh_retry_budget_exhausted_total"),
    }
}

fn policy_cfg(engines: &[String], policy: PolicyKind, breakers: bool) -> ServeConfig {
    let mut cfg = serve_cfg(engines);
    cfg.routing.policy.policy = policy;
    cfg.routing.health.breaker.enabled = breakers;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowed_engine_gets_little_traffic_under_peak_ewma() {
    // Real step times scaled by 0.1: a 24-token answer takes ~15 ms, ~75 ms on the slowed
    // engine.
    const TIME_SCALE: f64 = 0.1;
    let sims = start_sims(4, |_| {
        let mut c = sim_cfg("test-model");
        c.time_scale = TIME_SCALE;
        c
    })
    .await;
    let engines = urls(&sims);
    let c = client();
    set_faults(&c, &engines[0], json!({"slowdown": 5.0})).await;

    let mut cfg = policy_cfg(&engines, PolicyKind::PeakEwma, true);
    // The engines run TIME_SCALE times real time: the router's latency priors and decay are
    // scaled alike.
    scale_latency(&mut cfg, TIME_SCALE);
    let load = Load {
        concurrency: 8,
        max_requests: 400,
        max_time: Duration::from_secs(20),
        ..Load::default()
    };
    let r = run(cfg, &load, 24).await;
    let share = r.share(0);
    println!(
        "peak_ewma, engine slowed x5: {:.1}% of {} attempts (per engine {:?}), {} requests",
        share * 100.0,
        r.attempts.iter().sum::<f64>(),
        r.attempts,
        r.requests
    );
    assert!(r.requests >= 100, "too few requests: {}", r.requests);
    assert!(r.failures.is_empty(), "{:?}", r.failures);
    assert!(
        share <= 0.10,
        "slowed engine got {:.1}% under peak_ewma",
        share * 100.0
    );
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_engine_is_avoided_by_every_policy() {
    let sims = start_sims(4, |_| instant_sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let c = client();
    set_faults(
        &c,
        &engines[0],
        json!({"error_rate": 1.0, "error_status": 500}),
    )
    .await;

    let load_aware = [
        PolicyKind::WeightedRoundRobin,
        PolicyKind::LeastRequest,
        PolicyKind::PowerOfTwo,
        PolicyKind::PeakEwma,
        PolicyKind::ConsistentHash,
    ];
    let mut runs: Vec<(PolicyKind, bool)> = PolicyKind::ALL.iter().map(|&p| (p, true)).collect();
    runs.extend(load_aware.iter().map(|&p| (p, false)));
    runs.push((PolicyKind::RoundRobin, false));
    runs.push((PolicyKind::Random, false));

    let load = Load {
        concurrency: 8,
        max_requests: 400,
        max_time: Duration::from_secs(10),
        ..Load::default()
    };
    let mut problems = Vec::new();
    for (policy, breakers) in runs {
        let r = run(policy_cfg(&engines, policy, breakers), &load, 4).await;
        let share = r.share(0);
        println!(
            "{:<22} breakers {:<5}: failing engine {:>5.1}% of {} attempts; {} requests, {} retries, {} refused by the budget, {} client errors",
            policy.as_str(),
            if breakers { "on" } else { "off" },
            share * 100.0,
            r.attempts.iter().sum::<f64>(),
            r.requests,
            r.retries,
            r.budget_exhausted,
            r.failures.len()
        );
        if r.requests < 100 {
            problems.push(format!(
                "{policy:?}/{breakers}: only {} requests",
                r.requests
            ));
        }
        let exempt = !breakers && matches!(policy, PolicyKind::RoundRobin | PolicyKind::Random);
        if !exempt && share > 0.05 {
            problems.push(format!(
                "{policy:?} breakers {breakers}: failing engine got {:.1}%",
                share * 100.0
            ));
        }
        if exempt {
            // Ignoring weights, they keep sending it about its fair share.
            if share < 0.15 {
                problems.push(format!("{policy:?}: unexpected share {share}"));
            }
            // Only one engine fails and retries go to another one, so a client sees an error
            // exactly when the retry budget refused the retry.
            if r.failures.len() as f64 != r.budget_exhausted {
                problems.push(format!(
                    "{policy:?}: {} client errors but {} budget refusals: {:?}",
                    r.failures.len(),
                    r.budget_exhausted,
                    r.failures.iter().take(3).collect::<Vec<_>>()
                ));
            }
        } else if !r.failures.is_empty() {
            problems.push(format!(
                "{policy:?} breakers {breakers}: {} client errors: {:?}",
                r.failures.len(),
                r.failures.iter().take(3).collect::<Vec<_>>()
            ));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    stop_sims(sims).await;
}
