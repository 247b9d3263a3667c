//! Load- and latency-aware policies: `least_request`, `power_of_two`, `peak_ewma`.

use super::{Filter, Picks, sample};
use crate::config::{LeastRequestConfig, MAX_CANDIDATES};
use crate::rng::{Rng, mix64};
use crate::view::{EngineSet, EngineView};

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

/// Least request: the `k` engines of lowest `(load + own_bias × own + 1) / weight`, ties
/// broken by a random key per engine and request (uniform among the tied, never toward index
/// 0).
///
/// Scans the whole fleet when it has at most `max_scan` engines, otherwise a window of
/// `max_scan` consecutive engines starting at a random position.
pub(crate) fn least_request<S: EngineSet + ?Sized>(
    engines: &S,
    rng: &mut Rng,
    seed: u64,
    filter: Filter,
    k: usize,
    cfg: &LeastRequestConfig,
    out: &mut Vec<usize>,
) {
    let best = least_request_best(engines, rng, seed, filter, k, cfg);
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
    cfg: &LeastRequestConfig,
    out: &mut Vec<usize>,
) {
    if out.len() >= k {
        return;
    }
    let best = least_request_best(engines, rng, seed, filter, k, cfg);
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

/// The `k` best engines of least request (see [`least_request`]), on the stack.
pub(crate) fn least_request_best<S: EngineSet + ?Sized>(
    engines: &S,
    rng: &mut Rng,
    seed: u64,
    filter: Filter,
    k: usize,
    cfg: &LeastRequestConfig,
) -> LeastBest {
    let (max_scan, own_bias) = (cfg.max_scan, cfg.own_bias());
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
        if have == k {
            let worst = best[k - 1];
            if s > worst.0 {
                continue;
            }
            let tie = mix64(tie_seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            if s == worst.0 && tie >= worst.1 {
                continue;
            }
            insert(&mut best, k, (s, tie, i));
        } else {
            let tie = mix64(tie_seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            have += 1;
            insert(&mut best, have, (s, tie, i));
        }
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
            &cfg,
            &mut out,
        );
        out
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
