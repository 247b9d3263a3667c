//! Pure wire-format tests: round trips, golden bytes against Python, decoding
//! of hand-made vLLM-style payloads, and error reporting.

mod common;

use std::time::Duration;

use common::*;
use kvmesh_kvevents::json::{batch_from_json, batch_to_json};
use kvmesh_kvevents::{
    BlockHash, DecodeError, DecodeLimits, EventBatch, FrameError, KvEvent, MsgValue, WireEncoding,
    decode_batch, decode_frame, encode_batch, encode_value,
};
use serde_json::{Value, json};

const BOTH: [WireEncoding; 2] = [WireEncoding::Array, WireEncoding::Map];

fn s(x: &str) -> MsgValue {
    MsgValue::str(x)
}
fn u(x: u64) -> MsgValue {
    MsgValue::UInt(x)
}
fn arr(items: Vec<MsgValue>) -> MsgValue {
    MsgValue::Array(items)
}
fn map(entries: Vec<(&str, MsgValue)>) -> MsgValue {
    MsgValue::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}
const NIL: MsgValue = MsgValue::Nil;

fn decode(v: &MsgValue) -> Result<kvmesh_kvevents::DecodedBatch, DecodeError> {
    decode_batch(&encode_value(v), &DecodeLimits::default())
}

#[test]
fn round_trip_both_encodings() {
    for batch in sample_batches() {
        for enc in BOTH {
            let bytes = encode_batch(&batch, enc);
            let got = decode_batch(&bytes, &DecodeLimits::default()).unwrap();
            assert_eq!(got.batch, batch, "{enc}");
            assert_eq!(got.skipped_unknown, 0);
            // Re-encoding a decoded batch is byte-identical.
            assert_eq!(encode_batch(&got.batch, enc), bytes, "{enc}");
        }
    }
    let b = map_only_batch();
    let got = decode_batch(
        &encode_batch(&b, WireEncoding::Map),
        &DecodeLimits::default(),
    )
    .unwrap();
    assert_eq!(got.batch, b);
}

#[test]
fn encodings_have_vllm_shapes() {
    let batch = &sample_batches()[1];
    let a = encode_batch(batch, WireEncoding::Array);
    // [ts, events, rank]: fixarray(3), float64 ts, fixarray(5) of events.
    assert_eq!(a[0], 0x93);
    assert_eq!(a[1], 0xcb);
    assert_eq!(a[10], 0x95);
    // First event: fixarray(12) starting with fixstr "BlockStored".
    assert_eq!(a[11], 0x9c);
    assert_eq!(&a[12..24], b"\xabBlockStored");
    let m = encode_batch(batch, WireEncoding::Map);
    // Event 0 has all optional fields except locality/ownership -> 12 entries.
    assert_eq!(m[11], 0x8c);
    assert_eq!(&m[12..29], b"\xa4type\xabBlockStored");
    // A bare KvEvent::stored omits the defaulted fields: 8 entries.
    let plain = encode_batch(&sample_batches()[0], WireEncoding::Map);
    assert_eq!(plain[11], 0x88);
    // None rank is written as nil (array_like envelopes are never shortened).
    let empty = encode_batch(&sample_batches()[2], WireEncoding::Map);
    assert_eq!(empty, [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0xc0]);
}

#[test]
fn wire_encoding_from_str() {
    assert_eq!(
        "array".parse::<WireEncoding>().unwrap(),
        WireEncoding::Array
    );
    assert_eq!("MAP".parse::<WireEncoding>().unwrap(), WireEncoding::Map);
    assert!("msgpack".parse::<WireEncoding>().is_err());
    assert_eq!(WireEncoding::Array.to_string(), "array");
}

