//! The wire envelope of state deltas: versioned (`Envelope::V1`, `Envelope::V2`), carrying the
//! cluster id and the sender, encoded with bincode 2 (standard config) behind this one module.
//! Decoding treats every byte as hostile: bounded input size and allocation (`with_limit`), no
//! panic, a typed error the caller counts.
//!
//! **Versions, and how the format may change.** Version 1 encodes the deltas and control
//! messages in one piece: a reader that cannot decode one of them (a kind a later build
//! added) drops the whole envelope. Version 2 carries the same header and encodes each delta
//! and each control message on its own, length-prefixed ([`Part`]): a reader skips a part it
//! cannot decode, counts it, and applies the rest. Every build reads both; which one a router
//! writes is `serve.mesh.wire_version` (2 by default; 1 while upgrading from a build before
//! version 2, which reads only version 1). Writing version 2 lets a later build add a kind of
//! delta or control message without the earlier builds losing the rest; kinds added so are
//! written in version 2 only ([`Delta::Planted`], [`Delta::Bequest`],
//! [`Delta::SnapshotPart`]).
//! The rule for such a change: never change how an existing kind is encoded (its fields, their
//! order, its variant's index); add a new variant at the end of [`Delta`] or [`Control`], and
//! keep reading the old one. Information that older builds lack changes no digest they
//! compare (anti-entropy would repair it forever) unless that is accepted for the upgrade.

use crate::feeds::{FeedBatch, FeedBatches, FeedId, FeedPull, FeedSnapshot};
use crate::ids::{NodeId, Version};
use crate::load::{LoadBatch, LoadDelta};
use crate::marks::MarkDelta;
use crate::parts::SnapshotPart;
use crate::registry::{Planted, RegistryDelta};
use serde::{Deserialize, Serialize};

/// The largest envelope accepted (bytes): a delta batch is flushed well below it.
pub const MAX_ENVELOPE_BYTES: usize = 4 << 20;

/// One state delta.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Delta {
    /// A router's in-flight count on an engine.
    Load(LoadDelta),
    /// Several of one router's in-flight counts (what is sent: see [`LoadBatch`]).
    LoadBatch(LoadBatch),
    /// A speculative prefix mark.
    Mark(MarkDelta),
    /// An engine added, updated or removed.
    Registry(RegistryDelta),
    /// A batch of an engine's precise ops from its ingest owner.
    Feed(FeedBatch),
    /// An engine's whole block set from an ingest owner.
    FeedSnapshot(FeedSnapshot),
    /// Batches of one feed (what is sent: see [`FeedBatches`]).
    FeedBatches(FeedBatches),
    /// Adds that planted config records ([`crate::RegistrySet::plant`]). Added after version
    /// 2: written only in version 2 envelopes, which earlier builds skip part by part.
    Planted(Vec<Planted>),
    /// A leaving router's feed of an engine, given to a router that reads the engine once it
    /// is gone: taken up when that router comes to own it, instead of reading it afresh.
    /// Added after version 2: written only in version 2 envelopes.
    Bequest(FeedSnapshot),
    /// A part of a [`Delta::FeedSnapshot`] or [`Delta::Bequest`] too large for one envelope
    /// (see [`crate::parts`]). Added after version 2: written only in version 2 envelopes.
    SnapshotPart(SnapshotPart),
}

/// Digests of the replicated state's parts, compared in anti-entropy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StateDigest {
    /// [`crate::LoadMap::digest`].
    pub load: u64,
    /// [`crate::MarkMap::digest`].
    pub marks: u64,
    /// [`crate::RegistrySet::digest`].
    pub registry: u64,
}

/// The head of a feed a source advertises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeedHead {
    /// The engine.
    pub engine: u64,
    /// The feed.
    pub feed: FeedId,
    /// Its last batch.
    pub head: u64,
}

