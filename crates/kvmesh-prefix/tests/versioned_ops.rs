//! Versioned op batches are idempotent: any interleaving of several engines' batches, each
//! engine's in version order, with any duplicates and late redeliveries of older batches,
//! leaves the index exactly as applying each batch once, in order. Marks join by max expiry
//! whatever their order and repetition. Every change passes through the sink trait.

use kvmesh_prefix::{
    BlockKey, EngineId, IndexOp, IndexSink, OpVersion, PrefixIndex, RecordingSink, SinkCall,
    Target, Tee,
};
use proptest::prelude::*;

const ENGINES: u32 = 3;
const KEYS: u64 = 24;

fn target(slot: u32) -> Target {
    Target {
        slot,
        engine: EngineId::from_url(&format!("http://127.0.0.1:{}", 9000 + slot)),
    }
}

fn key(k: u64) -> BlockKey {
    // Every fourth key is an anchor (bit 0), like real chains.
    BlockKey((k + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) & !1 | u64::from(k.is_multiple_of(4)))
}

fn op() -> impl Strategy<Value = IndexOp> {
    prop_oneof![
        6 => (0..KEYS).prop_map(|k| IndexOp::Stored(key(k))),
        3 => (0..KEYS).prop_map(|k| IndexOp::Removed(key(k))),
        1 => Just(IndexOp::Cleared),
    ]
}

/// Per engine, batches with increasing versions (an epoch bump restarts the seqs, sometimes
/// with a bare epoch start `seq: None`).
fn engine_batches() -> impl Strategy<Value = Vec<(OpVersion, Vec<IndexOp>)>> {
    prop::collection::vec((any::<u8>(), prop::collection::vec(op(), 0..8)), 1..12).prop_map(|raw| {
        let mut epoch = 0u32;
        let mut seq: Option<u64> = None;
        raw.into_iter()
            .map(|(r, ops)| {
                if r % 7 == 0 {
                    epoch += 1;
                    seq = if r % 2 == 0 { None } else { Some(0) };
                } else {
                    seq = Some(seq.map_or(0, |s| s + 1));
                }
                (OpVersion { epoch, seq }, ops)
            })
            .collect()
    })
}

fn fresh(capacity: u32) -> PrefixIndex {
    let mut idx = PrefixIndex::new();
    for e in 0..ENGINES {
        idx.add_engine(e, capacity).expect("add");
    }
    idx
}

