//! The prefix index: which engines hold which block keys, with bounded memory.
//!
//! # Structure
//!
//! * **Entry slab** (`Vec<Entry>`, 32 bytes per entry): one entry per (engine, key) with the
//!   confirmed copy count, the speculative expiry, and the links of its engine's LRU list.
//!   Freed slots are reused through a free list.
//! * **Member table** (open addressing, 8 bytes per slot at load ≤ 4/5): (engine, key) → entry,
//!   for O(1) inserts, removals and "does engine e hold key k" probes.
//! * **Anchor postings**: anchor key → the entries holding it (one inline, more in a `Vec`).
//!   Only anchor keys (chain positions that are multiples of
//!   [`ANCHOR_STRIDE`](crate::ANCHOR_STRIDE), flagged in the key itself) have postings, so
//!   enumerating candidate engines never scans the fleet.
//! * **Per engine** (28 bytes per engine id): capacity, counts, LRU head and tail. No per-engine
//!   table: memory depends on the number of entries, not on the number of engines.
//! * **Expiry heap** of (expiry, entry) records for speculative entries, validated lazily
//!   and compacted when stale records outnumber live speculative entries.
//!
//! # Semantics
//!
//! An entry is *live* at `now` when it has a confirmed copy (`count > 0`, from KV events) or an
//! unexpired speculative mark (`expiry > now`, inserted at routing time; join = max). Expiry is
//! applied lazily and deterministically at read time: a lookup never matches an expired mark,
//! swept or not. [`PrefixIndex::expire`] drops expired entries physically (call it every second
//! or so); until then an expired entry still counts toward its engine's capacity. The same
//! calls with the same `now` values always give the same state and the same answers.

use crate::keys::BlockKey;
use crate::table::IdxTable;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// A router-assigned engine slot (dense small integers: the index keeps 28 bytes per id up to
/// the largest one used).
pub type Slot = u32;

/// Engine ids must be below this.
pub const MAX_ENGINES: u32 = 1 << 20;

const NIL: u32 = u32::MAX;
/// How many keys ahead lookups prefetch member-table slots.
const PREFETCH_AHEAD: usize = 4;
/// `Entry::engine` of a free slab slot.
const FREE: u32 = u32::MAX;

/// One engine's match for a request: it holds the request's first `blocks` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Match {
    /// The engine.
    pub engine: Slot,
    /// Leading blocks of the request it holds (consecutive from the first).
    pub blocks: u32,
}

/// A change to one engine's confirmed blocks, as the KV-event ingestion derives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexOp {
    /// The engine cached one more copy of the block.
    Stored(BlockKey),
    /// The engine evicted one copy of the block.
    Removed(BlockKey),
    /// The engine's cache was cleared (AllBlocksCleared, restart): drop all its entries.
    Cleared,
}

/// The version of one engine's op batch: its ingestion epoch (a restart starts a new one) and
/// the batch's seq within it; `seq: None` is the epoch's start (a restart seen before any
/// batch of the new process). Ordered by (epoch, seq) with `None` first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpVersion {
    /// Restarts seen.
    pub epoch: u32,
    /// The batch's seq in the epoch.
    pub seq: Option<u64>,
}

/// One engine's entry counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCounts {
    /// Entries stored (confirmed or speculative, including expired ones not yet swept).
    pub entries: u32,
    /// Entries with at least one confirmed copy.
    pub confirmed: u32,
    /// Entries carrying a speculative expiry (possibly past, until swept).
    pub speculative: u32,
    /// The engine's capacity in entries.
    pub capacity: u32,
}

/// Whole-index counters, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Engines added and not removed.
    pub engines: u32,
    /// Entries stored.
    pub entries: u64,
    /// Entries with a confirmed copy.
    pub confirmed: u64,
    /// Entries with a speculative expiry.
    pub speculative: u64,
    /// Entries evicted because their engine was at capacity (LRU).
    pub evicted: u64,
    /// Entries dropped because their speculative mark expired.
    pub expired: u64,
    /// Inserts and ops for engines that were not added (ignored).
    pub ignored: u64,
    /// Op batches skipped because their version was already applied.
    pub duplicates: u64,
    /// Heap bytes held by the index (see [`PrefixIndex::memory_bytes`]).
    pub memory_bytes: u64,
}

/// Errors of [`PrefixIndex::add_engine`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// Engine ids are dense slots below [`MAX_ENGINES`].
    #[error("engine id {0} is out of range (ids must be below {MAX_ENGINES})")]
    EngineIdOutOfRange(Slot),
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    key: u64,
    /// Speculative expiry in µs; 0 = none.
    expiry: u64,
    engine: u32,
    /// Confirmed copies.
    count: u32,
    /// LRU neighbours (towards the most / least recently used); free-list link when free.
    prev: u32,
    next: u32,
}

