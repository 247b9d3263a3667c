//! Two and three routers meshed in process on loopback (mutual TLS, certificates generated
//! here) in front of simulated engines: router A's decisions reach B's index, so the next
//! request of the conversation sent to B goes to the same engine; A's in-flight load shows on
//! B's engines; an engine added through A's admin API is routed to by C, a weight set
//! through B and a removal through A (of an engine of every router's config) reach every
//! router; `/admin/cluster` lists the members and the digests agree.

mod common;

use common::mesh::*;
use common::*;
use kvmesh_config::MeshConfig;
use kvmesh_gateway::GatewayServer;
use kvmesh_policy::PolicyKind;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meshed_routers_share_marks_load_and_engines() {
    let sims = start_sims(5, |_| sim_cfg("m")).await;
    let engines = urls(&sims);
    let router_cfg = |_: &str| {
        let mut cfg = serve_cfg(&engines[..4]);
        cfg.routing.policy.policy = PolicyKind::CacheAware;
        cfg.admin_token = "t".into();
        cfg
    };
    let (dir, [a, b, c_router]) = mesh_of_three("mesh-test", 4, router_cfg).await;
    let c = client();

    // A conversation's first turn through A; its follow-up through B lands on the same engine.
    let system = "You are a meticulous assistant for a shared product manual. ".repeat(60);
    let body = |q: &str| {
        serde_json::json!({
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "max_tokens": 2,
        })
    };
    let mut same = 0;
    for i in 0..5 {
        let q = format!("question {i} about chapter {i}");
        let first = post_json(
            &c,
            &format!("{}/v1/chat/completions", a.base_url()),
            &body(&q),
        )
        .await;
        assert_eq!(first.status, 200, "{}", first.body);
        // Within the flush interval (20 ms) and a margin, B's index holds A's marks.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let again = post_json(
            &c,
            &format!("{}/v1/chat/completions", b.base_url()),
            &body(&q),
        )
        .await;
        assert_eq!(again.status, 200);
        // A's mark travelled naming only the top key of each anchor window; B's index lets
        // them vouch for their windows, so B predicts the whole prompt, as A itself does.
        let third = post_json(
            &c,
            &format!("{}/v1/chat/completions", a.base_url()),
            &body(&q),
        )
        .await;
        assert_eq!(third.engine, first.engine);
        assert!(
            predicted_tokens(&third) > 16 * 8,
            "{}",
            predicted_tokens(&third)
        );
        assert_eq!(
            predicted_tokens(&again),
            predicted_tokens(&third),
            "B predicts the whole prompt from A's covering mark"
        );
        if again.engine == first.engine {
            same += 1;
        }
    }
    assert_eq!(
        same, 5,
        "every follow-up through B went where A sent the first turn"
    );

    // A's in-flight load shows on B: hold a long stream through A.
    let held = hold_stream(&c, &a, 400);
    assert!(
        until(Duration::from_secs(2), || peer_load(&b) >= 1).await,
        "B sees A's request in flight"
    );
    assert_eq!(held.await.expect("task").status, 200);
    assert!(
        until(Duration::from_secs(2), || peer_load(&b) == 0).await,
        "and the count returns to zero"
    );

    // An engine added through A's admin API is routed to by C within a second or so.
    let fifth = engines[4].clone();
    let add = admin(&c, &a, "POST", serde_json::json!({ "url": fifth })).await;
    assert_eq!(add.status, 201, "{}", add.body);
    let known = until(Duration::from_secs(2), || {
        c_router
            .gateway
            .registry
            .members()
            .iter()
            .any(|e| e.url == fifth && !e.models().is_empty())
    })
    .await;
    assert!(known, "C knows the engine A added");

    // A weight set through B's admin API reaches every router.
    let routers = [&a, &b, &c_router];
    let id1 = kvmesh_prefix::EngineId::from_url(&engines[1]);
    assert!(
        reweigh_everywhere(&c, &b, &engines[1], 2.5, &routers, Duration::from_secs(2)).await,
        "every router has the weight B was given"
    );

    // An engine of every router's config that the routers hold counts of (the requests
    // above), removed through A's admin API alone: it goes from every router, and its
    // counts from every router's mesh state (an engine without KV events used to keep them
    // until their writer left).
    let holds = |r: &GatewayServer, id: u64| {
        r.cluster
            .as_ref()
            .expect("meshed")
            .held_engines()
            .contains(&id)
    };
    let victim = engines[..4]
        .iter()
        .find(|u| {
            let id = kvmesh_prefix::EngineId::from_url(u).0;
            [&a, &b, &c_router].into_iter().all(|r| holds(r, id))
        })
        .expect("an engine every router holds counts of")
        .clone();
    let victim_id = kvmesh_prefix::EngineId::from_url(&victim).0;
    let del = admin(&c, &a, "DELETE", serde_json::json!({ "url": victim })).await;
    assert_eq!(del.status, 200, "{}", del.body);
    assert!(
        until(Duration::from_secs(2), || [&a, &b, &c_router]
            .into_iter()
            .all(|r| !holds(r, victim_id)
                && r.gateway
                    .registry
                    .get(kvmesh_prefix::EngineId(victim_id))
                    .is_none()))
        .await,
        "the removed engine and its counts are gone from every router"
    );

    // The replicated state converges: equal digests on all three (load and registry).
    assert!(
        digests_agree(&c, [&a, &b, &c_router]).await,
        "digests agree"
    );

    // C restarts with the config it had, which lists the removed engine: the run-time
    // changes hold on every router (the engine stays removed, B's weight stays).
    let seed = a.cluster.as_ref().and_then(|x| x.addr()).expect("a's mesh");
    c_router.shutdown().await;
    let mut cfg = router_cfg("c");
    cfg.mesh = mesh_cfg(&dir, "c", vec![seed.to_string()]);
    let c_router = start_router(cfg).await;
    let settled = |r: &GatewayServer| {
        let reg = &r.gateway.registry;
        reg.get(kvmesh_prefix::EngineId(victim_id)).is_none()
            && reg.members().len() == 4
            && (victim == engines[1] || reg.get(id1).is_some_and(|e| e.base_weight() == 2.5))
    };
    assert!(
        until(Duration::from_secs(5), || cluster_warm(&c_router)
            && [&a, &b, &c_router].into_iter().all(settled))
        .await,
        "after C's restart: {:?}",
        c_router
            .gateway
            .registry
            .members()
            .iter()
            .map(|e| (e.url.clone(), e.base_weight()))
            .collect::<Vec<_>>()
    );
    // Every router sees the two others again (C's new run included) before their digests
    // and ranks are compared.
    for r in [&a, &b, &c_router] {
        wait_members(&c, r, 2).await;
    }
    assert!(
        digests_agree(&c, [&a, &b, &c_router]).await,
        "digests agree after C's restart"
    );
    for (rank, r) in [&a, &b, &c_router].into_iter().enumerate() {
        // (A membership change reaches the rank a moment after the members.)
        let want = kvmesh_policy::RouterSlot {
            rank: rank as u32,
            routers: 3,
        };
        until(Duration::from_secs(5), || {
            r.gateway.registry.router_slot() == want
        })
        .await;
        let status = cluster_json(&c, r).await;
        assert_eq!(status["warm"], true, "every router is warm");
        // Each knows its own place among the three (by name), and its policies split ties
        // by it.
        assert_eq!(
            status["rank"],
            serde_json::json!({ "rank": rank, "routers": 3 }),
            "{status}"
        );
        assert_eq!(
            r.gateway.registry.router_slot(),
            kvmesh_policy::RouterSlot {
                rank: rank as u32,
                routers: 3
            }
        );
    }
    // The mesh's families on /metrics.
    let (_, page) = get(&c, &format!("{}/metrics", b.base_url())).await;
    let value = |prefix: &str| {
        page.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in /metrics"))
    };
    assert_eq!(value("kvmesh_mesh_members{state=\"alive\"} "), 2.0);
    assert!(value("kvmesh_mesh_envelopes_total{direction=\"received\"}") > 0.0);
    assert!(value("kvmesh_mesh_envelope_age_seconds_count") > 0.0);
    assert!(value("kvmesh_mesh_bytes_total{class=\"state\",direction=\"received\"}") > 0.0);
    assert!(value("kvmesh_mesh_bytes_total{class=\"swim\",direction=\"sent\"}") > 0.0);
    assert_eq!(
        value("kvmesh_mesh_envelopes_total{direction=\"dropped\"}"),
        0.0
    );
    assert_eq!(value("kvmesh_mesh_dropped_streams_total "), 0.0);
    assert_eq!(cluster_json(&c, &a).await["dropped_streams"], 0);
    assert!(value("kvmesh_mesh_udp_datagrams_received_total ") > 0.0);

    for r in [a, b, c_router] {
        r.shutdown().await;
    }
    stop_sims(sims).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_burst_spread_over_three_routers_lands_on_one_engine() {
    let sims = start_sims(8, |_| instant_sim_cfg("m")).await;
    let engines = urls(&sims);
    let (dir, [a, b, c3]) = mesh_of_three("mesh-burst", 8, |_| {
        let mut cfg = serve_cfg(&engines);
        cfg.routing.policy.policy = PolicyKind::CacheAware;
        cfg
    })
    .await;
    let c = client();
    let routers = [a.base_url(), b.base_url(), c3.base_url()];
    let mut together = 0;
    const BURSTS: usize = 20;
    for burst in 0..BURSTS {
        // A new ~4,000-token prefix per burst; 16 siblings differ only in their last words.
        let prefix = format!("burst {burst}: ") + &"a long shared document line. ".repeat(520);
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let (c, url) = (c.clone(), routers[i % 3].clone());
                let body = serde_json::json!({
                    "model": "m",
                    "messages": [{"role": "user", "content": format!("{prefix} sibling {i}")}],
                    "max_tokens": 1,
                });
                tokio::spawn(async move {
                    post_json(&c, &format!("{url}/v1/chat/completions"), &body).await
                })
            })
            .collect();
        let mut where_: std::collections::BTreeMap<String, usize> = Default::default();
        for t in tasks {
            let r = t.await.expect("task");
            assert_eq!(r.status, 200, "{}", r.body);
            *where_.entry(r.engine.unwrap_or_default()).or_default() += 1;
        }
        if where_.len() == 1 {
            together += 1;
        }
        println!("burst {burst}: {:?}", where_.values().collect::<Vec<_>>());
    }
    println!("{together} of {BURSTS} bursts on one engine");
    assert!(
        together * 10 >= BURSTS * 9,
        "{together} of {BURSTS} bursts on one engine"
    );
    for r in [a, b, c3] {
        r.shutdown().await;
    }
    stop_sims(sims).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Replicas named at start (a Kubernetes Deployment: node_id = the pod name) share one