#[test]
fn golden_bytes_match_python() {
    let mut batches = sample_batches();
    batches.push(map_only_batch());
    let mut cases = Vec::new();
    for (i, b) in batches.iter().enumerate() {
        for enc in BOTH {
            if i == batches.len() - 1 && enc == WireEncoding::Array {
                continue; // map-only fields
            }
            cases.push((b.clone(), enc));
        }
    }
    let input: Vec<Value> = cases
        .iter()
        .map(|(b, enc)| json!({"batch": batch_to_json(b), "encoding": enc.as_str()}))
        .collect();
    let out = run_python(
        "kv_events_golden.py",
        &[],
        &serde_json::to_string(&input).unwrap(),
        Duration::from_secs(30),
    );
    let out: Value = serde_json::from_str(out.trim()).unwrap();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    for (i, (b, enc)) in cases.iter().enumerate() {
        let ours = hex(&encode_batch(b, *enc));
        assert_eq!(
            out["msgpack"][i].as_str().unwrap(),
            ours,
            "case {i} ({enc}) vs msgpack"
        );
    }
    match out["msgspec"].as_array() {
        Some(list) => {
            for (i, (b, enc)) in cases.iter().enumerate() {
                let ours = hex(&encode_batch(b, *enc));
                assert_eq!(
                    list[i].as_str().unwrap(),
                    ours,
                    "case {i} ({enc}) vs msgspec"
                );
            }
            eprintln!("golden: also matched msgspec {}", out["msgspec_version"]);
        }
        // msgspec is what vLLM encodes with; tests/python/requirements.txt installs it.
        None => panic!("msgspec is not installed: run scripts/install-test-deps.sh"),
    }
}

#[test]
fn json_round_trip() {
    let mut batches = sample_batches();
    batches.push(map_only_batch());
    for b in batches {
        let j = batch_to_json(&b);
        assert_eq!(batch_from_json(&j).unwrap(), b);
        let text = serde_json::to_string(&j).unwrap();
        assert_eq!(
            batch_from_json(&serde_json::from_str(&text).unwrap()).unwrap(),
            b
        );
    }
}

#[test]
fn decodes_oldest_layouts_with_missing_trailing_fields() {
    // vLLM 0.9: [ts, events] and 5-field BlockStored, 1-field BlockRemoved.
    let v = arr(vec![
        MsgValue::F64(1.5),
        arr(vec![
            arr(vec![
                s("BlockStored"),
                arr(vec![u(1), u(2)]),
                NIL,
                arr(vec![u(5), u(6), u(7), u(8)]),
                u(2),
                NIL,
            ]),
            arr(vec![s("BlockRemoved"), arr(vec![u(1)])]),
            arr(vec![s("AllBlocksCleared")]),
        ]),
    ]);
    let got = decode(&v).unwrap().batch;
    assert_eq!(got.data_parallel_rank, None);
    let mut expected = KvEvent::stored(vec![1.into(), 2.into()], None, vec![5, 6, 7, 8], 2);
    if let KvEvent::BlockStored { medium, .. } = &mut expected {
        *medium = None;
    }
    assert_eq!(got.events[0], expected);
    assert_eq!(
        got.events[1],
        KvEvent::BlockRemoved {
            block_hashes: vec![1.into()],
            medium: None,
            group_idx: None,
            locality: None,
            ownership: None
        }
    );
    assert_eq!(got.events[2], KvEvent::AllBlocksCleared);

    // 7-field (medium) and 8-field (lora_name) layouts, with rank.
    let v = arr(vec![
        MsgValue::F64(2.0),
        arr(vec![
            arr(vec![
                s("BlockStored"),
                arr(vec![u(9)]),
                u(8),
                arr(vec![u(1)]),
                u(1),
                MsgValue::int(4),
                s("CPU"),
            ]),
            arr(vec![
                s("BlockStored"),
                arr(vec![u(9)]),
                u(8),
                arr(vec![u(1)]),
                u(1),
                NIL,
                s("GPU"),
                s("lora"),
            ]),
            arr(vec![s("BlockRemoved"), arr(vec![u(9)]), s("GPU")]),
        ]),
        u(2),
    ]);
    let got = decode(&v).unwrap().batch;
    assert_eq!(got.data_parallel_rank, Some(2));
    let KvEvent::BlockStored {
        lora_id,
        medium,
        parent_block_hash,
        ..
    } = &got.events[0]
    else {
        panic!()
    };
    assert_eq!(
        (*lora_id, medium.as_deref(), parent_block_hash),
        (Some(4), Some("CPU"), &Some(BlockHash::Int(8)))
    );
    let KvEvent::BlockStored { lora_name, .. } = &got.events[1] else {
        panic!()
    };
    assert_eq!(lora_name.as_deref(), Some("lora"));
}

