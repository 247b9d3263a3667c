//! Event types mirroring `vllm/distributed/kv_events.py`.

use std::fmt;
use std::str::FromStr;

/// Storage medium string vLLM uses for GPU-resident blocks (`MEDIUM_GPU`).
pub const MEDIUM_GPU: &str = "GPU";
/// Storage medium string vLLM's offloading connectors use for CPU blocks.
pub const MEDIUM_CPU: &str = "CPU";

/// A block hash as vLLM publishes it (`ExternalBlockHash = bytes | int`).
///
/// With `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` (the default) vLLM sends the low
/// 64 bits of the digest as a non-negative integer; with `=0` it sends the raw
/// digest bytes. Signed integers on the wire (older engines, other producers)
/// are normalised to their two's-complement `u64`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockHash {
    Int(u64),
    Bytes(Vec<u8>),
}

impl From<u64> for BlockHash {
    fn from(v: u64) -> Self {
        BlockHash::Int(v)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockHash::Int(v) => write!(f, "{v}"),
            BlockHash::Bytes(b) => {
                f.write_str("0x")?;
                for byte in b {
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
        }
    }
}

/// A generic msgpack value, used for the opaque `extra_keys` entries.
///
/// Kept lossless so that a decoded event re-encodes to the same bytes.
#[derive(Debug, Clone, PartialEq)]
pub enum MsgValue {
    Nil,
    Bool(bool),
    /// Non-negative integer (msgpack positive fixint / uint family).
    UInt(u64),
    /// Negative integer (msgpack negative fixint / int family).
    Int(i64),
    F32(f32),
    F64(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<MsgValue>),
    Map(Vec<(MsgValue, MsgValue)>),
    Ext(i8, Vec<u8>),
}

impl MsgValue {
    /// Integer constructor choosing the representation msgpack encoders use.
    pub fn int(v: i64) -> Self {
        if v >= 0 {
            MsgValue::UInt(v as u64)
        } else {
            MsgValue::Int(v)
        }
    }

    pub fn str(s: impl Into<String>) -> Self {
        MsgValue::Str(s.into())
    }
}

/// One KV-cache event (`BlockStored | BlockRemoved | AllBlocksCleared`).
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<BlockHash>,
        /// `None` when the first listed block is the root of its prefix.
        parent_block_hash: Option<BlockHash>,
        /// Tokens of all listed blocks in order (normally `blocks × block_size`;
        /// offloading connectors send an empty list).
        token_ids: Vec<u32>,
        block_size: u32,
        /// Deprecated by vLLM in favour of `lora_name`.
        lora_id: Option<i64>,
        medium: Option<String>,
        lora_name: Option<String>,
        /// One entry per block (`tuple | None`), opaque here.
        extra_keys: Option<Vec<MsgValue>>,
        group_idx: Option<i64>,
        kv_cache_spec_kind: Option<String>,
        kv_cache_spec_sliding_window: Option<i64>,
        /// Map encoding only (vLLM ≥ 0.28); not representable positionally.
        locality: Option<String>,
        /// Map encoding only (vLLM main, 2026); not representable positionally.
        ownership: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
        medium: Option<String>,
        group_idx: Option<i64>,
        /// Map encoding only.
        locality: Option<String>,
        /// Map encoding only.
        ownership: Option<String>,
    },
    AllBlocksCleared,
}

impl KvEvent {
    /// The msgspec tag (Python class name) of this event.
    pub fn tag(&self) -> &'static str {
        match self {
            KvEvent::BlockStored { .. } => TAG_BLOCK_STORED,
            KvEvent::BlockRemoved { .. } => TAG_BLOCK_REMOVED,
            KvEvent::AllBlocksCleared => TAG_ALL_BLOCKS_CLEARED,
        }
    }

    /// A `BlockStored` with the fields every vLLM version sends; the optional
    /// trailing fields are `None` and `medium` is `"GPU"`.
    pub fn stored(
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_string()),
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
            locality: None,
            ownership: None,
        }
    }

    /// A `BlockRemoved` on the GPU medium with no optional fields.
    pub fn removed(block_hashes: Vec<BlockHash>) -> Self {
        KvEvent::BlockRemoved {
            block_hashes,
            medium: Some(MEDIUM_GPU.to_string()),
            group_idx: None,
            locality: None,
            ownership: None,
        }
    }
}

pub(crate) const TAG_BLOCK_STORED: &str = "BlockStored";
pub(crate) const TAG_BLOCK_REMOVED: &str = "BlockRemoved";
pub(crate) const TAG_ALL_BLOCKS_CLEARED: &str = "AllBlocksCleared";

/// One published batch: all events of one engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Wall-clock seconds (Python `time.time()`).
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// A decoded batch plus the number of events whose tag was not recognised
/// (those are skipped rather than failing the batch).
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    pub batch: EventBatch,
    pub skipped_unknown: usize,
}

/// How events are laid out inside the (always positional) batch envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WireEncoding {
    /// `array_like=True` events: `["BlockStored", hashes, …]` (vLLM ≤ 0.23).
    Array,
    /// Field-name maps tagged under `"type"` (vLLM PR #42892 and later).
    #[default]
    Map,
}

impl WireEncoding {
    pub fn as_str(self) -> &'static str {
        match self {
            WireEncoding::Array => "array",
            WireEncoding::Map => "map",
        }
    }
}

impl fmt::Display for WireEncoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error parsing a [`WireEncoding`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown wire encoding {0:?} (expected \"array\" or \"map\")")]
pub struct ParseWireEncodingError(pub String);

impl FromStr for WireEncoding {
    type Err = ParseWireEncodingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "array" => Ok(WireEncoding::Array),
            "map" => Ok(WireEncoding::Map),
            _ => Err(ParseWireEncodingError(s.to_string())),
        }
    }
}
