//! KV-event ingestion end to end: a Python publisher (tests/python/kv_events_pub.py, pyzmq +
//! msgpack, vLLM-format frames in both encodings, int and bytes hashes) drives an in-process
//! router. Covered: chains of `BlockStored` with parents, `BlockRemoved`, `AllBlocksCleared`, a
//! lost batch filled from the replay socket, a seq regression (engine restart), a gap without a
//! replay socket (stale until `AllBlocksCleared`), garbage payloads (stale until a restart). At
//! each checkpoint the engine's index entries must be exactly the blocks the engine holds,
//! rehashed into the router's keys (`block_keys` of the token ids from the chain's root).
//!
//! 127.0.0.1 only; ports chosen by the OS; every wait is bounded; the Python process is killed
//! when its handle drops. The harness is in `kv_ingest_python/harness.rs`.

#[path = "kv_ingest_python/harness.rs"]
mod harness;

use harness::*;
use kvmesh_prefix::BlockKey;
use serde_json::json;
use std::sync::atomic::Ordering::Relaxed;

// ---------------------------------------------------------------------------------------------
// Tests.

/// Stored chains (int, bytes and mixed hashes), removals, a clear followed by new stores, a
/// dropped batch recovered from the replay socket (a later batch depends on it), encodings
/// alternating per batch starting with `enc`.
async fn stored_removed_cleared_replayed(enc: &str) {
    let alt = other(enc);
    let mut c = Cache::default();
    let a = [H::Int(1), H::Int(2), H::Int(u64::MAX - 3)];
    let b = [H::bytes(1, 1), H::bytes(1, 2)];
    let x = [H::bytes(2, 1), H::Int(0x8000_0000_0000_0001)];
    let d = [H::Int(40), H::bytes(4, 1)];
    let f = [H::Int(50), H::Int(51)];
    let g = [H::bytes(6, 1)];
    let mut steps = vec![
        // seq 0: a root chain of 3 blocks, int hashes.
        batch(1.0, vec![c.store(&a, None, Some("GPU"))], enc),
        // seq 1: a branch off a[1] (bytes hashes) and another root (mixed hashes).
        batch(
            2.0,
            vec![
                c.store(&b, Some(&a[1]), None),
                c.store(&x, None, Some("GPU")),
            ],
            alt,
        ),
    ];
    // seq 2: leaves evicted: the end of the branch and of the first chain.
    steps.push(batch(
        3.0,
        vec![c.remove(&[b[1].clone(), a[2].clone()])],
        enc,
    ));
    let before_clear = c.expected();
    assert_eq!(before_clear.len(), 5);
    // seq 3: the cache is reset, then a new chain.
    steps.push(batch(4.0, vec![c.clear(), c.store(&d, None, None)], alt));
    // seq 4: lost on the way (buffered for replay), extends d.
    let mut lost = batch(5.0, vec![c.store(&f, Some(&d[1]), Some("GPU"))], enc);
    lost["drop"] = json!(true);
    steps.push(lost);
    // seq 5: extends f (the router only knows f's keys if it replayed seq 4), then f[1] is
    // evicted (its child stays: entries are per block).
    steps.push(batch(
        6.0,
        vec![c.store(&g, Some(&f[1]), None), c.remove(&[f[1].clone()])],
        alt,
    ));
    // seq 6: one more store after the gap, bytes hash, plain root.
    let h = [H::bytes(7, 1)];
    steps.push(batch(7.0, vec![c.store(&h, None, None)], enc));
    let total_seqs = 7;

    let p = PyPublisher::start(&steps, true);
    let (server, e) = start_router(&p).await;
    assert_eq!(p.wait_done(), total_seqs);
    let expected = c.expected();
    let absent = c.gone_keys();
    assert_eq!(expected.len(), 5, "d[0], d[1], f[0], g[0], h[0]");
    wait_for("every batch applied", &e, || {
        batches_at_least(&e, total_seqs)
    })
    .await;
    wait_for("index = engine cache", &e, || {
        index_is(&server, &e, &expected, &absent)
    })
    .await;
    // Spot checks by name: g chains from f, which only the replay delivered.
    let idx_ok = |k: BlockKey| {
        server
            .gateway
            .registry
            .prefix
            .index()
            .holds(e.slot, k, server.gateway.clock.now_us())
    };
    assert!(idx_ok(c.key(&g[0])) && idx_ok(c.key(&f[0])) && idx_ok(c.key(&d[1])));
    let s = &e.ingest;
    assert_eq!(s.batches.load(Relaxed), total_seqs, "{}", counters(&e));
    assert_eq!(s.gaps.load(Relaxed), 1, "{}", counters(&e));
    assert!(s.replays_ok.load(Relaxed) >= 1, "{}", counters(&e));
    assert_eq!(s.replays_failed.load(Relaxed), 0, "{}", counters(&e));
    assert_eq!(s.malformed.load(Relaxed), 0, "{}", counters(&e));
    assert_eq!(s.restarts.load(Relaxed), 0, "{}", counters(&e));
    assert!(!s.stale.load(Relaxed), "{}", counters(&e));
    assert!(s.connected.load(Relaxed), "{}", counters(&e));
    assert_eq!(s.tracked_blocks.load(Relaxed), expected.len() as u64);
    assert_eq!(metric(&server, "kvmesh_kv_events_stale"), 0.0);
    p.finish();
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_removed_cleared_and_replayed_gap_array_first() {
    stored_removed_cleared_replayed("array").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_removed_cleared_and_replayed_gap_map_first() {
    stored_removed_cleared_replayed("map").await;
}

/// A replayed gap, a checkpoint, then the engine restarts (seq back to 0, replay buffer
/// emptied) and stores new blocks: only those remain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_drops_every_block_stored_before() {
    let mut c = Cache::default();
    let a = [H::Int(11), H::bytes(8, 1)];
    let b = [H::bytes(9, 1), H::Int(13)];
    let mut steps = vec![
        batch(10.0, vec![c.store(&a, None, Some("GPU"))], "array"),
        batch(11.0, vec![c.store(&b, Some(&a[1]), None)], "map"),
    ];
    steps[1]["drop"] = json!(true);
    steps.push(batch(12.0, vec![c.remove(&[b[1].clone()])], "array"));
    let before = c.expected();
    steps.push(json!({"sleep_ms": CHECKPOINT_MS}));
    steps.push(json!({"reset_seq": true}));
    c.drop_all();
    // The new process: seq 0 again, other hashes and tokens (a new first batch fingerprint).
    let n = [H::bytes(10, 1), H::Int(21)];
    let m = [H::Int(22)];
    steps.push(batch(100.0, vec![c.store(&n, None, None)], "map"));
    steps.push(batch(
        101.0,
        vec![c.store(&m, Some(&n[1]), Some("GPU"))],
        "array",
    ));
    let after = c.expected();
    let gone = c.gone_keys();
    assert_eq!((before.len(), after.len(), gone.len()), (3, 3, 4));

    let p = PyPublisher::start(&steps, true);
    let (server, e) = start_router(&p).await;
    // Checkpoint: the first epoch exactly, its gap replayed.
    wait_for("first epoch applied", &e, || batches_at_least(&e, 3)).await;
    wait_for("index = cache before the restart", &e, || {
        index_is(&server, &e, &before, &[])
    })
    .await;
    let s = &e.ingest;
    assert!(s.replays_ok.load(Relaxed) >= 1, "{}", counters(&e));
    assert!(!s.stale.load(Relaxed), "{}", counters(&e));
    assert_eq!(s.restarts.load(Relaxed), 0, "{}", counters(&e));
    assert_eq!(
        s.batches.load(Relaxed),
        3,
        "restarted before the checkpoint? {}",
        counters(&e)
    );

    assert_eq!(p.wait_done(), 2);
    wait_for("second epoch applied", &e, || batches_at_least(&e, 5)).await;
    wait_for("index = cache after the restart", &e, || {
        index_is(&server, &e, &after, &gone)
    })
    .await;
    assert!(s.restarts.load(Relaxed) >= 1, "{}", counters(&e));
    assert_eq!(s.epoch.load(Relaxed), 1, "{}", counters(&e));
    assert!(!s.stale.load(Relaxed), "{}", counters(&e));
    assert_eq!(s.replays_failed.load(Relaxed), 0, "{}", counters(&e));
    assert_eq!(s.tracked_blocks.load(Relaxed), 3);
    assert_eq!(metric(&server, "kvmesh_kv_events_restarts_total"), 1.0);
    p.finish();
    server.shutdown().await;
}

/// No replay socket: a lost batch leaves the engine stale (metric 1), its older blocks kept;
/// the next `AllBlocksCleared` resynchronises it exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_is_stale_until_all_blocks_cleared() {
    let mut c = Cache::default();
    let a = [H::Int(31), H::Int(32)];
    let lost = [H::bytes(11, 1)];
    let f = [H::Int(35)];
    let g = [H::bytes(12, 1), H::Int(37)];
    let mut steps = vec![batch(20.0, vec![c.store(&a, None, None)], "map")];
    let mut l = batch(21.0, vec![c.store(&lost, None, None)], "array");
    l["drop"] = json!(true);
    steps.push(l);
    // The batch that reveals the gap (see `batch_after_unreplayable_gap_is_applied` for what
    // happens to its own events).
    steps.push(batch(22.0, vec![c.store(&f, None, Some("GPU"))], "map"));
    steps.push(batch(23.0, vec![c.store(&g, None, None)], "array"));
    let (ka, klost, kg) = (
        [c.key(&a[0]), c.key(&a[1])],
        c.key(&lost[0]),
        [c.key(&g[0]), c.key(&g[1])],
    );
    steps.push(json!({"sleep_ms": CHECKPOINT_MS}));
    let h = [H::bytes(13, 1)];
    steps.push(batch(24.0, vec![c.clear(), c.store(&h, None, None)], "map"));
    let after = c.expected();
    let gone = c.gone_keys();

    let p = PyPublisher::start(&steps, false);
    let (server, e) = start_router(&p).await;
    // Checkpoint: g (the last batch before the pause) applied; a kept; the lost block unknown.
    wait_for("batches after the gap", &e, || {
        present(&server, &e, &kg, "g")
    })
    .await;
    assert!(
        holds_all(&server, &e, &ka),
        "blocks before the gap are kept"
    );
    assert!(
        !holds_all(&server, &e, &[klost]),
        "the lost batch's block cannot be known"
    );
    let s = &e.ingest;
    assert!(s.stale.load(Relaxed), "{}", counters(&e));
    assert_eq!(metric(&server, "kvmesh_kv_events_stale"), 1.0);
    assert_eq!(s.gaps.load(Relaxed), 1, "{}", counters(&e));
    assert_eq!(s.replays_ok.load(Relaxed), 0, "{}", counters(&e));

    assert_eq!(p.wait_done(), 5);
    wait_for("resynchronised by AllBlocksCleared", &e, || {
        index_is(&server, &e, &after, &gone)?;
        if s.stale.load(Relaxed) {
            return Err("still stale".into());
        }
        Ok(())
    })
    .await;
    assert_eq!(metric(&server, "kvmesh_kv_events_stale"), 0.0);
    assert_eq!(s.restarts.load(Relaxed), 0, "{}", counters(&e));
    assert_eq!(s.tracked_blocks.load(Relaxed), 1);
    p.finish();
    server.shutdown().await;
}

