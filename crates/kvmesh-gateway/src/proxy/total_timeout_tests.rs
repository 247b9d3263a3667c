//! The total timeout cutting a streamed answer: held against the engine only when the engine
//! had stopped sending (a stall), not when the router's budget ran out while it delivered (a
//! long generation, a slow client), which opened healthy engines' breakers.

use super::*;

/// A router over A and B with these timeouts.
fn timed(
    first_byte_ms: u64,
    stream_idle_ms: u64,
    total_ms: u64,
    mock: &Arc<MockUpstream>,
) -> Arc<Gateway> {
    let mut c = cfg();
    c.timeouts.first_byte_ms = first_byte_ms;
    c.timeouts.stream_idle_ms = stream_idle_ms;
    c.timeouts.total_ms = total_ms;
    gateway(c, mock, &[A, B])
}

/// A router over A and B, both hung, with these timeouts.
fn hung(first_byte_ms: u64, total_ms: u64) -> (Arc<Gateway>, Arc<MockUpstream>) {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::Hang);
    mock.set_default(B, MockReply::Hang);
    (timed(first_byte_ms, first_byte_ms, total_ms, &mock), mock)
}

/// A streamed answer of one event after each of `gaps`, with no end.
fn events(gaps: &[Duration]) -> MockReply {
    MockReply::Respond {
        head_after: Duration::ZERO,
        status: 200,
        chunks: gaps
            .iter()
            .map(|g| (*g, Ok(Bytes::from_static(b"data: {}\n\n"))))
            .collect(),
    }
}

/// A streamed answer of `chunks` events, one every `every`, with no end.
fn stream_of(chunks: usize, every: Duration) -> MockReply {
    events(&vec![every; chunks])
}

/// Sends a streamed request and reads its body until it ends or breaks: what the client got.
async fn stream_until_cut(gw: &Arc<Gateway>) -> String {
    let r = send_chat(gw, Bytes::from_static(STREAM_BODY.as_bytes())).await;
    assert_eq!(r.status(), 200);
    let mut body = r.into_body();
    let mut got = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        if let Ok(d) = frame.into_data() {
            got.extend_from_slice(&d);
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test(start_paused = true)]
async fn a_stream_still_delivering_at_the_total_timeout_is_not_the_engine_s_failure() {
    let mock = MockUpstream::new();
    // An event every 100 ms for a minute: the budget runs out first.
    mock.set_default(A, stream_of(600, Duration::from_millis(100)));
    mock.set_default(B, stream_of(600, Duration::from_millis(100)));
    let gw = timed(2_000, 2_000, 10_000, &mock);
    for _ in 0..6 {
        let t0 = tokio::time::Instant::now();
        let body = stream_until_cut(&gw).await;
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(10),
            "cut at the total timeout"
        );
        assert!(body.matches("data: {}").count() >= 90, "{body}");
    }
    for e in [A, B] {
        assert_eq!(errors(&gw, e, FailKind::Stream), 0, "{e}");
        assert_eq!(
            engine(&gw, e).tracker().breaker().state(gw.clock.now_us()),
            BreakerState::Closed,
            "{e}"
        );
    }
    assert_eq!(in_flight(&gw), 0);
}

/// A stream that stops in the middle (a wedged engine) is cut once the engine has sent
/// nothing for the stream idle timeout, as a stall held against the engine, not at the total
/// timeout (QA: such a stream held its client for the whole total timeout, 30 minutes by
/// default), nor at the first-byte timeout, which bounds only the wait for the first data.
#[tokio::test(start_paused = true)]
async fn a_stream_silent_for_the_stream_idle_timeout_is_cut_as_a_stall() {
    let mock = MockUpstream::new();
    // Two events, then nothing for a minute: a wedged engine.
    let stalled = events(&[
        Duration::ZERO,
        Duration::from_millis(100),
        Duration::from_secs(60),
    ]);
    mock.set_default(A, stalled.clone());
    mock.set_default(B, stalled);
    let gw = timed(1_000, 2_000, 10_000, &mock);
    let t0 = tokio::time::Instant::now();
    let body = stream_until_cut(&gw).await;
    assert_eq!(
        t0.elapsed(),
        Duration::from_millis(2_100),
        "cut a stream idle timeout after the last data"
    );
    assert_eq!(body.matches("data: {}").count(), 2, "{body}");
    assert_eq!(
        errors(&gw, A, FailKind::Stream) + errors(&gw, B, FailKind::Stream),
        1
    );
    assert_eq!(in_flight(&gw), 0);
}