#[test]
fn decodes_newer_trailing_fields_and_ignores_unknown_ones() {
    let v = arr(vec![
        MsgValue::F64(3.0),
        arr(vec![arr(vec![
            s("BlockStored"),
            arr(vec![u(1)]),
            NIL,
            arr(vec![u(1)]),
            u(1),
            NIL,
            s("GPU"),
            NIL,
            arr(vec![NIL]),
            u(0),
            s("sliding_window"),
            u(128),
            s("future-field"),
            arr(vec![u(1), u(2)]),
        ])]),
        u(0),
        s("future-envelope-field"),
    ]);
    let got = decode(&v).unwrap().batch;
    let KvEvent::BlockStored {
        extra_keys,
        group_idx,
        kv_cache_spec_kind,
        kv_cache_spec_sliding_window,
        ..
    } = &got.events[0]
    else {
        panic!()
    };
    assert_eq!(extra_keys, &Some(vec![NIL]));
    assert_eq!(
        (
            *group_idx,
            kv_cache_spec_kind.as_deref(),
            *kv_cache_spec_sliding_window
        ),
        (Some(0), Some("sliding_window"), Some(128))
    );
}

#[test]
fn decodes_map_events_as_vllm_0_26_sends_them() {
    // Shape reported from vLLM 0.26.0 (kthena issue #1535).
    let ev = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(vec![u(15760518052499183552)])),
        ("parent_block_hash", NIL),
        ("token_ids", arr(vec![u(151644), u(872), u(198)])),
        ("block_size", u(16)),
        ("lora_id", NIL),
        ("medium", s("GPU")),
        ("lora_name", NIL),
        ("extra_keys", arr(vec![NIL])),
        ("group_idx", u(0)),
        ("kv_cache_spec_kind", s("full_attention")),
    ]);
    let v = arr(vec![MsgValue::F64(1789095808.8378847), arr(vec![ev]), u(0)]);
    let got = decode(&v).unwrap();
    assert_eq!(got.skipped_unknown, 0);
    let KvEvent::BlockStored {
        block_hashes,
        token_ids,
        block_size,
        kv_cache_spec_kind,
        ..
    } = &got.batch.events[0]
    else {
        panic!()
    };
    assert_eq!(block_hashes, &vec![BlockHash::Int(15760518052499183552)]);
    assert_eq!((token_ids.len(), *block_size), (3, 16));
    assert_eq!(kv_cache_spec_kind.as_deref(), Some("full_attention"));
    // Re-encoding in map mode reproduces the original bytes exactly.
    assert_eq!(
        encode_batch(&got.batch, WireEncoding::Map),
        encode_value(&v)
    );
}

#[test]
fn map_events_tag_anywhere_missing_optionals_unknown_fields() {
    let ev = map(vec![
        ("block_hashes", arr(vec![u(3)])),
        ("event_version", u(2)),
        ("type", s("BlockRemoved")),
        ("whatever", map(vec![("nested", arr(vec![u(1)]))])),
    ]);
    let v = map(vec![
        ("events", arr(vec![ev])),
        ("ts", MsgValue::F64(1.0)),
        ("extra", NIL),
    ]);
    let got = decode(&v).unwrap().batch;
    assert_eq!(
        got.events,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![3.into()],
            medium: None,
            group_idx: None,
            locality: None,
            ownership: None
        }]
    );
    assert_eq!(got.data_parallel_rank, None);
}

