//! Shared test helpers: a seeded RNG, random workloads, an event mirror and a checked runner.
#![allow(dead_code)]

use kvmesh_engine::{
    CachedBlock, DuplicateBlocks, Engine, EngineEvent, EngineParams, FinishedRequest, Micros,
    RequestId, RequestSpec, StepOutput, TimingProfile,
};
use std::collections::{BTreeMap, BTreeSet};

/// SplitMix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }
    /// Uniform in lo..=hi.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 1.0 < p
    }
}

/// Small engine parameters: tiny cache and budget so that eviction, chunking and preemption
/// happen all the time.
pub fn small_params(seed: u64, rng: &mut Rng, mode: DuplicateBlocks) -> EngineParams {
    let block_size = [1u32, 2, 4, 16][rng.range(0, 3) as usize];
    EngineParams {
        block_size,
        num_blocks: rng.range(24, 160) as u32,
        max_num_seqs: rng.range(1, 12) as u32,
        max_num_batched_tokens: rng.range(8, 96) as u32,
        enable_prefix_caching: !rng.chance(0.1),
        max_model_len: 4096,
        profile: TimingProfile::by_name("h100-8b").unwrap(),
        seed,
        output_vocab: if rng.chance(0.5) {
            vec![]
        } else {
            vec![5, 6, 7]
        },
        duplicate_blocks: mode,
    }
}

/// A random workload with shared prefixes (and some block-aligned lengths, LoRA names, salts,
/// multi-turn continuations).
pub fn workload(rng: &mut Rng, n: usize, block_size: u32) -> Vec<(Micros, RequestSpec)> {
    let prefixes: Vec<Vec<u32>> = (0..rng.range(1, 4))
        .map(|_| {
            let len = rng.range(1, 6) * block_size as u64 + rng.range(0, 3);
            (0..len).map(|_| rng.range(0, 9) as u32).collect()
        })
        .collect();
    let mut t = 0;
    let mut out: Vec<(Micros, RequestSpec)> = Vec::with_capacity(n);
    for i in 0..n {
        t += rng.range(0, 30_000);
        let mut prompt = if rng.chance(0.8) {
            prefixes[rng.range(0, prefixes.len() as u64 - 1) as usize].clone()
        } else {
            Vec::new()
        };
        if rng.chance(0.2) && i > 0 {
            // A "next turn": an earlier prompt extended.
            prompt = out[rng.range(0, i as u64 - 1) as usize].1.prompt.clone();
        }
        let extra = if rng.chance(0.3) {
            block_size as u64 * rng.range(0, 3)
        } else {
            rng.range(0, 40)
        };
        prompt.extend((0..extra).map(|_| rng.range(0, 50) as u32));
        if prompt.is_empty() || rng.chance(0.02) {
            prompt.push(1);
        }
        let mut spec = RequestSpec::new(i as RequestId, prompt, rng.range(1, 40) as u32);
        if rng.chance(0.1) {
            spec.lora_name = Some(format!("lora{}", rng.range(0, 1)));
        }
        if rng.chance(0.05) {
            spec.cache_salt = Some("salt".into());
        }
        out.push((t, spec));
    }
    out
}

/// The cache as a consumer of the events sees it: hash -> (block, copies).
#[derive(Default, Debug)]
pub struct Mirror {
    pub blocks: BTreeMap<u64, (CachedBlock, u32)>,
    pub stored_while_present: u64,
}

