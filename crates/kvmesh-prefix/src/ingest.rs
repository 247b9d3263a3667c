//! The KV-event ingestion state machine of one engine (pure: the ZMQ subscriber shell feeds it
//! batches and forwards its [`IndexOp`]s to the index).
//!
//! * **Sequence tracking.** Batches are applied strictly in seq order. A batch ahead of the
//!   expected seq is not applied: [`IngestOutcome::Gap`] asks the shell to replay the missing
//!   range, and the engine is stale until it is filled (or the shell gives up with
//!   [`EngineIngest::mark_stale`]). A seq below the expected one is an exact duplicate (same
//!   seq, same content fingerprint, among the last [`RECENT_BATCHES`]) and is ignored, or else an
//!   engine restart: new epoch, the engine's blocks dropped ([`IndexOp::Cleared`]).
//! * **Rehashing.** `BlockStored` token ids are rehashed into our [`BlockKey`]s, chained from the
//!   parent's key: the engine-hash → (key, chain position, copies) map resolves parents and
//!   `BlockRemoved` (which carries engine hashes only). Int and bytes hashes are both accepted.
//! * **Bounded.** The map holds at most `capacity` hashes; beyond it the least recently stored
//!   hash is forgotten and its copies removed from the index (counted), so a hostile or buggy
//!   stream cannot grow memory.

use crate::index::IndexOp;
use crate::keys::{BlockKey, ExtraKeys, block_key_with};
use kvmesh_kvevents::{BlockHash, DecodedBatch, EventBatch, KvEvent, MEDIUM_GPU, MsgValue};
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// Batches remembered (seq and content fingerprint) to recognise exact duplicates.
pub const RECENT_BATCHES: usize = 256;

/// Configuration of one engine's ingestion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngestConfig {
    /// The engine's tokens per block (and the router's): events with another block size are
    /// skipped and counted (a mismatch would over-count matches, llm-d #2889).
    pub block_size: u32,
    /// Engine hashes tracked at most: set it to the engine's KV-cache size in blocks
    /// (`num_gpu_blocks`), and the index capacity of the engine to at least as much.
    pub capacity: usize,
}

/// What [`EngineIngest::on_batch`] did with a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestOutcome {
    /// Applied in order; its ops were appended.
    Applied,
    /// Same seq and content as a batch already applied: ignored.
    Duplicate,
    /// Batches `from..to` (half-open; `to` is this batch's seq) are missing. This batch was
    /// **not** applied: the shell should replay from `from` (the replay includes this batch) and
    /// feed the replayed batches in order, or give up with [`EngineIngest::mark_stale`]. The
    /// engine is stale meanwhile. Returned for every batch received ahead of the gap; the
    /// shell keeps one replay in flight.
    Gap {
        /// First missing seq.
        from: u64,
        /// This batch's seq.
        to: u64,
    },
    /// The seq went backwards without being a duplicate: the engine restarted. The epoch was
    /// bumped and [`IndexOp::Cleared`] appended; then the batch was applied if its seq is 0,
    /// otherwise `gap` is `Some((0, seq))` and the batch was not applied (as for `Gap`).
    Restarted {
        /// The new epoch.
        epoch: u32,
        /// Missing batches of the new epoch, if any.
        gap: Option<(u64, u64)>,
    },
}

/// Why an engine's view is not exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staleness {
    /// Every batch of the epoch was applied in order (or the state was reset since).
    Fresh,
    /// A gap is open; waiting for the replay.
    AwaitingReplay,
    /// The shell gave up on a gap: blocks stored or removed in the lost batches are unknown.
    /// Cleared by the next exact resync point: `AllBlocksCleared` or a restart.
    GaveUp,
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngestStats {
    /// Batches applied.
    pub batches_applied: u64,
    /// Exact duplicates ignored.
    pub duplicates: u64,
    /// Gaps opened (one per distinct gap, not per held-back batch).
    pub gaps: u64,
    /// Batches not applied because they were ahead of a gap.
    pub batches_held: u64,
    /// Gaps the shell gave up on.
    pub gave_up: u64,
    /// Restarts (seq regressions and explicit [`EngineIngest::on_restart`]).
    pub restarts: u64,
    /// Blocks stored (one per tracked copy).
    pub blocks_stored: u64,
    /// Blocks removed (resolved engine hashes).
    pub blocks_removed: u64,
    /// `AllBlocksCleared` events.
    pub clears: u64,
    /// Events skipped: block size differs from the configured one.
    pub skipped_block_size: u64,
    /// Events skipped: medium other than GPU (CPU offload tiers do not serve prefix hits).
    pub skipped_medium: u64,
    /// Events skipped: token count is not blocks × block size, or no hashes.
    pub skipped_malformed: u64,
    /// Events of unknown type the decoder skipped (from [`DecodedBatch::skipped_unknown`]).
    pub skipped_unknown: u64,
    /// Blocks skipped because their parent hash is unknown (chain start unknown).
    pub unknown_parent_blocks: u64,
    /// `BlockRemoved` hashes that were not tracked.
    pub unknown_removed: u64,
    /// Stored hashes already tracked under a different key (kept as they were).
    pub hash_conflicts: u64,
    /// Hashes forgotten because the map was at capacity.
    pub evicted_hashes: u64,
}

