//! Seeded discrete-event simulations of a gateway driving the policies and the state machines
//! over a small fleet: the acceptance shares of the router issue.
//!
//! The fleet: 8 engines, each serving up to 8 requests at once (FIFO queue beyond), service
//! time uniform in [1, 3] s of which 10% is prefill (TTFT = queueing + prefill). Poisson
//! arrivals at 60% of the healthy capacity, 300 simulated seconds (~5,000 requests). The gateway
//! logic is the real one's: the core's [`decide`] and [`Attempts`] machine (first candidate whose
//! breaker grants a permit; on failure, the next candidate within the retry budget, after the
//! jittered backoff, at most `max_attempts`), the same calls the hyper gateway makes.

use kvmesh_config::RetryConfig;
use kvmesh_policy::{
    EjectionGuard, EngineMember, EngineTracker, HealthConfig, Permit, Policy, PolicyConfig,
    PolicyKind, RequestCtx, RetryBudget, RetryBudgetConfig, Rng, fleet_reference_latency,
    stable_hash,
};
use kvmesh_route::{
    Accounting, Action, Attempts, Decision, FailKind, Fleet, Next, PrefixProbe, Verdict, decide,
};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

const ENGINES: usize = 8;
const SLOTS: usize = 8;
const SECOND: u64 = 1_000_000;
const DURATION: u64 = 300 * SECOND;
/// The degraded engine (not index 0: nothing may depend on index 0).
const ODD: usize = 5;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    /// Every step of the engine 5× slower.
    Slow5x,
    /// Answers every request with a 500 after 5 ms.
    FailFast,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Ev {
    Arrival,
    /// An attempt leaves after its backoff.
    Dispatch(usize),
    FirstByte(usize),
    End(usize),
    Fail(usize),
}

struct Req {
    decision: Decision,
    attempts: Attempts,
    engine: usize,
    permit: Option<Permit>,
    sent_at: u64,
    service: u64,
}

#[derive(Debug, Clone, PartialEq)]
struct Stats {
    attempts: [u64; ENGINES],
    requests: u64,
    failed_requests: u64,
}

impl Stats {
    fn share(&self, i: usize) -> f64 {
        self.attempts[i] as f64 / self.attempts.iter().sum::<u64>() as f64
    }
}

struct Sim {
    now: u64,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    rng: Rng,
    fault: Fault,
    running: [usize; ENGINES],
    queues: Vec<VecDeque<usize>>,
    in_flight: [u32; ENGINES],
    trackers: Vec<EngineTracker>,
    guard: EjectionGuard,
    budget: RetryBudget,
    reqs: Vec<Req>,
    stats: Stats,
}

impl Sim {
    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((t, self.seq, ev)));
    }

    /// Asks the attempt machine for request `r`'s next attempt; false when it gives up.
    fn attempt(&mut self, r: usize) -> bool {
        let u = self.rng.unit();
        let req = &mut self.reqs[r];
        let mut fleet = SimFleet(&mut self.trackers);
        match req.attempts.next(
            &req.decision.candidates,
            &mut fleet,
            &mut self.budget,
            self.now,
            u,
        ) {
            Next::Send {
                engine,
                permit,
                backoff_us,
                ..
            } => {
                req.engine = engine;
                req.permit = Some(permit);
                self.at(self.now + backoff_us, Ev::Dispatch(r));
                true
            }
            Next::GiveUp(_) => false,
        }
    }

    /// Request `r`'s attempt reaches its engine.
    fn dispatch(&mut self, r: usize) {
        let e = self.reqs[r].engine;
        self.stats.attempts[e] += 1;
        self.in_flight[e] += 1;
        let req = &mut self.reqs[r];
        req.sent_at = self.now;
        if self.fault == Fault::FailFast && e == ODD {
            self.at(self.now + 5_000, Ev::Fail(r));
        } else {
            let slow = if self.fault == Fault::Slow5x && e == ODD {
                5
            } else {
                1
            };
            req.service = (SECOND + self.rng.below(2 * SECOND as usize) as u64) * slow;
            if self.running[e] < SLOTS {
                self.start(e, r);
            } else {
                self.queues[e].push_back(r);
            }
        }
    }

    fn start(&mut self, e: usize, r: usize) {
        self.running[e] += 1;
        let s = self.reqs[r].service;
        self.at(self.now + s / 10, Ev::FirstByte(r));
        self.at(self.now + s, Ev::End(r));
    }

    fn finish(&mut self, r: usize) -> usize {
        let e = self.reqs[r].engine;
        self.in_flight[e] -= 1;
        e
    }
}

