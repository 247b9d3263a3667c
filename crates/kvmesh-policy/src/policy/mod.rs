//! The routing policies: a [`Policy`] is built once per membership version and then answers
//! every request with an ordered list of distinct candidates.

mod hash;
mod load;
pub use load::load_score;
mod prefix;
mod scored;
mod wrr;

use crate::config::{MAX_CANDIDATES, PolicyConfig, PolicyKind};
use crate::rng::{Rng, mix64};
use crate::view::{EngineMember, EngineSet, EngineView, Reason, RequestCtx, RouterSlot};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) use hash::Ring;
pub(crate) use prefix::min_blocks;
pub(crate) use wrr::Edf;

/// Which engines a pass may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Filter {
    /// Only eligible engines (the normal pass).
    Eligible,
    /// Every engine (panic mode, when none is eligible).
    All,
}

impl Filter {
    #[inline]
    pub(crate) fn ok(self, v: &EngineView) -> bool {
        match self {
            Filter::Eligible => v.eligible,
            Filter::All => true,
        }
    }
}

/// The prepared state of one model's policy for one membership (engine list).
///
/// Build it with [`Policy::new`] whenever the engine list changes (the consistent-hash ring
/// and the weighted-round-robin schedule are computed then), and share it between request
/// tasks: it is `Send + Sync`, [`Policy::pick`] takes `&self`, and the only locking is a short
/// `std::sync::Mutex` around the weighted-round-robin schedule (never held across an await,
/// since `pick` is synchronous).
#[derive(Debug)]
pub struct Policy {
    cfg: PolicyConfig,
    members: Vec<EngineMember>,
    rr: AtomicU64,
    wrr: Option<Mutex<Edf>>,
    ring: Option<Ring>,
    split: Option<load::TieSplit>,
}

impl Policy {
    /// Prepares `cfg`'s policy for `members` (index `i` of every later [`EngineSet`] is
    /// `members[i]`). `seed` randomises the starting points (round-robin position, WRR phases)
    /// so that router replicas do not move in lockstep; the same seed gives the same decisions.
    pub fn new(cfg: &PolicyConfig, members: &[EngineMember], seed: u64) -> Self {
        let mut cfg = cfg.clone();
        cfg.candidates = cfg.candidates.clamp(1, MAX_CANDIDATES);
        let mut rng = Rng::new(mix64(seed ^ 0x5EED_0F40_11C7));
        let wrr = (cfg.policy == PolicyKind::WeightedRoundRobin)
            .then(|| Mutex::new(Edf::new(members, &mut rng)));
        let ring = (cfg.policy == PolicyKind::ConsistentHash)
            .then(|| Ring::new(members, cfg.consistent_hash.virtual_nodes));
        Policy {
            rr: AtomicU64::new(rng.next_u64()),
            cfg,
            members: members.to_vec(),
            wrr,
            ring,
            split: None,
        }
    }

    /// Tells the policy where this router stands among its mesh's live routers: with
    /// several, `least_request` (and the prefix policies' fallback to it) gives each router
    /// a different engine of those tied for least loaded, in an order all routers share, so
    /// routers deciding at the same moment from the same counts do not pile onto one.
    /// [`RouterSlot::ALONE`] (the default) breaks ties at random.
    pub fn with_router_slot(mut self, slot: RouterSlot) -> Self {
        self.split = load::TieSplit::new(slot, &self.members);
        self
    }

    /// The policy kind.
    pub fn kind(&self) -> PolicyKind {
        self.cfg.policy
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// The membership it was built for.
    pub fn members(&self) -> &[EngineMember] {
        &self.members
    }

    /// Chooses engines for one request: writes up to `candidates` distinct engine indices into
    /// `out` (cleared first), the first choice first, then fallbacks for retries, and says why.
    ///
    /// Allocation-free when `out` has capacity for [`MAX_CANDIDATES`] (keep one `Vec` per
    /// task or thread and reuse it). Ineligible engines are never returned unless all engines
    /// are ineligible; then the policy runs over all of them ([`Reason::AllIneligible`]).
    /// `out` is empty only when `engines` is empty ([`Reason::NoEngines`]).
    pub fn pick<S: EngineSet + ?Sized>(
        &self,
        engines: &S,
        req: &RequestCtx<'_>,
        out: &mut Vec<usize>,
    ) -> Reason {
        out.clear();
        if engines.is_empty() {
            return Reason::NoEngines;
        }
        let reason = self.pick_with(engines, req, Filter::Eligible, out);
        if !out.is_empty() {
            return reason;
        }
        self.pick_with(engines, req, Filter::All, out);
        if out.is_empty() {
            Reason::NoEngines
        } else {
            Reason::AllIneligible
        }
    }

    fn least(&self) -> load::Least<'_> {
        load::Least {
            cfg: &self.cfg.least_request,
            split: self.split.as_ref(),
        }
    }

