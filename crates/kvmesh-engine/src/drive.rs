//! Virtual-time drivers: run engines on a simulated clock, as fast as the CPU allows.
//!
//! * [`run`] / [`run_with`]: one engine, a list of timed arrivals, until everything finished.
//! * [`VirtualEngine`]: one engine with its own "busy until" clock, the building block of a
//!   multi-engine event loop (many engines + a routing policy):
//!
//! ```
//! use kvmesh_engine::{drive::VirtualEngine, Engine, EngineParams, RequestSpec};
//! let mut engines: Vec<VirtualEngine> =
//!     (0..2).map(|_| VirtualEngine::new(Engine::new(EngineParams::default()))).collect();
//! let mut arrivals = vec![(0u64, RequestSpec::new(1, vec![1; 100], 4)),
//!                         (1_000, RequestSpec::new(2, vec![2; 100], 4))].into_iter().peekable();
//! loop {
//!     // The earliest engine step, and the next arrival: handle whichever comes first.
//!     let next_step = engines.iter().enumerate()
//!         .filter_map(|(i, e)| e.next_step_at().map(|t| (t, i))).min();
//!     match (arrivals.peek(), next_step) {
//!         (Some((at, _)), s) if s.is_none_or(|(t, _)| *at <= t) => {
//!             let (at, spec) = arrivals.next().unwrap();
//!             let target = (spec.id % 2) as usize; // the routing policy goes here
//!             engines[target].submit(spec, at).unwrap();
//!         }
//!         (_, Some((_, i))) => { let (_start, _out) = engines[i].step(); }
//!         (None, None) => break,
//!         _ => unreachable!(),
//!     }
//! }
//! assert_eq!(engines[0].engine().stats().finished_requests, 1);
//! ```

use crate::engine::Engine;
use crate::types::{
    AdmitError, EngineStats, FinishedRequest, Micros, RequestId, RequestSpec, StepOutput,
};

/// An engine on a virtual clock: it steps back to back while it has work, each step starting
/// when the previous one ends; an idle engine starts at the next submission's time.
#[derive(Debug, Clone)]
pub struct VirtualEngine {
    engine: Engine,
    free_at: Micros,
}

impl VirtualEngine {
    /// Wraps an engine whose clock starts at 0.
    pub fn new(engine: Engine) -> VirtualEngine {
        VirtualEngine { engine, free_at: 0 }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, mutably (abort, reset, slowdown...).
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Unwraps the engine.
    pub fn into_engine(self) -> Engine {
        self.engine
    }

    /// When the step in progress ends (or ended).
    pub fn free_at(&self) -> Micros {
        self.free_at
    }

    /// Start time of the next step, if the engine has work.
    pub fn next_step_at(&self) -> Option<Micros> {
        self.engine.has_work().then_some(self.free_at)
    }

    /// Adds a request arriving at `at`. The caller must have run every step that starts before
    /// `at` (process events in time order); an idle engine's clock jumps to `at`.
    pub fn submit(&mut self, spec: RequestSpec, at: Micros) -> Result<(), AdmitError> {
        self.engine.add_request(spec, at)?;
        self.free_at = self.free_at.max(at);
        Ok(())
    }

    /// Runs the next step at [`Self::free_at`]; returns its start time and output (produced at
    /// `start + duration_us`, which becomes the new `free_at`).
    pub fn step(&mut self) -> (Micros, StepOutput) {
        let start = self.free_at;
        let out = self.engine.step(start);
        self.free_at = start + out.duration_us;
        (start, out)
    }
}

/// What [`run`] returns.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    /// Finished requests, in finishing order.
    pub finished: Vec<FinishedRequest>,
    /// Requests the engine refused, with the reason.
    pub rejected: Vec<(RequestId, AdmitError)>,
    /// The engine's stats at the end.
    pub stats: EngineStats,
    /// Virtual time when the last step ended (µs).
    pub end: Micros,
}

/// Runs `engine` over timed arrivals (sorted by time) until every request finished. Time
/// advances by each step's duration; when idle it jumps to the next arrival.
pub fn run(
    engine: &mut Engine,
    arrivals: impl IntoIterator<Item = (Micros, RequestSpec)>,
) -> RunResult {
    run_with(engine, arrivals, |_, _| {})
}

/// [`run`], calling `on_step(start, &output)` after every step (before the finished requests
/// are collected).
pub fn run_with(
    engine: &mut Engine,
    arrivals: impl IntoIterator<Item = (Micros, RequestSpec)>,
    mut on_step: impl FnMut(Micros, &StepOutput),
) -> RunResult {
    let mut res = RunResult::default();
    let mut it = arrivals.into_iter().peekable();
    let mut now: Micros = 0;
    loop {
        while let Some((t, _)) = it.peek() {
            if *t > now {
                break;
            }
            let (t, spec) = it.next().expect("peeked");
            let id = spec.id;
            if let Err(e) = engine.add_request(spec, t) {
                res.rejected.push((id, e));
            }
        }
        if engine.has_work() {
            let mut out = engine.step(now);
            debug_assert!(!out.shape.is_empty(), "a step with work scheduled nothing");
            on_step(now, &out);
            now += out.duration_us;
            res.finished.append(&mut out.finished);
        } else {
            match it.peek() {
                Some((t, _)) => now = now.max(*t),
                None => break,
            }
        }
    }
    res.end = now;
    res.stats = engine.stats();
    res
}
