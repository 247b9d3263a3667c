//! The hot path does not allocate: a counting global allocator around `Policy::pick` for every
//! policy, at 64 and 4,096 engines, with and without prefix input, alone and as one of three
//! meshed routers (ties split by rank).

use kvmesh_policy::{
    EngineMember, EngineSet, EngineView, MAX_CANDIDATES, Policy, PolicyConfig, PolicyKind,
    PrefixInput, PrefixMatch, RequestCtx, Rng, RouterSlot, Totals, stable_hash,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// An engine set with running totals, as a gateway would keep them.
struct Fleet {
    views: Vec<EngineView>,
    totals: Totals,
}

impl EngineSet for Fleet {
    fn len(&self) -> usize {
        self.views.len()
    }
    fn view(&self, i: usize) -> EngineView {
        self.views[i]
    }
    fn totals(&self) -> Totals {
        self.totals
    }
}

#[test]
fn pick_does_not_allocate() {
    for n in [64usize, 4096] {
        let mut rng = Rng::new(n as u64);
        let views: Vec<EngineView> = (0..n)
            .map(|_| {
                let mut v = EngineView::new(0.5 + rng.unit());
                v.in_flight = rng.below(30) as u32;
                v.eligible = rng.unit() < 0.95;
                v.latency_us = 1e5 * (1.0 + rng.unit());
                v
            })
            .collect();
        let totals = views.as_slice().totals();
        let fleet = Fleet { views, totals };
        let members: Vec<EngineMember> = (0..n)
            .map(|i| EngineMember::new(stable_hash(&(i as u64).to_le_bytes())))
            .collect();
        // Matches prepared outside the measured section (a gateway reuses a buffer).
        let matches: Vec<PrefixMatch> = (0..n / 64 * 8)
            .map(|_| PrefixMatch {
                engine: rng.below(n) as u32,
                blocks: rng.below(65) as u32,
            })
            .collect();
        let slots = [
            RouterSlot::ALONE,
            RouterSlot {
                rank: 1,
                routers: 3,
            },
        ];
        for (kind, slot) in PolicyKind::ALL
            .into_iter()
            .flat_map(|k| slots.map(|s| (k, s)))
        {
            let cfg = PolicyConfig {
                policy: kind,
                ..PolicyConfig::default()
            };
            let p = Policy::new(&cfg, &members, 1).with_router_slot(slot);
            let mut out = Vec::with_capacity(MAX_CANDIDATES);
            let before = ALLOCS.with(|a| a.get());
            for s in 0..1_000u64 {
                let ctx = RequestCtx::new(s, s).with_hash_key(s.wrapping_mul(0x9E37_79B9));
                p.pick(&fleet, &ctx, &mut out);
                assert!(!out.is_empty());
                let with = ctx.with_prefix(PrefixInput {
                    total_blocks: 64,
                    matches: &matches,
                    cold_key: 0,
                });
                p.pick(&fleet, &with, &mut out);
                assert!(!out.is_empty());
            }
            let after = ALLOCS.with(|a| a.get());
            assert_eq!(
                after - before,
                0,
                "{kind:?} at {n} engines ({slot:?}) allocated"
            );
        }
    }
}