#[derive(Debug, Clone, Copy)]
struct Tracked {
    key: BlockKey,
    pos: u32,
    copies: u32,
    stamp: u64,
}

#[inline]
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Deterministic hasher for engine hashes (no per-process random state).
#[derive(Default, Clone, Copy)]
struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        mix(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// An engine hash as a u64: ints as they are, bytes through blake3 (first 8 bytes, LE).
#[inline]
pub fn engine_hash_u64(h: &BlockHash) -> u64 {
    match h {
        BlockHash::Int(v) => *v,
        BlockHash::Bytes(b) => {
            let d = blake3::hash(b);
            u64::from_le_bytes(d.as_bytes()[..8].try_into().expect("8 bytes"))
        }
    }
}

/// A cheap content fingerprint of a batch (timestamp, events, their first hashes and sizes),
/// to tell an exact duplicate from a restarted engine's batch with the same seq.
fn fingerprint(b: &EventBatch) -> u64 {
    let mut x = mix(b.ts.to_bits() ^ (b.events.len() as u64).rotate_left(48));
    for ev in &b.events {
        let (tag, first, n, toks) = match ev {
            KvEvent::BlockStored {
                block_hashes,
                token_ids,
                ..
            } => (1, block_hashes.first(), block_hashes.len(), token_ids.len()),
            KvEvent::BlockRemoved { block_hashes, .. } => {
                (2, block_hashes.first(), block_hashes.len(), 0)
            }
            KvEvent::AllBlocksCleared => (3, None, 0, 0),
        };
        let h = match first {
            Some(BlockHash::Int(v)) => *v,
            Some(BlockHash::Bytes(b)) => b.iter().fold(b.len() as u64, |a, &c| {
                a.wrapping_mul(31).wrapping_add(c as u64)
            }),
            None => 0,
        };
        x = mix(x ^ tag ^ h.rotate_left(7) ^ ((n as u64) << 20) ^ ((toks as u64) << 40));
    }
    x
}

/// The per-block extra keys of a `BlockStored`: vLLM lists, per block, its extra hash keys
/// (LoRA name first, then multimodal identifiers, then the cache salt on the first block). A
/// LoRA name equal to the event's is dropped; a lone string on a chain's first block is the
/// cache salt; anything else is opaque (digested, so that such blocks never match a key the
/// router computes from token ids alone: no false hits for multimodal prompts).
fn block_extras<'a>(
    extra_keys: Option<&'a [MsgValue]>,
    j: usize,
    lora: Option<&str>,
    lora_id_only: Option<i64>,
    root: bool,
) -> (Option<&'a str>, Option<[u8; 32]>) {
    let mut rest: &[MsgValue] = match extra_keys.and_then(|e| e.get(j)) {
        None | Some(MsgValue::Nil) => &[],
        Some(MsgValue::Array(items)) => items,
        Some(other) => std::slice::from_ref(other),
    };
    if let (Some(l), Some(MsgValue::Str(s))) = (lora, rest.first())
        && s == l
    {
        rest = &rest[1..];
    }
    let mut salt = None;
    if root && let [MsgValue::Str(s)] = rest {
        salt = Some(s.as_str());
        rest = &[];
    }
    if rest.is_empty() && lora_id_only.is_none() {
        return (salt, None);
    }
    let mut h = blake3::Hasher::new();
    if let Some(id) = lora_id_only {
        h.update(b"lora_id");
        h.update(&id.to_le_bytes());
    }
    for v in rest {
        h.update(&kvmesh_kvevents::encode_value(v));
    }
    (salt, Some(*h.finalize().as_bytes()))
}