/// Garbage on the wire (counted as malformed) is a lost batch; the replay returns the same
/// garbage, so the gap cannot be filled: stale, with the stream still flowing; a restart
/// (seq back to 0) resynchronises it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_a_gap_replay_cannot_fill_until_restart() {
    let mut c = Cache::default();
    let a = [H::bytes(14, 1), H::Int(42)];
    let b = [H::Int(43)];
    let k = [H::bytes(15, 1)];
    let mut steps = vec![batch(30.0, vec![c.store(&a, None, None)], "array")];
    // Not msgpack of a batch: an array header announcing 3 items, then a truncated float.
    steps.push(json!({"payload_hex": "93cb0102"}));
    steps.push(batch(
        31.0,
        vec![c.store(&b, Some(&a[1]), Some("GPU"))],
        "map",
    ));
    steps.push(batch(32.0, vec![c.store(&k, None, None)], "array"));
    let (ka, kk) = ([c.key(&a[0]), c.key(&a[1])], c.key(&k[0]));
    steps.push(json!({"sleep_ms": CHECKPOINT_MS}));
    steps.push(json!({"reset_seq": true}));
    c.drop_all();
    let n = [H::Int(44), H::bytes(16, 1)];
    steps.push(batch(130.0, vec![c.store(&n, None, None)], "map"));
    let after = c.expected();
    let gone = c.gone_keys();

    let p = PyPublisher::start(&steps, true);
    let (server, e) = start_router(&p).await;
    wait_for("the batch after the failed replay", &e, || {
        present(&server, &e, &[kk], "k")
    })
    .await;
    assert!(
        holds_all(&server, &e, &ka),
        "blocks before the gap are kept"
    );
    let s = &e.ingest;
    // Once on the stream, (here) once more in the replay.
    assert!(s.malformed.load(Relaxed) >= 1, "{}", counters(&e));
    assert_eq!(s.gaps.load(Relaxed), 1, "{}", counters(&e));
    assert_eq!(s.replays_ok.load(Relaxed), 0, "{}", counters(&e));
    assert_eq!(s.replays_failed.load(Relaxed), 1, "{}", counters(&e));
    assert!(s.stale.load(Relaxed), "{}", counters(&e));
    assert_eq!(metric(&server, "kvmesh_kv_events_stale"), 1.0);
    assert!(s.connected.load(Relaxed), "{}", counters(&e));

    assert_eq!(p.wait_done(), 1);
    wait_for("resynchronised by the restart", &e, || {
        index_is(&server, &e, &after, &gone)?;
        if s.stale.load(Relaxed) {
            return Err("still stale".into());
        }
        Ok(())
    })
    .await;
    assert!(s.restarts.load(Relaxed) >= 1, "{}", counters(&e));
    assert_eq!(metric(&server, "kvmesh_kv_events_stale"), 0.0);
    p.finish();
    server.shutdown().await;
}

