//! Cache-aware routing on the request path: prompt → tokens → block keys → per-engine longest
//! cached prefix (from the shared [`PrefixIndex`]) → the policy's [`PrefixInput`]; after the
//! decision, speculative entries for the chosen engine.
//!
//! One index serves every model: block keys already separate what must not match (token ids,
//! LoRA name, cache salt, block size), and an engine slot is the engine's id in it. Entries
//! come from two sources: the engines' KV events (confirmed copies, `crate::ingest`) and
//! routing decisions (speculative marks: `speculative_ttl_ms` under `precise`/`scored`,
//! `approximate_ttl_ms` under `cache_aware` and for engines whose event stream is not live).

mod pending;

use crate::memo::{self, Memo, PromptMemo};
use kvmesh_config::{PrefixConfig, ServeConfig};
use kvmesh_openai::{ApiError, ChatCompletionRequest, CompletionRequest, PromptInput, parse_body};
use kvmesh_policy::{PolicyConfig, PolicyKind, PrefixAffinityConfig, PrefixMatch};
use kvmesh_prefix::{
    ANCHOR_STRIDE, BlockKey, ExtraKeys, IndexOp, IndexSink, Match, OpVersion, PrefixIndex, Target,
    Tee, extend_block_keys, max_hit_blocks,
};
use kvmesh_route::TtlPlan;
use kvmesh_tokenize::{ChatRenderRequest, Resume, SegmentCache, Tokenizer};
pub use pending::Hold;
use pending::PendingMarks;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Router-wide counters of cache-aware routing.
pub struct PrefixMetrics {
    /// Requests whose prompt was tokenized and looked up.
    pub lookups: AtomicU64,
    /// Requests of a cache-aware route whose prompt could not be tokenized (routed on load;
    /// the engine answers with the real error if the body is invalid).
    pub tokenize_failures: AtomicU64,
    /// Time spent rendering, tokenizing and hashing.
    pub prepare_time: kvmesh_metrics::Histogram,
    /// Time spent in index lookups.
    pub lookup_time: kvmesh_metrics::Histogram,
}

/// The shared prefix index, the engine slots, the tokenizers.
pub struct PrefixState {
    cfg: PrefixConfig,
    index: RwLock<PrefixIndex>,
    /// Free engine slots (ids in the index) and the next never-used one.
    slots: Mutex<(Vec<u32>, u32)>,
    /// Slots of engines gone for good (their last reference dropped), freed by the next sweep.
    retired: Mutex<Vec<u32>>,
    /// Where index changes go besides the local index (the mesh's delta buffer).
    delta: Mutex<Option<Box<dyn IndexSink + Send>>>,
    /// The marks of decisions whose engine has not answered yet.
    pending: Arc<PendingMarks>,
    tokenizers: Mutex<HashMap<String, Arc<Tokenizer>>>,
    /// Token ids of prompt pieces, shared by every model (keys are text hashes; a piece
    /// tokenized by two tokenizers would collide, so the cache is per tokenizer path).
    segments: Mutex<HashMap<String, Arc<SegmentCache>>>,
    /// Recently routed chat prompts, per tokenizer path (see [`crate::memo`]).
    memos: Mutex<HashMap<String, Arc<PromptMemo>>>,
    /// Turns on the blocking pool for large prompts (`offload_prepare_threads` permits).
    offload: Arc<tokio::sync::Semaphore>,
    /// Test hook: while true, prompts prepared on the blocking pool wait before returning
    /// ([`Self::hold_offloaded`]); the count of those waiting.
    hold: (Mutex<bool>, Condvar),
    held: std::sync::atomic::AtomicUsize,
    /// Counters.
    pub metrics: PrefixMetrics,
}

