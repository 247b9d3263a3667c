//! The mesh's replicated state, pure: no I/O, no clock (time is `now_us`, cluster time: µs
//! since the Unix epoch), deterministic.
//!
//! Every piece is a delta-state CRDT: a local change yields a small delta, and `merge` of any
//! deltas in any order, batching or repetition ends in the same state (commutative,
//! associative, idempotent — property-tested), whose `digest` routers compare for
//! anti-entropy.
//!
//! * [`load`]: per-(router, engine) in-flight counts — single writer, newest version wins,
//!   a departed router's entries collected (tombstoned by incarnation).
//! * [`marks`]: speculative prefix marks — (engine, block key) → expiry, join = max,
//!   expired marks dropped deterministically, a per-engine bound.
//! * [`registry`]: the engine registry — an add-wins observed-remove set of engines with
//!   last-writer-wins attributes ((time, node) stamps, no arbitrary tie) and a causal context
//!   instead of tombstones (memory: the engines present + a counter interval per router run),
//!   beside it the notes of the config records routers seeded (bounded, grow-only).
//! * [`ownership`]: which `r` routers read an engine's KV events (rendezvous hashing over the
//!   live routers' stable ids, with bounded loads).
//! * [`feeds`]: precise prefix feeds — an engine's KV-event ops as its ingest owner derived
//!   them, numbered without gaps, a bounded log and snapshots for receivers that lost some.
//! * [`parts`]: feed snapshots too large for one envelope, sent in parts and put together.
//! * [`wire`]: the versioned envelope (`Envelope::V1`, and `V2` whose every delta and
//!   control message is a part of its own, skipped alone when a reader cannot decode it), with
//!   the cluster id and the sender, and its size-bounded decoder, which never panics on
//!   hostile bytes.
//!

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod feeds;
pub mod ids;
pub mod load;
pub mod marks;
pub mod ownership;
pub mod parts;
pub mod registry;
pub mod wire;

pub use feeds::{
    FeedApply, FeedBatch, FeedBatches, FeedId, FeedIn, FeedOut, FeedPull, FeedSnapshot, SnapBlock,
    WireOp,
};
pub use ids::{NodeId, Version};
pub use load::{LoadBatch, LoadDelta, LoadMap};
pub use marks::{MARK_WINDOW, MarkDelta, MarkMap, covering_keys, window_top};
pub use ownership::{Ownership, owners};
pub use parts::{Assembly, PartDropped, SNAPSHOT_PART_BLOCKS, SnapshotPart};
pub use registry::{
    Dot, EngineRecord, PLANTED_MAX, Planted, RegistryAdd, RegistryDelta, RegistrySet, SEEDED_MAX,
    Seeded, Span, Stamp,
};
pub use wire::{
    Control, Delta, Envelope, EnvelopeKind, EnvelopeV1, EnvelopeV2, FeedHead, MAX_ENVELOPE_BYTES,
    Part, StateDigest, WIRE_VERSIONS, WireError, decode, decode_counting, encode, encode_as,
    encoded_len,
};

/// A 64-bit digest of a sorted sequence of hashable parts (blake3, stable across platforms).
pub(crate) fn digest_of(tag: &[u8], parts: impl Iterator<Item = [u8; 32]>) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(tag);
    for p in parts {
        h.update(&p);
    }
    let b = h.finalize();
    let mut x = [0u8; 8];
    x.copy_from_slice(&b.as_bytes()[..8]);
    u64::from_le_bytes(x)
}

/// 32 bytes of four u64s (a digest part).
pub(crate) fn part(a: u64, b: u64, c: u64, d: u64) -> [u8; 32] {
    let mut p = [0u8; 32];
    p[..8].copy_from_slice(&a.to_le_bytes());
    p[8..16].copy_from_slice(&b.to_le_bytes());
    p[16..24].copy_from_slice(&c.to_le_bytes());
    p[24..].copy_from_slice(&d.to_le_bytes());
    p
}
