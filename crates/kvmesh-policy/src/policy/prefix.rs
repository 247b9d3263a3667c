//! Prefix affinity: `cache_aware` and `precise` (one algorithm; they differ only in where the
//! gateway gets the matches from), and the load guard they share with `scored`.

use super::Filter;
use super::load::{Least, fill_least_request, load_score};
use crate::config::{MAX_CANDIDATES, PrefixAffinityConfig};
use crate::rng::{Rng, mix64};
use crate::view::{EngineMember, EngineSet, EngineView, PrefixInput, Reason};

/// Salt of the per-engine random tie keys of the cache-aware policies.
const TIE_SALT: u64 = 0xCAC4_E7E1_E5A1_7000;

/// The random tie key of engine `i` for a request (uniform among tied engines, never toward
/// index 0).
#[inline]
pub(crate) fn tie_key(tie_seed: u64, i: usize) -> u64 {
    mix64(tie_seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The per-request tie seed.
#[inline]
pub(crate) fn tie_seed(seed: u64) -> u64 {
    mix64(seed ^ TIE_SALT)
}

/// The load guard: an engine is overloaded iff `load + 1 > max(abs, rel × mean_after × w /
/// mean_w)`, i.e. `load + 1 > abs && load + 1 > rel × (Σ load + 1) / Σ weight × w`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guard {
    abs: f64,
    /// `rel × (Σ load + 1) / Σ weight`: the bound per unit of weight; 0 when there is no mean
    /// (no eligible engine: panic mode), so only the absolute floor applies.
    per_weight: f64,
}

impl Guard {
    /// Reads the fleet totals once ([`EngineSet::totals`]).
    pub(crate) fn new<S: EngineSet + ?Sized>(engines: &S, cfg: &PrefixAffinityConfig) -> Self {
        let t = engines.totals();
        let per_weight = if t.eligible > 0 && t.weight > 0.0 && t.weight.is_finite() {
            cfg.balance_rel_threshold * (t.load as f64 + 1.0) / t.weight
        } else {
            0.0
        };
        Guard {
            abs: f64::from(cfg.balance_abs_threshold),
            per_weight: if per_weight.is_finite() {
                per_weight
            } else {
                0.0
            },
        }
    }

    /// True when sending one more request would overload `v`.
    #[inline]
    pub(crate) fn overloaded(&self, v: &EngineView) -> bool {
        let after = f64::from(v.load()) + 1.0;
        after > self.abs && after > self.per_weight * v.safe_weight()
    }
}

/// Up to [`MAX_CANDIDATES`] distinct engines, kept sorted ascending by `(a, b, tie)`; inserting
/// an engine already present keeps its better entry.
pub(crate) struct TopK {
    items: [(f64, f64, u64, usize); MAX_CANDIDATES],
    len: usize,
    cap: usize,
}

impl TopK {
    pub(crate) fn new(cap: usize) -> Self {
        TopK {
            items: [(f64::INFINITY, f64::INFINITY, u64::MAX, usize::MAX); MAX_CANDIDATES],
            len: 0,
            cap: cap.clamp(1, MAX_CANDIDATES),
        }
    }

    #[inline]
    fn less(x: &(f64, f64, u64, usize), y: &(f64, f64, u64, usize)) -> bool {
        (x.0, x.1, x.2) < (y.0, y.1, y.2)
    }

    /// Offers engine `i` with key `(a, b, tie)` (lower is better).
    #[cfg(test)]
    pub(crate) fn offer(&mut self, a: f64, b: f64, tie: u64, i: usize) {
        self.offer_with(a, b, i, || tie);
    }

    /// Like [`offer`](Self::offer), computing the tie key only when the entry would
    /// otherwise be compared on it or kept (most entries of a scan lose on `(a, b)`).
    #[inline]
    pub(crate) fn offer_with(&mut self, a: f64, b: f64, i: usize, tie: impl FnOnce() -> u64) {
        if self.len == self.cap {
            let w = &self.items[self.len - 1];
            if (a, b) > (w.0, w.1) {
                return;
            }
        }
        self.insert((a, b, tie(), i));
    }

    #[inline(never)]
    fn insert(&mut self, item: (f64, f64, u64, usize)) {
        let i = item.3;
        if self.len == self.cap && !Self::less(&item, &self.items[self.len - 1]) {
            return;
        }
        // An engine listed twice (or matched and scanned): keep its better entry.
        if let Some(p) = self.items[..self.len].iter().position(|x| x.3 == i) {
            if !Self::less(&item, &self.items[p]) {
                return;
            }
            self.items.copy_within(p + 1..self.len, p);
            self.len -= 1;
        }
        let mut p = if self.len < self.cap {
            self.len += 1;
            self.len - 1
        } else {
            self.cap - 1
        };
        self.items[p] = item;
        while p > 0 && Self::less(&self.items[p], &self.items[p - 1]) {
            self.items.swap(p, p - 1);
            p -= 1;
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Engine indices, best first.
    pub(crate) fn engines(&self) -> impl Iterator<Item = usize> + '_ {
        self.items[..self.len].iter().map(|x| x.3)
    }
}

/// `cache_aware` / `precise`.
///
/// `need = max(min_match_blocks, ceil(min_match_ratio × total_blocks))`. Among matched engines
/// passing `filter`, not overloaded, holding at least `need` blocks: the most blocks, then the
/// lower `(load + 1) / weight`, then a random key. Fallbacks: the other usable matched
/// engines in that order, then least-request engines. With no usable match, least request,
/// [`Reason::PrefixOverloaded`] if a holder of `need` blocks was only excluded by the guard;
/// a cold prompt (no holder at all) goes to its rendezvous home ([`Reason::PrefixCold`],
/// `cold_prefix_rendezvous`), else least request ([`Reason::PrefixNone`]). O(matches +
/// min(n, max_scan)); the scan happens only when the matched engines do not fill the `k`
/// candidates.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cache_aware<S: EngineSet + ?Sized>(
    engines: &S,
    members: &[EngineMember],
    prefix: &PrefixInput<'_>,
    cfg: &PrefixAffinityConfig,
    rng: &mut Rng,
    seed: u64,
    filter: Filter,
    k: usize,
    lr: &Least<'_>,
    out: &mut Vec<usize>,
) -> Reason {
    let n = engines.len();
    let total = prefix.total_blocks;
    let need = min_blocks(cfg, total);
    let ties = tie_seed(seed);
    let mut guard: Option<Guard> = None;
    let mut top = TopK::new(k);
    let mut overloaded = false;
    for m in prefix.matches {
        let i = m.engine as usize;
        let blocks = m.blocks.min(total);
        if i >= n || blocks < need {
            continue;
        }
        let v = engines.view(i);
        if !filter.ok(&v) {
            continue;
        }
        // The fleet totals (a scan) are read only when an engine is above the absolute
        // floor: below it no engine is overloaded whatever the mean.
        if f64::from(v.load()) + 1.0 > f64::from(cfg.balance_abs_threshold)
            && guard
                .get_or_insert_with(|| Guard::new(engines, cfg))
                .overloaded(&v)
        {
            overloaded = true;
            continue;
        }
        top.offer_with(-f64::from(blocks), load_score(&v), i, || tie_key(ties, i));
    }
    let reason = if top.is_empty() {
        if overloaded {
            Reason::PrefixOverloaded
        } else if prefix.cold_key != 0
            && cfg.cold_prefix_rendezvous
            && let Some(i) = cold_home(engines, members, prefix.cold_key, cfg, filter, &mut guard)
        {
            out.push(i);
            Reason::PrefixCold
        } else {
            Reason::PrefixNone
        }
    } else {
        Reason::PrefixMatch
    };
    out.extend(top.engines());
    fill_least_request(engines, rng, seed, filter, k, lr, out);
    reason
}

/// The home of a cold prefix (no engine holds a usable part of it): of the engines passing
/// `filter` and the load guard whose `(in_flight + 1) / weight` is within `cold_prefix_slack`
/// of the least of them, the one weighted rendezvous hashing of `cold_key` ranks first (by
/// their stable ids). Routers whose views agree within the slack pick the same engine without
/// talking, so siblings of a new prefix that arrive at several routers at once land together;
/// and new prefixes spread over the least loaded engines as one router's least request
/// spreads them, rather than by hash alone. The views are the routers' in-flight counts,
/// which the mesh shares within a fraction of a millisecond and delivers no earlier than the
/// marks before them (so a sibling's own load does not part siblings), not the
/// engine-reported load, which each router scrapes at its own moments (reading it parted
/// siblings under load). A burst of other new prefixes placed at several routers at once can
/// still part them. O(n) in the route's engines, two passes (only for cold prompts).
fn cold_home<S: EngineSet + ?Sized>(
    engines: &S,
    members: &[EngineMember],
    cold_key: u64,
    cfg: &PrefixAffinityConfig,
    filter: Filter,
    guard: &mut Option<Guard>,
) -> Option<usize> {
    let n = engines.len().min(members.len());
    let mut usable = |v: &EngineView| {
        filter.ok(v)
            && !(f64::from(v.load()) + 1.0 > f64::from(cfg.balance_abs_threshold)
                && guard
                    .get_or_insert_with(|| Guard::new(engines, cfg))
                    .overloaded(v))
    };
    let shared = |v: &EngineView| (f64::from(v.in_flight) + 1.0) / v.safe_weight();
    let mut least = f64::INFINITY;
    for i in 0..n {
        let v = engines.view(i);
        if usable(&v) {
            least = least.min(shared(&v));
        }
    }
    let slack = if cfg.cold_prefix_slack.is_finite() {
        cfg.cold_prefix_slack.max(0.0)
    } else {
        f64::MAX
    };
    // (rendezvous score, hash, engine): the lowest score among the least loaded.
    let mut best: Option<(f64, u64, usize)> = None;
    for (i, m) in members.iter().enumerate().take(n) {
        let v = engines.view(i);
        if shared(&v) > least + slack || !usable(&v) {
            continue;
        }
        let h = mix64(cold_key ^ m.id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        // Weighted rendezvous: −ln(u) / w, the lowest wins; (0, 1] so ln is finite.
        let u = ((h >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let score = -u.ln() / v.safe_weight();
        if best.is_none_or(|b| (score, h) < (b.0, b.1)) {
            best = Some((score, h, i));
        }
    }
    best.map(|b| b.2)
}

/// The smallest usable match: `max(min_match_blocks, ceil(min_match_ratio × total))`, at
/// least 1 (a small epsilon keeps `0.3 × 10` at 3 despite rounding).
#[inline]
pub(crate) fn min_blocks(cfg: &PrefixAffinityConfig, total: u32) -> u32 {
    let ratio = if cfg.min_match_ratio.is_finite() {
        cfg.min_match_ratio.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let by_ratio = (ratio * f64::from(total) - 1e-9).ceil().max(0.0) as u32;
    cfg.min_match_blocks.max(by_ratio).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_the_best_distinct_engines() {
        let mut t = TopK::new(3);
        t.offer(1.0, 0.0, 5, 10);
        t.offer(0.0, 0.0, 5, 11);
        t.offer(2.0, 0.0, 5, 12);
        t.offer(1.5, 0.0, 5, 13); // evicts 12
        t.offer(0.5, 0.0, 5, 13); // better entry for 13
        t.offer(3.0, 0.0, 5, 11); // worse entry for 11: ignored
        assert_eq!(t.engines().collect::<Vec<_>>(), [11, 13, 10]);
        t.offer(-1.0, 0.0, 5, 10); // moves 10 to the front
        assert_eq!(t.engines().collect::<Vec<_>>(), [10, 11, 13]);
    }

    #[test]
    fn minimum_match_rounds_up_exactly() {
        let cfg = PrefixAffinityConfig::default();
        assert_eq!(min_blocks(&cfg, 10), 3);
        assert_eq!(min_blocks(&cfg, 11), 4);
        assert_eq!(min_blocks(&cfg, 1), 1);
        assert_eq!(min_blocks(&cfg, 0), 1);
        let cfg = PrefixAffinityConfig {
            min_match_blocks: 8,
            ..cfg
        };
        assert_eq!(min_blocks(&cfg, 10), 8);
    }
}
