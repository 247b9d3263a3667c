//! Step 3 of a request: the attempt state machine.
//!
//! ```text
//!            ┌──────────── next() ─────────────┐
//!  Decision ─▶ candidate at pos: permit?        │ no permit (breaker open / half-open probe
//!            │   retry? budget.try_retry       │   out, unhealthy) → pos+1
//!            │   → Send { engine, backoff }    │ budget refused → GiveUp(BudgetExhausted)
//!            └── on_head(verdict) ─────────────┘ attempts = max or no candidate left
//!                  Answered → Deliver                → GiveUp(Exhausted | AllRefused)
//!                  Failed(kind) → TryNext (accounting: 429 = cancel, else failure)
//! ```

use crate::decide::Decision;
use kvmesh_config::RetryConfig;
use kvmesh_policy::RetryBudget;

/// Why an attempt on an engine failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailKind {
    /// TCP connect failed or was refused.
    Connect,
    /// No first byte of the answer within the first-byte timeout (no head, or a success's
    /// body silent until then).
    Timeout,
    /// 5xx answer.
    Status5xx,
    /// 429 answer.
    Status429,
    /// The body broke or stalled mid-stream, or the engine's event stream told of an error
    /// of its own (an error event whose code is not the client's).
    Stream,
    /// Any other transport error before the first byte of the answer (before the head, or a
    /// success's body that broke before its first data).
    Transport,
    /// The client went away after a wait for an answer (or for more of it) in which the
    /// engine answered nobody and did no work (`health.unanswered`; never retried: nobody is
    /// left to answer).
    Unanswered,
}

impl FailKind {
    /// Every kind, in a fixed order (metric arrays index by it).
    pub const ALL: [FailKind; 7] = [
        FailKind::Connect,
        FailKind::Timeout,
        FailKind::Status5xx,
        FailKind::Status429,
        FailKind::Stream,
        FailKind::Transport,
        FailKind::Unanswered,
    ];

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FailKind::Connect => "connect",
            FailKind::Timeout => "timeout",
            FailKind::Status5xx => "5xx",
            FailKind::Status429 => "429",
            FailKind::Stream => "stream",
            FailKind::Transport => "transport",
            FailKind::Unanswered => "unanswered",
        }
    }

    /// Position in [`FailKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// How the failure counts for the engine: a 429 says "busy", not "broken" (retried, but
    /// not held against its breaker or error rate); every other kind is a failure.
    pub fn accounting(self) -> Accounting {
        match self {
            FailKind::Status429 => Accounting::Cancel,
            _ => Accounting::Failure,
        }
    }
}

/// What a response head (or its absence) says about an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A response to stream to the client: 2xx, or a 4xx that is the client's own fault.
    Answered,
    /// Worth retrying on another engine (nothing has reached the client yet).
    Failed(FailKind),
}

/// How an attempt counts for its engine's breaker, health and error rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accounting {
    /// The stream ended well.
    Success,
    /// Counts against the engine.
    Failure,
    /// No verdict on the engine (the client left, or the engine was busy).
    Cancel,
}

/// Classifies a response status: 5xx is a failure; 429 is retried when `retry_429`;
/// anything else (2xx, the client's 4xx) goes to the client.
pub fn classify_status(status: u16, retry_429: bool) -> Verdict {
    match status {
        500..=599 => Verdict::Failed(FailKind::Status5xx),
        429 if retry_429 => Verdict::Failed(FailKind::Status429),
        _ => Verdict::Answered,
    }
}

/// How a delivered response's body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// The engine ended the body.
    Complete,
    /// The upstream body broke.
    BodyError,
    /// The total timeout hit mid-stream while the engine was still sending: the router's
    /// budget for the request ran out (a long generation, a slow client), not the engine.
    TotalTimeout,
    /// The total timeout hit mid-stream after the engine had sent nothing for a whole
    /// first-byte timeout: a stalled engine.
    Stalled,
    /// The client went away (the body was dropped unfinished).
    ClientGone,
    /// The engine's refusal of the client's request (a 4xx answer) ended: neither the
    /// engine's success nor its failure (a quick refusal says nothing of its latency).
    Refused,
    /// The engine's event stream carried an error event (`data: {"error": …}`, as vLLM and
    /// SGLang end a stream whose generation failed), whoever it blames.
    ErrorEvent(Blame),
}

