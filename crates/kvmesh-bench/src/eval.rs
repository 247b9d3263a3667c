//! The virtual-time evaluator: the pure engine model (`kvmesh-engine`) and the pure routing
//! core (`kvmesh-route::decide` over `kvmesh-policy`) in one loop on a simulated clock — no
//! sockets, no threads, 100k requests in seconds.
//!
//! One router in front of `engines` engines. What the router knows, per contender:
//! * load-only policies (`round_robin`, `least_request`, ...): its own in-flight counts;
//! * `cache_aware`: its own decisions, as marks in a [`PrefixIndex`] kept `approximate_ttl`;
//! * `precise` / `scored`: every engine's KV events, applied the instant a step ends (through
//!   the same ingestion state machine as the gateway, `EngineIngest`), plus `speculative_ttl`
//!   marks for blocks not yet stored;
//! * **oracle** (the ceiling): exact, instant knowledge of every engine's cache *and* queue —
//!   per engine, the longest prefix of the prompt it holds (its cache, asked directly) or will
//!   hold (a request routed there and not finished shares it) — fed to `precise`'s choice, so
//!   the same load guard applies. No router can know more without delaying requests.
//!
//! Engines are `kvmesh sim`'s: the same `EngineParams` from the same `[sim]` config.

use crate::jobs::{Arrival, JobSet};
use kvmesh_engine::drive::VirtualEngine;
use kvmesh_engine::{Engine, EngineParams, Micros, RequestSpec};
use kvmesh_kvevents::EventBatch;
use kvmesh_policy::{
    EngineMember, EngineView, Policy, PolicyConfig, PolicyKind, PrefixMatch, RequestCtx, Rng,
};
use kvmesh_prefix::{
    BlockKey, EngineIngest, ExtraKeys, IngestConfig, Match, PrefixIndex, block_keys, max_hit_blocks,
};
use kvmesh_route::{PrefixPlan, PrefixProbe, TtlPlan, decide};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

/// What routes the requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contender {
    /// A kvmesh policy.
    Policy(PolicyKind),
    /// Exact, instant knowledge of every engine's cache and queue (see the module doc).
    Oracle,
}

impl Contender {
    /// The contender's name (`oracle` or the policy's).
    pub fn name(&self) -> &'static str {
        match self {
            Contender::Policy(p) => p.as_str(),
            Contender::Oracle => "oracle",
        }
    }
}

/// The fleet and the router of an evaluation.
#[derive(Debug, Clone)]
pub struct EvalConfig {
    /// Engines.
    pub engines: usize,
    /// Every engine's parameters (engine `i` gets seed `params.seed + i`).
    pub params: EngineParams,
    /// The router's policy settings (the policy kind is the contender's).
    pub routing: PolicyConfig,
    /// TTLs of the router's marks.
    pub ttl: TtlPlan,
    /// Closed loop: conversations at once.
    pub concurrency: usize,
    /// Open loop: trace time ÷ this.
    pub speedup: f64,
    /// Seed of the policy's random choices.
    pub seed: u64,
}

/// The outcome of one evaluation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EvalResult {
    /// Contender name.
    pub name: String,
    /// Requests finished.
    pub requests: u64,
    /// Requests the engines refused (too long for the cache).
    pub rejected: u64,
    /// Σ prefix-cache hits / Σ queries over the engines (vLLM's counters).
    pub hit_rate: f64,
    /// Σ predicted cached tokens of the chosen engines / Σ prompt tokens.
    pub predicted_hit_rate: f64,
    /// TTFT percentiles, virtual ms.
    pub ttft_p50_ms: f64,
    /// See `ttft_p50_ms`.
    pub ttft_p99_ms: f64,
    /// Output tokens per virtual second (first arrival to last finish).
    pub output_tokens_per_s: f64,
    /// Requests per virtual second.
    pub requests_per_s: f64,
    /// Requests per engine.
    pub per_engine: Vec<u64>,
    /// Most requests on one engine / the mean.
    pub load_spread: f64,
    /// Preemptions over all engines.
    pub preemptions: u64,
    /// Virtual seconds from start to the last finish.
    pub virtual_s: f64,
}

struct Live {
    engine: usize,
    job: usize,
    keys: Arc<Vec<BlockKey>>,
}

/// Exact knowledge for the oracle, per engine.
struct Exact<'a> {
    held: &'a [u32],
}

