//! Cache-aware routing end to end: simulated engines publishing vLLM KV events over ZMQ, a
//! router with the `precise` policy in front of them, requests over loopback HTTP.
//!
//! 1. Sibling burst: 16 concurrent requests sharing a new ~4,000-token prefix all land on one
//!    engine (speculative entries make the siblings follow the first before any KV event
//!    arrives); `least_request` and `round_robin` spread the same burst (printed, contrast).
//! 2. Engine restart (cache empty, KV-event seq back to 0): within 1 s the router no longer
//!    believes the engine holds the prefix. (a) detected by the `process_start_time_seconds`
//!    scrape (no traffic reaches the engine); (b) detected by the seq regression of the first
//!    KV-event batch of the new process (an unrelated request sent directly to the engine).
//! 3. Prediction in the normal case: `x-kvmesh-predicted-cached-tokens` equals the engine's
//!    `usage.prompt_tokens_details.cached_tokens` (chat and completions).
//! 4. A LoRA adapter (the engines list it with a `parent`): its blocks carry its name on the
//!    engine and in the router's keys, so predictions hold for it and never leak to the base
//!    model's requests.
//!
//! Delays and spreads are printed (`cargo test -- --nocapture`).

use bytes::Bytes;
use http::{Method, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_config::{PolicyKind, ServeConfig, SimConfig};
use kvmesh_gateway::{Engine, GatewayServer};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

const MODEL: &str = "prefix-model";
/// Engines run 20× faster than real time.
const TIME_SCALE: f64 = 0.05;
/// Bound of one HTTP exchange.
const HTTP_TIMEOUT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// HTTP over loopback.

/// One HTTP answer.
#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: http::HeaderMap,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Header `name`, which must be present.
    fn required_header(&self, name: &str) -> &str {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} header: {self:?}"))
    }

    /// `x-kvmesh-engine`: the engine the router used.
    fn engine(&self) -> String {
        self.required_header("x-kvmesh-engine").to_string()
    }

    /// `x-kvmesh-predicted-cached-tokens`.
    fn predicted(&self) -> u64 {
        self.required_header("x-kvmesh-predicted-cached-tokens")
            .parse()
            .expect("numeric prediction")
    }

    /// The integer at `pointer` in the JSON body.
    fn json_u64(&self, pointer: &str) -> u64 {
        serde_json::from_str::<Value>(&self.body)
            .ok()
            .and_then(|v| v.pointer(pointer).and_then(Value::as_u64))
            .unwrap_or_else(|| panic!("no {pointer} in {}", self.body))
    }

    /// `usage.prompt_tokens_details.cached_tokens` (what the engine served from its cache).
    fn cached_tokens(&self) -> u64 {
        self.json_u64("/usage/prompt_tokens_details/cached_tokens")
    }

    /// `usage.prompt_tokens`.
    fn prompt_tokens(&self) -> u64 {
        self.json_u64("/usage/prompt_tokens")
    }

    fn expect_ok(self, what: &str) -> Reply {
        assert_eq!(self.status, StatusCode::OK, "{what}: {}", self.body);
        self
    }
}

