//! Load- and latency-aware policies: `least_request`, `power_of_two`, `peak_ewma`.

use super::{Filter, Picks, sample};
use crate::config::{LeastRequestConfig, MAX_CANDIDATES};
use crate::rng::{Rng, mix64};
use crate::view::{EngineMember, EngineSet, EngineView, RouterSlot};

/// Least request as one [`Policy`](crate::Policy) runs it: its config, and how it splits ties
/// with the other routers of its mesh.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Least<'a> {
    pub(crate) cfg: &'a LeastRequestConfig,
    pub(crate) split: Option<&'a TieSplit>,
}

/// Ties split between routers: engines tied for least loaded (and for this router's own count
/// on them, which breaks ties in the sum first: see [`least_request`]) are put in an order
/// every router shares (a hash of each engine's stable id), and the router of rank `r` among
/// `n` live routers takes the `(r mod ties)`-th. Routers that decide at the same moment from
/// the same counts (a peer's newest count not yet arrived) then take different engines of the
/// tie where picking at random would put two on one engine half the time with two tied.
#[derive(Debug, Clone)]
pub(crate) struct TieSplit {
    rank: u32,
    /// Per engine index: its place in the shared order.
    keys: Vec<u64>,
}

impl TieSplit {
    /// The split for `slot` over `members`; `None` for a router alone (no one to split with).
    pub(crate) fn new(slot: RouterSlot, members: &[EngineMember]) -> Option<TieSplit> {
        (slot.routers > 1).then(|| TieSplit {
            rank: slot.rank % slot.routers,
            keys: members
                .iter()
                .map(|m| mix64(m.id ^ 0x5917_7135_0C0F_FEE5))
                .collect(),
        })
    }

    /// Engine `i`'s place in the order the routers share.
    #[inline]
    fn key(&self, i: usize) -> u64 {
        self.keys.get(i).copied().unwrap_or(i as u64)
    }

    /// Of the engines tied for least loaded, the one this router's rank takes; `None` without
    /// a tie.
    fn take(&self, tied: &mut Tied) -> Option<usize> {
        let tied = tied.as_mut_slice();
        if tied.len() < 2 {
            return None;
        }
        tied.sort_unstable();
        Some(tied[self.rank as usize % tied.len()].1)
    }
}

/// Engines tied for the lowest score so far, with their keys (on the stack; past
/// [`MAX_SPLIT`] further ones are not kept).
struct Tied {
    items: [(u64, usize); MAX_SPLIT],
    len: usize,
}

impl Tied {
    fn new() -> Tied {
        Tied {
            items: [(0, 0); MAX_SPLIT],
            len: 0,
        }
    }

    #[inline]
    fn clear(&mut self) {
        self.len = 0;
    }

    #[inline]
    fn push(&mut self, key: u64, i: usize) {
        if self.len < MAX_SPLIT {
            self.items[self.len] = (key, i);
            self.len += 1;
        }
    }

    fn as_mut_slice(&mut self) -> &mut [(u64, usize)] {
        &mut self.items[..self.len]
    }
}

/// Most tied engines [`TieSplit`] orders (on the stack); ties past it are not considered.
const MAX_SPLIT: usize = 64;

/// `(load + 1) / weight`: in-flight requests per unit of weight, counting the new one (what
/// `least_request` and the power-of-two policies compare).
#[inline]
pub fn load_score(v: &EngineView) -> f64 {
    (f64::from(v.load()) + 1.0) / v.safe_weight()
}

/// `(load + own_bias × own + 1) / weight`: the rank of least request, where this router's own
/// requests (known at once) count `own_bias` more than its peers' (known late) — see
/// [`LeastRequestConfig::own_bias`].
#[inline]
fn least_score(v: &EngineView, own_bias: f64) -> f64 {
    load_score(v) + own_bias * f64::from(v.own_in_flight) / v.safe_weight()
}

/// `latency × (load + 1) / weight`: the Finagle/Linkerd peak-EWMA cost, per unit of weight.
#[inline]
pub(crate) fn latency_score(v: &EngineView) -> f64 {
    v.latency_us.max(1.0) * (f64::from(v.load()) + 1.0) / v.safe_weight()
}

