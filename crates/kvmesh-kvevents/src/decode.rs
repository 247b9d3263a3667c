//! Hostile-input decoder for vLLM KV-event payloads and ZMQ frames.

use crate::msgpack::{Head, Reader, utf8};
use crate::types::{
    BlockHash, DecodedBatch, EventBatch, KvEvent, MsgValue, TAG_ALL_BLOCKS_CLEARED,
    TAG_BLOCK_REMOVED, TAG_BLOCK_STORED,
};

/// Upper bounds enforced while decoding. Every limit is checked before the
/// corresponding allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest accepted payload (the msgpack frame), in bytes.
    pub max_payload_bytes: usize,
    /// Largest number of events (known or unknown) in one batch.
    pub max_events_per_batch: usize,
    /// Largest number of block hashes in one event.
    pub max_hashes_per_event: usize,
    /// Largest number of token ids in one `BlockStored`.
    pub max_tokens_per_event: usize,
    /// Longest byte-string block hash (vLLM's sha256 digests are 32 bytes).
    pub max_hash_bytes: usize,
    /// Longest string field (`medium`, `lora_name`, tags, …), in bytes.
    pub max_string_bytes: usize,
    /// Most msgpack values inside one event's `extra_keys`.
    pub max_extra_values: usize,
    /// Deepest nesting inside one `extra_keys` entry.
    pub max_extra_depth: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_payload_bytes: 16 * 1024 * 1024,
            max_events_per_batch: 65_536,
            max_hashes_per_event: 65_536,
            max_tokens_per_event: 1 << 21,
            max_hash_bytes: 64,
            max_string_bytes: 4096,
            max_extra_values: 65_536,
            max_extra_depth: 16,
        }
    }
}

/// Why a payload could not be decoded. Offsets are byte positions in the payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("payload of {len} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge { len: usize, max: usize },
    #[error("payload truncated (value at byte {offset} runs past the end)")]
    Truncated { offset: usize },
    #[error("{remaining} trailing bytes after the batch at byte {offset}")]
    TrailingBytes { offset: usize, remaining: usize },
    #[error("reserved msgpack marker 0xc1 at byte {offset}")]
    ReservedMarker { offset: usize },
    #[error("{context}: expected {expected}, found {found} at byte {offset}")]
    UnexpectedType {
        context: &'static str,
        expected: &'static str,
        found: &'static str,
        offset: usize,
    },
    #[error("{context}: {what} over the limit of {max} (found {len}) at byte {offset}")]
    TooMany {
        context: &'static str,
        what: &'static str,
        len: u64,
        max: usize,
        offset: usize,
    },
    #[error("{context}: {what} limit exceeded at byte {offset}")]
    LimitExceeded {
        context: &'static str,
        what: &'static str,
        offset: usize,
    },
    #[error("{context}: nesting too deep at byte {offset}")]
    TooDeep {
        context: &'static str,
        offset: usize,
    },
    #[error("{context}: invalid UTF-8 at byte {offset}")]
    InvalidUtf8 {
        context: &'static str,
        offset: usize,
    },
    #[error("{context}: integer out of range at byte {offset}")]
    IntOutOfRange {
        context: &'static str,
        offset: usize,
    },
    #[error("{context}: missing required field `{field}`")]
    MissingField {
        context: &'static str,
        field: &'static str,
    },
    #[error("{context}: duplicate field `{field}`")]
    DuplicateField {
        context: &'static str,
        field: &'static str,
    },
    #[error("event at byte {offset} has no string tag")]
    MissingTag { offset: usize },
}