impl Entry {
    #[inline]
    fn live(&self, now: u64) -> bool {
        self.count > 0 || self.expiry > now
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct EngineSlot {
    present: bool,
    capacity: u32,
    len: u32,
    confirmed: u32,
    speculative: u32,
    /// Most recently used entry.
    head: u32,
    /// Least recently used entry (evicted first).
    tail: u32,
    /// Version of the last op batch applied.
    applied: Option<OpVersion>,
}

#[derive(Debug, Clone)]
enum Posting {
    One(u32),
    Many(Vec<u32>),
}

impl Posting {
    #[inline]
    fn as_slice(&self) -> &[u32] {
        match self {
            Posting::One(i) => std::slice::from_ref(i),
            Posting::Many(v) => v,
        }
    }
}

/// Hasher for keys that are already uniform 64-bit values (anchor keys: bit 0 is always set,
/// so it folds the high half in).
#[derive(Default, Clone, Copy)]
struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
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

type AnchorMap = HashMap<u64, Posting, BuildHasherDefault<FoldHasher>>;

/// Hints the CPU to load `p`'s cache line (never faults, no observable effect).
#[inline]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: a prefetch is a hint: it never faults, even on an invalid address, and has no
    // observable effect; SSE (which provides it) is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[inline]
fn member_hash(engine: u32, key: u64) -> u64 {
    let mut x = key
        ^ u64::from(engine)
            .wrapping_add(1)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 32)
}

/// The bounded prefix index. See the module docs for the structure and semantics, and the
/// crate README for costs and measured memory.
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    entries: Vec<Entry>,
    free_head: Option<u32>,
    members: IdxTableDefault,
    anchors: AnchorMap,
    engines: Vec<EngineSlot>,
    heap: BinaryHeap<Reverse<(u64, u32)>>,
    n_engines: u32,
    n_entries: u64,
    n_confirmed: u64,
    n_speculative: u64,
    evicted: u64,
    expired: u64,
    ignored: u64,
    /// Heap bytes of the `Posting::Many` vectors, maintained (no walk to report memory).
    posting_bytes: usize,
    /// Op batches skipped because their version was already applied.
    duplicates: u64,
}

/// `IdxTable` with a `Default` (empty, allocated on first insert).
#[derive(Debug, Clone)]
struct IdxTableDefault(IdxTable);

impl Default for IdxTableDefault {
    fn default() -> Self {
        IdxTableDefault(IdxTable::with_capacity(0))
    }
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    /// An empty index with room for `entries` entries without reallocating (size it to the sum
    /// of the engines' capacities to pin memory at its minimum).
    pub fn with_capacity(entries: usize) -> PrefixIndex {
        PrefixIndex {
            entries: Vec::with_capacity(entries),
            members: IdxTableDefault(IdxTable::with_capacity(entries)),
            ..PrefixIndex::default()
        }
    }

    /// Adds engine `engine` with room for `capacity` entries (confirmed and speculative
    /// together; beyond it the least recently used entry is evicted). An engine already present
    /// keeps its entries and gets the new capacity.
    pub fn add_engine(&mut self, engine: Slot, capacity: u32) -> Result<(), IndexError> {
        if engine >= MAX_ENGINES {
            return Err(IndexError::EngineIdOutOfRange(engine));
        }
        let i = engine as usize;
        if self.engines.len() <= i {
            self.engines.resize(i + 1, EngineSlot::default());
        }
        if !self.engines[i].present {
            self.engines[i] = EngineSlot {
                present: true,
                capacity,
                head: NIL,
                tail: NIL,
                ..EngineSlot::default()
            };
            self.n_engines += 1;
        } else {
            self.set_capacity(engine, capacity);
        }
        Ok(())
    }

    /// Changes an engine's capacity, evicting its least recently used entries if it shrinks.
    /// Ignored for an unknown engine.
    pub fn set_capacity(&mut self, engine: Slot, capacity: u32) {
        let Some(slot) = self.slot_mut(engine) else {
            return;
        };
        slot.capacity = capacity;
        while self.engines[engine as usize].len > capacity {
            self.evict_lru(engine);
        }
    }

    /// True when the engine was added and not removed.
    pub fn has_engine(&self, engine: Slot) -> bool {
        self.slot(engine).is_some()
    }

    /// Removes an engine and all its entries.
    pub fn remove_engine(&mut self, engine: Slot) {
        if self.slot(engine).is_none() {
            return;
        }
        self.clear_engine(engine);
        self.engines[engine as usize].present = false;
        self.n_engines -= 1;
    }