/// Power of two choices: the better of two random engines first; then the worse one and
/// further random engines as fallbacks, best first. Ties keep the first drawn, which is random.
pub(crate) fn power_of_two<S: EngineSet + ?Sized>(
    engines: &S,
    rng: &mut Rng,
    filter: Filter,
    k: usize,
    score: fn(&EngineView) -> f64,
    out: &mut Vec<usize>,
) {
    let mut picks = Picks::new();
    sample(engines, rng, filter, k.max(2), &mut picks);
    let items = picks.as_mut_slice();
    if items.len() >= 2 && score(&items[1].1) < score(&items[0].1) {
        items.swap(0, 1);
    }
    if items.len() > 2 {
        // Fallbacks: sort by score (insertion sort, at most 8 items; stable, so ties keep
        // their random draw order).
        let rest = &mut items[1..];
        for a in 1..rest.len() {
            let mut b = a;
            while b > 0 && score(&rest[b].1) < score(&rest[b - 1].1) {
                rest.swap(b, b - 1);
                b -= 1;
            }
        }
    }
    for &(i, _) in items.iter().take(k) {
        out.push(i);
    }
}

/// Least request: the `k` engines of lowest `(load + own_bias × own + 1) / weight`; of
/// engines equal in that, the one holding fewer of this router's own requests first, then a
/// random key per engine and request (uniform among the tied, never toward index 0).
///
/// The own count as the first tie-break keeps each router's own share even across engines
/// equal in the sum: meshed routers that decide at the same moment on the same (partly late)
/// sum then mostly take different engines — a router whose own request just ended on an
/// engine sees its own count there lowest, and the peers' requests elsewhere. Alone, or
/// without a mesh, the own count is the whole count and changes no ranking.
///
/// Scans the whole fleet when it has at most `max_scan` engines, otherwise a window of
/// `max_scan` consecutive engines starting at a random position.
pub(crate) fn least_request<S: EngineSet + ?Sized>(
    engines: &S,
    rng: &mut Rng,
    seed: u64,
    filter: Filter,
    k: usize,
    lr: &Least<'_>,
    out: &mut Vec<usize>,
) {
    let best = least_request_best(engines, rng, seed, filter, k, lr);
    out.extend_from_slice(best.as_slice());
}

/// Fills `out` up to `k` with least-request engines not already in it (the fallbacks of the
/// cache-aware policies). Asking for the `k` best guarantees enough new ones: at most
/// `out.len()` of them can already be there.
pub(crate) fn fill_least_request<S: EngineSet + ?Sized>(
    engines: &S,
    rng: &mut Rng,
    seed: u64,
    filter: Filter,
    k: usize,
    lr: &Least<'_>,
    out: &mut Vec<usize>,
) {
    if out.len() >= k {
        return;
    }
    let best = least_request_best(engines, rng, seed, filter, k, lr);
    for &i in best.as_slice() {
        if out.len() < k && !out.contains(&i) {
            out.push(i);
        }
    }
}

/// The result of [`least_request_best`]: up to [`MAX_CANDIDATES`] engine indices, best first.
pub(crate) struct LeastBest {
    items: [usize; MAX_CANDIDATES],
    len: usize,
}

impl LeastBest {
    pub(crate) fn as_slice(&self) -> &[usize] {
        &self.items[..self.len]
    }
}