/// The batch whose arrival reveals an unreplayable gap carries real events: once the shell
/// gives up on the gap it must still apply them. Here that batch is the engine's
/// `AllBlocksCleared` (its exact resynchronisation point): afterwards the engine is fresh and
/// the blocks it cleared are gone. (Regression test: the shell used to drop that batch.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_after_unreplayable_gap_is_applied() {
    let mut c = Cache::default();
    let a = [H::Int(61), H::bytes(17, 1)];
    let lost = [H::Int(62)];
    let mut steps = vec![batch(40.0, vec![c.store(&a, None, None)], "array")];
    let mut l = batch(41.0, vec![c.store(&lost, None, None)], "map");
    l["drop"] = json!(true);
    steps.push(l);
    let r = [H::bytes(18, 1)];
    steps.push(batch(
        42.0,
        vec![c.clear(), c.store(&r, None, None)],
        "array",
    ));
    let t = [H::Int(63)];
    steps.push(batch(43.0, vec![c.store(&t, Some(&r[0]), None)], "map"));
    // A plain root store: applied whatever happened to the batches before it.
    let z = [H::bytes(19, 1)];
    steps.push(batch(44.0, vec![c.store(&z, None, None)], "array"));
    let expected = c.expected();
    let gone = c.gone_keys();
    let kz = c.key(&z[0]);

    let p = PyPublisher::start(&steps, false);
    let (server, e) = start_router(&p).await;
    assert_eq!(p.wait_done(), 5);
    wait_for("the last batch", &e, || present(&server, &e, &[kz], "z")).await;
    let s = &e.ingest;
    let r1 = index_is(&server, &e, &expected, &gone);
    let stale = s.stale.load(Relaxed);
    assert!(
        r1.is_ok() && !stale,
        "the batch received right after the gap (AllBlocksCleared + a store) was not applied: \
         {r1:?}, stale={stale}\n  ingest: {}",
        counters(&e)
    );
    p.finish();
    server.shutdown().await;
}

