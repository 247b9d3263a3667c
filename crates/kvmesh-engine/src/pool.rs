//! The paged KV-cache block pool, after vLLM's `BlockPool` (`vllm/v1/core/block_pool.py`) and
//! `FreeKVCacheBlockQueue` (`vllm/v1/core/kv_cache_utils.py`).
//!
//! * Every block has a reference count. Blocks with count 0 sit in the **free queue**, a doubly
//!   linked list threaded through the block array (O(1) pop, remove and insert at both ends).
//! * Allocation pops from the head; a popped block that still holds a hash is **evicted**
//!   (its hash leaves the map, `BlockRemoved`).
//! * Freeing walks a request's blocks in reverse (tail first). Blocks that hold a hash go to the
//!   tail (LRU order: the tail of the freed request is evicted first); blocks without a hash
//!   (partial or duplicate-free) go to the head, since they can never be hit (vLLM PR #42656,
//!   May 2026).
//! * The hash map points a block hash to the cached block(s) holding it; like vLLM it may hold
//!   several copies of one hash ([`DuplicateBlocks::Keep`]), the first inserted being the one
//!   hits use.

use crate::params::DuplicateBlocks;
use crate::types::{CachedBlock, EngineEvent};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

const NIL: u32 = u32::MAX;

/// A request's extra keys, as the cache records them with its blocks.
#[derive(Clone, Copy)]
pub(crate) struct Extras<'a> {
    /// LoRA name: kept on every block.
    pub lora: &'a Option<Arc<str>>,
    /// Cache salt: reported on the chain's root block.
    pub salt: Option<&'a str>,
}

/// Identity hasher: the keys are already uniformly distributed 64-bit hashes.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ *b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// A `HashMap` keyed by already-random `u64`s. Never iterated where order matters.
pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    prev: u32,
    next: u32,
    in_free: bool,
    hash: Option<u64>,
    parent: Option<u64>,
    lora: Option<Arc<str>>,
}

/// The block pool.
#[derive(Debug, Clone)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    /// Token ids of cached blocks, `block_size` per block (for `cached_blocks()`).
    contents: Vec<u32>,
    block_size: usize,
    head: u32,
    tail: u32,
    num_free: u32,
    num_cached: u32,
    /// hash -> the block hits use.
    map: IdMap<u32>,
    /// hash -> further copies, in insertion order (Keep mode only).
    dups: IdMap<Vec<u32>>,
    caching: bool,
    mode: DuplicateBlocks,
    events: Vec<EngineEvent>,
    scratch_head: Vec<u32>,
    scratch_tail: Vec<u32>,
}

impl BlockPool {
    /// `num_blocks` free blocks, queued in id order.
    pub(crate) fn new(
        num_blocks: u32,
        block_size: usize,
        caching: bool,
        mode: DuplicateBlocks,
    ) -> BlockPool {
        assert!((1..NIL).contains(&num_blocks) && block_size >= 1);
        let n = num_blocks as usize;
        let blocks = (0..num_blocks)
            .map(|i| Block {
                ref_cnt: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == num_blocks { NIL } else { i + 1 },
                in_free: true,
                hash: None,
                parent: None,
                lora: None,
            })
            .collect();
        BlockPool {
            blocks,
            contents: if caching {
                vec![0; n * block_size]
            } else {
                Vec::new()
            },
            block_size,
            head: 0,
            tail: num_blocks - 1,
            num_free: num_blocks,
            num_cached: 0,
            map: IdMap::default(),
            dups: IdMap::default(),
            caching,
            mode,
            events: Vec::new(),
            scratch_head: Vec::new(),
            scratch_tail: Vec::new(),
        }
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.blocks.len() as u32
    }

    pub(crate) fn num_free(&self) -> u32 {
        self.num_free
    }

    pub(crate) fn num_cached(&self) -> u32 {
        self.num_cached
    }

    pub(crate) fn ref_cnt(&self, b: u32) -> u32 {
        self.blocks[b as usize].ref_cnt
    }

