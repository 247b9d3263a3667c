//! The engine: requests, vLLM V1's scheduler loop, and the step function.
//!
//! One [`Engine::step`] is one `EngineCore.step()` of vLLM V1: `Scheduler.schedule()` (running
//! requests first, then waiting ones FCFS, allocating KV slots and caching newly full blocks at
//! scheduling time), the forward pass (its duration from the [`TimingProfile`]), then
//! `update_from_output()` (sample one token for every request whose scheduled tokens reached
//! the end of its sequence, finish those at `max_tokens`, free their blocks).

use crate::hash::{BlockHasher, sample_token};
use crate::params::EngineParams;
use crate::pool::{BlockPool, IdMap};
use crate::profile::BatchShape;
use crate::types::{
    AdmitError, CachedBlock, EngineEvent, EngineStats, FinishedRequest, Micros, RequestId,
    RequestSpec, StepOutput, TokenOutput,
};
use std::collections::VecDeque;
use std::sync::Arc;

/// A live request's state (vLLM's `Request` plus its `req_to_blocks` entry).
#[derive(Debug, Clone)]
struct Req {
    id: RequestId,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: u32,
    lora: Option<Arc<str>>,
    salt: Option<Box<str>>,
    /// Engine hashes of the full blocks of `tokens` (empty when caching is off).
    hashes: Vec<u64>,
    /// KV blocks held, in sequence order.
    blocks: Vec<u32>,
    /// Leading blocks already hashed and cached (vLLM `num_cached_block`).
    num_cached_blocks: usize,
    /// Tokens whose KV is computed or scheduled (vLLM `num_computed_tokens`).
    num_computed: usize,
    running: bool,
    done: bool,
    preemptions: u32,
    /// Hit tokens at first scheduling (vLLM `num_cached_tokens`).
    cached_tokens: Option<u32>,
    arrival: Micros,
    first_token_at: Option<Micros>,
}

impl Req {
    fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// A deterministic model of one vLLM V1 engine. See the crate docs.
#[derive(Debug, Clone)]
pub struct Engine {
    params: EngineParams,
    bs: usize,
    pool: BlockPool,
    hasher: BlockHasher,
    slots: Vec<Option<Req>>,
    free_slots: Vec<usize>,
    ids: IdMap<usize>,
    /// Running requests in scheduling order (vLLM `self.running`).
    running: Vec<usize>,
    /// Waiting requests, FCFS; preempted ones go back to the front.
    waiting: VecDeque<usize>,
    slowdown: f64,
    stats: EngineStats,
    scratch_sched: Vec<(usize, usize)>,
    scratch_hits: Vec<u32>,
}

impl Engine {
    /// A fresh engine with an empty cache.
    ///
    /// # Panics
    /// When `params.validate()` fails.
    pub fn new(params: EngineParams) -> Engine {
        if let Err(e) = params.validate() {
            panic!("invalid engine parameters: {e}");
        }
        let bs = params.block_size as usize;
        Engine {
            pool: BlockPool::new(
                params.num_blocks,
                bs,
                params.enable_prefix_caching,
                params.duplicate_blocks,
            ),
            hasher: BlockHasher::new(params.seed),
            bs,
            params,
            slots: Vec::new(),
            free_slots: Vec::new(),
            ids: IdMap::default(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            slowdown: 1.0,
            stats: EngineStats::default(),
            scratch_sched: Vec::new(),
            scratch_hits: Vec::new(),
        }
    }

    /// The parameters the engine was built with.
    pub fn params(&self) -> &EngineParams {
        &self.params
    }

    fn req(&self, slot: usize) -> &Req {
        self.slots[slot].as_ref().expect("live slot")
    }

    /// Queues a request (vLLM `add_request`): it waits FCFS until a step admits it. On error
    /// nothing changes.
    pub fn add_request(&mut self, spec: RequestSpec, now: Micros) -> Result<(), AdmitError> {
        if self.ids.contains_key(&spec.id) {
            return Err(AdmitError::DuplicateId);
        }
        if spec.prompt.is_empty() {
            return Err(AdmitError::EmptyPrompt);
        }
        if spec.max_tokens == 0 {
            return Err(AdmitError::ZeroMaxTokens);
        }
        let prompt = spec.prompt.len() as u64;
        if prompt + spec.max_tokens as u64 > self.params.max_model_len as u64 {
            return Err(AdmitError::TooLong {
                prompt: u32::try_from(prompt).unwrap_or(u32::MAX),
                max_tokens: spec.max_tokens,
                max_model_len: self.params.max_model_len,
            });
        }
        // The last generated token is never fed back, so it needs no KV slot.
        let blocks_needed = (prompt + spec.max_tokens as u64 - 1).div_ceil(self.bs as u64);
        if blocks_needed > self.params.num_blocks as u64 {
            return Err(AdmitError::ExceedsCache {
                blocks_needed,
                capacity: self.params.num_blocks as u64,
            });
        }
        let lora: Option<Arc<str>> = spec.lora_name.map(Arc::from);
        let salt: Option<Box<str>> = spec.cache_salt.map(Box::from);
        let mut hashes = Vec::new();
        if self.params.enable_prefix_caching {
            self.hasher.extend_hashes(
                &mut hashes,
                &spec.prompt,
                self.bs,
                lora.as_deref(),
                salt.as_deref(),
            );
        }
        let prompt_len = spec.prompt.len();
        let mut tokens = spec.prompt;
        tokens.reserve(spec.max_tokens as usize);
        let req = Req {
            id: spec.id,
            tokens,
            prompt_len,
            max_tokens: spec.max_tokens,
            lora,
            salt,
            hashes,
            blocks: Vec::new(),
            num_cached_blocks: 0,
            num_computed: 0,
            running: false,
            done: false,
            preemptions: 0,
            cached_tokens: None,
            arrival: now,
            first_token_at: None,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s] = Some(req);
                s
            }
            None => {
                self.slots.push(Some(req));
                self.slots.len() - 1
            }
        };
        self.ids.insert(spec.id, slot);
        self.waiting.push_back(slot);
        Ok(())
    }

