//! The per-engine state machines driven the way the gateway will drive them.

use kvmesh_policy::{
    BreakerConfig, BreakerEvent, BreakerState, CircuitBreaker, EjectionConfig, EjectionGuard,
    EngineTracker, HealthConfig, HealthEvent, RetryBudget, RetryBudgetConfig,
};

const MS: u64 = 1_000;
const S: u64 = 1_000_000;

#[test]
fn breaker_opens_after_consecutive_failures_and_backs_off() {
    let cfg = BreakerConfig::default();
    let mut b = CircuitBreaker::new(&cfg);
    let mut now = 0;
    for i in 0..4 {
        let p = b.try_acquire(now).unwrap();
        assert_eq!(b.on_failure(now, p, true), None, "failure {i}");
        now += MS;
    }
    let p = b.try_acquire(now).unwrap();
    assert_eq!(
        b.on_failure(now, p, true),
        Some(BreakerEvent::Opened { for_us: 5 * S })
    );
    assert!(b.is_ejected());
    assert!(!b.allows(now + S));
    assert_eq!(b.try_acquire(now + S), None);
    assert_eq!(
        b.state(now + S),
        BreakerState::Open {
            until_us: now + 5 * S
        }
    );
    // Half-open: one probe at a time.
    now += 5 * S;
    assert_eq!(b.state(now), BreakerState::HalfOpen);
    let probe = b.try_acquire(now).unwrap();
    assert!(probe.is_probe());
    assert_eq!(b.try_acquire(now), None);
    // A failed probe reopens, for twice as long.
    assert_eq!(
        b.on_failure(now, probe, false),
        Some(BreakerEvent::Opened { for_us: 10 * S })
    );
    now += 10 * S;
    let probe = b.try_acquire(now).unwrap();
    assert_eq!(
        b.on_failure(now, probe, true),
        Some(BreakerEvent::Opened { for_us: 20 * S })
    );
    now += 20 * S;
    // Three good probes close it.
    for i in 0..3 {
        let probe = b.try_acquire(now).unwrap();
        let ev = b.on_success(now + S, probe);
        assert_eq!(ev, (i == 2).then_some(BreakerEvent::Closed));
        now += 2 * S;
    }
    assert_eq!(b.state(now), BreakerState::Closed);
    assert!(!b.is_ejected());
    // The backoff is remembered for a while...
    for _ in 0..5 {
        let p = b.try_acquire(now).unwrap();
        b.on_failure(now, p, true);
    }
    assert_eq!(
        b.state(now),
        BreakerState::Open {
            until_us: now + 40 * S
        }
    );
}

#[test]
fn open_time_is_capped_and_forgotten_after_a_quiet_period() {
    let cfg = BreakerConfig::default();
    let mut b = CircuitBreaker::new(&cfg);
    let mut now = 0;
    let mut lengths = Vec::new();
    for _ in 0..8 {
        // Closed: fail until it opens; half-open: the probe fails and it reopens.
        loop {
            let p = b.try_acquire(now).unwrap();
            if let Some(BreakerEvent::Opened { for_us }) = b.on_failure(now, p, true) {
                lengths.push(for_us / S);
                now += for_us;
                break;
            }
        }
    }
    assert_eq!(lengths, [5, 10, 20, 40, 60, 60, 60, 60]);
    // Close it, stay quiet for more than backoff_reset_ms, trip again: back to open_ms.
    for _ in 0..3 {
        let p = b.try_acquire(now).unwrap();
        b.on_success(now, p);
    }
    assert_eq!(b.state(now), BreakerState::Closed);
    now += 301 * S;
    let mut ev = None;
    for _ in 0..5 {
        let p = b.try_acquire(now).unwrap();
        ev = b.on_failure(now, p, true);
    }
    assert_eq!(ev, Some(BreakerEvent::Opened { for_us: 5 * S }));
}

#[test]
fn breaker_opens_on_failure_ratio_over_the_window() {
    let cfg = BreakerConfig {
        consecutive_failures: 100,
        ..BreakerConfig::default()
    };
    let mut b = CircuitBreaker::new(&cfg);
    // Alternate success / failure: 50% errors, never 2 in a row.
    let mut opened_at = None;
    for i in 0..40u64 {
        let now = i * 100 * MS;
        let p = b.try_acquire(now).unwrap();
        let ev = if i % 2 == 0 {
            b.on_success(now, p)
        } else {
            b.on_failure(now, p, true)
        };
        if matches!(ev, Some(BreakerEvent::Opened { .. })) {
            opened_at = Some(i);
            break;
        }
    }
    // Judged once 20 requests are in the window.
    assert_eq!(opened_at, Some(19));
    // Old outcomes leave the window: 10 failures spread over 100 s never trip it.
    let mut b = CircuitBreaker::new(&cfg);
    for i in 0..200u64 {
        let now = i * 500 * MS;
        let p = b.try_acquire(now).unwrap();
        let ev = if i % 20 == 0 {
            b.on_failure(now, p, true)
        } else {
            b.on_success(now, p)
        };
        assert_eq!(ev, None);
    }
}