#[test]
fn bytes_hashes_signed_ints_and_nil_parent() {
    let v = arr(vec![
        MsgValue::F32(0.5),
        arr(vec![
            arr(vec![
                s("BlockStored"),
                arr(vec![
                    MsgValue::Bin(vec![0xab; 32]),
                    MsgValue::Int(-1),
                    MsgValue::Int(-9_000_000_000),
                ]),
                NIL,
                arr(vec![]),
                u(0),
                NIL,
                s("CPU"),
                NIL,
            ]),
            arr(vec![s("BlockRemoved"), arr(vec![MsgValue::Int(-2)]), NIL]),
        ]),
        MsgValue::int(-1),
    ]);
    let got = decode(&v).unwrap().batch;
    assert_eq!(got.ts, 0.5);
    assert_eq!(got.data_parallel_rank, Some(-1));
    let KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        ..
    } = &got.events[0]
    else {
        panic!()
    };
    assert_eq!(
        block_hashes,
        &vec![
            BlockHash::Bytes(vec![0xab; 32]),
            BlockHash::Int(u64::MAX),
            BlockHash::Int((-9_000_000_000i64) as u64)
        ]
    );
    assert_eq!(parent_block_hash, &None);
    let KvEvent::BlockRemoved { block_hashes, .. } = &got.events[1] else {
        panic!()
    };
    assert_eq!(block_hashes, &vec![BlockHash::Int(u64::MAX - 1)]);
    // Non-canonical signed encodings of positive ints (int64 marker) decode too.
    let mut raw = encode_value(&arr(vec![
        MsgValue::F64(1.0),
        arr(vec![arr(vec![s("BlockRemoved"), arr(vec![u(0)])])]),
    ]));
    let len = raw.len();
    raw.splice(len - 1.., [0xd3, 0, 0, 0, 0, 0, 0, 0, 42]);
    let got = decode_batch(&raw, &DecodeLimits::default()).unwrap().batch;
    let KvEvent::BlockRemoved { block_hashes, .. } = &got.events[0] else {
        panic!()
    };
    assert_eq!(block_hashes, &vec![BlockHash::Int(42)]);
}

#[test]
fn unknown_tags_are_skipped_and_counted() {
    let v = arr(vec![
        MsgValue::F64(1.0),
        arr(vec![
            arr(vec![
                s("BlockMoved"),
                arr(vec![u(1)]),
                map(vec![("deep", arr(vec![arr(vec![u(1)])]))]),
            ]),
            arr(vec![s("AllBlocksCleared")]),
            map(vec![
                ("type", s("FutureEvent")),
                ("payload", MsgValue::Bin(vec![1, 2])),
            ]),
            map(vec![
                ("type", s("AllBlocksCleared")),
                ("reason", s("reset")),
            ]),
        ]),
        u(0),
    ]);
    let got = decode(&v).unwrap();
    assert_eq!(got.skipped_unknown, 2);
    assert_eq!(
        got.batch.events,
        vec![KvEvent::AllBlocksCleared, KvEvent::AllBlocksCleared]
    );
}

fn expect_err(v: &MsgValue, limits: &DecodeLimits) -> DecodeError {
    let err = decode_batch(&encode_value(v), limits).expect_err("should fail");
    assert!(!err.to_string().is_empty());
    err
}

