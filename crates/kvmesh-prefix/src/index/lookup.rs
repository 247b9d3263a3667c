//! Lookups: per engine, the longest consecutive cached prefix of a request's keys.

use super::{Match, PREFETCH_AHEAD, PrefixIndex, member_hash, prefetch};

/// Prefetch distance along a posting list and along the engines still matching.
const WIDE_AHEAD: usize = 16;
use crate::keys::{ANCHOR_STRIDE, BlockKey};

impl PrefixIndex {
    /// For each engine holding the first block of `keys` (the chain of a request, from its
    /// first block, as [`crate::block_keys`] returns it) at `now_us`, the number of leading
    /// blocks it holds consecutively. `out` is cleared, then filled with one [`Match`] per
    /// engine holding at least one block, **sorted by engine id**. Allocation-free once `out`
    /// has grown to the number of matching engines.
    ///
    /// Cost: the engines holding the first key, plus one member probe per (engine still
    /// matching, next key) — O(Σ matched blocks), independent of the fleet size and of the
    /// index size. Pass `&keys[..max_hit_blocks(..)]` to predict vLLM's hit count exactly.
    pub fn lookup(&self, keys: &[BlockKey], now_us: u64, out: &mut Vec<Match>) {
        self.lookup_min(keys, 1, now_us, out);
    }

    /// [`lookup`](Self::lookup) restricted to engines holding at least `min_blocks` leading
    /// blocks. Candidate engines are enumerated at the last anchor position before
    /// `min_blocks` (a multiple of [`ANCHOR_STRIDE`]), so engines that share only a short
    /// common prefix (a chat template's first blocks, held by the whole fleet) are never
    /// visited when `min_blocks > ANCHOR_STRIDE`. `keys` must start at the chain's first block.
    pub fn lookup_min(
        &self,
        keys: &[BlockKey],
        min_blocks: usize,
        now_us: u64,
        out: &mut Vec<Match>,
    ) {
        out.clear();
        let m = min_blocks.max(1);
        if keys.len() < m {
            return;
        }
        let s = (m - 1) / ANCHOR_STRIDE * ANCHOR_STRIDE;
        let Some(posting) = self.anchors.get(&keys[s].0) else {
            return;
        };
        let posting = posting.as_slice();
        for (n, &idx) in posting.iter().enumerate() {
            if let Some(&next) = posting.get(n + WIDE_AHEAD) {
                prefetch(self.entries.as_ptr().wrapping_add(next as usize));
            }
            let e = &self.entries[idx as usize];
            if e.live(now_us) && keys[..s].iter().all(|k| self.holds(e.engine, *k, now_us)) {
                out.push(Match {
                    engine: e.engine,
                    blocks: s as u32 + 1,
                });
            }
        }
        // out[..active] are the engines still matching. Probes are independent and the member
        // table is larger than the caches, so member slots are prefetched ahead: WIDE_AHEAD
        // engines ahead when many still match, else PREFETCH_AHEAD keys ahead.
        let mut active = out.len();
        for (i, k) in keys.iter().enumerate().skip(s + 1) {
            if active == 0 {
                break;
            }
            let ahead = keys.get(i + PREFETCH_AHEAD);
            let mut j = 0;
            while j < active {
                if j + WIDE_AHEAD < active {
                    let e = out[j + WIDE_AHEAD].engine;
                    self.members.0.prefetch(member_hash(e, k.0));
                } else if let Some(a) = ahead {
                    self.members.0.prefetch(member_hash(out[j].engine, a.0));
                }
                if self.holds(out[j].engine, *k, now_us) {
                    out[j].blocks += 1;
                    j += 1;
                } else {
                    active -= 1;
                    out.swap(j, active);
                }
            }
        }
        if m > s + 1 {
            out.retain(|x| x.blocks as usize >= m);
        }
        out.sort_unstable_by_key(|x| x.engine);
    }
}
