//! The mesh across real processes: three `kvmesh serve` routers (certificates from
//! `kvmesh cert`) and simulated engines on loopback. A conversation's first turn through
//! router A; its follow-up through B goes to the same engine with a predicted cached prefix;
//! an engine added through A's admin API joins C's routing set (slow start ramping it in).
//! Bounded waits throughout.

mod common;

use common::*;
use std::time::{Duration, Instant};

fn members(base: &str) -> usize {
    http(
        "GET",
        &format!("{base}/admin/cluster"),
        &[],
        "",
        Duration::from_secs(5),
    )
    .and_then(|r| serde_json::from_str::<serde_json::Value>(&r.body).ok())
    .and_then(|v| v["members"].as_array().map(Vec::len))
    .unwrap_or(0)
}

fn wait(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn three_serve_processes_share_prefixes_and_engines() {
    let dir = certs_abc("mesh-proc");
    let sims: Vec<Proc> = (0..4)
        .map(|i| {
            Proc::start(&[
                "--model",
                "m",
                "--time-scale",
                "0.02",
                "--seed",
                &(i + 1).to_string(),
            ])
        })
        .collect();
    let engine_args: Vec<String> = sims[..3]
        .iter()
        .flat_map(|s| ["--engine".to_string(), s.base()])
        .collect();
    let mut args: Vec<&str> = engine_args.iter().map(String::as_str).collect();
    args.extend(["--policy", "cache_aware", "--admin-token", "t"]);
    let routers = meshed_abc(&dir, "proc-test", &args);
    let (a, b, c) = (routers[0].base(), routers[1].base(), routers[2].base());
    for r in [&a, &b, &c] {
        wait("the mesh forms", Duration::from_secs(30), || {
            members(r) == 2
        });
    }

    let system = "You answer questions about one shared operations handbook. ".repeat(60);
    for i in 0..3 {
        let body = serde_json::json!({
            "model": "m",
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": format!("question {i}")}],
            "max_tokens": 2,
        })
        .to_string();
        let t = Duration::from_secs(30);
        let first = http("POST", &format!("{a}/v1/chat/completions"), &[], &body, t).expect("a");
        assert_eq!(first.status, 200, "{}", first.body);
        std::thread::sleep(Duration::from_millis(200));
        let again = http("POST", &format!("{b}/v1/chat/completions"), &[], &body, t).expect("b");
        assert_eq!(again.status, 200, "{}", again.body);
        assert_eq!(
            again.header("x-kvmesh-engine"),
            first.header("x-kvmesh-engine")
        );
        let predicted: u64 = again
            .header("x-kvmesh-predicted-cached-tokens")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(predicted > 0, "B predicted A's prefix on that engine");
    }

    // An engine added through A's admin API: C routes to it.
    let fourth = sims[3].base();
    let added = http(
        "POST",
        &format!("{a}/admin/engines"),
        &[("authorization", "Bearer t")],
        &serde_json::json!({ "url": fourth }).to_string(),
        Duration::from_secs(10),
    )
    .expect("admin");
    assert_eq!(added.status, 201, "{}", added.body);
    let t0 = Instant::now();
    wait("C knows the new engine", Duration::from_secs(5), || {
        http(
            "GET",
            &format!("{c}/admin/engines"),
            &[("authorization", "Bearer t")],
            "",
            Duration::from_secs(5),
        )
        .is_some_and(|r| r.body.contains(&fourth))
    });
    println!("C learnt A's engine in {:?}", t0.elapsed());
    // It is in C's routing set (slow start ramps a new engine in, on every router alike).
    let metrics = http(
        "GET",
        &format!("{c}/metrics"),
        &[],
        "",
        Duration::from_secs(5),
    )
    .expect("metrics");
    let weight = metrics
        .body
        .lines()
        .find(|l| l.starts_with("kvmesh_engine_effective_weight{") && l.contains(&fourth))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(weight > 0.0, "C routes to the new engine (weight {weight})");

    // B's own address taken as an engine through A (B refuses it: requests would loop; A and
    // C route to it): removed from every router through B as well.
    let admin = |base: &str, method: &str, body: String| {
        http(
            method,
            &format!("{base}/admin/engines"),
            &[("authorization", "Bearer t")],
            &body,
            Duration::from_secs(10),
        )
        .expect("admin")
    };
    let b_as_engine = serde_json::json!({ "url": b }).to_string();
    let quoted = format!("\"{b}\"");
    let added = admin(&a, "POST", b_as_engine.clone());
    assert_eq!(added.status, 201, "{}", added.body);
    wait("C knows B as an engine", Duration::from_secs(5), || {
        admin(&c, "GET", String::new()).body.contains(&quoted)
    });
    let removed = admin(&b, "DELETE", b_as_engine);
    assert_eq!(removed.status, 200, "{}", removed.body);
    wait(
        "A and C forget B as an engine",
        Duration::from_secs(5),
        || {
            !admin(&a, "GET", String::new()).body.contains(&quoted)
                && !admin(&c, "GET", String::new()).body.contains(&quoted)
        },
    );
    drop(routers);
    drop(sims);
    let _ = std::fs::remove_dir_all(&dir);
}
