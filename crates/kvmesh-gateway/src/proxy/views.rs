//! The core's views of one request's route: the index (what each engine holds of the
//! prompt) and the breakers (the attempt machine's permits).

use crate::engine::Engine;
use kvmesh_policy::Permit;
use kvmesh_prefix::{BlockKey, PrefixIndex};
use kvmesh_route::{Fleet, PrefixProbe};
use std::sync::Arc;

/// The core's view of the index for one request: per route engine, the leading blocks of
/// `keys` it holds (probed exactly, so short matches the lookup skipped count too; a peer's
/// covering mark vouches for its window) and
/// whether its events are live.
pub struct IndexProbe<'a> {
    /// The index (under the caller's lock).
    pub index: &'a PrefixIndex,
    /// The route's engines.
    pub engines: &'a [Arc<Engine>],
    /// The request's block keys.
    pub keys: &'a [BlockKey],
    /// Now (cluster µs).
    pub now_us: u64,
}

impl PrefixProbe for IndexProbe<'_> {
    fn held_blocks(&self, engine: usize) -> u32 {
        self.index
            .held_prefix(self.engines[engine].slot, self.keys, self.now_us)
    }

    fn events_live(&self, engine: usize) -> bool {
        self.engines[engine].events_live()
    }
}

/// The route's breakers as the attempt machine asks them.
pub(super) struct RouteFleet<'a>(pub(super) &'a [Arc<Engine>]);

impl Fleet for RouteFleet<'_> {
    type Permit = Permit;

    fn try_acquire(&mut self, engine: usize, now_us: u64, ignore_health: bool) -> Option<Permit> {
        let mut t = self.0[engine].tracker();
        if ignore_health {
            t.try_acquire_ignoring_health(now_us)
        } else {
            t.try_acquire(now_us)
        }
    }

    fn cancel(&mut self, engine: usize, permit: Permit) {
        self.0[engine].tracker().on_cancel(permit);
    }
}