#[test]
fn malformed_payloads_give_clear_errors() {
    let d = DecodeLimits::default();
    let ok = encode_batch(&sample_batches()[1], WireEncoding::Map);
    for cut in [0, 1, 5, ok.len() / 2, ok.len() - 1] {
        assert!(
            matches!(
                decode_batch(&ok[..cut], &d),
                Err(DecodeError::Truncated { .. })
            ),
            "cut {cut}"
        );
    }
    let mut trailing = ok.clone();
    trailing.push(0xc0);
    assert!(matches!(
        decode_batch(&trailing, &d),
        Err(DecodeError::TrailingBytes { remaining: 1, .. })
    ));
    assert!(matches!(
        decode_batch(&[0xc1], &d),
        Err(DecodeError::ReservedMarker { offset: 0 })
    ));
    assert!(matches!(
        expect_err(&s("x"), &d),
        DecodeError::UnexpectedType {
            context: "batch",
            ..
        }
    ));
    assert!(matches!(
        expect_err(&arr(vec![MsgValue::F64(1.0)]), &d),
        DecodeError::MissingField {
            field: "events",
            ..
        }
    ));
    assert!(matches!(
        expect_err(&arr(vec![s("t"), arr(vec![])]), &d),
        DecodeError::UnexpectedType {
            context: "batch.ts",
            ..
        }
    ));
    let bad_event = |ev: MsgValue| arr(vec![MsgValue::F64(1.0), arr(vec![ev])]);
    assert!(matches!(
        expect_err(&bad_event(u(1)), &d),
        DecodeError::UnexpectedType { .. }
    ));
    assert!(matches!(
        expect_err(&bad_event(arr(vec![])), &d),
        DecodeError::MissingTag { .. }
    ));
    assert!(matches!(
        expect_err(&bad_event(arr(vec![u(7)])), &d),
        DecodeError::MissingTag { .. }
    ));
    assert!(matches!(
        expect_err(&bad_event(map(vec![("block_hashes", arr(vec![]))])), &d),
        DecodeError::MissingTag { .. }
    ));
    assert!(matches!(
        expect_err(&bad_event(arr(vec![s("BlockStored"), arr(vec![])])), &d),
        DecodeError::MissingField {
            field: "token_ids",
            ..
        }
    ));
    assert!(matches!(
        expect_err(&bad_event(arr(vec![s("BlockRemoved")])), &d),
        DecodeError::MissingField {
            field: "block_hashes",
            ..
        }
    ));
    let stored = |tokens: MsgValue, size: MsgValue| {
        bad_event(arr(vec![s("BlockStored"), arr(vec![]), NIL, tokens, size]))
    };
    assert!(matches!(
        expect_err(&stored(arr(vec![MsgValue::Int(-1)]), u(1)), &d),
        DecodeError::IntOutOfRange { .. }
    ));
    assert!(matches!(
        expect_err(&stored(arr(vec![u(1 << 32)]), u(1)), &d),
        DecodeError::IntOutOfRange { .. }
    ));
    assert!(matches!(
        expect_err(&stored(arr(vec![]), s("16")), &d),
        DecodeError::UnexpectedType {
            context: "BlockStored.block_size",
            ..
        }
    ));
    assert!(matches!(
        expect_err(
            &bad_event(arr(vec![s("BlockRemoved"), arr(vec![s("h")])])),
            &d
        ),
        DecodeError::UnexpectedType { .. }
    ));
    assert!(matches!(
        expect_err(
            &bad_event(map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", arr(vec![])),
                ("block_hashes", arr(vec![]))
            ])),
            &d
        ),
        DecodeError::DuplicateField {
            field: "block_hashes",
            ..
        }
    ));
    let bad_utf8 = bad_event(arr(vec![
        s("BlockRemoved"),
        arr(vec![]),
        MsgValue::Str(String::new()),
    ]));
    let mut raw = encode_value(&bad_utf8);
    let n = raw.len();
    raw[n - 1] = 0xa1; // fixstr(1) ...
    raw.push(0xff); // ... holding an invalid byte
    assert!(matches!(
        decode_batch(&raw, &d),
        Err(DecodeError::InvalidUtf8 { .. })
    ));
}

