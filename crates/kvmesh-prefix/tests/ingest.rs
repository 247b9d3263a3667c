//! The ingestion state machine on hand-made event streams: rehashing, chaining, copies,
//! extra keys, skipped events, seq gaps, duplicates, restarts, the capacity bound.

use kvmesh_kvevents::{BlockHash, DecodedBatch, EventBatch, KvEvent, MsgValue};
use kvmesh_prefix::{
    BlockKey, EngineIngest, ExtraKeys, IndexOp, IngestConfig, IngestOutcome, Match, PrefixIndex,
    Staleness, block_keys,
};
use proptest::prelude::*;

const BS: u32 = 4;

struct Rig {
    ing: EngineIngest,
    idx: PrefixIndex,
    ops: Vec<IndexOp>,
    out: Vec<Match>,
}

impl Rig {
    fn new(capacity: usize) -> Rig {
        let mut idx = PrefixIndex::new();
        idx.add_engine(0, capacity as u32).unwrap();
        idx.add_engine(1, 100).unwrap();
        Rig {
            ing: EngineIngest::new(IngestConfig {
                block_size: BS,
                capacity,
            }),
            idx,
            ops: Vec::new(),
            out: Vec::new(),
        }
    }

    fn feed(&mut self, seq: u64, events: Vec<KvEvent>) -> IngestOutcome {
        let batch = EventBatch {
            ts: 1000.0 + seq as f64,
            events,
            data_parallel_rank: None,
        };
        self.ops.clear();
        let o = self.ing.on_batch(seq, &batch, seq * 10, &mut self.ops);
        self.idx.apply_all(0, &self.ops);
        self.idx.check_invariants().unwrap();
        o
    }

    /// Engine 0's matched blocks for these tokens.
    fn matched(&mut self, tokens: &[u32], extra: ExtraKeys<'_>) -> u32 {
        let mut keys = Vec::new();
        block_keys(tokens, BS as usize, extra, &mut keys);
        self.idx.lookup(&keys, 0, &mut self.out);
        self.out
            .iter()
            .find(|m| m.engine == 0)
            .map_or(0, |m| m.blocks)
    }
}

fn h(v: u64) -> BlockHash {
    BlockHash::Int(v)
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::stored(
        hashes.iter().map(|&x| h(x)).collect(),
        parent.map(h),
        tokens.to_vec(),
        BS,
    )
}

fn toks(n: u32) -> Vec<u32> {
    (0..n).map(|i| 100 + i).collect()
}

#[test]
fn stored_chains_across_events_and_copies_are_counted() {
    let mut r = Rig::new(100);
    let t = toks(16);
    assert_eq!(
        r.feed(0, vec![stored(&[1, 2], None, &t[..8])]),
        IngestOutcome::Applied
    );
    assert_eq!(
        r.feed(1, vec![stored(&[3], Some(2), &t[8..12])]),
        IngestOutcome::Applied
    );
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 3);
    // Ops come deepest first (the chain's first block ends up most recently used).
    let mut keys = Vec::new();
    block_keys(&t[..8], 4, ExtraKeys::NONE, &mut keys);
    r.ops.clear();
    r.ing.on_batch(
        2,
        &EventBatch {
            ts: 5.0,
            events: vec![stored(&[1, 2], None, &t[..8])],
            data_parallel_rank: None,
        },
        0,
        &mut r.ops,
    );
    assert_eq!(
        r.ops,
        vec![IndexOp::Stored(keys[1]), IndexOp::Stored(keys[0])]
    );
    r.idx.apply_all(0, &r.ops);
    // Block 2 now has two copies: one removal keeps it.
    assert_eq!(
        r.feed(3, vec![KvEvent::removed(vec![h(2)])]),
        IngestOutcome::Applied
    );
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 3);
    r.feed(4, vec![KvEvent::removed(vec![h(2)])]);
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 1);
    r.feed(5, vec![KvEvent::removed(vec![h(2), h(99)])]);
    let s = r.ing.stats();
    assert_eq!(
        (s.blocks_stored, s.blocks_removed, s.unknown_removed),
        (5, 2, 2)
    );
    assert_eq!(r.ing.tracked_hashes(), 2);
}

#[test]
fn unknown_parent_skips_the_chain_and_bytes_hashes_work() {
    let mut r = Rig::new(100);
    let t = toks(12);
    r.feed(0, vec![stored(&[5], Some(4), &t[4..8])]);
    r.feed(1, vec![stored(&[6], Some(5), &t[8..12])]);
    assert_eq!(r.ing.stats().unknown_parent_blocks, 2);
    assert!(r.idx.is_empty());
    // Bytes hashes: same keys as ints.
    let b = |v: u8| BlockHash::Bytes(vec![v; 32]);
    r.feed(
        2,
        vec![KvEvent::stored(vec![b(1), b(2)], None, t[..8].to_vec(), BS)],
    );
    r.feed(
        3,
        vec![KvEvent::stored(vec![b(3)], Some(b(2)), t[8..].to_vec(), BS)],
    );
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 3);
    r.feed(4, vec![KvEvent::removed(vec![b(1)])]);
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 0);
}

