//! The engine's body streamed through to the client (`TrackedBody`): cancellation when the
//! client leaves, a break mid-stream, coalescing of the frames already there, and the end of
//! the count at the stream's end — on tokio's paused time with a scripted upstream.

use super::*;

/// A streamed reply: the head after `head_ms`, each chunk after its delay (ms), then, if
/// given, an error after its delay (the body breaks there).
fn scripted(head_ms: u64, chunks: &[(u64, &str)], error: Option<(u64, &str)>) -> MockReply {
    let mut script: Vec<(Duration, Result<Bytes, String>)> = chunks
        .iter()
        .map(|(ms, s)| {
            (
                Duration::from_millis(*ms),
                Ok(Bytes::copy_from_slice(s.as_bytes())),
            )
        })
        .collect();
    if let Some((ms, e)) = error {
        script.push((Duration::from_millis(ms), Err(e.into())));
    }
    MockReply::Respond {
        head_after: Duration::from_millis(head_ms),
        status: 200,
        chunks: script,
    }
}

/// A streamed reply: the head at once, each chunk after its delay (ms).
fn stream_reply(chunks: &[(u64, &str)]) -> MockReply {
    scripted(0, chunks, None)
}

fn data(f: Option<Result<hyper::body::Frame<Bytes>, crate::upstream::BoxError>>) -> Bytes {
    f.expect("a frame")
        .expect("no error")
        .into_data()
        .expect("a data frame")
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_mid_stream_cancels_upstream_and_releases_the_engine() {
    let mock = MockUpstream::new();
    mock.set_default(
        A,
        scripted(5, &[(1, "data: 1\n\n"), (1_000, "data: 2\n\n")], None),
    );
    let gw = gateway(cfg(), &mock, &[A]);
    let r = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes())).await;
    assert_eq!(r.status(), 200);
    let mut body = r.into_body();
    let first = body.frame().await.expect("a frame").expect("data");
    assert_eq!(first.into_data().expect("data"), "data: 1\n\n");
    assert_eq!(in_flight(&gw), 1, "counted until the end of the stream");
    assert_eq!(mock.live_bodies(), 1);
    drop(body); // the client goes away
    assert_eq!(
        mock.live_bodies(),
        0,
        "the upstream body is dropped: the engine aborts"
    );
    assert_eq!(in_flight(&gw), 0);
    let a = engine(&gw, A);
    assert!(
        a.metrics
            .errors
            .iter()
            .all(|e| e.load(Ordering::Relaxed) == 0)
    );
    assert_eq!(
        a.tracker().breaker().state(gw.clock.now_us()),
        BreakerState::Closed
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_that_breaks_mid_stream_is_a_failure_not_a_retry() {
    let mock = MockUpstream::new();
    mock.set_default(A, scripted(0, &[(0, "data: 1\n\n")], Some((3, "reset"))));
    mock.set_default(B, MockReply::ok(200, "{}"));
    let gw = gateway(cfg(), &mock, &[A, B]);
    let broke = a_first(&gw, async {
        let r = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes())).await;
        assert_eq!(r.status(), 200);
        r.into_body().collect().await.is_err()
    })
    .await;
    assert!(broke, "the client sees the break");
    assert_eq!(errors(&gw, A, FailKind::Stream), 1);
    assert_eq!(
        mock.calls().len(),
        1,
        "bytes reached the client: never retried"
    );
    assert_eq!(in_flight(&gw), 0);
}

#[tokio::test(start_paused = true)]
async fn coalescing_never_holds_back_a_lone_frame() {
    use futures::FutureExt;
    let mock = MockUpstream::new();
    mock.set_default(
        A,
        stream_reply(&[
            (0, "data: 1\n\n"),
            (1_000, "data: 2\n\n"),
            (0, "data: [DONE]\n\n"),
        ]),
    );
    let gw = gateway(cfg(), &mock, &[A]);
    let mut body = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes()))
        .await
        .into_body();
    // Polled once, without waiting for anything (no timer runs, the clock does not move):
    // the frame in hand is delivered while the upstream still holds the next one back.
    let first = body
        .frame()
        .now_or_never()
        .expect("the lone frame is delivered at the first poll");
    assert_eq!(data(first), "data: 1\n\n");
    assert_eq!(
        engine(&gw, A).metrics.ttft.count(),
        1,
        "TTFT at the first frame"
    );
    assert!(
        body.frame().now_or_never().is_none(),
        "nothing else is available yet: the body is pending"
    );
    // The next frame and the closing one become available together: one write.
    assert_eq!(data(body.frame().await), "data: 2\n\ndata: [DONE]\n\n");
    assert!(body.frame().await.is_none());
    assert_eq!(in_flight(&gw), 0);
    assert_eq!(
        engine(&gw, A).metrics.e2e.count(),
        1,
        "accounted as a success"
    );
    assert_eq!(engine(&gw, A).metrics.ttft.count(), 1);
}

