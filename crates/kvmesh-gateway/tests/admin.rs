//! Acceptance 6: the admin API (`/admin/engines`) and DNS discovery.
//!
//! * No token configured → 403; a missing or wrong bearer → 401.
//! * GET lists the engines; POST adds one (it takes traffic once its models are known, and
//!   slow start ramps it); DELETE removes one while its in-flight requests finish; PATCH sets
//!   one's weight; an invalid body → 400 and nothing changes; another method → 405 naming
//!   those it takes.
//! * A `dns` entry `localhost:PORT` resolves and adds the engine(s) behind it; an address
//!   where nothing listens (e.g. `[::1]` when only 127.0.0.1 is served) is marked unhealthy and
//!   serves no model; DELETE of a resolved engine → 409 (its name would bring it back).

mod common;

use bytes::Bytes;
use common::*;
use kvmesh_config::DnsEntry;
use kvmesh_gateway::GatewayServer;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const TOKEN: &str = "s3cret-admin-token";

fn bearer() -> (&'static str, String) {
    ("authorization", format!("Bearer {TOKEN}"))
}

async fn admin(c: &HttpClient, base: &str, method: &str, body: impl Into<Bytes>) -> Reply {
    let (k, v) = bearer();
    send(
        c,
        method,
        &format!("{base}/admin/engines"),
        &[(k, &v)],
        body,
        Duration::from_secs(10),
    )
    .await
}

/// The `Allow` header of a reply.
fn allow(r: &Reply) -> Option<&str> {
    r.headers.get("allow").and_then(|v| v.to_str().ok())
}

/// A router in front of `engines` with the admin API on (`TOKEN`), routing to all of them.
async fn admin_router(engines: &[String]) -> GatewayServer {
    let mut cfg = serve_cfg(engines);
    cfg.admin_token = TOKEN.into();
    start_router_with(cfg, "test-model", engines.len()).await
}