#[test]
fn wrong_block_size_cpu_medium_and_malformed_events_are_skipped() {
    let mut r = Rig::new(100);
    let t = toks(8);
    let mut ev = stored(&[1], None, &t[..8]);
    if let KvEvent::BlockStored { block_size, .. } = &mut ev {
        *block_size = 8;
    }
    let mut cpu = stored(&[2], None, &t[..4]);
    if let KvEvent::BlockStored { medium, .. } = &mut cpu {
        *medium = Some("CPU".into());
    }
    r.feed(0, vec![ev, cpu, stored(&[3], None, &t[..5])]);
    let s = *r.ing.stats();
    assert_eq!(
        (s.skipped_block_size, s.skipped_medium, s.skipped_malformed),
        (1, 1, 1)
    );
    assert!(r.idx.is_empty());
    // A CPU removal never removes the GPU copy.
    r.feed(1, vec![stored(&[2], None, &t[..4])]);
    let mut rm = KvEvent::removed(vec![h(2)]);
    if let KvEvent::BlockRemoved { medium, .. } = &mut rm {
        *medium = Some("CPU".into());
    }
    r.feed(2, vec![rm]);
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 1);
}

fn with_extras(mut ev: KvEvent, lora: Option<&str>, extra: Option<Vec<MsgValue>>) -> KvEvent {
    if let KvEvent::BlockStored {
        lora_name,
        extra_keys,
        ..
    } = &mut ev
    {
        *lora_name = lora.map(str::to_string);
        *extra_keys = extra;
    }
    ev
}

#[test]
fn lora_salt_and_opaque_extra_keys() {
    let t = toks(8);
    let s = |x: &str| MsgValue::str(x);
    // LoRA from lora_name, salt from the first block's extra keys (after the LoRA name).
    let mut r = Rig::new(100);
    let ev = with_extras(
        stored(&[1, 2], None, &t),
        Some("ad"),
        Some(vec![
            MsgValue::Array(vec![s("ad"), s("tenant")]),
            MsgValue::Array(vec![s("ad")]),
        ]),
    );
    r.feed(0, vec![ev]);
    let both = ExtraKeys {
        lora_name: Some("ad"),
        cache_salt: Some("tenant"),
    };
    assert_eq!(r.matched(&t, both), 2);
    assert_eq!(r.matched(&t, ExtraKeys::lora("ad")), 0);
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 0);
    // Salt alone, extra keys nil on the second block.
    let mut r = Rig::new(100);
    let ev = with_extras(
        stored(&[1, 2], None, &t),
        None,
        Some(vec![MsgValue::Array(vec![s("x")]), MsgValue::Nil]),
    );
    r.feed(0, vec![ev]);
    assert_eq!(r.matched(&t, ExtraKeys::salt("x")), 2);
    // Multimodal identifiers: opaque, never matched by token-only keys.
    let mut r = Rig::new(100);
    let ev = with_extras(
        stored(&[1, 2], None, &t),
        None,
        Some(vec![MsgValue::Nil, MsgValue::Array(vec![s("mm-hash")])]),
    );
    r.feed(0, vec![ev]);
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 1);
    // Deprecated lora_id without a name: opaque too.
    let mut r = Rig::new(100);
    let mut ev = stored(&[1], None, &t[..4]);
    if let KvEvent::BlockStored { lora_id, .. } = &mut ev {
        *lora_id = Some(3);
    }
    r.feed(0, vec![ev]);
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 0);
    assert_eq!(r.idx.len(), 1);
}

