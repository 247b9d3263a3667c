//! The registry's causal context: every dot a router has seen, added or removed, as per router
//! a set of disjoint counter intervals. A router's adds within one run are contiguous (each add
//! also claims the counters it skipped, see [`super::RegistrySet::add`]), so once its adds
//! have all arrived its dots are one interval: the context is one (lo, hi) per router run, its
//! "version vector", plus the few intervals a missing add still separates (its "dot cloud"),
//! which merge as soon as the gap fills.

use super::Dot;
use crate::ids::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The dots `node`:`lo`..=`hi` (a dot's counter is never 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Span {
    /// The router whose dots these are.
    pub node: NodeId,
    /// The first counter.
    pub lo: u64,
    /// The last counter (inclusive).
    pub hi: u64,
}

impl Span {
    /// The span of one dot.
    pub fn dot(d: Dot) -> Span {
        Span {
            node: d.node,
            lo: d.counter,
            hi: d.counter,
        }
    }

    /// The span as it is understood (counter 0 is no dot), or `None` when it is empty.
    pub(crate) fn normalized(self) -> Option<Span> {
        let lo = self.lo.max(1);
        (lo <= self.hi).then_some(Span { lo, ..self })
    }
}

/// Per router, disjoint and non-adjacent intervals `lo → hi` of the counters seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CausalContext {
    nodes: BTreeMap<NodeId, BTreeMap<u64, u64>>,
}

impl CausalContext {
    /// Whether the dot was seen.
    pub(crate) fn covers(&self, d: Dot) -> bool {
        self.nodes.get(&d.node).is_some_and(|iv| {
            iv.range(..=d.counter)
                .next_back()
                .is_some_and(|(_, &hi)| hi >= d.counter)
        })
    }

    /// The highest counter of `node` seen (0 when none).
    pub(crate) fn top(&self, node: NodeId) -> u64 {
        self.nodes
            .get(&node)
            .and_then(|iv| iv.values().next_back().copied())
            .unwrap_or(0)
    }

    /// Adds a span (normalized first); true when it covered something new.
    pub(crate) fn insert(&mut self, s: Span) -> bool {
        let Some(Span {
            node,
            mut lo,
            mut hi,
        }) = s.normalized()
        else {
            return false;
        };
        let iv = self.nodes.entry(node).or_default();
        // Already inside one interval: nothing new.
        if let Some((_, &h)) = iv.range(..=lo).next_back()
            && h >= hi
        {
            return false;
        }
        // Absorb every interval that overlaps or touches [lo, hi].
        let touching: Vec<(u64, u64)> = iv
            .range(..=hi.saturating_add(1))
            .rev()
            .take_while(|(_, h)| h.saturating_add(1) >= lo)
            .map(|(&l, &h)| (l, h))
            .collect();
        for (l, h) in touching {
            iv.remove(&l);
            lo = lo.min(l);
            hi = hi.max(h);
        }
        iv.insert(lo, hi);
        true
    }

    /// Every interval, by router then counter.
    pub(crate) fn spans(&self) -> impl Iterator<Item = Span> + '_ {
        self.nodes
            .iter()
            .flat_map(|(&node, iv)| iv.iter().map(move |(&lo, &hi)| Span { node, lo, hi }))
    }

    /// The routers with something seen.
    pub(crate) fn routers(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.keys().copied()
    }

    /// What was seen of `node` within `lo..=hi`.
    pub(crate) fn within(&self, node: NodeId, lo: u64, hi: u64) -> Vec<Span> {
        let Some(iv) = self.nodes.get(&node) else {
            return Vec::new();
        };
        // The interval starting before lo may reach into the range.
        let first = iv.range(..lo).next_back().map(|(&l, &h)| (l, h));
        first
            .into_iter()
            .chain(iv.range(lo..=hi).map(|(&l, &h)| (l, h)))
            .filter_map(|(l, h)| {
                Span {
                    node,
                    lo: l.max(lo),
                    hi: h.min(hi),
                }
                .normalized()
            })
            .collect()
    }

    /// Intervals held (the context's size).
    pub(crate) fn len(&self) -> usize {
        self.nodes.values().map(BTreeMap::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n() -> NodeId {
        NodeId::from_name("a")
    }

    fn sp(lo: u64, hi: u64) -> Span {
        Span { node: n(), lo, hi }
    }

    fn dot(c: u64) -> Dot {
        Dot {
            node: n(),
            counter: c,
        }
    }

    #[test]
    fn intervals_merge_when_they_touch_and_gaps_stay_uncovered() {
        let mut c = CausalContext::default();
        assert!(c.insert(sp(5, 7)));
        assert!(c.insert(sp(10, 12)));
        assert_eq!(c.len(), 2);
        assert!(c.covers(dot(6)) && !c.covers(dot(8)) && !c.covers(dot(4)));
        assert!(!c.insert(sp(6, 7)), "inside an interval: nothing new");
        assert!(c.insert(sp(8, 9)), "fills the gap");
        assert_eq!(c.spans().collect::<Vec<_>>(), vec![sp(5, 12)]);
        assert!(c.insert(sp(1, 20)));
        assert_eq!(c.spans().collect::<Vec<_>>(), vec![sp(1, 20)]);
        assert_eq!(c.top(n()), 20);
        assert!(!c.insert(sp(0, 0)) && !c.insert(sp(9, 3)), "empty spans");
        assert!(c.insert(sp(u64::MAX - 1, u64::MAX)) && c.covers(dot(u64::MAX)));
    }

    #[test]
    fn within_cuts_the_intervals_to_a_range() {
        let mut c = CausalContext::default();
        c.insert(sp(1, 10));
        c.insert(sp(20, 30));
        assert_eq!(c.within(n(), 5, 25), vec![sp(5, 10), sp(20, 25)]);
        assert_eq!(c.within(n(), 11, 19), vec![]);
        assert_eq!(c.within(n(), 1, u64::MAX), vec![sp(1, 10), sp(20, 30)]);
        assert_eq!(c.within(NodeId(1), 1, u64::MAX), vec![]);
    }
}