    fn pick_with<S: EngineSet + ?Sized>(
        &self,
        engines: &S,
        req: &RequestCtx<'_>,
        filter: Filter,
        out: &mut Vec<usize>,
    ) -> Reason {
        let k = self.cfg.candidates;
        // Panic mode draws from another stream than the normal pass did.
        let salt = if filter == Filter::All { 0xA11 } else { 0 };
        let mut rng = Rng::new(mix64(req.seed ^ salt));
        match self.cfg.policy {
            PolicyKind::RoundRobin => {
                let start = self.rr.fetch_add(1, Ordering::Relaxed);
                round_robin(engines, start, &mut rng, filter, k, out);
                Reason::RoundRobin
            }
            PolicyKind::Random => {
                let mut picks = Picks::new();
                sample(engines, &mut rng, filter, k, &mut picks);
                for &(i, _) in picks.as_slice() {
                    out.push(i);
                }
                Reason::Random
            }
            PolicyKind::WeightedRoundRobin => {
                if let Some(edf) = &self.wrr {
                    let mut edf = edf.lock().unwrap_or_else(|e| e.into_inner());
                    edf.pick(engines, filter, k, out);
                }
                if out.is_empty() {
                    // Membership and engine set disagree: serve rather than fail.
                    load::power_of_two(engines, &mut rng, filter, k, load::load_score, out);
                }
                Reason::WeightedRoundRobin
            }
            PolicyKind::LeastRequest => {
                let lr = &self.least();
                load::least_request(engines, &mut rng, req.seed, filter, k, lr, out);
                Reason::LeastLoad
            }
            PolicyKind::PowerOfTwo => {
                load::power_of_two(engines, &mut rng, filter, k, load::load_score, out);
                Reason::PowerOfTwo
            }
            PolicyKind::PeakEwma => {
                load::power_of_two(engines, &mut rng, filter, k, load::latency_score, out);
                Reason::LeastLatency
            }
            PolicyKind::ConsistentHash => {
                let (Some(ring), Some(key)) = (&self.ring, req.hash_key) else {
                    load::power_of_two(engines, &mut rng, filter, k, load::load_score, out);
                    return Reason::HashNoKey;
                };
                let eps = self.cfg.consistent_hash.balance_factor;
                let r = ring.pick(engines, &self.members, key, eps, filter, k, out);
                if out.len() < k {
                    // Fill the fallbacks (or the whole list, if the walk found nothing).
                    let mut picks = Picks::new();
                    sample(engines, &mut rng, filter, k + out.len(), &mut picks);
                    for &(i, _) in picks.as_slice() {
                        if out.len() < k && !out.contains(&i) {
                            out.push(i);
                        }
                    }
                }
                r
            }
            PolicyKind::CacheAware | PolicyKind::Precise => {
                let lr = &self.least();
                match req.prefix {
                    Some(px) if px.total_blocks > 0 => prefix::cache_aware(
                        engines,
                        &self.members,
                        &px,
                        &self.cfg.prefix,
                        &mut rng,
                        req.seed,
                        filter,
                        k,
                        lr,
                        out,
                    ),
                    _ => {
                        load::least_request(engines, &mut rng, req.seed, filter, k, lr, out);
                        Reason::PrefixNone
                    }
                }
            }
            PolicyKind::Scored => {
                let lr = &self.least();
                match req.prefix {
                    Some(px) if px.total_blocks > 0 => scored::scored(
                        engines,
                        &px,
                        &self.cfg.prefix,
                        &self.cfg.scored,
                        &mut rng,
                        req.seed,
                        filter,
                        k,
                        lr.cfg.max_scan,
                        out,
                    ),
                    _ => load::least_request(engines, &mut rng, req.seed, filter, k, lr, out),
                }
                Reason::Scored
            }
        }
    }
}

