//! Encoder producing the bytes vLLM's `msgspec.msgpack.Encoder` emits.
//!
//! The batch envelope is always positional (`EventBatch` is `array_like=True`
//! in every vLLM release) and always has three elements: msgspec's
//! `omit_defaults` never shortens an `array_like` struct, so a `None` rank is
//! written as nil. Events follow the chosen [`WireEncoding`]:
//!
//! * `Array`: every field of the `BlockStored` / `BlockRemoved` layout is
//!   written, in declaration order, `None` as nil (`locality`/`ownership` did
//!   not exist while events were positional and are not written).
//! * `Map`: `"type"` first, then fields in declaration order; fields without
//!   a default in vLLM (`block_hashes` … `lora_name`, `medium`) are always
//!   written, defaulted fields (`extra_keys`, `group_idx`, …) only when not
//!   `None` (msgspec `omit_defaults=True`).

use crate::msgpack::Writer;
use crate::types::{BlockHash, EventBatch, KvEvent, MsgValue, WireEncoding};

/// Encodes a batch as vLLM would for the given event encoding.
///
/// # Panics
/// Only if a collection holds more than `u32::MAX` elements, which msgpack
/// cannot represent.
pub fn encode_batch(batch: &EventBatch, encoding: WireEncoding) -> Vec<u8> {
    let mut w = Writer::with_capacity(64 + batch.events.len() * 64);
    w.array_len(3);
    w.f64(batch.ts);
    w.array_len(batch.events.len());
    for ev in &batch.events {
        encode_event(&mut w, ev, encoding);
    }
    opt_int(&mut w, batch.data_parallel_rank);
    w.buf
}

/// Encodes one event on its own (useful for building hand-made payloads).
pub fn encode_event_bytes(event: &KvEvent, encoding: WireEncoding) -> Vec<u8> {
    let mut w = Writer::with_capacity(64);
    encode_event(&mut w, event, encoding);
    w.buf
}

fn hash(w: &mut Writer, h: &BlockHash) {
    match h {
        BlockHash::Int(v) => w.uint(*v),
        BlockHash::Bytes(b) => w.bin(b),
    }
}

fn hashes(w: &mut Writer, hs: &[BlockHash]) {
    w.array_len(hs.len());
    for h in hs {
        hash(w, h);
    }
}

fn opt_hash(w: &mut Writer, h: &Option<BlockHash>) {
    match h {
        Some(h) => hash(w, h),
        None => w.nil(),
    }
}

fn opt_int(w: &mut Writer, v: Option<i64>) {
    match v {
        Some(v) => w.int(v),
        None => w.nil(),
    }
}

fn opt_str(w: &mut Writer, v: &Option<String>) {
    match v {
        Some(s) => w.str(s),
        None => w.nil(),
    }
}

fn opt_values(w: &mut Writer, v: &Option<Vec<MsgValue>>) {
    match v {
        Some(items) => {
            w.array_len(items.len());
            for item in items {
                w.value(item);
            }
        }
        None => w.nil(),
    }
}

fn tokens(w: &mut Writer, t: &[u32]) {
    w.array_len(t.len());
    for &tok in t {
        w.uint(tok as u64);
    }
}

fn encode_event(w: &mut Writer, ev: &KvEvent, encoding: WireEncoding) {
    match (ev, encoding) {
        (
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
                kv_cache_spec_sliding_window,
                ..
            },
            WireEncoding::Array,
        ) => {
            w.array_len(12);
            w.str(ev.tag());
            hashes(w, block_hashes);
            opt_hash(w, parent_block_hash);
            tokens(w, token_ids);
            w.uint(*block_size as u64);
            opt_int(w, *lora_id);
            opt_str(w, medium);
            opt_str(w, lora_name);
            opt_values(w, extra_keys);
            opt_int(w, *group_idx);
            opt_str(w, kv_cache_spec_kind);
            opt_int(w, *kv_cache_spec_sliding_window);
        }
        (
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
                kv_cache_spec_sliding_window,
                locality,
                ownership,
            },
            WireEncoding::Map,
        ) => {
            let optional = [
                extra_keys.is_some(),
                group_idx.is_some(),
                kv_cache_spec_kind.is_some(),
                kv_cache_spec_sliding_window.is_some(),
                locality.is_some(),
                ownership.is_some(),
            ];
            w.map_len(8 + optional.iter().filter(|b| **b).count());
            w.str("type");
            w.str(ev.tag());
            w.str("block_hashes");
            hashes(w, block_hashes);
            w.str("parent_block_hash");
            opt_hash(w, parent_block_hash);
            w.str("token_ids");
            tokens(w, token_ids);
            w.str("block_size");
            w.uint(*block_size as u64);
            w.str("lora_id");
            opt_int(w, *lora_id);
            w.str("medium");
            opt_str(w, medium);
            w.str("lora_name");
            opt_str(w, lora_name);
            if extra_keys.is_some() {
                w.str("extra_keys");
                opt_values(w, extra_keys);
            }
            map_opt_int(w, "group_idx", *group_idx);
            map_opt_str(w, "kv_cache_spec_kind", kv_cache_spec_kind);
            map_opt_int(
                w,
                "kv_cache_spec_sliding_window",
                *kv_cache_spec_sliding_window,
            );
            map_opt_str(w, "locality", locality);
            map_opt_str(w, "ownership", ownership);
        }
        (
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
                ..
            },
            WireEncoding::Array,
        ) => {
            w.array_len(4);
            w.str(ev.tag());
            hashes(w, block_hashes);
            opt_str(w, medium);
            opt_int(w, *group_idx);
        }
        (
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
                locality,
                ownership,
            },
            WireEncoding::Map,
        ) => {
            let optional = [group_idx.is_some(), locality.is_some(), ownership.is_some()];
            w.map_len(3 + optional.iter().filter(|b| **b).count());
            w.str("type");
            w.str(ev.tag());
            w.str("block_hashes");
            hashes(w, block_hashes);
            w.str("medium");
            opt_str(w, medium);
            map_opt_int(w, "group_idx", *group_idx);
            map_opt_str(w, "locality", locality);
            map_opt_str(w, "ownership", ownership);
        }
        (KvEvent::AllBlocksCleared, WireEncoding::Array) => {
            w.array_len(1);
            w.str(ev.tag());
        }
        (KvEvent::AllBlocksCleared, WireEncoding::Map) => {
            w.map_len(1);
            w.str("type");
            w.str(ev.tag());
        }
    }
}

fn map_opt_int(w: &mut Writer, key: &str, v: Option<i64>) {
    if let Some(v) = v {
        w.str(key);
        w.int(v);
    }
}

fn map_opt_str(w: &mut Writer, key: &str, v: &Option<String>) {
    if let Some(s) = v {
        w.str(key);
        w.str(s);
    }
}

/// Encodes any [`MsgValue`] (smallest representation for every value), e.g.
/// to hand-craft payloads in tests.
pub fn encode_value(value: &MsgValue) -> Vec<u8> {
    let mut w = Writer::with_capacity(64);
    w.value(value);
    w.buf
}