#[inline]
fn is_gpu(medium: &Option<String>) -> bool {
    medium
        .as_deref()
        .is_none_or(|m| m.eq_ignore_ascii_case(MEDIUM_GPU))
}

/// One engine's ingestion state. See the module docs.
#[derive(Debug, Clone)]
pub struct EngineIngest {
    cfg: IngestConfig,
    epoch: u32,
    next_seq: Option<u64>,
    gap: Option<(u64, u64)>,
    staleness: Staleness,
    stale_since_us: Option<u64>,
    /// After `mark_stale`: the next batch is applied whatever its seq (a regression starts a
    /// new epoch with it, stale).
    resume: bool,
    recent: Vec<(u64, u64)>,
    hashes: HashMap<u64, Tracked, BuildHasherDefault<MixHasher>>,
    /// (hash, stamp) in store order; records whose stamp is no longer the hash's are stale.
    order: VecDeque<(u64, u64)>,
    stamp: u64,
    scratch: Vec<(u64, BlockKey, u32)>,
    /// Per `Stored` op emitted since the last [`EngineIngest::take_stored_meta`]: the
    /// engine's hash of the block and its chain position (a mesh feed carries them so that
    /// another router can take the stream over).
    stored_meta: Vec<(u64, u32)>,
    stats: IngestStats,
}

