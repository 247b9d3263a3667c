//! The request path on tokio's paused time with a scripted upstream: retry, breaker, budget,
//! timeout and cancellation verdicts, without sockets or sleeps in real time.

use super::*;
use crate::engine::Source;
use crate::gateway::Gateway;
use crate::upstream::{MockReply, MockUpstream};
use http::StatusCode;
use kvmesh_config::{EngineEntry, ServeConfig};
use kvmesh_policy::{BreakerState, PolicyKind};

const A: &str = "127.0.0.1:9";
const B: &str = "127.0.0.2:9";
const C: &str = "127.0.0.3:9";

fn cfg() -> ServeConfig {
    let mut c = ServeConfig {
        seed: 42,
        ..ServeConfig::default()
    };
    c.routing.policy.policy = PolicyKind::LeastRequest;
    c.routing.health.active.enabled = false;
    c
}

/// A router over `engines` (no task started, nothing listens: the mock answers).
fn gateway(c: ServeConfig, mock: &Arc<MockUpstream>, engines: &[&str]) -> Arc<Gateway> {
    let gw = Arc::new(Gateway::new(c, Some(mock.clone())));
    for a in engines {
        let e = EngineEntry {
            url: format!("http://{a}"),
            models: vec!["m".into()],
            ..EngineEntry::default()
        };
        gw.registry
            .add(&e, Source::Static, false)
            .expect("add engine");
    }
    gw
}

fn engine(gw: &Gateway, a: &str) -> Arc<Engine> {
    gw.registry
        .get(kvmesh_prefix::EngineId::from_url(&format!("http://{a}")))
        .expect("engine")
}

const BODY: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;

/// Sends one chat request with `body`; the response head and its streaming body.
async fn send_chat(gw: &Arc<Gateway>, body: Bytes) -> Response<Body> {
    let (parts, ()) = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("origin", "https://app.example.com")
        .body(())
        .expect("request")
        .into_parts();
    handle(gw, &parts, body, &HeaderValue::from_static("rid")).await
}

/// The same request with its answer streamed.
const STREAM_BODY: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}"#;

/// Sends one chat request and reads the whole answer.
async fn call(gw: &Arc<Gateway>) -> (u16, HeaderMap, String) {
    call_with(gw, BODY).await
}