/// One HTTP/1.1 exchange on a fresh connection (engines restart mid-test: no pooled
/// connection may outlive one), bounded by [`HTTP_TIMEOUT`].
async fn http(method: Method, url: &str, body: impl Into<Bytes>) -> Reply {
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http();
    let req = http::Request::builder()
        .method(method.clone())
        .uri(url)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.into()))
        .expect("request");
    let exchange = async {
        let resp = client
            .request(req)
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: {e:?}"));
        let (head, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: reading the body: {e:?}"))
            .to_bytes();
        Reply {
            status: head.status,
            headers: head.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    };
    tokio::time::timeout(HTTP_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {url}: no answer within {HTTP_TIMEOUT:?}"))
}

async fn post_json(url: &str, body: &Value) -> Reply {
    http(Method::POST, url, body.to_string()).await
}

/// A chat request (the shared `system` text, then a distinct user turn).
async fn chat(base: &str, system: &str, user: &str) -> Reply {
    chat_model(base, MODEL, system, user).await
}

/// [`chat`] naming `model`.
async fn chat_model(base: &str, model: &str, system: &str, user: &str) -> Reply {
    let body = json!({
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": 2,
    });
    post_json(&format!("{base}/v1/chat/completions"), &body)
        .await
        .expect_ok("chat")
}

/// A completions request with a text prompt.
async fn complete(base: &str, prompt: &str) -> Reply {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    post_json(&format!("{base}/v1/completions"), &body)
        .await
        .expect_ok("completion")
}

/// About `words` English words (≈ one token each), distinct per `seed`.
fn long_text(seed: u64, words: usize) -> String {
    const WORDS: &str = "router engine cache prefix block token request latency batch queue \
        gossip mesh policy weight health stream model prompt decode prefill memory event replay \
        cluster node partition";
    let w: Vec<&str> = WORDS.split_whitespace().collect();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(words * 8);
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(w[(x % w.len() as u64) as usize]);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// A cluster: engines with KV events, a router.

type Sims = kvmesh_sim::LocalFleet;

/// `n` simulated engines publishing KV events (with a replay socket).
async fn start_sims(n: usize) -> Sims {
    start_sims_with_adapters(n, &[]).await
}

/// [`start_sims`] whose engines also serve the LoRA adapters `adapters`.
async fn start_sims_with_adapters(n: usize, adapters: &[&str]) -> Sims {
    kvmesh_sim::start_fleet(n, true, |i| SimConfig {
        model: MODEL.into(),
        time_scale: TIME_SCALE,
        seed: i as u64 + 1,
        lora_modules: adapters.iter().map(|a| a.to_string()).collect(),
        ..SimConfig::default()
    })
    .await
    .expect("start sims")
}

/// A router over `sims` with `policy`; `discovery_ms`: how often engines' /metrics are read.
fn serve_cfg(sims: &Sims, policy: PolicyKind, discovery_ms: u64) -> ServeConfig {
    let mut c = ServeConfig {
        listen: "127.0.0.1:0".into(),
        engines: sims.entries.clone(),
        seed: 7,
        discovery_interval_ms: discovery_ms,
        drain_timeout_ms: 5_000,
        ..ServeConfig::default()
    };
    c.routing.policy.policy = policy;
    // Generous: a check may take 100+ ms on a loaded 2-core machine.
    c.routing.health.active.interval_ms = 500;
    c.routing.health.active.timeout_ms = 500;
    c.timeouts.first_byte_ms = 30_000;
    c.timeouts.total_ms = 60_000;
    c
}

fn member(router: &GatewayServer, url: &str) -> Arc<Engine> {
    router
        .gateway
        .registry
        .members()
        .into_iter()
        .find(|e| e.url == url)
        .unwrap_or_else(|| panic!("{url} is not a member"))
}

/// Blocks each engine holds according to its KV events, by URL.
fn tracked_blocks(router: &GatewayServer) -> BTreeMap<String, u64> {
    router
        .gateway
        .registry
        .members()
        .iter()
        .map(|e| (e.url.clone(), e.ingest.tracked_blocks.load(Relaxed)))
        .collect()
}

/// Polls `cond` every 5 ms until it holds; returns how long it took, or `None` after `limit`.
async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    loop {
        if cond() {
            return Some(t0.elapsed());
        }
        if t0.elapsed() >= limit {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Starts a router and waits until it routes the model to every engine and, when the policy
/// reads KV events, until a batch from every engine has been applied (ZMQ subscriptions take a
/// moment to reach the publisher: short unrelated requests go directly to each engine until
/// one of its batches arrives).
async fn start_router(sims: &Sims, cfg: ServeConfig) -> GatewayServer {
    let events = matches!(cfg.routing.policy.policy, PolicyKind::Precise);
    let router = kvmesh_gateway::start(cfg).await.expect("start router");
    let gw = router.gateway.clone();
    let n = sims.entries.len();
    let routed = wait_for(Duration::from_secs(20), || {
        gw.registry
            .snapshot()
            .routes
            .get(MODEL)
            .is_some_and(|r| r.engines.len() == n)
    })
    .await;
    assert!(
        routed.is_some(),
        "{MODEL} not routed to {n} engines in 20 s"
    );
    if events {
        for (i, url) in sims.urls().iter().enumerate() {
            let e = member(&router, url);
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut k = 0;
            while e.ingest.batches.load(Relaxed) == 0 {
                assert!(
                    Instant::now() < deadline,
                    "no KV-event batch of {url} applied in 20 s (connected: {})",
                    e.ingest.connected.load(Relaxed)
                );
                if e.ingest.connected.load(Relaxed) {
                    // Two full blocks at least: a batch of BlockStored events.
                    let prompt = format!("hello engine {i} attempt {k}: {}", long_text(k, 40));
                    complete(url, &prompt).await;
                    k += 1;
                }
                let _ = wait_for(Duration::from_millis(200), || {
                    e.ingest.batches.load(Relaxed) > 0
                })
                .await;
            }
        }
    }
    router
}

// ---------------------------------------------------------------------------------------------
// 1. Sibling burst.

/// Sends `n` chat requests sharing `prefix` (distinct user turns) through `base` all at once;
/// returns the engine each used and how many were routed with no predicted hit (under a
/// cache-aware policy: those routed before any sibling's speculative entry was visible).
async fn burst(base: &str, prefix: &Arc<String>, tag: &str, n: usize) -> (Vec<String>, usize) {
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let barrier = barrier.clone();
        let prefix = prefix.clone();
        let base = base.to_string();
        let user = format!(
            "{tag}: question {i} about {}",
            long_text(1000 + i as u64, 12)
        );
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            chat(&base, &prefix, &user).await
        }));
    }
    let mut engines = Vec::with_capacity(n);
    let mut cold = 0;
    for t in tasks {
        let r = t.await.expect("request task");
        if r.header("x-kvmesh-predicted-cached-tokens") == Some("0") {
            cold += 1;
        }
        engines.push(r.engine());
    }
    (engines, cold)
}

fn spread(engines: &[String]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for e in engines {
        *m.entry(e.clone()).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sibling_burst_lands_on_one_engine_under_precise() {
    const SIBLINGS: usize = 16;
    // PREFIX_ROUTING_BURSTS=N repeats the precise burst N times (stress).
    let bursts: u64 = std::env::var("PREFIX_ROUTING_BURSTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    const PREFIX_WORDS: usize = 4_000;
    let t_all = Instant::now();
    let sims = start_sims(8).await;

    let router = start_router(&sims, serve_cfg(&sims, PolicyKind::Precise, 1_000)).await;
    let base = router.base_url();
    let mut used = Vec::new();
    for b in 0..bursts {
        let prefix = Arc::new(long_text(100 + b, PREFIX_WORDS));
        let t = Instant::now();
        let (engines, cold) = burst(&base, &prefix, &format!("precise burst {b}"), SIBLINGS).await;
        let s = spread(&engines);
        println!(
            "precise burst {b}: {SIBLINGS} siblings on {} engine(s) {:?} in {:?}, {cold} routed \
             with no predicted hit",
            s.len(),
            s.values().collect::<Vec<_>>(),
            t.elapsed()
        );
        assert_eq!(
            s.len(),
            1,
            "burst {b}: siblings of a new prefix spread over engines: {s:?} ({cold} of them \
             routed with no predicted hit: decided before the first one's speculative entry \
             was visible)"
        );
        used.push(engines[0].clone());
    }
    println!("precise bursts went to {used:?}");
    router.shutdown().await;

    // Contrast: load-only policies spread the same kind of burst.
    for (k, policy) in [PolicyKind::LeastRequest, PolicyKind::RoundRobin]
        .into_iter()
        .enumerate()
    {
        let router = start_router(&sims, serve_cfg(&sims, policy, 1_000)).await;
        let prefix = Arc::new(long_text(200 + k as u64, PREFIX_WORDS));
        let (engines, _) = burst(
            &router.base_url(),
            &prefix,
            &format!("{} burst", policy.as_str()),
            SIBLINGS,
        )
        .await;
        let s = spread(&engines);
        println!(
            "{} burst: {SIBLINGS} siblings on {} engine(s) {:?}",
            policy.as_str(),
            s.len(),
            s.values().collect::<Vec<_>>()
        );
        assert!(
            s.len() > 1,
            "{} kept a burst on one engine: {s:?}",
            policy.as_str()
        );
        router.shutdown().await;
    }
    sims.shutdown(Duration::from_secs(2)).await;
    println!("sibling burst test: {:?}", t_all.elapsed());
}

// ---------------------------------------------------------------------------------------------
// 2. Engine restart.

/// How the restart is revealed to the router.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Reveal {
    /// Nothing reaches the engine: only the scrape of `process_start_time_seconds` can tell.
    StartTimeScrape,
    /// An unrelated request reaches the engine directly at once: its first KV-event batch has
    /// seq 0, below the last seq of the old process.
    SeqRegression,
}

/// Warms prefix P on one engine (A) through the router, restarts A, waits (≤ 1 s) for the
/// router to notice, then checks that nothing routes on the belief that A still holds P.
async fn restart_scenario(reveal: Reveal, discovery_ms: u64) -> Duration {
    let t_all = Instant::now();
    let sims = start_sims(3).await;
    let router = start_router(&sims, serve_cfg(&sims, PolicyKind::Precise, discovery_ms)).await;
    let base = router.base_url();
    let p = long_text(300, 2_000);

    // Warm: the first request picks A (nobody holds P); the second follows it and hits.
    let tracked = tracked_blocks(&router);
    let first = chat(&base, &p, "warm-up question 0").await;
    let a = first.engine();
    assert_eq!(first.predicted(), 0, "P is new: nothing predicted");
    let ea = member(&router, &a);
    // A's KV events confirm P (beyond the speculative entry).
    let want = tracked[&a] + first.prompt_tokens() / 16;
    let confirmed = wait_for(Duration::from_secs(10), || {
        ea.ingest.tracked_blocks.load(Relaxed) >= want
    })
    .await;
    assert!(
        confirmed.is_some(),
        "A's KV events never confirmed P (tracked {})",
        ea.ingest.tracked_blocks.load(Relaxed)
    );
    let second = chat(&base, &p, "warm-up question 1").await;
    assert_eq!(second.engine(), a, "the sibling follows the warm engine");
    assert!(second.cached_tokens() > 1_000, "A holds P: {}", second.body);
    assert_eq!(
        second.predicted(),
        second.cached_tokens(),
        "prediction on the warm engine"
    );

    // Under frequent scrapes, make the other engines look busier than A (a long generation
    // each, sent to them directly): with no engine holding P after the restart, least request
    // then sends P to A itself, which must come with no predicted hit.
    let others: Vec<String> = sims.urls().into_iter().filter(|u| *u != a).collect();
    let mut blockers = Vec::new();
    let force_a = discovery_ms <= 1_000;
    if force_a {
        for (i, u) in others.iter().enumerate() {
            let body = json!({
                "model": MODEL,
                "prompt": long_text(700 + i as u64, 20),
                "max_tokens": 20_000,
                "stream": true,
            });
            let url = format!("{u}/v1/completions");
            blockers.push(tokio::spawn(async move { post_json(&url, &body).await }));
        }
        for u in &others {
            let e = member(&router, u);
            let busy = wait_for(Duration::from_secs(5), || {
                e.reported_load().unwrap_or(0) >= 1
            })
            .await;
            assert!(busy.is_some(), "{u} never reported its long request");
        }
    }

    // Restart A.
    let restarts_before = ea.ingest.restarts.load(Relaxed);
    let epoch_before = ea.ingest.epoch.load(Relaxed);
    let t0 = Instant::now();
    http(Method::POST, &format!("{a}/admin/restart"), "")
        .await
        .expect_ok("restart");
    if reveal == Reveal::SeqRegression {
        complete(&a, &long_text(400, 60)).await;
    }
    let detected = wait_for(Duration::from_secs(1), || {
        ea.ingest.restarts.load(Relaxed) > restarts_before
    })
    .await;
    let delay = t0.elapsed();
    let Some(delay) = detected.map(|_| delay) else {
        panic!(
            "{reveal:?}: restart of {a} not detected within 1 s (restarts {}, epoch {}, batches {})",
            ea.ingest.restarts.load(Relaxed),
            ea.ingest.epoch.load(Relaxed),
            ea.ingest.batches.load(Relaxed)
        );
    };
    println!(
        "{reveal:?} (discovery every {discovery_ms} ms): restart of A detected after {:.1} ms",
        delay.as_secs_f64() * 1e3
    );
    // The router's metrics say so too.
    let page = http(Method::GET, &format!("{base}/metrics"), "").await.body;
    let line = page
        .lines()
        .find(|l| l.starts_with("kvmesh_kv_events_restarts_total{") && l.contains(&a))
        .unwrap_or_else(|| panic!("no kvmesh_kv_events_restarts_total for {a}"));
    let n: f64 = line
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("value");
    assert!(n >= 1.0, "{line}");
    // The restart is counted when it is seen; the applier publishes the new epoch after its
    // catch-up from the replay socket, a moment later (CI once read the epoch in between).
    let new_epoch = wait_for(Duration::from_secs(2), || {
        ea.ingest.epoch.load(Relaxed) > epoch_before
    })
    .await;
    assert!(
        new_epoch.is_some(),
        "{reveal:?}: no new epoch after the restart"
    );

    if force_a {
        // A's own load as the router sees it is back to 0 (a scrape may have caught the
        // direct request of the seq-regression variant running).
        let idle = wait_for(Duration::from_secs(3), || {
            ea.reported_load().unwrap_or(0) == 0 && ea.in_flight.load(Relaxed) == 0
        })
        .await;
        assert!(idle.is_some(), "A never looked idle to the router");
    }

    // P is held by no engine now: the next request with P is predicted to hit nothing,
    // wherever it goes; the following ones follow it and are predicted exactly.
    let mut on_a = 0;
    println!(
        "  first request with P sent {:.1} ms after the restart",
        t0.elapsed().as_secs_f64() * 1e3
    );
    for i in 0..4 {
        let r = chat(&base, &p, &format!("after the restart {i}")).await;
        let (e, pred, got) = (r.engine(), r.predicted(), r.cached_tokens());
        println!(
            "  after restart {i}: {} predicted {pred} cached {got}",
            if e == a { "A" } else { "other" }
        );
        if i == 0 {
            assert_eq!(
                pred, 0,
                "{reveal:?}: right after the restart the router still believed {e} holds P"
            );
            if force_a {
                for u in &others {
                    assert!(
                        member(&router, u).reported_load().unwrap_or(0) >= 1,
                        "{u} finished its long request too early"
                    );
                }
                assert_eq!(e, a, "least request sends P to the idle engine A");
            }
        }
        if e == a {
            on_a += 1;
        }
        assert!(
            pred <= got,
            "{reveal:?}: request {i} on {e}: predicted {pred} cached tokens, the engine had {got}"
        );
        assert_eq!(pred, got, "request {i} on {e}: prediction is exact");
    }
    println!("  {on_a} of 4 post-restart requests with P went to A");

    if reveal == Reveal::SeqRegression {
        // A later scrape sees the new start time too: the hint must not clear the new
        // process's blocks again (the events already told).
        tokio::time::sleep(Duration::from_millis(3 * discovery_ms.min(1_000) + 200)).await;
        assert_eq!(
            ea.ingest.restarts.load(Relaxed),
            restarts_before + 1,
            "one restart, counted once"
        );
        assert!(
            ea.ingest.tracked_blocks.load(Relaxed) > 0,
            "the new process's blocks are kept"
        );
    } else {
        assert_eq!(ea.ingest.restarts.load(Relaxed), restarts_before + 1);
    }
    for b in blockers {
        b.abort();
    }
    router.shutdown().await;
    sims.shutdown(Duration::from_secs(2)).await;
    println!("  scenario took {:?}", t_all.elapsed());
    delay
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_detected_by_start_time_scrape() {
    restart_scenario(Reveal::StartTimeScrape, 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_detected_by_seq_regression() {
    // Scrapes every 200 ms: whichever comes first; the delay shows it was the events.
    restart_scenario(Reveal::SeqRegression, 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_detected_by_seq_regression_alone() {
    // Scrapes every 30 s (the first at start-up only): the seq regression alone must tell.
    restart_scenario(Reveal::SeqRegression, 30_000).await;
}

// ---------------------------------------------------------------------------------------------
// 3. Predictions in the normal case.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_cached_tokens_match_the_engine() {
    let sims = start_sims(3).await;
    let mut cfg = serve_cfg(&sims, PolicyKind::Precise, 1_000);
    // Speculative entries fade fast: the second requests are routed on KV events alone.
    cfg.prefix.speculative_ttl_ms = 100;
    let router = start_router(&sims, cfg).await;
    let base = router.base_url();

    // Chat: system prompt P.
    let p = long_text(500, 1_500);
    let tracked = tracked_blocks(&router);
    let first = chat(&base, &p, "first question").await;
    let a = first.engine();
    assert_eq!(first.predicted(), 0);
    assert_eq!(first.cached_tokens(), 0, "P is new to every engine");
    let ea = member(&router, &a);
    let want = tracked[&a] + first.prompt_tokens() / 16;
    let synced = wait_for(Duration::from_secs(10), || {
        ea.ingest.tracked_blocks.load(Relaxed) >= want
    })
    .await;
    assert!(synced.is_some(), "A's KV events never covered the prompt");
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The same request again: every full block but the one holding the last prompt token.
    let same = chat(&base, &p, "first question").await;
    let n = same.prompt_tokens();
    println!(
        "chat, same prompt ({n} tokens): predicted {}, engine cached {}",
        same.predicted(),
        same.cached_tokens()
    );
    assert_eq!(same.engine(), a);
    assert_eq!(same.cached_tokens(), (n - 1) / 16 * 16);
    assert_eq!(same.predicted(), same.cached_tokens());

    // Another user turn after P: the shared blocks.
    let other = chat(&base, &p, "a different question altogether").await;
    println!(
        "chat, same system prompt ({} tokens): predicted {}, engine cached {}",
        other.prompt_tokens(),
        other.predicted(),
        other.cached_tokens()
    );
    assert_eq!(other.engine(), a);
    assert!(other.cached_tokens() >= 1_000);
    assert_eq!(other.predicted(), other.cached_tokens());

    // Completions: text prompt T, then T and more.
    let t = long_text(600, 1_200);
    let tracked = tracked_blocks(&router);
    let first = complete(&base, &t).await;
    let b = first.engine();
    assert_eq!(first.predicted(), 0);
    let eb = member(&router, &b);
    let want = tracked[&b] + first.prompt_tokens() / 16;
    let synced = wait_for(Duration::from_secs(10), || {
        eb.ingest.tracked_blocks.load(Relaxed) >= want
    })
    .await;
    assert!(synced.is_some());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let longer = complete(&base, &format!("{t} and then some more words")).await;
    println!(
        "completions, extended prompt ({} tokens): predicted {}, engine cached {}",
        longer.prompt_tokens(),
        longer.predicted(),
        longer.cached_tokens()
    );
    assert_eq!(longer.engine(), b);
    assert!(longer.cached_tokens() >= 1_000);
    assert_eq!(longer.predicted(), longer.cached_tokens());

    router.shutdown().await;
    sims.shutdown(Duration::from_secs(2)).await;
}

// ---------------------------------------------------------------------------------------------
// 4. LoRA adapters.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapter_prefixes_are_keyed_by_the_adapter_name() {
    const ADAPTER: &str = "tenant-adapter";
    // One engine: the base-model request below lands where the adapter's blocks are, so both
    // the engine's hashes and the router's keys must tell them apart.
    let sims = start_sims_with_adapters(1, &[ADAPTER]).await;
    let mut cfg = serve_cfg(&sims, PolicyKind::Precise, 200);
    // Speculative entries fade fast: the second request is routed on KV events alone.
    cfg.prefix.speculative_ttl_ms = 100;
    let router = start_router(&sims, cfg).await;
    let gw = router.gateway.clone();
    let keyed = wait_for(Duration::from_secs(20), || {
        gw.registry.snapshot().routes.get(ADAPTER).is_some_and(|r| {
            r.engines.len() == 1
                && r.prefix
                    .as_ref()
                    .is_some_and(|p| p.lora_name.as_deref() == Some(ADAPTER))
        })
    })
    .await;
    assert!(keyed.is_some(), "the adapter was not discovered as one");
    let base = router.base_url();

    let p = long_text(700, 1_200);
    let tracked = tracked_blocks(&router);
    let first = chat_model(&base, ADAPTER, &p, "a question").await;
    assert_eq!((first.predicted(), first.cached_tokens()), (0, 0));
    let a = first.engine();
    let ea = member(&router, &a);
    let want = tracked[&a] + first.prompt_tokens() / 16;
    let synced = wait_for(Duration::from_secs(10), || {
        ea.ingest.tracked_blocks.load(Relaxed) >= want
    })
    .await;
    assert!(
        synced.is_some(),
        "the adapter's KV events never covered the prompt"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    let again = chat_model(&base, ADAPTER, &p, "a question").await;
    println!(
        "adapter, same prompt ({} tokens): predicted {}, engine cached {}",
        again.prompt_tokens(),
        again.predicted(),
        again.cached_tokens()
    );
    assert_eq!(again.engine(), a);
    assert!(again.cached_tokens() >= 1_000);
    assert_eq!(again.predicted(), again.cached_tokens());

    // The base model with the same prompt on the same engine: other block hashes there, other
    // keys in the router — nothing cached, nothing predicted.
    let plain = chat_model(&base, MODEL, &p, "a question").await;
    println!(
        "base model, same prompt, same engine: predicted {}, cached {}",
        plain.predicted(),
        plain.cached_tokens()
    );
    assert_eq!(plain.engine(), a);
    assert_eq!((plain.predicted(), plain.cached_tokens()), (0, 0));

    router.shutdown().await;
    sims.shutdown(Duration::from_secs(2)).await;
}
