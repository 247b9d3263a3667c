//! Acceptance 2: one of four engines is killed during a load run, then comes back.
//!
//! * No client sees an error for a request that had not started streaming (it was retried on
//!   another engine); the only failures allowed are streams the killed engine had already
//!   started (their head reached the client, so they cannot be retried).
//! * The killed engine is ejected: its breaker opens and its health checks fail.
//! * When an engine starts again on the same port, it ramps up: the slow-start factor and the
//!   effective weight rise from below 1 toward 1 and its share of the requests grows.
//!
//! The engines run in real time (h100-8b profile), so that several streams are being
//! generated on each engine when one dies, as on a real GPU; each sits behind a
//! [`CrashProxy`] that dies like a killed process (listener gone, every connection reset; an
//! in-process `SimServer::shutdown` would drain the streams instead of breaking them). The
//! router's health, breaker, slow-start and latency time constants are compressed (see
//! `serve_cfg`) so that kill, ejection, return and ramp all happen within the 30-second load
//! run the issue asks for (bounded by 32 s).
//!
//! And an engine that freezes (connections open, nothing answered) is marked unhealthy on the
//! health checks' schedule, whatever its discovery waits for.

mod common;

use common::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One look at the router's metrics for the victim.
#[derive(Debug, Clone, Copy)]
struct Sample {
    t: Duration,
    victim: f64,
    total: f64,
    factor: f64,
    weight: f64,
    breaker: f64,
    healthy: f64,
    in_flight: f64,
}