    /// Drops all of an engine's entries, confirmed and speculative (AllBlocksCleared, restart).
    pub fn clear_engine(&mut self, engine: Slot) {
        if self.slot(engine).is_none() {
            return;
        }
        while let Some(head) = self.slot(engine).map(|s| s.head).filter(|&h| h != NIL) {
            self.free_entry(head);
        }
    }

    #[inline]
    fn slot(&self, engine: Slot) -> Option<&EngineSlot> {
        self.engines.get(engine as usize).filter(|s| s.present)
    }

    #[inline]
    fn slot_mut(&mut self, engine: Slot) -> Option<&mut EngineSlot> {
        self.engines.get_mut(engine as usize).filter(|s| s.present)
    }

    /// The entry index of (engine, key).
    #[inline]
    fn find(&self, engine: Slot, key: u64) -> Option<u32> {
        let entries = &self.entries;
        self.members.0.find(member_hash(engine, key), |i| {
            let e = &entries[i as usize];
            e.key == key && e.engine == engine
        })
    }

    /// True when `engine` holds `key` live at `now` (confirmed, or speculative and unexpired).
    #[inline]
    pub fn holds(&self, engine: Slot, key: BlockKey, now_us: u64) -> bool {
        match self.find(engine, key.0) {
            Some(i) => self.entries[i as usize].live(now_us),
            None => false,
        }
    }

    /// One more confirmed copy of `key` on `engine` (a `BlockStored`). Refreshes the entry's
    /// LRU position; may evict the engine's least recently used entry. False when the engine
    /// is unknown or has capacity 0.
    pub fn store(&mut self, engine: Slot, key: BlockKey) -> bool {
        match self.find(engine, key.0) {
            Some(i) => {
                let e = &mut self.entries[i as usize];
                if e.count == 0 {
                    self.n_confirmed += 1;
                    self.engines[engine as usize].confirmed += 1;
                }
                let e = &mut self.entries[i as usize];
                e.count = e.count.saturating_add(1);
                self.touch(i);
                true
            }
            None => self.alloc_entry(engine, key.0, 1, 0).is_some(),
        }
    }

    /// One confirmed copy of `key` on `engine` fewer (a `BlockRemoved`). The last copy takes
    /// the entry with it, speculative mark and all: a mark says the engine will compute the
    /// block, and the engine has now said that it holds it no more (a mark left to its expiry
    /// predicted an evicted block for up to its whole life: QA measured 23–32% of predictions
    /// above what an evicting engine had cached, and misroutes). False when there was no
    /// confirmed copy (a mark alone stays).
    pub fn remove(&mut self, engine: Slot, key: BlockKey) -> bool {
        let Some(i) = self.find(engine, key.0) else {
            return false;
        };
        let e = &mut self.entries[i as usize];
        if e.count == 0 {
            return false;
        }
        e.count -= 1;
        if e.count == 0 {
            self.n_confirmed -= 1;
            self.engines[engine as usize].confirmed -= 1;
            self.free_entry(i);
        }
        true
    }

    /// Marks `keys` (a request's chain, first block first) as speculatively held by `engine`
    /// until `expiry_us` (join = max with an existing mark). Nothing happens when
    /// `expiry_us <= now_us`. The chain is touched tail first, so that under capacity pressure
    /// its deepest blocks are evicted before their ancestors (as vLLM evicts).
    pub fn insert_speculative(
        &mut self,
        engine: Slot,
        keys: &[BlockKey],
        expiry_us: u64,
        now_us: u64,
    ) {
        if expiry_us <= now_us {
            return;
        }
        match self.slot(engine) {
            None => {
                self.ignored += 1;
                return;
            }
            Some(s) if s.capacity == 0 => return,
            Some(_) => {}
        }
        for key in keys.iter().rev() {
            match self.find(engine, key.0) {
                Some(i) => {
                    let e = &mut self.entries[i as usize];
                    if expiry_us > e.expiry {
                        if e.expiry == 0 {
                            self.n_speculative += 1;
                            self.engines[engine as usize].speculative += 1;
                        }
                        self.entries[i as usize].expiry = expiry_us;
                        self.push_expiry(expiry_us, i);
                    }
                    self.touch(i);
                }
                None => {
                    if let Some(i) = self.alloc_entry(engine, key.0, 0, expiry_us) {
                        self.push_expiry(expiry_us, i);
                    }
                }
            }
        }
    }