#[test]
fn gap_replay_duplicates_and_give_up() {
    let mut r = Rig::new(100);
    let t = toks(12);
    let b0 = vec![stored(&[1], None, &t[..4])];
    let b1 = vec![stored(&[2], Some(1), &t[4..8])];
    let b2 = vec![stored(&[3], Some(2), &t[8..12])];
    assert_eq!(r.feed(0, b0.clone()), IngestOutcome::Applied);
    assert!(!r.ing.is_stale());
    // Batch 1 lost: batch 2 reveals the gap and is held back.
    assert_eq!(r.feed(2, b2.clone()), IngestOutcome::Gap { from: 1, to: 2 });
    assert!(r.ing.is_stale());
    assert_eq!(r.ing.staleness(), Staleness::AwaitingReplay);
    assert_eq!(r.ing.stale_since_us(), Some(20));
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 1);
    // Replay from 1: 0 again (duplicate), then 1 and 2.
    assert_eq!(r.feed(0, b0.clone()), IngestOutcome::Duplicate);
    assert!(r.ops.is_empty());
    assert_eq!(r.feed(1, b1.clone()), IngestOutcome::Applied);
    assert!(r.ing.is_stale(), "2 is still missing");
    assert_eq!(r.feed(2, b2.clone()), IngestOutcome::Applied);
    assert!(!r.ing.is_stale());
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 3);
    // A late duplicate from the live socket is ignored.
    assert_eq!(r.feed(1, b1.clone()), IngestOutcome::Duplicate);
    assert_eq!(r.ing.stats().duplicates, 2);
    // Another gap; the shell gives up: stays stale, next batch is the new baseline.
    assert_eq!(r.feed(7, vec![]), IngestOutcome::Gap { from: 3, to: 7 });
    assert_eq!(r.feed(8, vec![]), IngestOutcome::Gap { from: 3, to: 8 });
    assert_eq!(r.ing.stats().gaps, 2);
    r.ing.mark_stale(100);
    assert_eq!(r.feed(8, vec![]), IngestOutcome::Applied);
    assert_eq!(r.feed(9, vec![]), IngestOutcome::Applied);
    assert_eq!(r.ing.staleness(), Staleness::GaveUp);
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 3, "blocks kept");
    // AllBlocksCleared is an exact resync point.
    r.feed(10, vec![KvEvent::AllBlocksCleared]);
    assert!(!r.ing.is_stale());
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 0);
    assert!(r.idx.engine_counts(0).unwrap().entries == 0);
}

/// Given up on a gap, the shell steps the batch that revealed it again as the new baseline;
/// when the replay meanwhile moved the expected seq past it, it reads as a regression. It
/// starts a new epoch with that batch, stale until the next clear, and the stream flows on
/// (QA: it opened a gap no replay would fill, and every later batch was held back).
#[test]
fn a_regression_right_after_giving_up_is_the_new_baseline() {
    let mut r = Rig::new(100);
    let t = toks(8);
    for seq in 0..5 {
        r.feed(seq, vec![stored(&[seq + 1], None, &t[..4])]);
    }
    r.ing.mark_stale(100);
    let out = r.feed(2, vec![stored(&[20], None, &t[..4])]);
    assert!(
        matches!(out, IngestOutcome::Restarted { gap: None, .. }),
        "{out:?}"
    );
    assert_eq!(r.ing.pending_gap(), None);
    assert_eq!(r.ing.staleness(), Staleness::GaveUp);
    assert_eq!(
        r.matched(&t, ExtraKeys::NONE),
        1,
        "the new epoch holds its batch"
    );
    assert_eq!(r.feed(3, vec![]), IngestOutcome::Applied);
    assert_eq!(
        r.feed(4, vec![KvEvent::AllBlocksCleared]),
        IngestOutcome::Applied
    );
    assert!(!r.ing.is_stale());
}

#[test]
fn a_replayed_stream_that_is_not_the_applied_one_is_told_apart() {
    let mut r = Rig::new(100);
    let t = toks(8);
    let b = |seq: u64, ts: f64| EventBatch {
        ts,
        events: vec![stored(&[seq + 1], None, &t[..4])],
        data_parallel_rank: None,
    };
    // Nothing applied in this epoch: nothing to tell apart.
    assert!(!r.ing.is_another_stream([(0, &b(0, 5.0))]));
    for seq in 0..3 {
        r.feed(seq, vec![stored(&[seq + 1], None, &t[..4])]);
    }
    // The same stream, longer or as long: the applied one (feed stamps ts 1000 + seq).
    let same: Vec<EventBatch> = (0..5).map(|s| b(s, 1000.0 + s as f64)).collect();
    assert!(
        !r.ing
            .is_another_stream(same.iter().enumerate().map(|(s, x)| (s as u64, x)))
    );
    assert!(
        !r.ing
            .is_another_stream(same[..3].iter().enumerate().map(|(s, x)| (s as u64, x)))
    );
    // Shorter than what was applied, or empty: a new process's.
    assert!(
        r.ing
            .is_another_stream(same[..2].iter().enumerate().map(|(s, x)| (s as u64, x)))
    );
    assert!(r.ing.is_another_stream(std::iter::empty()));
    // As long, but a batch published at another time: another process's.
    let other: Vec<EventBatch> = (0..4).map(|s| b(s, 2000.0 + s as f64)).collect();
    assert!(
        r.ing
            .is_another_stream(other.iter().enumerate().map(|(s, x)| (s as u64, x)))
    );
}