async fn sample(c: &HttpClient, base: &str, victim: &str, t0: Instant) -> Sample {
    let p = scrape(c, base).await;
    Sample {
        t: t0.elapsed(),
        victim: engine_metric(&p, "kvmesh_engine_requests_total", victim),
        total: metric(&p, "kvmesh_engine_requests_total"),
        factor: engine_metric(&p, "kvmesh_engine_slow_start_factor", victim),
        weight: engine_metric(&p, "kvmesh_engine_effective_weight", victim),
        breaker: engine_metric(&p, "kvmesh_engine_breaker_state", victim),
        healthy: engine_metric(&p, "kvmesh_engine_healthy", victim),
        in_flight: engine_metric(&p, "kvmesh_engine_in_flight", victim),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_engine_is_retried_around_ejected_and_ramped_back() {
    let real_time = |_| {
        let mut c = sim_cfg("test-model");
        c.time_scale = 1.0;
        c
    };
    let mut sims = start_sims(4, real_time).await;
    let mut proxies = Vec::new();
    for s in &sims {
        proxies.push(CrashProxy::start("127.0.0.1:0".parse().expect("addr"), s.http_addr).await);
    }
    let engines: Vec<String> = proxies.iter().map(CrashProxy::url).collect();
    let mut cfg = serve_cfg(&engines);
    cfg.routing.health.slow_start.window_ms = 4_000;
    // A failure's latency penalty (≥ 10 s, fading with τ = 10 s) and the error rate's decay
    // are compressed ×10 like the other intervals.
    let h = &mut cfg.routing.health;
    h.latency.decay_ms = 1_000;
    h.latency.failure_penalty_ms = 1_000;
    h.auto_weight.error_decay_ms = 3_000;
    let router = start_router_with(cfg, "test-model", 4).await;
    let base = router.base_url();
    let c = client();
    let victim_idx = 1;
    let victim = engines[victim_idx].clone();

    // The load: streaming chats, bounded in count and time, stopped once the ramp has been
    // seen. Until the kill, long answers (~2.5 s): every stream on the victim is still being
    // generated when it dies, so none can complete from what was already buffered. After
    // it, short ones (~0.4 s), for enough requests to measure the ramp.
    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let load = {
        let (c, url, stop, killed) = (
            c.clone(),
            format!("{base}/v1/chat/completions"),
            stop.clone(),
            killed.clone(),
        );
        tokio::spawn(async move {
            let load = Load {
                concurrency: 32,
                max_requests: 20_000,
                max_time: Duration::from_secs(32),
                request_timeout: Duration::from_secs(20),
            };
            let make: MakeRequest = Arc::new(move |i| {
                let tokens = if killed.load(Ordering::Relaxed) {
                    64
                } else {
                    400
                };
                let text = format!("conversation {i}");
                (vec![], chat_body("test-model", &text, tokens, true))
            });
            run_load(&c, &url, &load, stop, make).await
        })
    };
    let mut samples: Vec<Sample> = Vec::new();

    // Warm up until every engine serves and the victim has several streams in flight.
    wait_until(
        "traffic on every engine and streams in flight on the victim",
        Duration::from_secs(15),
        || {
            let (c, base, engines, victim) =
                (c.clone(), base.clone(), engines.clone(), victim.clone());
            async move {
                let p = scrape(&c, &base).await;
                attempts(&p, &engines).iter().all(|&a| a >= 5.0)
                    && engine_metric(&p, "kvmesh_engine_in_flight", &victim) >= 6.0
            }
        },
    )
    .await;

    // Kill: new connections are refused, open ones (streams in flight) are reset.
    let before = sample(&c, &base, &victim, t0).await;
    let killed_at = t0.elapsed();
    killed.store(true, Ordering::Relaxed);
    proxies[victim_idx].crash().await;
    println!(
        "killed {victim} at {killed_at:?} with {} streams in flight",
        before.in_flight
    );

    // Ejected: the breaker opens and the health checks fail.
    let mut opened = false;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = sample(&c, &base, &victim, t0).await;
        samples.push(s);
        opened |= s.breaker == 1.0;
        if opened && s.healthy == 0.0 {
            break;
        }
        if Instant::now() >= deadline {
            let p = scrape(&c, &base).await;
            let lines: Vec<&str> = p
                .lines()
                .filter(|l| {
                    !l.starts_with('#')
                        && !l.ends_with(" 0")
                        && (l.contains("errors_total")
                            || l.contains("breaker_state")
                            || l.contains("ejections"))
                })
                .collect();
            panic!("victim not ejected (breaker opened: {opened}): {s:?}\n{lines:#?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let page = scrape(&c, &base).await;
    assert!(engine_metric(&page, "kvmesh_engine_ejections_total", &victim) >= 1.0);
    let kinds: Vec<String> = ["stream", "connect", "transport", "5xx", "timeout"]
        .iter()
        .map(|k| {
            let n = engine_kind_metric(&page, "kvmesh_engine_errors_total", &victim, k);
            format!("{k} {n}")
        })
        .collect();
    println!(
        "ejected {:?} after the kill; failed attempts: {}; router retries so far {}",
        t0.elapsed() - killed_at,
        kinds.join(", "),
        metric(&page, "kvmesh_retries_total")
    );

    // Back: a new engine (empty cache) on the same port.
    let mut cfg = real_time(0);
    cfg.seed = 99;
    let revived = kvmesh_sim::start(cfg).await.expect("start sim");
    proxies[victim_idx].restart(revived.http_addr).await;
    let restarted_at = t0.elapsed();
    sims.push(revived);

    // Ramp: sample until the factor has been 1 for 2.5 s.
    let mut full_since: Option<Duration> = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let s = sample(&c, &base, &victim, t0).await;
        samples.push(s);
        if s.healthy == 1.0 && s.factor >= 1.0 && s.breaker == 0.0 {
            let since = *full_since.get_or_insert(s.t);
            if s.t - since >= Duration::from_millis(2_500) {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no ramp to full weight: {:#?}",
            &samples[samples.len().saturating_sub(10)..]
        );
    }
    // The scenario is a 30-second load run: keep the load going until then.
    let run_for = Duration::from_secs(30);
    if let Some(left) = run_for.checked_sub(t0.elapsed()) {
        tokio::time::sleep(left).await;
    }
    stop.store(true, Ordering::Relaxed);
    let replies = load.await.expect("load");

    // 1. Errors: only streams the victim had started before it died.
    let (broken, other): (Vec<&Reply>, Vec<&Reply>) = replies
        .iter()
        .filter(|r| !r.ok())
        .partition(|r| r.status == 200 && r.engine.as_deref() == Some(victim.as_str()));
    println!(
        "{} requests; {} streams broken on the killed engine; {} other failures",
        replies.len(),
        broken.len(),
        other.len()
    );
    assert!(
        other.is_empty(),
        "clients saw errors for requests that had not started streaming: {:#?}",
        other.iter().take(5).collect::<Vec<_>>()
    );
    // (The resets take a moment to reach every connection: allow 0.5 s.)
    let late: Vec<_> = broken
        .iter()
        .filter(|r| r.sent_at > killed_at + Duration::from_millis(500))
        .collect();
    assert!(
        late.is_empty(),
        "streams sent after the kill broke: {late:#?}"
    );
    assert!(replies.len() >= 300, "too little load: {}", replies.len());

    // 2. Ramp: the factor and the effective weight rise from below 1 to 1, the share grows.
    let after: Vec<Sample> = samples
        .iter()
        .copied()
        .filter(|s| s.t > restarted_at && s.healthy == 1.0 && s.breaker != 1.0)
        .collect();
    let mut prev: Option<Sample> = None;
    for s in &after {
        let share = prev.map_or(0.0, |p| {
            (s.victim - p.victim) / (s.total - p.total).max(1.0)
        });
        println!(
            "t={:>6.2}s factor={:.3} weight={:.3} breaker={} share of the last interval {:>5.1}%",
            s.t.as_secs_f64(),
            s.factor,
            s.weight,
            s.breaker,
            share * 100.0
        );
        prev = Some(*s);
    }
    let first = after.first().expect("samples after recovery");
    let last = after.last().expect("samples after recovery");
    assert!(first.factor < 0.6, "ramp not seen from below: {first:?}");
    assert_eq!(last.factor, 1.0);
    // The effective weight climbs back to full. (Its peak, not its last sample: the automatic
    // factor reacts to latency, and one scheduling stall of this shared 2-core machine at the
    // very end, with other tests running, can halve the last sample: seen once in a full run.)
    let peak = after.iter().map(|s| s.weight).fold(0.0, f64::max);
    assert!(
        peak > first.weight && peak > 0.9,
        "effective weight {} -> peak {peak} (last {})",
        first.weight,
        last.weight
    );
    // Share over the first part of the ramp vs the last 2 s at full weight.
    let early_end = after
        .iter()
        .position(|s| s.factor >= 0.5)
        .unwrap_or(after.len() - 1)
        .max(1);
    let share = |a: &Sample, b: &Sample| (b.victim - a.victim) / (b.total - a.total).max(1.0);
    let early = share(&after[0], &after[early_end]);
    let late_start = after
        .iter()
        .rposition(|s| last.t - s.t >= Duration::from_secs(2))
        .unwrap_or(0);
    let late = share(&after[late_start], last);
    println!(
        "victim share: {:.1}% while the factor was below 0.5, {:.1}% over the last 2 s at full weight",
        early * 100.0,
        late * 100.0
    );
    assert!(early < late, "share did not grow: {early:.3} -> {late:.3}");
    assert!(late >= 0.10, "share at full weight only {late:.3}");

    router.shutdown().await;
    drop(proxies);
    stop_sims(sims).await;
}

/// An engine that stops answering but keeps its connections open (`kill -STOP`, a wedged
/// process) is marked unhealthy within what the health settings allow: its health checks
/// are not held up behind the discovery of its models and metrics, which waits out its own
/// timeouts. (QA: both shared one loop, and the checks ran a fraction of the time, so such an
/// engine was marked unhealthy after 26–90 s instead of about 17 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_engine_is_marked_unhealthy_on_the_health_checks_schedule() {
    let sims = start_sims(2, |_| sim_cfg("test-model")).await;
    let proxy = CrashProxy::start("127.0.0.1:0".parse().expect("addr"), sims[1].http_addr).await;
    let victim = proxy.url();
    let engines = vec![urls(&sims)[0].clone(), victim.clone()];
    let mut cfg = serve_cfg(&engines);
    let h = &mut cfg.routing.health.active;
    (h.interval_ms, h.timeout_ms, h.unhealthy_threshold) = (200, 200, 2);
    // Discovery of a frozen engine waits out two reads of 500 ms each, time and again.
    cfg.discovery_interval_ms = 100;
    let router = start_router_with(cfg, "test-model", 2).await;
    let (c, base) = (client(), router.base_url());
    let healthy = |page: &str| engine_metric(page, "kvmesh_engine_healthy", &victim);
    assert_eq!(healthy(&scrape(&c, &base).await), 1.0);
    proxy.freeze();
    // 2 checks × (200 ms interval + 200 ms timeout) = 0.8 s; a check that lost its turns to
    // discovery half the time needed at least 2.4 s.
    wait_until(
        "the frozen engine marked unhealthy",
        Duration::from_millis(2_000),
        || async { healthy(&scrape(&c, &base).await) == 0.0 },
    )
    .await;
    router.shutdown().await;
    drop(proxy);
    stop_sims(sims).await;
}

/// An engine that hangs (takes requests, passes its health checks, never answers) while its
/// clients give up after 0.8 s, long before the router's first-byte timeout: each client
/// that leaves an attempt the engine never answered counts as a failure of kind
/// `unanswered`, the breaker opens, and the requests that follow all go to the engine that
/// answers. (QA: such an engine kept its full share for as long as it hung, with 0 errors
/// and its breaker closed; half of the clients of a 2-engine router timed out.) The
/// engine that answers gets no such failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_give_up_on_a_hung_engine_open_its_breaker() {
    let sims = start_sims(2, |_| sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let (good, victim) = (engines[0].clone(), engines[1].clone());
    let mut cfg = serve_cfg(&engines);
    // Every other request to the hung engine: load-aware policies send it fewer while its
    // attempts are in flight, and none once they are counted as failures.
    cfg.routing.policy.policy = kvmesh_policy::PolicyKind::RoundRobin;
    // Its metrics read every 100 ms: two reads with no work seen show it idle.
    cfg.discovery_interval_ms = 100;
    let h = &mut cfg.routing.health;
    h.unanswered.after_ms = 300;
    // Long enough that no half-open probe comes during the check below.
    (h.breaker.open_ms, h.breaker.open_max_ms) = (60_000, 60_000);
    let router = start_router_with(cfg, "test-model", 2).await;
    let (c, base) = (client(), router.base_url());
    set_faults(&c, &sims[1].base_url(), serde_json::json!({"hang": true})).await;
    let url = format!("{base}/v1/chat/completions");
    let load = |n: u64| Load {
        concurrency: 4,
        max_requests: n,
        max_time: Duration::from_secs(20),
        request_timeout: Duration::from_millis(800),
    };
    let make: MakeRequest = Arc::new(|i| {
        let text = format!("question {i}");
        (vec![], chat_body("test-model", &text, 8, true))
    });
    let stop = Arc::new(AtomicBool::new(false));
    // Meanwhile bad requests, which the hung engine's API server refuses at once (400), as a
    // stuck vLLM's does: a refusal is no sign that the engine works (QA: they kept its
    // unanswered attempts from counting, and half of the requests were lost for good).
    let refusals = {
        let (c, url, stop) = (c.clone(), url.clone(), stop.clone());
        tokio::spawn(async move {
            let mut bad = chat_body("test-model", "hi", 8, true);
            bad["temperature"] = serde_json::json!(-1);
            let mut refused = 0;
            for _ in 0..200 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let r = send(
                    &c,
                    "POST",
                    &url,
                    &[],
                    bad.to_string(),
                    Duration::from_secs(5),
                )
                .await;
                refused += usize::from(r.status == 400);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            refused
        })
    };
    let first = run_load(
        &c,
        &url,
        &load(24),
        Arc::new(AtomicBool::new(false)),
        make.clone(),
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let refused = refusals.await.expect("refusals");
    let lost = first.iter().filter(|r| !r.ok()).count();
    // The router learns that a client left when its connection closes: each attempt is
    // accounted for before its in-flight count drops.
    settled(&c, &base, &victim).await;
    let page = scrape(&c, &base).await;
    let unanswered =
        |e: &str| engine_kind_metric(&page, "kvmesh_engine_errors_total", e, "unanswered");
    println!(
        "while the engine learned: {lost} of {} requests lost; unanswered: victim {}, good {}; breaker {}; in flight {}",
        first.len(),
        unanswered(&victim),
        unanswered(&good),
        engine_metric(&page, "kvmesh_engine_breaker_state", &victim),
        engine_metric(&page, "kvmesh_engine_in_flight", &victim)
    );
    assert!(lost >= 1, "the hung engine got no request: {first:?}");
    assert!(refused >= 5, "{refused} bad requests refused");
    assert!(unanswered(&victim) >= 5.0, "{page}");
    assert_eq!(unanswered(&good), 0.0);
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_ejections_total", &victim),
        1.0
    );
    assert_eq!(
        engine_metric(&page, "kvmesh_engine_breaker_state", &victim),
        1.0
    );
    // From now on every request is answered.
    let after = run_load(&c, &url, &load(24), Arc::new(AtomicBool::new(false)), make).await;
    assert_eq!(failures(&after), Vec::<String>::new());
    assert!(
        after
            .iter()
            .all(|r| r.engine.as_deref() == Some(good.as_str()))
    );
    router.shutdown().await;
    clear_faults(&c, &sims[1].base_url()).await;
    stop_sims(sims).await;
}

/// A request without `stream` waits for its whole answer, so no first-byte timeout bounds it:
/// on a hung engine it used to wait out the total timeout (30 minutes by default). Now the
/// attempt is given up once the engine has been silent (nothing answered here, its token
/// counter, read from its metrics, not grown) for the first-byte timeout, and the request is
/// answered by the other engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_on_a_hung_engine_is_answered_by_another() {
    let sims = start_sims(2, |_| sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let mut cfg = serve_cfg(&engines);
    cfg.routing.policy.policy = kvmesh_policy::PolicyKind::RoundRobin;
    cfg.timeouts.first_byte_ms = 1_000;
    cfg.discovery_interval_ms = 100;
    let router = start_router_with(cfg, "test-model", 2).await;
    let (c, base) = (client(), router.base_url());
    set_faults(&c, &sims[1].base_url(), serde_json::json!({"hang": true})).await;
    let url = format!("{base}/v1/chat/completions");
    for i in 0..4 {
        let t0 = Instant::now();
        let body = chat_body("test-model", &format!("question {i}"), 8, false).to_string();
        let r = send(&c, "POST", &url, &[], body, Duration::from_secs(20)).await;
        assert!(r.ok(), "{r:?}");
        assert_eq!(r.engine.as_deref(), Some(engines[0].as_str()));
        assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    }
    let page = scrape(&c, &base).await;
    let timeouts = engine_kind_metric(&page, "kvmesh_engine_errors_total", &engines[1], "timeout");
    assert!(timeouts >= 1.0, "the hung engine was never tried: {page}");
    router.shutdown().await;
    clear_faults(&c, &sims[1].base_url()).await;
    stop_sims(sims).await;
}

/// A busy engine is not a hung one: clients that give up on requests whose long prefill
/// (about 1.9 s here, in real time) has not produced a token yet leave an engine that is
/// working — its steps show in its metrics (`vllm:iteration_tokens_total`) — so they are
/// cancels, and its breaker stays closed. (QA: with only the generated-token counter read,
/// 5 such clients opened the only engine's breaker, and every request got a 503 for 5 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_give_up_on_long_prefills_leave_the_engine_in() {
    let sims = start_sims(1, |_| {
        let mut c = sim_cfg("test-model");
        c.time_scale = 1.0;
        c
    })
    .await;
    let engines = urls(&sims);
    let mut cfg = serve_cfg(&engines);
    cfg.discovery_interval_ms = 100;
    cfg.routing.health.unanswered.after_ms = 300;
    let router = start_router_with(cfg, "test-model", 1).await;
    let (c, base) = (client(), router.base_url());
    let url = format!("{base}/v1/completions");
    let long = "word ".repeat(27_000);
    for i in 0..6 {
        let body = completion_body("test-model", &format!("{i} {long}"), 8, false);
        let r = send(
            &c,
            "POST",
            &url,
            &[],
            body.to_string(),
            Duration::from_millis(900),
        )
        .await;
        assert!(
            !r.ok(),
            "answered within 0.9 s: the prefill is not long enough here"
        );
    }
    let e = &engines[0];
    settled(&c, &base, e).await;
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_kind_metric(&page, "kvmesh_engine_errors_total", e, "unanswered"),
        0.0
    );
    assert_eq!(engine_metric(&page, "kvmesh_engine_breaker_state", e), 0.0);
    let r = post_json(&c, &url, &completion_body("test-model", "short", 4, false)).await;
    assert!(r.ok(), "{r:?}");
    router.shutdown().await;
    stop_sims(sims).await;
}

/// An engine that hangs in the middle of its answers: a client that leaves a stream after
/// a long silence counts against it (`unanswered`), and a client that waits has its stream
/// ended by the router once the engine has sent nothing for the stream idle timeout (an error
/// event; a `stream` failure), not at the total timeout. (QA: a patient client got nothing
/// for 150 s, and clients that left counted as cancels.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_engine_stops_mid_way_is_ended_and_held_against_it() {
    use http_body_util::BodyExt;
    let sims = start_sims(1, |_| sim_cfg("test-model")).await;
    let engines = urls(&sims);
    let mut cfg = serve_cfg(&engines);
    cfg.discovery_interval_ms = 100;
    cfg.routing.health.unanswered.after_ms = 300;
    cfg.timeouts.stream_idle_ms = 1_500;
    let router = start_router_with(cfg, "test-model", 1).await;
    let (c, base) = (client(), router.base_url());
    let url = format!("{base}/v1/chat/completions");
    // Opens a long stream and reads its first chunk.
    let open = |text: &'static str| {
        let c = c.clone();
        let url = url.clone();
        async move {
            let body = chat_body("test-model", text, 4_000, true).to_string();
            let req = http::Request::post(url)
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .expect("request");
            let resp = c.request(req).await.expect("head");
            assert_eq!(resp.status(), 200);
            let mut b = resp.into_body();
            let f = b.frame().await.expect("a first frame").expect("frame");
            assert!(f.is_data());
            b
        }
    };
    let sim = sims[0].base_url();
    // A client that leaves after 1 s of silence.
    let leaving = open("one").await;
    set_faults(&c, &sim, serde_json::json!({"hang": true})).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    drop(leaving);
    let e = &engines[0];
    settled(&c, &base, e).await;
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_kind_metric(&page, "kvmesh_engine_errors_total", e, "unanswered"),
        1.0
    );
    // A client that waits: ended about 1.5 s after the engine's last data, with an error.
    clear_faults(&c, &sim).await;
    let mut waiting = open("two").await;
    set_faults(&c, &sim, serde_json::json!({"hang": true})).await;
    let t0 = Instant::now();
    let mut text = String::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), waiting.frame()).await {
            Err(_) => panic!("not ended 10 s after the engine hung: {text}"),
            Ok(None) | Ok(Some(Err(_))) => break,
            Ok(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    text.push_str(&String::from_utf8_lossy(d));
                }
            }
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(text.contains("\"error\""), "{text}");
    settled(&c, &base, e).await;
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_kind_metric(&page, "kvmesh_engine_errors_total", e, "stream"),
        1.0
    );
    router.shutdown().await;
    clear_faults(&c, &sim).await;
    stop_sims(sims).await;
}

/// Waits until the router holds no request in flight on `engine`: every attempt on it
/// (those whose clients left included) has been accounted for.
async fn settled(c: &HttpClient, base: &str, engine: &str) {
    wait_until(
        "no request in flight on the engine",
        Duration::from_secs(5),
        || async {
            engine_metric(&scrape(c, base).await, "kvmesh_engine_in_flight", engine) == 0.0
        },
    )
    .await;
}