/// Decodes one msgpack payload (a `KVEventBatch`) in either encoding.
///
/// Accepted envelopes: `[ts, events]`, `[ts, events, dp_rank, …]` and the map
/// form `{"ts", "events", "data_parallel_rank"}`. Events may be positional
/// arrays or `"type"`-tagged maps, mixed freely. Unknown event tags are
/// skipped and counted; unknown map fields and extra trailing positional
/// fields are ignored; anything else malformed fails the whole batch.
pub fn decode_batch(payload: &[u8], limits: &DecodeLimits) -> Result<DecodedBatch, DecodeError> {
    if payload.len() > limits.max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge {
            len: payload.len(),
            max: limits.max_payload_bytes,
        });
    }
    let mut d = Decoder {
        r: Reader::new(payload),
        limits,
        skipped: 0,
    };
    let batch = d.batch()?;
    if d.r.remaining() > 0 {
        return Err(DecodeError::TrailingBytes {
            offset: d.r.pos(),
            remaining: d.r.remaining(),
        });
    }
    Ok(DecodedBatch {
        batch,
        skipped_unknown: d.skipped,
    })
}

/// One decoded ZMQ message `[topic, seq, payload]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvFrame {
    pub topic: String,
    pub seq: u64,
    pub batch: DecodedBatch,
}

/// Why a multipart message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    #[error("expected 3 frames [topic, seq, payload], got {0}")]
    FrameCount(usize),
    #[error("sequence frame must be 8 bytes, got {0}")]
    SeqLength(usize),
    #[error("topic is not valid UTF-8")]
    TopicUtf8,
    #[error("batch seq {seq}: {source}")]
    Payload {
        seq: u64,
        #[source]
        source: DecodeError,
    },
}

impl FrameError {
    /// The sequence number, when the frame got far enough to carry one.
    pub fn seq(&self) -> Option<u64> {
        match self {
            FrameError::Payload { seq, .. } => Some(*seq),
            _ => None,
        }
    }
}

