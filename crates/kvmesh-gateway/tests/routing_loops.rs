//! Routing loops: an engine whose address is a router's. A router refuses its own address as
//! an engine wherever one comes from (config, admin API, a peer's record); and a request that
//! comes back to a router it passed through (`x-kvmesh-via` carries each router's mark) is
//! refused with a 508 instead of being routed again (QA: a router given its own address as an
//! engine turned one request into about 10,000 and ran out of file descriptors).

mod common;

use common::*;
use kvmesh_config::EngineEntry;
use kvmesh_gateway::Source;
use serde_json::json;
use std::time::Duration;

const TOKEN: &str = "loop-test-token";

fn auth() -> String {
    format!("Bearer {TOKEN}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_refuses_its_own_address_as_an_engine() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let mut cfg = serve_cfg(&urls(&sims));
    cfg.admin_token = TOKEN.into();
    let router = start_router_with(cfg, "m", 1).await;
    let base = router.base_url();
    let c = client();
    let admin = format!("{base}/admin/engines");
    let a = auth();
    for own in [
        base.clone(),
        base.replace("127.0.0.1", "localhost"),
        base.replace("127.0.0.1", "0.0.0.0"),
    ] {
        let body = json!({ "url": own }).to_string();
        let r = send(
            &c,
            "POST",
            &admin,
            &[("authorization", &a)],
            body,
            Duration::from_secs(10),
        )
        .await;
        let v = assert_openai_error(&r, 400);
        assert_eq!(v["error"]["param"], "url", "{}", r.body);
        assert!(r.body.contains("own listen address"), "{}", r.body);
    }
    // A peer's record (or a DNS name) naming it goes through the same registry.
    let entry = EngineEntry {
        url: base.clone(),
        ..EngineEntry::default()
    };
    let err = router
        .gateway
        .registry
        .add(&entry, Source::Mesh, true)
        .err()
        .expect("its own address refused");
    assert!(err.contains("own listen address"), "{err}");
    assert_eq!(router.gateway.registry.len(), 1, "nothing added");
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_comes_back_is_refused_not_routed_again() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let mut cfg = serve_cfg(&urls(&sims));
    cfg.admin_token = TOKEN.into();
    cfg.routing.policy.policy = kvmesh_policy::PolicyKind::RoundRobin;
    let a = start_router_with(cfg, "m", 1).await;
    // B routes to A; A is then given B as an engine: A → B → A is a loop neither router can
    // see from the addresses alone.
    let b = start_router_with(serve_cfg(&[a.base_url()]), "m", 1).await;
    let c = client();
    let body = json!({ "url": b.base_url() }).to_string();
    let admin = format!("{}/admin/engines", a.base_url());
    let r = send(
        &c,
        "POST",
        &admin,
        &[("authorization", &auth())],
        body,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    wait_routable(&a, "m", 2).await;

    // Every request is served: the ones A sends through B come back to A, are refused there,
    // and A tries the engine.
    let n = 12;
    let chat = format!("{}/v1/chat/completions", a.base_url());
    for i in 0..n {
        let r = post_json(
            &c,
            &chat,
            &chat_body("m", &format!("question {i}"), 2, false),
        )
        .await;
        assert!(r.ok(), "{r:?}");
    }
    let page_a = scrape(&c, &a.base_url()).await;
    let page_b = scrape(&c, &b.base_url()).await;
    let (routed_a, routed_b) = (
        metric(&page_a, "kvmesh_requests_total"),
        metric(&page_b, "kvmesh_requests_total"),
    );
    assert!(
        routed_b >= 1.0,
        "round robin sent some through B: {routed_b}"
    );
    assert_eq!(routed_a, f64::from(n), "no request routed twice by A");
    assert!(
        routed_b <= f64::from(n),
        "B routed each at most once: {routed_b}"
    );

    // A request carrying the router's own mark is refused before anything is routed.
    let via = a.gateway.via.to_str().expect("ascii").to_string();
    let r = send(
        &c,
        "POST",
        &chat,
        &[("x-kvmesh-via", &via)],
        chat_body("m", "again", 2, false).to_string(),
        Duration::from_secs(10),
    )
    .await;
    let v = assert_openai_error(&r, 508);
    assert_eq!(v["error"]["code"], "loop_detected", "{}", r.body);
    // Its answer carries the request's id, as every answer does (QA29: the 508 did not).
    assert!(r.headers.contains_key("x-request-id"), "{:?}", r.headers);
    let page_a = scrape(&c, &a.base_url()).await;
    assert_eq!(metric(&page_a, "kvmesh_requests_total"), f64::from(n));
    stop_sims(sims).await;
}

/// A router's own address taken as an engine through a peer's admin API: the router refuses
/// it, its peers route to it. Their in-flight counts of it are the cluster's, and the
/// router's mesh node keeps them as any engine's: it used to hold them as an orphan's, drop
/// them every ten anti-entropy periods and be repaired, again and again (QA26: load digests
/// apart for over 70 s, repairs rising).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_keeps_the_cluster_s_counts_of_its_own_address_taken_as_an_engine() {
    use common::mesh::*;
    let sims = start_sims(2, |_| instant_sim_cfg("m")).await;
    let engines = urls(&sims);
    let (dir, [a, b, c3]) = mesh_of_three("own-address", 2, |_| {
        let mut cfg = serve_cfg(&engines);
        cfg.admin_token = "t".into();
        cfg.routing.policy.policy = kvmesh_policy::PolicyKind::RoundRobin;
        // Orphans are dropped after ten periods: 1 s here.
        cfg.mesh.anti_entropy_ms = 100;
        cfg
    })
    .await;
    let http = client();
    let b_url = b.base_url();
    let added = admin(&http, &a, "POST", json!({ "url": b_url })).await;
    assert_eq!(added.status, 201, "{}", added.body);
    let id = kvmesh_prefix::EngineId::from_url(&b_url);
    let known = || {
        [&a, &c3]
            .iter()
            .all(|r| r.gateway.registry.get(id).is_some())
    };
    assert!(until(Duration::from_secs(5), known).await, "A and C have B");
    let routed = || {
        a.gateway.registry.get(id).is_some_and(|e| {
            e.metrics
                .requests
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
        })
    };
    for i in 0..30 {
        if routed() {
            break;
        }
        let body = chat_body("m", &format!("turn {i}"), 2, false);
        let r = post_json(
            &http,
            &format!("{}/v1/chat/completions", a.base_url()),
            &body,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(routed(), "A routed to B as an engine");
    // Three orphan graces: the counts of B-as-engine stay at B, and the digests together.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let at_b = cluster_json(&http, &b).await;
    assert_eq!(at_b["orphan_entries_dropped"], 0, "{at_b}");
    assert_eq!(at_b["entries"]["orphan_engines"], 0, "{at_b}");
    assert!(digests_agree(&http, [&a, &b, &c3]).await);
    // Removed (through B itself), B's node lets them go with the engine.
    let removed = admin(&http, &b, "DELETE", json!({ "url": b_url })).await;
    assert_eq!(removed.status, 200, "{}", removed.body);
    assert!(
        until(Duration::from_secs(5), || !known()).await,
        "A and C forget B as an engine"
    );
    assert!(digests_agree(&http, [&a, &b, &c3]).await);
    drop((a, b, c3));
    let _ = std::fs::remove_dir_all(&dir);
    stop_sims(sims).await;
}