impl PrefixState {
    /// Empty state for `cfg`.
    pub fn new(cfg: &ServeConfig) -> PrefixState {
        PrefixState {
            cfg: cfg.prefix.clone(),
            index: RwLock::new(PrefixIndex::new()),
            slots: Mutex::new((Vec::new(), 0)),
            retired: Mutex::new(Vec::new()),
            delta: Mutex::new(None),
            pending: Arc::default(),
            tokenizers: Mutex::new(HashMap::new()),
            segments: Mutex::new(HashMap::new()),
            memos: Mutex::new(HashMap::new()),
            offload: Arc::new(tokio::sync::Semaphore::new(
                cfg.prefix.offload_prepare_threads.max(1),
            )),
            hold: (Mutex::new(false), Condvar::new()),
            held: Default::default(),
            metrics: PrefixMetrics {
                lookups: AtomicU64::new(0),
                tokenize_failures: AtomicU64::new(0),
                prepare_time: kvmesh_metrics::Histogram::new(kvmesh_metrics::MICRO_BUCKETS),
                lookup_time: kvmesh_metrics::Histogram::new(kvmesh_metrics::MICRO_BUCKETS),
            },
        }
    }

    /// The `[serve.prefix]` section.
    pub fn config(&self) -> &PrefixConfig {
        &self.cfg
    }

