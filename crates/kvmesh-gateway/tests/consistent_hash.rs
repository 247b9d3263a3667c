//! Acceptance 4: `consistent_hash` keeps a key on one engine while its load is within the
//! bound (key from the `x-session-id` header, or else the OpenAI `user` field), spills a hot
//! key past the bound, and removing one of N engines (admin API) moves only that engine's
//! keys (≈ 1/N).

mod common;

use common::*;
use kvmesh_config::ServeConfig;
use kvmesh_policy::PolicyKind;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const TOKEN: &str = "test-admin-token";

fn hash_cfg(engines: &[String]) -> ServeConfig {
    let mut cfg = serve_cfg(engines);
    cfg.routing.policy.policy = PolicyKind::ConsistentHash;
    cfg.admin_token = TOKEN.into();
    // Latency noise must not move keys here: on a loaded test machine one slow answer makes
    // an engine look > 20% slower than the median, its weight drops and consistent hashing
    // thins its ring points (by design: see the policy README). Tested here: membership and
    // load bounds.
    cfg.routing.health.auto_weight.latency_tolerance = 100.0;
    cfg
}

/// Sends one keyed request (sequentially: no other load); returns the engine that served it.
async fn engine_for(
    c: &HttpClient,
    base: &str,
    header: Option<&str>,
    user: Option<&str>,
) -> String {
    let mut body = completion_body("test-model", "a short prompt", 8, false);
    if let Some(u) = user {
        body["user"] = Value::String(u.into());
    }
    let headers: Vec<(&str, &str)> = header.map(|h| ("x-session-id", h)).into_iter().collect();
    let r = send(
        c,
        "POST",
        &format!("{base}/v1/completions"),
        &headers,
        body.to_string(),
        Duration::from_secs(30),
    )
    .await;
    assert!(r.ok(), "{r:?}");
    r.engine.expect("x-kvmesh-engine")
}

/// Routing reasons and effective weights, for failure messages.
async fn routing_state(c: &HttpClient, base: &str) -> String {
    scrape(c, base)
        .await
        .lines()
        .filter(|l| {
            l.starts_with("kvmesh_routing_decisions_total{")
                || l.starts_with("kvmesh_engine_effective_weight{")
                || l.starts_with("kvmesh_engine_in_flight{")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

async fn homes(c: &HttpClient, base: &str, keys: &[String]) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for k in keys {
        m.insert(k.clone(), engine_for(c, base, Some(k), None).await);
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_same_engine_from_header_or_user_field() {
    // Requests last ~25 ms and each engine's /metrics is read every 0.5 s, so some reads
    // happen while one of our requests runs: the engine then reports a load the router must
    // not keep counting after the request ended (a sequential client never exceeds a bound).
    let sims = start_sims(4, |_| {
        let mut c = sim_cfg("test-model");
        c.time_scale = 0.5;
        c
    })
    .await;
    let engines = urls(&sims);
    let cfg = hash_cfg(&engines);
    let router = start_router_with(cfg, "test-model", 4).await;
    let base = router.base_url();
    let c = client();

    let keys: Vec<String> = (0..30).map(|i| format!("session-{i}")).collect();
    let mut by_header = BTreeMap::new();
    let mut by_user = BTreeMap::new();
    for round in 0..2 {
        for k in &keys {
            for (by, header, user) in [
                (&mut by_header, Some(k.as_str()), None),
                (&mut by_user, None, Some(k.as_str())),
            ] {
                let e = engine_for(&c, &base, header, user).await;
                let home = by.entry(k.clone()).or_insert_with(|| e.clone());
                if *home != e {
                    panic!(
                        "key {k} (header {header:?}, user {user:?}) moved in round {round}: {}",
                        routing_state(&c, &base).await
                    );
                }
            }
        }
    }
    // The header and the user field hash the same way; the keys spread over the fleet.
    assert_eq!(by_header, by_user);
    let used: BTreeSet<&String> = by_header.values().collect();

    assert!(used.len() >= 3, "30 keys on {} engines", used.len());
    // The header wins over the user field.
    let e = engine_for(&c, &base, Some("session-1"), Some("session-2")).await;
    assert_eq!(e, by_header["session-1"]);

    let page = scrape(&c, &base).await;
    let decisions = |reason: &str| {
        page.lines()
            .filter(|l| {
                l.starts_with("kvmesh_routing_decisions_total{")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, |a, b| a + b)
    };
    println!(
        "decisions: hash {}, hash_overflow {}",
        decisions("hash"),
        decisions("hash_overflow")
    );
    assert_eq!(decisions("hash"), 121.0);
    assert_eq!(decisions("hash_overflow"), 0.0);
    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_key_spills_past_its_load_bound() {
    // Real-time engines: eight concurrent 64-token answers overlap for ~0.4 s.
    let sims = start_sims(4, |_| {
        let mut c = sim_cfg("test-model");
        c.time_scale = 1.0;
        c
    })
    .await;
    let engines = urls(&sims);
    let router = start_router_with(hash_cfg(&engines), "test-model", 4).await;
    let base = router.base_url();
    let c = client();
    let home = engine_for(&c, &base, Some("hot"), None).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (c, url) = (c.clone(), format!("{base}/v1/completions"));
        tasks.push(tokio::spawn(async move {
            let body = completion_body("test-model", "a short prompt", 64, false);
            send(
                &c,
                "POST",
                &url,
                &[("x-session-id", "hot")],
                body.to_string(),
                Duration::from_secs(30),
            )
            .await
        }));
    }
    let mut served: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks {
        let r = t.await.expect("task");
        assert!(r.ok(), "{r:?}");
        *served.entry(r.engine.expect("engine")).or_default() += 1;
    }
    println!("8 concurrent requests of one key: {served:?} (home {home})");
    // With 8 in flight over 4 engines of equal weight, the bound is ceil(1.25 × 8 / 4) = 3.
    assert!(served.len() >= 2, "{served:?}");
    assert!(served.values().all(|&n| n <= 5), "{served:?}");
    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_one_of_four_engines_moves_only_its_keys() {
    let sims = start_sims(4, |_| instant_sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let router = start_router_with(hash_cfg(&engines), "test-model", 4).await;
    let base = router.base_url();
    let c = client();

    let keys: Vec<String> = (0..200).map(|i| format!("user-{i}")).collect();
    let before = homes(&c, &base, &keys).await;
    let removed = engines[2].clone();
    let r = send(
        &c,
        "DELETE",
        &format!("{base}/admin/engines"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
        json!({"url": removed}).to_string(),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let after = homes(&c, &base, &keys).await;

    let of_removed: BTreeSet<&String> = before
        .iter()
        .filter(|(_, e)| **e == removed)
        .map(|(k, _)| k)
        .collect();
    let moved: BTreeSet<&String> = keys.iter().filter(|k| before[*k] != after[*k]).collect();
    let others_moved: Vec<&&String> = moved.difference(&of_removed).collect();
    println!(
        "removed 1 of 4 engines: {} of 200 keys moved, {} of them were its keys, {} others",
        moved.len(),
        of_removed.len(),
        others_moved.len()
    );
    assert!(after.values().all(|e| *e != removed));
    assert!(of_removed.is_subset(&moved));
    assert!(
        others_moved.is_empty(),
        "keys of other engines moved: {others_moved:?}"
    );
    // ≈ 1/N of the keys: 128 virtual nodes per engine give each engine 25% ± a few points.
    assert!(
        (20..=80).contains(&moved.len()),
        "{} of 200 keys moved",
        moved.len()
    );
    router.shutdown().await;
    stop_sims(sims).await;
}
