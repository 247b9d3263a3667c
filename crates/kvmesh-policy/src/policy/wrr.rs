//! Smooth weighted round robin as earliest-deadline-first scheduling (what Envoy does).
//!
//! Each engine has a virtual deadline; a pick takes the earliest eligible one and pushes its
//! deadline forward by `1 / weight`, reading the weight at that moment (so automatic weights
//! and slow start apply from the engine's next turn). Over any window an engine gets picks in
//! proportion to its weight, spread evenly (weights 5:1:1 give `A A B A C A A …`, not
//! `A A A A A B C`), at O(log n) per pick instead of nginx's O(n).

use super::Filter;
use crate::config::MAX_CANDIDATES;
use crate::rng::Rng;
use crate::view::{EngineMember, EngineSet};

#[derive(Debug, Clone, Copy)]
struct Entry {
    deadline: f64,
    tie: u32,
    idx: u32,
}

impl Entry {
    #[inline]
    fn before(&self, other: &Entry) -> bool {
        (self.deadline, self.tie) < (other.deadline, other.tie)
    }
}

/// The EDF schedule: a binary min-heap of deadlines.
#[derive(Debug)]
pub(crate) struct Edf {
    heap: Vec<Entry>,
    /// Virtual time: the deadline of the last engine picked.
    vt: f64,
}

impl Edf {
    /// Engines start at a random phase within their first period, so replicas of the router
    /// do not all begin with the same engine.
    pub(crate) fn new(members: &[EngineMember], rng: &mut Rng) -> Self {
        let mut edf = Edf {
            heap: Vec::with_capacity(members.len()),
            vt: 0.0,
        };
        for (i, m) in members.iter().enumerate() {
            let w = if m.base_weight > 1e-9 {
                m.base_weight
            } else {
                1e-9
            };
            edf.push(Entry {
                deadline: rng.unit() / w,
                tie: rng.next_u64() as u32,
                idx: i as u32,
            });
        }
        edf
    }

    /// Writes up to `k` candidates: the earliest-deadline engine passing `filter` (its turn is
    /// taken), then the next ones in deadline order (their turns are kept).
    pub(crate) fn pick<S: EngineSet + ?Sized>(
        &mut self,
        engines: &S,
        filter: Filter,
        k: usize,
        out: &mut Vec<usize>,
    ) {
        let n = engines.len();
        let k = k.min(MAX_CANDIDATES);
        let mut held = [(
            Entry {
                deadline: 0.0,
                tie: 0,
                idx: 0,
            },
            1.0f64,
        ); MAX_CANDIDATES];
        let mut nheld = 0;
        for _ in 0..self.heap.len() {
            let Some(mut e) = self.pop() else { break };
            let idx = e.idx as usize;
            let view = (idx < n).then(|| engines.view(idx));
            match view {
                Some(v) if filter.ok(&v) => {
                    held[nheld] = (e, v.safe_weight());
                    nheld += 1;
                    out.push(idx);
                    if nheld == k {
                        break;
                    }
                }
                _ => {
                    // Skipped engines lose this turn.
                    let w = view.map_or(1.0, |v| v.safe_weight());
                    e.deadline = e.deadline.max(self.vt) + 1.0 / w;
                    self.push(e);
                }
            }
        }
        for (j, &(mut e, w)) in held[..nheld].iter().enumerate() {
            if j == 0 {
                self.vt = e.deadline;
                e.deadline += 1.0 / w;
            }
            self.push(e);
        }
        if nheld < k && nheld < n {
            self.scan_fill(engines, filter, k, out);
        }
        if self.vt > 1e12 {
            self.rebase();
        }
    }

    /// Slow path when popping did not find enough (engines that keep coming back early were
    /// skipped): the eligible entries of earliest deadline, by a scan.
    fn scan_fill<S: EngineSet + ?Sized>(
        &mut self,
        engines: &S,
        filter: Filter,
        k: usize,
        out: &mut Vec<usize>,
    ) {
        let n = engines.len();
        let first_missing = out.is_empty();
        while out.len() < k {
            let mut best: Option<usize> = None;
            for (p, e) in self.heap.iter().enumerate() {
                let idx = e.idx as usize;
                if idx >= n || out.contains(&idx) || !filter.ok(&engines.view(idx)) {
                    continue;
                }
                if best.is_none_or(|b| e.before(&self.heap[b])) {
                    best = Some(p);
                }
            }
            let Some(p) = best else { break };
            out.push(self.heap[p].idx as usize);
            if first_missing && out.len() == 1 {
                let w = engines.view(self.heap[p].idx as usize).safe_weight();
                self.vt = self.vt.max(self.heap[p].deadline);
                self.heap[p].deadline = self.vt + 1.0 / w;
                self.sift_down(p);
            }
        }
    }

    /// Subtracts the virtual time from every deadline (keeps f64 precision forever).
    fn rebase(&mut self) {
        let vt = self.vt;
        for e in &mut self.heap {
            e.deadline -= vt;
        }
        self.vt = 0.0;
    }

    fn push(&mut self, e: Entry) {
        self.heap.push(e);
        let mut c = self.heap.len() - 1;
        while c > 0 {
            let p = (c - 1) / 2;
            if self.heap[c].before(&self.heap[p]) {
                self.heap.swap(c, p);
                c = p;
            } else {
                break;
            }
        }
    }

    fn pop(&mut self) -> Option<Entry> {
        if self.heap.is_empty() {
            return None;
        }
        let last = self.heap.len() - 1;
        self.heap.swap(0, last);
        let e = self.heap.pop();
        self.sift_down(0);
        e
    }

    fn sift_down(&mut self, mut p: usize) {
        let len = self.heap.len();
        loop {
            let l = 2 * p + 1;
            if l >= len {
                break;
            }
            let r = l + 1;
            let c = if r < len && self.heap[r].before(&self.heap[l]) {
                r
            } else {
                l
            };
            if self.heap[c].before(&self.heap[p]) {
                self.heap.swap(c, p);
                p = c;
            } else {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::EngineView;

    #[test]
    fn weights_5_1_1_are_interleaved() {
        let members = [
            EngineMember::new(1),
            EngineMember::new(2),
            EngineMember::new(3),
        ];
        let mut edf = Edf::new(&members, &mut Rng::new(1));
        let mut views = vec![EngineView::new(1.0); 3];
        views[0].weight = 5.0;
        let mut seq = Vec::new();
        let mut out = Vec::new();
        for _ in 0..70 {
            out.clear();
            edf.pick(&views, Filter::Eligible, 1, &mut out);
            seq.push(out[0]);
        }
        // After the first cycle, every window of 7 holds 5 of engine 0.
        for w in seq[7..].windows(7) {
            let a = w.iter().filter(|&&i| i == 0).count();
            assert!((4..=6).contains(&a), "{seq:?}");
        }
        // Never more than 3 picks of engine 0 in a row.
        assert!(
            !seq.windows(4).any(|w| w.iter().all(|&i| i == 0)),
            "{seq:?}"
        );
    }

    #[test]
    fn ineligible_with_short_period_does_not_hide_an_eligible_one() {
        let members = [EngineMember::new(1), EngineMember::new(2)];
        let mut edf = Edf::new(&members, &mut Rng::new(2));
        let mut views = vec![EngineView::new(1000.0), EngineView::new(0.001)];
        views[0].eligible = false;
        for _ in 0..10 {
            let mut out = Vec::new();
            edf.pick(&views, Filter::Eligible, 2, &mut out);
            assert_eq!(out, [1]);
        }
    }
}