/// certificate pair through `cert_name`, and still appear under their own names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_certificate_pair_through_cert_name() {
    let sims = start_sims(1, |_| sim_cfg("m")).await;
    let engines = urls(&sims);
    let dir = std::env::temp_dir().join(format!("kvmesh-cert-name-{}", std::process::id()));
    let certs = kvmesh_mesh::certs::generate(&["router".into()]).expect("certs");
    kvmesh_mesh::certs::write_dir(&dir, &certs).expect("write");
    let cfg = |name: &str, seeds: Vec<String>| {
        let mut c = serve_cfg(&engines);
        c.mesh = MeshConfig {
            cert_name: "router".into(),
            ..mesh_cfg(&dir, name, seeds)
        };
        c
    };
    let a = start_router_with(cfg("kvmesh-7d9f-x1", vec![]), "m", 1).await;
    let seed = mesh_addr(&a);
    let b = start_router_with(cfg("kvmesh-7d9f-y2", vec![seed]), "m", 1).await;
    let http = client();
    wait_members(&http, &a, 1).await;
    wait_members(&http, &b, 1).await;
    let seen = cluster_json(&http, &a).await;
    assert_eq!(seen["members"][0]["name"], "kvmesh-7d9f-y2", "{seen}");
    assert_eq!(cluster_json(&http, &b).await["node"], "kvmesh-7d9f-y2");
    assert_eq!(
        seen["wire_version"], 2,
        "the default envelope version: {seen}"
    );
    a.shutdown().await;
    b.shutdown().await;
    stop_sims(sims).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Publishes a router's certificate files as Kubernetes updates a Secret's volume: a new
