//! Interop with pyzmq + msgpack (tests/python/kv_events_*.py): Rust publisher
//! to a Python subscriber, Python replay client against the Rust replay
//! socket, Python publisher (vLLM framing, gaps, old layouts, unknown tags,
//! garbage) to the Rust subscriber and replay client. 127.0.0.1 only; every
//! wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvmesh_kvevents::json::batch_to_json;
use kvmesh_kvevents::{
    BlockHash, DecodeLimits, EventBatch, FrameError, KvEvent, Publisher, PublisherConfig,
    RecvError, ReplayFraming, Subscriber, WireEncoding, decode_batch, replay,
};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);
const LAST_TS: f64 = 777.5;

fn final_batch() -> EventBatch {
    EventBatch {
        ts: LAST_TS,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: Some(0),
    }
}

async fn rust_to_python(enc: WireEncoding) {
    require_python();
    let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
    cfg.topic = "kv@py".into();
    let p = Publisher::start(cfg).await.unwrap();
    let sub = PyChild::spawn(
        "kv_events_sub.py",
        &[
            "--endpoint",
            p.endpoint(),
            "--topic",
            "kv@",
            "--until-ts",
            &LAST_TS.to_string(),
            "--timeout",
            "20",
        ],
    );
    assert_eq!(sub.next_json(WAIT)["ready"], json!(true));
    // Slow-joiner handshake: warm-up batches until the script prints one.
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "python subscriber never saw a warm-up batch"
        );
        p.publish(&warmup_batch(), enc).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Ok(line) = sub.lines.try_recv() {
            let v: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["batch"]["ts"], json!(-1.0), "{line}");
            break;
        }
    }
    p.reset_seq().unwrap();
    let mut expected = sample_batches();
    if enc == WireEncoding::Map {
        expected.push(map_only_batch());
    }
    expected.push(final_batch());
    for b in &expected {
        p.publish(b, enc).unwrap();
    }
    let mut got = Vec::new();
    while got.len() < expected.len() {
        let v = sub.next_json(WAIT);
        assert!(v.get("error").is_none(), "python failed to decode: {v}");
        if v["batch"]["ts"] != json!(-1.0) {
            got.push(v);
        }
    }
    for (i, (v, b)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(v["seq"], json!(i), "{v}");
        assert_eq!(v["topic"], json!("kv@py"));
        assert_eq!(v["skipped_unknown"], json!(0));
        if !b.events.is_empty() {
            assert_eq!(v["encoding"], json!(enc.as_str()));
        }
        assert_eq!(v["batch"], batch_to_json(b), "batch {i} ({enc})");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_publisher_to_python_subscriber_array() {
    rust_to_python(WireEncoding::Array).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_publisher_to_python_subscriber_map() {
    rust_to_python(WireEncoding::Map).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_replay_client_against_rust_publisher() {
    require_python();
    for framing in [ReplayFraming::WithTopic, ReplayFraming::Legacy] {
        let mut cfg = PublisherConfig::new("tcp://127.0.0.1:0");
        cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
        cfg.topic = "kv@r".into();
        cfg.replay_framing = framing;
        let p = Publisher::start(cfg).await.unwrap();
        for i in 0..5 {
            let enc = if i % 2 == 0 {
                WireEncoding::Map
            } else {
                WireEncoding::Array
            };
            p.publish(&stream_batch(i), enc).unwrap();
        }
        p.flush().await.unwrap();
        let rep = p.replay_endpoint().unwrap().to_string();
        let out = tokio::task::spawn_blocking(move || {
            run_python(
                "kv_events_replay.py",
                &["--endpoint", &rep, "--start", "2", "--timeout", "10"],
                "",
                WAIT,
            )
        })
        .await
        .unwrap();
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 4, "{out}");
        for (k, v) in lines[..3].iter().enumerate() {
            let seq = 2 + k as u64;
            assert_eq!(v["seq"], json!(seq));
            let topic = match framing {
                ReplayFraming::WithTopic => json!("kv@r"),
                ReplayFraming::Legacy => Value::Null,
            };
            assert_eq!(v["topic"], topic);
            assert_eq!(v["batch"], batch_to_json(&stream_batch(seq)));
        }
        assert_eq!(lines[3], json!({"end": true, "count": 3}));
    }
}

/// Writes a JSON script for kv_events_pub.py to a unique temp file (process id, time and a
/// counter: two tests starting together may read the same time).
fn script_file(script: &Value) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let path = std::env::temp_dir().join(format!(
        "kv_events_script_{}_{nanos}_{n}.json",
        std::process::id()
    ));
    std::fs::write(&path, serde_json::to_vec(script).unwrap()).unwrap();
    path
}

async fn python_to_rust(enc: WireEncoding, framing: ReplayFraming) {
    require_python();
    let old = KvEvent::stored(
        vec![BlockHash::Int(77)],
        Some(BlockHash::Int(76)),
        vec![9, 8],
        2,
    );
    let mut old_expected = old.clone();
    if let KvEvent::BlockStored { medium, .. } = &mut old_expected {
        *medium = None; // cut off by array_fields = 5 in array mode
    }
    let unknown = json!({"type": "BlockMoved", "block_hashes": [1], "to": "CPU"});
    let mut steps: Vec<Value> = (0..4)
        .map(|i| json!({"batch": batch_to_json(&stream_batch(i))}))
        .collect();
    steps.push(json!({"batch": batch_to_json(&stream_batch(4)), "drop": true})); // seq 4: gap, replayable
    steps.push(json!({"skip_seq": true})); // seq 5: gap, not replayable
    let old_batch = EventBatch {
        ts: 6.0,
        events: vec![old],
        data_parallel_rank: None,
    };
    let mut old_step = json!({"batch": batch_to_json(&old_batch), "batch_fields": 2});
    if enc == WireEncoding::Array {
        old_step["array_fields"] = json!(5);
    }
    steps.push(old_step); // seq 6
    steps.push(json!({"batch": {"ts": 7.0, "events": [unknown, {"type": "AllBlocksCleared"}], "data_parallel_rank": 0}})); // seq 7
    steps.push(json!({"payload_hex": "93cb0102"})); // seq 8: garbage
    steps.push(json!({"batch": batch_to_json(&final_batch())})); // seq 9
    let path = script_file(&json!({"encoding": enc.as_str(), "steps": steps}));
    let framing_arg = match framing {
        ReplayFraming::WithTopic => "topic",
        ReplayFraming::Legacy => "legacy",
    };
    let mut publisher = PyChild::spawn(
        "kv_events_pub.py",
        &[
            "--endpoint",
            "tcp://127.0.0.1:*",
            "--replay-endpoint",
            "tcp://127.0.0.1:*",
            "--replay-framing",
            framing_arg,
            "--topic",
            "kv@vllm",
            "--script",
            path.to_str().unwrap(),
            "--wait-subscribers",
            "1",
            "--exit-on-stdin-eof",
            "--timeout",
            "30",
        ],
    );
    let eps = publisher.next_json(WAIT);
    let endpoint = eps["endpoint"].as_str().unwrap().to_string();
    let replay_ep = eps["replay_endpoint"].as_str().unwrap().to_string();
    // The XPUB script waits for this subscription before sending anything.
    let mut sub = Subscriber::connect(&endpoint, "kv@").await.unwrap();
    let mut frames = Vec::new();
    while frames.len() < 8 {
        match sub.recv_timeout(WAIT).await {
            Ok(Some(f)) => frames.push(Ok(f)),
            Ok(None) => panic!("timed out after {} frames", frames.len()),
            Err(RecvError::Frame(e)) => frames.push(Err(e)),
            Err(e) => panic!("transport error {e}"),
        }
    }
    let ok = |i: usize| frames[i].as_ref().unwrap();
    for i in 0..4 {
        assert_eq!(
            (ok(i).seq, &ok(i).topic),
            (i as u64, &"kv@vllm".to_string())
        );
        assert_eq!(ok(i).batch.batch, stream_batch(i as u64), "seq {i}");
    }
    assert_eq!(ok(4).seq, 6, "seqs 4 and 5 are a gap");
    let want_old = if enc == WireEncoding::Array {
        old_expected
    } else {
        old_batch.events[0].clone()
    };
    assert_eq!(
        ok(4).batch.batch,
        EventBatch {
            ts: 6.0,
            events: vec![want_old],
            data_parallel_rank: None
        }
    );
    assert_eq!((ok(5).seq, ok(5).batch.skipped_unknown), (7, 1));
    assert_eq!(ok(5).batch.batch.events, vec![KvEvent::AllBlocksCleared]);
    assert!(
        matches!(frames[6], Err(FrameError::Payload { seq: 8, .. })),
        "{:?}",
        frames[6]
    );
    assert_eq!((ok(7).seq, &ok(7).batch.batch), (9, &final_batch()));
    assert_eq!(publisher.next_json(WAIT)["next_seq"], json!(10));

    // Recover the gap from the Python replay socket (vLLM's _service_replay).
    let got = replay(&replay_ep, 4, WAIT).await.unwrap();
    assert_eq!(
        got.iter().map(|r| r.seq).collect::<Vec<_>>(),
        [4, 6, 7, 8, 9]
    );
    let topic =
        (framing == ReplayFraming::WithTopic).then(|| bytes::Bytes::from_static(b"kv@vllm"));
    assert!(got.iter().all(|r| r.topic == topic));
    let d = decode_batch(&got[0].payload, &DecodeLimits::default()).unwrap();
    assert_eq!(d.batch, stream_batch(4));

    publisher.close_stdin();
    assert_eq!(
        publisher.wait(WAIT),
        Some(0),
        "kv_events_pub.py exit status"
    );
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_publisher_to_rust_subscriber_array_legacy_replay() {
    python_to_rust(WireEncoding::Array, ReplayFraming::Legacy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_publisher_to_rust_subscriber_map_topic_replay() {
    python_to_rust(WireEncoding::Map, ReplayFraming::WithTopic).await;
}