impl EngineIngest {
    /// A new engine stream: nothing applied yet (the first batch is expected to be seq 0).
    pub fn new(cfg: IngestConfig) -> EngineIngest {
        EngineIngest {
            cfg,
            epoch: 0,
            next_seq: None,
            gap: None,
            staleness: Staleness::Fresh,
            stale_since_us: None,
            resume: false,
            recent: Vec::new(),
            hashes: HashMap::default(),
            order: VecDeque::new(),
            stamp: 0,
            scratch: Vec::new(),
            stored_meta: Vec::new(),
            stats: IngestStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &IngestConfig {
        &self.cfg
    }

    /// Sets the block size the engine's events must have (the router learnt the engine's model
    /// after its events started, e.g. an engine found through DNS whose model has its own
    /// block size). If events were skipped for their block size before, the engine's blocks
    /// are not exactly known: it is marked stale until its next exact resync point.
    pub fn set_block_size(&mut self, block_size: u32, now_us: u64) {
        if block_size == self.cfg.block_size || block_size == 0 {
            return;
        }
        self.cfg.block_size = block_size;
        if self.stats.skipped_block_size > 0 {
            self.mark_stale(now_us);
        }
    }

    /// Restarts seen so far (0 at first).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The seq the next in-order batch must carry (`None` before the first batch of an epoch).
    pub fn next_seq(&self) -> Option<u64> {
        self.next_seq
    }

    /// Whether the engine's stream as its replay socket holds it now (`replayed`: the whole
    /// history from seq 0, in order) is another than the one applied in this epoch: it is
    /// shorter than what was applied, or a batch of a seq applied here differs (each batch
    /// carries its publication time). A restart whose batches never arrived here (published
    /// before the subscription came back) after one the events did show: the restart hint
    /// then finds the epoch already moved on.
    pub fn is_another_stream<'a>(
        &self,
        replayed: impl IntoIterator<Item = (u64, &'a EventBatch)>,
    ) -> bool {
        let Some(next) = self.next_seq else {
            return false;
        };
        let mut last = None;
        for (seq, b) in replayed {
            last = Some(seq);
            let slot = seq as usize % RECENT_BATCHES;
            if self
                .recent
                .get(slot)
                .is_some_and(|&(s, fp)| s == seq && fp != fingerprint(b))
            {
                return true;
            }
        }
        last.is_none_or(|l| l.saturating_add(1) < next)
    }

    /// The open gap `(from, to)`, if any.
    pub fn pending_gap(&self) -> Option<(u64, u64)> {
        self.gap
    }

    /// True while the engine's blocks are not exactly known (gap open or given up): route it as
    /// approximate.
    pub fn is_stale(&self) -> bool {
        self.staleness != Staleness::Fresh
    }

    /// Why the engine is stale, if it is.
    pub fn staleness(&self) -> Staleness {
        self.staleness
    }

    /// When the engine became stale (the `now_us` passed then).
    pub fn stale_since_us(&self) -> Option<u64> {
        self.stale_since_us
    }

    /// Counters.
    pub fn stats(&self) -> &IngestStats {
        &self.stats
    }

    /// Engine hashes tracked.
    pub fn tracked_hashes(&self) -> usize {
        self.hashes.len()
    }

    /// Heap bytes held, approximately (map and queue capacity).
    pub fn memory_bytes(&self) -> usize {
        self.hashes.capacity() * (size_of::<(u64, Tracked)>() + 1)
            + self.order.capacity() * 16
            + self.recent.capacity() * 16
            + self.scratch.capacity() * size_of::<(u64, BlockKey, u32)>()
    }

    /// A decoded batch: counts the events the decoder skipped, then [`on_batch`](Self::on_batch).
    pub fn on_decoded(
        &mut self,
        seq: u64,
        batch: &DecodedBatch,
        now_us: u64,
        ops: &mut Vec<IndexOp>,
    ) -> IngestOutcome {
        let out = self.on_batch(seq, &batch.batch, now_us, ops);
        if matches!(
            out,
            IngestOutcome::Applied | IngestOutcome::Restarted { gap: None, .. }
        ) {
            self.stats.skipped_unknown += batch.skipped_unknown as u64;
        }
        out
    }

    /// Handles batch `seq` received at `now_us`; index changes are appended to `ops` (apply
    /// them to the engine's entries with [`crate::PrefixIndex::apply_all`]).
    pub fn on_batch(
        &mut self,
        seq: u64,
        batch: &EventBatch,
        now_us: u64,
        ops: &mut Vec<IndexOp>,
    ) -> IngestOutcome {
        let fp = fingerprint(batch);
        match self.next_seq {
            Some(exp) if seq < exp => {
                let slot = seq as usize % RECENT_BATCHES;
                if self.recent.get(slot) == Some(&(seq, fp)) {
                    self.stats.duplicates += 1;
                    return IngestOutcome::Duplicate;
                }
                // Given up (`mark_stale`): this batch is the new baseline whatever its seq.
                let baseline = self.resume;
                self.new_epoch(ops);
                if seq == 0 || baseline {
                    if seq != 0 {
                        // What the new epoch held before this batch is unknown: stale until
                        // the engine's next clear. (Left as a gap, no replay would ever fill
                        // it and every later batch was held back: QA.)
                        self.staleness = Staleness::GaveUp;
                        self.stale_since_us = Some(now_us);
                    }
                    self.apply(seq, fp, batch, ops);
                    IngestOutcome::Restarted {
                        epoch: self.epoch,
                        gap: None,
                    }
                } else {
                    self.open_gap(0, seq, now_us);
                    IngestOutcome::Restarted {
                        epoch: self.epoch,
                        gap: Some((0, seq)),
                    }
                }
            }
            Some(exp) if seq > exp && !self.resume => {
                self.open_gap(exp, seq, now_us);
                IngestOutcome::Gap { from: exp, to: seq }
            }
            None if seq > 0 && !self.resume => {
                self.open_gap(0, seq, now_us);
                IngestOutcome::Gap { from: 0, to: seq }
            }
            _ => {
                self.apply(seq, fp, batch, ops);
                IngestOutcome::Applied
            }
        }
    }

    /// The shell gives up on the open gap (no replay socket, or history already gone): the
    /// engine stays stale ([`Staleness::GaveUp`]) and the next batch is applied whatever its
    /// seq, as the new baseline. Its blocks are kept: most are still right (unless that
    /// batch's seq went back: a new epoch, its blocks dropped, stale until the next clear).
    pub fn mark_stale(&mut self, now_us: u64) {
        self.gap = None;
        self.resume = true;
        if self.staleness == Staleness::Fresh {
            self.stale_since_us = Some(now_us);
        }
        self.staleness = Staleness::GaveUp;
        self.stats.gave_up += 1;
    }

    /// The engine hash and chain position of each `Stored` op emitted since the last call, in
    /// order (cleared by the call).
    pub fn take_stored_meta(&mut self, into: &mut Vec<(u64, u32)>) {
        into.clear();
        into.append(&mut self.stored_meta);
    }

    /// Takes over an engine's stream from another router's snapshot: its blocks (engine
    /// hash, key, chain position, copies) and the seq it expected next. The next batches
    /// continue from there (a gap to the engine's current seq opens a replay, as usual);
    /// `stale` carries the other router's doubt over. Emits no ops: the blocks are already in
    /// the index the snapshot came with.
    pub fn import(
        &mut self,
        blocks: impl IntoIterator<Item = (u64, BlockKey, u32, u32)>,
        next_seq: Option<u64>,
        stale: bool,
        now_us: u64,
    ) {
        self.forget_all();
        for (h, key, pos, copies) in blocks {
            if h == 0 || self.hashes.len() >= self.cfg.capacity {
                continue;
            }
            self.stamp += 1;
            self.hashes.insert(
                h,
                Tracked {
                    key,
                    pos,
                    copies: copies.max(1),
                    stamp: self.stamp,
                },
            );
            self.order.push_back((h, self.stamp));
        }
        self.next_seq = next_seq;
        self.gap = None;
        self.resume = false;
        self.recent.clear();
        if stale {
            self.mark_stale(now_us);
        }
    }

    /// The shell learned of a restart some other way (process restarted, health check): new
    /// epoch, blocks dropped, next batch expected at seq 0.
    pub fn on_restart(&mut self, ops: &mut Vec<IndexOp>) {
        self.new_epoch(ops);
    }

    fn new_epoch(&mut self, ops: &mut Vec<IndexOp>) {
        self.epoch += 1;
        self.stats.restarts += 1;
        self.next_seq = None;
        self.gap = None;
        self.resume = false;
        self.staleness = Staleness::Fresh;
        self.stale_since_us = None;
        self.recent.clear();
        self.forget_all();
        ops.push(IndexOp::Cleared);
    }

    fn forget_all(&mut self) {
        self.hashes.clear();
        self.order.clear();
    }

    fn open_gap(&mut self, from: u64, to: u64, now_us: u64) {
        self.stats.batches_held += 1;
        match &mut self.gap {
            Some(g) => g.1 = g.1.max(to),
            None => {
                self.gap = Some((from, to));
                self.stats.gaps += 1;
            }
        }
        if self.staleness == Staleness::Fresh {
            self.staleness = Staleness::AwaitingReplay;
            self.stale_since_us = Some(now_us);
        }
    }

    fn apply(&mut self, seq: u64, fp: u64, batch: &EventBatch, ops: &mut Vec<IndexOp>) {
        self.resume = false;
        for ev in &batch.events {
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
                    ..
                } => {
                    if !is_gpu(medium) {
                        self.stats.skipped_medium += 1;
                    } else if *block_size != self.cfg.block_size {
                        self.stats.skipped_block_size += 1;
                    } else {
                        let lora_id_only = lora_id.filter(|_| lora_name.is_none());
                        self.stored(
                            block_hashes,
                            parent_block_hash.as_ref(),
                            token_ids,
                            lora_name.as_deref(),
                            lora_id_only,
                            extra_keys.as_deref(),
                            ops,
                        );
                    }
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } => {
                    if !is_gpu(medium) {
                        self.stats.skipped_medium += 1;
                    } else {
                        self.removed(block_hashes, ops);
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.stats.clears += 1;
                    self.forget_all();
                    ops.push(IndexOp::Cleared);
                    if self.staleness == Staleness::GaveUp {
                        self.staleness = Staleness::Fresh;
                        self.stale_since_us = None;
                    }
                }
            }
        }
        self.stats.batches_applied += 1;
        // (An engine's seq is its own bytes: one at the end of u64 is not followed by another.)
        self.next_seq = Some(seq.saturating_add(1));
        if self.recent.is_empty() {
            self.recent = vec![(u64::MAX, 0); RECENT_BATCHES];
        }
        self.recent[seq as usize % RECENT_BATCHES] = (seq, fp);
        if let Some((_, to)) = self.gap
            && seq >= to
        {
            self.gap = None;
            if self.staleness == Staleness::AwaitingReplay {
                self.staleness = Staleness::Fresh;
                self.stale_since_us = None;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn stored(
        &mut self,
        hashes: &[BlockHash],
        parent: Option<&BlockHash>,
        tokens: &[u32],
        lora: Option<&str>,
        lora_id_only: Option<i64>,
        extra_keys: Option<&[MsgValue]>,
        ops: &mut Vec<IndexOp>,
    ) {
        let bs = self.cfg.block_size as usize;
        let n = hashes.len();
        if n == 0 || bs == 0 || tokens.len() != n * bs {
            self.stats.skipped_malformed += 1;
            return;
        }
        let (mut parent_key, mut pos) = match parent {
            None => (None, 0u32),
            Some(h) => match self.hashes.get(&engine_hash_u64(h)) {
                Some(t) => (Some(t.key), t.pos.saturating_add(1)),
                None => {
                    // Unknown chain start (evicted from the map or lost in a gap): no request
                    // key can ever reach these blocks (keys chain from the prompt's first
                    // block), so they are skipped, and so are their descendants later.
                    self.stats.unknown_parent_blocks += n as u64;
                    return;
                }
            },
        };
        // Keys in chain order, then tracked and emitted deepest first so that the chain's
        // first block ends up most recently used (evicted last), in the map and the index.
        self.scratch.clear();
        for (j, h) in hashes.iter().enumerate() {
            let (salt, opaque) =
                block_extras(extra_keys, j, lora, lora_id_only, parent_key.is_none());
            let extra = ExtraKeys {
                lora_name: lora,
                cache_salt: salt,
            };
            let blk = &tokens[j * bs..(j + 1) * bs];
            let key = block_key_with(parent_key, pos as usize, blk, extra, opaque.as_ref());
            self.scratch.push((engine_hash_u64(h), key, pos));
            parent_key = Some(key);
            pos = pos.saturating_add(1);
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        for &(h, key, pos) in scratch.iter().rev() {
            if self.track(h, key, pos, ops) {
                ops.push(IndexOp::Stored(key));
                self.stored_meta.push((h, pos));
                self.stats.blocks_stored += 1;
            }
        }
        scratch.clear();
        self.scratch = scratch;
    }

    /// Records one more copy of engine hash `h`; false if not tracked (conflict or capacity 0).
    fn track(&mut self, h: u64, key: BlockKey, pos: u32, ops: &mut Vec<IndexOp>) -> bool {
        self.stamp += 1;
        let stamp = self.stamp;
        match self.hashes.get_mut(&h) {
            Some(t) if t.key != key => {
                self.stats.hash_conflicts += 1;
                return false;
            }
            Some(t) => {
                t.copies = t.copies.saturating_add(1);
                t.stamp = stamp;
            }
            None => {
                if self.cfg.capacity == 0 {
                    return false;
                }
                while self.hashes.len() >= self.cfg.capacity && self.evict_oldest(ops) {}
                self.hashes.insert(
                    h,
                    Tracked {
                        key,
                        pos,
                        copies: 1,
                        stamp,
                    },
                );
            }
        }
        self.order.push_back((h, stamp));
        if self.order.len() > 2 * self.hashes.len() + 64 {
            let hashes = &self.hashes;
            self.order
                .retain(|(h, st)| hashes.get(h).is_some_and(|t| t.stamp == *st));
        }
        true
    }

    /// Forgets the least recently stored hash (its copies are removed from the index); false
    /// if there was none.
    fn evict_oldest(&mut self, ops: &mut Vec<IndexOp>) -> bool {
        while let Some((h, st)) = self.order.pop_front() {
            if let Some(t) = self.hashes.get(&h)
                && t.stamp == st
            {
                let t = self.hashes.remove(&h).expect("present");
                for _ in 0..t.copies {
                    ops.push(IndexOp::Removed(t.key));
                }
                self.stats.evicted_hashes += 1;
                return true;
            }
        }
        false
    }

    fn removed(&mut self, hashes: &[BlockHash], ops: &mut Vec<IndexOp>) {
        for h in hashes {
            let h = engine_hash_u64(h);
            match self.hashes.get_mut(&h) {
                Some(t) => {
                    ops.push(IndexOp::Removed(t.key));
                    self.stats.blocks_removed += 1;
                    t.copies -= 1;
                    if t.copies == 0 {
                        self.hashes.remove(&h);
                    }
                }
                None => self.stats.unknown_removed += 1,
            }
        }
    }
}
