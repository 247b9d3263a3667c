//! The total timeout cutting a streamed answer: held against the engine only when the engine
//! had stopped sending (a stall), not when the router's budget ran out while it delivered (a
//! long generation, a slow client), which opened healthy engines' breakers.

use super::*;

/// A router over A and B with these timeouts.
fn timed(first_byte_ms: u64, total_ms: u64, mock: &Arc<MockUpstream>) -> Arc<Gateway> {
    let mut c = cfg();
    c.timeouts.first_byte_ms = first_byte_ms;
    c.timeouts.total_ms = total_ms;
    gateway(c, mock, &[A, B])
}

/// A router over A and B, both hung, with these timeouts.
fn hung(first_byte_ms: u64, total_ms: u64) -> (Arc<Gateway>, Arc<MockUpstream>) {
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::Hang);
    mock.set_default(B, MockReply::Hang);
    (timed(first_byte_ms, total_ms, &mock), mock)
}

/// A streamed answer of `chunks` events, one every `every`, with no end.
fn stream_of(chunks: usize, every: Duration) -> MockReply {
    MockReply::Respond {
        head_after: Duration::ZERO,
        status: 200,
        chunks: (0..chunks)
            .map(|_| (every, Ok(Bytes::from_static(b"data: {}\n\n"))))
            .collect(),
    }
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
    let gw = timed(2_000, 10_000, &mock);
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

#[tokio::test(start_paused = true)]
async fn a_stream_silent_for_a_first_byte_timeout_at_the_total_timeout_is_a_stall() {
    let mock = MockUpstream::new();
    // Two events, then nothing for a minute: a wedged engine.
    let stalled = MockReply::Respond {
        head_after: Duration::ZERO,
        status: 200,
        chunks: vec![
            (Duration::ZERO, Ok(Bytes::from_static(b"data: {}\n\n"))),
            (
                Duration::from_millis(100),
                Ok(Bytes::from_static(b"data: {}\n\n")),
            ),
            (
                Duration::from_secs(60),
                Ok(Bytes::from_static(b"data: {}\n\n")),
            ),
        ],
    };
    mock.set_default(A, stalled.clone());
    mock.set_default(B, stalled);
    let gw = timed(2_000, 10_000, &mock);
    let t0 = tokio::time::Instant::now();
    let body = stream_until_cut(&gw).await;
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(10),
        "cut at the total timeout"
    );
    assert_eq!(body.matches("data: {}").count(), 2, "{body}");
    assert_eq!(
        errors(&gw, A, FailKind::Stream) + errors(&gw, B, FailKind::Stream),
        1
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
                .generated_at_us
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
