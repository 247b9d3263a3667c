//! Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018) on a ring of
//! virtual nodes, by configured weights, thinned by errors.
//!
//! * **Ring.** Each engine owns `virtual_nodes × base_weight` points derived from its stable
//!   id alone, so adding or removing one engine moves only the keys of that engine (≈ 1/N).
//! * **Bounded loads.** A key goes to the first engine clockwise whose load is below
//!   `ceil((1 + ε) × (L + 1) × w / W)` (L, W: total load and configured weight of the
//!   eligible engines, w the engine's, the `+ 1` counting this request). Some engine is always
//!   below its bound, so no engine ever exceeds it while the walk finds one.
//! * **Configured weights.** The ring and the bounds use each engine's configured weight,
//!   the cluster's record of it, never this router's effective weight (its latency estimates,
//!   its own slow-start clock): those differ from router to router and move with every
//!   estimate, and a key must go to the same engine through every router and stay there.
//!   (Thinning an engine's points by its effective weight, as this module did before, sent
//!   7–10 of 40 sessions to another engine through another router, and moved 7 of 40 on one
//!   router between two passes: QA.) Envoy's ring hash likewise takes host weights, and its
//!   slow start applies to round robin and least request only.
//! * **Thinning by errors.** An engine failing its requests ([`EngineView::error_factor`]
//!   below 1: 1 for every engine that answers, so healthy engines never move) keeps each of its
//!   points with probability `error_factor`, decided by a hash of the point: the same for
//!   every request, the same on routers that see the same error rate, and monotone (as it
//!   recovers, its keys come back and no other key moves). That is how an engine failing
//!   every request stops receiving its keys even with breakers off.

use super::Filter;
use crate::config::MAX_CANDIDATES;
use crate::rng::{mix64, unit_f64};
use crate::view::{EngineMember, EngineSet, Reason};

/// At most this many ring points are visited per decision.
const WALK_LIMIT: usize = 512;
/// The ring never holds more points than this (memory ≈ 12 bytes per point).
const MAX_POINTS: usize = 1 << 20;

/// The sorted ring: `points[j]` is owned by engine `owners[j]`.
#[derive(Debug)]
pub(crate) struct Ring {
    points: Vec<u64>,
    owners: Vec<u32>,
}

impl Ring {
    pub(crate) fn new(members: &[EngineMember], virtual_nodes: u32) -> Self {
        let n = members.len();
        if n == 0 {
            return Ring {
                points: Vec::new(),
                owners: Vec::new(),
            };
        }
        let mean_w = members.iter().map(|m| m.base_weight.max(1e-9)).sum::<f64>() / n as f64;
        let mut want: Vec<f64> = members
            .iter()
            .map(|m| f64::from(virtual_nodes.max(1)) * m.base_weight.max(1e-9) / mean_w)
            .collect();
        let total: f64 = want.iter().sum();
        if total > MAX_POINTS as f64 {
            let scale = MAX_POINTS as f64 / total;
            want.iter_mut().for_each(|w| *w *= scale);
        }
        let mut ring: Vec<(u64, u32)> = Vec::with_capacity(total.min(MAX_POINTS as f64) as usize);
        for (i, m) in members.iter().enumerate() {
            let count = (want[i].round() as u64).max(1);
            for v in 0..count {
                ring.push((vnode_point(m.id, v), i as u32));
            }
        }
        ring.sort_unstable();
        Ring {
            points: ring.iter().map(|p| p.0).collect(),
            owners: ring.iter().map(|p| p.1).collect(),
        }
    }

    /// Walks clockwise from `key`, writing up to `k` distinct candidates: engines that pass the
    /// filter, survive thinning by errors and are below their load bound. Engines that passed everything
    /// but the bound are appended, least relatively loaded first, if the walk found too few.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pick<S: EngineSet + ?Sized>(
        &self,
        engines: &S,
        members: &[EngineMember],
        key: u64,
        eps: f64,
        filter: Filter,
        k: usize,
        out: &mut Vec<usize>,
    ) -> Reason {
        let len = self.points.len();
        if len == 0 {
            return Reason::Hash;
        }
        let n = engines.len().min(members.len());
        let totals = engines.totals();
        // In panic mode (no eligible engine) there is no meaningful bound.
        let bounded = filter == Filter::Eligible && totals.eligible > 0 && totals.base_weight > 0.0;
        let scale = (1.0 + eps) * (totals.load as f64 + 1.0) / totals.base_weight.max(1e-9);
        let mut spilled = false;
        let mut over = [(f64::INFINITY, usize::MAX); MAX_CANDIDATES];
        let mut nover = 0;
        let mut pos = self.points.partition_point(|&p| p < key);
        for _ in 0..len.min(WALK_LIMIT) {
            if pos == len {
                pos = 0;
            }
            let point = self.points[pos];
            let idx = self.owners[pos] as usize;
            pos += 1;
            if idx >= n || out.contains(&idx) {
                continue;
            }
            let v = engines.view(idx);
            if !filter.ok(&v) {
                spilled |= out.is_empty();
                continue;
            }
            let factor = v.error_factor;
            if factor < 1.0 && unit_f64(mix64(point ^ 0x7417_AA11)) >= factor {
                continue;
            }
            if bounded {
                let cap = (scale * v.base_weight.max(1e-9)).ceil();
                let load = f64::from(v.load());
                if load + 1.0 > cap {
                    spilled |= out.is_empty();
                    let rel = (load + 1.0) / cap.max(1.0);
                    if nover < MAX_CANDIDATES && !over[..nover].iter().any(|o| o.1 == idx) {
                        over[nover] = (rel, idx);
                        nover += 1;
                    }
                    continue;
                }
            }
            out.push(idx);
            if out.len() >= k {
                break;
            }
        }
        if out.len() < k && nover > 0 {
            over[..nover].sort_by(|a, b| a.0.total_cmp(&b.0));
            for &(_, idx) in &over[..nover] {
                if out.len() < k {
                    out.push(idx);
                }
            }
        }
        if spilled {
            Reason::HashOverflow
        } else {
            Reason::Hash
        }
    }
}

/// Position of virtual node `v` of the engine with stable id `id` (fixed forever).
#[inline]
fn vnode_point(id: u64, v: u64) -> u64 {
    mix64(id ^ mix64(v.wrapping_add(0x4B1D_0000_0000_0001)))
}
