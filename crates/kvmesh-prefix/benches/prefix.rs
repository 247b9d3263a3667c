//! `cargo bench -p kvmesh-prefix --bench prefix`
//!
//! * block keys of an 8,000-token prompt (32 KB of text) at 16 tokens per block, and the
//!   incremental extension by one 400-token turn;
//! * lookups on 1M indexed blocks at 64 and at 4,096 engines, on a shared-prefix workload
//!   (groups of conversations sharing a system prompt, each group cached on 3 engines), with
//!   and without a chat-template first block common to every prompt (then every engine holds
//!   the root key: `lookup` visits them all, `lookup_min(9)` does not);
//! * store + remove and speculative-insert throughput on the 1M-block index, and the
//!   ingestion of a `BlockStored` batch (rehash included);
//! * bytes per entry of the built indexes (printed), and p50/p99 of single lookups timed one
//!   by one (printed), besides criterion's estimates;
//! * the whole routing decision minus tokenization, as the gateway makes it: lookup, engine
//!   slots translated to the route's indices, the `precise` policy's pick over the fleet's
//!   load views (`decision/...`).

use criterion::{Criterion, criterion_group, criterion_main};
use kvmesh_kvevents::{BlockHash, EventBatch, KvEvent};
use kvmesh_policy::{
    EngineMember, EngineView, Policy, PolicyConfig, PolicyKind, PrefixInput, PrefixMatch,
    RequestCtx,
};
use kvmesh_prefix::{
    BlockKey, EngineIngest, ExtraKeys, IndexOp, IngestConfig, Match, PrefixIndex, block_keys,
    extend_block_keys,
};
use std::hint::black_box;
use std::time::{Duration, Instant};

const BS: usize = 16;

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 151_000) as u32
        })
        .collect()
}

struct Fleet {
    idx: PrefixIndex,
    /// A new conversation of group 0 (its system prompt is cached on 3 engines).
    hit: Vec<BlockKey>,
    /// A prompt nobody holds.
    miss: Vec<BlockKey>,
}

/// `engines` engines holding `total` blocks: conversations of `sys` system blocks (shared by
/// the group, groups cached on 3 engines each) plus `user` blocks of their own.
fn fleet(engines: u32, total: usize, sys: usize, user: usize, template: bool) -> Fleet {
    let per_engine = total / engines as usize;
    let mut idx = PrefixIndex::with_capacity(total + engines as usize * (sys + user));
    // Engines come in trios; trio t serves groups 2t and 2t + 1: each group on 3 engines.
    let groups = 2 * (engines as usize).div_ceil(3);
    let head: Vec<u32> = if template {
        (0..BS as u32).collect()
    } else {
        Vec::new()
    };
    let prompt = |g: usize, conv: u64| {
        let mut t = head.clone();
        t.extend(tokens(1 + g as u64, sys * BS - t.len()));
        t.extend(tokens(1_000_000 + conv, user * BS));
        t
    };
    let mut keys = Vec::new();
    let mut conv = 0u64;
    for e in 0..engines {
        idx.add_engine(e, (per_engine + sys + user) as u32).unwrap();
        let t = e as usize / 3;
        let mine = [(2 * t) % groups, (2 * t + 1) % groups];
        let mut k = 0;
        while (idx.engine_counts(e).unwrap().entries as usize) < per_engine {
            conv += 1;
            block_keys(&prompt(mine[k % 2], conv), BS, ExtraKeys::NONE, &mut keys);
            for key in keys.iter().rev() {
                idx.store(e, *key);
            }
            k += 1;
        }
    }
    let mut hit = Vec::new();
    block_keys(&prompt(0, u64::MAX), BS, ExtraKeys::NONE, &mut hit);
    let mut miss = Vec::new();
    let mut t = head.clone();
    t.extend(tokens(u64::MAX - 1, (sys + user) * BS - head.len()));
    block_keys(&t, BS, ExtraKeys::NONE, &mut miss);
    Fleet { idx, hit, miss }
}

