//! Loopback tests of the Rust publisher, subscriber and replay client.
//! 127.0.0.1 only; every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use kvmesh_kvevents::{
    DecodeLimits, FrameError, KvFrame, Publisher, PublisherConfig, RecvError, ReplayFraming,
    Subscriber, WireEncoding, decode_batch, replay,
};

const STEP: Duration = Duration::from_millis(50);
const WAIT: Duration = Duration::from_secs(10);

async fn publisher(replay: bool, topic: &str, framing: ReplayFraming) -> Publisher {
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
    cfg.topic = topic.to_string();
    cfg.replay_endpoint = replay.then(|| "tcp://127.0.0.1:0".to_string());
    cfg.replay_framing = framing;
    Publisher::start(cfg).await.expect("publisher")
}

/// Connects a subscriber and handles the ZMQ slow joiner with a handshake:
/// publish warm-up batches (ts = -1) until one arrives, then restart the
/// publisher's seq so the real stream starts at 0.
async fn warm_subscriber(p: &Publisher, topic: &str) -> Subscriber {
    let mut sub = Subscriber::connect(p.endpoint(), topic)
        .await
        .expect("connect");
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "subscriber never received a warm-up batch"
        );
        p.publish(&warmup_batch(), WireEncoding::Map).unwrap();
        if sub.recv_timeout(STEP).await.unwrap().is_some() {
            break;
        }
    }
    p.reset_seq().unwrap();
    sub
}

