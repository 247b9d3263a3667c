//! The marks of decisions still waiting for their engine's answer.
//!
//! A decision that finds an engine holding the prompt's leading blocks only extends their
//! marks; it takes back, if the engine refuses the request, only the blocks it marked anew
//! (the others were there before it). But blocks found marked by another decision whose
//! engine has not answered yet are no evidence: two identical requests sent together both
//! mark the engine, the second finding the first's marks and extending them, and when the
//! engine refuses both the first's refusal finds its marks extended (a later decision's
//! stay) while the second took them for held before it. So each decision that marks blocks
//! anew is kept here — its engine, and the position and key of the first block it marked
//! anew (block keys are chained: a prompt holding that key at that position shares
//! everything before it) — until its engine answers or the request ends; a decision counts
//! as held before it only the leading blocks up to the first such block ([`Hold::settled`]).
//!
//! What this does not tell: whether the earlier request is then served. When the later one
//! is refused first, the blocks they share lose their mark although the earlier one may
//! still be served (a missed hit, not a wrong prediction).

use kvmesh_prefix::{BlockKey, Slot};
use std::sync::{Arc, Mutex, MutexGuard};

/// One decision awaiting its engine's answer: the first block it marked anew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Open {
    slot: Slot,
    at: u32,
    key: u64,
}

/// The open decisions of the router (as many as its requests awaiting an answer).
#[derive(Debug, Default)]
pub struct PendingMarks {
    open: Mutex<Vec<Open>>,
}

impl PendingMarks {
    fn lock(&self) -> MutexGuard<'_, Vec<Open>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A decision marked `keys` on engine `slot`, finding the first `known` held. Called
    /// under the index's write lock, with the mark (the next decision's lookup sees both):
    /// counts how many of the `known` were held before any open decision marked them, and
    /// opens this decision when it marks a block that was not held before.
    pub fn open(self: &Arc<Self>, slot: Slot, keys: &[BlockKey], known: usize) -> Hold {
        let known = known.min(keys.len());
        let mut open = self.lock();
        let settled = open
            .iter()
            .filter(|o| {
                o.slot == slot
                    && (o.at as usize) < known
                    && keys.get(o.at as usize).is_some_and(|k| k.0 == o.key)
            })
            .map(|o| o.at as usize)
            .min()
            .unwrap_or(known);
        let new = (settled < keys.len()).then(|| Open {
            slot,
            at: settled as u32,
            key: keys[settled].0,
        });
        if let Some(o) = new {
            open.push(o);
        }
        Hold {
            marks: self.clone(),
            open: new,
            settled,
        }
    }

    /// How many decisions are open.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// A decision's mark while its engine has not answered; dropped once the answer settled it
/// (or the request ended without one), it closes the decision.
#[derive(Debug)]
pub struct Hold {
    marks: Arc<PendingMarks>,
    open: Option<Open>,
    settled: usize,
}

impl Hold {
    /// The leading keys the engine held before this decision and every decision still
    /// awaiting its answer: a refusal takes back the marks of the keys past them.
    pub fn settled(&self) -> usize {
        self.settled
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(o) = self.open {
            let mut open = self.marks.lock();
            if let Some(i) = open.iter().position(|&x| x == o) {
                open.swap_remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: u64, salt: u64) -> Vec<BlockKey> {
        (0..n).map(|i| BlockKey(salt * 1_000 + i)).collect()
    }

    #[test]
    fn a_decision_alone_counts_what_it_found_held() {
        let p = Arc::new(PendingMarks::default());
        let k = keys(10, 1);
        let h = p.open(0, &k, 4);
        assert_eq!(h.settled(), 4);
        assert_eq!(p.len(), 1, "it marked six blocks anew");
        drop(h);
        assert_eq!(p.len(), 0);
        // Nothing new: nothing to wait for.
        let h = p.open(0, &k, 10);
        assert_eq!((h.settled(), p.len()), (10, 0));
    }

    #[test]
    fn blocks_found_marked_by_an_open_decision_are_not_counted_held() {
        let p = Arc::new(PendingMarks::default());
        let turn = keys(12, 1);
        let first = p.open(0, &turn, 4);
        // The same prompt, while the first awaits its answer: it finds all twelve marked.
        let second = p.open(0, &turn, 12);
        assert_eq!(second.settled(), 4, "held before: the first four only");
        // A shorter prompt of the same conversation, found wholly marked.
        let short = p.open(0, &turn[..8], 8);
        assert_eq!(short.settled(), 4);
        // On another engine, or another conversation, the open decision says nothing.
        assert_eq!(p.open(1, &turn, 12).settled(), 12);
        assert_eq!(p.open(0, &keys(12, 2), 12).settled(), 12);
        drop(first);
        // Still open through the second (same first new block).
        assert_eq!(p.open(0, &turn, 12).settled(), 4);
        drop((second, short));
        assert_eq!(p.open(0, &turn, 12).settled(), 12, "all answered");
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn the_earliest_open_block_bounds_what_is_held() {
        let p = Arc::new(PendingMarks::default());
        let turn = keys(20, 1);
        let _a = p.open(0, &turn[..10], 6);
        let _b = p.open(0, &turn, 10);
        assert_eq!(p.open(0, &turn, 20).settled(), 6);
        // Known blocks end before either opened block: nothing changes.
        assert_eq!(p.open(0, &turn, 5).settled(), 5);
    }
}
