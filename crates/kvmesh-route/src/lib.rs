//! The router's pure core: what one request does, without I/O.
//!
//! A router handles a request in a handful of named steps; this crate holds the two that
//! decide, so that the hyper gateway, the virtual-time benchmark evaluator and the mesh
//! simulation all run the same code:
//!
//! 1. **prepare** (shell: `kvmesh-gateway`): body → model → route snapshot; for cache-aware
//!    routes prompt → block keys → per-engine matches from the prefix index;
//! 2. **[`decide`]** (here): the policy's ordered candidates, why the first was chosen, how many
//!    leading blocks each candidate is predicted to hold, the speculative mark to record for
//!    the first choice and the reservation (in-flight count) it takes before the attempt;
//! 3. **attempt** ([`Attempts`], here): next candidate whose breaker grants a permit, retries
//!    under the retry budget with jittered exponential backoff, a [`Verdict`] per response
//!    head (deliver / retry), the [`Accounting`] of each attempt for the engine's breaker and
//!    health (success / failure / cancel), and why the request gave up;
//! 4. **forward and stream** (shell): the request to the engine, the body back frame by
//!    frame; the end of the stream is classified by [`stream_end`].
//!
//! Time comes in as `now_us` (cluster time: µs since the Unix epoch in the router) and
//! randomness as seeds or uniform draws, so the same inputs give the same decisions.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod attempt;
mod decide;

pub use attempt::{
    Accounting, Action, Attempts, Blame, Budget, FailKind, Fleet, GiveUp, Next, StreamEnd, Verdict,
    backoff_us, classify_status, stream_end,
};
pub use decide::{Decision, Mark, PrefixPlan, PrefixProbe, TtlPlan, decide};
