//! Canonical JSON form of batches, shared with the Python helpers in
//! `tests/python/kv_events_*.py` (scripts of batches to publish, JSON lines
//! printed by the subscriber).
//!
//! * batch: `{"ts": f, "events": [...], "data_parallel_rank": int|null}`
//! * events: objects with `"type"` and every field of the Rust variant
//!   (absent optional fields may be omitted or `null` on input; output always
//!   writes all of them, `null` when `None`)
//! * block hashes: JSON integers, or `{"$bytes": "<hex>"}` for byte hashes
//! * `extra_keys` values: `null`, bools, numbers, strings, arrays,
//!   `{"$bytes": hex}`, `{"$map": [[k, v], ...]}` (order-preserving),
//!   `{"$ext": [type, hex]}`

use serde_json::{Map, Value, json};

use crate::types::{BlockHash, EventBatch, KvEvent, MsgValue};

/// Error converting JSON into a batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid batch JSON at {path}: {msg}")]
pub struct JsonError {
    pub path: String,
    pub msg: String,
}

fn err(path: &str, msg: impl Into<String>) -> JsonError {
    JsonError {
        path: path.to_string(),
        msg: msg.into(),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str, path: &str) -> Result<Vec<u8>, JsonError> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return Err(err(path, "hex string of odd length or non-ASCII"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| err(path, "bad hex digit")))
        .collect()
}

pub fn hash_to_json(h: &BlockHash) -> Value {
    match h {
        BlockHash::Int(v) => json!(v),
        BlockHash::Bytes(b) => json!({ "$bytes": hex(b) }),
    }
}

pub fn value_to_json(v: &MsgValue) -> Value {
    match v {
        MsgValue::Nil => Value::Null,
        MsgValue::Bool(b) => json!(b),
        MsgValue::UInt(u) => json!(u),
        MsgValue::Int(i) => json!(i),
        MsgValue::F32(f) => json!(*f as f64),
        MsgValue::F64(f) => json!(f),
        MsgValue::Str(s) => json!(s),
        MsgValue::Bin(b) => json!({ "$bytes": hex(b) }),
        MsgValue::Array(items) => Value::Array(items.iter().map(value_to_json).collect()),
        MsgValue::Map(entries) => json!({
            "$map": entries
                .iter()
                .map(|(k, v)| json!([value_to_json(k), value_to_json(v)]))
                .collect::<Vec<_>>()
        }),
        MsgValue::Ext(ty, d) => json!({ "$ext": [ty, hex(d)] }),
    }
}

pub fn event_to_json(ev: &KvEvent) -> Value {
    match ev {
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
        } => json!({
            "type": ev.tag(),
            "block_hashes": block_hashes.iter().map(hash_to_json).collect::<Vec<_>>(),
            "parent_block_hash": parent_block_hash.as_ref().map(hash_to_json),
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_id": lora_id,
            "medium": medium,
            "lora_name": lora_name,
            "extra_keys": extra_keys.as_ref().map(|v| v.iter().map(value_to_json).collect::<Vec<_>>()),
            "group_idx": group_idx,
            "kv_cache_spec_kind": kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": kv_cache_spec_sliding_window,
            "locality": locality,
            "ownership": ownership,
        }),
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
            locality,
            ownership,
        } => json!({
            "type": ev.tag(),
            "block_hashes": block_hashes.iter().map(hash_to_json).collect::<Vec<_>>(),
            "medium": medium,
            "group_idx": group_idx,
            "locality": locality,
            "ownership": ownership,
        }),
        KvEvent::AllBlocksCleared => json!({ "type": ev.tag() }),
    }
}

/// Canonical JSON of a batch.
pub fn batch_to_json(batch: &EventBatch) -> Value {
    json!({
        "ts": batch.ts,
        "events": batch.events.iter().map(event_to_json).collect::<Vec<_>>(),
        "data_parallel_rank": batch.data_parallel_rank,
    })
}

fn hash_from_json(v: &Value, path: &str) -> Result<BlockHash, JsonError> {
    if let Some(u) = v.as_u64() {
        return Ok(BlockHash::Int(u));
    }
    if let Some(i) = v.as_i64() {
        return Ok(BlockHash::Int(i as u64));
    }
    match v.get("$bytes").and_then(Value::as_str) {
        Some(h) => Ok(BlockHash::Bytes(unhex(h, path)?)),
        None => Err(err(path, "expected integer or {\"$bytes\": hex}")),
    }
}