#[test]
fn seq_regression_is_a_restart() {
    let mut r = Rig::new(100);
    let t = toks(8);
    r.feed(0, vec![stored(&[1, 2], None, &t)]);
    r.feed(1, vec![]);
    r.idx.store(1, BlockKey(1)); // another engine's entry survives
    // Same seq 0, other content (other ts): restart, blocks dropped, batch applied.
    let o = r.feed(0, vec![stored(&[7], None, &t[..4])]);
    assert_eq!(
        o,
        IngestOutcome::Restarted {
            epoch: 1,
            gap: None
        }
    );
    assert_eq!(r.ops[0], IndexOp::Cleared);
    assert_eq!(r.matched(&t, ExtraKeys::NONE), 1);
    assert_eq!(r.idx.engine_counts(1).unwrap().entries, 1);
    // Restart seen at seq 3: the new epoch's 0..3 are missing.
    r.feed(1, vec![]);
    r.feed(2, vec![]);
    r.feed(3, vec![]);
    r.feed(4, vec![]);
    let o = r.feed(2, vec![stored(&[9], None, &t[..4])]);
    assert_eq!(
        o,
        IngestOutcome::Restarted {
            epoch: 2,
            gap: Some((0, 2))
        }
    );
    assert!(r.ing.is_stale());
    assert!(r.idx.engine_counts(0).unwrap().entries == 0);
    // First batch of a stream joined late: gap from 0.
    let mut r = Rig::new(100);
    assert_eq!(r.feed(5, vec![]), IngestOutcome::Gap { from: 0, to: 5 });
    // Explicit restart.
    r.ops.clear();
    r.ing.on_restart(&mut r.ops);
    assert_eq!(r.ops, vec![IndexOp::Cleared]);
    assert_eq!(
        (r.ing.epoch(), r.ing.next_seq(), r.ing.is_stale()),
        (1, None, false)
    );
    // Decoded batches count the decoder's unknown events.
    let d = DecodedBatch {
        batch: EventBatch {
            ts: 0.5,
            events: vec![],
            data_parallel_rank: None,
        },
        skipped_unknown: 2,
    };
    r.ing.on_decoded(0, &d, 0, &mut r.ops);
    assert_eq!(r.ing.stats().skipped_unknown, 2);
}

#[test]
fn hash_map_is_bounded_by_capacity() {
    let mut r = Rig::new(4);
    for i in 0..10u32 {
        let t: Vec<u32> = (0..4).map(|j| i * 10 + j).collect();
        r.feed(u64::from(i), vec![stored(&[i as u64 + 1], None, &t)]);
        assert!(r.ing.tracked_hashes() <= 4);
    }
    assert_eq!(r.ing.stats().evicted_hashes, 6);
    // The index holds exactly the tracked (most recent) blocks.
    assert_eq!(r.idx.engine_counts(0).unwrap().entries, 4);
    for i in 0..10u32 {
        let t: Vec<u32> = (0..4).map(|j| i * 10 + j).collect();
        let want = u32::from(i >= 6);
        assert_eq!(r.matched(&t, ExtraKeys::NONE), want, "block {i}");
    }
}

fn arb_event() -> impl Strategy<Value = KvEvent> {
    let hash = 0u64..40;
    prop_oneof![
        4 => (prop::collection::vec(hash.clone(), 0..5), prop::option::of(hash.clone()), 0u32..3, 0u32..20, any::<bool>())
            .prop_map(|(hs, p, bsel, extra_tok, cpu)| {
                let bs = [BS, BS, 8][bsel as usize];
                let n = hs.len() as u32 * bs + u32::from(extra_tok == 0);
                let mut ev = KvEvent::stored(
                    hs.into_iter().map(BlockHash::Int).collect(),
                    p.map(BlockHash::Int),
                    (0..n).map(|i| (i * 7 + extra_tok) % 5).collect(),
                    bs,
                );
                if cpu
                    && extra_tok % 5 == 0
                    && let KvEvent::BlockStored { medium, .. } = &mut ev
                {
                    *medium = Some("CPU".into());
                }
                ev
            }),
        3 => prop::collection::vec(hash, 0..4)
            .prop_map(|hs| KvEvent::removed(hs.into_iter().map(BlockHash::Int).collect())),
        1 => Just(KvEvent::AllBlocksCleared),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Hostile or buggy streams: random events and seqs never panic, never exceed the bounds,
    /// and leave the index consistent with the tracked hashes.
    #[test]
    fn random_streams_stay_bounded(
        batches in prop::collection::vec((0u64..30, prop::collection::vec(arb_event(), 0..6)), 1..60),
        cap in 1usize..12,
    ) {
        let mut r = Rig::new(cap);
        for (seq, events) in batches {
            r.feed(seq, events);
            prop_assert!(r.ing.tracked_hashes() <= cap);
            let c = r.idx.engine_counts(0).unwrap();
            prop_assert!(c.entries as usize <= cap);
            prop_assert!(c.entries as usize <= r.ing.tracked_hashes());
            if r.ing.pending_gap().is_some() {
                prop_assert!(r.ing.is_stale());
            }
        }
    }
}
