//! The simulator's KV events seen by the project's own Rust subscriber: one batch per step
//! from seq 0, AllBlocksCleared on cache reset, seq back to 0 on restart.

mod common;

use common::*;
use kvmesh_kvevents::{KvEvent, MsgValue, Subscriber};
use serde_json::json;
use std::time::Duration;

/// Sends requests until a batch arrives (ZMQ subscriptions take a moment to reach the
/// publisher), then returns every batch until the stream is quiet.
async fn drive_and_collect(
    c: &HttpClient,
    base: &str,
    sub: &mut Subscriber,
    prompt: &str,
) -> Vec<(u64, Vec<KvEvent>)> {
    let url = format!("{base}/v1/completions");
    let mut out = Vec::new();
    for _ in 0..50 {
        let (s, v) = post(
            c,
            &url,
            json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        while let Some(f) = sub
            .recv_timeout(Duration::from_millis(300))
            .await
            .expect("decodable frame")
        {
            out.push((f.seq, f.batch.batch.events));
        }
        if !out.is_empty() {
            return out;
        }
    }
    panic!("no KV-event batch arrived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seq_counts_batches_and_restarts_at_zero() {
    let mut cfg = cfg();
    cfg.kv_events.endpoint = "tcp://127.0.0.1:0".into();
    let sim = kvmesh_sim::start(cfg).await.expect("start");
    let ep = sim.kv_events_endpoint.clone().expect("bound endpoint");
    let base = sim.base_url();
    let c = client();
    let mut sub = Subscriber::connect(&ep, "").await.expect("subscribe");

    let first = drive_and_collect(&c, &base, &mut sub, &long_text(1, 200)).await;
    let seqs: Vec<u64> = first.iter().map(|(s, _)| *s).collect();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "consecutive seqs {seqs:?}"
    );
    assert!(
        first
            .iter()
            .flat_map(|(_, e)| e)
            .any(|e| matches!(e, KvEvent::BlockStored { .. }))
    );

    // A salted request: its root block carries the salt as its extra key, as vLLM sends it.
    let (s, v) = post(
        &c,
        &format!("{base}/v1/completions"),
        json!({"model": "sim-model", "prompt": long_text(9, 100), "max_tokens": 2, "cache_salt": "tenant-a"}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let mut salted = None;
    let mut last_seq = seqs.last().copied().unwrap_or(0);
    while let Some(f) = sub
        .recv_timeout(Duration::from_millis(500))
        .await
        .expect("frame")
    {
        assert_eq!(f.seq, last_seq + 1, "consecutive seqs");
        last_seq = f.seq;
        for e in f.batch.batch.events {
            if let KvEvent::BlockStored {
                parent_block_hash: None,
                extra_keys,
                block_hashes,
                ..
            } = e
            {
                salted = Some((extra_keys, block_hashes.len()));
            }
        }
    }
    let (keys, blocks) = salted.expect("a root BlockStored for the salted prompt");
    let keys = keys.expect("extra_keys on a salted chain");
    assert_eq!(keys.len(), blocks);
    assert_eq!(keys[0], MsgValue::Array(vec![MsgValue::str("tenant-a")]));
    assert!(keys[1..].iter().all(|k| *k == MsgValue::Nil));

    // Cache reset → AllBlocksCleared in the next batch.
    let (s, _) = request(
        &c,
        "POST",
        &format!("{base}/reset_prefix_cache"),
        bytes::Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    let f = sub
        .recv_timeout(Duration::from_secs(5))
        .await
        .expect("frame")
        .expect("a batch after the reset");
    assert_eq!(f.seq, last_seq + 1);
    assert!(matches!(
        f.batch.batch.events.as_slice(),
        [KvEvent::AllBlocksCleared]
    ));

    // Restart → the next batch has seq 0 again.
    let (s, _) = request(
        &c,
        "POST",
        &format!("{base}/admin/restart"),
        bytes::Bytes::new(),
    )
    .await;
    assert_eq!(s, 200);
    let after = drive_and_collect(&c, &base, &mut sub, &long_text(2, 200)).await;
    assert_eq!(
        after[0].0,
        0,
        "seq after restart: {:?}",
        after.iter().map(|b| b.0).collect::<Vec<_>>()
    );
    sim.shutdown(Duration::from_secs(5)).await;
}