pub fn value_from_json(v: &Value, path: &str) -> Result<MsgValue, JsonError> {
    Ok(match v {
        Value::Null => MsgValue::Nil,
        Value::Bool(b) => MsgValue::Bool(*b),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                MsgValue::UInt(u)
            } else if let Some(i) = n.as_i64() {
                MsgValue::Int(i)
            } else {
                MsgValue::F64(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::String(s) => MsgValue::Str(s.clone()),
        Value::Array(items) => MsgValue::Array(
            items
                .iter()
                .map(|x| value_from_json(x, path))
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(o) => {
            if let Some(h) = o.get("$bytes").and_then(Value::as_str) {
                MsgValue::Bin(unhex(h, path)?)
            } else if let Some(entries) = o.get("$map").and_then(Value::as_array) {
                let mut out = Vec::with_capacity(entries.len());
                for e in entries {
                    match e.as_array().map(Vec::as_slice) {
                        Some([k, v]) => {
                            out.push((value_from_json(k, path)?, value_from_json(v, path)?))
                        }
                        _ => return Err(err(path, "$map entries must be [key, value]")),
                    }
                }
                MsgValue::Map(out)
            } else if let Some([ty, data]) =
                o.get("$ext").and_then(Value::as_array).map(Vec::as_slice)
            {
                let ty = ty
                    .as_i64()
                    .and_then(|t| i8::try_from(t).ok())
                    .ok_or_else(|| err(path, "$ext type must fit i8"))?;
                MsgValue::Ext(ty, unhex(data.as_str().unwrap_or(""), path)?)
            } else {
                // Plain objects become string-keyed maps (key order not preserved).
                MsgValue::Map(
                    o.iter()
                        .map(|(k, v)| Ok((MsgValue::Str(k.clone()), value_from_json(v, path)?)))
                        .collect::<Result<_, JsonError>>()?,
                )
            }
        }
    })
}

fn field<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn opt_i64(o: &Map<String, Value>, key: &str, path: &str) -> Result<Option<i64>, JsonError> {
    field(o, key)
        .map(|v| {
            v.as_i64()
                .ok_or_else(|| err(&format!("{path}.{key}"), "expected integer"))
        })
        .transpose()
}

fn opt_string(o: &Map<String, Value>, key: &str, path: &str) -> Result<Option<String>, JsonError> {
    field(o, key)
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| err(&format!("{path}.{key}"), "expected string"))
        })
        .transpose()
}

fn hashes_from(o: &Map<String, Value>, path: &str) -> Result<Vec<BlockHash>, JsonError> {
    let p = format!("{path}.block_hashes");
    field(o, "block_hashes")
        .and_then(Value::as_array)
        .ok_or_else(|| err(&p, "expected array"))?
        .iter()
        .map(|h| hash_from_json(h, &p))
        .collect()
}

pub fn event_from_json(v: &Value, path: &str) -> Result<KvEvent, JsonError> {
    let o = v.as_object().ok_or_else(|| err(path, "expected object"))?;
    let ty = o.get("type").and_then(Value::as_str).unwrap_or("");
    match ty {
        "BlockStored" => {
            let tp = format!("{path}.token_ids");
            let token_ids = field(o, "token_ids")
                .and_then(Value::as_array)
                .ok_or_else(|| err(&tp, "expected array"))?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| err(&tp, "expected u32"))
                })
                .collect::<Result<_, _>>()?;
            let block_size = field(o, "block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| err(&format!("{path}.block_size"), "expected u32"))?;
            let extra_keys = match field(o, "extra_keys") {
                None => None,
                Some(Value::Array(items)) => Some(
                    items
                        .iter()
                        .map(|x| value_from_json(x, &format!("{path}.extra_keys")))
                        .collect::<Result<_, _>>()?,
                ),
                Some(_) => return Err(err(&format!("{path}.extra_keys"), "expected array")),
            };
            Ok(KvEvent::BlockStored {
                block_hashes: hashes_from(o, path)?,
                parent_block_hash: field(o, "parent_block_hash")
                    .map(|h| hash_from_json(h, &format!("{path}.parent_block_hash")))
                    .transpose()?,
                token_ids,
                block_size,
                lora_id: opt_i64(o, "lora_id", path)?,
                medium: opt_string(o, "medium", path)?,
                lora_name: opt_string(o, "lora_name", path)?,
                extra_keys,
                group_idx: opt_i64(o, "group_idx", path)?,
                kv_cache_spec_kind: opt_string(o, "kv_cache_spec_kind", path)?,
                kv_cache_spec_sliding_window: opt_i64(o, "kv_cache_spec_sliding_window", path)?,
                locality: opt_string(o, "locality", path)?,
                ownership: opt_string(o, "ownership", path)?,
            })
        }
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hashes_from(o, path)?,
            medium: opt_string(o, "medium", path)?,
            group_idx: opt_i64(o, "group_idx", path)?,
            locality: opt_string(o, "locality", path)?,
            ownership: opt_string(o, "ownership", path)?,
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(err(
            &format!("{path}.type"),
            format!("unknown event type {other:?}"),
        )),
    }
}

/// Parses the canonical JSON of a batch.
pub fn batch_from_json(v: &Value) -> Result<EventBatch, JsonError> {
    let o = v
        .as_object()
        .ok_or_else(|| err("batch", "expected object"))?;
    let ts = o
        .get("ts")
        .and_then(Value::as_f64)
        .ok_or_else(|| err("batch.ts", "expected number"))?;
    let events = o
        .get("events")
        .and_then(Value::as_array)
        .ok_or_else(|| err("batch.events", "expected array"))?
        .iter()
        .enumerate()
        .map(|(i, e)| event_from_json(e, &format!("batch.events[{i}]")))
        .collect::<Result<_, _>>()?;
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank: opt_i64(o, "data_parallel_rank", "batch")?,
    })
}