impl Mirror {
    pub fn apply(&mut self, ev: &EngineEvent, block_size: u32) {
        match ev {
            EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size: bs,
                lora_name,
                ..
            } => {
                assert_eq!(*bs, block_size);
                assert!(!block_hashes.is_empty());
                assert_eq!(token_ids.len(), block_hashes.len() * block_size as usize);
                if let Some(p) = parent_block_hash {
                    assert!(
                        self.blocks.contains_key(p),
                        "parent {p:#x} not cached at store time"
                    );
                }
                let mut parent = *parent_block_hash;
                for (j, &h) in block_hashes.iter().enumerate() {
                    let b = CachedBlock {
                        hash: h,
                        parent,
                        token_ids: token_ids[j * *bs as usize..(j + 1) * *bs as usize].to_vec(),
                        lora_name: lora_name.clone(),
                    };
                    let e = self.blocks.entry(h).or_insert((b.clone(), 0));
                    if e.1 > 0 {
                        self.stored_while_present += 1;
                    }
                    assert_eq!(e.0, b, "same hash, different block");
                    e.1 += 1;
                    parent = Some(h);
                }
            }
            EngineEvent::BlockRemoved { block_hashes } => {
                for h in block_hashes {
                    let e = self.blocks.get_mut(h).expect("removed hash was stored");
                    e.1 -= 1;
                    if e.1 == 0 {
                        self.blocks.remove(h);
                    }
                }
            }
            EngineEvent::AllBlocksCleared => self.blocks.clear(),
        }
    }

    /// Compares with the engine's content (copies counted).
    pub fn assert_matches(&self, engine: &Engine) {
        let mut got: BTreeMap<u64, (CachedBlock, u32)> = BTreeMap::new();
        for b in engine.cached_blocks() {
            let e = got.entry(b.hash).or_insert((b.clone(), 0));
            assert_eq!(e.0, b);
            e.1 += 1;
        }
        assert_eq!(
            got.len(),
            self.blocks.len(),
            "mirror and cache differ in hashes"
        );
        assert_eq!(got, self.blocks, "mirror and cache differ");
    }
}

/// Per-request bookkeeping of a checked run.
#[derive(Default, Debug)]
pub struct Ledger {
    pub specs: BTreeMap<RequestId, RequestSpec>,
    pub next_index: BTreeMap<RequestId, u32>,
    pub tokens: BTreeMap<RequestId, Vec<u32>>,
    pub finished: BTreeMap<RequestId, FinishedRequest>,
    pub aborted: BTreeSet<RequestId>,
    pub rejected: BTreeSet<RequestId>,
}

/// Options of [`checked_run`].
#[derive(Clone, Copy)]
pub struct Chaos {
    pub abort_p: f64,
    pub reset_p: f64,
    pub slowdown_p: f64,
}

pub const NO_CHAOS: Chaos = Chaos {
    abort_p: 0.0,
    reset_p: 0.0,
    slowdown_p: 0.0,
};