/// Events with gaps shorter than the stream idle timeout (and longer than the first-byte
/// timeout) are never cut before the total timeout (the idle check moves with the data).
#[tokio::test(start_paused = true)]
async fn a_stream_with_gaps_shorter_than_the_idle_timeout_is_not_cut_early() {
    let mock = MockUpstream::new();
    // A first event at once, then one every 1.9 s.
    let mut gaps = vec![Duration::from_millis(1_900); 8];
    gaps[0] = Duration::ZERO;
    mock.set_default(A, events(&gaps));
    mock.set_default(B, events(&gaps));
    let gw = timed(1_000, 2_000, 10_000, &mock);
    let t0 = tokio::time::Instant::now();
    let body = stream_until_cut(&gw).await;
    assert_eq!(t0.elapsed(), Duration::from_secs(10), "{body}");
    assert_eq!(body.matches("data: {}").count(), 6, "{body}");
    assert_eq!(
        errors(&gw, A, FailKind::Stream) + errors(&gw, B, FailKind::Stream),
        0
    );
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test(start_paused = true)]
async fn a_whole_answer_cut_while_the_engine_generates_is_not_the_engine_s_failure() {
    let (gw, _mock) = hung(1_000, 10_000);
    // 2 s in, a scrape finds both engines' generated-token counters grown.
    let g = gw.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        for e in [A, B] {
            engine(&g, e)
                .worked_at_us
                .store(g.clock.now_us(), Ordering::Relaxed);
        }
    });
    let (status, ..) = call(&gw).await;
    assert_eq!(status, 504);
    assert_eq!(
        errors(&gw, A, FailKind::Timeout) + errors(&gw, B, FailKind::Timeout),
        0,
        "a long generation, not a failed engine"
    );
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test(start_paused = true)]
async fn a_whole_answer_is_bounded_by_the_total_timeout_and_not_tried_again() {
    let (gw, mock) = hung(1_000, 10_000);
    let t0 = tokio::time::Instant::now();
    let (status, _, body) = call(&gw).await;
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("upstream timeout"), "{body}");
    assert_eq!(t0.elapsed(), Duration::from_secs(10));
    assert_eq!(
        mock.calls().len(),
        1,
        "the total timeout is the request's, not an attempt's"
    );
    assert_eq!(
        errors(&gw, A, FailKind::Timeout) + errors(&gw, B, FailKind::Timeout),
        1
    );
    assert_eq!(in_flight(&gw), 0);
}

/// A router over A and B whose token counters are known (read once: 0 tokens), with a
/// silence limit of 1 s (first-byte timeout 1 s, discovery every 100 ms), a total of 10 s.
fn counted(mock: &Arc<MockUpstream>) -> Arc<Gateway> {
    let mut c = cfg();
    c.timeouts.first_byte_ms = 1_000;
    c.timeouts.total_ms = 10_000;
    c.discovery_interval_ms = 100;
    let gw = gateway(c, mock, &[A, B]);
    for e in [A, B] {
        engine(&gw, e)
            .work_bits
            .store(0f64.to_bits(), Ordering::Relaxed);
    }
    gw
}

