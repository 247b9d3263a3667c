//! Structural invariants of the index, for tests (O(entries)).

use super::{Entry, FREE, NIL, Posting, PrefixIndex};
use crate::keys::BlockKey;
use std::collections::HashSet;

impl PrefixIndex {
    /// Checks every structural invariant: each stored entry is in the member table, in its
    /// engine's LRU list exactly once and, for anchor keys, in its posting exactly once; counts
    /// and totals agree; no engine exceeds its capacity; the free list holds every free slot.
    /// O(entries); for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![false; self.entries.len()];
        let (mut total, mut confirmed, mut spec) = (0u64, 0u64, 0u64);
        let mut engines = 0u32;
        for (id, s) in self.engines.iter().enumerate() {
            if !s.present {
                continue;
            }
            engines += 1;
            let (mut len, mut c, mut sp) = (0u32, 0u32, 0u32);
            let mut prev = NIL;
            let mut i = s.head;
            while i != NIL {
                let e: &Entry = &self.entries[i as usize];
                if e.engine as usize != id {
                    return Err(format!(
                        "entry {i} on engine {id}'s list has engine {}",
                        e.engine
                    ));
                }
                if std::mem::replace(&mut seen[i as usize], true) {
                    return Err(format!("entry {i} linked twice"));
                }
                if e.prev != prev {
                    return Err(format!("entry {i}: prev {} != {prev}", e.prev));
                }
                if e.count == 0 && e.expiry == 0 {
                    return Err(format!("entry {i} has neither copies nor expiry"));
                }
                let found = self.find(e.engine, e.key);
                if found != Some(i) {
                    return Err(format!("entry {i}: member table gives {found:?}"));
                }
                if BlockKey(e.key).is_anchor() {
                    let n = self
                        .anchors
                        .get(&e.key)
                        .map_or(0, |p| p.as_slice().iter().filter(|&&j| j == i).count());
                    if n != 1 {
                        return Err(format!("anchor entry {i} is {n} times in its posting"));
                    }
                }
                len += 1;
                c += u32::from(e.count > 0);
                sp += u32::from(e.expiry != 0);
                prev = i;
                i = e.next;
            }
            if s.tail != prev {
                return Err(format!("engine {id}: tail {} != last {prev}", s.tail));
            }
            if (len, c, sp) != (s.len, s.confirmed, s.speculative) {
                return Err(format!(
                    "engine {id}: counted ({len}, {c}, {sp}), recorded ({}, {}, {})",
                    s.len, s.confirmed, s.speculative
                ));
            }
            if len > s.capacity {
                return Err(format!(
                    "engine {id}: {len} entries > capacity {}",
                    s.capacity
                ));
            }
            total += u64::from(len);
            confirmed += u64::from(c);
            spec += u64::from(sp);
        }
        if (total, confirmed, spec, engines)
            != (
                self.n_entries,
                self.n_confirmed,
                self.n_speculative,
                self.n_engines,
            )
        {
            return Err(format!(
                "totals ({total}, {confirmed}, {spec}, {engines}) != recorded ({}, {}, {}, {})",
                self.n_entries, self.n_confirmed, self.n_speculative, self.n_engines
            ));
        }
        for (i, e) in self.entries.iter().enumerate() {
            if e.engine != FREE && !seen[i] {
                return Err(format!("entry {i} is on no engine list"));
            }
        }
        if self.members.0.len() as u64 != total || self.members.0.iter().any(|i| !seen[i as usize])
        {
            return Err("member table holds stale or missing indices".into());
        }
        let posting_bytes: usize = self
            .anchors
            .values()
            .map(|p| match p {
                Posting::One(_) => 0,
                Posting::Many(v) => v.capacity() * 4,
            })
            .sum();
        if posting_bytes != self.posting_bytes {
            return Err(format!(
                "maintained posting bytes {} != {posting_bytes}",
                self.posting_bytes
            ));
        }
        let mut in_postings = HashSet::new();
        for (k, p) in &self.anchors {
            if let Posting::Many(v) = p
                && v.len() < 2
            {
                return Err(format!("posting of {k:#x} is a short Many"));
            }
            for &i in p.as_slice() {
                let e = &self.entries[i as usize];
                if e.engine == FREE || e.key != *k || !in_postings.insert(i) {
                    return Err(format!("posting of {k:#x} holds a bad entry {i}"));
                }
            }
        }
        let mut free = 0usize;
        let mut f = self.free_head;
        while let Some(i) = f {
            if self.entries[i as usize].engine != FREE || free > self.entries.len() {
                return Err(format!("free list reaches used entry {i} or loops"));
            }
            free += 1;
            let n = self.entries[i as usize].next;
            f = (n != NIL).then_some(n);
        }
        if free as u64 + total != self.entries.len() as u64 {
            return Err(format!(
                "{free} free + {total} used != {} slots",
                self.entries.len()
            ));
        }
        Ok(())
    }
}