    pub(crate) fn block_hash(&self, b: u32) -> Option<u64> {
        self.blocks[b as usize].hash
    }

    /// The cached block hits use for this hash.
    pub(crate) fn lookup(&self, hash: u64) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    /// Events produced since the last call.
    pub(crate) fn take_events(&mut self) -> Vec<EngineEvent> {
        std::mem::take(&mut self.events)
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next) = {
            let blk = &self.blocks[b as usize];
            debug_assert!(blk.in_free);
            (blk.prev, blk.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let blk = &mut self.blocks[b as usize];
        blk.prev = NIL;
        blk.next = NIL;
        blk.in_free = false;
        self.num_free -= 1;
    }

    fn push_back(&mut self, b: u32) {
        let old = self.tail;
        {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(!blk.in_free && blk.ref_cnt == 0);
            blk.prev = old;
            blk.next = NIL;
            blk.in_free = true;
        }
        if old == NIL {
            self.head = b;
        } else {
            self.blocks[old as usize].next = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn push_front(&mut self, b: u32) {
        let old = self.head;
        {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(!blk.in_free && blk.ref_cnt == 0);
            blk.prev = NIL;
            blk.next = old;
            blk.in_free = true;
        }
        if old == NIL {
            self.tail = b;
        } else {
            self.blocks[old as usize].prev = b;
        }
        self.head = b;
        self.num_free += 1;
    }

    /// Takes a reference on cached blocks hit by a request (pulling free ones out of the queue).
    pub(crate) fn touch(&mut self, hits: &[u32]) {
        for &b in hits {
            if self.blocks[b as usize].ref_cnt == 0 {
                self.unlink(b);
            }
            self.blocks[b as usize].ref_cnt += 1;
        }
    }

    /// Pops `n` blocks from the head of the free queue (evicting their hashes) into `out`.
    /// The caller checked `n <= num_free()`.
    pub(crate) fn allocate(&mut self, n: usize, out: &mut Vec<u32>) {
        assert!(n <= self.num_free as usize, "allocate beyond free blocks");
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            if let Some(h) = self.blocks[b as usize].hash {
                self.evict(b, h);
            }
            self.blocks[b as usize].ref_cnt = 1;
            out.push(b);
        }
    }

    fn evict(&mut self, b: u32, h: u64) {
        self.remove_hash(h, b);
        let blk = &mut self.blocks[b as usize];
        blk.hash = None;
        blk.parent = None;
        blk.lora = None;
        self.num_cached -= 1;
        self.events.push(EngineEvent::BlockRemoved {
            block_hashes: vec![h],
        });
    }

    fn insert_hash(&mut self, h: u64, b: u32) {
        match self.map.entry(h) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(b);
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                self.dups.entry(h).or_default().push(b);
            }
        }
    }

    fn remove_hash(&mut self, h: u64, b: u32) {
        if self.map.get(&h) == Some(&b) {
            match self.dups.get_mut(&h) {
                Some(v) => {
                    let next = v.remove(0);
                    if v.is_empty() {
                        self.dups.remove(&h);
                    }
                    self.map.insert(h, next);
                }
                None => {
                    self.map.remove(&h);
                }
            }
        } else {
            let v = self.dups.get_mut(&h).expect("evicted hash is mapped");
            let pos = v.iter().position(|&x| x == b).expect("copy is mapped");
            v.remove(pos);
            if v.is_empty() {
                self.dups.remove(&h);
            }
        }
    }

