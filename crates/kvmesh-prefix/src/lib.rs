//! Block keys, the bounded prefix index and the KV-event ingestion state machine of the kvmesh
//! router's cache-aware routing.
//!
//! **Pure**: no I/O, no tokio, no clock (time is `now_us`, µs on the caller's clock),
//! deterministic. The router calls it on every request:
//!
//! ```text
//! prompt tokens ─▶ block_keys ─▶ PrefixIndex::lookup ─▶ [(engine, matched blocks)] ─▶ policy
//!                                 ▲                  ◀── insert_speculative (chosen engine, TTL)
//! KV-event batches ─▶ EngineIngest::on_batch ─▶ IndexOp ─▶ PrefixIndex::apply_all
//! ```
//!
//! * [`keys`]: [`BlockKey`] = blake3 chained over the parent key, the block's token ids and the
//!   extra keys (LoRA name on every block, cache salt on the first), 64 bits (byte layout and
//!   collision argument in the module docs).
//! * [`index`]: [`PrefixIndex`], per engine which keys it holds (confirmed copies from KV events,
//!   speculative marks with an expiry from routing decisions), per-engine LRU capacity, lookups
//!   whose cost follows the matches, not the fleet.
//! * [`ingest`]: [`EngineIngest`], one engine's event stream: seq gaps, duplicates, restarts
//!   (epochs), rehashing of `BlockStored` token ids, engine hash → key map for `BlockRemoved`.
//!
//! The crate README gives the design, costs, measured memory and benchmark figures.

#![warn(missing_docs)]
// The one `unsafe` of the workspace is `index::prefetch` (an x86_64 `_mm_prefetch` hint, which
// cannot fault); every other crate is `#![forbid(unsafe_code)]`. Everything else here must be
// safe code:
#![deny(unsafe_code)]

pub mod id;
pub mod index;
pub mod ingest;
pub mod keys;
pub mod sink;
mod table;

pub use id::EngineId;
pub use index::{
    EngineCounts, IndexError, IndexOp, IndexStats, MAX_ENGINES, Match, OpVersion, PrefixIndex, Slot,
};
pub use ingest::{
    EngineIngest, IngestConfig, IngestOutcome, IngestStats, RECENT_BATCHES, Staleness,
    engine_hash_u64,
};
pub use keys::{
    ANCHOR_STRIDE, BlockKey, ExtraKeys, KEY_LAYOUT_VERSION, block_key, block_key_with, block_keys,
    extend_block_keys, max_hit_blocks, window_top,
};
pub use sink::{IndexSink, RecordingSink, SinkCall, Target, Tee};