/// Parses the 8-byte big-endian sequence frame.
pub fn parse_seq(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Decodes one `[topic, seq (u64 BE), payload]` multipart message.
pub fn decode_frame<F: AsRef<[u8]>>(
    frames: &[F],
    limits: &DecodeLimits,
) -> Result<KvFrame, FrameError> {
    let [topic, seq, payload] = frames else {
        return Err(FrameError::FrameCount(frames.len()));
    };
    let seq = parse_seq(seq.as_ref())?;
    let topic = std::str::from_utf8(topic.as_ref())
        .map_err(|_| FrameError::TopicUtf8)?
        .to_string();
    let batch = decode_batch(payload.as_ref(), limits)
        .map_err(|source| FrameError::Payload { seq, source })?;
    Ok(KvFrame { topic, seq, batch })
}

// ---------------------------------------------------------------------------

struct Decoder<'a, 'l> {
    r: Reader<'a>,
    limits: &'l DecodeLimits,
    skipped: usize,
}

const CTX_BATCH: &str = "batch";

/// Fields of an event, gathered from either encoding.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<BlockHash>>,
    parent_block_hash: Option<Option<BlockHash>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<Option<i64>>,
    medium: Option<Option<String>>,
    lora_name: Option<Option<String>>,
    extra_keys: Option<Option<Vec<MsgValue>>>,
    group_idx: Option<Option<i64>>,
    kv_cache_spec_kind: Option<Option<String>>,
    kv_cache_spec_sliding_window: Option<Option<i64>>,
    locality: Option<Option<String>>,
    ownership: Option<Option<String>>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

const STORED_POSITIONAL: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_POSITIONAL: [&str; 3] = ["block_hashes", "medium", "group_idx"];

impl<'a> Decoder<'a, '_> {
    fn head(&mut self) -> Result<(Head<'a>, usize), DecodeError> {
        let offset = self.r.pos();
        Ok((self.r.next_head()?, offset))
    }

    fn batch(&mut self) -> Result<EventBatch, DecodeError> {
        let (head, offset) = self.head()?;
        match head {
            Head::Array(n) => {
                if n < 2 {
                    return Err(DecodeError::MissingField {
                        context: CTX_BATCH,
                        field: if n == 0 { "ts" } else { "events" },
                    });
                }
                let ts = self.ts()?;
                let events = self.events()?;
                let data_parallel_rank = if n >= 3 {
                    self.opt_i64("batch.data_parallel_rank")?
                } else {
                    None
                };
                for _ in 3..n {
                    self.r.skip_value()?;
                }
                Ok(EventBatch {
                    ts,
                    events,
                    data_parallel_rank,
                })
            }
            Head::Map(n) => {
                let (mut ts, mut events, mut rank) = (None, None, None);
                for _ in 0..n {
                    let key = self.key(CTX_BATCH)?;
                    match key {
                        "ts" => set_once(&mut ts, self.ts()?, CTX_BATCH, "ts")?,
                        "events" => set_once(&mut events, self.events()?, CTX_BATCH, "events")?,
                        "data_parallel_rank" => {
                            let v = self.opt_i64("batch.data_parallel_rank")?;
                            set_once(&mut rank, v, CTX_BATCH, "data_parallel_rank")?
                        }
                        _ => self.r.skip_value()?,
                    }
                }
                Ok(EventBatch {
                    ts: ts.ok_or(missing(CTX_BATCH, "ts"))?,
                    events: events.ok_or(missing(CTX_BATCH, "events"))?,
                    data_parallel_rank: rank.flatten(),
                })
            }
            other => Err(unexpected(CTX_BATCH, "array or map", &other, offset)),
        }
    }

    fn ts(&mut self) -> Result<f64, DecodeError> {
        let (head, offset) = self.head()?;
        match head {
            Head::F64(f) => Ok(f),
            Head::F32(f) => Ok(f as f64),
            Head::UInt(u) => Ok(u as f64),
            Head::Int(i) => Ok(i as f64),
            other => Err(unexpected("batch.ts", "float", &other, offset)),
        }
    }

    fn events(&mut self) -> Result<Vec<KvEvent>, DecodeError> {
        let n = self.array_len("batch.events", "events", self.limits.max_events_per_batch)?;
        // Events are large relative to their smallest encoding: grow lazily.
        let mut events = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            if let Some(ev) = self.event()? {
                events.push(ev);
            }
        }
        Ok(events)
    }

    /// Reads an array head and checks its length against `max`.
    fn array_len(
        &mut self,
        context: &'static str,
        what: &'static str,
        max: usize,
    ) -> Result<usize, DecodeError> {
        let (head, offset) = self.head()?;
        let Head::Array(n) = head else {
            return Err(unexpected(context, "array", &head, offset));
        };
        if n as usize > max {
            return Err(DecodeError::TooMany {
                context,
                what,
                len: n as u64,
                max,
                offset,
            });
        }
        Ok(n as usize)
    }

    fn tag_kind(&mut self, tag: &[u8], offset: usize) -> Result<Option<Kind>, DecodeError> {
        if tag.len() > self.limits.max_string_bytes {
            return Err(DecodeError::TooMany {
                context: "event.type",
                what: "tag bytes",
                len: tag.len() as u64,
                max: self.limits.max_string_bytes,
                offset,
            });
        }
        Ok(match tag {
            t if t == TAG_BLOCK_STORED.as_bytes() => Some(Kind::Stored),
            t if t == TAG_BLOCK_REMOVED.as_bytes() => Some(Kind::Removed),
            t if t == TAG_ALL_BLOCKS_CLEARED.as_bytes() => Some(Kind::Cleared),
            _ => None,
        })
    }

    fn event(&mut self) -> Result<Option<KvEvent>, DecodeError> {
        let (head, offset) = self.head()?;
        match head {
            Head::Array(n) => {
                if n == 0 {
                    return Err(DecodeError::MissingTag { offset });
                }
                let (tag_head, tag_off) = self.head()?;
                let Head::Str(tag) = tag_head else {
                    return Err(DecodeError::MissingTag { offset: tag_off });
                };
                let Some(kind) = self.tag_kind(tag, tag_off)? else {
                    for _ in 1..n {
                        self.r.skip_value()?;
                    }
                    self.skipped += 1;
                    return Ok(None);
                };
                let names: &[&'static str] = match kind {
                    Kind::Stored => &STORED_POSITIONAL,
                    Kind::Removed => &REMOVED_POSITIONAL,
                    Kind::Cleared => &[],
                };
                let mut f = Fields::default();
                for i in 0..(n - 1) as usize {
                    match names.get(i) {
                        Some(name) => {
                            self.field(kind, name, &mut f)?;
                        }
                        None => self.r.skip_value()?,
                    }
                }
                build(kind, f).map(Some)
            }
            Head::Map(n) => {
                // Locate the tag first: msgspec writes it first, but other
                // producers may not.
                let start = self.r.pos();
                let mut kind = None;
                let mut found = false;
                for _ in 0..n {
                    let (k, k_off) = self.head()?;
                    if matches!(k, Head::Str(s) if s == b"type") {
                        let (v, v_off) = self.head()?;
                        let Head::Str(tag) = v else {
                            return Err(DecodeError::MissingTag { offset: v_off });
                        };
                        kind = self.tag_kind(tag, v_off)?;
                        found = true;
                        break;
                    }
                    if !matches!(k, Head::Str(_)) {
                        return Err(unexpected("event", "str key", &k, k_off));
                    }
                    self.r.skip_value()?;
                }
                if !found {
                    return Err(DecodeError::MissingTag { offset });
                }
                self.r.set_pos(start);
                let Some(kind) = kind else {
                    for _ in 0..n {
                        self.r.skip_value()?;
                        self.r.skip_value()?;
                    }
                    self.skipped += 1;
                    return Ok(None);
                };
                let mut f = Fields::default();
                let ctx = context(kind);
                for _ in 0..n {
                    let key = self.key(ctx)?;
                    if key == "type" {
                        self.r.skip_value()?;
                        continue;
                    }
                    let known = match kind {
                        Kind::Stored => STORED_POSITIONAL
                            .iter()
                            .copied()
                            .chain(["locality", "ownership"])
                            .find(|k| *k == key),
                        Kind::Removed => REMOVED_POSITIONAL
                            .iter()
                            .copied()
                            .chain(["locality", "ownership"])
                            .find(|k| *k == key),
                        Kind::Cleared => None,
                    };
                    match known {
                        Some(name) => self.field(kind, name, &mut f)?,
                        None => self.r.skip_value()?,
                    }
                }
                build(kind, f).map(Some)
            }
            other => Err(unexpected("batch.events[]", "array or map", &other, offset)),
        }
    }

    fn key(&mut self, ctx: &'static str) -> Result<&'a str, DecodeError> {
        let (head, offset) = self.head()?;
        match head {
            Head::Str(s) => utf8(s, ctx, offset),
            other => Err(unexpected(ctx, "str key", &other, offset)),
        }
    }

    /// Reads the value of the named field into `f`.
    fn field(&mut self, kind: Kind, name: &'static str, f: &mut Fields) -> Result<(), DecodeError> {
        let ctx = context(kind);
        match name {
            "block_hashes" => {
                let v = self.hashes(ctx)?;
                set_once(&mut f.block_hashes, v, ctx, name)
            }
            "parent_block_hash" => {
                let v = self.opt_hash("BlockStored.parent_block_hash")?;
                set_once(&mut f.parent_block_hash, v, ctx, name)
            }
            "token_ids" => {
                let v = self.tokens()?;
                set_once(&mut f.token_ids, v, ctx, name)
            }
            "block_size" => {
                let v = self.u32("BlockStored.block_size")?;
                set_once(&mut f.block_size, v, ctx, name)
            }
            "lora_id" => {
                let v = self.opt_i64("BlockStored.lora_id")?;
                set_once(&mut f.lora_id, v, ctx, name)
            }
            "medium" => {
                let v = self.opt_str("event.medium")?;
                set_once(&mut f.medium, v, ctx, name)
            }
            "lora_name" => {
                let v = self.opt_str("BlockStored.lora_name")?;
                set_once(&mut f.lora_name, v, ctx, name)
            }
            "extra_keys" => {
                let v = self.extra_keys()?;
                set_once(&mut f.extra_keys, v, ctx, name)
            }
            "group_idx" => {
                let v = self.opt_i64("event.group_idx")?;
                set_once(&mut f.group_idx, v, ctx, name)
            }
            "kv_cache_spec_kind" => {
                let v = self.opt_str("BlockStored.kv_cache_spec_kind")?;
                set_once(&mut f.kv_cache_spec_kind, v, ctx, name)
            }
            "kv_cache_spec_sliding_window" => {
                let v = self.opt_i64("BlockStored.kv_cache_spec_sliding_window")?;
                set_once(&mut f.kv_cache_spec_sliding_window, v, ctx, name)
            }
            "locality" => {
                let v = self.opt_str("event.locality")?;
                set_once(&mut f.locality, v, ctx, name)
            }
            "ownership" => {
                let v = self.opt_str("event.ownership")?;
                set_once(&mut f.ownership, v, ctx, name)
            }
            _ => self.r.skip_value(),
        }
    }

    fn hash_from(
        &self,
        head: Head<'a>,
        ctx: &'static str,
        offset: usize,
    ) -> Result<BlockHash, DecodeError> {
        match head {
            Head::UInt(u) => Ok(BlockHash::Int(u)),
            Head::Int(i) => Ok(BlockHash::Int(i as u64)),
            Head::Bin(b) => {
                if b.len() > self.limits.max_hash_bytes {
                    return Err(DecodeError::TooMany {
                        context: ctx,
                        what: "hash bytes",
                        len: b.len() as u64,
                        max: self.limits.max_hash_bytes,
                        offset,
                    });
                }
                Ok(BlockHash::Bytes(b.to_vec()))
            }
            other => Err(unexpected(ctx, "int or bin", &other, offset)),
        }
    }

    fn hashes(&mut self, ctx: &'static str) -> Result<Vec<BlockHash>, DecodeError> {
        let n = self.array_len(ctx, "block hashes", self.limits.max_hashes_per_event)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (head, offset) = self.head()?;
            out.push(self.hash_from(head, "event.block_hashes[]", offset)?);
        }
        Ok(out)
    }

    fn opt_hash(&mut self, ctx: &'static str) -> Result<Option<BlockHash>, DecodeError> {
        let (head, offset) = self.head()?;
        match head {
            Head::Nil => Ok(None),
            other => self.hash_from(other, ctx, offset).map(Some),
        }
    }

    fn tokens(&mut self) -> Result<Vec<u32>, DecodeError> {
        let ctx = "BlockStored.token_ids";
        let n = self.array_len(ctx, "token ids", self.limits.max_tokens_per_event)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.u32("BlockStored.token_ids[]")?);
        }
        Ok(out)
    }

    fn u32(&mut self, ctx: &'static str) -> Result<u32, DecodeError> {
        let (head, offset) = self.head()?;
        match head {
            Head::UInt(u) => u32::try_from(u).map_err(|_| DecodeError::IntOutOfRange {
                context: ctx,
                offset,
            }),
            Head::Int(_) => Err(DecodeError::IntOutOfRange {
                context: ctx,
                offset,
            }),
            other => Err(unexpected(ctx, "int", &other, offset)),
        }
    }

    fn opt_i64(&mut self, ctx: &'static str) -> Result<Option<i64>, DecodeError> {
        let (head, offset) = self.head()?;
        match head {
            Head::Nil => Ok(None),
            Head::UInt(u) => i64::try_from(u)
                .map(Some)
                .map_err(|_| DecodeError::IntOutOfRange {
                    context: ctx,
                    offset,
                }),
            Head::Int(i) => Ok(Some(i)),
            other => Err(unexpected(ctx, "int or nil", &other, offset)),
        }
    }

    fn opt_str(&mut self, ctx: &'static str) -> Result<Option<String>, DecodeError> {
        let (head, offset) = self.head()?;
        match head {
            Head::Nil => Ok(None),
            Head::Str(s) => {
                if s.len() > self.limits.max_string_bytes {
                    return Err(DecodeError::TooMany {
                        context: ctx,
                        what: "string bytes",
                        len: s.len() as u64,
                        max: self.limits.max_string_bytes,
                        offset,
                    });
                }
                Ok(Some(utf8(s, ctx, offset)?.to_string()))
            }
            other => Err(unexpected(ctx, "str or nil", &other, offset)),
        }
    }

    fn extra_keys(&mut self) -> Result<Option<Vec<MsgValue>>, DecodeError> {
        let ctx = "BlockStored.extra_keys";
        let (head, offset) = self.head()?;
        let n = match head {
            Head::Nil => return Ok(None),
            Head::Array(n) => n as usize,
            other => return Err(unexpected(ctx, "array or nil", &other, offset)),
        };
        if n > self.limits.max_hashes_per_event {
            return Err(DecodeError::TooMany {
                context: ctx,
                what: "entries",
                len: n as u64,
                max: self.limits.max_hashes_per_event,
                offset,
            });
        }
        let mut budget = self.limits.max_extra_values;
        let mut out = Vec::with_capacity(n.min(budget));
        for _ in 0..n {
            out.push(
                self.r
                    .read_value(self.limits.max_extra_depth, &mut budget, ctx)?,
            );
        }
        Ok(Some(out))
    }
}