/// The event stream's terminator ends the attempt when it passes, before the upstream body
/// ends: the client that reads it and sends its next request never finds this one still
/// counted in flight.
#[tokio::test(start_paused = true)]
async fn the_stream_s_terminator_ends_the_count_before_the_body_ends() {
    let mock = MockUpstream::new();
    mock.set_default(
        A,
        stream_reply(&[(0, "data: 1\n\n"), (0, "data: [DONE]\n\n"), (1_000, "")]),
    );
    // A frame that only contains the marker's text is not the end.
    mock.set_default(B, stream_reply(&[(0, "xdata: [DONE]\n\n"), (1_000, "")]));
    let gw = gateway(cfg(), &mock, &[A]);
    let mut body = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes()))
        .await
        .into_body();
    assert_eq!(data(body.frame().await), "data: 1\n\ndata: [DONE]\n\n");
    assert_eq!(in_flight(&gw), 0, "ended with the terminator");
    assert_eq!(
        engine(&gw, A).metrics.e2e.count(),
        1,
        "accounted as a success"
    );
    // The rest of the body still passes, and is not counted again.
    while let Some(f) = body.frame().await {
        f.expect("no error");
    }
    assert_eq!(engine(&gw, A).metrics.e2e.count(), 1);
    assert_eq!(in_flight(&gw), 0);

    let gw = gateway(cfg(), &mock, &[B]);
    let mut body = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes()))
        .await
        .into_body();
    assert_eq!(data(body.frame().await), "xdata: [DONE]\n\n");
    assert_eq!(in_flight(&gw), 1, "not an end: still in flight");
    while let Some(f) = body.frame().await {
        f.expect("no error");
    }
    assert_eq!(in_flight(&gw), 0);
    assert_eq!(engine(&gw, B).metrics.e2e.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn frames_already_available_are_merged_into_one_up_to_the_bound() {
    let mock = MockUpstream::new();
    let frames: Vec<String> = (0..16).map(|i| format!("data: {i}\n\n")).collect();
    let script: Vec<(u64, &str)> = frames.iter().map(|f| (0, f.as_str())).collect();
    mock.set_default(A, stream_reply(&script));
    let big = "x".repeat(40 * 1024);
    mock.set_default(B, stream_reply(&[(0, &big), (0, &big), (0, &big)]));
    let gw = gateway(cfg(), &mock, &[A]);
    let mut body = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes()))
        .await
        .into_body();
    assert_eq!(
        data(body.frame().await),
        frames.concat(),
        "one frame for the burst"
    );
    assert!(body.frame().await.is_none());
    assert_eq!(in_flight(&gw), 0);
    assert_eq!(engine(&gw, A).metrics.e2e.count(), 1);

    // Past the bound (64 KiB), the rest goes in the next write.
    let gw = gateway(cfg(), &mock, &[B]);
    let mut body = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes()))
        .await
        .into_body();
    assert_eq!(data(body.frame().await).len(), 80 * 1024);
    assert_eq!(data(body.frame().await).len(), 40 * 1024);
    assert!(body.frame().await.is_none());
    assert_eq!(engine(&gw, B).metrics.e2e.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_error_met_while_coalescing_follows_the_data_and_is_a_failure() {
    let mock = MockUpstream::new();
    mock.set_default(
        A,
        scripted(
            0,
            &[(0, "data: 1\n\n"), (0, "data: 2\n\n")],
            Some((0, "reset")),
        ),
    );
    let gw = gateway(cfg(), &mock, &[A]);
    let mut body = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes()))
        .await
        .into_body();
    assert_eq!(data(body.frame().await), "data: 1\n\ndata: 2\n\n");
    assert!(
        !hyper::body::Body::is_end_stream(&body),
        "never an end while the error waits"
    );
    // One `Pending` first (woken at once): hyper flushes the data before the error closes
    // the connection (tests/broken_answer.rs shows it through a real connection).
    use futures::FutureExt;
    assert!(body.frame().now_or_never().is_none(), "a pause first");
    assert!(matches!(body.frame().await, Some(Err(_))), "then the break");
    assert_eq!(errors(&gw, A, FailKind::Stream), 1);
    assert_eq!(in_flight(&gw), 0);
}

