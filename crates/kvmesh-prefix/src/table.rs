//! An open-addressing hash table of entry indices (linear probing, backward-shift deletion, no
//! tombstones), 8 bytes per slot: a 32-bit fingerprint of the hash and the 32-bit index of the
//! entry in the caller's slab. The table does not store keys: the caller supplies the hash of
//! any stored index and an equality test, which it answers from its slab.
//!
//! The slot count is not a power of two: a hash maps to its home slot by "fastrange"
//! (`(h × n) >> 64`), so the table can be sized to exactly `len / MAX_LOAD` slots.

const EMPTY: u64 = u64::MAX;
/// Maximum load factor 4/5: short probes (fingerprints spare most slab reads) at 10 bytes
/// per stored index.
const LOAD_NUM: usize = 4;
const LOAD_DEN: usize = 5;
const MIN_SLOTS: usize = 16;

/// See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct IdxTable {
    slots: Vec<u64>,
    len: usize,
}

#[inline]
fn pack(hash: u64, idx: u32) -> u64 {
    ((hash as u32 as u64) << 32) | idx as u64
}

#[inline]
fn idx_of(slot: u64) -> u32 {
    slot as u32
}

#[inline]
fn fp_of(slot: u64) -> u32 {
    (slot >> 32) as u32
}

impl IdxTable {
    /// A table that holds `n` indices without growing.
    pub(crate) fn with_capacity(n: usize) -> IdxTable {
        let slots = (n * LOAD_DEN).div_ceil(LOAD_NUM).max(MIN_SLOTS);
        IdxTable {
            slots: vec![EMPTY; slots],
            len: 0,
        }
    }

    /// Stored indices.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * 8
    }

    #[inline]
    fn home(&self, hash: u64) -> usize {
        ((hash as u128 * self.slots.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() { 0 } else { i + 1 }
    }

    /// Hints the CPU to load the home slot of `hash` (lookups issue it a few probes ahead).
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        crate::index::prefetch(self.slots.as_ptr().wrapping_add(self.home(hash)));
    }

    /// The stored index whose entry satisfies `eq`, among those stored under `hash`.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.find_slot(hash, &mut eq).map(|s| idx_of(self.slots[s]))
    }

    #[inline]
    fn find_slot(&self, hash: u64, eq: &mut impl FnMut(u32) -> bool) -> Option<usize> {
        let fp = hash as u32;
        let mut i = self.home(hash);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            if fp_of(s) == fp && eq(idx_of(s)) {
                return Some(i);
            }
            i = self.next(i);
        }
    }

    /// Stores `idx` under `hash` (the caller checked it is absent). Grows when full, rehashing
    /// every stored index with `hash_of`.
    pub(crate) fn insert(&mut self, hash: u64, idx: u32, hash_of: impl Fn(u32) -> u64) {
        if (self.len + 1) * LOAD_DEN > self.slots.len() * LOAD_NUM {
            self.grow(&hash_of);
        }
        self.place(pack(hash, idx), hash);
        self.len += 1;
    }

    fn place(&mut self, slot: u64, hash: u64) {
        let mut i = self.home(hash);
        while self.slots[i] != EMPTY {
            i = self.next(i);
        }
        self.slots[i] = slot;
    }

    fn grow(&mut self, hash_of: &impl Fn(u32) -> u64) {
        let new_len = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; new_len]);
        for s in old {
            if s != EMPTY {
                let h = hash_of(idx_of(s));
                self.place(s, h);
            }
        }
    }

    /// Removes the index whose entry satisfies `eq` under `hash`; true if it was there.
    /// `hash_of` gives the hash of other stored indices (they may shift back).
    pub(crate) fn remove(
        &mut self,
        hash: u64,
        mut eq: impl FnMut(u32) -> bool,
        hash_of: impl Fn(u32) -> u64,
    ) -> bool {
        let Some(mut hole) = self.find_slot(hash, &mut eq) else {
            return false;
        };
        let n = self.slots.len();
        let mut j = self.next(hole);
        loop {
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            let home = self.home(hash_of(idx_of(s)));
            // `s` may fill the hole if the hole lies cyclically in [home, j).
            let dist_home = (j + n - home) % n;
            let dist_hole = (j + n - hole) % n;
            if dist_home >= dist_hole {
                self.slots[hole] = s;
                hole = j;
            }
            j = self.next(j);
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Every stored index (for invariant checks).
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots
            .iter()
            .filter(|&&s| s != EMPTY)
            .map(|&s| idx_of(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn mix(x: u64) -> u64 {
        let x = (x ^ (x >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 33)
    }

    #[test]
    fn random_ops_match_a_set() {
        // Entry idx i has key keys[i]; a small key space forces collisions and clusters.
        let mut t = IdxTable::with_capacity(0);
        let mut model = BTreeSet::new();
        let mut x = 1u64;
        for step in 0..20_000u64 {
            x = mix(x.wrapping_add(step));
            let idx = (x % 300) as u32;
            // Small hash space: many fingerprints collide too.
            let h = |i: u32| mix(i as u64 % 97) ^ ((i as u64 % 5) << 40);
            if x & (1 << 20) == 0 {
                if model.insert(idx) {
                    t.insert(h(idx), idx, h);
                }
            } else {
                assert_eq!(t.remove(h(idx), |i| i == idx, h), model.remove(&idx));
            }
            assert_eq!(t.len(), model.len());
            if step % 997 == 0 {
                for i in 0..300u32 {
                    assert_eq!(t.find(h(i), |j| j == i).is_some(), model.contains(&i));
                }
                let all: BTreeSet<u32> = t.iter().collect();
                assert_eq!(all, model);
            }
        }
    }
}