impl PrefixProbe for Exact<'_> {
    fn held_blocks(&self, engine: usize) -> u32 {
        self.held[engine]
    }
    fn events_live(&self, _: usize) -> bool {
        true
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[(((p / 100.0) * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)]
}

fn lcp(a: &[BlockKey], b: &[BlockKey]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Runs `set` through `contender` in virtual time.
pub fn evaluate(set: &JobSet, contender: Contender, cfg: &EvalConfig) -> EvalResult {
    let n = cfg.engines.max(1);
    let bs = cfg.params.block_size as usize;
    let kind = match contender {
        Contender::Policy(p) => p,
        Contender::Oracle => PolicyKind::Precise,
    };
    let prefix_aware = matches!(
        kind,
        PolicyKind::CacheAware | PolicyKind::Precise | PolicyKind::Scored
    );
    let reads_events =
        contender != Contender::Oracle && matches!(kind, PolicyKind::Precise | PolicyKind::Scored);
    let mut pcfg = cfg.routing.clone();
    pcfg.policy = kind;
    let members: Vec<EngineMember> = (0..n as u64).map(|i| EngineMember::new(i + 1)).collect();
    let policy = Policy::new(&pcfg, &members, cfg.seed);
    let mut rng = Rng::new(cfg.seed ^ 0x5EED);
    let mut engines: Vec<VirtualEngine> = (0..n)
        .map(|i| {
            let mut p = cfg.params.clone();
            p.seed = p.seed.wrapping_add(i as u64);
            VirtualEngine::new(Engine::new(p))
        })
        .collect();
    let mut index = PrefixIndex::new();
    let mut ingest: Vec<EngineIngest> = Vec::new();
    let mut seqs = vec![0u64; n];
    for i in 0..n {
        let _ = index.add_engine(i as u32, cfg.params.num_blocks.max(1024));
        ingest.push(EngineIngest::new(IngestConfig {
            block_size: cfg.params.block_size,
            capacity: cfg.params.num_blocks as usize,
        }));
    }
    let mut in_flight = vec![0u32; n];
    let mut on_engine: Vec<Vec<u64>> = vec![Vec::new(); n];
    let mut live: HashMap<u64, Live> = HashMap::new();
    // Arrivals: (time, order, job index).
    let mut arrivals: BinaryHeap<Reverse<(Micros, u64, usize)>> = BinaryHeap::new();
    let mut order = 0u64;
    let convs = set.conversations();
    let mut conv_of = vec![(0usize, 0usize); set.jobs.len()];
    for (c, js) in convs.iter().enumerate() {
        for (t, &j) in js.iter().enumerate() {
            conv_of[j] = (c, t);
        }
    }
    let mut next_conv = 0usize;
    match set.arrival {
        Arrival::Closed => {
            while next_conv < convs.len() && next_conv < cfg.concurrency.max(1) {
                arrivals.push(Reverse((0, order, convs[next_conv][0])));
                order += 1;
                next_conv += 1;
            }
        }
        Arrival::Open => {
            let speed = if cfg.speedup > 0.0 { cfg.speedup } else { 1.0 };
            for (j, job) in set.jobs.iter().enumerate() {
                arrivals.push(Reverse(((job.at_us as f64 / speed) as Micros, order, j)));
                order += 1;
            }
        }
    }
    let ttl = cfg.ttl;
    let mut res = EvalResult {
        name: contender.name().to_string(),
        per_engine: vec![0; n],
        ..EvalResult::default()
    };
    let (mut ttfts, mut predicted_tokens, mut prompt_tokens, mut out_tokens) =
        (Vec::new(), 0u64, 0u64, 0u64);
    let mut end: Micros = 0;
    let mut next_expire: Micros = 1_000_000;
    let mut keys = Vec::new();
    let mut matches: Vec<Match> = Vec::new();
    let mut pm: Vec<PrefixMatch> = Vec::new();
    let mut held = vec![0u32; n];
    let mut ops = Vec::new();
    loop {
        let next_step = engines
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.next_step_at().map(|t| (t, i)))
            .min();
        let arrival_first = match (arrivals.peek(), next_step) {
            (Some(Reverse((at, _, _))), s) => s.is_none_or(|(t, _)| *at <= t),
            (None, Some(_)) => false,
            (None, None) => break,
        };
        if arrival_first {
            let Reverse((now, _, j)) = arrivals.pop().expect("peeked");
            if now >= next_expire {
                index.expire(now);
                next_expire = now + 1_000_000;
            }
            let job = &set.jobs[j];
            block_keys(&job.prompt, bs, ExtraKeys::default(), &mut keys);
            let hit_blocks = max_hit_blocks(job.prompt.len(), bs).min(keys.len());
            let views: Vec<EngineView> = (0..n)
                .map(|i| {
                    let mut v = EngineView::new(1.0);
                    v.in_flight = in_flight[i];
                    v
                })
                .collect();
            held.iter_mut().for_each(|h| *h = 0);
            pm.clear();
            if contender == Contender::Oracle {
                for (i, e) in engines.iter().enumerate() {
                    let cached =
                        e.engine().matched_prefix_tokens(&job.prompt, None, None) as usize / bs;
                    let queued = on_engine[i]
                        .iter()
                        .map(|r| lcp(&live[r].keys, &keys[..hit_blocks]))
                        .max()
                        .unwrap_or(0);
                    held[i] = cached.max(queued).min(hit_blocks) as u32;
                }
            } else if prefix_aware {
                index.lookup(&keys[..hit_blocks], now, &mut matches);
                for m in &matches {
                    held[m.engine as usize] = m.blocks;
                }
            }
            for (i, &h) in held.iter().enumerate() {
                if h > 0 {
                    pm.push(PrefixMatch {
                        engine: i as u32,
                        blocks: h,
                    });
                }
            }
            let ctx = RequestCtx::new(rng.next_u64(), now)
                .with_hash_key(kvmesh_policy::stable_hash(&job.conv.to_le_bytes()));
            let probe = Exact { held: &held };
            let plan = (prefix_aware && hit_blocks > 0).then_some(PrefixPlan {
                total_blocks: hit_blocks as u32,
                matches: &pm,
                cold_key: 0,
                probe: &probe,
                ttl,
            });
            let d = decide(&policy, &views, ctx, plan, Vec::new());
            let e = d.candidates.first().copied().unwrap_or(0);
            if contender != Contender::Oracle
                && let Some(m) = d.mark
            {
                index.insert_speculative(m.engine as u32, &keys, m.expiry_us, now);
            }
            let spec = RequestSpec::new(job.id, job.prompt.clone(), job.max_tokens);
            match engines[e].submit(spec, now) {
                Ok(()) => {
                    in_flight[e] += 1;
                    on_engine[e].push(job.id);
                    res.per_engine[e] += 1;
                    predicted_tokens += u64::from(d.predicted(0)) * bs as u64;
                    prompt_tokens += job.prompt.len() as u64;
                    live.insert(
                        job.id,
                        Live {
                            engine: e,
                            job: j,
                            keys: Arc::new(keys.clone()),
                        },
                    );
                }
                Err(_) => {
                    res.rejected += 1;
                    schedule_next(
                        set,
                        &convs,
                        &conv_of,
                        j,
                        now,
                        &mut next_conv,
                        &mut arrivals,
                        &mut order,
                    );
                }
            }
            continue;
        }
        let (_, i) = next_step.expect("a step is due");
        let (start, out) = engines[i].step();
        let done_at = start + out.duration_us;
        if reads_events && !out.events.is_empty() {
            let batch = EventBatch {
                ts: done_at as f64 / 1e6,
                events: out
                    .events
                    .into_iter()
                    .map(|ev| kvmesh_sim::to_kv_event(ev, true))
                    .collect(),
                data_parallel_rank: None,
            };
            ops.clear();
            ingest[i].on_batch(seqs[i], &batch, done_at, &mut ops);
            seqs[i] += 1;
            index.apply_all(i as u32, &ops);
        }
        for f in out.finished {
            let Some(l) = live.remove(&f.id) else {
                continue;
            };
            in_flight[l.engine] -= 1;
            on_engine[l.engine].retain(|&r| r != f.id);
            ttfts.push((f.first_token_at - f.arrival) as f64 / 1e3);
            out_tokens += u64::from(f.output_tokens);
            res.requests += 1;
            end = end.max(f.finished_at);
            schedule_next(
                set,
                &convs,
                &conv_of,
                l.job,
                f.finished_at,
                &mut next_conv,
                &mut arrivals,
                &mut order,
            );
        }
    }
    let (mut hits, mut queries) = (0u64, 0u64);
    for e in &engines {
        let s = e.engine().stats();
        hits += s.prefix_cache_hits;
        queries += s.prefix_cache_queries;
        res.preemptions += s.preemptions;
    }
    res.hit_rate = if queries > 0 {
        hits as f64 / queries as f64
    } else {
        0.0
    };
    res.predicted_hit_rate = if prompt_tokens > 0 {
        predicted_tokens as f64 / prompt_tokens as f64
    } else {
        0.0
    };
    res.ttft_p50_ms = percentile(&mut ttfts, 50.0);
    res.ttft_p99_ms = percentile(&mut ttfts, 99.0);
    res.virtual_s = end as f64 / 1e6;
    // Rates are undefined when no virtual time passed (instant engines): left at 0.
    if res.virtual_s > 0.0 {
        res.output_tokens_per_s = out_tokens as f64 / res.virtual_s;
        res.requests_per_s = res.requests as f64 / res.virtual_s;
    }
    res.load_spread = spread(&res.per_engine);
    res
}

/// Most requests on one engine / the mean (0 without requests).
pub fn spread(per_engine: &[u64]) -> f64 {
    let total: u64 = per_engine.iter().sum();
    if total == 0 || per_engine.is_empty() {
        return 0.0;
    }
    let mean = total as f64 / per_engine.len() as f64;
    *per_engine.iter().max().unwrap_or(&0) as f64 / mean
}

/// Closed loop: after job `j` ends at `at`, its conversation's next turn arrives then, or, at
/// its end, the next conversation starts. Open loop: nothing to do.
#[allow(clippy::too_many_arguments)]
fn schedule_next(
    set: &JobSet,
    convs: &[Vec<usize>],
    conv_of: &[(usize, usize)],
    j: usize,
    at: Micros,
    next_conv: &mut usize,
    arrivals: &mut BinaryHeap<Reverse<(Micros, u64, usize)>>,
    order: &mut u64,
) {
    if set.arrival != Arrival::Closed {
        return;
    }
    let (c, t) = conv_of[j];
    let next = if let Some(&nj) = convs[c].get(t + 1) {
        Some(nj)
    } else if *next_conv < convs.len() {
        *next_conv += 1;
        Some(convs[*next_conv - 1][0])
    } else {
        None
    };
    if let Some(nj) = next {
        arrivals.push(Reverse((at, *order, nj)));
        *order += 1;
    }
}
