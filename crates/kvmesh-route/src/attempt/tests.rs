use super::*;
use kvmesh_policy::{Reason, RetryBudgetConfig};

/// Breakers as a list of answers per engine: `true` grants a permit.
struct Gates {
    open: Vec<bool>,
    acquired: Vec<usize>,
    cancelled: Vec<usize>,
    ignore_health_seen: bool,
}

impl Gates {
    fn new(open: &[bool]) -> Gates {
        Gates {
            open: open.to_vec(),
            acquired: Vec::new(),
            cancelled: Vec::new(),
            ignore_health_seen: false,
        }
    }
}

impl Fleet for Gates {
    type Permit = usize;
    fn try_acquire(&mut self, engine: usize, _now: u64, ignore_health: bool) -> Option<usize> {
        self.ignore_health_seen |= ignore_health;
        self.open[engine].then(|| {
            self.acquired.push(engine);
            engine
        })
    }
    fn cancel(&mut self, engine: usize, permit: usize) {
        assert_eq!(engine, permit);
        self.cancelled.push(engine);
    }
}

fn decision(candidates: &[usize], reason: Reason) -> Decision {
    Decision {
        candidates: candidates.to_vec(),
        reason,
        predicted_blocks: [0; kvmesh_policy::MAX_CANDIDATES],
        mark: None,
        reserve: candidates.first().copied(),
    }
}

fn budget(tokens: f64) -> RetryBudget {
    let cfg = RetryBudgetConfig {
        ratio: 0.0,
        min_per_second: tokens,
        max_tokens: tokens,
    };
    RetryBudget::new(&cfg, 0)
}

fn send(n: Next<usize>) -> (usize, u32, u64) {
    match n {
        Next::Send {
            engine,
            attempt,
            backoff_us,
            permit,
            ..
        } => {
            assert_eq!(permit, engine);
            (engine, attempt, backoff_us)
        }
        Next::GiveUp(g) => panic!("gave up: {g:?}"),
    }
}

#[test]
fn first_attempt_has_no_backoff_and_an_answer_is_delivered() {
    let d = decision(&[2, 0, 1], Reason::LeastLoad);
    let mut a = Attempts::new(&d, &RetryConfig::default());
    let mut g = Gates::new(&[true; 3]);
    let mut b = budget(0.0);
    assert_eq!(
        send(a.next(&d.candidates, &mut g, &mut b, 0, 0.5)),
        (2, 1, 0)
    );
    assert_eq!(a.on_head(Verdict::Answered), Action::Deliver);
    assert!(!g.ignore_health_seen);
}

#[test]
fn a_5xx_retries_the_next_candidate_after_a_backoff_and_counts_as_failure() {
    let d = decision(&[2, 0, 1], Reason::LeastLoad);
    let retry = RetryConfig::default();
    let mut a = Attempts::new(&d, &retry);
    let mut g = Gates::new(&[true; 3]);
    let mut b = budget(10.0);
    send(a.next(&d.candidates, &mut g, &mut b, 0, 0.5));
    assert_eq!(
        a.on_head(classify_status(503, true)),
        Action::TryNext {
            account: Accounting::Failure
        }
    );
    // u = 0.5: no jitter; first retry = base.
    assert_eq!(
        send(a.next(&d.candidates, &mut g, &mut b, 0, 0.5)),
        (0, 2, retry.backoff_base_ms * 1000)
    );
    assert_eq!(
        a.on_head(Verdict::Failed(FailKind::Connect)),
        Action::TryNext {
            account: Accounting::Failure
        }
    );
    assert_eq!(
        send(a.next(&d.candidates, &mut g, &mut b, 0, 0.5)),
        (1, 3, retry.backoff_base_ms * 2000)
    );
    a.on_head(Verdict::Failed(FailKind::Timeout));
    // max_attempts = 3: the last failure decides the status (a timeout: 504).
    let g_up = a.next(&d.candidates, &mut g, &mut b, 0, 0.5);
    assert_eq!(
        g_up,
        Next::GiveUp(GiveUp::Exhausted {
            last: FailKind::Timeout
        })
    );
    assert_eq!(
        GiveUp::Exhausted {
            last: FailKind::Timeout
        }
        .status(),
        504
    );
}

#[test]
fn a_429_is_retried_but_not_held_against_the_engine_unless_disabled() {
    assert_eq!(FailKind::Status429.accounting(), Accounting::Cancel);
    assert_eq!(
        classify_status(429, true),
        Verdict::Failed(FailKind::Status429)
    );
    assert_eq!(classify_status(429, false), Verdict::Answered);
    assert_eq!(classify_status(400, true), Verdict::Answered);
    assert_eq!(classify_status(200, true), Verdict::Answered);
    assert_eq!(
        classify_status(500, false),
        Verdict::Failed(FailKind::Status5xx)
    );
}

