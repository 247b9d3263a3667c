//! Heap measured by a counting global allocator: bytes per index entry (goal ≤ 64), and the
//! hot path (block keys into a reused buffer, lookups into a reused buffer) allocates nothing.
//! Run with `--nocapture` to see the figures.

use kvmesh_kvevents::{BlockHash, EventBatch, KvEvent};
use kvmesh_prefix::{
    BlockKey, EngineIngest, ExtraKeys, IngestConfig, Match, PrefixIndex, block_keys,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|l| l.set(l.get() + layout.size() as i64));
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|l| l.set(l.get() - layout.size() as i64));
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LIVE.try_with(|l| l.set(l.get() + new_size as i64 - layout.size() as i64));
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> i64 {
    LIVE.with(|l| l.get())
}

fn allocs() -> u64 {
    ALLOCS.with(|a| a.get())
}

/// Synthetic keys (no hashing cost): chain `c`, block `i`.
fn key(c: u64, i: usize) -> BlockKey {
    let mut x =
        c.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    BlockKey::from_digest(x ^ (x >> 29), i)
}

const ENGINES: u32 = 64;
const CHAIN: usize = 64;

/// Fills `engines × chains × CHAIN` confirmed entries; every chain is on one engine (all keys
/// distinct: the most postings per entry).
fn fill(idx: &mut PrefixIndex, chains: u64) {
    for e in 0..ENGINES {
        idx.add_engine(e, (chains as usize * CHAIN) as u32).unwrap();
        for c in 0..chains {
            for i in (0..CHAIN).rev() {
                idx.store(e, key(u64::from(e) << 32 | c, i));
            }
        }
    }
}

#[test]
fn bytes_per_entry() {
    // 64 engines × 50 chains × 64 blocks = 204,800 entries (not a power of two: the grown
    // figure includes the slack of doubling).
    let chains = 50u64;
    let n = ENGINES as usize * chains as usize * CHAIN;

    let before = live();
    let mut idx = PrefixIndex::with_capacity(n);
    fill(&mut idx, chains);
    let presized = (live() - before) as f64 / n as f64;
    assert_eq!(idx.len(), n);
    let reported = idx.memory_bytes() as f64 / n as f64;
    drop(idx);

    let before = live();
    let mut idx = PrefixIndex::new();
    fill(&mut idx, chains);
    let grown = (live() - before) as f64 / n as f64;
    drop(idx);

    // Speculative entries also carry an expiry-heap record.
    let before = live();
    let mut idx = PrefixIndex::with_capacity(n);
    for e in 0..ENGINES {
        idx.add_engine(e, (chains as usize * CHAIN) as u32).unwrap();
        let keys: Vec<BlockKey> = (0..CHAIN).map(|i| key(u64::from(e), i)).collect();
        for c in 0..chains {
            let keys: Vec<BlockKey> = keys.iter().map(|k| BlockKey(k.0 ^ (c << 40))).collect();
            idx.insert_speculative(e, &keys, 1_000_000, 0);
        }
    }
    let spec = (live() - before) as f64 / idx.len() as f64;
    eprintln!(
        "bytes per entry: {presized:.1} pre-sized (index reports {reported:.1}), \
         {grown:.1} grown by doubling, {spec:.1} speculative (pre-sized)"
    );
    assert!(presized <= 64.0, "{presized}");
    assert!(grown <= 128.0, "{grown}");
}

#[test]
fn hot_path_does_not_allocate() {
    let mut idx = PrefixIndex::new();
    fill(&mut idx, 8);
    // A shared prompt on a few engines.
    let toks: Vec<u32> = (0..8000).map(|i| (i * 31 + 7) % 150_000).collect();
    let mut keys = Vec::with_capacity(1000);
    block_keys(&toks, 16, ExtraKeys::NONE, &mut keys);
    for e in [3, 17, 40] {
        idx.insert_speculative(e, &keys[..300], 1_000_000, 0);
    }
    let mut out: Vec<Match> = Vec::with_capacity(ENGINES as usize);
    let a = allocs();
    for _ in 0..100 {
        block_keys(&toks, 16, ExtraKeys::lora("x"), &mut keys);
        block_keys(&toks, 16, ExtraKeys::NONE, &mut keys);
        idx.lookup(&keys, 10, &mut out);
        idx.lookup_min(&keys, 20, 10, &mut out);
    }
    assert_eq!(allocs() - a, 0, "allocations on the hot path");
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|m| m.blocks == 300));
}

#[test]
fn ingestion_bytes_per_tracked_block() {
    let n = 20_000u64;
    let batch = EventBatch {
        ts: 1.0,
        events: (0..n)
            .map(|i| KvEvent::stored(vec![BlockHash::Int(i + 1)], None, vec![i as u32; 16], 16))
            .collect(),
        data_parallel_rank: None,
    };
    let mut ops = Vec::with_capacity(n as usize);
    let before = live();
    let mut ing = EngineIngest::new(IngestConfig {
        block_size: 16,
        capacity: 1 << 20,
    });
    ing.on_batch(0, &batch, 0, &mut ops);
    let per = (live() - before) as f64 / n as f64;
    eprintln!(
        "ingestion: {per:.1} bytes per tracked engine hash (reported {:.1})",
        ing.memory_bytes() as f64 / n as f64
    );
    assert_eq!(ing.tracked_hashes(), n as usize);
    assert!(per < 160.0, "{per}");
}