/// The engines' breakers as the attempt machine sees them.
struct SimFleet<'a>(&'a mut [EngineTracker]);

impl Fleet for SimFleet<'_> {
    type Permit = Permit;
    fn try_acquire(&mut self, engine: usize, now_us: u64, ignore_health: bool) -> Option<Permit> {
        if ignore_health {
            self.0[engine].try_acquire_ignoring_health(now_us)
        } else {
            self.0[engine].try_acquire(now_us)
        }
    }
    fn cancel(&mut self, engine: usize, permit: Permit) {
        self.0[engine].on_cancel(permit);
    }
}

/// No prefix side in this simulation.
struct NoPrefix;

impl PrefixProbe for NoPrefix {
    fn held_blocks(&self, _: usize) -> u32 {
        0
    }
    fn events_live(&self, _: usize) -> bool {
        false
    }
}

fn run(kind: PolicyKind, fault: Fault, breakers: bool, seed: u64) -> Stats {
    let mut health = HealthConfig::default();
    health.breaker.enabled = breakers;
    let cfg = PolicyConfig {
        policy: kind,
        ..PolicyConfig::default()
    };
    let members: Vec<EngineMember> = (0..ENGINES)
        .map(|i| EngineMember::new(stable_hash(format!("http://engine-{i}:8000").as_bytes())))
        .collect();
    let policy = Policy::new(&cfg, &members, seed);
    let mut sim = Sim {
        now: 0,
        seq: 0,
        events: BinaryHeap::new(),
        rng: Rng::new(seed),
        fault,
        running: [0; ENGINES],
        queues: vec![VecDeque::new(); ENGINES],
        in_flight: [0; ENGINES],
        trackers: (0..ENGINES)
            .map(|_| EngineTracker::new(&health, 0, false))
            .collect(),
        guard: EjectionGuard::new(&health.ejection),
        budget: RetryBudget::new(&RetryBudgetConfig::default(), 0),
        reqs: Vec::new(),
        stats: Stats {
            attempts: [0; ENGINES],
            requests: 0,
            failed_requests: 0,
        },
    };
    // 60% of the capacity of 7 healthy engines: 0.6 × 7 × 8 slots / 2 s.
    let rate = 0.6 * 7.0 * SLOTS as f64 / 2.0;
    let retry = RetryConfig::default();
    let mut fleet_latency = 0.0;
    let mut next_fleet_update = 0;
    sim.at(0, Ev::Arrival);
    while let Some(Reverse((t, _, ev))) = sim.events.pop() {
        sim.now = t;
        match ev {
            Ev::Arrival => {
                if t >= DURATION {
                    continue;
                }
                let gap = -(1.0 - sim.rng.unit()).ln() / rate * SECOND as f64;
                sim.at(t + gap as u64 + 1, Ev::Arrival);
                if t >= next_fleet_update {
                    let mut l: Vec<f64> = sim
                        .trackers
                        .iter()
                        .map(|k| k.latency().latency_us(t))
                        .collect();
                    fleet_latency = fleet_reference_latency(&mut l);
                    next_fleet_update = t + SECOND;
                }
                let views: Vec<_> = (0..ENGINES)
                    .map(|i| {
                        sim.trackers[i].view(t, 1.0, sim.in_flight[i], None, None, fleet_latency)
                    })
                    .collect();
                let session = sim.rng.below(500) as u64;
                let ctx = RequestCtx::new(sim.rng.next_u64(), t)
                    .with_hash_key(stable_hash(&session.to_le_bytes()));
                let decision = decide::<_, NoPrefix>(&policy, &views, ctx, None, Vec::new());
                sim.budget.on_request(t);
                sim.stats.requests += 1;
                sim.reqs.push(Req {
                    attempts: Attempts::new(&decision, &retry),
                    decision,
                    engine: usize::MAX,
                    permit: None,
                    sent_at: 0,
                    service: 0,
                });
                let r = sim.reqs.len() - 1;
                if !sim.attempt(r) {
                    sim.stats.failed_requests += 1;
                }
            }
            Ev::Dispatch(r) => sim.dispatch(r),
            Ev::FirstByte(r) => {
                let e = sim.reqs[r].engine;
                let ttft = t - sim.reqs[r].sent_at;
                sim.trackers[e].on_first_byte(t, ttft);
            }
            Ev::End(r) => {
                let e = sim.finish(r);
                let permit = sim.reqs[r].permit.expect("sent");
                let e2e = t - sim.reqs[r].sent_at;
                sim.trackers[e].on_success(t, permit, e2e);
                sim.running[e] -= 1;
                if let Some(next) = sim.queues[e].pop_front() {
                    sim.start(e, next);
                }
            }
            Ev::Fail(r) => {
                let e = sim.finish(r);
                let permit = sim.reqs[r].permit.expect("sent");
                let ejected = sim
                    .trackers
                    .iter()
                    .filter(|k| k.breaker().is_ejected())
                    .count();
                let may_open = sim.guard.may_eject(ejected, ENGINES);
                let Action::TryNext { account } = sim.reqs[r]
                    .attempts
                    .on_head(Verdict::Failed(FailKind::Status5xx))
                else {
                    unreachable!("a failure is never delivered")
                };
                assert_eq!(account, Accounting::Failure);
                sim.trackers[e].on_failure(t, permit, may_open);
                if !sim.attempt(r) {
                    sim.stats.failed_requests += 1;
                }
            }
        }
    }
    assert!(
        sim.in_flight.iter().all(|&f| f == 0),
        "every counter back to 0"
    );
    sim.stats
}