    /// Drops one reference on each block of a request, walking `blocks` backwards (vLLM frees in
    /// reverse so that a request's tail is evicted first).
    pub(crate) fn free(&mut self, blocks: &[u32]) {
        let mut head = std::mem::take(&mut self.scratch_head);
        let mut tail = std::mem::take(&mut self.scratch_tail);
        for &b in blocks.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.ref_cnt > 0);
            blk.ref_cnt -= 1;
            if blk.ref_cnt == 0 {
                if blk.hash.is_some() {
                    tail.push(b);
                } else {
                    head.push(b);
                }
            }
        }
        // prepend_n keeps the list order: head[0] becomes the new head.
        for &b in head.iter().rev() {
            self.push_front(b);
        }
        for &b in &tail {
            self.push_back(b);
        }
        head.clear();
        tail.clear();
        self.scratch_head = head;
        self.scratch_tail = tail;
    }

    /// Caches the request's blocks `from..to` (now full): sets their hashes, maps them and emits
    /// one `BlockStored` per run of newly stored blocks. `hashes` and `tokens` are the request's
    /// block hashes and token ids. In [`DuplicateBlocks::Share`] mode a block whose hash is
    /// already cached is replaced in `req_blocks` by the cached one.
    pub(crate) fn cache_full_blocks(
        &mut self,
        req_blocks: &mut [u32],
        hashes: &[u64],
        tokens: &[u32],
        from: usize,
        to: usize,
        extras: Extras<'_>,
    ) {
        debug_assert!(self.caching && from < to && to <= hashes.len());
        let lora = extras.lora;
        let bs = self.block_size;
        let mut run_start: Option<usize> = None;
        for i in from..to {
            let h = hashes[i];
            let b = req_blocks[i];
            debug_assert!(self.blocks[b as usize].hash.is_none());
            if self.mode == DuplicateBlocks::Share
                && let Some(x) = self.lookup(h)
            {
                if let Some(s) = run_start.take() {
                    self.emit_stored(hashes, tokens, s, i, extras);
                }
                // Reference the cached copy; give back the fresh one (unhashed: queue head).
                self.touch(&[x]);
                req_blocks[i] = x;
                let blk = &mut self.blocks[b as usize];
                blk.ref_cnt -= 1;
                debug_assert_eq!(blk.ref_cnt, 0);
                self.push_front(b);
                continue;
            }
            let blk = &mut self.blocks[b as usize];
            blk.hash = Some(h);
            blk.parent = if i == 0 { None } else { Some(hashes[i - 1]) };
            blk.lora = lora.clone();
            self.contents[b as usize * bs..(b as usize + 1) * bs]
                .copy_from_slice(&tokens[i * bs..(i + 1) * bs]);
            self.insert_hash(h, b);
            self.num_cached += 1;
            run_start.get_or_insert(i);
        }
        if let Some(s) = run_start {
            self.emit_stored(hashes, tokens, s, to, extras);
        }
    }

    fn emit_stored(
        &mut self,
        hashes: &[u64],
        tokens: &[u32],
        from: usize,
        to: usize,
        extras: Extras<'_>,
    ) {
        let bs = self.block_size;
        self.events.push(EngineEvent::BlockStored {
            block_hashes: hashes[from..to].to_vec(),
            parent_block_hash: if from == 0 {
                None
            } else {
                Some(hashes[from - 1])
            },
            token_ids: tokens[from * bs..to * bs].to_vec(),
            block_size: bs as u32,
            lora_name: extras.lora.as_deref().map(str::to_string),
            cache_salt: if from == 0 {
                extras.salt.map(str::to_string)
            } else {
                None
            },
        });
    }

    /// vLLM's `reset_prefix_cache`: only when no block is in use; drops every hash and emits
    /// `AllBlocksCleared`. The free queue keeps its order.
    pub(crate) fn reset(&mut self) -> bool {
        if self.num_free != self.capacity() {
            return false;
        }
        for blk in &mut self.blocks {
            blk.hash = None;
            blk.parent = None;
            blk.lora = None;
        }
        self.map.clear();
        self.dups.clear();
        self.num_cached = 0;
        if self.caching {
            self.events.push(EngineEvent::AllBlocksCleared);
        }
        true
    }

    /// Every cached block (duplicates included), in block-id order.
    pub(crate) fn cached_blocks(&self) -> Vec<CachedBlock> {
        let bs = self.block_size;
        self.blocks
            .iter()
            .enumerate()
            .filter_map(|(i, blk)| {
                blk.hash.map(|hash| CachedBlock {
                    hash,
                    parent: blk.parent,
                    token_ids: self.contents[i * bs..(i + 1) * bs].to_vec(),
                    lora_name: blk.lora.as_deref().map(str::to_string),
                })
            })
            .collect()
    }

    /// Checks the pool's structure; `expected_refs[b]` is how many live requests hold block `b`.
    pub(crate) fn check(&self, expected_refs: &[u32]) -> Result<(), String> {
        let n = self.blocks.len();
        // Walk the free queue.
        let mut count = 0usize;
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            let blk = &self.blocks[cur as usize];
            if !blk.in_free || blk.ref_cnt != 0 || blk.prev != prev {
                return Err(format!("free queue corrupt at block {cur}"));
            }
            count += 1;
            if count > n {
                return Err("free queue has a cycle".into());
            }
            prev = cur;
            cur = blk.next;
        }
        if prev != self.tail {
            return Err("free queue tail mismatch".into());
        }
        if count != self.num_free as usize {
            return Err(format!(
                "free count {} but queue holds {count}",
                self.num_free
            ));
        }
        let mut hashed = 0u32;
        for (i, blk) in self.blocks.iter().enumerate() {
            if blk.ref_cnt != expected_refs[i] {
                return Err(format!(
                    "block {i}: refcount {} but {} holders",
                    blk.ref_cnt, expected_refs[i]
                ));
            }
            if blk.in_free != (blk.ref_cnt == 0) {
                return Err(format!(
                    "block {i}: in_free={} ref={}",
                    blk.in_free, blk.ref_cnt
                ));
            }
            if let Some(h) = blk.hash {
                hashed += 1;
                let mapped = self.map.get(&h) == Some(&(i as u32))
                    || self.dups.get(&h).is_some_and(|v| v.contains(&(i as u32)));
                if !mapped {
                    return Err(format!("block {i} has hash {h:#x} but is not mapped"));
                }
            }
        }
        if hashed != self.num_cached {
            return Err(format!(
                "{hashed} hashed blocks, counter says {}",
                self.num_cached
            ));
        }
        let mut entries = self.map.len();
        for (h, &b) in &self.map {
            if self.blocks[b as usize].hash != Some(*h) {
                return Err(format!("map entry {h:#x} -> block {b} with another hash"));
            }
        }
        for (h, v) in &self.dups {
            if !self.map.contains_key(h) || v.is_empty() {
                return Err(format!("duplicate list for {h:#x} without a primary"));
            }
            for &b in v {
                if self.blocks[b as usize].hash != Some(*h) {
                    return Err(format!("dup entry {h:#x} -> block {b} with another hash"));
                }
            }
            entries += v.len();
        }
        if entries != hashed as usize {
            return Err(format!("{entries} map entries for {hashed} hashed blocks"));
        }
        if self.mode == DuplicateBlocks::Share && !self.dups.is_empty() {
            return Err("duplicate blocks in Share mode".into());
        }
        if !self.caching && hashed != 0 {
            return Err("hashed blocks with prefix caching disabled".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(p: &BlockPool) -> Vec<u32> {
        let mut v = Vec::new();
        let mut c = p.head;
        while c != NIL {
            v.push(c);
            c = p.blocks[c as usize].next;
        }
        v
    }

    #[test]
    fn free_puts_hashed_blocks_at_tail_in_reverse_and_others_at_head() {
        let mut p = BlockPool::new(6, 2, true, DuplicateBlocks::Keep);
        let mut req = Vec::new();
        p.allocate(3, &mut req);
        assert_eq!(req, vec![0, 1, 2]);
        let toks = [1, 2, 3, 4, 5];
        let hashes = [11, 22];
        p.cache_full_blocks(
            &mut req,
            &hashes,
            &toks,
            0,
            2,
            Extras {
                lora: &None,
                salt: None,
            },
        );
        p.free(&req);
        // Unhashed block 2 at the head; hashed 1 then 0 at the tail.
        assert_eq!(order(&p), vec![2, 3, 4, 5, 1, 0]);
        let refs = vec![0; 6];
        p.check(&refs).unwrap();
        let ev = p.take_events();
        assert_eq!(ev.len(), 1);
    }
}
