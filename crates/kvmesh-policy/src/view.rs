//! What a policy reads: per-engine views, the request context, and what it answers with.

/// One engine as a policy sees it at decision time: plain values the gateway reads from its
/// counters (lock-free atomics, a snapshot) when the policy asks for engine `i`.
///
/// Build it with [`EngineView::new`] or [`EngineTracker::view`](crate::EngineTracker::view)
/// and set fields; the struct is `#[non_exhaustive]` so fields can be added later.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct EngineView {
    /// Health checks and the breaker allow traffic to it. Ineligible engines are skipped unless
    /// every engine is ineligible (then all are used: [`Reason::AllIneligible`]).
    pub eligible: bool,
    /// Effective weight: base weight × automatic factor × slow-start factor. Must be > 0
    /// (anything smaller is treated as 1e-9).
    pub weight: f64,
    /// Configured weight: the cluster's record of the engine, the same on every router
    /// (`weight` is this router's own estimate). What consistent hashing places and bounds
    /// by, so that every router sends a key to the same engine.
    pub base_weight: f64,
    /// The automatic weight's error term alone (`1 − error rate / error_rate_zero`, at least
    /// `min_factor`; 1 with automatic weights off): 1 for an engine that answers, low for one
    /// failing its requests on every router that sends to it, where the latency term and
    /// slow start differ from router to router. What consistent hashing thins by.
    pub error_factor: f64,
    /// Requests in flight to it, counted by the routers until the end of each answer (this
    /// router's own, plus peers' once the mesh shares them).
    pub in_flight: u32,
    /// This router's own part of `in_flight`: the requests it knows of at once, where its
    /// peers' part arrives over the mesh after a delay. `least_request` counts them
    /// `least_request.own_bias` times more; 0 when the caller does not tell them apart
    /// ([`EngineTracker::view`](crate::EngineTracker::view) leaves it 0), which ranks by
    /// `in_flight` alone.
    pub own_in_flight: u32,
    /// Requests the engine itself reports (running + waiting), if known. It may lag; the
    /// load a policy uses is `max(in_flight, engine_load)`, so neither is counted twice.
    pub engine_load: Option<u32>,
    /// KV-cache utilisation the engine reports, 0..=1, if known (a term of `scored`; the
    /// automatic weight already accounts for it).
    pub kv_usage: Option<f32>,
    /// Requests the engine reports waiting in its queue (not yet running), if known; a term of
    /// `scored` (unknown counts as 0). [`EngineTracker::view`](crate::EngineTracker::view)
    /// leaves it `None`; the gateway sets it from the engine's metrics.
    pub waiting: Option<u32>,
    /// Latency estimate in µs (from [`LatencyTracker::latency_us`](crate::LatencyTracker)),
    /// used by `peak_ewma`.
    pub latency_us: f64,
}

impl Default for EngineView {
    fn default() -> Self {
        EngineView::new(1.0)
    }
}

impl EngineView {
    /// An eligible, idle engine of the given effective weight and no latency estimate.
    pub fn new(weight: f64) -> Self {
        EngineView {
            eligible: true,
            weight,
            base_weight: weight,
            error_factor: 1.0,
            in_flight: 0,
            own_in_flight: 0,
            engine_load: None,
            kv_usage: None,
            waiting: None,
            latency_us: 0.0,
        }
    }

    /// The load policies compare: `max(in_flight, engine_load)`.
    #[inline]
    pub fn load(&self) -> u32 {
        match self.engine_load {
            Some(l) => l.max(self.in_flight),
            None => self.in_flight,
        }
    }

    /// The weight, floored at 1e-9 so that it can divide.
    #[inline]
    pub fn safe_weight(&self) -> f64 {
        if self.weight > 1e-9 {
            self.weight
        } else {
            1e-9
        }
    }
}

/// Fleet-wide sums over the eligible engines (used by bounded-load hashing).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Totals {
    /// Number of eligible engines.
    pub eligible: usize,
    /// Sum of their loads ([`EngineView::load`]).
    pub load: u64,
    /// Sum of their effective weights.
    pub weight: f64,
    /// Sum of their configured weights ([`EngineView::base_weight`]).
    pub base_weight: f64,
}