fn show(label: &str, kind: PolicyKind, s: &Stats) {
    let shares: Vec<String> = (0..ENGINES)
        .map(|i| format!("{:4.1}", 100.0 * s.share(i)))
        .collect();
    println!(
        "{label:28} {:22} engine {ODD}: {:5.2}%  all: [{}]  failed requests {}/{}",
        kind.as_str(),
        100.0 * s.share(ODD),
        shares.join(" "),
        s.failed_requests,
        s.requests
    );
}

#[test]
fn engine_slowed_5x_gets_at_most_10_percent_under_peak_ewma() {
    for seed in [1, 2, 3] {
        let s = run(PolicyKind::PeakEwma, Fault::Slow5x, true, seed);
        show("slowed x5", PolicyKind::PeakEwma, &s);
        assert!(s.share(ODD) <= 0.10, "seed {seed}: {}", s.share(ODD));
        assert_eq!(s.failed_requests, 0);
    }
}

#[test]
fn engine_slowed_5x_gets_less_than_its_fair_share_under_load_aware_policies() {
    for kind in [
        PolicyKind::WeightedRoundRobin,
        PolicyKind::LeastRequest,
        PolicyKind::PowerOfTwo,
        PolicyKind::ConsistentHash,
    ] {
        let s = run(kind, Fault::Slow5x, true, 7);
        show("slowed x5", kind, &s);
        assert!(
            s.share(ODD) < 1.0 / ENGINES as f64,
            "{kind:?}: {}",
            s.share(ODD)
        );
    }
}

#[test]
fn engine_failing_instantly_gets_at_most_5_percent() {
    for breakers in [true, false] {
        for kind in PolicyKind::ALL {
            let exempt = !breakers && matches!(kind, PolicyKind::RoundRobin | PolicyKind::Random);
            for seed in [11, 12] {
                let s = run(kind, Fault::FailFast, breakers, seed);
                let label = format!(
                    "fail-fast, breakers {}",
                    if breakers { "on" } else { "off" }
                );
                show(&label, kind, &s);
                if !exempt {
                    assert!(
                        s.share(ODD) <= 0.05,
                        "{kind:?} breakers={breakers} seed {seed}: {}",
                        s.share(ODD)
                    );
                }
                // Retries within the budget hide nearly every failure from clients.
                assert!(
                    (s.failed_requests as f64) < 0.01 * s.requests as f64,
                    "{kind:?} breakers={breakers}: {} of {} failed",
                    s.failed_requests,
                    s.requests
                );
            }
        }
    }
}

#[test]
fn simulation_is_deterministic() {
    for kind in PolicyKind::ALL {
        let a = run(kind, Fault::FailFast, true, 5);
        let b = run(kind, Fault::FailFast, true, 5);
        assert_eq!(a, b, "{kind:?}");
    }
}