/// The engines the admin API lists, by URL.
async fn listed(c: &HttpClient, base: &str) -> BTreeMap<String, Value> {
    let r = admin(c, base, "GET", Bytes::new()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["engines"]
        .as_array()
        .expect("engines")
        .iter()
        .map(|e| (e["url"].as_str().expect("url").to_string(), e.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_is_off_without_a_token() {
    let sims = start_sims(1, |_| instant_sim_cfg("test-model")).await;
    let router = start_router_with(serve_cfg(&urls(&sims)), "test-model", 1).await;
    let c = client();
    let url = format!("{}/admin/engines", router.base_url());
    for method in ["GET", "POST", "DELETE"] {
        for auth in [None, Some("Bearer "), Some("Bearer anything")] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let body = json!({"url": "http://127.0.0.1:1"}).to_string();
            let r = send(&c, method, &url, &headers, body, Duration::from_secs(10)).await;
            assert_openai_error(&r, 403);
        }
    }
    assert_eq!(router.gateway.registry.members().len(), 1);
    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_lists_adds_and_removes_engines() {
    let mut sims = start_sims(2, |_| sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let router = admin_router(&engines).await;
    let base = router.base_url();
    let c = client();
    let url = format!("{base}/admin/engines");

    // Authentication.
    for auth in [
        None,
        Some("Bearer wrong-token"),
        Some("Basic czNjcmV0"),
        Some("Bearer s3cret-admin-toke"),
    ] {
        for method in ["GET", "POST", "DELETE"] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let body = json!({"url": "http://127.0.0.1:1"}).to_string();
            let r = send(&c, method, &url, &headers, body, Duration::from_secs(10)).await;
            assert_openai_error(&r, 401);
        }
    }

    // GET lists the start-up engines.
    let list = listed(&c, &base).await;
    assert_eq!(list.keys().cloned().collect::<Vec<_>>(), {
        let mut e = engines.clone();
        e.sort();
        e
    });
    for e in list.values() {
        assert_eq!(e["source"], "static", "{e}");
        assert_eq!(e["models"], json!(["test-model"]), "{e}");
        assert_eq!(e["healthy"], true, "{e}");
        assert_eq!(e["breaker"], "closed", "{e}");
        assert_eq!(e["weight"], 1.0, "{e}");
    }

    // Invalid bodies change nothing.
    let version = router.gateway.registry.snapshot().version;
    for body in [
        "not json".to_string(),
        "{}".to_string(),
        json!({"url": "ftp://127.0.0.1:1"}).to_string(),
        json!({"url": "http://127.0.0.1:1/v1"}).to_string(),
        json!({"url": "http://127.0.0.1:1", "weight": -1}).to_string(),
        json!({"url": "http://127.0.0.1:1", "wieght": 2}).to_string(),
        json!({"url": "http://127.0.0.1:1", "kv_events": "udp://x"}).to_string(),
        // Found by QA, each accepted before: endpoints that can never connect, models that
        // are no model.
        json!({"url": "http://127.0.0.1:1", "kv_events": "tcp://"}).to_string(),
        json!({"url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:99999"}).to_string(),
        json!({"url": "http://127.0.0.1:1", "kv_events": "tcp://@@@ ###"}).to_string(),
        json!({"url": "http://127.0.0.1:1", "models": [""]}).to_string(),
        json!({"url": "http://127.0.0.1:1", "models": ["a", "a"]}).to_string(),
    ] {
        let r = admin(&c, &base, "POST", body.clone()).await;
        assert_openai_error(&r, 400);
    }
    // A refused field is named.
    let r = admin(&c, &base, "POST", json!({"url": "ftp://x:1"}).to_string()).await;
    assert_eq!(r.json()["error"]["param"], "url", "{}", r.body);
    // A missing URL is said to be missing (QA35: told as the invalid URL "").
    let r = admin(&c, &base, "POST", json!({"weight": 2}).to_string()).await;
    assert_eq!(r.json()["error"]["param"], "url", "{}", r.body);
    assert_eq!(
        r.json()["error"]["code"],
        "missing_required_parameter",
        "{}",
        r.body
    );
    let body = json!({"url": "http://127.0.0.1:1", "models": [""]}).to_string();
    let r = admin(&c, &base, "POST", body).await;
    assert_eq!(r.json()["error"]["param"], "models", "{}", r.body);
    // An engine posted again: with the same settings it is done already (a retry: 200,
    // nothing changes; QA found a 409 where the README says the calls are idempotent), with
    // others a 409 that says which.
    let r = admin(&c, &base, "POST", json!({"url": engines[0]}).to_string()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["url"], engines[0].as_str(), "{}", r.body);
    let body = json!({"url": engines[0], "weight": 2}).to_string();
    let r = admin(&c, &base, "POST", body).await;
    assert_openai_error(&r, 409);
    assert!(r.body.contains("weight 1 here, 2 posted"), "{}", r.body);
    assert!(r.body.contains("set its weight with PATCH"), "{}", r.body);
    // Another spelling of the same engine is the same engine (found by QA: it was added).
    let shouted = engines[0].replace("http://127.0.0.1:", "HTTP://127.0.0.1:0");
    let r = admin(&c, &base, "POST", json!({ "url": shouted }).to_string()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let body = json!({ "url": shouted, "models": ["other"] }).to_string();
    let r = admin(&c, &base, "POST", body).await;
    assert_openai_error(&r, 409);
    // PATCH sets weights only: a models mismatch is not sent there (QA32).
    assert!(
        r.body.contains("DELETE it and POST it again") && !r.body.contains("PATCH"),
        "{}",
        r.body
    );
    // A DELETE with a field it does not take is refused, as POST and PATCH refuse one (QA:
    // it removed the engine from every router).
    let extra = json!({"url": engines[0], "weight": "9"}).to_string();
    for body in ["not json", "{\"uri\": \"x\"}", extra.as_str()] {
        let r = admin(&c, &base, "DELETE", body.to_string()).await;
        assert_openai_error(&r, 400);
    }
    // A spelling no engine can have is refused as such, not "no engine" (QA).
    let hex = engines[0].replace("http://127.0.0.1:", "http://0x7f.0.0.1:");
    let r = admin(&c, &base, "DELETE", json!({ "url": hex }).to_string()).await;
    assert_openai_error(&r, 400);
    assert_eq!(r.json()["error"]["param"], "url", "{}", r.body);
    assert!(r.body.contains("a.b.c.d"), "{}", r.body);
    let r = admin(
        &c,
        &base,
        "DELETE",
        json!({"url": "http://127.0.0.1:1"}).to_string(),
    )
    .await;
    assert_openai_error(&r, 404);
    assert_eq!(listed(&c, &base).await.len(), 2);
    assert_eq!(router.gateway.registry.snapshot().version, version);

    // POST adds an engine: it knows its models at once and ramps up under load.
    let new_sim = kvmesh_sim::start(sim_cfg("test-model")).await.expect("sim");
    let new = new_sim.base_url();
    sims.push(new_sim);
    let r = admin(
        &c,
        &base,
        "POST",
        json!({"url": new, "weight": 1.0}).to_string(),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["models"], json!(["test-model"]), "{}", r.body);
    let list = listed(&c, &base).await;
    assert_eq!(list[&new]["source"], "admin");
    let page = scrape(&c, &base).await;
    let factor0 = engine_metric(&page, "kvmesh_engine_slow_start_factor", &new);
    assert!(factor0 < 0.5, "a new engine starts its ramp: {factor0}");

    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (c, url, stop) = (
            c.clone(),
            format!("{base}/v1/chat/completions"),
            stop.clone(),
        );
        tokio::spawn(async move {
            let load = Load {
                concurrency: 8,
                max_requests: 20_000,
                max_time: Duration::from_secs(15),
                ..Load::default()
            };
            let make: MakeRequest = Arc::new(|i| {
                (
                    vec![],
                    chat_body("test-model", &format!("hello {i}"), 16, true),
                )
            });
            run_load(&c, &url, &load, stop, make).await
        })
    };
    // Sample the new engine's factor and attempts until it has been at full weight for 1 s.
    let all = [engines.clone(), vec![new.clone()]].concat();
    let t0 = Instant::now();
    let mut samples: Vec<(Duration, f64, f64, f64)> = Vec::new();
    let deadline = t0 + Duration::from_secs(12);
    loop {
        let p = scrape(&c, &base).await;
        let a = attempts(&p, &all);
        let f = engine_metric(&p, "kvmesh_engine_slow_start_factor", &new);
        samples.push((t0.elapsed(), f, a[2], a.iter().sum()));
        let full_for = samples
            .iter()
            .find(|s| s.1 >= 1.0)
            .map(|s| t0.elapsed() - s.0);
        if full_for.is_some_and(|d| d >= Duration::from_secs(1)) {
            break;
        }
        assert!(Instant::now() < deadline, "no ramp: {samples:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let replies = load.await.expect("load");
    assert!(failures(&replies).is_empty(), "{:?}", failures(&replies));
    let first_half = samples.len() / 2;
    let share = |a: &(Duration, f64, f64, f64), b: &(Duration, f64, f64, f64)| {
        (b.2 - a.2) / (b.3 - a.3).max(1.0)
    };
    let early = share(&samples[0], &samples[first_half]);
    let late = share(&samples[first_half], samples.last().expect("samples"));
    println!(
        "added engine: factor {factor0:.2} -> 1; share {:.1}% in the first half of the ramp, {:.1}% after",
        early * 100.0,
        late * 100.0
    );
    assert!(
        samples.windows(2).all(|w| w[1].1 >= w[0].1),
        "factor not monotone"
    );
    assert!(late > early, "share did not grow: {early} -> {late}");
    assert!(
        samples.last().expect("samples").2 > 0.0,
        "the new engine took no traffic"
    );

    // DELETE removes an engine while a long stream on it finishes.
    // ~2 s of streaming at time_scale 0.05.
    let long = chat_body("test-model", "a long answer please", 6000, true);
    let (head, stream, _) = stream_started(&c, &base, &long, 0).await;
    let victim = head
        .get("x-kvmesh-engine")
        .and_then(|v| v.to_str().ok())
        .expect("engine")
        .to_string();
    let reading = tokio::spawn(async move {
        use http_body_util::BodyExt;
        let b = tokio::time::timeout(Duration::from_secs(30), stream.collect())
            .await
            .expect("stream ends in time")
            .expect("stream intact")
            .to_bytes();
        String::from_utf8_lossy(&b).into_owned()
    });
    // Percent-encoded in the query string.
    let encoded = victim.replace(':', "%3A").replace('/', "%2F");
    let (k, v) = bearer();
    let r = send(
        &c,
        "DELETE",
        &format!("{url}?url={encoded}"),
        &[(k, &v)],
        Bytes::new(),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["removed"], victim.as_str());
    assert!(
        !reading.is_finished(),
        "the stream ended before the removal"
    );
    // It is shown draining, with its stream, until the stream ends (QA32: it vanished from
    // every view at once).
    let shown = listed(&c, &base).await;
    assert_eq!(shown[&victim]["state"], "draining", "{shown:?}");
    assert_eq!(shown[&victim]["in_flight"], 1, "{shown:?}");
    assert!(
        shown
            .iter()
            .all(|(u, e)| *u == victim || e["state"] == "active")
    );
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_in_flight", &victim),
        1.0
    );
    let (_, status) = get(&c, &format!("{base}/status.json")).await;
    let status: Value = serde_json::from_str(&status).expect("status json");
    let in_status = status["engines"]
        .as_array()
        .expect("engines")
        .iter()
        .find(|e| e["url"] == victim.as_str())
        .cloned()
        .expect("the draining engine in /status.json");
    assert_eq!(in_status["state"], "draining", "{in_status}");
    // New requests avoid it while the old stream goes on.
    for i in 0..20 {
        let r = post_json(
            &c,
            &format!("{base}/v1/chat/completions"),
            &chat_body("test-model", &format!("after {i}"), 2, false),
        )
        .await;
        assert!(r.ok(), "{r:?}");
        assert_ne!(r.engine.as_deref(), Some(victim.as_str()));
    }
    let body = reading.await.expect("reader");
    assert!(
        body.contains("data: [DONE]"),
        "the in-flight stream did not finish"
    );
    assert!(!body.contains("\"error\""), "{body:.300}");
    let page = scrape(&c, &base).await;
    assert_eq!(metric(&page, "kvmesh_in_flight"), 0.0);
    assert!(!page.contains(&format!("engine=\"{victim}\"")), "{page}");
    assert!(!listed(&c, &base).await.contains_key(&victim));
    // Removal by JSON body works too.
    let remaining: Vec<String> = listed(&c, &base).await.into_keys().collect();
    let r = admin(
        &c,
        &base,
        "DELETE",
        json!({"url": remaining[0]}).to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(listed(&c, &base).await.len(), remaining.len() - 1);

    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_sets_an_engines_weight() {
    let sims = start_sims(2, |_| instant_sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let router = admin_router(&engines).await;
    let base = router.base_url();
    let c = client();
    let weight = |l: &BTreeMap<String, Value>| l[&engines[0]]["weight"].as_f64();

    let r = admin(
        &c,
        &base,
        "PATCH",
        json!({ "url": engines[0], "weight": 2.5 }).to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["weight"], 2.5);
    assert_eq!(weight(&listed(&c, &base).await), Some(2.5));

    // Bad input: a clear error, and the weight stays.
    for (body, status) in [
        (json!({ "url": engines[0], "weight": 0 }), 400),
        (json!({ "url": engines[0], "weight": 0.0004 }), 400),
        (json!({ "url": engines[0], "weight": -1 }), 400),
        (json!({ "url": engines[0], "weight": "2" }), 400),
        (json!({ "url": engines[0] }), 400),
        (
            json!({ "url": engines[0], "weight": 3, "models": ["x"] }),
            400,
        ),
        (json!({ "url": "http://127.0.0.1:1", "weight": 3 }), 404),
        (json!({ "url": "http://[::127.0.0.1]:1", "weight": 3 }), 400),
    ] {
        let r = admin(&c, &base, "PATCH", body.to_string()).await;
        assert_eq!(r.status, status, "{body}: {}", r.body);
        assert!(r.json()["error"]["message"].is_string(), "{}", r.body);
    }
    assert_eq!(weight(&listed(&c, &base).await), Some(2.5));

    // Another method: 405, naming those the path takes.
    let r = admin(&c, &base, "PUT", Bytes::new()).await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(allow(&r), Some("GET, POST, PATCH, DELETE"));
    let r = send(
        &c,
        "DELETE",
        &format!("{base}/v1/models"),
        &[],
        Bytes::new(),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(allow(&r), Some("GET, HEAD"));
    router.shutdown().await;
    stop_sims(sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_name_adds_the_engines_it_resolves_to() {
    let sims = start_sims(1, |_| instant_sim_cfg("test-model")).await;
    let port = sims[0].http_addr.port();
    let mut cfg = serve_cfg(&[]);
    cfg.admin_token = TOKEN.into();
    cfg.dns = vec![DnsEntry {
        name: format!("localhost:{port}"),
        refresh_ms: 200,
        weight: 1.0,
        // Where each resolved engine's KV events would be (nothing publishes there: the
        // entry is what is checked).
        kv_events_port: 1,
        kv_replay_port: 0,
    }];
    let router = start_router_with(cfg, "test-model", 1).await;
    let base = router.base_url();
    let c = client();
    let v4 = format!("http://127.0.0.1:{port}");

    let list = listed(&c, &base).await;
    println!(
        "localhost:{port} resolved to {:?}",
        list.keys().collect::<Vec<_>>()
    );
    let e = list
        .get(&v4)
        .unwrap_or_else(|| panic!("{v4} not in {list:?}"));
    assert_eq!(e["source"], format!("dns:localhost:{port}"));
    assert_eq!(e["kv_events"], "tcp://127.0.0.1:1");
    assert_eq!(e["kv_replay"], "", "listed, empty without a replay socket");
    assert_eq!(e["models"], json!(["test-model"]));
    // Found at start-up: no slow start (like the static engines).
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_slow_start_factor", &v4),
        1.0
    );

    // Other addresses (e.g. [::1], where nothing listens) fail their checks and serve nothing.
    let others: Vec<String> = list.keys().filter(|u| **u != v4).cloned().collect();
    if !others.is_empty() {
        wait_until(
            "unserved addresses marked unhealthy",
            Duration::from_secs(10),
            || {
                let (c, base, others) = (c.clone(), base.clone(), others.clone());
                async move {
                    let list = listed(&c, &base).await;
                    others
                        .iter()
                        .all(|u| list[u]["healthy"] == false && list[u]["models"] == json!([]))
                }
            },
        )
        .await;
    }
    for i in 0..20 {
        let r = post_json(
            &c,
            &format!("{base}/v1/completions"),
            &completion_body("test-model", &format!("dns {i}"), 2, false),
        )
        .await;
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.engine.as_deref(), Some(v4.as_str()));
    }
    // A resolved engine is its name's: the admin API does not remove it.
    let r = admin(&c, &base, "DELETE", json!({ "url": v4 }).to_string()).await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.body.contains("DNS"), "{}", r.body);
    // Nor sets its weight: the name's weight rules (set here, it went to every router).
    let r = admin(
        &c,
        &base,
        "PATCH",
        json!({ "url": v4, "weight": 3 }).to_string(),
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(listed(&c, &base).await[&v4]["weight"], json!(1.0));
    // Re-resolution keeps the same engines (no churn).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let again = listed(&c, &base).await;
    assert_eq!(
        again.keys().collect::<Vec<_>>(),
        list.keys().collect::<Vec<_>>()
    );
    router.shutdown().await;
    stop_sims(sims).await;
}

/// The routing-decision series of a model go with the last engine that served it (QA: an
/// engine of 6,500 models, removed, left 104,000 series and a 9 MB /metrics behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_engine_s_models_leave_no_metric_series_behind() {
    let sims = start_sims(1, |_| instant_sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let router = admin_router(&engines).await;
    let base = router.base_url();
    let c = client();
    let extra = json!({"url": "http://127.0.0.1:1", "models": ["leak-a", "leak-b"]}).to_string();
    assert_eq!(admin(&c, &base, "POST", extra).await.status, 201);
    let series = |page: &str| page.lines().filter(|l| l.contains("model=\"leak-")).count();
    let page = scrape(&c, &base).await;
    assert!(series(&page) > 0, "the models' routes have series");
    let gone = json!({"url": "http://127.0.0.1:1"}).to_string();
    assert_eq!(admin(&c, &base, "DELETE", gone).await.status, 200);
    let page = scrape(&c, &base).await;
    assert_eq!(series(&page), 0, "left behind");
    assert!(
        page.contains("model=\"test-model\""),
        "the served model keeps its own"
    );
    stop_sims(sims).await;
}

/// A router may start without engines when its admin API can give it some (QA: `kvmesh
/// serve` refused to start): until one is added it answers 503 (to be retried), not a 404
/// that clients take as final; then it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_started_without_engines_serves_once_one_is_added() {
    let sims = start_sims(1, |_| instant_sim_cfg("test-model")).await;
    let mut cfg = serve_cfg(&[]);
    cfg.admin_token = TOKEN.into();
    let router = start_router(cfg).await;
    let base = router.base_url();
    let c = client();
    let chat = json!({"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let url = format!("{base}/v1/chat/completions");
    let r = send(&c, "POST", &url, &[], chat.clone(), Duration::from_secs(10)).await;
    assert_openai_error(&r, 503);
    let r = admin(
        &c,
        &base,
        "POST",
        json!({"url": urls(&sims)[0]}).to_string(),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    wait_routable(&router, "test-model", 1).await;
    let r = send(&c, "POST", &url, &[], chat, Duration::from_secs(10)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    router.shutdown().await;
    stop_sims(sims).await;
}