    /// The index, for reading (lookups and probes run under this shared lock, concurrently
    /// with each other; never held across an await).
    pub fn index(&self) -> RwLockReadGuard<'_, PrefixIndex> {
        self.index.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The write lock: private. Every change goes through [`Self::apply_batch`],
    /// [`Self::mark`], [`Self::clear`] or [`Self::exclusive`] (the sink), or the slot and sweep
    /// bookkeeping below.
    fn index_mut(&self) -> RwLockWriteGuard<'_, PrefixIndex> {
        self.index.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` with the sink of every index change: the local index (write-locked for the
    /// call) teed to the delta sink when one is set.
    fn with_sink<R>(&self, f: impl FnOnce(&mut dyn IndexSink) -> R) -> R {
        let mut index = self.index_mut();
        let mut delta = lock(&self.delta);
        match delta.as_deref_mut() {
            Some(d) => f(&mut Tee(&mut *index, d)),
            None => f(&mut *index),
        }
    }

    /// A versioned batch of an engine's ops (its KV events); true when it was new.
    pub fn apply_batch(&self, t: Target, version: OpVersion, ops: &[IndexOp]) -> bool {
        self.with_sink(|s| s.apply_batch(t, version, ops))
    }

    /// A decision's speculative mark (a brief write lock; lookups are not held up for long):
    /// [`Exclusive::mark`].
    pub fn mark(
        &self,
        t: Target,
        keys: &[BlockKey],
        known: usize,
        expiry_us: u64,
        now_us: u64,
    ) -> Option<Hold> {
        self.exclusive(|x| x.mark(t, keys, known, expiry_us, now_us))
    }

    /// A mark another router made (arrived through the mesh): into the local index only, not
    /// back to the delta sink.
    pub fn remote_mark(&self, t: Target, keys: &[BlockKey], expiry_us: u64, now_us: u64) {
        if !keys.is_empty() && expiry_us > now_us {
            self.index_mut()
                .insert_speculative(t.slot, keys, expiry_us, now_us);
        }
    }

    /// Takes back one decision's mark (the engine refused the request): see
    /// [`PrefixIndex::unmark`]. Local: peers keep the copy the mesh carried until it expires.
    pub fn unmark(&self, t: Target, keys: &[BlockKey], expiry_us: u64) {
        self.index_mut().unmark(t.slot, keys, expiry_us);
    }

    /// The routing decisions' marks for an engine are void (it restarted); its confirmed
    /// blocks stay for its events, or its owners' feed of them, to clear. Local: each router
    /// sees the restart itself.
    pub fn clear_marks(&self, t: Target) {
        self.index_mut().clear_marks(t.slot);
    }

    /// Runs `f` holding the write lock: a lookup, decision and mark that must not interleave
    /// with another request's (a prompt no engine holds yet: its siblings must see its mark).
    pub fn exclusive<R>(&self, f: impl FnOnce(&mut Exclusive<'_>) -> R) -> R {
        let mut index = self.index_mut();
        let mut delta = lock(&self.delta);
        let mut x = Exclusive {
            index: &mut index,
            delta: delta.as_deref_mut(),
            pending: &self.pending,
        };
        f(&mut x)
    }

    /// Sets the sink that receives every index change besides the local index (the mesh's
    /// delta buffer; a recording sink in tests).
    pub fn set_delta_sink(&self, sink: Option<Box<dyn IndexSink + Send>>) {
        *lock(&self.delta) = sink;
    }

    /// The tokenizer at `path` (empty = bundled Qwen3), loaded once.
    pub fn tokenizer(&self, path: &str) -> Result<Arc<Tokenizer>, String> {
        if let Some(t) = lock(&self.tokenizers).get(path) {
            return Ok(t.clone());
        }
        // Loading takes a moment (hundreds of ms for a large vocabulary); done outside the
        // lock, a concurrent load of the same path just wastes one.
        let t = Arc::new(load_tokenizer(path)?);
        lock(&self.tokenizers).insert(path.to_string(), t.clone());
        Ok(t)
    }

    fn segment_cache(&self, path: &str) -> Arc<SegmentCache> {
        let mut g = lock(&self.segments);
        if let Some(c) = g.get(path) {
            return c.clone();
        }
        let c = Arc::new(SegmentCache::new(self.cfg.tokenizer_cache_tokens));
        g.insert(path.to_string(), c.clone());
        c
    }

    fn prompt_memo(&self, path: &str) -> Arc<PromptMemo> {
        lock(&self.memos)
            .entry(path.to_string())
            .or_insert_with(|| Arc::new(PromptMemo::new(self.cfg.prompt_memo_bytes)))
            .clone()
    }

    /// Bytes held by the piece caches (as counted for their bound: 4 per id) and the prompt
    /// memos, summed over tokenizers.
    pub fn cache_bytes(&self) -> (usize, usize) {
        let pieces = lock(&self.segments)
            .values()
            .map(|c| c.held_tokens() * 4)
            .sum();
        let memos = lock(&self.memos).values().map(|m| m.bytes()).sum();
        (pieces, memos)
    }

    /// Test hook: while `on`, prompts prepared on the blocking pool wait, once prepared,
    /// until it is turned off (30 s at most) ([`Self::held_prepares`] counts them), so that a test can
    /// show other requests being served meanwhile.
    #[doc(hidden)]
    pub fn hold_offloaded(&self, on: bool) {
        *self.hold.0.lock().unwrap_or_else(|p| p.into_inner()) = on;
        self.hold.1.notify_all();
    }

    /// Prompts waiting in the [`Self::hold_offloaded`] hook.
    #[doc(hidden)]
    pub fn held_prepares(&self) -> usize {
        self.held.load(Relaxed)
    }

    fn wait_if_held(&self) {
        let mut on = self.hold.0.lock().unwrap_or_else(|p| p.into_inner());
        if !*on {
            return;
        }
        self.held.fetch_add(1, Relaxed);
        // Bounded, so that a test of a broken offload (this wait on the runtime's only
        // thread) fails instead of hanging.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while *on {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            on = self
                .hold
                .1
                .wait_timeout(on, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.held.fetch_sub(1, Relaxed);
    }

    /// A slot for a new engine, registered in the index with the configured capacity.
    pub fn alloc_slot(&self) -> u32 {
        let slot = {
            let mut s = lock(&self.slots);
            match s.0.pop() {
                Some(x) => x,
                None => {
                    s.1 += 1;
                    s.1 - 1
                }
            }
        };
        let _ = self
            .index_mut()
            .add_engine(slot, self.cfg.engine_capacity_blocks);
        slot
    }

    /// Frees a slot and drops its entries.
    pub fn release_slot(&self, slot: u32) {
        self.index_mut().remove_engine(slot);
        lock(&self.slots).0.push(slot);
    }

    /// A slot for a new engine, returned (retired, then freed by a sweep) when the lease is
    /// dropped with the engine's last reference.
    pub fn lease(state: &Arc<PrefixState>) -> SlotLease {
        SlotLease {
            slot: state.alloc_slot(),
            state: state.clone(),
        }
    }

    /// Queues the slot of an engine whose last reference is gone (`Drop` of the engine: no
    /// request, probe or event task can write for it any more); the next [`sweep`](Self::sweep)
    /// frees it. Deferred so that a slot is never reused while a late decision or event batch
    /// of the removed engine could still mark it.
    pub fn retire_slot(&self, slot: u32) {
        lock(&self.retired).push(slot);
    }

    /// Frees retired slots and drops expired speculative entries (about once a second).
    pub fn sweep(&self, now_us: u64) -> usize {
        let retired = std::mem::take(&mut *lock(&self.retired));
        for slot in retired {
            self.release_slot(slot);
        }
        self.index_mut().expire(now_us)
    }
}

/// The index under its write lock ([`PrefixState::exclusive`]): read it, then mark through
/// the sink.
pub struct Exclusive<'a> {
    index: &'a mut PrefixIndex,
    delta: Option<&'a mut (dyn IndexSink + Send + 'static)>,
    pending: &'a Arc<PendingMarks>,
}

impl Exclusive<'_> {
    /// The index, for lookups and probes.
    pub fn index(&self) -> &PrefixIndex {
        self.index
    }

    /// A decision's speculative mark, through the sink; `known`: the leading keys the
    /// decision found the engine holding. Held until the engine answers (see [`Hold`]).
    pub fn mark(
        &mut self,
        t: Target,
        keys: &[BlockKey],
        known: usize,
        expiry_us: u64,
        now_us: u64,
    ) -> Option<Hold> {
        if keys.is_empty() {
            return None;
        }
        IndexSink::mark(self.index, t, keys, known, expiry_us, now_us);
        if let Some(d) = self.delta.as_deref_mut() {
            d.mark(t, keys, known, expiry_us, now_us);
        }
        Some(self.pending.open(t.slot, keys, known))
    }
}

/// An engine's slot in the index, held by the engine: dropped with the engine's last
/// reference (no request, probe or event task can write for it any more), it retires the
/// slot, and the next sweep frees it with its entries.
pub struct SlotLease {
    slot: u32,
    state: Arc<PrefixState>,
}

impl SlotLease {
    /// The slot.
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.state.retire_slot(self.slot);
    }
}

/// What a cache-aware route needs on the request path, prepared at snapshot rebuild.
pub struct RoutePrefix {
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its piece cache.
    pub segments: Arc<SegmentCache>,
    /// Its prompt memo.
    pub memo: Arc<PromptMemo>,
    /// Tokens per block.
    pub block_size: u32,
    /// The model's name when it is a LoRA adapter (mixed into every block key).
    pub lora_name: Option<String>,
    /// The policy kind (decides the speculative TTL and the shortest match looked up).
    pub kind: PolicyKind,
    /// The policy's matching thresholds (matches shorter than it uses are not looked up).
    pub affinity: PrefixAffinityConfig,
    /// Engine slot → index of the engine in the route (`u32::MAX`: not in this route).
    pub slot_to_idx: Vec<u32>,
}

impl RoutePrefix {
    /// Prepares a route of `model` over `engines` if its policy is cache-aware. A tokenizer
    /// that fails to load is logged and the route falls back to load-only routing.
    pub fn build(
        state: &PrefixState,
        cfg: &ServeConfig,
        model: &str,
        policy: &PolicyConfig,
        lora: bool,
        slots: &[u32],
    ) -> Option<RoutePrefix> {
        let kind = policy.policy;
        if !kind.uses_prefix() {
            return None;
        }
        let path = cfg.model_tokenizer(model);
        let tokenizer = match state.tokenizer(path) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(model, error = %e, "cache-aware routing disabled for this model");
                return None;
            }
        };
        let max_slot = slots.iter().copied().max().unwrap_or(0);
        let mut slot_to_idx = vec![u32::MAX; max_slot as usize + 1];
        for (i, &s) in slots.iter().enumerate() {
            slot_to_idx[s as usize] = i as u32;
        }
        Some(RoutePrefix {
            tokenizer,
            segments: state.segment_cache(path),
            memo: state.prompt_memo(path),
            block_size: cfg.model_block_size(model),
            lora_name: lora.then(|| model.to_string()),
            kind,
            affinity: policy.prefix,
            slot_to_idx,
        })
    }
}

/// Where the request's body goes (the prompt is read differently).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`: messages rendered with the chat template.
    Chat,
    /// `/v1/completions`: a text prompt or token ids.
    Completions,
}