#[test]
fn open_breakers_are_skipped_and_all_refused_is_a_503() {
    let d = decision(&[0, 1, 2], Reason::LeastLoad);
    let mut a = Attempts::new(&d, &RetryConfig::default());
    let mut g = Gates::new(&[false, true, false]);
    let mut b = budget(0.0);
    // A refused candidate costs no attempt and no retry token.
    assert_eq!(
        send(a.next(&d.candidates, &mut g, &mut b, 0, 0.5)),
        (1, 1, 0)
    );
    a.on_head(Verdict::Failed(FailKind::Status5xx));
    assert_eq!(
        a.next(&d.candidates, &mut g, &mut b, 0, 0.5),
        Next::GiveUp(GiveUp::Exhausted {
            last: FailKind::Status5xx
        })
    );
    let mut a = Attempts::new(&d, &RetryConfig::default());
    let mut g = Gates::new(&[false; 3]);
    let n = a.next(&d.candidates, &mut g, &mut b, 0, 0.5);
    assert_eq!(n, Next::GiveUp(GiveUp::AllRefused));
    assert_eq!(GiveUp::AllRefused.status(), 503);
}

#[test]
fn an_empty_budget_stops_retries_and_returns_the_permit() {
    let d = decision(&[0, 1, 2], Reason::LeastLoad);
    let mut a = Attempts::new(&d, &RetryConfig::default());
    let mut g = Gates::new(&[true; 3]);
    let mut b = budget(0.0);
    send(a.next(&d.candidates, &mut g, &mut b, 0, 0.5));
    a.on_head(Verdict::Failed(FailKind::Connect));
    assert_eq!(
        a.next(&d.candidates, &mut g, &mut b, 0, 0.5),
        Next::GiveUp(GiveUp::BudgetExhausted {
            last: FailKind::Connect
        })
    );
    assert_eq!(g.cancelled, vec![1], "the unused permit goes back");
    assert_eq!(a.sent(), 1);
}

#[test]
fn panic_mode_asks_for_permits_ignoring_health() {
    let d = decision(&[1, 0], Reason::AllIneligible);
    let mut a = Attempts::new(&d, &RetryConfig::default());
    let mut g = Gates::new(&[true; 2]);
    send(a.next(&d.candidates, &mut g, &mut budget(0.0), 0, 0.5));
    assert!(g.ignore_health_seen);
}

#[test]
fn no_engines_gives_up_at_once() {
    let d = decision(&[], Reason::NoEngines);
    let mut a = Attempts::new(&d, &RetryConfig::default());
    let mut g = Gates::new(&[]);
    assert_eq!(
        a.next(&d.candidates, &mut g, &mut budget(1.0), 0, 0.5),
        Next::GiveUp(GiveUp::NoEngines)
    );
}

#[test]
fn attempts_are_capped_by_config_and_candidates() {
    let d = decision(&[0, 1, 2, 3], Reason::LeastLoad);
    let retry = RetryConfig {
        max_attempts: 2,
        ..RetryConfig::default()
    };
    let mut a = Attempts::new(&d, &retry);
    let mut g = Gates::new(&[true; 4]);
    let mut b = budget(100.0);
    for _ in 0..2 {
        send(a.next(&d.candidates, &mut g, &mut b, 0, 0.5));
        a.on_head(Verdict::Failed(FailKind::Status5xx));
    }
    assert!(matches!(
        a.next(&d.candidates, &mut g, &mut b, 0, 0.5),
        Next::GiveUp(GiveUp::Exhausted { .. })
    ));
    assert_eq!(g.acquired, vec![0, 1]);
}

#[test]
fn stream_ends_account_as_expected() {
    assert_eq!(stream_end(StreamEnd::Complete), (Accounting::Success, None));
    assert_eq!(
        stream_end(StreamEnd::BodyError),
        (Accounting::Failure, Some(FailKind::Stream))
    );
    // The router's budget ran out while the engine delivered: not held against the engine.
    assert_eq!(
        stream_end(StreamEnd::TotalTimeout),
        (Accounting::Cancel, None)
    );
    assert_eq!(
        stream_end(StreamEnd::Stalled),
        (Accounting::Failure, Some(FailKind::Stream))
    );
    assert_eq!(
        stream_end(StreamEnd::ClientGone),
        (Accounting::Cancel, None)
    );
    assert_eq!(stream_end(StreamEnd::Refused), (Accounting::Cancel, None));
    assert_eq!(
        stream_end(StreamEnd::ErrorEvent(Blame::Engine)),
        (Accounting::Failure, Some(FailKind::Stream))
    );
    assert_eq!(
        stream_end(StreamEnd::ErrorEvent(Blame::Client)),
        (Accounting::Cancel, None)
    );
    assert_eq!(
        stream_end(StreamEnd::ErrorEvent(Blame::Overloaded)),
        (Accounting::Cancel, Some(FailKind::Status429))
    );
}

#[test]
fn backoff_doubles_caps_and_jitters_within_bounds() {
    let r = RetryConfig {
        backoff_base_ms: 10,
        backoff_max_ms: 50,
        jitter: 0.2,
        ..RetryConfig::default()
    };
    assert_eq!(backoff_us(&r, 1, 0.5), 10_000);
    assert_eq!(backoff_us(&r, 2, 0.5), 20_000);
    assert_eq!(backoff_us(&r, 3, 0.5), 40_000);
    assert_eq!(backoff_us(&r, 4, 0.5), 50_000);
    assert_eq!(backoff_us(&r, 60, 0.5), 50_000);
    assert_eq!(backoff_us(&r, 1, 0.0), 8_000);
    assert!(backoff_us(&r, 1, 0.999_999) <= 12_000);
}