/// Whose error an engine's error event reports, as its code (or, without a numeric one, its
/// type) says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The engine's own (a 5xx code, a server error, or no code the client owns): its failure.
    Engine,
    /// The client's request (a 4xx code other than 429, an invalid request): not the
    /// engine's failure, and no success of it either.
    Client,
    /// The engine is overloaded (429, a rate limit): counted as a 429, not held against it.
    Overloaded,
}

/// The accounting of a delivered attempt at the end of its body (and the failure kind to
/// count when it failed). Bytes reached the client: it is never retried.
pub fn stream_end(end: StreamEnd) -> (Accounting, Option<FailKind>) {
    match end {
        StreamEnd::Complete => (Accounting::Success, None),
        StreamEnd::BodyError | StreamEnd::Stalled | StreamEnd::ErrorEvent(Blame::Engine) => {
            (Accounting::Failure, Some(FailKind::Stream))
        }
        StreamEnd::ErrorEvent(Blame::Overloaded) => (Accounting::Cancel, Some(FailKind::Status429)),
        StreamEnd::TotalTimeout
        | StreamEnd::ClientGone
        | StreamEnd::Refused
        | StreamEnd::ErrorEvent(Blame::Client) => (Accounting::Cancel, None),
    }
}

/// The engines' breakers as the attempt machine asks them for permits.
pub trait Fleet {
    /// A breaker permit (returned with the attempt's accounting).
    type Permit;
    /// A permit to send to `engine` now, or `None` (breaker open, half-open probe out, or
    /// unhealthy unless `ignore_health`: panic mode).
    fn try_acquire(
        &mut self,
        engine: usize,
        now_us: u64,
        ignore_health: bool,
    ) -> Option<Self::Permit>;
    /// Gives back a permit that was not used (the retry budget refused the retry).
    fn cancel(&mut self, engine: usize, permit: Self::Permit);
}

/// The retry budget as the attempt machine uses it.
pub trait Budget {
    /// A new request arrived (deposits its share of a retry).
    fn on_request(&mut self, now_us: u64);
    /// Asks for one retry.
    fn try_retry(&mut self, now_us: u64) -> bool;
}

impl Budget for RetryBudget {
    fn on_request(&mut self, now_us: u64) {
        RetryBudget::on_request(self, now_us)
    }
    fn try_retry(&mut self, now_us: u64) -> bool {
        RetryBudget::try_retry(self, now_us)
    }
}

impl Budget for &kvmesh_policy::AtomicRetryBudget {
    fn on_request(&mut self, now_us: u64) {
        kvmesh_policy::AtomicRetryBudget::on_request(self, now_us)
    }
    fn try_retry(&mut self, now_us: u64) -> bool {
        kvmesh_policy::AtomicRetryBudget::try_retry(self, now_us)
    }
}

/// What to do next.
#[derive(Debug, PartialEq, Eq)]
pub enum Next<P> {
    /// Send attempt number `attempt` (1-based) to `engine` (route index; the candidate at
    /// `pos`), after waiting `backoff_us` (0 for the first attempt).
    Send {
        /// Position in the decision's candidates (its prediction is at the same position).
        pos: usize,
        /// Route index of the engine.
        engine: usize,
        /// The breaker permit.
        permit: P,
        /// 1 for the first attempt, 2 for the first retry, …
        attempt: u32,
        /// Wait before sending (jittered exponential backoff; 0 for the first attempt).
        backoff_us: u64,
    },
    /// No further attempt.
    GiveUp(GiveUp),
}

/// Why a request stopped without a response to deliver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUp {
    /// The decision had no candidate (no engine serves the model).
    NoEngines,
    /// No attempt was sent: every candidate's breaker or health refused.
    AllRefused,
    /// The retry budget refused a retry after `last` failed.
    BudgetExhausted {
        /// The last attempt's failure.
        last: FailKind,
    },
    /// Attempts used up (the configured maximum, or no candidate left) after `last` failed.
    Exhausted {
        /// The last attempt's failure.
        last: FailKind,
    },
}

impl GiveUp {
    /// The status the client gets when no engine answer is available to pass on:
    /// 503 when nothing could be tried, 504 after a timeout, 502 otherwise.
    pub fn status(self) -> u16 {
        match self {
            GiveUp::NoEngines | GiveUp::AllRefused => 503,
            GiveUp::BudgetExhausted { last } | GiveUp::Exhausted { last } => match last {
                FailKind::Timeout => 504,
                _ => 502,
            },
        }
    }
}