    /// The client went away (vLLM `finish_requests(.., FINISHED_ABORTED)`): the request leaves
    /// its queue and its blocks are freed (full ones stay cached). False if unknown.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(slot) = self.ids.remove(&id) else {
            return false;
        };
        let req = self.slots[slot].take().expect("live slot");
        if req.running {
            let pos = self.running.iter().position(|&s| s == slot);
            self.running.remove(pos.expect("running request is queued"));
        } else {
            let pos = self.waiting.iter().position(|&s| s == slot);
            self.waiting.remove(pos.expect("waiting request is queued"));
        }
        self.pool.free(&req.blocks);
        self.free_slots.push(slot);
        self.stats.aborted_requests += 1;
        true
    }

    /// True while any request is running or waiting.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Fault injection: every step's duration is multiplied by `factor` (finite, > 0; other
    /// values are ignored).
    pub fn set_slowdown(&mut self, factor: f64) {
        if factor.is_finite() && factor > 0.0 {
            self.slowdown = factor;
        }
    }

    /// Events produced outside a step (a cache reset) that no step has returned yet.
    pub fn take_events(&mut self) -> Vec<EngineEvent> {
        self.pool.take_events()
    }

    /// vLLM's `/reset_prefix_cache`: succeeds only when no block is in use (no running
    /// request), then forgets every cached block and emits `AllBlocksCleared`.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> EngineStats {
        let cap = self.pool.capacity();
        let free = self.pool.num_free();
        EngineStats {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            kv_cache_usage: (cap - free) as f64 / cap as f64,
            used_blocks: cap - free,
            free_blocks: free,
            cached_blocks: self.pool.num_cached(),
            ..self.stats.clone()
        }
    }

    /// The prefix cache's content, in block-id order (duplicates listed once per copy).
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        self.pool.cached_blocks()
    }

    /// The engine's hashes of the full blocks of `tokens` (what `BlockStored` would carry).
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Vec<u64> {
        let mut v = Vec::new();
        self.hasher
            .extend_hashes(&mut v, tokens, self.bs, lora_name, cache_salt);
        v
    }

    /// How many prompt tokens would be prefix-cache hits if this prompt were scheduled now
    /// (full blocks, at most `len - 1` tokens). Changes nothing: for oracles and tests.
    pub fn matched_prefix_tokens(
        &self,
        prompt: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> u32 {
        if !self.params.enable_prefix_caching || prompt.is_empty() {
            return 0;
        }
        let max_blocks = (prompt.len() - 1) / self.bs;
        let mut parent = None;
        let mut n = 0;
        for i in 0..max_blocks {
            let salt = if i == 0 { cache_salt } else { None };
            let blk = &prompt[i * self.bs..(i + 1) * self.bs];
            let h = self.hasher.hash_block(parent, blk, lora_name, salt);
            if self.pool.lookup(h).is_none() {
                break;
            }
            parent = Some(h);
            n += 1;
        }
        (n * self.bs) as u32
    }

    /// vLLM `KVCacheManager.allocate_slots` for `num_new` tokens after `hits` (cached blocks
    /// found for a waiting request; empty for running ones). False (and no change) when the free
    /// queue cannot supply the blocks.
    fn allocate_slots(&mut self, slot: usize, num_new: usize, hits: &[u32]) -> bool {
        let bs = self.bs;
        let caching = self.params.enable_prefix_caching;
        let pool = &mut self.pool;
        let r = self.slots[slot].as_mut().expect("live slot");
        let total = r.num_computed + hits.len() * bs + num_new;
        let need = total.div_ceil(bs);
        let new = need.saturating_sub(r.blocks.len() + hits.len());
        // Hit blocks sitting in the free queue stop being free when touched.
        let evictable = hits.iter().filter(|&&b| pool.ref_cnt(b) == 0).count();
        if new + evictable > pool.num_free() as usize {
            return false;
        }
        if !hits.is_empty() {
            debug_assert!(r.blocks.is_empty());
            pool.touch(hits);
            r.blocks.extend_from_slice(hits);
            r.num_cached_blocks = hits.len();
        }
        pool.allocate(new, &mut r.blocks);
        if caching {
            // Blocks are cached when scheduled (vLLM `cache_blocks` in `allocate_slots`),
            // capped at the tokens that exist.
            let full = total.min(r.tokens.len()) / bs;
            if full > r.num_cached_blocks {
                pool.cache_full_blocks(
                    &mut r.blocks,
                    &r.hashes,
                    &r.tokens,
                    r.num_cached_blocks,
                    full,
                    crate::pool::Extras {
                        lora: &r.lora,
                        salt: r.salt.as_deref(),
                    },
                );
                r.num_cached_blocks = full;
            }
        }
        true
    }

    /// vLLM `_preempt_request` (recompute): free the blocks, forget the progress, back to the
    /// front of the waiting queue. The caller already removed it from `running`.
    fn preempt(&mut self, slot: usize) {
        let pool = &mut self.pool;
        let r = self.slots[slot].as_mut().expect("live slot");
        pool.free(&r.blocks);
        r.blocks.clear();
        r.num_cached_blocks = 0;
        r.num_computed = 0;
        r.running = false;
        r.preemptions += 1;
        self.waiting.push_front(slot);
        self.stats.preemptions += 1;
    }

    /// The longest chain of cached blocks for a waiting request, into `out` (vLLM
    /// `find_longest_cache_hit`, capped at `num_tokens - 1` tokens so the last token is computed).
    fn find_hits(&self, slot: usize, out: &mut Vec<u32>) {
        out.clear();
        if !self.params.enable_prefix_caching {
            return;
        }
        let r = self.req(slot);
        let max_blocks = ((r.tokens.len() - 1) / self.bs).min(r.hashes.len());
        for &h in &r.hashes[..max_blocks] {
            match self.pool.lookup(h) {
                Some(b) => out.push(b),
                None => break,
            }
        }
    }

    /// Runs one engine step at `now`: schedules a batch, computes its duration and advances every
    /// scheduled request. Tokens, finished requests and events are produced at
    /// `now + duration_us`. With no work it returns an empty output of duration 0.
    pub fn step(&mut self, now: Micros) -> StepOutput {
        let mut out = StepOutput::default();
        if !self.has_work() {
            out.events = self.pool.take_events();
            return out;
        }
        let mut sched = std::mem::take(&mut self.scratch_sched);
        sched.clear();
        self.schedule(&mut sched);

        let shape = self.batch_shape(&sched);
        let us = self.params.profile.step_micros(&shape) * self.slowdown;
        let duration = if shape.is_empty() {
            0
        } else {
            us.round() as Micros
        };
        let end = now + duration;
        if !sched.is_empty() {
            self.stats.steps += 1;
        }

        let mut finished_any = false;
        for &(slot, n) in &sched {
            if self.advance(slot, n, end, &mut out.tokens) {
                finished_any = true;
            }
        }
        if finished_any {
            for &(slot, _) in &sched {
                if self.req(slot).done {
                    out.finished.push(self.finish(slot, end));
                }
            }
            let slots = &self.slots;
            self.running
                .retain(|&s| slots[s].as_ref().is_some_and(|r| !r.done));
            for f in &out.finished {
                let slot = self.ids.remove(&f.id).expect("finished request is live");
                self.slots[slot] = None;
                self.free_slots.push(slot);
            }
        }
        out.duration_us = duration;
        out.shape = shape;
        out.events = self.pool.take_events();
        self.scratch_sched = sched;
        out
    }

    /// vLLM `Scheduler.schedule()` without the features the model has no use for (speculative
    /// decoding, encoders, KV connectors, LoRA slots, priorities).
    fn schedule(&mut self, sched: &mut Vec<(usize, usize)>) {
        let mut budget = self.params.max_num_batched_tokens as usize;
        let mut preempted = false;

        // Running requests first, in order; each gets what it still needs, within the budget.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let r = self.req(slot);
            let num_new = (r.tokens.len() - r.num_computed).min(budget);
            debug_assert!(num_new > 0);
            let mut scheduled = false;
            loop {
                if self.allocate_slots(slot, num_new, &[]) {
                    scheduled = true;
                    break;
                }
                // Out of blocks: preempt the last running request (FCFS: the most recently
                // scheduled), possibly this one.
                let victim = self.running.pop().expect("running is not empty");
                self.preempt(victim);
                preempted = true;
                if victim == slot {
                    break;
                }
            }
            if !scheduled {
                break;
            }
            sched.push((slot, num_new));
            budget -= num_new;
            i += 1;
        }

        // Then waiting requests, FCFS, unless something was preempted in this step.
        if preempted {
            return;
        }
        let mut hits = std::mem::take(&mut self.scratch_hits);
        while budget > 0 && !self.waiting.is_empty() {
            if self.running.len() >= self.params.max_num_seqs as usize {
                break;
            }
            let slot = self.waiting[0];
            self.find_hits(slot, &mut hits);
            let hit_tokens = hits.len() * self.bs;
            let num_new = (self.req(slot).tokens.len() - hit_tokens).min(budget);
            if !self.allocate_slots(slot, num_new, &hits) {
                // FCFS: a request that cannot get blocks stops admission.
                break;
            }
            self.waiting.pop_front();
            self.running.push(slot);
            let caching = self.params.enable_prefix_caching;
            let r = self.slots[slot].as_mut().expect("live slot");
            r.running = true;
            r.num_computed = hit_tokens;
            if caching {
                // vLLM `PrefixCacheStats.record`: a rescheduled preempted request counts apart.
                if r.preemptions == 0 {
                    self.stats.prefix_cache_queries += r.tokens.len() as u64;
                    self.stats.prefix_cache_hits += hit_tokens as u64;
                } else {
                    self.stats.preempted_prefix_cache_queries += r.tokens.len() as u64;
                    self.stats.preempted_prefix_cache_hits += hit_tokens as u64;
                }
            }
            r.cached_tokens.get_or_insert(hit_tokens as u32);
            sched.push((slot, num_new));
            budget -= num_new;
        }
        self.scratch_hits = hits;
    }

    /// The step's composition, from the scheduled (request, tokens) pairs before advancing.
    fn batch_shape(&self, sched: &[(usize, usize)]) -> BatchShape {
        let mut s = BatchShape::default();
        for &(slot, n) in sched {
            let r = self.req(slot);
            let ctx = r.num_computed as u64;
            let n64 = n as u64;
            let is_decode = n == 1 && r.num_computed + 1 == r.tokens.len() && r.num_output() > 0;
            if is_decode {
                s.decode_seqs += 1;
                s.decode_context_tokens += ctx + 1;
            } else {
                s.prefill_tokens += n64;
                s.prefill_attention_pairs += n64 * ctx + n64 * n64 / 2;
            }
        }
        s
    }

    /// vLLM `update_from_output` for one request: its scheduled tokens are now computed; if
    /// that reaches the end of its sequence a token is sampled. True when it just finished.
    fn advance(
        &mut self,
        slot: usize,
        n: usize,
        end: Micros,
        tokens: &mut Vec<TokenOutput>,
    ) -> bool {
        let bs = self.bs;
        let caching = self.params.enable_prefix_caching;
        let seed = self.params.seed;
        let hasher = &self.hasher;
        let vocab = &self.params.output_vocab;
        let r = self.slots[slot].as_mut().expect("live slot");
        r.num_computed += n;
        debug_assert!(r.num_computed <= r.tokens.len());
        if r.num_computed < r.tokens.len() {
            return false; // a prefill chunk that does not reach the end: no token yet
        }
        let index = r.num_output() as u32;
        let token = sample_token(seed, r.id, index, vocab);
        r.tokens.push(token);
        if caching && r.tokens.len().is_multiple_of(bs) {
            hasher.extend_hashes(
                &mut r.hashes,
                &r.tokens,
                bs,
                r.lora.as_deref(),
                r.salt.as_deref(),
            );
        }
        tokens.push(TokenOutput {
            id: r.id,
            token,
            index,
        });
        if r.first_token_at.is_none() {
            r.first_token_at = Some(end);
            self.stats.prompt_tokens += r.prompt_len as u64;
        }
        self.stats.generation_tokens += 1;
        if index + 1 == r.max_tokens {
            r.done = true;
        }
        r.done
    }

    /// Frees a finished request's blocks and reports it (the caller unlinks it).
    fn finish(&mut self, slot: usize, end: Micros) -> FinishedRequest {
        let pool = &mut self.pool;
        let r = self.slots[slot].as_mut().expect("live slot");
        pool.free(&r.blocks);
        r.blocks.clear();
        r.running = false;
        self.stats.finished_requests += 1;
        FinishedRequest {
            id: r.id,
            prompt_tokens: r.prompt_len as u32,
            cached_tokens: r.cached_tokens.unwrap_or(0),
            output_tokens: r.num_output() as u32,
            arrival: r.arrival,
            first_token_at: r.first_token_at.unwrap_or(end),
            finished_at: end,
            preemptions: r.preemptions,
        }
    }

    /// Checks every structural invariant: block accounting (free + used = capacity, refcounts
    /// = holders, free queue linked correctly), hash map ↔ blocks, queues ↔ requests, each
    /// request's blocks and cached prefix. O(total state): for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let cap = self.pool.capacity() as usize;
        let mut refs = vec![0u32; cap];
        let mut seen = vec![false; self.slots.len()];
        let bs = self.bs;
        let caching = self.params.enable_prefix_caching;
        if self.running.len() > self.params.max_num_seqs as usize {
            return Err("more running requests than max_num_seqs".into());
        }
        let queued = self.running.iter().map(|&s| (s, true));
        let queued = queued.chain(self.waiting.iter().map(|&s| (s, false)));
        let mut n = 0;
        for (slot, running) in queued {
            n += 1;
            let Some(r) = self.slots.get(slot).and_then(|s| s.as_ref()) else {
                return Err(format!("queued slot {slot} is empty"));
            };
            let id = r.id;
            if std::mem::replace(&mut seen[slot], true) {
                return Err(format!("request {id} queued twice"));
            }
            if self.ids.get(&id) != Some(&slot) {
                return Err(format!("request {id} not indexed"));
            }
            if r.running != running || r.done {
                return Err(format!("request {id}: wrong state flags"));
            }
            if r.num_output() >= r.max_tokens as usize {
                return Err(format!("request {id} has all its tokens but is live"));
            }
            if caching && r.hashes.len() != r.tokens.len() / bs {
                return Err(format!("request {id}: {} hashes", r.hashes.len()));
            }
            if !running {
                if !r.blocks.is_empty() || r.num_computed != 0 || r.num_cached_blocks != 0 {
                    return Err(format!("waiting request {id} holds state"));
                }
                continue;
            }
            if r.num_computed == 0 || r.num_computed > r.tokens.len() {
                return Err(format!("request {id}: computed {}", r.num_computed));
            }
            if r.blocks.len() != r.num_computed.div_ceil(bs) {
                return Err(format!(
                    "request {id}: {} blocks for {} computed tokens",
                    r.blocks.len(),
                    r.num_computed
                ));
            }
            let want_cached = if caching { r.num_computed / bs } else { 0 };
            if r.num_cached_blocks != want_cached {
                return Err(format!(
                    "request {id}: {} cached blocks, expected {want_cached}",
                    r.num_cached_blocks
                ));
            }
            for (i, &b) in r.blocks.iter().enumerate() {
                refs[b as usize] += 1;
                let h = self.pool.block_hash(b);
                if i < r.num_cached_blocks {
                    if h != Some(r.hashes[i]) {
                        return Err(format!("request {id}: block {i} not cached with its hash"));
                    }
                } else if h.is_some() {
                    return Err(format!("request {id}: uncached block {i} has a hash"));
                }
            }
        }
        if n != self.ids.len() {
            return Err(format!(
                "{} live ids but {n} queued requests",
                self.ids.len()
            ));
        }
        let live = self.slots.iter().filter(|s| s.is_some()).count();
        if live != n || live + self.free_slots.len() != self.slots.len() {
            return Err("slot accounting broken".into());
        }
        self.pool.check(&refs)
    }
}