/// What the index holds, comparable across runs (entry slots may differ).
fn contents(idx: &PrefixIndex) -> Vec<(u32, Vec<bool>, Option<kvmesh_prefix::EngineCounts>)> {
    (0..ENGINES)
        .map(|e| {
            let held = (0..KEYS).map(|k| idx.holds(e, key(k), 0)).collect();
            (e, held, idx.engine_counts(e))
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn redelivered_and_interleaved_batches_end_as_applied_once(
        per_engine in prop::collection::vec(engine_batches(), ENGINES as usize),
        picks in prop::collection::vec(any::<u32>(), 0..200),
        capacity in prop_oneof![Just(4u32), Just(1_000u32)],
    ) {
        // Reference: each engine's batches once, in order.
        let mut once = fresh(capacity);
        for (e, batches) in per_engine.iter().enumerate() {
            for (v, ops) in batches {
                prop_assert!(once.apply_batch(e as u32, *v, ops));
            }
        }
        // Delivery: engines interleaved by `picks`; each step delivers the engine's next batch,
        // or redelivers one it already delivered (a duplicate, or an older batch arriving late).
        let mut got = fresh(capacity);
        let mut sink = Tee(&mut got, RecordingSink::default());
        let mut next = vec![0usize; ENGINES as usize];
        for p in &picks {
            let e = (*p % ENGINES) as usize;
            let batches = &per_engine[e];
            let redeliver = (p / ENGINES).is_multiple_of(3) && next[e] > 0;
            let i = if redeliver { (*p as usize / 7) % next[e] } else { next[e] };
            let Some((v, ops)) = batches.get(i) else { continue };
            let applied = sink.apply_batch(target(e as u32), *v, ops);
            prop_assert_eq!(applied, !redeliver, "engine {} batch {}", e, i);
            if !redeliver {
                next[e] += 1;
            }
        }
        // The rest of every engine, in order, with a duplicate of each.
        for e in 0..ENGINES as usize {
            for (v, ops) in &per_engine[e][next[e]..] {
                prop_assert!(sink.apply_batch(target(e as u32), *v, ops));
                prop_assert!(!sink.apply_batch(target(e as u32), *v, ops));
            }
        }
        // The recording side saw each batch exactly once (only new ones pass the tee).
        let recorded = sink.1.calls.iter().filter(|c| matches!(c, SinkCall::Batch { .. })).count();
        prop_assert_eq!(recorded, per_engine.iter().map(Vec::len).sum::<usize>());
        prop_assert_eq!(contents(&got), contents(&once));
        let (a, b) = (got.stats(), once.stats());
        prop_assert_eq!((a.entries, a.confirmed, a.speculative, a.evicted), (b.entries, b.confirmed, b.speculative, b.evicted));
        got.check_invariants().map_err(TestCaseError::fail)?;
        for e in 0..ENGINES {
            prop_assert_eq!(got.applied_version(e), once.applied_version(e));
        }
    }

    #[test]
    fn marks_join_by_max_in_any_order_and_repetition(
        marks in prop::collection::vec((0..ENGINES, 0..KEYS, 1..6u64, 1u64..50), 1..40),
        order in prop::collection::vec(any::<u32>(), 0..80),
    ) {
        let apply = |seq: &[(u32, u64, u64, u64)]| {
            let mut idx = fresh(1_000);
            for &(e, k, n, exp) in seq {
                let keys: Vec<BlockKey> = (k..k + n).map(|x| key(x % KEYS)).collect();
                IndexSink::mark(&mut idx, target(e), &keys, 0, 100 + exp, 1);
            }
            idx
        };
        let a = apply(&marks);
        // Reorder and repeat.
        let mut shuffled = marks.clone();
        for (i, o) in order.iter().enumerate() {
            let j = *o as usize % shuffled.len();
            let k = i % shuffled.len();
            shuffled.swap(j, k);
            if o % 5 == 0 {
                shuffled.push(marks[*o as usize % marks.len()]);
            }
        }
        let b = apply(&shuffled);
        for now in [0, 101, 120, 130, 149, 151] {
            for e in 0..ENGINES {
                for k in 0..KEYS {
                    prop_assert_eq!(a.holds(e, key(k), now), b.holds(e, key(k), now), "engine {} key {} at {}", e, k, now);
                }
            }
        }
    }
}

#[test]
fn a_newer_epoch_drops_the_engines_old_blocks_and_an_older_one_changes_nothing() {
    let mut idx = fresh(100);
    let v = |epoch, seq| OpVersion { epoch, seq };
    assert!(idx.apply_batch(
        0,
        v(0, Some(0)),
        &[IndexOp::Stored(key(1)), IndexOp::Stored(key(2))]
    ));
    assert!(idx.apply_batch(0, v(0, Some(1)), &[IndexOp::Removed(key(2))]));
    assert!(
        !idx.apply_batch(0, v(0, Some(1)), &[IndexOp::Removed(key(1))]),
        "duplicate"
    );
    assert!(idx.holds(0, key(1), 0));
    // Restart: epoch 1 begins (no batch yet): the old blocks are gone.
    assert!(idx.apply_batch(0, v(1, None), &[]));
    assert!(!idx.holds(0, key(1), 0));
    // A late batch of the old epoch changes nothing.
    assert!(!idx.apply_batch(0, v(0, Some(7)), &[IndexOp::Stored(key(3))]));
    assert!(!idx.holds(0, key(3), 0));
    assert!(idx.apply_batch(0, v(1, Some(0)), &[IndexOp::Stored(key(4))]));
    assert!(idx.holds(0, key(4), 0));
    assert_eq!(idx.stats().duplicates, 2);
    // Another engine is independent.
    assert!(idx.apply_batch(1, v(0, Some(0)), &[IndexOp::Stored(key(1))]));
    assert!(idx.holds(1, key(1), 0));
}