#[test]
fn late_results_from_before_a_trip_change_nothing() {
    let mut b = CircuitBreaker::new(&BreakerConfig::default());
    let stale = b.try_acquire(0).unwrap();
    for _ in 0..5 {
        let p = b.try_acquire(0).unwrap();
        b.on_failure(0, p, true);
    }
    assert!(b.is_ejected());
    let probe = b.try_acquire(5 * S).unwrap();
    // The stale success neither closes nor counts as a probe; the probe slot stays taken.
    assert_eq!(b.on_success(5 * S, stale), None);
    assert_eq!(b.try_acquire(5 * S), None);
    // A cancelled probe frees its slot.
    b.on_cancel(probe);
    assert!(b.try_acquire(5 * S).is_some());
}

#[test]
fn ejection_guard_caps_the_fleet_share() {
    let g = EjectionGuard::new(&EjectionConfig::default());
    assert_eq!(g.max_ejected(3), 1); // at least one
    assert_eq!(g.max_ejected(10), 3);
    assert!(g.may_eject(2, 10));
    assert!(!g.may_eject(3, 10));
    // A suppressed trip keeps the breaker closed and asks again next time.
    let mut b = CircuitBreaker::new(&BreakerConfig::default());
    for _ in 0..4 {
        let p = b.try_acquire(0).unwrap();
        b.on_failure(0, p, false);
    }
    let p = b.try_acquire(0).unwrap();
    assert_eq!(
        b.on_failure(0, p, false),
        Some(BreakerEvent::OpenSuppressed)
    );
    assert_eq!(b.state(0), BreakerState::Closed);
    let p = b.try_acquire(0).unwrap();
    assert!(matches!(
        b.on_failure(0, p, true),
        Some(BreakerEvent::Opened { .. })
    ));
}

#[test]
fn disabled_breaker_never_ejects() {
    let cfg = BreakerConfig {
        enabled: false,
        ..BreakerConfig::default()
    };
    let mut b = CircuitBreaker::new(&cfg);
    for i in 0..100 {
        let p = b.try_acquire(i).unwrap();
        assert_eq!(b.on_failure(i, p, true), None);
    }
    assert!(b.allows(100) && !b.is_ejected());
}

#[test]
fn tracker_recovery_restarts_slow_start_and_failures_cut_the_weight() {
    let cfg = HealthConfig::default();
    let mut t = EngineTracker::new(&cfg, 0, false);
    assert_eq!(t.weight_factor(0, 0.0, None), 1.0);
    let v = t.view(0, 2.0, 3, Some(5), Some(0.5), 0.0);
    assert!(v.eligible && v.weight == 2.0 && v.load() == 5);
    // Fails fast five times: breaker opens, weight and latency collapse.
    let mut now = S;
    for _ in 0..5 {
        let p = t.try_acquire(now).unwrap();
        t.on_failure(now, p, true);
        now += 5 * MS;
    }
    assert!(!t.eligible(now));
    assert!(t.latency().ttft_us(now) >= 10.0 * S as f64);
    assert!(t.weight_factor(now, 300_000.0, None) <= 0.1);
    // Recovers: three good probes close the breaker and restart slow start.
    now += 5 * S;
    for _ in 0..3 {
        let p = t.try_acquire(now).unwrap();
        t.on_first_byte(now + 50 * MS, 50 * MS);
        t.on_success(now + S, p, S);
        now += S;
    }
    assert!(t.eligible(now));
    assert_eq!(t.slow_start().since_us(), Some(now));
    // Health checks: three failures make it ineligible, two passes bring it back (ramping).
    for _ in 0..2 {
        assert_eq!(t.on_health_check(now, false), None);
    }
    assert_eq!(
        t.on_health_check(now, false),
        Some(HealthEvent::BecameUnhealthy)
    );
    assert!(!t.eligible(now) && t.try_acquire(now).is_none());
    t.on_health_check(now + 5 * S, true);
    assert_eq!(
        t.on_health_check(now + 10 * S, true),
        Some(HealthEvent::BecameHealthy)
    );
    assert!(t.eligible(now + 10 * S));
    assert_eq!(t.slow_start().since_us(), Some(now + 10 * S));
}

#[test]
fn gray_engine_loses_weight_relative_to_the_fleet() {
    let cfg = HealthConfig::default();
    let mut t = EngineTracker::new(&cfg, 0, false);
    for i in 1..=200u64 {
        let now = i * 100 * MS;
        let p = t.try_acquire(now).unwrap();
        t.on_first_byte(now, 1_000 * MS); // fleet median ~200 ms: 5x slower
        t.on_success(now, p, 10 * S);
    }
    let now = 20 * S;
    let fleet = 200_000.0 + 0.1 * 2_000_000.0;
    let f = t.weight_factor(now, fleet, None);
    assert!(f < 0.4, "{f}");
}

#[test]
fn retry_budget_limits_a_retry_storm() {
    let mut b = RetryBudget::new(&RetryBudgetConfig::default(), 0);
    // Overload: 500 requests/s for 60 s, all failing and wanting up to 2 retries each.
    let (mut requests, mut retries) = (0u64, 0u64);
    for i in 0..30_000u64 {
        let now = i * 2 * MS;
        b.on_request(now);
        requests += 1;
        for _ in 0..2 {
            if b.try_retry(now) {
                retries += 1;
            }
        }
    }
    let amplification = (requests + retries) as f64 / requests as f64;
    assert!(amplification < 1.25, "{amplification}");
}
