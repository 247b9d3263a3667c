//! The wait for a whole answer (no `"stream": true`: the head comes with the end of the
//! generation, so no first-byte timeout can bound it): until the request's total deadline,
//! and cut sooner when the engine has gone silent — it answered nothing at this router and
//! its work counters (`probe::WORK_COUNTERS`) did not change for [`silence_limit`]. A hung
//! engine used to keep such a request for the whole total timeout (30 minutes by default) while another engine
//! could have answered it. Only for engines whose metrics have such counters (vLLM's):
//! without them, a long generation is not told from a hang.

use crate::engine::Engine;
use crate::gateway::Gateway;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::Instant;

/// How a bounded wait ended.
pub(super) enum Waited<T> {
    /// The future finished first.
    Done(T),
    /// The request's total deadline passed.
    Deadline,
    /// The engine was silent for this long (≥ [`silence_limit`]).
    Silent(Duration),
}

/// How long an engine may be silent before a whole answer's attempt on it is given up:
/// `timeouts.first_byte_ms` (what a streamed answer may wait for its first byte), and at least
/// three discovery intervals (the counter is read once per interval).
pub(super) fn silence_limit(gw: &Gateway) -> Duration {
    let c = &gw.cfg;
    Duration::from_millis(
        c.timeouts
            .first_byte_ms
            .max(c.discovery_interval_ms.saturating_mul(3)),
    )
}

/// How long `engine` has been silent since `sent_us` (cluster µs), or `None` when its
/// work counters are unknown.
fn silent_for(gw: &Gateway, engine: &Engine, sent_us: u64) -> Option<Duration> {
    if !engine.work_known() {
        return None;
    }
    let answered = engine.tracker().answered_us();
    let worked = engine.worked_at_us.load(Ordering::Relaxed);
    let last = sent_us.max(answered).max(worked);
    Some(Duration::from_micros(
        gw.clock.now_us().saturating_sub(last),
    ))
}

/// Waits for `fut` until `end`, giving up early when `engine` is silent for
/// [`silence_limit`] (checked a few times per limit).
pub(super) async fn until_or_silent<F: Future>(
    gw: &Gateway,
    engine: &Engine,
    sent_us: u64,
    end: Instant,
    fut: F,
) -> Waited<F::Output> {
    let limit = silence_limit(gw);
    let step = (limit / 4).max(Duration::from_millis(10));
    tokio::pin!(fut);
    loop {
        let check = end.min(Instant::now() + step);
        if let Ok(v) = tokio::time::timeout_at(check, &mut fut).await {
            return Waited::Done(v);
        }
        if Instant::now() >= end {
            return Waited::Deadline;
        }
        if let Some(quiet) = silent_for(gw, engine, sent_us)
            && quiet >= limit
        {
            return Waited::Silent(quiet);
        }
    }
}
