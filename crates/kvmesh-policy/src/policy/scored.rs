//! `scored`: a weighted sum of prefix match, queue, KV utilisation, in-flight load and latency
//! (llm-d's scorer chain), over the matched engines and a least-request-style window.

use super::Filter;
use super::prefix::{Guard, TopK, tie_key, tie_seed};
use crate::config::{PrefixAffinityConfig, ScoredConfig};
use crate::rng::Rng;
use crate::view::{EngineSet, EngineView, PrefixInput};

/// A weight as used: finite and positive, else 0 (`Policy::new` does not validate).
#[inline]
fn weight(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 { x } else { 0.0 }
}

/// The engine's signals as the score reads them, sanitised (unknown → 0).
#[derive(Clone, Copy)]
struct Signals {
    waiting: f64,
    kv: f64,
    load_per_weight: f64,
    latency: f64,
}

impl Signals {
    #[inline]
    fn of(v: &EngineView) -> Self {
        let kv = match v.kv_usage {
            Some(x) if x.is_finite() => f64::from(x).clamp(0.0, 1.0),
            _ => 0.0,
        };
        let latency = if v.latency_us.is_finite() && v.latency_us > 0.0 {
            v.latency_us
        } else {
            0.0
        };
        Signals {
            waiting: f64::from(v.waiting.unwrap_or(0)),
            kv,
            load_per_weight: f64::from(v.load()) / v.safe_weight(),
            latency,
        }
    }
}

/// Visits every considered engine passing `filter`: first the matched ones (with their blocks,
/// capped at `total`), then the window `start..start + len` (mod n) with 0 blocks. An engine
/// may be visited more than once (listed twice, or matched and in the window); the callers
/// take maxima and keep the best entry per engine, so that is harmless.
#[inline]
fn visit<S: EngineSet + ?Sized>(
    engines: &S,
    prefix: &PrefixInput<'_>,
    filter: Filter,
    start: usize,
    len: usize,
    mut f: impl FnMut(usize, &EngineView, u32),
) {
    let n = engines.len();
    for m in prefix.matches {
        let i = m.engine as usize;
        if i >= n || m.blocks == 0 {
            continue;
        }
        let v = engines.view(i);
        if filter.ok(&v) {
            f(i, &v, m.blocks.min(prefix.total_blocks));
        }
    }
    for j in 0..len {
        let i = if start + j < n {
            start + j
        } else {
            start + j - n
        };
        let v = engines.view(i);
        if filter.ok(&v) {
            f(i, &v, 0);
        }
    }
}

/// `scored` with prefix input (`total_blocks > 0`).
///
/// `score = w.prefix × blocks / total − w.queue × waiting / max_waiting − w.kv_usage × kv_usage
/// − w.in_flight × (load / weight) / max(load / weight) − w.latency × latency / max_latency`,
/// the maxima over the considered engines (a term whose maximum is 0 contributes 0). Engines
/// over the load guard rank after every other (so they are chosen only when all considered
/// engines are overloaded); then the highest score; exact ties by a random key per engine.
/// Two passes over O(matches + min(n, max_scan)) engines (maxima, then scores).
#[allow(clippy::too_many_arguments)]
pub(crate) fn scored<S: EngineSet + ?Sized>(
    engines: &S,
    prefix: &PrefixInput<'_>,
    guard_cfg: &PrefixAffinityConfig,
    w: &ScoredConfig,
    rng: &mut Rng,
    seed: u64,
    filter: Filter,
    k: usize,
    max_scan: usize,
    out: &mut Vec<usize>,
) {
    let n = engines.len();
    let total = f64::from(prefix.total_blocks.max(1));
    let (start, len) = if n <= max_scan {
        (0, n)
    } else {
        (rng.below(n), max_scan)
    };
    let (wp, wq, wk, wi, wl) = (
        weight(w.prefix),
        weight(w.queue),
        weight(w.kv_usage),
        weight(w.in_flight),
        weight(w.latency),
    );

    // Pass 1: the maxima over the considered engines.
    let (mut max_wait, mut max_lpw, mut max_lat) = (0.0f64, 0.0f64, 0.0f64);
    let mut max_load = 0u32;
    visit(engines, prefix, filter, start, len, |_, v, _| {
        let s = Signals::of(v);
        max_load = max_load.max(v.load());
        // Signals are finite and ≥ 0: plain comparisons, no NaN handling.
        if s.waiting > max_wait {
            max_wait = s.waiting;
        }
        if s.load_per_weight > max_lpw {
            max_lpw = s.load_per_weight;
        }
        if s.latency > max_lat {
            max_lat = s.latency;
        }
    });
    // Scale factors: 0 for a term whose maximum is 0 (or whose weight is).
    let scale = |w: f64, max: f64| if max > 0.0 { w / max } else { 0.0 };
    let (sq, si, sl) = (scale(wq, max_wait), scale(wi, max_lpw), scale(wl, max_lat));
    let sp = wp / total;

    // Pass 2: scores, overloaded engines last.
    // The fleet totals (a scan of every engine) only when some considered engine is above the
    // guard's absolute floor: below it none is overloaded whatever the mean.
    let guard = (u64::from(max_load) + 1 > u64::from(guard_cfg.balance_abs_threshold))
        .then(|| Guard::new(engines, guard_cfg));
    let ties = tie_seed(seed);
    let mut top = TopK::new(k);
    visit(engines, prefix, filter, start, len, |i, v, blocks| {
        let s = Signals::of(v);
        let score = sp * f64::from(blocks)
            - sq * s.waiting
            - wk * s.kv
            - si * s.load_per_weight
            - sl * s.latency;
        let over = if guard.as_ref().is_some_and(|g| g.overloaded(v)) {
            1.0
        } else {
            0.0
        };
        top.offer_with(over, -score, i, || tie_key(ties, i));
    });
    out.extend(top.engines());
}