/// A request body parsed once, for routing (model, user) and for its prompt.
pub enum ParsedRequest {
    /// `/v1/chat/completions`.
    Chat(ChatCompletionRequest),
    /// `/v1/completions`.
    Completion(CompletionRequest),
}

impl ParsedRequest {
    /// Parses `body` as `endpoint`'s request (leniently: validation is the engine's).
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, String> {
        Ok(match endpoint {
            Endpoint::Chat => ParsedRequest::Chat(parse_body(body).map_err(|e| e.message)?),
            Endpoint::Completions => {
                ParsedRequest::Completion(parse_body(body).map_err(|e| e.message)?)
            }
        })
    }

    /// What every OpenAI-compatible server rejects (no `messages`, `max_tokens` below 1, …):
    /// the router answers it itself, before any decision, so that it changes no state.
    pub fn check_openai(&self) -> Result<(), ApiError> {
        match self {
            ParsedRequest::Chat(r) => r.check_openai(),
            ParsedRequest::Completion(r) => r.check_openai(),
        }
    }

    /// The completion's `max_tokens` (`max_completion_tokens` first, for chat), when given
    /// and valid.
    pub fn max_tokens(&self) -> Option<u32> {
        match self {
            ParsedRequest::Chat(r) => r.max_tokens().ok().flatten(),
            ParsedRequest::Completion(r) => {
                kvmesh_openai::check_max_tokens("max_tokens", r.max_tokens)
                    .ok()
                    .flatten()
            }
        }
    }