/// An engine that sends its head and breaks before the first byte of the answer (it died
/// during the prefill): nothing reached the client, so the request is retried elsewhere.
#[tokio::test(start_paused = true)]
async fn an_answer_that_breaks_before_its_first_byte_is_retried_on_another_engine() {
    let mock = MockUpstream::new();
    mock.set_default(A, scripted(0, &[(0, "")], Some((3, "reset"))));
    mock.set_default(
        B,
        stream_reply(&[(2, "data: 1\n\n"), (0, "data: [DONE]\n\n")]),
    );
    let gw = gateway(cfg(), &mock, &[A, B]);
    let r = a_first(
        &gw,
        send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes())),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvmesh-engine"], engine(&gw, B).header_value);
    let body = r.into_body().collect().await.expect("whole").to_bytes();
    assert_eq!(body, "data: 1\n\ndata: [DONE]\n\n");
    let authorities: Vec<String> = mock.calls().into_iter().map(|c| c.authority).collect();
    assert_eq!(authorities, [A, B], "one retry, on the other engine");
    assert_eq!(errors(&gw, A, FailKind::Transport), 1);
    assert_eq!(
        errors(&gw, A, FailKind::Stream),
        0,
        "no stream reached the client"
    );
    assert_eq!(engine(&gw, A).metrics.ttft.count(), 0);
    assert_eq!(engine(&gw, B).metrics.ttft.count(), 1);
    assert_eq!(engine(&gw, B).metrics.e2e.count(), 1);
    assert_eq!(in_flight(&gw), 0);
}

/// A head followed by nothing until the first-byte timeout: a timeout, retried elsewhere.
#[tokio::test(start_paused = true)]
async fn a_head_without_a_first_byte_times_out_and_is_retried() {
    let mut c = cfg();
    c.timeouts.first_byte_ms = 1_000;
    let mock = MockUpstream::new();
    mock.set_default(A, stream_reply(&[(5_000, "data: late\n\n")]));
    mock.set_default(B, MockReply::ok(200, "{}"));
    let gw = gateway(c, &mock, &[A, B]);
    let r = a_first(
        &gw,
        send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes())),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.into_body().collect().await.expect("whole").to_bytes(),
        "{}"
    );
    assert_eq!(errors(&gw, A, FailKind::Timeout), 1);
    assert_eq!(mock.calls().len(), 2);
    assert_eq!(
        mock.live_bodies(),
        0,
        "the late body is dropped: the engine aborts"
    );
    assert_eq!(in_flight(&gw), 0);
}

/// A success with an empty body is no answer to a completion: a failed attempt (retried
/// elsewhere; here, with one engine, the client gets a 502 saying why), never a success.
#[tokio::test(start_paused = true)]
async fn an_empty_answer_is_a_failed_attempt() {
    let mock = MockUpstream::new();
    mock.set_default(
        A,
        MockReply::Respond {
            head_after: Duration::ZERO,
            status: 200,
            chunks: Vec::new(),
        },
    );
    let gw = gateway(cfg(), &mock, &[A]);
    let r = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes())).await;
    assert_eq!(r.status(), 502);
    assert_eq!(in_flight(&gw), 0);
    let body = r.into_body().collect().await.expect("whole").to_bytes();
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("empty answer"), "{text}");
    assert!(errors(&gw, A, FailKind::Transport) >= 1);
    assert_eq!(engine(&gw, A).metrics.e2e.count(), 0, "never a success");
}