/// Round robin: the engine at position `start`, skipping filtered-out engines; fallbacks are
/// random distinct engines. When the engine in turn is filtered out, the first choice is a
/// random engine rather than the next in order, and retries go to random engines rather than
/// to the neighbour: either way an ejected or failing engine's turns are spread over the fleet
/// instead of doubling the share of the engine after it.
fn round_robin<S: EngineSet + ?Sized>(
    engines: &S,
    start: u64,
    rng: &mut Rng,
    filter: Filter,
    k: usize,
    out: &mut Vec<usize>,
) {
    let n = engines.len();
    let first = (start % n as u64) as usize;
    if filter.ok(&engines.view(first)) {
        out.push(first);
    }
    if out.len() < k {
        let mut picks = Picks::new();
        sample(engines, rng, filter, k + 1, &mut picks);
        for &(i, _) in picks.as_slice() {
            if out.len() < k && !out.contains(&i) {
                out.push(i);
            }
        }
    }
}

/// A small, fixed-capacity list of (engine, view) on the stack.
pub(crate) struct Picks {
    items: [(usize, EngineView); MAX_CANDIDATES + 1],
    len: usize,
}

impl Picks {
    pub(crate) fn new() -> Self {
        Picks {
            items: [(usize::MAX, EngineView::new(0.0)); MAX_CANDIDATES + 1],
            len: 0,
        }
    }

    pub(crate) fn as_slice(&self) -> &[(usize, EngineView)] {
        &self.items[..self.len]
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [(usize, EngineView)] {
        &mut self.items[..self.len]
    }

    fn contains(&self, i: usize) -> bool {
        self.as_slice().iter().any(|&(j, _)| j == i)
    }

    fn push(&mut self, i: usize, v: EngineView) {
        if self.len < self.items.len() {
            self.items[self.len] = (i, v);
            self.len += 1;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// Up to `want` distinct random engines that pass `filter`, in the order drawn.
///
/// Draws random indices first (O(want) when most engines pass); only when that falls short
/// (a tiny fleet, or most engines filtered out) does it scan from a random position.
pub(crate) fn sample<S: EngineSet + ?Sized>(
    engines: &S,
    rng: &mut Rng,
    filter: Filter,
    want: usize,
    picks: &mut Picks,
) {
    let n = engines.len();
    let want = want.min(MAX_CANDIDATES + 1).min(n);
    if want == 0 {
        return;
    }
    let draws = 4 * want + 8;
    for _ in 0..draws {
        let i = rng.below(n);
        if picks.contains(i) {
            continue;
        }
        let v = engines.view(i);
        if filter.ok(&v) {
            picks.push(i, v);
            if picks.len() == want {
                return;
            }
        }
    }
    let start = rng.below(n);
    for j in 0..n {
        let i = (start + j) % n;
        if picks.contains(i) {
            continue;
        }
        let v = engines.view(i);
        if filter.ok(&v) {
            picks.push(i, v);
            if picks.len() == want {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_returns_distinct_engines_that_pass() {
        let mut views = vec![EngineView::new(1.0); 10];
        for v in views.iter_mut().step_by(2) {
            v.eligible = false;
        }
        let mut rng = Rng::new(3);
        for _ in 0..100 {
            let mut p = Picks::new();
            sample(&views, &mut rng, Filter::Eligible, 4, &mut p);
            assert_eq!(p.len(), 4);
            let mut seen: Vec<usize> = p.as_slice().iter().map(|x| x.0).collect();
            assert!(seen.iter().all(|i| i % 2 == 1));
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), 4);
        }
        let mut p = Picks::new();
        sample(&views[..3], &mut rng, Filter::Eligible, 3, &mut p);
        assert_eq!(p.as_slice().iter().map(|x| x.0).collect::<Vec<_>>(), [1]);
    }
}