    /// The `model` field.
    pub fn model(&self) -> Option<&str> {
        match self {
            ParsedRequest::Chat(r) => r.model.as_deref(),
            ParsedRequest::Completion(r) => r.model.as_deref(),
        }
    }

    /// The `user` field.
    pub fn user(&self) -> Option<&str> {
        match self {
            ParsedRequest::Chat(r) => r.user.as_deref(),
            ParsedRequest::Completion(r) => r.user.as_deref(),
        }
    }

    /// Whether the answer is streamed (`"stream": true`).
    pub fn stream(&self) -> bool {
        match self {
            ParsedRequest::Chat(r) => r.stream,
            ParsedRequest::Completion(r) => r.stream,
        }
    }
}

/// Per-thread buffers of the request path (no allocation per request once warm).
#[derive(Default)]
pub struct Scratch {
    tokens: Vec<u32>,
    resumes: Vec<Resume>,
    /// The request's block keys (only the blocks an engine could serve from cache).
    pub keys: Vec<BlockKey>,
    found: Vec<Match>,
    /// Matches translated to route indices (the policy's input).
    pub matches: Vec<PrefixMatch>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch buffers (never across an await: `f` is synchronous).
pub fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|s| f(&mut s.borrow_mut()))
}

/// What the request's prompt turned into.
#[derive(Debug, Clone, Copy, Default)]
pub struct Lookup {
    /// Prompt tokens (after the `max_prompt_tokens` cut).
    pub prompt_tokens: u32,
    /// Blocks an engine could serve from cache (`scratch.keys.len()`).
    pub total_blocks: u32,
}

/// Renders/tokenizes the body's prompt, computes its block keys into `s.keys` and the
/// per-engine matches into `s.matches` (route indices). `None` when the prompt cannot be read
/// (routed on load alone). The request path uses the two halves ([`prompt_keys`] outside any
/// lock, [`match_engines`] under the index lock it decides and remembers under).
pub fn prepare(
    state: &PrefixState,
    rp: &RoutePrefix,
    endpoint: Endpoint,
    body: &[u8],
    now_us: u64,
    s: &mut Scratch,
) -> Option<Lookup> {
    let req = ParsedRequest::parse(endpoint, body).ok()?;
    let l = prompt_keys(state, rp, &req, s)?;
    match_engines(state, &state.index(), rp, now_us, s);
    Some(l)
}