/// Next non-warm-up frame.
async fn next(sub: &mut Subscriber) -> Result<KvFrame, RecvError> {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match sub.recv_timeout(left).await? {
            Some(f) if f.batch.batch.ts == -1.0 => continue,
            Some(f) => return Ok(f),
            None => panic!("no batch within {WAIT:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_publisher_to_rust_subscriber_both_encodings() {
    let p = publisher(false, "kv@pod-a@model", ReplayFraming::WithTopic).await;
    assert!(p.endpoint().starts_with("tcp://127.0.0.1:"));
    let mut sub = warm_subscriber(&p, "kv@").await;
    let mut sent = Vec::new();
    for (i, b) in sample_batches()
        .into_iter()
        .chain([map_only_batch()])
        .enumerate()
    {
        let enc = if i % 2 == 0 && i != 4 {
            WireEncoding::Array
        } else {
            WireEncoding::Map
        };
        assert_eq!(p.publish(&b, enc).unwrap(), i as u64);
        sent.push(b);
    }
    for (i, b) in sent.iter().enumerate() {
        let f = next(&mut sub).await.unwrap();
        assert_eq!(f.seq, i as u64);
        assert_eq!(f.topic, "kv@pod-a@model");
        assert_eq!(&f.batch.batch, b);
        assert_eq!(f.batch.skipped_unknown, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_visible_and_replay_fills_them() {
    let p = publisher(true, "kv", ReplayFraming::WithTopic).await;
    let rep = p.replay_endpoint().unwrap().to_string();
    let mut sub = warm_subscriber(&p, "").await;
    assert_eq!(p.publish(&stream_batch(0), WireEncoding::Map).unwrap(), 0);
    assert_eq!(p.publish(&stream_batch(1), WireEncoding::Array).unwrap(), 1);
    assert_eq!(
        p.publish_dropped(&stream_batch(2), WireEncoding::Map)
            .unwrap(),
        2
    );
    assert_eq!(p.skip_seq().unwrap(), 3);
    assert_eq!(p.publish(&stream_batch(4), WireEncoding::Map).unwrap(), 4);
    assert_eq!(p.next_seq(), 5);
    let seqs: Vec<u64> = [
        next(&mut sub).await,
        next(&mut sub).await,
        next(&mut sub).await,
    ]
    .into_iter()
    .map(|f| f.unwrap().seq)
    .collect();
    assert_eq!(seqs, [0, 1, 4]);

    p.flush().await.unwrap();
    let got = replay(&rep, 2, WAIT).await.unwrap();
    let seqs: Vec<u64> = got.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        [2, 4],
        "the dropped batch is replayable, the skipped seq is not"
    );
    for r in &got {
        assert_eq!(r.topic.as_deref(), Some(&b"kv"[..]));
        let d = decode_batch(&r.payload, &DecodeLimits::default()).unwrap();
        assert_eq!(d.batch, stream_batch(r.seq));
    }
    // Everything buffered since the reset, and nothing past the end.
    assert_eq!(replay(&rep, 0, WAIT).await.unwrap().len(), 4);
    assert!(replay(&rep, 100, WAIT).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_replay_framing_and_bounded_ring() {
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    cfg.replay_framing = ReplayFraming::Legacy;
    cfg.buffer_len = 5;
    let p = Publisher::start(cfg).await.unwrap();
    for i in 0..12 {
        p.publish(&stream_batch(i), WireEncoding::Array).unwrap();
    }
    p.flush().await.unwrap();
    let got = replay(p.replay_endpoint().unwrap(), 0, WAIT).await.unwrap();
    assert_eq!(
        got.iter().map(|r| r.seq).collect::<Vec<_>>(),
        [7, 8, 9, 10, 11]
    );
    assert!(got.iter().all(|r| r.topic.is_none()));
    assert_eq!(
        decode_batch(&got[0].payload, &DecodeLimits::default())
            .unwrap()
            .batch,
        stream_batch(7)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_seq_restarts_stream_and_clears_replay() {
    let p = publisher(true, "", ReplayFraming::WithTopic).await;
    let mut sub = warm_subscriber(&p, "").await;
    for i in 0..3 {
        p.publish(&stream_batch(i), WireEncoding::Map).unwrap();
    }
    p.reset_seq().unwrap();
    assert_eq!(p.publish(&stream_batch(10), WireEncoding::Map).unwrap(), 0);
    let seqs: Vec<u64> = [
        next(&mut sub).await,
        next(&mut sub).await,
        next(&mut sub).await,
        next(&mut sub).await,
    ]
    .into_iter()
    .map(|f| f.unwrap().seq)
    .collect();
    assert_eq!(seqs, [0, 1, 2, 0]);
    p.flush().await.unwrap();
    let got = replay(p.replay_endpoint().unwrap(), 0, WAIT).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        decode_batch(&got[0].payload, &DecodeLimits::default())
            .unwrap()
            .batch,
        stream_batch(10)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_payload_is_a_per_message_error() {
    let p = publisher(false, "", ReplayFraming::WithTopic).await;
    let mut sub = warm_subscriber(&p, "").await;
    p.publish_payload(Bytes::from_static(&[0x93, 0xcb, 1, 2]))
        .unwrap();
    p.publish(&stream_batch(1), WireEncoding::Map).unwrap();
    match next(&mut sub).await {
        Err(RecvError::Frame(FrameError::Payload { seq: 0, .. })) => {}
        other => panic!("expected a payload error for seq 0, got {other:?}"),
    }
    let f = next(&mut sub).await.unwrap();
    assert_eq!((f.seq, f.batch.batch), (1, stream_batch(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_prefix_filtering() {
    let p = publisher(false, "kv@a", ReplayFraming::WithTopic).await;
    let mut other = Subscriber::connect(p.endpoint(), "kv@b").await.unwrap();
    let mut sub = warm_subscriber(&p, "kv@a").await;
    p.publish(&stream_batch(0), WireEncoding::Map).unwrap();
    assert_eq!(next(&mut sub).await.unwrap().seq, 0);
    assert!(
        other
            .recv_timeout(Duration::from_millis(300))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_handle_is_cloneable_and_sync() {
    fn assert_send_sync<T: Send + Sync + Clone + 'static>() {}
    assert_send_sync::<Publisher>();
    let p = Publisher::bind("tcp://127.0.0.1:0", None, "t".into(), 16)
        .await
        .unwrap();
    let q = p.clone();
    // Publishing from a plain thread (as an engine loop would) needs no runtime.
    let seq = std::thread::spawn(move || q.publish(&stream_batch(0), WireEncoding::Array))
        .join()
        .unwrap()
        .unwrap();
    assert_eq!(seq, 0);
    assert_eq!(p.next_seq(), 1);
    p.flush().await.unwrap();
    // vLLM's default `tcp://*:5557` is bound as 0.0.0.0 (not exercised here:
    // tests stay on 127.0.0.1), and vLLM's bind-or-connect heuristic.
    use kvmesh_kvevents::publisher::{normalize_bind_endpoint, vllm_binds};
    assert_eq!(
        normalize_bind_endpoint("tcp://*:5557"),
        "tcp://0.0.0.0:5557"
    );
    assert_eq!(
        normalize_bind_endpoint("tcp://127.0.0.1:5557"),
        "tcp://127.0.0.1:5557"
    );
    assert!(vllm_binds("tcp://*:5557") && vllm_binds("ipc:///tmp/x"));
    assert!(!vllm_binds("tcp://10.1.2.3:5557"));
}