/// Runs a workload step by step, checking invariants, the event mirror and every token after
/// every step. Returns the ledger, the mirror and a digest of the whole trace.
pub fn checked_run(
    engine: &mut Engine,
    work: Vec<(Micros, RequestSpec)>,
    chaos: Chaos,
    rng: &mut Rng,
) -> (Ledger, Mirror, u64) {
    use std::hash::{Hash, Hasher};
    let bs = engine.params().block_size;
    let mut trace = std::collections::hash_map::DefaultHasher::new();
    let mut led = Ledger::default();
    let mut mirror = Mirror::default();
    let mut it = work.into_iter().peekable();
    let mut now: Micros = 0;
    let mut steps = 0u64;
    loop {
        while it.peek().is_some_and(|(t, _)| *t <= now) {
            let (t, spec) = it.next().unwrap();
            let id = spec.id;
            match engine.add_request(spec.clone(), t) {
                Ok(()) => {
                    led.specs.insert(id, spec);
                    led.next_index.insert(id, 0);
                }
                Err(e) => {
                    e.to_string().hash(&mut trace);
                    led.rejected.insert(id);
                }
            }
        }
        if rng.chance(chaos.abort_p) {
            let live: Vec<RequestId> = led
                .next_index
                .keys()
                .copied()
                .filter(|id| !led.finished.contains_key(id) && !led.aborted.contains(id))
                .collect();
            if !live.is_empty() {
                let id = live[rng.range(0, live.len() as u64 - 1) as usize];
                assert!(engine.abort(id));
                assert!(!engine.abort(id));
                led.aborted.insert(id);
                engine.check_invariants().unwrap();
            }
        }
        if rng.chance(chaos.reset_p) {
            let idle = engine.stats().used_blocks == 0;
            assert_eq!(engine.reset_prefix_cache(), idle);
            for ev in engine.take_events() {
                mirror.apply(&ev, bs);
            }
            if idle {
                assert_eq!(engine.stats().cached_blocks, 0);
            }
            mirror.assert_matches(engine);
        }
        if rng.chance(chaos.slowdown_p) {
            engine.set_slowdown(1.0 + rng.range(0, 3) as f64);
        }
        if engine.has_work() {
            let before = engine.stats();
            let out = engine.step(now);
            let after = engine.stats();
            if after.preemptions > before.preemptions {
                // vLLM admits no waiting request in a step that preempted.
                assert_eq!(after.prefix_cache_queries, before.prefix_cache_queries);
                assert_eq!(
                    after.preempted_prefix_cache_queries,
                    before.preempted_prefix_cache_queries
                );
            }
            steps += 1;
            assert!(steps < 1_000_000, "no progress");
            assert!(!out.shape.is_empty(), "a step with work scheduled nothing");
            let budget = engine.params().max_num_batched_tokens as u64;
            assert!(out.shape.scheduled_tokens() <= budget);
            check_step(engine, &out, &mut led, &mut mirror, now);
            format!("{now} {out:?}").hash(&mut trace);
            now += out.duration_us;
        } else if let Some((t, _)) = it.peek() {
            now = now.max(*t);
        } else {
            break;
        }
    }
    // Everything admitted and not aborted finished exactly once, with all its tokens.
    for (id, spec) in &led.specs {
        if led.aborted.contains(id) {
            assert!(!led.finished.contains_key(id));
            continue;
        }
        let f = led
            .finished
            .get(id)
            .unwrap_or_else(|| panic!("request {id} lost"));
        assert_eq!(f.output_tokens, spec.max_tokens);
        assert_eq!(led.tokens[id].len(), spec.max_tokens as usize);
    }
    let s = engine.stats();
    assert_eq!(s.running + s.waiting, 0);
    assert_eq!(s.used_blocks, 0);
    assert_eq!(s.finished_requests, led.finished.len() as u64);
    (led, mirror, trace.finish())
}

fn check_step(
    engine: &Engine,
    out: &StepOutput,
    led: &mut Ledger,
    mirror: &mut Mirror,
    now: Micros,
) {
    let p = engine.params();
    engine
        .check_invariants()
        .unwrap_or_else(|e| panic!("invariant broken at t={now}: {e}"));
    for ev in &out.events {
        mirror.apply(ev, p.block_size);
    }
    mirror.assert_matches(engine);
    if p.duplicate_blocks == DuplicateBlocks::Share {
        assert_eq!(mirror.stored_while_present, 0, "a hash was stored twice");
    }
    if !p.enable_prefix_caching {
        assert!(out.events.is_empty());
    }
    for t in &out.tokens {
        assert!(!led.finished.contains_key(&t.id), "token after finish");
        assert!(!led.aborted.contains(&t.id), "token after abort");
        let next = led
            .next_index
            .get_mut(&t.id)
            .expect("token for unknown request");
        assert_eq!(t.index, *next, "tokens out of order");
        *next += 1;
        led.tokens.entry(t.id).or_default().push(t.token);
        if !p.output_vocab.is_empty() {
            assert!(p.output_vocab.contains(&t.token));
        }
    }
    let end = now + out.duration_us;
    for f in &out.finished {
        let spec = &led.specs[&f.id];
        assert!(
            led.finished.insert(f.id, f.clone()).is_none(),
            "finished twice"
        );
        assert_eq!(f.prompt_tokens as usize, spec.prompt.len());
        assert_eq!(f.output_tokens, spec.max_tokens);
        assert_eq!(led.next_index[&f.id], spec.max_tokens);
        assert_eq!(f.finished_at, end);
        assert!(f.arrival <= f.first_token_at && f.first_token_at <= f.finished_at);
        // Hits are whole blocks and never the last prompt token.
        assert_eq!(f.cached_tokens % p.block_size, 0);
        assert!(f.cached_tokens < f.prompt_tokens);
        if !p.enable_prefix_caching {
            assert_eq!(f.cached_tokens, 0);
        }
    }
}