/// Requests and announcements between routers (not state).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    /// Anti-entropy: the sender's digests; the receiver sends back the parts that differ,
    /// and its own digests when `reply` (so that the sender sends its differing parts too).
    Digest {
        /// The sender's digests.
        digest: StateDigest,
        /// Per router, a hash of its load entries and their newest version.
        load_nodes: Vec<(NodeId, u64, Version)>,
        /// Per expiry bucket, a hash of its marks (sent when the mark digests differ).
        mark_buckets: Vec<(u64, u64)>,
        /// Answer with your digests.
        reply: bool,
        /// The two routers have just met (a join, a healed partition): the receiver also sends
        /// the marks it made in the last moments, which it would otherwise take for in flight
        /// — they were flushed to members the sender was not one of.
        met: bool,
    },
    /// A joining router wants the sender's whole state (it is warm once it has it).
    WantState,
    /// The last envelope of a whole state: it came in this many envelopes (each of kind
    /// [`EnvelopeKind::Snapshot`]), so the receiver knows when it has all of it.
    WholeState {
        /// Envelopes of the whole state, this one included.
        chunks: u32,
    },
    /// Feed batches or a snapshot wanted.
    Pull(FeedPull),
    /// Heads of the feeds the sender is the source of.
    Heads(Vec<FeedHead>),
}

/// What an envelope's deltas are, for its receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EnvelopeKind {
    /// The sender's latest changes (a flush, an answer to a feed pull): news that routing
    /// acts on now.
    Live,
    /// What the receiver was found to miss: the answer to its digests (anti-entropy, two
    /// routers meeting after a join or a partition).
    Repair,
    /// A chunk of the sender's whole state, the welcome a joining router asked for.
    Snapshot,
}

impl EnvelopeKind {
    /// A transfer of state rather than news: its marks are old decisions, possibly many.
    pub fn is_transfer(self) -> bool {
        self != EnvelopeKind::Live
    }
}

/// Version 1 of the envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvelopeV1 {
    /// The cluster it belongs to: a receiver of another cluster drops it.
    pub cluster_id: u64,
    /// The sender.
    pub from: NodeId,
    /// What the deltas are: the sender's latest changes, or a transfer of state the receiver
    /// missed (an anti-entropy repair, a chunk of a whole state).
    pub kind: EnvelopeKind,
    /// When it was sent (the sender's cluster time, µs): the receiver's delta lag.
    pub sent_us: u64,
    /// The deltas, in the sender's order.
    pub deltas: Vec<Delta>,
    /// Requests and announcements.
    pub control: Vec<Control>,
}

/// One delta or control message encoded on its own (bincode, as in version 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part(pub Vec<u8>);

impl Part {
    /// `v` (a [`Delta`], a [`Control`]) encoded as a part.
    pub fn of<T: Serialize>(v: &T) -> Result<Part, WireError> {
        bincode::serde::encode_to_vec(v, config())
            .map(Part)
            .map_err(|x| WireError::Malformed(x.to_string()))
    }
}

impl Serialize for Part {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Part {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Bytes;
        impl<'de> serde::de::Visitor<'de> for Bytes {
            type Value = Part;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Part, E> {
                Ok(Part(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Part, E> {
                Ok(Part(v))
            }
        }
        d.deserialize_byte_buf(Bytes)
    }
}

/// Version 2 of the envelope: version 1's header, each delta and control message a
/// [`Part`] of its own (see the module's notes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvelopeV2 {
    /// The cluster it belongs to.
    pub cluster_id: u64,
    /// The sender.
    pub from: NodeId,
    /// What the deltas are.
    pub kind: EnvelopeKind,
    /// When it was sent (the sender's cluster time, µs).
    pub sent_us: u64,
    /// The deltas, each encoded on its own, in the sender's order.
    pub deltas: Vec<Part>,
    /// Requests and announcements, each encoded on its own.
    pub control: Vec<Part>,
}

/// What travels between routers; a new version is a new variant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Envelope {
    /// Version 1.
    V1(EnvelopeV1),
    /// Version 2.
    V2(EnvelopeV2),
}

/// The versions this build writes (and reads).
pub const WIRE_VERSIONS: std::ops::RangeInclusive<u8> = 1..=2;

/// Why bytes were not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Longer than [`MAX_ENVELOPE_BYTES`].
    #[error("envelope of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// Not a valid envelope (truncated, garbage, unknown version).
    #[error("undecodable envelope: {0}")]
    Malformed(String),
    /// Trailing bytes after a valid envelope.
    #[error("{0} trailing bytes after the envelope")]
    Trailing(usize),
    /// Another cluster's envelope.
    #[error("envelope of cluster {got:#x}, this is {want:#x}")]
    OtherCluster {
        /// Its cluster id.
        got: u64,
        /// Ours.
        want: u64,
    },
}