/// A whole answer on an engine that hangs (it answers nothing and generates no token) is
/// given up after the silence limit and retried on the other engine, not waited for until
/// the total timeout (QA: a hung engine kept such requests for the whole 30 minutes).
#[tokio::test(start_paused = true)]
async fn a_whole_answer_on_a_silent_engine_is_retried_elsewhere() {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::Hang);
    mock.set_default(B, MockReply::ok(200, r#"{"ok":true}"#));
    let gw = counted(&mock);
    let t0 = tokio::time::Instant::now();
    let (status, _, body) = a_first(&gw, call(&gw)).await;
    assert_eq!(status, 200, "{body}");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(1) && took <= Duration::from_millis(1_300),
        "{took:?}"
    );
    assert_eq!(calls_to(&mock, A), 1);
    assert_eq!(calls_to(&mock, B), 1);
    assert_eq!(errors(&gw, A, FailKind::Timeout), 1);
    assert_eq!(in_flight(&gw), 0);
}

/// An engine seen working meanwhile — its token counter grew at a scrape, or it answered
/// another request at this router — is not silent: the whole answer is waited for until the
/// total timeout, as before; so is an engine whose counter is unknown (the tests above).
#[tokio::test(start_paused = true)]
async fn a_whole_answer_on_a_working_engine_is_waited_for() {
    for by_answer in [false, true] {
        let mock = MockUpstream::new();
        mock.set_default(A, MockReply::Hang);
        mock.set_default(B, MockReply::Hang);
        let gw = counted(&mock);
        let g = gw.clone();
        let work = tokio::spawn(async move {
            for _ in 0..40 {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let now = g.clock.now_us();
                for e in [A, B] {
                    let e = engine(&g, e);
                    if by_answer {
                        e.tracker().on_first_byte(now, 100_000);
                    } else {
                        e.worked_at_us.store(now, Ordering::Relaxed);
                    }
                }
            }
        });
        let t0 = tokio::time::Instant::now();
        let (status, ..) = call(&gw).await;
        assert_eq!(status, 504, "by answer: {by_answer}");
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(10),
            "by answer: {by_answer}"
        );
        assert_eq!(mock.calls().len(), 1, "by answer: {by_answer}");
        work.abort();
        assert_eq!(in_flight(&gw), 0);
    }
}

/// Reads `n` data frames of a streamed answer, waits `then`, and leaves (drops the body).
async fn read_then_leave(gw: &Arc<Gateway>, n: usize, then: Duration) {
    let r = send_chat(gw, Bytes::from_static(STREAM_BODY.as_bytes())).await;
    assert_eq!(r.status(), 200);
    let mut body = r.into_body();
    let mut got = 0;
    while got < n {
        match body.frame().await {
            Some(Ok(f)) if f.is_data() => got += 1,
            Some(Ok(_)) => {}
            other => panic!("the stream ended after {got} frames: {other:?}"),
        }
    }
    tokio::time::sleep(then).await;
    drop(body);
}

/// A client that leaves a stream after 2 s of silence: held against an engine that had kept
/// a pace of 0.1 s between events (it stopped), not against one whose events come every
/// 1.7 s (it is slow, and working: QA saw such engines counted as unanswered).
#[tokio::test(start_paused = true)]
async fn leaving_a_stream_counts_only_a_silence_beyond_its_pace() {
    for (every, held) in [
        (Duration::from_millis(1_700), 0),
        (Duration::from_millis(100), 1),
    ] {
        let mock = MockUpstream::new();
        // Three events at the pace, then nothing for a minute.
        let reply = events(&[Duration::ZERO, every, every, Duration::from_secs(60)]);
        mock.set_default(A, reply.clone());
        mock.set_default(B, reply);
        let gw = timed(20_000, 20_000, 120_000, &mock);
        read_then_leave(&gw, 3, Duration::from_secs(2)).await;
        // The body is dropped with the response: give the drop its turn.
        tokio::task::yield_now().await;
        let unanswered =
            errors(&gw, A, FailKind::Unanswered) + errors(&gw, B, FailKind::Unanswered);
        assert_eq!(unanswered, held, "events every {every:?}");
        assert_eq!(in_flight(&gw), 0);
    }
}