    /// Applies one ingestion op to `engine`'s entries.
    pub fn apply(&mut self, engine: Slot, op: IndexOp) {
        if self.slot(engine).is_none() {
            self.ignored += 1;
            return;
        }
        match op {
            IndexOp::Stored(k) => {
                self.store(engine, k);
            }
            IndexOp::Removed(k) => {
                self.remove(engine, k);
            }
            IndexOp::Cleared => self.clear_engine(engine),
        }
    }

    /// Applies a versioned batch of `engine`'s ops, in order, if `version` is newer than the
    /// last batch applied to it; a redelivered or older batch changes nothing (false). A
    /// batch of a newer epoch first drops the engine's entries (it restarted: its cache is
    /// empty). So any redelivery of an engine's batches, in its version order, ends in the
    /// same index as applying each once.
    pub fn apply_batch(&mut self, engine: Slot, version: OpVersion, ops: &[IndexOp]) -> bool {
        let Some(s) = self.slot(engine) else {
            self.ignored += 1;
            return false;
        };
        match s.applied {
            Some(done) if version <= done => {
                self.duplicates += 1;
                return false;
            }
            Some(done) if version.epoch > done.epoch => self.clear_engine(engine),
            _ => {}
        }
        self.engines[engine as usize].applied = Some(version);
        self.apply_all(engine, ops);
        true
    }

    /// The version of the last batch applied to `engine`.
    pub fn applied_version(&self, engine: Slot) -> Option<OpVersion> {
        self.slot(engine).and_then(|s| s.applied)
    }

    /// Applies ops in order (unversioned: each op counts, however often it comes).
    pub fn apply_all(&mut self, engine: Slot, ops: &[IndexOp]) {
        for &op in ops {
            self.apply(engine, op);
        }
    }

    fn push_expiry(&mut self, expiry: u64, idx: u32) {
        self.heap.push(Reverse((expiry, idx)));
        if self.heap.len() as u64 > 2 * self.n_speculative + 1024 {
            // Drop records that no longer describe their entry (refreshed or freed).
            let entries = &self.entries;
            self.heap.retain(|Reverse((exp, i))| {
                let e = &entries[*i as usize];
                e.engine != FREE && e.expiry == *exp
            });
        }
    }

    /// Drops every speculative mark that expired at `now_us` (entries without a confirmed copy
    /// go). Returns the number of entries dropped. Cost: O(expired × log heap).
    pub fn expire(&mut self, now_us: u64) -> usize {
        let mut dropped = 0;
        while let Some(&Reverse((exp, i))) = self.heap.peek() {
            if exp > now_us {
                break;
            }
            self.heap.pop();
            let e = self.entries[i as usize];
            if e.engine == FREE || e.expiry == 0 || e.expiry > now_us {
                continue;
            }
            self.entries[i as usize].expiry = 0;
            self.n_speculative -= 1;
            self.engines[e.engine as usize].speculative -= 1;
            if e.count == 0 {
                self.free_entry(i);
                self.expired += 1;
                dropped += 1;
            }
        }
        dropped
    }