fn config() -> bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_ENVELOPE_BYTES>,
> {
    bincode::config::standard().with_limit::<MAX_ENVELOPE_BYTES>()
}

/// The encoded size of one part of an envelope (a delta, a control message), as it travels
/// inside one: what byte accounting by kind measures.
pub fn encoded_len<T: Serialize>(v: &T) -> usize {
    bincode::serde::encode_to_vec(v, config()).map_or(0, |b| b.len())
}

/// Encodes an envelope.
pub fn encode(e: &Envelope) -> Result<Vec<u8>, WireError> {
    bincode::serde::encode_to_vec(e, config()).map_err(|x| WireError::Malformed(x.to_string()))
}

/// Encodes an envelope's contents as `version` (1 or 2; see the module's notes).
pub fn encode_as(e: EnvelopeV1, version: u8) -> Result<Vec<u8>, WireError> {
    if version != 2 {
        return encode(&Envelope::V1(e));
    }
    let v2 = EnvelopeV2 {
        cluster_id: e.cluster_id,
        from: e.from,
        kind: e.kind,
        sent_us: e.sent_us,
        deltas: e.deltas.iter().map(Part::of).collect::<Result<_, _>>()?,
        control: e.control.iter().map(Part::of).collect::<Result<_, _>>()?,
    };
    encode(&Envelope::V2(v2))
}

/// Decodes one part: exactly one value, no byte left over.
fn decode_part<T: serde::de::DeserializeOwned>(p: &Part) -> Option<T> {
    match bincode::serde::decode_from_slice::<T, _>(&p.0, config()) {
        Ok((v, used)) if used == p.0.len() => Some(v),
        _ => None,
    }
}

/// Decodes an envelope of `cluster_id` from hostile bytes: size-bounded, never panics.
pub fn decode(bytes: &[u8], cluster_id: u64) -> Result<EnvelopeV1, WireError> {
    decode_counting(bytes, cluster_id).map(|(e, _)| e)
}

/// [`decode`], and how many parts of a version 2 envelope were skipped because they did not
/// decode (a kind of delta or control message this build does not know, or garbage).
pub fn decode_counting(bytes: &[u8], cluster_id: u64) -> Result<(EnvelopeV1, usize), WireError> {
    if bytes.len() > MAX_ENVELOPE_BYTES {
        return Err(WireError::TooLarge(bytes.len()));
    }
    let (env, used): (Envelope, usize) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|x| WireError::Malformed(x.to_string()))?;
    if used != bytes.len() {
        return Err(WireError::Trailing(bytes.len() - used));
    }
    let got = match &env {
        Envelope::V1(e) => e.cluster_id,
        Envelope::V2(e) => e.cluster_id,
    };
    if got != cluster_id {
        return Err(WireError::OtherCluster {
            got,
            want: cluster_id,
        });
    }
    // Parts are decoded only for this cluster's envelopes.
    let (v1, skipped) = match env {
        Envelope::V1(v1) => (v1, 0),
        Envelope::V2(v2) => {
            let deltas: Vec<Delta> = v2.deltas.iter().filter_map(decode_part).collect();
            let control: Vec<Control> = v2.control.iter().filter_map(decode_part).collect();
            let skipped = v2.deltas.len() + v2.control.len() - deltas.len() - control.len();
            let v1 = EnvelopeV1 {
                cluster_id: v2.cluster_id,
                from: v2.from,
                kind: v2.kind,
                sent_us: v2.sent_us,
                deltas,
                control,
            };
            (v1, skipped)
        }
    };
    Ok((v1, skipped))
}
