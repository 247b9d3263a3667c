//! The ingestion state machine fed what an engine's decoder lets through (the decoder bounds
//! sizes, not values): seqs at the edges of u64 and in any order, hashes of every shape,
//! parents never stored, token counts that do not match the block size, block sizes of 0 and
//! `u32::MAX`, other media, interleaved with the shell's own calls (a restart, going stale,
//! a new block size). Never a panic; the index it feeds keeps its invariants; what it tracks
//! stays within its capacity.

use kvmesh_kvevents::{BlockHash, EventBatch, KvEvent, MsgValue};
use kvmesh_prefix::{EngineIngest, IndexOp, IngestConfig, PrefixIndex};
use proptest::prelude::*;

const CAPACITY: usize = 64;

fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(i64::MAX as u64),
        0u64..8,
        any::<u64>(),
    ]
}

fn hash() -> impl Strategy<Value = BlockHash> {
    prop_oneof![
        3 => (0u64..12).prop_map(BlockHash::Int),
        1 => edge_u64().prop_map(BlockHash::Int),
        1 => proptest::collection::vec(any::<u8>(), 0..40).prop_map(BlockHash::Bytes),
    ]
}

fn medium() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        3 => Just(Some("GPU".to_string())),
        1 => Just(None),
        1 => Just(Some("CPU".to_string())),
        1 => Just(Some(String::new())),
    ]
}

fn event() -> impl Strategy<Value = KvEvent> {
    let stored = (
        proptest::collection::vec(hash(), 0..6),
        proptest::option::of(hash()),
        proptest::collection::vec(any::<u32>(), 0..24),
        prop_oneof![Just(4u32), Just(0), Just(1), Just(u32::MAX), 0u32..9],
        proptest::option::of(prop_oneof![
            Just(i64::MIN),
            Just(i64::MAX),
            Just(-1i64),
            0i64..3
        ]),
        medium(),
        proptest::option::of(proptest::collection::vec(
            prop_oneof![
                Just(MsgValue::Nil),
                any::<i64>().prop_map(MsgValue::Int),
                ".{0,8}".prop_map(MsgValue::Str),
            ],
            0..3,
        )),
        proptest::option::of(prop_oneof![Just(i64::MIN), Just(-1i64), 0i64..3]),
    )
        .prop_map(
            |(block_hashes, parent, token_ids, block_size, lora_id, medium, extra_keys, group)| {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash: parent,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name: None,
                    extra_keys,
                    group_idx: group,
                    kv_cache_spec_kind: None,
                    kv_cache_spec_sliding_window: None,
                    locality: None,
                    ownership: None,
                }
            },
        );
    let removed =
        (proptest::collection::vec(hash(), 0..6), medium()).prop_map(|(block_hashes, medium)| {
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx: None,
                locality: None,
                ownership: None,
            }
        });
    prop_oneof![4 => stored, 2 => removed, 1 => Just(KvEvent::AllBlocksCleared)]
}

/// One step: a batch at a seq (the next one expected, or one from the edges), or one of the
/// shell's calls.
#[derive(Debug, Clone)]
enum Step {
    Batch {
        next: bool,
        seq: u64,
        events: Vec<KvEvent>,
    },
    Restart,
    Stale,
    BlockSize(u32),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (any::<bool>(), edge_u64(), proptest::collection::vec(event(), 0..5))
            .prop_map(|(next, seq, events)| Step::Batch { next, seq, events }),
        1 => Just(Step::Restart),
        1 => Just(Step::Stale),
        1 => prop_oneof![Just(0u32), Just(4), Just(8), Just(u32::MAX)].prop_map(Step::BlockSize),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn anything_the_decoder_lets_through_is_ingested_without_panic(
        steps in proptest::collection::vec(step(), 1..40),
    ) {
        let mut idx = PrefixIndex::new();
        idx.add_engine(0, CAPACITY as u32).unwrap();
        let mut ing = EngineIngest::new(IngestConfig { block_size: 4, capacity: CAPACITY });
        let mut ops: Vec<IndexOp> = Vec::new();
        for (t, s) in steps.into_iter().enumerate() {
            let now = t as u64 * 1_000;
            ops.clear();
            match s {
                Step::Batch { next, seq, events } => {
                    let seq = if next { ing.next_seq().unwrap_or(0) } else { seq };
                    let batch = EventBatch { ts: now as f64, events, data_parallel_rank: None };
                    let _ = ing.on_batch(seq, &batch, now, &mut ops);
                }
                Step::Restart => ing.on_restart(&mut ops),
                Step::Stale => ing.mark_stale(now),
                Step::BlockSize(b) => ing.set_block_size(b, now),
            }
            idx.apply_all(0, &ops);
            prop_assert!(idx.check_invariants().is_ok(), "{:?}", idx.check_invariants());
            prop_assert!(ing.tracked_hashes() <= CAPACITY, "{} tracked", ing.tracked_hashes());
        }
    }
}