#[test]
fn limits_are_enforced() {
    let b = &sample_batches()[1];
    let bytes = encode_batch(b, WireEncoding::Array);
    fn lim(f: impl FnOnce(&mut DecodeLimits)) -> DecodeLimits {
        let mut l = DecodeLimits::default();
        f(&mut l);
        l
    }
    let too_many = |r| matches!(r, Err(DecodeError::TooMany { .. }));
    assert!(matches!(
        decode_batch(&bytes, &lim(|l| l.max_payload_bytes = 10)),
        Err(DecodeError::PayloadTooLarge { .. })
    ));
    assert!(too_many(decode_batch(
        &bytes,
        &lim(|l| l.max_events_per_batch = 4)
    )));
    assert!(too_many(decode_batch(
        &bytes,
        &lim(|l| l.max_hashes_per_event = 1)
    )));
    assert!(too_many(decode_batch(
        &bytes,
        &lim(|l| l.max_tokens_per_event = 3)
    )));
    assert!(too_many(decode_batch(
        &bytes,
        &lim(|l| l.max_hash_bytes = 16)
    )));
    assert!(too_many(decode_batch(
        &bytes,
        &lim(|l| l.max_string_bytes = 3)
    )));
    assert!(matches!(
        decode_batch(&bytes, &lim(|l| l.max_extra_values = 2)),
        Err(DecodeError::LimitExceeded { .. })
    ));
    assert!(matches!(
        decode_batch(&bytes, &lim(|l| l.max_extra_depth = 0)),
        Err(DecodeError::TooDeep { .. })
    ));
    // Exactly at the limits is fine.
    let exact = lim(|l| {
        l.max_payload_bytes = bytes.len();
        l.max_events_per_batch = 5;
        l.max_hashes_per_event = 2;
        l.max_tokens_per_event = 4;
        l.max_hash_bytes = 32;
        l.max_extra_values = 3;
        l.max_extra_depth = 1;
    });
    assert_eq!(decode_batch(&bytes, &exact).unwrap().batch, *b);
    // Declared lengths larger than the input fail before allocating.
    let huge = [
        0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
    ];
    assert!(matches!(
        decode_batch(&huge, &DecodeLimits::default()),
        Err(DecodeError::Truncated { .. })
    ));
    // Deep nesting in extra_keys is rejected, not recursed into (raw bytes:
    // building such a MsgValue would itself recurse).
    let deep = |n: usize| {
        let mut v = vec![0x91u8; n];
        v.push(0xc0);
        v
    };
    let mut raw = vec![0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91, 0x99];
    raw.extend_from_slice(b"\xabBlockStored");
    raw.extend_from_slice(&[0x90, 0xc0, 0x90, 0x00, 0xc0, 0xc0, 0xc0, 0x91]);
    raw.extend(deep(10_000));
    assert!(matches!(
        decode_batch(&raw, &DecodeLimits::default()),
        Err(DecodeError::TooDeep { .. })
    ));
    // ... and skipped iteratively when inside an unknown event.
    let mut raw = vec![0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91, 0x92];
    raw.extend_from_slice(b"\xa4Nope");
    raw.extend(deep(1_000_000));
    assert_eq!(
        decode_batch(&raw, &DecodeLimits::default())
            .unwrap()
            .skipped_unknown,
        1
    );
}

#[test]
fn frames() {
    let d = DecodeLimits::default();
    let payload = encode_batch(&sample_batches()[0], WireEncoding::Map);
    let seq = 7u64.to_be_bytes();
    let f = decode_frame(&[&b"kv@pod"[..], &seq, &payload], &d).unwrap();
    assert_eq!((f.topic.as_str(), f.seq), ("kv@pod", 7));
    assert_eq!(f.batch.batch, sample_batches()[0]);
    assert_eq!(
        decode_frame(&[&b""[..], &seq], &d),
        Err(FrameError::FrameCount(2))
    );
    assert_eq!(
        decode_frame(&[&b""[..], &seq[..4], &payload], &d),
        Err(FrameError::SeqLength(4))
    );
    assert_eq!(
        decode_frame(&[&[0xffu8][..], &seq, &payload], &d),
        Err(FrameError::TopicUtf8)
    );
    let err = decode_frame(&[&b""[..], &seq, &payload[..3]], &d).unwrap_err();
    assert_eq!(err.seq(), Some(7));
    assert!(err.to_string().contains("batch seq 7"));
}

#[test]
fn eventbatch_stays_plain_data() {
    // The public types are plain owned data: Send + Sync + Clone.
    fn assert_traits<T: Send + Sync + Clone + 'static>() {}
    assert_traits::<EventBatch>();
    assert_traits::<KvEvent>();
    assert_traits::<kvmesh_kvevents::DecodedBatch>();
}