/// The `k` best engines of least request (see [`least_request`]), on the stack; with a
/// [`TieSplit`], the first is the tied engine this router's rank takes.
pub(crate) fn least_request_best<S: EngineSet + ?Sized>(
    engines: &S,
    rng: &mut Rng,
    seed: u64,
    filter: Filter,
    k: usize,
    lr: &Least<'_>,
) -> LeastBest {
    let (max_scan, own_bias) = (lr.cfg.max_scan, lr.cfg.own_bias());
    let n = engines.len();
    let k = k.clamp(1, MAX_CANDIDATES);
    let (start, len) = if n <= max_scan {
        (0, n)
    } else {
        (rng.below(n), max_scan)
    };
    let tie_seed = mix64(seed ^ 0x7E1E_B4EA);
    // Best k so far, sorted ascending by (score, tie).
    let mut best = [(f64::INFINITY, u64::MAX, usize::MAX); MAX_CANDIDATES];
    let mut have = 0usize;
    // The lowest (score, own) and the engines that have it, in the order the routers share
    // (kept only with a split, which needs two of them).
    let mut least = (f64::INFINITY, u32::MAX);
    let mut split = lr.split.map(|split| (split, Tied::new()));
    for j in 0..len {
        let i = if start + j < n {
            start + j
        } else {
            start + j - n
        };
        let v = engines.view(i);
        if !filter.ok(&v) {
            continue;
        }
        let s = least_score(&v, own_bias);
        let own = v.own_in_flight;
        if let Some((split, tied)) = split.as_mut()
            && (s, own) <= least
        {
            if (s, own) < least {
                least = (s, own);
                tied.clear();
            }
            tied.push(split.key(i), i);
        }
        // Equal scores: fewer of this router's own requests first, then at random (the key
        // is worked out only for an engine that may enter the best k).
        let tie = || {
            (u64::from(own) << 32)
                | (mix64(tie_seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 32)
        };
        if have == k {
            let worst = best[k - 1];
            if s > worst.0 {
                continue;
            }
            let tie = tie();
            if s == worst.0 && tie >= worst.1 {
                continue;
            }
            insert(&mut best, k, (s, tie, i));
        } else {
            let tie = tie();
            have += 1;
            insert(&mut best, have, (s, tie, i));
        }
    }
    if let Some((split, tied)) = split.as_mut()
        && let Some(i) = split.take(tied)
    {
        have = first(&mut best, have, k, i);
    }
    let mut r = LeastBest {
        items: [usize::MAX; MAX_CANDIDATES],
        len: have,
    };
    for (slot, &(_, _, i)) in r.items.iter_mut().zip(&best[..have]) {
        *slot = i;
    }
    r
}

/// Moves engine `i` to the front of `best[..have]` (inserting it, the last dropping off at
/// `k`, when it is not there); the new length.
fn first(best: &mut [(f64, u64, usize); MAX_CANDIDATES], have: usize, k: usize, i: usize) -> usize {
    let at = best[..have].iter().position(|b| b.2 == i);
    let (item, end, have) = match at {
        Some(p) => (best[p], p, have),
        None => ((best[0].0, 0, i), have.min(k - 1), (have + 1).min(k)),
    };
    best.copy_within(0..end, 1);
    best[0] = item;
    have
}

/// Inserts `item` into the sorted prefix `best[..len]`, dropping what falls off the end.
#[inline]
fn insert(best: &mut [(f64, u64, usize); MAX_CANDIDATES], len: usize, item: (f64, u64, usize)) {
    let mut p = len - 1;
    best[p] = item;
    while p > 0 && (best[p].0, best[p].1) < (best[p - 1].0, best[p - 1].1) {
        best.swap(p, p - 1);
        p -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn views(loads: &[u32]) -> Vec<EngineView> {
        loads
            .iter()
            .map(|&l| {
                let mut v = EngineView::new(1.0);
                v.in_flight = l;
                v
            })
            .collect()
    }

    /// The `k` engines least request ranks first, with the default config but `own_bias`.
    fn ranked(vs: &[EngineView], seed: u64, k: usize, own_bias: f64) -> Vec<usize> {
        let cfg = LeastRequestConfig {
            own_bias: Some(own_bias),
            ..LeastRequestConfig::default()
        };
        let mut out = Vec::new();
        least_request(
            vs,
            &mut Rng::new(seed),
            seed,
            Filter::Eligible,
            k,
            &Least {
                cfg: &cfg,
                split: None,
            },
            &mut out,
        );
        out
    }

    /// The `k` engines ranked first by the router of `rank` among `routers`, over engines of
    /// the given stable ids.
    fn ranked_at(vs: &[EngineView], ids: &[u64], rank: u32, routers: u32, k: usize) -> Vec<usize> {
        let members: Vec<EngineMember> = ids.iter().map(|&id| EngineMember::new(id)).collect();
        let split = TieSplit::new(RouterSlot { rank, routers }, &members);
        let cfg = LeastRequestConfig {
            own_bias: Some(0.0),
            ..LeastRequestConfig::default()
        };
        let lr = Least {
            cfg: &cfg,
            split: split.as_ref(),
        };
        let mut out = Vec::new();
        least_request(vs, &mut Rng::new(7), 7, Filter::Eligible, k, &lr, &mut out);
        out
    }

    #[test]
    fn routers_of_different_ranks_take_different_engines_of_a_tie() {
        // Engines 1, 2 and 3 tie; 4 is ineligible though idle.
        let mut vs = views(&[4, 2, 2, 2, 0, 6]);
        vs[4].eligible = false;
        let ids = [11, 22, 33, 44, 55, 66];
        for k in [1, 3, 8] {
            let firsts: Vec<usize> = (0..3).map(|r| ranked_at(&vs, &ids, r, 3, k)[0]).collect();
            let mut distinct = firsts.clone();
            distinct.sort_unstable();
            assert_eq!(distinct, [1, 2, 3], "k={k}: each rank its own tied engine");
            for r in 0..3 {
                let out = ranked_at(&vs, &ids, r, 3, k);
                let mut seen = out.clone();
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(seen.len(), out.len(), "k={k}: distinct candidates {out:?}");
                assert_eq!(out.len(), k.min(5), "k={k}: {out:?}");
                assert!(!out.contains(&4), "ineligible engine offered: {out:?}");
            }
        }
        // Two tied among three routers: two ranks must share one, but both are used.
        let vs = views(&[3, 1, 1, 3]);
        let mut firsts: Vec<usize> = (0..3).map(|r| ranked_at(&vs, &ids, r, 3, 1)[0]).collect();
        firsts.sort_unstable();
        firsts.dedup();
        assert_eq!(firsts, [1, 2]);
    }

    #[test]
    fn the_split_follows_engine_ids_not_positions() {
        // The same three tied engines, listed in another order by a second router.
        let a = views(&[1, 1, 1, 9]);
        let ids_a = [101, 202, 303, 404];
        let ids_b = [303, 101, 202, 404];
        for rank in 0..3 {
            let at_a = ids_a[ranked_at(&a, &ids_a, rank, 3, 1)[0]];
            let at_b = ids_b[ranked_at(&a, &ids_b, rank, 3, 1)[0]];
            assert_eq!(
                at_a, at_b,
                "rank {rank}: the same engine whatever the order"
            );
        }
    }

    #[test]
    fn without_a_tie_or_alone_the_split_changes_nothing() {
        let ids = [1, 2, 3, 4, 5];
        // A single least loaded engine: every rank takes it, fallbacks as without a split.
        let vs = views(&[5, 1, 3, 0, 2]);
        for rank in 0..4 {
            assert_eq!(ranked_at(&vs, &ids, rank, 4, 3), ranked(&vs, 7, 3, 0.0));
        }
        // Alone: ties broken at random, exactly as without a slot.
        let vs = views(&[2, 0, 0, 0, 0]);
        assert!(TieSplit::new(RouterSlot::ALONE, &[EngineMember::new(1)]).is_none());
        assert_eq!(ranked_at(&vs, &ids, 0, 1, 3), ranked(&vs, 7, 3, 0.0));
    }

    #[test]
    fn least_request_orders_by_load_and_skips_ineligible() {
        let mut vs = views(&[5, 1, 3, 0, 2]);
        vs[3].eligible = false;
        assert_eq!(ranked(&vs, 9, 3, 4.0), [1, 4, 2]);
    }

    #[test]
    fn least_request_weight_divides_load() {
        let mut vs = views(&[3, 1]);
        vs[0].weight = 8.0; // (3+1)/8 = 0.5 < (1+1)/1
        assert_eq!(ranked(&vs, 9, 2, 4.0), [0, 1]);
    }

    #[test]
    fn engine_reported_load_is_not_added_twice() {
        let mut v = EngineView::new(1.0);
        v.in_flight = 3;
        v.engine_load = Some(5);
        assert_eq!(v.load(), 5);
        v.engine_load = Some(1);
        assert_eq!(v.load(), 3);
    }

    /// Two routers with the same cluster counts but different own shares.
    fn router_views(own: &[u32], cluster: &[u32]) -> Vec<EngineView> {
        own.iter()
            .zip(cluster)
            .map(|(&o, &c)| {
                let mut v = EngineView::new(1.0);
                v.in_flight = c;
                v.own_in_flight = o;
                v
            })
            .collect()
    }

    fn first(vs: &[EngineView], own_bias: f64) -> usize {
        ranked(vs, 9, 1, own_bias)[0]
    }

    #[test]
    fn routers_on_the_same_late_sum_take_different_engines_by_their_own_share() {
        // Engine 1 is the least loaded in the sum both routers see (a slot just freed); A's
        // own requests are heavy on it, B's on engine 0. Without the bias both take engine 1;
        // with it each takes the engine where its own share is lowest.
        let cluster = [12, 11, 12, 12];
        let a = router_views(&[3, 5, 4, 4], &cluster);
        let b = router_views(&[5, 3, 4, 4], &cluster);
        assert_eq!((first(&a, 0.0), first(&b, 0.0)), (1, 1));
        assert_eq!(first(&a, 4.0), 0);
        assert_eq!(first(&b, 4.0), 1);
    }

    #[test]
    fn of_engines_equal_in_the_sum_the_one_with_fewer_of_its_own_goes_first() {
        // Engines 1 and 2 tie for least loaded in the sum (a slot freed on each, say by a
        // different router). A holds fewer of its own on engine 2, B on engine 1: each takes
        // that one, whatever its rank in the split, and the split keeps deciding between
        // engines equal in both.
        let cluster = [12, 11, 11, 12];
        let a = router_views(&[3, 5, 2, 4], &cluster);
        let b = router_views(&[3, 2, 5, 4], &cluster);
        let ids = [11, 22, 33, 44];
        for rank in 0..3 {
            assert_eq!(ranked_at(&a, &ids, rank, 3, 1), [2], "A at rank {rank}");
            assert_eq!(ranked_at(&b, &ids, rank, 3, 1), [1], "B at rank {rank}");
            assert_eq!(
                ranked_at(&a, &ids, rank, 3, 4)[1],
                1,
                "then the other tied one"
            );
        }
        assert_eq!(first(&a, 0.0), 2);
        // A difference of one in the sum still wins over the own count (the bias 0).
        let c = router_views(&[9, 0, 0, 0], &[11, 12, 12, 12]);
        assert_eq!(first(&c, 0.0), 0);
        // Equal in both: the split's ranks take different engines, as before.
        let d = router_views(&[2, 2, 2, 2], &[11, 11, 11, 12]);
        let mut firsts: Vec<usize> = (0..3).map(|r| ranked_at(&d, &ids, r, 3, 1)[0]).collect();
        firsts.sort_unstable();
        assert_eq!(firsts, [0, 1, 2]);
    }

    #[test]
    fn the_bias_yields_to_a_large_difference_in_the_sum() {
        // Engine 0 holds 20 more requests than engine 1 (a peer's or unknown clients'): an own
        // request more on engine 1 counts 1 + 4, less than that difference.
        let a = router_views(&[0, 1], &[30, 10]);
        assert_eq!(first(&a, 4.0), 1);
        assert_eq!(first(&a, 1000.0), 0);
    }

    #[test]
    fn alone_the_bias_changes_no_ranking() {
        // All in flight is this router's own: (1 + bias) × load + 1 orders as load + 1.
        let loads = [5, 1, 3, 0, 2, 2];
        let alone = router_views(&loads, &loads);
        for seed in 0..50 {
            let (a, b) = (ranked(&alone, seed, 6, 0.0), ranked(&alone, seed, 6, 4.0));
            assert_eq!(a, b, "seed {seed}");
        }
    }
}