fn percentiles(f: &mut dyn FnMut()) -> (f64, f64) {
    let mut v: Vec<u64> = (0..2000)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as u64
        })
        .collect();
    v.sort_unstable();
    (
        v[v.len() / 2] as f64 / 1e3,
        v[v.len() * 99 / 100] as f64 / 1e3,
    )
}

fn report(name: &str, fleet: &Fleet, keys: &[BlockKey], min: usize) {
    let mut out: Vec<Match> = Vec::with_capacity(4096);
    let (p50, p99) = percentiles(&mut || fleet.idx.lookup_min(keys, min, 0, &mut out));
    let best = out.iter().map(|m| m.blocks).max().unwrap_or(0);
    eprintln!(
        "{name}: p50 {p50:.1} µs, p99 {p99:.1} µs; {} engines matched, best {best} of {} blocks",
        out.len(),
        keys.len()
    );
}

fn bench_keys(c: &mut Criterion) {
    let toks = tokens(7, 8_000);
    let mut keys = Vec::with_capacity(600);
    let mut g = c.benchmark_group("keys");
    // Calibration: the floor of one 16-token block, one blake3 compression.
    let buf = [7u8; 64];
    g.bench_function("blake3_keyed_hash_64B", |b| {
        b.iter(|| blake3::keyed_hash(black_box(&[1u8; 32]), black_box(&buf)))
    });
    g.bench_function("block_keys/8000_tokens_bs16", |b| {
        b.iter(|| block_keys(black_box(&toks), BS, ExtraKeys::NONE, &mut keys))
    });
    let mut next = toks.clone();
    next.extend(tokens(8, 400));
    let mut base = Vec::new();
    block_keys(&toks, BS, ExtraKeys::NONE, &mut base);
    g.bench_function("extend_block_keys/+400_tokens", |b| {
        b.iter(|| {
            keys.clear();
            keys.extend_from_slice(&base);
            extend_block_keys(black_box(&next), BS, ExtraKeys::NONE, &mut keys)
        })
    });
    g.finish();
}

fn bench_lookup(c: &mut Criterion) {
    // (engines, system blocks, user blocks): 8,000-token conversations at 64 engines,
    // 2,000-token ones at 4,096 engines (244 blocks per engine).
    for (engines, sys, user) in [(64u32, 375usize, 125usize), (4096, 100, 25)] {
        for template in [false, true] {
            let t0 = Instant::now();
            let f = fleet(engines, 1 << 20, sys, user, template);
            let s = f.idx.stats();
            let name = format!(
                "lookup/{engines}x1M{}",
                if template { "/template_root" } else { "" }
            );
            eprintln!(
                "{name}: built in {:.1} s: {} entries, {:.1} bytes/entry",
                t0.elapsed().as_secs_f64(),
                s.entries,
                s.memory_bytes as f64 / s.entries as f64
            );
            report(&format!("{name}/hit"), &f, &f.hit, 1);
            report(&format!("{name}/miss"), &f, &f.miss, 1);
            if template {
                report(&format!("{name}/hit_min9"), &f, &f.hit, 9);
            }
            let mut out: Vec<Match> = Vec::with_capacity(4096);
            let mut g = c.benchmark_group(&name);
            g.bench_function("hit", |b| {
                b.iter(|| f.idx.lookup(black_box(&f.hit), 0, &mut out))
            });
            g.bench_function("miss", |b| {
                b.iter(|| f.idx.lookup(black_box(&f.miss), 0, &mut out))
            });
            if template {
                g.bench_function("hit_min9", |b| {
                    b.iter(|| f.idx.lookup_min(black_box(&f.hit), 9, 0, &mut out))
                });
            }
            g.finish();
            if !template {
                bench_decision(c, &f, engines);
            }
            if engines == 64 && !template {
                bench_ops(c, f);
            }
        }
    }
}