/// The engines of one model, read lazily: a policy asks only for the views it needs, so power
/// of two or consistent hashing at 4,096 engines touch a handful of them.
///
/// Indices are positions in the membership the [`Policy`](crate::Policy) was built with.
pub trait EngineSet {
    /// Number of engines.
    fn len(&self) -> usize;

    /// Engine `i` (`i < len()`) now.
    fn view(&self, i: usize) -> EngineView;

    /// True when there are no engines.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sums over the eligible engines. The default scans every engine; a gateway with
    /// thousands of engines should keep running totals and override it, since
    /// `consistent_hash` calls it once per decision.
    fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for i in 0..self.len() {
            let v = self.view(i);
            if v.eligible {
                t.eligible += 1;
                t.load += u64::from(v.load());
                t.weight += v.safe_weight();
                t.base_weight += v.base_weight.max(1e-9);
            }
        }
        t
    }
}

impl EngineSet for [EngineView] {
    fn len(&self) -> usize {
        <[EngineView]>::len(self)
    }
    fn view(&self, i: usize) -> EngineView {
        self[i]
    }
}

impl EngineSet for Vec<EngineView> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn view(&self, i: usize) -> EngineView {
        self[i]
    }
}

/// How long a prefix of the request each engine already holds in its KV cache: the input of
/// the cache-aware policies (`cache_aware`, `precise`, `scored`; the others ignore it).
///
/// `cache_aware` expects matches from the gateway's own record of earlier routing decisions,
/// `precise` from the engines' KV events; the policies treat both the same. Entries may come
/// in any order; an index outside the engine set is ignored; if an engine is listed twice, its
/// larger match counts; `blocks` above `total_blocks` count as `total_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixInput<'a> {
    /// Full blocks in the request's prompt.
    pub total_blocks: u32,
    /// Engines holding a prefix, with the number of leading blocks they hold; engines not
    /// listed hold none. Only the entries are read (O(matches)): list the engines that hold
    /// something, not the whole fleet.
    pub matches: &'a [PrefixMatch],
    /// A key naming the prompt's leading blocks (the block key at depth
    /// `min(total, cold_prefix_blocks)`; 0 = none): when no engine holds a usable prefix,
    /// `cache_aware`/`precise` send the prompt to this key's rendezvous home, which every
    /// router computes alike.
    pub cold_key: u64,
}

/// One engine's cached prefix for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Engine index (a position in the [`EngineSet`]).
    pub engine: u32,
    /// Leading blocks of the prompt it holds.
    pub blocks: u32,
}

/// Per-request input of a decision.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RequestCtx<'a> {
    /// Consistent-hash key: the configured header or the OpenAI `user` field, hashed with
    /// [`stable_hash`](crate::stable_hash). `None` = no key (`consistent_hash` then falls back
    /// to power of two).
    pub hash_key: Option<u64>,
    /// Seed of every random choice of this decision (sampling, tie-breaks).
    pub seed: u64,
    /// Now, in µs on the caller's clock.
    pub now_us: u64,
    /// Prefix matches for the cache-aware policies (ignored by the others). `None` (or
    /// `total_blocks == 0`): they fall back to least request.
    pub prefix: Option<PrefixInput<'a>>,
}

impl<'a> RequestCtx<'a> {
    /// A request without key or prefix input.
    pub fn new(seed: u64, now_us: u64) -> Self {
        RequestCtx {
            hash_key: None,
            seed,
            now_us,
            prefix: None,
        }
    }

    /// Sets the consistent-hash key.
    pub fn with_hash_key(mut self, key: u64) -> Self {
        self.hash_key = Some(key);
        self
    }

    /// Sets the prefix-match input.
    pub fn with_prefix(mut self, prefix: PrefixInput<'a>) -> Self {
        self.prefix = Some(prefix);
        self
    }
}

