//! Property tests: arbitrary batches round-trip; arbitrary, truncated and
//! mutated bytes never panic and never produce output beyond the limits.

use kvmesh_kvevents::{
    BlockHash, DecodeLimits, DecodedBatch, EventBatch, KvEvent, MsgValue, WireEncoding,
    decode_batch, decode_frame, encode_batch,
};
use proptest::prelude::*;

fn hash() -> impl Strategy<Value = BlockHash> {
    prop_oneof![
        any::<u64>().prop_map(BlockHash::Int),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(BlockHash::Bytes),
    ]
}

fn opt_str() -> impl Strategy<Value = Option<String>> {
    proptest::option::of("[a-zA-Z0-9_é-]{0,40}")
}

fn leaf() -> impl Strategy<Value = MsgValue> {
    prop_oneof![
        Just(MsgValue::Nil),
        any::<bool>().prop_map(MsgValue::Bool),
        any::<u64>().prop_map(MsgValue::UInt),
        (i64::MIN..0).prop_map(MsgValue::Int),
        any::<f64>()
            .prop_filter("NaN breaks equality", |f| !f.is_nan())
            .prop_map(MsgValue::F64),
        "[a-z]{0,40}".prop_map(MsgValue::Str),
        proptest::collection::vec(any::<u8>(), 0..20).prop_map(MsgValue::Bin),
    ]
}

fn value() -> impl Strategy<Value = MsgValue> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(MsgValue::Array),
            proptest::collection::vec((inner.clone(), inner), 0..3).prop_map(MsgValue::Map),
        ]
    })
}

fn event(map_only_fields: bool) -> impl Strategy<Value = KvEvent> {
    let stored = (
        proptest::collection::vec(hash(), 0..5),
        proptest::option::of(hash()),
        proptest::collection::vec(any::<u32>(), 0..40),
        any::<u32>(),
        proptest::option::of(any::<i64>()),
        (opt_str(), opt_str(), opt_str()),
        proptest::option::of(proptest::collection::vec(value(), 0..4)),
        (
            proptest::option::of(any::<i64>()),
            proptest::option::of(any::<i64>()),
        ),
        (opt_str(), opt_str()),
    )
        .prop_map(
            move |(
                hs,
                parent,
                toks,
                bs,
                lora_id,
                (medium, lora_name, kind),
                extra,
                (g, w),
                (loc, own),
            )| {
                KvEvent::BlockStored {
                    block_hashes: hs,
                    parent_block_hash: parent,
                    token_ids: toks,
                    block_size: bs,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys: extra,
                    group_idx: g,
                    kv_cache_spec_kind: kind,
                    kv_cache_spec_sliding_window: w,
                    locality: loc.filter(|_| map_only_fields),
                    ownership: own.filter(|_| map_only_fields),
                }
            },
        );
    let removed = (
        proptest::collection::vec(hash(), 0..5),
        opt_str(),
        proptest::option::of(any::<i64>()),
        (opt_str(), opt_str()),
    )
        .prop_map(move |(hs, medium, g, (loc, own))| KvEvent::BlockRemoved {
            block_hashes: hs,
            medium,
            group_idx: g,
            locality: loc.filter(|_| map_only_fields),
            ownership: own.filter(|_| map_only_fields),
        });
    prop_oneof![stored, removed, Just(KvEvent::AllBlocksCleared)]
}

fn batch(map_only_fields: bool) -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>().prop_filter("NaN breaks equality", |f| !f.is_nan()),
        proptest::collection::vec(event(map_only_fields), 0..6),
        proptest::option::of(any::<i64>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
        })
}

fn small_limits() -> DecodeLimits {
    DecodeLimits {
        max_payload_bytes: 4096,
        max_events_per_batch: 3,
        max_hashes_per_event: 3,
        max_tokens_per_event: 16,
        max_hash_bytes: 16,
        max_string_bytes: 16,
        max_extra_values: 8,
        max_extra_depth: 2,
    }
}

/// Checks a successful decode against the limits it ran with.
fn within(d: &DecodedBatch, l: &DecodeLimits) -> bool {
    d.batch.events.len() + d.skipped_unknown <= l.max_events_per_batch
        && d.batch.events.iter().all(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                medium,
                lora_name,
                ..
            } => {
                block_hashes.len() <= l.max_hashes_per_event
                    && token_ids.len() <= l.max_tokens_per_event
                    && block_hashes
                        .iter()
                        .chain(parent_block_hash)
                        .all(|h| !matches!(h, BlockHash::Bytes(b) if b.len() > l.max_hash_bytes))
                    && [medium, lora_name]
                        .iter()
                        .all(|s| s.as_ref().is_none_or(|s| s.len() <= l.max_string_bytes))
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                block_hashes.len() <= l.max_hashes_per_event
            }
            KvEvent::AllBlocksCleared => true,
        })
}

fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
    for l in [DecodeLimits::default(), small_limits()] {
        if let Ok(d) = decode_batch(bytes, &l) {
            prop_assert!(within(&d, &l), "limits exceeded: {d:?}");
        }
    }
    let seq = 1u64.to_be_bytes();
    let _ = decode_frame(&[&b"t"[..], &seq, bytes], &small_limits());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn array_round_trip(b in batch(false)) {
        let bytes = encode_batch(&b, WireEncoding::Array);
        let d = decode_batch(&bytes, &DecodeLimits::default()).unwrap();
        prop_assert_eq!(&d.batch, &b);
        prop_assert_eq!(encode_batch(&d.batch, WireEncoding::Array), bytes);
    }

    #[test]
    fn map_round_trip(b in batch(true)) {
        let bytes = encode_batch(&b, WireEncoding::Map);
        let d = decode_batch(&bytes, &DecodeLimits::default()).unwrap();
        prop_assert_eq!(&d.batch, &b);
        prop_assert_eq!(encode_batch(&d.batch, WireEncoding::Map), bytes);
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        check(&bytes)?;
    }

    #[test]
    fn msgpack_shaped_noise_never_panics(
        bytes in proptest::collection::vec(
            prop_oneof![
                Just(0x90u8), Just(0x91), Just(0x93), Just(0x9c), Just(0x81), Just(0x88),
                Just(0xc0), Just(0xcb), Just(0xcf), Just(0xdd), Just(0xdf), Just(0xc4),
                Just(0xab), Just(0xa4), any::<u8>(),
            ],
            0..256,
        )
    ) {
        check(&bytes)?;
    }

    #[test]
    fn truncated_valid_payloads_fail_cleanly(b in batch(true), enc in prop_oneof![Just(WireEncoding::Array), Just(WireEncoding::Map)], frac in 0.0f64..1.0) {
        let bytes = encode_batch(&b, enc);
        let cut = ((bytes.len() as f64) * frac) as usize;
        prop_assert!(decode_batch(&bytes[..cut], &DecodeLimits::default()).is_err());
        check(&bytes[..cut])?;
    }

    #[test]
    fn mutated_valid_payloads_never_panic(
        b in batch(true),
        enc in prop_oneof![Just(WireEncoding::Array), Just(WireEncoding::Map)],
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
    ) {
        let mut bytes = encode_batch(&b, enc);
        for (idx, byte, op) in edits {
            if bytes.is_empty() {
                break;
            }
            let i = idx.index(bytes.len());
            match op {
                0 => bytes[i] = byte,
                1 => { bytes.remove(i); }
                _ => bytes.insert(i, byte),
            }
        }
        check(&bytes)?;
    }
}