/// What the machine says after a response head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Stream this response to the client (its accounting comes at the end of the body:
    /// [`stream_end`]).
    Deliver,
    /// Account the attempt (`account`) and ask [`Attempts::next`] again.
    TryNext {
        /// How the failed attempt counts for its engine.
        account: Accounting,
    },
}

/// The attempts of one request over its decision's candidates.
#[derive(Debug, Clone)]
pub struct Attempts {
    pos: usize,
    sent: u32,
    max_attempts: u32,
    panic_mode: bool,
    empty: bool,
    last: Option<FailKind>,
    retry_429: bool,
    backoff_base_us: u64,
    backoff_max_us: u64,
    jitter: f64,
}

impl Attempts {
    /// Attempts over `decision`'s candidates: at most `retry.max_attempts` (and at most one
    /// per candidate).
    pub fn new(decision: &Decision, retry: &RetryConfig) -> Attempts {
        let n = decision.candidates.len() as u32;
        Attempts {
            pos: 0,
            sent: 0,
            max_attempts: retry.max_attempts.min(n).max(1),
            panic_mode: decision.panic_mode(),
            empty: decision.is_empty(),
            last: None,
            retry_429: retry.on_429,
            backoff_base_us: retry.backoff_base_ms.saturating_mul(1000),
            backoff_max_us: retry.backoff_max_ms.saturating_mul(1000),
            jitter: retry.jitter,
        }
    }

    /// Whether 429 answers are retried.
    pub fn retries_429(&self) -> bool {
        self.retry_429
    }

    /// Attempts sent so far.
    pub fn sent(&self) -> u32 {
        self.sent
    }

    /// The next step: the next candidate whose breaker grants a permit (asking the budget
    /// for a retry first when an attempt already failed), or why the request gives up.
    /// `jitter_u`: a uniform draw in [0, 1) for the backoff's jitter.
    pub fn next<F: Fleet + ?Sized, B: Budget + ?Sized>(
        &mut self,
        candidates: &[usize],
        fleet: &mut F,
        budget: &mut B,
        now_us: u64,
        jitter_u: f64,
    ) -> Next<F::Permit> {
        if self.empty {
            return Next::GiveUp(GiveUp::NoEngines);
        }
        while self.sent < self.max_attempts && self.pos < candidates.len() {
            let pos = self.pos;
            let engine = candidates[pos];
            self.pos += 1;
            let Some(permit) = fleet.try_acquire(engine, now_us, self.panic_mode) else {
                continue;
            };
            let mut backoff_us = 0;
            if self.sent > 0 {
                if !budget.try_retry(now_us) {
                    fleet.cancel(engine, permit);
                    let last = self.last.unwrap_or(FailKind::Transport);
                    return Next::GiveUp(GiveUp::BudgetExhausted { last });
                }
                backoff_us = backoff_us_for(
                    self.backoff_base_us,
                    self.backoff_max_us,
                    self.jitter,
                    self.sent,
                    jitter_u,
                );
            }
            self.sent += 1;
            return Next::Send {
                pos,
                engine,
                permit,
                attempt: self.sent,
                backoff_us,
            };
        }
        Next::GiveUp(match self.last {
            None => GiveUp::AllRefused,
            Some(last) => GiveUp::Exhausted { last },
        })
    }

    /// Records the response head (or its absence) of the attempt just sent.
    pub fn on_head(&mut self, verdict: Verdict) -> Action {
        match verdict {
            Verdict::Answered => Action::Deliver,
            Verdict::Failed(kind) => {
                self.last = Some(kind);
                Action::TryNext {
                    account: kind.accounting(),
                }
            }
        }
    }
}

fn backoff_us_for(base_us: u64, max_us: u64, jitter: f64, retry: u32, u: f64) -> u64 {
    let exp = base_us.saturating_mul(1u64 << retry.saturating_sub(1).min(16));
    let base = exp.min(max_us) as f64;
    let jittered = base * (1.0 + jitter * (2.0 * u.clamp(0.0, 1.0) - 1.0));
    jittered.max(0.0) as u64
}

/// The jittered exponential backoff before retry number `retry` (1-based): base × 2^(retry−1),
/// capped, ± `jitter` (`u` uniform in [0, 1)).
pub fn backoff_us(retry: &RetryConfig, retry_no: u32, u: f64) -> u64 {
    backoff_us_for(
        retry.backoff_base_ms.saturating_mul(1000),
        retry.backoff_max_ms.saturating_mul(1000),
        retry.jitter,
        retry_no,
        u,
    )
}

#[cfg(test)]
mod tests;