fn context(kind: Kind) -> &'static str {
    match kind {
        Kind::Stored => TAG_BLOCK_STORED,
        Kind::Removed => TAG_BLOCK_REMOVED,
        Kind::Cleared => TAG_ALL_BLOCKS_CLEARED,
    }
}

fn set_once<T>(
    slot: &mut Option<T>,
    v: T,
    context: &'static str,
    field: &'static str,
) -> Result<(), DecodeError> {
    if slot.is_some() {
        return Err(DecodeError::DuplicateField { context, field });
    }
    *slot = Some(v);
    Ok(())
}

fn missing(context: &'static str, field: &'static str) -> DecodeError {
    DecodeError::MissingField { context, field }
}

fn unexpected(
    context: &'static str,
    expected: &'static str,
    found: &Head<'_>,
    offset: usize,
) -> DecodeError {
    DecodeError::UnexpectedType {
        context,
        expected,
        found: found.kind(),
        offset,
    }
}

fn build(kind: Kind, f: Fields) -> Result<KvEvent, DecodeError> {
    let ctx = context(kind);
    Ok(match kind {
        Kind::Stored => KvEvent::BlockStored {
            block_hashes: f.block_hashes.ok_or(missing(ctx, "block_hashes"))?,
            parent_block_hash: f.parent_block_hash.flatten(),
            token_ids: f.token_ids.ok_or(missing(ctx, "token_ids"))?,
            block_size: f.block_size.ok_or(missing(ctx, "block_size"))?,
            lora_id: f.lora_id.flatten(),
            medium: f.medium.flatten(),
            lora_name: f.lora_name.flatten(),
            extra_keys: f.extra_keys.flatten(),
            group_idx: f.group_idx.flatten(),
            kv_cache_spec_kind: f.kv_cache_spec_kind.flatten(),
            kv_cache_spec_sliding_window: f.kv_cache_spec_sliding_window.flatten(),
            locality: f.locality.flatten(),
            ownership: f.ownership.flatten(),
        },
        Kind::Removed => KvEvent::BlockRemoved {
            block_hashes: f.block_hashes.ok_or(missing(ctx, "block_hashes"))?,
            medium: f.medium.flatten(),
            group_idx: f.group_idx.flatten(),
            locality: f.locality.flatten(),
            ownership: f.ownership.flatten(),
        },
        Kind::Cleared => KvEvent::AllBlocksCleared,
    })
}