/// Renders/tokenizes the body's prompt and computes its block keys into `s.keys` (cut to the
/// blocks an engine can serve from cache). No lock.
pub fn prompt_keys(
    state: &PrefixState,
    rp: &RoutePrefix,
    req: &ParsedRequest,
    s: &mut Scratch,
) -> Option<Lookup> {
    let t0 = std::time::Instant::now();
    s.tokens.clear();
    s.keys.clear();
    s.matches.clear();
    s.resumes.clear();
    if let Err(e) = tokens_and_keys(rp, req, state.cfg.max_prompt_tokens, s) {
        state.metrics.tokenize_failures.fetch_add(1, Relaxed);
        tracing::debug!(error = %e, "prompt not tokenized; routing on load");
        return None;
    }
    let n = s.tokens.len().min(state.cfg.max_prompt_tokens);
    s.keys.truncate(max_hit_blocks(n, rp.block_size as usize));
    state
        .metrics
        .prepare_time
        .observe_us(t0.elapsed().as_micros() as u64);
    Some(Lookup {
        prompt_tokens: n as u32,
        total_blocks: s.keys.len() as u32,
    })
}

/// A prompt prepared on the blocking pool: its block keys (cut as [`prompt_keys`] cuts them)
/// and what it turned into (`None`: not readable, routed on load).
pub struct Prepared {
    /// The block keys.
    pub keys: Vec<BlockKey>,
    /// Tokens and blocks.
    pub lookup: Option<Lookup>,
}

/// [`prompt_keys`] for a request whose body has at least `offload_prepare_bytes`, on tokio's
/// blocking pool (at most `offload_prepare_threads` at once; the others wait for a turn
/// without holding a thread), so that preparing a long prompt never holds up the requests
/// served by the same runtime thread. `None` for smaller bodies (prepared inline, in the
/// decision) — the request is then handed back untouched.
pub async fn prompt_keys_offloaded(
    state: &Arc<PrefixState>,
    rp: &Arc<RoutePrefix>,
    req: ParsedRequest,
    body_len: usize,
) -> (Option<ParsedRequest>, Option<Prepared>) {
    if body_len < state.cfg.offload_prepare_bytes {
        return (Some(req), None);
    }
    let Ok(permit) = state.offload.clone().acquire_owned().await else {
        return (Some(req), None);
    };
    let (state, rp) = (state.clone(), rp.clone());
    let job = tokio::task::spawn_blocking(move || {
        let _turn = permit;
        let prepared = with_scratch(|s| {
            let lookup = prompt_keys(&state, &rp, &req, s);
            Prepared {
                keys: std::mem::take(&mut s.keys),
                lookup,
            }
        });
        state.wait_if_held();
        (req, prepared)
    });
    match job.await {
        Ok((req, prepared)) => (Some(req), Some(prepared)),
        // A panic while preparing: the prompt is routed on load.
        Err(_) => (None, None),
    }
}

/// Looks `s.keys` up in `index` and translates the engine slots into the route's indices
/// (`s.matches`). Only matches the policy can use are looked up: `cache_aware` and `precise`
/// ignore those under their minimum (`min_match_ratio` of the prompt), and `scored` counts
/// matches of at least `ANCHOR_STRIDE + 1` blocks (144 tokens at 16 per block), so a chat
/// template's first block, held by the whole fleet, never makes a lookup visit every engine.
pub fn match_engines(
    state: &PrefixState,
    index: &PrefixIndex,
    rp: &RoutePrefix,
    now_us: u64,
    s: &mut Scratch,
) {
    let t1 = std::time::Instant::now();
    let total = s.keys.len() as u32;
    let min = match rp.kind {
        PolicyKind::Scored => (ANCHOR_STRIDE as u32 + 1).min(total),
        _ => rp.affinity.min_blocks(total),
    };
    index.lookup_min(&s.keys, min.max(1) as usize, now_us, &mut s.found);
    s.matches.clear();
    for m in &s.found {
        if let Some(&i) = rp.slot_to_idx.get(m.engine as usize)
            && i != u32::MAX
        {
            s.matches.push(PrefixMatch {
                engine: i,
                blocks: m.blocks,
            });
        }
    }
    state
        .metrics
        .lookup_time
        .observe_us(t1.elapsed().as_micros() as u64);
    state.metrics.lookups.fetch_add(1, Relaxed);
}