/// A seq that goes back (without the engine restarting) after a gap the replay could not
/// fill: the router gives that gap up and takes the batch as its new baseline, and every
/// later batch is applied. (QA: the re-stepped batch read as a restart and opened a gap that
/// no replay would ever fill; every later batch was held back for good, the engine's next
/// `AllBlocksCleared` included.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seq_that_goes_back_after_an_unfilled_gap_does_not_stop_the_stream() {
    let mut c = Cache::default();
    let mut steps = Vec::new();
    for (i, h) in [71, 72, 73].into_iter().enumerate() {
        steps.push(batch(
            50.0 + i as f64,
            vec![c.store(&[H::Int(h)], None, None)],
            "map",
        ));
    }
    // Seq 3 is lost for good (not in the replay either); seq 4 reveals the gap.
    steps.push(json!({"skip_seq": true}));
    steps.push(batch(
        54.0,
        vec![c.store(&[H::Int(74)], None, None)],
        "array",
    ));
    steps.push(json!({"sleep_ms": CHECKPOINT_MS}));
    // Seq 1 again, with other events: the replay from 0 gets past it and meets the hole.
    steps.push(json!({"set_seq": 1}));
    steps.push(batch(55.0, vec![c.store(&[H::Int(75)], None, None)], "map"));
    steps.push(json!({"sleep_ms": CHECKPOINT_MS}));
    // Later batches, the engine's cache reset among them: applied, exact again.
    steps.push(batch(
        56.0,
        vec![c.store(&[H::Int(76)], None, None)],
        "array",
    ));
    let z = [H::bytes(20, 1)];
    steps.push(batch(57.0, vec![c.clear(), c.store(&z, None, None)], "map"));
    let (after, gone) = (c.expected(), c.gone_keys());

    let p = PyPublisher::start(&steps, true);
    let (server, e) = start_router(&p).await;
    p.wait_done();
    let s = &e.ingest;
    wait_for("the batches after the seq went back", &e, || {
        index_is(&server, &e, &after, &gone)?;
        if s.stale.load(Relaxed) {
            return Err("still stale".into());
        }
        Ok(())
    })
    .await;
    p.finish();
    server.shutdown().await;
}
