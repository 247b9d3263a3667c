//! Lookups: per engine, the longest cached prefix of a request's keys.
//!
//! # Covering marks
//!
//! Block keys are chained: an engine that holds the block at chain position `q` was sent the
//! whole prompt up to `q`. A *speculative* entry (a routing decision's mark, live until its
//! expiry) therefore vouches for the earlier positions of its anchor window — the positions
//! after the previous anchor up to it — so a mark that travels between routers names only the
//! top key of each window it covers (every [`ANCHOR_STRIDE`]-th key and its last one), not
//! every key. A lookup that misses position `i` for an engine probes the rest of `i`'s window
//! (at most `ANCHOR_STRIDE - 1` keys) for a live speculative entry, and continues after it.
//! Confirmed entries (KV events) never vouch for anything but themselves: an engine may evict
//! a parent block and keep its child, and vLLM's own lookup stops at the first miss.

use super::{Match, PREFETCH_AHEAD, PrefixIndex, Slot, member_hash, prefetch};

/// Prefetch distance along a posting list and along the engines still matching.
const WIDE_AHEAD: usize = 16;
use crate::keys::{ANCHOR_STRIDE, BlockKey, window_top};

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
            if e.live(now_us) && self.held_within(e.engine, keys, s, now_us) >= s {
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
                let e = out[j].engine;
                if out[j].blocks as usize > i {
                    // Already past `i`: a covering entry further on vouched for it.
                    j += 1;
                } else if self.holds(e, *k, now_us) {
                    out[j].blocks += 1;
                    j += 1;
                } else if let Some(q) = self.cover(e, keys, i, now_us) {
                    out[j].blocks = q as u32 + 1;
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

    /// How many leading blocks of `keys` (a chain from its first block) `engine` holds at
    /// `now_us`: consecutive live entries, and the positions a covering speculative entry
    /// vouches for (module docs). What [`lookup`](Self::lookup) finds for the engine, probed
    /// for one engine.
    pub fn held_prefix(&self, engine: Slot, keys: &[BlockKey], now_us: u64) -> u32 {
        self.held_within(engine, keys, keys.len(), now_us) as u32
    }

    /// [`held_prefix`](Self::held_prefix), walking no further than position `limit` (covers
    /// are still looked for in the whole of `keys`: a window's top may lie past `limit`).
    /// The result may pass `limit` by a cover's jump.
    fn held_within(&self, engine: Slot, keys: &[BlockKey], limit: usize, now_us: u64) -> usize {
        let mut i = 0;
        while i < limit {
            if self.holds(engine, keys[i], now_us) {
                i += 1;
            } else if let Some(q) = self.cover(engine, keys, i, now_us) {
                i = q + 1;
            } else {
                break;
            }
        }
        i
    }

    /// The position of a live speculative entry of `engine` after `i` in `i`'s anchor window
    /// (up to the next anchor position, or the chain's last key), which vouches for `i`.
    #[inline]
    fn cover(&self, engine: Slot, keys: &[BlockKey], i: usize, now_us: u64) -> Option<usize> {
        // Only speculative entries vouch: an engine without any (a precise engine between
        // decisions' 2 s marks) costs no probe.
        if self
            .engines
            .get(engine as usize)
            .is_none_or(|e| e.speculative == 0)
        {
            return None;
        }
        let top = window_top(i, keys.len())?;
        (i + 1..=top).find(|&q| {
            self.find(engine, keys[q].0)
                .is_some_and(|x| self.entries[x as usize].expiry > now_us)
        })
    }
}