/// The prompt's token ids into `s.tokens` and the keys of the full blocks of its first `max`
/// tokens into `s.keys`. A chat prompt that continues a memoized one (an earlier turn of its
/// conversation, see [`crate::memo`]) reuses the memo's ids and keys up to where the two
/// texts are cut alike, and is memoized in turn.
fn tokens_and_keys(
    rp: &RoutePrefix,
    req: &ParsedRequest,
    max: usize,
    s: &mut Scratch,
) -> Result<(), String> {
    let bs = rp.block_size as usize;
    let salt = match req {
        ParsedRequest::Chat(r) => r.cache_salt.as_deref(),
        ParsedRequest::Completion(r) => r.cache_salt.as_deref(),
    };
    let extra = ExtraKeys {
        lora_name: rp.lora_name.as_deref(),
        cache_salt: salt.filter(|x| !x.is_empty()),
    };
    match req {
        ParsedRequest::Chat(r) => {
            let req = ChatRenderRequest {
                messages: &r.messages,
                tools: r.tools.as_deref(),
                add_generation_prompt: r.add_generation_prompt.unwrap_or(true),
                continue_final_message: r.continue_final_message,
                template_kwargs: r.chat_template_kwargs.as_ref(),
            };
            let text = rp.tokenizer.render_chat(&req).map_err(|e| e.to_string())?;
            let params = memo::params(rp.block_size, extra.lora_name, extra.cache_salt);
            let mut start = 0;
            let mut same = false;
            if let Some(m) = rp.memo.find(&text, params)
                && m.params == params
            {
                let common = memo::common_prefix(m.text.as_bytes(), text.as_bytes());
                same = common == text.len() && common == m.text.len();
                let n = rp.tokenizer.resumable(&m.resumes, common);
                if let Some(at) = n.checked_sub(1).map(|i| m.resumes[i]) {
                    start = at.byte as usize;
                    s.tokens.extend_from_slice(&m.tokens[..at.tokens as usize]);
                    s.resumes.extend_from_slice(&m.resumes[..n]);
                    let known = (at.tokens as usize).min(max) / bs;
                    s.keys.extend_from_slice(&m.keys[..known.min(m.keys.len())]);
                }
            }
            rp.tokenizer
                .encode_cached_from(
                    &text,
                    start,
                    &rp.segments,
                    &mut s.tokens,
                    Some(&mut s.resumes),
                )
                .map_err(|e| e.to_string())?;
            let n = s.tokens.len().min(max);
            extend_block_keys(&s.tokens[..n], bs, extra, &mut s.keys);
            if !same && text.len() >= memo::MIN_MEMO_BYTES {
                rp.memo.put(Memo {
                    text: text.into_boxed_str(),
                    tokens: s.tokens.as_slice().into(),
                    keys: s.keys.as_slice().into(),
                    resumes: s.resumes.as_slice().into(),
                    params,
                });
            }
        }
        ParsedRequest::Completion(r) => {
            let inputs = r.prompt.inputs();
            let [input] = inputs.as_slice() else {
                return Err("batched prompts are routed on load".into());
            };
            match input {
                PromptInput::Text(t) => {
                    rp.tokenizer
                        .encode_into(t, true, &mut s.tokens)
                        .map_err(|e| e.to_string())?;
                }
                PromptInput::Tokens(ids) => s.tokens.extend_from_slice(ids),
            }
            let n = s.tokens.len().min(max);
            extend_block_keys(&s.tokens[..n], bs, extra, &mut s.keys);
        }
    }
    Ok(())
}

/// How long marks last under this config (the core picks per engine: [`TtlPlan`]).
pub fn ttl_plan(cfg: &PrefixConfig) -> TtlPlan {
    TtlPlan {
        speculative_us: cfg.speculative_ttl_ms.saturating_mul(1000),
        approximate_us: cfg.approximate_ttl_ms.saturating_mul(1000),
    }
}

/// Loads the tokenizer at `path` (empty: the bundled one).
pub fn load_tokenizer(path: &str) -> Result<Tokenizer, String> {
    if path.is_empty() {
        Tokenizer::bundled_default()
    } else {
        Tokenizer::from_path(Path::new(path))
    }
    .map_err(|e| {
        let shown = if path.is_empty() { "(bundled)" } else { path };
        format!("cannot load tokenizer {shown}: {e}")
    })
}