    /// Creates the entry (engine, key), evicting the engine's LRU entry when at capacity.
    fn alloc_entry(&mut self, engine: Slot, key: u64, count: u32, expiry: u64) -> Option<u32> {
        let slot = self.slot(engine)?;
        if slot.capacity == 0 {
            return None;
        }
        if slot.len >= slot.capacity {
            self.evict_lru(engine);
        }
        let entry = Entry {
            key,
            expiry,
            engine,
            count,
            prev: NIL,
            next: NIL,
        };
        let idx = match self.free_head {
            Some(i) => {
                let next = self.entries[i as usize].next;
                self.free_head = (next != NIL).then_some(next);
                self.entries[i as usize] = entry;
                i
            }
            None => {
                assert!(self.entries.len() < NIL as usize - 1, "prefix index full");
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        let entries = &self.entries;
        self.members.0.insert(member_hash(engine, key), idx, |i| {
            let e = &entries[i as usize];
            member_hash(e.engine, e.key)
        });
        if BlockKey(key).is_anchor() {
            match self.anchors.entry(key) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Posting::One(idx));
                }
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    let p = o.get_mut();
                    match p {
                        Posting::One(j) => {
                            let v = vec![*j, idx];
                            self.posting_bytes += v.capacity() * 4;
                            *p = Posting::Many(v);
                        }
                        Posting::Many(v) => {
                            let before = v.capacity();
                            v.push(idx);
                            self.posting_bytes += (v.capacity() - before) * 4;
                        }
                    }
                }
            }
        }
        self.link_front(idx);
        let s = &mut self.engines[engine as usize];
        s.len += 1;
        self.n_entries += 1;
        if count > 0 {
            s.confirmed += 1;
            self.n_confirmed += 1;
        }
        if expiry != 0 {
            s.speculative += 1;
            self.n_speculative += 1;
        }
        Some(idx)
    }

    fn evict_lru(&mut self, engine: Slot) {
        let tail = self.engines[engine as usize].tail;
        if tail != NIL {
            self.free_entry(tail);
            self.evicted += 1;
        }
    }

    /// Removes an entry from every structure and returns its slot to the free list.
    fn free_entry(&mut self, idx: u32) {
        let e = self.entries[idx as usize];
        debug_assert!(e.engine != FREE);
        let entries = &self.entries;
        let removed = self.members.0.remove(
            member_hash(e.engine, e.key),
            |i| i == idx,
            |i| {
                let x = &entries[i as usize];
                member_hash(x.engine, x.key)
            },
        );
        debug_assert!(removed);
        if BlockKey(e.key).is_anchor()
            && let std::collections::hash_map::Entry::Occupied(mut o) = self.anchors.entry(e.key)
        {
            let empty = match o.get_mut() {
                Posting::One(j) => *j == idx,
                Posting::Many(v) => {
                    if let Some(pos) = v.iter().position(|&j| j == idx) {
                        v.swap_remove(pos);
                    }
                    if v.len() == 1 {
                        let last = v[0];
                        self.posting_bytes -= v.capacity() * 4;
                        *o.get_mut() = Posting::One(last);
                    }
                    false
                }
            };
            if empty {
                o.remove();
            }
        }
        self.unlink(idx);
        let s = &mut self.engines[e.engine as usize];
        s.len -= 1;
        self.n_entries -= 1;
        if e.count > 0 {
            s.confirmed -= 1;
            self.n_confirmed -= 1;
        }
        if e.expiry != 0 {
            s.speculative -= 1;
            self.n_speculative -= 1;
        }
        let slot = &mut self.entries[idx as usize];
        slot.engine = FREE;
        slot.expiry = 0;
        slot.count = 0;
        slot.prev = NIL;
        slot.next = self.free_head.unwrap_or(NIL);
        self.free_head = Some(idx);
    }

    fn link_front(&mut self, idx: u32) {
        let engine = self.entries[idx as usize].engine as usize;
        let old = self.engines[engine].head;
        {
            let e = &mut self.entries[idx as usize];
            e.prev = NIL;
            e.next = old;
        }
        if old == NIL {
            self.engines[engine].tail = idx;
        } else {
            self.entries[old as usize].prev = idx;
        }
        self.engines[engine].head = idx;
    }

    fn unlink(&mut self, idx: u32) {
        let Entry {
            engine, prev, next, ..
        } = self.entries[idx as usize];
        let s = &mut self.engines[engine as usize];
        if prev == NIL {
            s.head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        let s = &mut self.engines[engine as usize];
        if next == NIL {
            s.tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
    }

    /// Moves an entry to the front (most recently used) of its engine's LRU list.
    #[inline]
    fn touch(&mut self, idx: u32) {
        let engine = self.entries[idx as usize].engine as usize;
        if self.engines[engine].head != idx {
            self.unlink(idx);
            self.link_front(idx);
        }
    }

    /// An engine's counts; `None` for an unknown engine.
    pub fn engine_counts(&self, engine: Slot) -> Option<EngineCounts> {
        self.slot(engine).map(|s| EngineCounts {
            entries: s.len,
            confirmed: s.confirmed,
            speculative: s.speculative,
            capacity: s.capacity,
        })
    }

    /// Entries stored.
    pub fn len(&self) -> usize {
        self.n_entries as usize
    }

    /// True when no entry is stored.
    pub fn is_empty(&self) -> bool {
        self.n_entries == 0
    }

    /// Whole-index counters.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            engines: self.n_engines,
            entries: self.n_entries,
            confirmed: self.n_confirmed,
            speculative: self.n_speculative,
            evicted: self.evicted,
            expired: self.expired,
            ignored: self.ignored,
            duplicates: self.duplicates,
            memory_bytes: self.memory_bytes() as u64,
        }
    }

    /// Heap bytes held (allocated capacity of every structure; allocator overhead excluded).
    pub fn memory_bytes(&self) -> usize {
        let posting_vecs = self.posting_bytes;
        self.entries.capacity() * size_of::<Entry>()
            + self.members.0.heap_bytes()
            + self.anchors.capacity() * (size_of::<(u64, Posting)>() + 1)
            + posting_vecs
            + self.engines.capacity() * size_of::<EngineSlot>()
            + self.heap.capacity() * size_of::<Reverse<(u64, u32)>>()
    }
}

mod check;
mod lookup;
mod marks;