/// Sends one chat request with `body` and reads the whole answer.
async fn call_with(gw: &Arc<Gateway>, body: &'static str) -> (u16, HeaderMap, String) {
    let r = send_chat(gw, Bytes::from_static(body.as_bytes())).await;
    let (p, b) = r.into_parts();
    let bytes = b.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    (
        p.status.as_u16(),
        p.headers,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

/// Runs `f` (a request) while B looks 5 requests busier, so that least request tries A first.
async fn a_first<T>(gw: &Gateway, f: impl std::future::Future<Output = T>) -> T {
    engine(gw, B).in_flight.fetch_add(5, Ordering::Relaxed);
    let out = f.await;
    engine(gw, B).in_flight.fetch_sub(5, Ordering::Relaxed);
    out
}

/// The engine the last attempt went to.
fn last_tried(mock: &MockUpstream) -> String {
    let calls = mock.calls();
    calls.last().expect("attempts were sent").authority.clone()
}

fn calls_to(mock: &MockUpstream, a: &str) -> usize {
    mock.calls().iter().filter(|c| c.authority == a).count()
}

fn errors(gw: &Gateway, a: &str, k: FailKind) -> u64 {
    engine(gw, a).metrics.errors[k.index()].load(Ordering::Relaxed)
}

fn in_flight(gw: &Gateway) -> u32 {
    gw.registry
        .members()
        .iter()
        .map(|e| e.in_flight.load(Ordering::Relaxed))
        .sum()
}

#[path = "proxy/body_tests.rs"]
mod body;
#[path = "proxy/error_answer_tests.rs"]
mod error_answer;
#[path = "proxy/events_status_tests.rs"]
mod events_status;
#[path = "proxy/model_tests.rs"]
mod model;
#[path = "proxy/total_timeout_tests.rs"]
mod total_timeout;

#[tokio::test(start_paused = true)]
async fn a_5xx_is_retried_on_another_engine_and_counted_against_the_first() {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(500, "boom"));
    mock.set_default(B, MockReply::ok(200, "{\"ok\":1}"));
    mock.set_default(C, MockReply::ok(200, "{\"ok\":1}"));
    let gw = gateway(cfg(), &mock, &[A, B, C]);
    for _ in 0..30 {
        let (status, h, body) = call(&gw).await;
        assert_eq!(status, 200, "{body}");
        assert_ne!(h["x-kvmesh-engine"], "http://127.0.0.1:9");
        assert_eq!(in_flight(&gw), 0);
    }
    let to_a = calls_to(&mock, A);
    assert!(to_a >= 1, "least_request reaches A at least once");
    assert_eq!(errors(&gw, A, FailKind::Status5xx), to_a as u64);
    assert_eq!(
        gw.metrics.retries.get(),
        to_a as u64,
        "each failure on A cost exactly one retry"
    );
}

#[tokio::test(start_paused = true)]
async fn consecutive_failures_open_the_breaker_then_a_probe_after_the_open_period() {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ConnectError);
    mock.set_default(B, MockReply::ok(200, "{}"));
    mock.set_default(C, MockReply::ok(200, "{}"));
    // Round robin keeps offering A its turn (least_request would already steer away from it:
    // failures lower its automatic weight).
    let mut c = cfg();
    c.routing.policy.policy = PolicyKind::RoundRobin;
    let gw = gateway(c, &mock, &[A, B, C]);
    let mut n = 0;
    while !engine(&gw, A).tracker().breaker().is_ejected() {
        assert_eq!(call(&gw).await.0, 200);
        n += 1;
        assert!(n < 500, "the breaker never opened");
    }
    assert_eq!(
        errors(&gw, A, FailKind::Connect),
        5,
        "opens at the 5th failure"
    );
    let before = calls_to(&mock, A);
    for _ in 0..50 {
        assert_eq!(call(&gw).await.0, 200);
    }
    assert_eq!(
        calls_to(&mock, A),
        before,
        "an open breaker gets no traffic"
    );
    // After the open period, one half-open probe goes to A (and fails again).
    tokio::time::advance(Duration::from_millis(5_100)).await;
    for _ in 0..50 {
        assert_eq!(call(&gw).await.0, 200);
    }
    assert_eq!(calls_to(&mock, A), before + 1, "exactly one probe");
    assert!(matches!(
        engine(&gw, A).tracker().breaker().state(gw.clock.now_us()),
        BreakerState::Open { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn an_empty_retry_budget_returns_the_engines_own_error() {
    let mut c = cfg();
    c.routing.retry_budget.ratio = 0.0;
    c.routing.retry_budget.min_per_second = 0.0;
    c.routing.retry_budget.max_tokens = 0.0;
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(503, "{\"error\":\"engine busy\"}"));
    mock.set_default(B, MockReply::ok(503, "{\"error\":\"engine busy\"}"));
    let gw = gateway(c, &mock, &[A, B]);
    let (status, _, body) = call(&gw).await;
    assert_eq!(status, 503);
    assert_eq!(
        body, "{\"error\":\"engine busy\"}",
        "passed through as it was"
    );
    assert_eq!(mock.calls().len(), 1, "no retry without budget");
    assert_eq!(gw.metrics.budget_exhausted.get(), 1);
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test(start_paused = true)]
async fn a_hung_engine_times_out_and_the_retry_succeeds_after_a_backoff() {
    let mut c = cfg();
    c.timeouts.first_byte_ms = 2_000;
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::Hang);
    mock.set_default(B, MockReply::ok(200, "{}"));
    let gw = gateway(c, &mock, &[A, B]);
    let t0 = tokio::time::Instant::now();
    let (status, ..) = a_first(&gw, call_with(&gw, STREAM_BODY)).await;
    assert_eq!(status, 200);
    assert_eq!(errors(&gw, A, FailKind::Timeout), 1);
    // Virtual time: the first-byte timeout, then the first backoff (10 ms ± 20%).
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(2_008), "{waited:?}");
    assert!(waited <= Duration::from_millis(2_013), "{waited:?}");
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test(start_paused = true)]
async fn every_engine_timing_out_is_a_504_and_refusing_is_a_502() {
    let mut c = cfg();
    c.timeouts.first_byte_ms = 1_000;
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::Hang);
    mock.set_default(B, MockReply::Hang);
    let gw = gateway(c.clone(), &mock, &[A, B]);
    let (status, h, body) = call_with(&gw, STREAM_BODY).await;
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("upstream timeout"), "{body}");
    // The router's own error names the engine whose failure it reports (the last tried).
    assert_eq!(
        h["x-kvmesh-engine"],
        engine(&gw, &last_tried(&mock)).header_value
    );
    let mock = MockUpstream::new();
    let gw = gateway(c, &mock, &[A, B]);
    let (status, h, body) = call(&gw).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("\"error\""), "OpenAI-shaped: {body}");
    assert_eq!(
        h["x-kvmesh-engine"],
        engine(&gw, &last_tried(&mock)).header_value
    );
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test(start_paused = true)]
async fn a_whole_answer_is_waited_for_past_the_first_byte_timeout() {
    // Without `stream`, the engine answers once the generation ends: a long generation is
    // not a hung engine.
    let mut c = cfg();
    c.timeouts.first_byte_ms = 2_000;
    let mock = MockUpstream::new();
    let late = MockReply::Respond {
        head_after: Duration::from_secs(30),
        status: 200,
        chunks: vec![(Duration::ZERO, Ok(Bytes::from_static(b"{}")))],
    };
    mock.set_default(A, late.clone());
    mock.set_default(B, late);
    let gw = gateway(c, &mock, &[A, B]);
    let t0 = tokio::time::Instant::now();
    let (status, _, body) = call(&gw).await;
    assert_eq!((status, body.as_str()), (200, "{}"));
    assert_eq!(t0.elapsed(), Duration::from_secs(30));
    assert_eq!(mock.calls().len(), 1, "not started over on another engine");
    assert_eq!(
        errors(&gw, A, FailKind::Timeout) + errors(&gw, B, FailKind::Timeout),
        0
    );
    // Streamed, the same engine is given the first-byte timeout.
    let (status, ..) = call_with(&gw, STREAM_BODY).await;
    assert_eq!(status, 504);
    assert_eq!(
        errors(&gw, A, FailKind::Timeout) + errors(&gw, B, FailKind::Timeout),
        2
    );
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test(start_paused = true)]
async fn a_429_is_retried_elsewhere_but_never_opens_the_breaker() {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(429, "slow down"));
    mock.set_default(B, MockReply::ok(200, "{}"));
    let gw = gateway(cfg(), &mock, &[A, B]);
    for _ in 0..40 {
        // 100 ms between requests: the budget's floor (10/s) pays each retry.
        tokio::time::advance(Duration::from_millis(100)).await;
        let (status, ..) = a_first(&gw, call(&gw)).await;
        assert_eq!(status, 200);
    }
    assert_eq!(errors(&gw, A, FailKind::Status429), 40);
    assert_eq!(
        engine(&gw, A).tracker().breaker().state(gw.clock.now_us()),
        BreakerState::Closed,
        "busy is not broken"
    );
}