/// directory of all three files, then the directory link swapped to it by a rename, so the
/// router never sees half of a change.
fn publish(base: &std::path::Path, node: &str, version: u32, ca: &str, cert: &str, key: &str) {
    let real = base.join(format!("{node}-v{version}"));
    std::fs::create_dir_all(&real).expect("dir");
    std::fs::write(real.join("ca.pem"), ca).expect("write");
    std::fs::write(real.join(format!("{node}.pem")), cert).expect("write");
    std::fs::write(real.join(format!("{node}.key")), key).expect("write");
    let link = base.join(format!("{node}.tmp"));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&real, &link).expect("link");
    std::fs::rename(&link, base.join(node)).expect("swap");
}

/// A CA rotation through the files of two running routers, each with its own directory (as
/// on two hosts): both trust the old and the new CA, then take pairs of the new one, then
/// trust the new one alone. They stay one mesh, and a change through one reaches the other;
/// files that do not load change nothing; at the end a router holding the old CA's pair is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_rotation_through_the_files_keeps_routers_meshed_without_a_restart() {
    let sims = start_sims(1, |_| sim_cfg("m")).await;
    let engines = urls(&sims);
    let names = || vec!["a".to_string(), "b".to_string(), "c".to_string()];
    let old = kvmesh_mesh::certs::generate(&names()).expect("old CA");
    let new = kvmesh_mesh::certs::generate(&names()).expect("new CA");
    let base = std::env::temp_dir().join(format!("kvmesh-rotation-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let dir = |n: &str| base.join(n);
    let pair = |c: &kvmesh_mesh::certs::ClusterCerts, n: &str| {
        let p = c.nodes.iter().find(|x| x.name == n).expect("node");
        (p.cert_pem.clone(), p.key_pem.clone())
    };
    let install = |n: &str, v: u32, ca: &str, c: &kvmesh_mesh::certs::ClusterCerts| {
        let (cert, key) = pair(c, n);
        publish(&base, n, v, ca, &cert, &key);
    };
    for n in ["a", "b", "c"] {
        install(n, 1, &old.ca_pem, &old);
    }
    let cfg = |name: &str, seeds: Vec<String>| {
        let mut c = serve_cfg(&engines);
        c.admin_token = "t".into();
        c.mesh = MeshConfig {
            tls_reload_ms: 100,
            ..mesh_cfg(&dir(name), name, seeds)
        };
        c
    };
    let a = start_router_with(cfg("a", vec![]), "m", 1).await;
    let seed = mesh_addr(&a);
    let b = start_router_with(cfg("b", vec![seed.clone()]), "m", 1).await;
    let http = client();
    wait_members(&http, &a, 1).await;
    wait_members(&http, &b, 1).await;
    let counter = |r: &GatewayServer, what: &str| {
        let t = r.cluster.as_ref().expect("meshed").transport_counters();
        match what {
            "reloads" => t.tls_reloads.load(Relaxed),
            _ => t.tls_reload_failures.load(Relaxed),
        }
    };
    let reloaded = |n: u64| {
        let (a, b) = (&a, &b);
        async move {
            assert!(
                until(Duration::from_secs(5), || counter(a, "reloads") >= n
                    && counter(b, "reloads") >= n)
                .await,
                "both routers took the files ({n})"
            );
        }
    };

    // 1. Both trust the old and the new CA.
    let both = format!("{}{}", old.ca_pem, new.ca_pem);
    for n in ["a", "b"] {
        install(n, 2, &both, &old);
    }
    reloaded(1).await;
    // A key cut short on a: refused, the pair before kept.
    let (cert, _) = pair(&old, "a");
    publish(
        &base,
        "a",
        3,
        &both,
        &cert,
        "-----BEGIN PRIVATE KEY-----\nAAA",
    );
    assert!(
        until(Duration::from_secs(5), || counter(&a, "failures") == 1).await,
        "the bad key was counted"
    );
    // 2. Pairs of the new CA.
    for n in ["a", "b"] {
        install(n, 4, &both, &new);
    }
    reloaded(2).await;
    // 3. The new CA alone: the connections close and both sides verify each other again.
    for n in ["a", "b"] {
        install(n, 5, &new.ca_pem, &new);
    }
    reloaded(3).await;
    wait_members(&http, &a, 1).await;
    wait_members(&http, &b, 1).await;
    assert!(
        reweigh_everywhere(&http, &b, &engines[0], 3.5, &[&a], Duration::from_secs(5)).await,
        "a change through b reached a after the rotation"
    );
    assert_eq!(counter(&a, "failures"), 1);
    // `/admin/cluster` says what each presents and trusts: the new pair and the new CA alone.
    for n in ["a", "b"] {
        let (cert, key) = pair(&new, n);
        let want = kvmesh_mesh::certs::NodeTls::from_pem(n, &new.ca_pem, &cert, &key)
            .expect("loads")
            .summary();
        let r = if n == "a" { &a } else { &b };
        let tls = cluster_json(&http, r).await["tls"].clone();
        assert_eq!(tls["cert_sha256"], want.cert_sha256.as_str(), "{n}: {tls}");
        assert_eq!(
            tls["cas_sha256"],
            serde_json::json!(want.cas_sha256),
            "{n}: {tls}"
        );
        assert_eq!(tls["cert_not_after"], 67_090_118_400i64, "{n}: {tls}");
        assert_eq!(tls["reloads"], 3, "{n}: {tls}");
    }
    assert_eq!(counter(&b, "failures"), 0);

    // A router still holding the old CA's pair (and trusting it) is refused.
    let refused = a
        .cluster
        .as_ref()
        .expect("meshed")
        .transport_counters()
        .handshake_failures
        .load(Relaxed);
    let c = start_router_with(cfg("c", vec![seed]), "m", 1).await;
    assert!(
        until(Duration::from_secs(10), || a
            .cluster
            .as_ref()
            .expect("meshed")
            .transport_counters()
            .handshake_failures
            .load(Relaxed)
            > refused)
        .await,
        "a refused c's handshake"
    );
    assert!(
        cluster_json(&http, &c).await["members"]
            .as_array()
            .is_none_or(Vec::is_empty)
    );
    assert_eq!(
        cluster_json(&http, &a).await["members"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    for r in [a, b, c] {
        r.shutdown().await;
    }
    stop_sims(sims).await;
    let _ = std::fs::remove_dir_all(&base);
}

/// A router told to stop drains its requests before it leaves the mesh: meanwhile its peers
/// still list it and count its requests (found by QA: it left first, and its peers routed as
/// if its engines were idle while its streams ran on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_router_stays_in_the_mesh_until_its_requests_end() {
    let sims = start_sims(1, |_| {
        let mut c = sim_cfg("m");
        c.time_scale = 1.0;
        c
    })
    .await;
    let engines = urls(&sims);
    let dir = std::env::temp_dir().join(format!("kvmesh-drain-{}", std::process::id()));
    let certs = kvmesh_mesh::certs::generate(&["a".into(), "b".into()]).expect("certs");
    kvmesh_mesh::certs::write_dir(&dir, &certs).expect("write");
    let cfg = |name: &str, seeds: Vec<String>| {
        let mut c = serve_cfg(&engines);
        c.mesh = mesh_cfg(&dir, name, seeds);
        c
    };
    let a = start_router_with(cfg("a", vec![]), "m", 1).await;
    let b = start_router_with(cfg("b", vec![mesh_addr(&a)]), "m", 1).await;
    let http = client();
    wait_members(&http, &a, 1).await;
    wait_members(&http, &b, 1).await;
    let held = hold_stream(&http, &b, 600);
    assert!(
        until(Duration::from_secs(5), || peer_load(&a) == 1).await,
        "A sees B's request"
    );
    let b_addr = b.addr;
    let draining = tokio::spawn(b.shutdown());
    // B is draining once it accepts no connection.
    wait_until(
        "B to stop accepting",
        Duration::from_secs(5),
        || async move { tokio::net::TcpStream::connect(b_addr).await.is_err() },
    )
    .await;
    assert!(!held.is_finished(), "the stream outlasts the check");
    assert_eq!(peer_load(&a), 1, "B's request still counted while B drains");
    // And B stays A's member for the whole drain: it may leave the moment its request ends,
    // before this task has read the answer's end (seen once in a full run), not before.
    while !held.is_finished() {
        let members = cluster_json(&http, &a).await["members"].clone();
        if members.as_array().map(Vec::len) != Some(1) {
            assert!(
                until(Duration::from_millis(500), || held.is_finished()).await,
                "B left while its request ran: {members}"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(held.await.expect("task").status, 200, "drained, not cut");
    draining.await.expect("shut down");
    assert!(
        until(Duration::from_secs(3), || peer_load(&a) == 0).await,
        "B's count gone with B"
    );
    wait_members(&http, &a, 0).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// An admin change sent to a router that does not hold the cluster's registry yet (joining,
/// its seeds unreachable here) is refused with a 503 to retry: applied then, it would be
/// undone by the cluster's state (a removal answered 200 came back 3 ms later, QA). Reading
/// is answered; once warm, changes are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_wait_until_the_router_holds_the_cluster_s_registry() {
    let sims = start_sims(2, |_| instant_sim_cfg("m")).await;
    let engines = urls(&sims);
    let dir = std::env::temp_dir().join(format!("kvmesh-admin-warm-{}", std::process::id()));
    let certs = kvmesh_mesh::certs::generate(&["a".into()]).expect("certs");
    kvmesh_mesh::certs::write_dir(&dir, &certs).expect("write");
    let mut cfg = serve_cfg(&engines[..1]);
    cfg.admin_token = "t".into();
    cfg.mesh = mesh_cfg(&dir, "a", vec!["127.0.0.1:9".into()]);
    // Warm by its warm-up time (5 anti-entropy rounds, 5 s) since nobody answers.
    let a = start_router_with(cfg, "m", 1).await;
    let c = client();
    let add = serde_json::json!({ "url": engines[1] });
    assert!(!cluster_warm(&a), "warm before its warm-up time");
    let r = admin(&c, &a, "POST", add.clone()).await;
    let v = assert_openai_error(&r, 503);
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("joining the cluster")),
        "{}",
        r.body
    );
    assert_eq!(a.gateway.registry.members().len(), 1, "nothing changed");
    assert_eq!(
        admin(&c, &a, "GET", serde_json::json!({})).await.status,
        200
    );
    assert!(until(Duration::from_secs(15), || cluster_warm(&a)).await);
    assert_eq!(admin(&c, &a, "POST", add).await.status, 201);
    a.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    stop_sims(sims).await;
}
