//! `cargo bench -p kvmesh-prefix --bench concurrency`
//!
//! Decision latency under concurrency, the way the router takes its prefix-index lock, before
//! and after the router-core reshape: 2 request threads decide (lookup + `precise` pick +
//! probes of the 3 candidates + speculative mark of the first) over 64 engines and ~1M indexed
//! blocks, while a third thread applies KV-event batches (64 ops each, back to back) under the
//! write lock.
//!
//! * `write-lock` (before): lookup, pick and mark under one hold of the write lock, as every
//!   cache-aware request did;
//! * `read-then-mark` (after): lookup, pick and probes under the shared lock, then the mark
//!   under a brief write lock; the 5% of prompts no engine holds are decided under the write
//!   lock (as the gateway does, so that siblings see each other's mark).
//!
//! Prints p50 / p99 / p99.9 of each request's decision (its own `Instant` pair) and the
//! applier's batches per second, per mode, interleaved over 3 rounds. Bounded: a fixed number
//! of requests per thread.

use kvmesh_policy::{
    EngineMember, EngineView, Policy, PolicyConfig, PolicyKind, PrefixInput, PrefixMatch,
    RequestCtx,
};
use kvmesh_prefix::{BlockKey, ExtraKeys, IndexOp, Match, PrefixIndex, block_keys};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

const BS: usize = 16;
const ENGINES: u32 = 64;
const PROMPT_BLOCKS: usize = 64;
const CONVERSATIONS: usize = 16_000;
const REQUESTS_PER_THREAD: usize = 40_000;

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

fn keys_of(seed: u64) -> Vec<BlockKey> {
    let mut k = Vec::new();
    block_keys(
        &tokens(seed, PROMPT_BLOCKS * BS),
        BS,
        ExtraKeys::default(),
        &mut k,
    );
    k
}

/// ~1M blocks: 16,000 conversations of 64 blocks, each confirmed on one engine.
fn build() -> (PrefixIndex, Vec<Vec<BlockKey>>) {
    let mut idx = PrefixIndex::with_capacity(CONVERSATIONS * PROMPT_BLOCKS + 65_536);
    for e in 0..ENGINES {
        idx.add_engine(e, 20_000).expect("engine");
    }
    let prompts: Vec<Vec<BlockKey>> = (0..CONVERSATIONS as u64).map(keys_of).collect();
    for (i, p) in prompts.iter().enumerate() {
        let e = (i as u32 * 7) % ENGINES;
        let ops: Vec<IndexOp> = p.iter().map(|k| IndexOp::Stored(*k)).collect();
        idx.apply_all(e, &ops);
    }
    (idx, prompts)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    WriteLock,
    ReadThenMark,
    ReadThenDeferredMark,
}

/// Marks that found the write lock taken, applied by the next writer.
type Pending = Arc<std::sync::Mutex<Vec<(u32, Vec<BlockKey>, u64, u64)>>>;

fn drain(idx: &mut PrefixIndex, pending: &Pending) {
    let mut p = pending.lock().expect("pending");
    for (e, keys, exp, now) in p.drain(..) {
        idx.insert_speculative(e, &keys, exp, now);
    }
}

struct Decider {
    policy: Policy,
    views: Vec<EngineView>,
    found: Vec<Match>,
    matches: Vec<PrefixMatch>,
    out: Vec<usize>,
}

impl Decider {
    fn new() -> Decider {
        let members: Vec<EngineMember> =
            (0..ENGINES).map(|e| EngineMember::new(e as u64)).collect();
        let cfg = PolicyConfig {
            policy: PolicyKind::Precise,
            ..PolicyConfig::default()
        };
        Decider {
            policy: Policy::new(&cfg, &members, 1),
            views: (0..ENGINES)
                .map(|e| {
                    let mut v = EngineView::new(1.0);
                    v.in_flight = (e * 7) % 13;
                    v
                })
                .collect(),
            found: Vec::with_capacity(4096),
            matches: Vec::with_capacity(4096),
            out: Vec::with_capacity(8),
        }
    }

    /// Lookup + pick + probes; returns the first candidate and whether some engine matched.
    fn decide(
        &mut self,
        idx: &PrefixIndex,
        keys: &[BlockKey],
        seed: u64,
        now: u64,
    ) -> (usize, bool) {
        let min = (keys.len() as u32 * 3).div_ceil(10).max(1) as usize;
        idx.lookup_min(keys, min, now, &mut self.found);
        self.matches.clear();
        self.matches.extend(self.found.iter().map(|m| PrefixMatch {
            engine: m.engine,
            blocks: m.blocks,
        }));
        let ctx = RequestCtx::new(seed, now).with_prefix(PrefixInput {
            total_blocks: keys.len() as u32,
            matches: &self.matches,
            cold_key: 0,
        });
        self.policy.pick(&self.views, &ctx, &mut self.out);
        let mut held = 0;
        for &c in &self.out {
            held += keys
                .iter()
                .take_while(|k| idx.holds(c as u32, **k, now))
                .count();
        }
        std::hint::black_box(held);
        (self.out[0], !self.matches.is_empty())
    }
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i] as f64 / 1000.0
}