/// Lookup + slot → route index + `precise` pick, with loads spread over the fleet.
fn bench_decision(c: &mut Criterion, f: &Fleet, engines: u32) {
    let members: Vec<EngineMember> = (0..engines).map(|e| EngineMember::new(e as u64)).collect();
    let views: Vec<EngineView> = (0..engines)
        .map(|e| {
            let mut v = EngineView::new(1.0);
            v.in_flight = (e * 7) % 13;
            v
        })
        .collect();
    let cfg = PolicyConfig {
        policy: PolicyKind::Precise,
        ..PolicyConfig::default()
    };
    let policy = Policy::new(&cfg, &members, 1);
    // The gateway maps index slots to route indices through a table; here they are equal.
    let slot_to_idx: Vec<u32> = (0..engines).collect();
    let mut found: Vec<Match> = Vec::with_capacity(4096);
    let mut matches: Vec<PrefixMatch> = Vec::with_capacity(4096);
    let mut out = Vec::with_capacity(8);
    let mut seed = 0u64;
    let mut decide = |keys: &[BlockKey]| {
        seed += 1;
        f.idx.lookup(keys, 0, &mut found);
        matches.clear();
        for m in &found {
            if let Some(&i) = slot_to_idx.get(m.engine as usize) {
                matches.push(PrefixMatch {
                    engine: i,
                    blocks: m.blocks,
                });
            }
        }
        let ctx = RequestCtx::new(seed, 0).with_prefix(PrefixInput {
            total_blocks: keys.len() as u32,
            matches: &matches,
            cold_key: 0,
        });
        policy.pick(&views, &ctx, &mut out)
    };
    let name = format!("decision/{engines}x1M/precise");
    let (p50, p99) = percentiles(&mut || {
        black_box(decide(&f.hit));
    });
    eprintln!("{name}/hit: p50 {p50:.1} µs, p99 {p99:.1} µs (lookup + pick)");
    let mut g = c.benchmark_group(&name);
    g.bench_function("hit", |b| b.iter(|| black_box(decide(black_box(&f.hit)))));
    g.bench_function("miss", |b| b.iter(|| black_box(decide(black_box(&f.miss)))));
    g.finish();
}

fn bench_ops(c: &mut Criterion, f: Fleet) {
    let mut idx = f.idx;
    let mut g = c.benchmark_group("ops/64x1M");
    let chain = f.miss;
    // 500 stores then 500 removes of a new chain on one engine: 1,000 ops per iteration.
    g.bench_function("store_remove_500_blocks", |b| {
        b.iter(|| {
            for k in chain.iter().rev() {
                idx.store(5, *k);
            }
            for k in &chain {
                idx.remove(5, *k);
            }
        })
    });
    // Routing-time speculative marks for a 500-block prompt (refreshing, then expiring).
    let mut now = 1u64;
    g.bench_function("speculative_500_blocks", |b| {
        b.iter(|| {
            now += 1;
            idx.insert_speculative(7, &chain, now + 2_000_000, now);
        })
    });
    idx.expire(u64::MAX);
    g.finish();

    // Ingestion: a 32-block BlockStored (rehash + map + ops) and its 32 removals.
    let toks = tokens(99, 32 * BS);
    let stored = EventBatch {
        ts: 1.0,
        events: vec![KvEvent::stored(
            (1..=32).map(BlockHash::Int).collect(),
            None,
            toks,
            BS as u32,
        )],
        data_parallel_rank: None,
    };
    let removed = EventBatch {
        ts: 2.0,
        events: vec![KvEvent::removed((1..=32).map(BlockHash::Int).collect())],
        data_parallel_rank: None,
    };
    let mut ing = EngineIngest::new(IngestConfig {
        block_size: BS as u32,
        capacity: 1 << 16,
    });
    let mut ops: Vec<IndexOp> = Vec::with_capacity(64);
    let mut seq = 0u64;
    let mut g = c.benchmark_group("ingest");
    g.bench_function("stored_then_removed_32_blocks", |b| {
        b.iter(|| {
            for batch in [&stored, &removed] {
                ops.clear();
                ing.on_batch(seq, batch, 0, &mut ops);
                idx.apply_all(9, &ops);
                seq += 1;
            }
        })
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_keys, bench_lookup
}
criterion_main!(benches);