/// Why the first candidate was chosen (a metric label: [`Reason::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Reason {
    /// The model has no engines; the candidate list is empty.
    NoEngines,
    /// Every engine was ineligible, so the policy ran over all of them (Envoy's panic mode).
    AllIneligible,
    /// `round_robin`: next in turn.
    RoundRobin,
    /// `random`: uniform choice.
    Random,
    /// `weighted_round_robin`: earliest deadline.
    WeightedRoundRobin,
    /// `least_request`: the least load per unit of weight.
    LeastLoad,
    /// `power_of_two`: the less loaded of two random engines.
    PowerOfTwo,
    /// `peak_ewma`: the lower latency cost of two random engines.
    LeastLatency,
    /// `consistent_hash`: the key's home engine.
    Hash,
    /// `consistent_hash`: the home engine was at its load bound (or ineligible, or thinned
    /// for its errors), so the key went further along the ring.
    HashOverflow,
    /// `consistent_hash` without a key: power of two instead.
    HashNoKey,
    /// `cache_aware` / `precise`: the engine holding the longest usable cached prefix (at
    /// least the minimum match, not overloaded).
    PrefixMatch,
    /// `cache_aware` / `precise`: no engine held at least the minimum match (or there was no
    /// prefix input), so the least loaded engine.
    PrefixNone,
    /// `cache_aware` / `precise`: no engine held any usable part of the prompt, so the
    /// rendezvous home of its leading blocks (the same engine on every router).
    PrefixCold,
    /// `cache_aware` / `precise`: engines held a usable prefix but all were over the load
    /// guard, so the least loaded engine.
    PrefixOverloaded,
    /// `scored`: the best weighted score (least request when there was no prefix input).
    Scored,
}

impl Reason {
    /// Every reason, in declaration order ([`Reason::index`] is the position here).
    pub const ALL: [Reason; 16] = [
        Reason::NoEngines,
        Reason::AllIneligible,
        Reason::RoundRobin,
        Reason::Random,
        Reason::WeightedRoundRobin,
        Reason::LeastLoad,
        Reason::PowerOfTwo,
        Reason::LeastLatency,
        Reason::Hash,
        Reason::HashOverflow,
        Reason::HashNoKey,
        Reason::PrefixMatch,
        Reason::PrefixNone,
        Reason::PrefixCold,
        Reason::PrefixOverloaded,
        Reason::Scored,
    ];

    /// Position in [`Reason::ALL`] (per-reason counter arrays index by it).
    pub fn index(self) -> usize {
        self as usize
    }

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NoEngines => "no_engines",
            Reason::AllIneligible => "fallback_all_unhealthy",
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
            Reason::WeightedRoundRobin => "weighted_round_robin",
            Reason::LeastLoad => "least_load",
            Reason::PowerOfTwo => "power_of_two",
            Reason::LeastLatency => "least_latency",
            Reason::Hash => "hash",
            Reason::HashOverflow => "hash_overflow",
            Reason::HashNoKey => "hash_no_key",
            Reason::PrefixMatch => "prefix_match",
            Reason::PrefixNone => "prefix_none",
            Reason::PrefixCold => "prefix_cold",
            Reason::PrefixOverloaded => "prefix_overloaded",
            Reason::Scored => "scored",
        }
    }
}

/// An engine of the membership a [`Policy`](crate::Policy) is built for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineMember {
    /// Stable identity, e.g. [`stable_hash`](crate::stable_hash) of the engine's URL: the
    /// ring positions derive from it, so an engine keeps its keys across membership changes.
    pub id: u64,
    /// Configured base weight (> 0): sizes its share of the ring and its initial WRR period.
    pub base_weight: f64,
}

impl EngineMember {
    /// A member of base weight 1.
    pub fn new(id: u64) -> Self {
        EngineMember {
            id,
            base_weight: 1.0,
        }
    }
}

/// Where this router stands among the live routers of its mesh: its `rank` (0-based, in an
/// order every router computes alike, e.g. by node name) of `routers`. `least_request` splits
/// engines tied for least loaded by it (see [`Policy::with_router_slot`](crate::Policy::with_router_slot)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterSlot {
    /// This router's place, `0..routers`.
    pub rank: u32,
    /// Live routers, this one included.
    pub routers: u32,
}

impl RouterSlot {
    /// A router alone.
    pub const ALONE: RouterSlot = RouterSlot {
        rank: 0,
        routers: 1,
    };
}
