//! What the client gets when the engines' answers are not what they should be (QA): an error
//! answer too large or too late to be read whole, a stream kept open after its terminator, a
//! whole answer's first byte taken for a time to first token.

use super::failed::{ERROR_BODY_MAX, ERROR_BODY_WAIT};
use super::*;

/// An answer with `status` whose body is `chunks` (each after its delay).
fn answer(status: u16, chunks: Vec<(Duration, &'static str)>) -> MockReply {
    MockReply::Respond {
        head_after: Duration::ZERO,
        status,
        chunks: chunks
            .into_iter()
            .map(|(d, c)| (d, Ok(Bytes::from_static(c.as_bytes()))))
            .collect(),
    }
}

#[tokio::test(start_paused = true)]
async fn an_error_answer_that_cannot_be_read_whole_is_the_router_s_own_error() {
    // Larger than what is kept of an error answer.
    let big: &'static str = "x".repeat(ERROR_BODY_MAX + 1).leak();
    let mock = MockUpstream::new();
    mock.set_default(A, answer(500, vec![(Duration::ZERO, big)]));
    mock.set_default(B, answer(500, vec![(Duration::ZERO, big)]));
    let gw = gateway(cfg(), &mock, &[A, B]);
    let (status, headers, body) = call(&gw).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(headers["content-type"], "application/json");
    let v: serde_json::Value = serde_json::from_str(&body).expect("OpenAI-shaped");
    let message = v["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("status 500") && message.contains("its body over 64 KiB"),
        "{message}"
    );

    // Its body arrives after the wait for it.
    let late = ERROR_BODY_WAIT + Duration::from_secs(2);
    let mock = MockUpstream::new();
    mock.set_default(A, answer(500, vec![(late, "{\"error\":\"late\"}")]));
    mock.set_default(B, answer(500, vec![(late, "{\"error\":\"late\"}")]));
    let gw = gateway(cfg(), &mock, &[A, B]);
    let (status, _, body) = call(&gw).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("its body not whole within 5s"), "{body}");
    assert_eq!(in_flight(&gw), 0);

    // One that is read whole is passed on as it was.
    let mock = MockUpstream::new();
    mock.set_default(A, MockReply::ok(500, "{\"error\":\"boom\"}"));
    mock.set_default(B, MockReply::ok(500, "{\"error\":\"boom\"}"));
    let gw = gateway(cfg(), &mock, &[A, B]);
    let (status, headers, body) = call(&gw).await;
    assert_eq!((status, body.as_str()), (500, "{\"error\":\"boom\"}"));
    assert!(headers.contains_key("x-kvmesh-engine"), "names the engine");
}

#[tokio::test(start_paused = true)]
async fn a_stream_left_open_after_its_terminator_ends_soon_after_it() {
    let mock = MockUpstream::new();
    // The terminator, then the body stays open for an hour.
    let open = answer(
        200,
        vec![
            (Duration::ZERO, "data: {}\n\n"),
            (Duration::from_millis(10), "data: [DONE]\n\n"),
            (Duration::from_secs(3_600), ""),
        ],
    );
    mock.set_default(A, open.clone());
    mock.set_default(B, open);
    let mut c = cfg();
    c.timeouts.total_ms = 600_000;
    let gw = gateway(c, &mock, &[A, B]);
    let t0 = tokio::time::Instant::now();
    let r = send_chat(&gw, Bytes::from_static(STREAM_BODY.as_bytes())).await;
    assert_eq!(r.status(), 200);
    let body = r
        .into_body()
        .collect()
        .await
        .expect("ends cleanly")
        .to_bytes();
    assert!(
        body.ends_with(b"data: [DONE]\n\n"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    let took = t0.elapsed();
    assert!(
        took >= crate::track::AFTER_TERMINATOR && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(in_flight(&gw), 0);
    assert_eq!(
        errors(&gw, A, FailKind::Stream) + errors(&gw, B, FailKind::Stream),
        0
    );
}

#[tokio::test(start_paused = true)]
async fn only_a_streamed_answer_s_first_byte_is_a_time_to_first_token() {
    let mock = MockUpstream::new();
    let reply = answer(200, vec![(Duration::from_millis(300), "{\"ok\":1}")]);
    mock.set_default(A, reply.clone());
    mock.set_default(B, reply);
    let gw = gateway(cfg(), &mock, &[A, B]);
    let ttfts = |gw: &Gateway| {
        gw.registry
            .members()
            .iter()
            .map(|e| e.metrics.ttft.count())
            .sum::<u64>()
    };
    let (status, ..) = call(&gw).await;
    assert_eq!(status, 200);
    assert_eq!(ttfts(&gw), 0, "a whole answer has no time to first token");
    let (status, ..) = call_with(&gw, STREAM_BODY).await;
    assert_eq!(status, 200);
    assert_eq!(ttfts(&gw), 1, "a streamed one has");
}