fn run(
    mode: Mode,
    idx: &Arc<RwLock<PrefixIndex>>,
    prompts: &Arc<Vec<Vec<BlockKey>>>,
    pace: Option<std::time::Duration>,
) {
    let stop = Arc::new(AtomicBool::new(false));
    let pending: Pending = Arc::default();
    let batches = Arc::new(AtomicU64::new(0));
    let applier = {
        let (idx, prompts, stop, batches) =
            (idx.clone(), prompts.clone(), stop.clone(), batches.clone());
        let pending = pending.clone();
        std::thread::spawn(move || {
            let mut i = 0u64;
            let mut ops = Vec::with_capacity(64);
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let p = &prompts[(i as usize * 131) % prompts.len()];
                let e = (i as u32 * 13) % ENGINES;
                ops.clear();
                // Half stores, half removes of the same blocks: the index size stays put.
                for k in &p[..32] {
                    ops.push(IndexOp::Stored(*k));
                }
                for k in &p[..32] {
                    ops.push(IndexOp::Removed(*k));
                }
                {
                    let mut g = idx.write().expect("lock");
                    drain(&mut g, &pending);
                    g.apply_all(e, &ops);
                }
                batches.fetch_add(1, Ordering::Relaxed);
                if let Some(p) = pace {
                    std::thread::sleep(p);
                }
            }
        })
    };
    let t0 = Instant::now();
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let (idx, prompts, pending) = (idx.clone(), prompts.clone(), pending.clone());
            std::thread::spawn(move || {
                let mut d = Decider::new();
                let mut lat = Vec::with_capacity(REQUESTS_PER_THREAD);
                let cold: Vec<Vec<BlockKey>> =
                    (0..64).map(|i| keys_of(1_000_000 + t * 100 + i)).collect();
                for r in 0..REQUESTS_PER_THREAD {
                    let seed = t * 1_000_000 + r as u64;
                    let keys = if r % 20 == 0 {
                        &cold[(r / 20) % cold.len()]
                    } else {
                        &prompts[(seed.wrapping_mul(0x9E37_79B9) as usize) % prompts.len()]
                    };
                    let now = 1_000 + r as u64;
                    let s = Instant::now();
                    match mode {
                        Mode::WriteLock => {
                            let mut g = idx.write().expect("lock");
                            let (first, _) = d.decide(&g, keys, seed, now);
                            g.insert_speculative(first as u32, keys, now + 2_000_000, now);
                        }
                        Mode::ReadThenMark => {
                            let (first, matched) = {
                                let g = idx.read().expect("lock");
                                d.decide(&g, keys, seed, now)
                            };
                            if matched {
                                idx.write().expect("lock").insert_speculative(
                                    first as u32,
                                    keys,
                                    now + 2_000_000,
                                    now,
                                );
                            } else {
                                let mut g = idx.write().expect("lock");
                                let (first, _) = d.decide(&g, keys, seed, now);
                                g.insert_speculative(first as u32, keys, now + 2_000_000, now);
                            }
                        }
                        Mode::ReadThenDeferredMark => {
                            let (first, matched) = {
                                let g = idx.read().expect("lock");
                                d.decide(&g, keys, seed, now)
                            };
                            if matched {
                                match idx.try_write() {
                                    Ok(mut g) => {
                                        drain(&mut g, &pending);
                                        g.insert_speculative(
                                            first as u32,
                                            keys,
                                            now + 2_000_000,
                                            now,
                                        );
                                    }
                                    Err(_) => pending.lock().expect("pending").push((
                                        first as u32,
                                        keys.clone(),
                                        now + 2_000_000,
                                        now,
                                    )),
                                }
                            } else {
                                let mut g = idx.write().expect("lock");
                                drain(&mut g, &pending);
                                let (first, _) = d.decide(&g, keys, seed, now);
                                g.insert_speculative(first as u32, keys, now + 2_000_000, now);
                            }
                        }
                    }
                    lat.push(s.elapsed().as_nanos() as u64);
                }
                lat
            })
        })
        .collect();
    let mut lat: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("thread"))
        .collect();
    let wall = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    applier.join().expect("applier");
    lat.sort_unstable();
    let name = match mode {
        Mode::WriteLock => "write-lock (before)",
        Mode::ReadThenMark => "read, then mark",
        Mode::ReadThenDeferredMark => "read, mark or defer (after)",
    };
    println!(
        "{name:24} decision p50 {:6.2} µs  p99 {:7.2} µs  p99.9 {:7.2} µs  | {:7.0} decisions/s, applier {:6.0} batches/s",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        percentile(&lat, 0.999),
        lat.len() as f64 / wall.as_secs_f64(),
        batches.load(Ordering::Relaxed) as f64 / wall.as_secs_f64(),
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs benches as tests: skip then.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let (idx, prompts) = build();
    println!(
        "64 engines, {} indexed blocks; 2 request threads + 1 applier thread (64 ops per batch); {} decisions per thread per round",
        idx.len(),
        REQUESTS_PER_THREAD
    );
    let idx = Arc::new(RwLock::new(idx));
    let prompts = Arc::new(prompts);
    for (label, pace) in [
        ("busy applier (batches back to back)", None),
        (
            "paced applier (~2,000 batches/s)",
            Some(std::time::Duration::from_micros(500)),
        ),
    ] {
        for round in 1..=3 {
            println!("{label}, round {round}");
            run(Mode::WriteLock, &idx, &prompts, pace);
            run(Mode::ReadThenMark, &idx, &prompts, pace);
            run(Mode::ReadThenDeferredMark, &idx, &prompts, pace);
        }
    }
}