#[tokio::test(start_paused = true)]
async fn hidden_engine_urls_name_the_engine_by_its_id() {
    let mut c = cfg();
    c.hide_engine_urls = true;
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(200, "{}"));
    let gw = gateway(c, &mock, &[A]);
    let (_, h, _) = call(&gw).await;
    let id = kvmesh_prefix::EngineId::from_url("http://127.0.0.1:9").to_string();
    assert_eq!(h["x-kvmesh-engine"], id.as_str());
    assert_eq!(mock.calls()[0].headers["x-request-id"], "rid");
    // Cross-origin answers are the router's to allow: an engine is not shown the origin
    // (vLLM allows any by default and would say so to the browser).
    assert!(mock.calls()[0].headers.get("origin").is_none());
    // Nor do error answers name it by its address (found by QA: they did).
    let mut c = cfg();
    c.hide_engine_urls = true;
    let mock = MockUpstream::new();
    let gw = gateway(c, &mock, &[A]);
    let (status, _, body) = call(&gw).await;
    assert_eq!(status, 502, "{body}");
    assert!(!body.contains("127.0.0.1"), "{body}");
    assert!(
        body.contains(&format!("engine {id}: could not connect")),
        "{body}"
    );
}

#[tokio::test(start_paused = true)]
async fn metrics_render_the_counters_the_request_path_touched() {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(500, "boom"));
    mock.set_default(B, MockReply::ok(200, "{}"));
    let mut c = cfg();
    c.routing.policy.policy = PolicyKind::RoundRobin;
    let gw = gateway(c, &mock, &[A, B]);
    // Streamed: a whole answer has no time to first token.
    for _ in 0..4 {
        assert_eq!(call_with(&gw, STREAM_BODY).await.0, 200);
    }
    let text = gw.metrics.render(&gw.registry, gw.clock.now_us());
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` in\n{text}"))
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .expect("a value")
    };
    assert_eq!(
        line("kvmesh_requests_total "),
        0.0,
        "counted by `inference`, not `handle`"
    );
    let to_a = calls_to(&mock, A) as f64;
    assert_eq!(line("kvmesh_retries_total "), to_a);
    assert_eq!(
        line("kvmesh_engine_errors_total{engine=\"http://127.0.0.1:9\",kind=\"5xx\"}"),
        to_a
    );
    assert_eq!(
        line(
            "kvmesh_routing_decisions_total{model=\"m\",policy=\"round_robin\",reason=\"round_robin\"}"
        ),
        4.0
    );
    assert_eq!(
        line("kvmesh_engine_in_flight{engine=\"http://127.0.0.2:9\"}"),
        0.0
    );
    assert_eq!(line("kvmesh_routing_decision_seconds_count "), 4.0);
    assert!(
        text.contains(
            "kvmesh_engine_ttft_seconds_bucket{le=\"+Inf\",engine=\"http://127.0.0.2:9\"} 4"
        ),
        "{text}"
    );
    assert!(
        text.contains("# TYPE kvmesh_engine_requests counter"),
        "{text}"
    );
    assert!(text.ends_with("# EOF\n"), "OpenMetrics ends with EOF");
}

/// A recording sink the test keeps a handle on.
struct Shared(Arc<std::sync::Mutex<kvmesh_prefix::RecordingSink>>);

impl kvmesh_prefix::IndexSink for Shared {
    fn apply_batch(
        &mut self,
        t: kvmesh_prefix::Target,
        v: kvmesh_prefix::OpVersion,
        ops: &[kvmesh_prefix::IndexOp],
    ) -> bool {
        self.0.lock().expect("sink").apply_batch(t, v, ops)
    }
    fn mark(
        &mut self,
        t: kvmesh_prefix::Target,
        k: &[kvmesh_prefix::BlockKey],
        known: usize,
        e: u64,
        n: u64,
    ) {
        self.0.lock().expect("sink").mark(t, k, known, e, n)
    }
    fn clear(&mut self, t: kvmesh_prefix::Target) {
        self.0.lock().expect("sink").clear(t)
    }
}

#[tokio::test(start_paused = true)]
async fn every_mark_of_a_cache_aware_decision_reaches_the_delta_sink() {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(200, "{}"));
    mock.set_default(B, MockReply::ok(200, "{}"));
    let mut c = cfg();
    c.routing.policy.policy = PolicyKind::CacheAware;
    let gw = gateway(c, &mock, &[A, B]);
    let rec = Arc::new(std::sync::Mutex::new(
        kvmesh_prefix::RecordingSink::default(),
    ));
    gw.registry
        .prefix
        .set_delta_sink(Some(Box::new(Shared(rec.clone()))));
    let long = "a shared system prompt long enough for several blocks ".repeat(20);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"hi"}}],"max_tokens":2}}"#
    );
    let mut engines = Vec::new();
    for _ in 0..3 {
        let r = send_chat(&gw, Bytes::from(body.clone())).await;
        assert_eq!(r.status(), 200);
        engines.push(r.headers()["x-kvmesh-engine"].clone());
    }
    assert!(
        engines.iter().all(|e| *e == engines[0]),
        "one engine: {engines:?}"
    );
    let calls = rec.lock().expect("sink").calls.clone();
    assert_eq!(calls.len(), 3, "one mark per decision: {calls:?}");
    let chosen = engine(
        &gw,
        if engines[0] == "http://127.0.0.1:9" {
            A
        } else {
            B
        },
    );
    for call in &calls {
        match call {
            kvmesh_prefix::SinkCall::Mark { target, keys, .. } => {
                assert_eq!(*target, chosen.target());
                assert!(keys.len() >= 10, "the prompt's blocks: {}", keys.len());
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // The first decision found no holder (exclusive path), the next two a match.
    let text = gw.metrics.render(&gw.registry, gw.clock.now_us());
    assert!(text.contains("reason=\"prefix_match\"} 2"), "{text}");
}

/// An engine's report counts the requests the mesh knows of (ours and the peers') as of
/// when it was read; those that ended since are not phantom load: only the part no router
/// knows of stays (here 2 of another client), on top of the counts now.
#[test]
fn reported_load_replaces_the_mesh_s_requests_by_their_counts_now() {
    let mock = MockUpstream::new();
    let gw = gateway(cfg(), &mock, &[A]);
    let e = engine(&gw, A);
    e.in_flight.store(3, Ordering::Relaxed);
    e.peer_in_flight.store(5, Ordering::Relaxed);
    // Read while 3 of ours and 5 of the peers' ran, plus 2 of somebody else's.
    e.set_reported(Some(7), Some(3), None, 3, 5);
    assert_eq!(e.reported_load(), Some(10));
    // The peers' 5 ended (gossiped), one of ours too: 2 unknown + 2 ours + 0 peers'.
    e.peer_in_flight.store(0, Ordering::Relaxed);
    e.in_flight.store(2, Ordering::Relaxed);
    assert_eq!(e.reported_load(), Some(4));
    assert_eq!(e.view(0, 0.0).load(), 4);
    // Without a mesh the peers count 0: the others' load as reported stays.
    e.set_reported(Some(6), Some(0), None, 2, 0);
    assert_eq!(e.reported_load(), Some(6));
    // A page without vLLM's gauges (SGLang, another router): the load is unknown, and the
    // engine's view is its counts alone (QA: it read 4,294,967,294 and was never chosen).
    e.set_reported(None, None, None, 2, 0);
    assert_eq!(e.reported_load(), None);
    assert_eq!(e.view(0, 0.0).load(), 2);
}

/// In-flight changes reach the mesh's listener once per engine until it reads the count,
/// and a change after its read is signalled again.
#[tokio::test]
async fn in_flight_changes_are_signalled_once_until_read() {
    let mock = MockUpstream::new();
    let gw = gateway(cfg(), &mock, &[A, B]);
    let (a, b) = (engine(&gw, A), engine(&gw, B));
    a.begin_request(); // nobody listens yet: nothing queued
    let mut rx = gw.registry.load_signal.connect().expect("first listener");
    assert!(gw.registry.load_signal.connect().is_none());
    a.begin_request();
    a.begin_request();
    b.begin_request();
    assert_eq!(rx.try_recv().ok(), Some(a.id.0));
    assert_eq!(rx.try_recv().ok(), Some(b.id.0));
    assert!(rx.try_recv().is_err(), "one entry per engine until read");
    assert_eq!(a.read_load_change(), 3);
    a.end_request();
    assert_eq!(rx.try_recv().ok(), Some(a.id.0));
    assert_eq!(a.read_load_change(), 2);
    assert!(rx.try_recv().is_err());
}

/// An engine removed while requests to it run, then added again (found by QA: the router's
/// total forgot them, and the engine came back counted at 0 while they still ran).
#[tokio::test(start_paused = true)]
async fn an_engine_removed_and_added_again_keeps_the_count_of_its_running_requests() {
    let mock = MockUpstream::new();
    let slow = MockReply::Respond {
        head_after: Duration::ZERO,
        status: 200,
        chunks: vec![
            (Duration::ZERO, Ok(Bytes::from_static(b"data: 1\n\n"))),
            (
                Duration::from_secs(10),
                Ok(Bytes::from_static(b"data: [DONE]\n\n")),
            ),
        ],
    };
    mock.set_default(A, slow);
    let gw = gateway(cfg(), &mock, &[A]);
    let mut rx = gw.registry.load_signal.connect().expect("listener");
    let body = Bytes::from_static(STREAM_BODY.as_bytes());
    let (r1, r2) = tokio::join!(send_chat(&gw, body.clone()), send_chat(&gw, body));
    assert_eq!((r1.status(), r2.status()), (StatusCode::OK, StatusCode::OK));
    assert_eq!(gw.registry.load_signal.total(), 2);
    let old = engine(&gw, A);
    assert_eq!(old.read_load_change(), 2);
    while rx.try_recv().is_ok() {}
    gw.registry.remove(&format!("http://{A}")).expect("removed");
    assert_eq!(gw.registry.load_signal.total(), 2, "still running");
    let e = EngineEntry {
        url: format!("http://{A}"),
        models: vec!["m".into()],
        ..EngineEntry::default()
    };
    let again = gw
        .registry
        .add(&e, Source::Admin, false)
        .expect("added again");
    assert!(!Arc::ptr_eq(&old, &again));
    assert_eq!(
        again.in_flight.load(Ordering::SeqCst),
        2,
        "its requests still run"
    );
    assert_eq!(rx.try_recv().ok(), Some(again.id.0), "the mesh hears of it");
    assert_eq!(again.read_load_change(), 2);
    // Once more (found by QA: the second time the count was lost).
    gw.registry
        .remove(&format!("http://{A}"))
        .expect("removed again");
    drop(again);
    let again = gw
        .registry
        .add(&e, Source::Admin, false)
        .expect("added a third time");
    assert_eq!(again.in_flight.load(Ordering::SeqCst), 2, "still running");
    assert_eq!(rx.try_recv().ok(), Some(again.id.0));
    assert_eq!(again.read_load_change(), 2);
    // An attempt decided before the removal may still begin (and end) on the first engine:
    // it is counted where decisions read.
    old.begin_request();
    assert_eq!(again.in_flight.load(Ordering::SeqCst), 3);
    old.end_request();
    assert_eq!(again.in_flight.load(Ordering::SeqCst), 2);
    assert_eq!(gw.registry.load_signal.total(), 2);
    // The requests end on the removed engine; the count they end is the one decisions read.
    drop(old);
    let (b1, b2) = tokio::join!(r1.into_body().collect(), r2.into_body().collect());
    assert!(b1.is_ok() && b2.is_ok());
    assert_eq!(again.in_flight.load(Ordering::SeqCst), 0);
    assert_eq!(gw.registry.load_signal.total(), 0);
    assert_eq!(rx.try_recv().ok(), Some(again.id.0), "and of their end");
    assert_eq!(again.read_load_change(), 0);
}

/// A reservation hands its count to the first attempt on its engine: the count does not
/// move (one change for the mesh per request start, no moment counted twice); an attempt on
/// another engine ends it.
#[tokio::test]
async fn a_reservation_hands_its_count_to_the_attempt_on_its_engine() {
    let gw = gateway(cfg(), &MockUpstream::new(), &[A, B]);
    let (a, b) = (engine(&gw, A), engine(&gw, B));
    let mut rx = gw.registry.load_signal.connect().expect("listener");
    let r = Reservation::new(a.clone());
    assert_eq!(rx.try_recv().ok(), Some(a.id.0));
    assert_eq!(a.read_load_change(), 1);
    assert!(r.hand_over(&a));
    assert_eq!(
        a.in_flight.load(Ordering::SeqCst),
        1,
        "counted, now as the attempt"
    );
    assert!(rx.try_recv().is_err(), "no change to tell");
    let r = Reservation::new(a.clone());
    assert_eq!(rx.try_recv().ok(), Some(a.id.0));
    assert_eq!(a.read_load_change(), 2);
    assert!(!r.hand_over(&b));
    assert_eq!(
        a.in_flight.load(Ordering::SeqCst),
        1,
        "ended on the other engine"
    );
    assert_eq!(rx.try_recv().ok(), Some(a.id.0));
    assert_eq!(a.read_load_change(), 1);
    assert_eq!(b.in_flight.load(Ordering::SeqCst), 0);
    a.end_request();
    assert_eq!(in_flight(&gw), 0);
}

/// A long prompt is prepared off the runtime's threads: with the runtime's only thread free,
/// a small request is served from start to end while a 128 KB prompt is held between its
/// preparation and its decision; then the long one is routed as well, with the same keys as
/// inline preparation gives.
#[tokio::test(flavor = "current_thread")]
async fn a_small_request_is_served_while_a_long_prompt_is_prepared() {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(200, "{}"));
    let mut c = cfg();
    c.routing.policy.policy = PolicyKind::CacheAware;
    let gw = gateway(c, &mock, &[A]);
    let state = gw.registry.prefix.clone();
    let long = "A long agentic prompt with tool output and code. ".repeat(2700);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"go"}}],"max_tokens":2}}"#
    );
    assert!(body.len() >= state.config().offload_prepare_bytes);
    state.hold_offloaded(true);
    let big = tokio::spawn({
        let gw = gw.clone();
        let body = Bytes::from(body.clone());
        async move { send_chat(&gw, body).await.status() }
    });
    // Condition, not time: the long prompt is prepared and waiting in the hook. (The bound
    // only turns a broken offload — preparation on this very thread — into a failure
    // instead of a hang.)
    let mut turns = 0;
    while state.held_prepares() == 0 {
        turns += 1;
        assert!(
            turns < 60_000,
            "the long prompt never reached the blocking pool"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (status, _, _) = call(&gw).await;
    assert_eq!(status, 200);
    assert_eq!(
        state.held_prepares(),
        1,
        "still held while the small one was served"
    );
    assert!(!big.is_finished());
    state.hold_offloaded(false);
    assert_eq!(big.await.expect("joined"), 200);
    // The keys prepared on the pool (forced there: any length) are the inline ones.
    let rp = gw.registry.snapshot().routes["m"]
        .prefix
        .clone()
        .expect("cache-aware route");
    let parsed = prefix::ParsedRequest::parse(Endpoint::Chat, body.as_bytes()).expect("parsed");
    let (_, off) = prefix::prompt_keys_offloaded(&state, &rp, parsed, usize::MAX).await;
    let off = off.expect("offloaded");
    let inline = prefix::with_scratch(|s| {
        let parsed = prefix::ParsedRequest::parse(Endpoint::Chat, body.as_bytes()).expect("parsed");
        prefix::prompt_keys(&state, &rp, &parsed, s).map(|l| (l.total_blocks, s.keys.clone()))
    });
    let (blocks, keys) = inline.expect("prepared");
    assert_eq!(off.keys, keys);
    assert_eq!(off.lookup.map(|l| l.total_blocks), Some(blocks));
    assert!(blocks > 1000);
}

/// Records what the decision observer is told.
#[derive(Default)]
struct Seen(std::sync::Mutex<Vec<(String, kvmesh_policy::Reason, bool, u32)>>);

impl crate::gateway::DecisionObserver for Seen {
    fn decided(
        &self,
        engines: &[Arc<Engine>],
        chosen: usize,
        reason: kvmesh_policy::Reason,
        _now_us: u64,
        reserved: bool,
    ) {
        let e = &engines[chosen];
        let n = e.in_flight.load(Ordering::SeqCst);
        self.0
            .lock()
            .unwrap()
            .push((e.url.clone(), reason, reserved, n));
    }
}

/// The observer is told each decision once, with the engine the request then went to and the
/// reservation already counted on it.
#[tokio::test(start_paused = true)]
async fn the_decision_observer_sees_each_decision_with_its_reservation() {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(200, "{\"ok\":1}"));
    mock.set_default(B, MockReply::ok(200, "{\"ok\":1}"));
    let gw = gateway(cfg(), &mock, &[A, B]);
    let seen = Arc::new(Seen::default());
    assert!(gw.decision_observer.set(seen.clone()).is_ok());
    // B busier: least request picks A.
    engine(&gw, B).in_flight.store(3, Ordering::SeqCst);
    let (status, _, _) = call(&gw).await;
    assert_eq!(status, 200);
    let got = seen.0.lock().unwrap().clone();
    assert_eq!(
        got,
        vec![(
            format!("http://{A}"),
            kvmesh_policy::Reason::LeastLoad,
            true,
            1
        )]
    );
    assert_eq!(mock.calls().len(), 1);
    assert_eq!(mock.calls()[0].authority, A);
}

/// The automatic weight an engine has now, against the router's current fleet reference.
fn weight(gw: &Gateway, a: &str) -> f64 {
    engine(gw, a)
        .view(gw.clock.now_us(), gw.registry.fleet_latency_us())
        .weight
}

#[tokio::test(start_paused = true)]
async fn a_slowdown_of_the_whole_fleet_derates_no_engine_once_the_reference_follows() {
    let mock = MockUpstream::new();
    let gw = gateway(cfg(), &mock, &[A, B, C]);
    // Every engine answers as the initial values say (200 ms to the first byte): the
    // reference.
    let now = gw.clock.now_us();
    for a in [A, B, C] {
        engine(&gw, a).tracker().on_first_byte(now, 200_000);
    }
    gw.registry.refresh_fleet_latency();
    assert_eq!(weight(&gw, A), 1.0);
    // Every engine answers its first byte 2 s late (a burst queued on the whole fleet).
    let now = gw.clock.now_us();
    for a in [A, B, C] {
        engine(&gw, a).tracker().on_first_byte(now, 2_000_000);
    }
    // Against the reference from before, each looks 5.5 × slower than the median.
    assert!(weight(&gw, A) < 0.3, "{}", weight(&gw, A));
    crate::spawn_reference_refresh(&gw);
    let every = gw.cfg.routing.health.auto_weight.reference_refresh_ms;
    tokio::time::sleep(Duration::from_millis(every + 1)).await;
    for a in [A, B, C] {
        assert_eq!(weight(&gw, a), 1.0, "{a} after one refresh period");
    }
    // One engine slower than the rest still loses weight.
    let now = gw.clock.now_us();
    engine(&gw, A).tracker().on_first_byte(now, 10_000_000);
    tokio::time::sleep(Duration::from_millis(every + 1)).await;
    assert!(weight(&gw, A) < 0.5, "{}", weight(&gw, A));
    assert_eq!(weight(&gw, B), 1.0);
    gw.tasks.shutdown(Duration::from_secs(1)).await;
}
