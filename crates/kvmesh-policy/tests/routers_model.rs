//! `least_request` at several routers that see each other's in-flight counts late: a seeded,
//! virtual-time model of a closed-loop fleet (no sockets, no clock).
//!
//! Each router knows its own requests at once and its peers' only after the mesh's delay.
//! Each engine ends requests at its own decode-step boundaries, so several of one engine's
//! end at once and their clients' next turns reach the routers together: routers that rank
//! engines by the same stale total take the same least loaded one. Counting a router's own
//! requests above its peers' (`least_request.own_bias`) keeps each router's own requests
//! spread, so simultaneous decisions at different routers go to different engines. That pays
//! while counts are late (the mesh's thread at normal priority on a busy machine). Once they
//! arrive within ~0.2 ms (a real-time mesh thread) the sum alone is as even as one router
//! keeps it, and the bias only costs: with clients sprayed over the routers, each router's own
//! share drifts and the bias turns it away from the least loaded engine. Measured on the
//! bench's fleet alike (BENCHMARKS.md, "The mesh", *A real-time mesh thread*); one difference:
//! with late counts and sprayed clients the fleet did better with the bias, the model without.
//!
//! Each router also splits engines tied for least loaded by its rank among the routers (as
//! the gateway's do, `Policy::with_router_slot`), so routers deciding at once on the same
//! counts take different engines of a tie. With late counts and no bias that takes part of
//! the herd away when clients keep their router; sprayed, it changes little. The fleet
//! measured the same at real-time priority (BENCHMARKS.md, *Ties split by rank*).
//!
//! Before the split, least request breaks ties in the sum by the router's own count (fewer
//! of its own first). With late counts, no bias and clients that keep their router, that
//! takes nearly all the herd away (max/mean 1.009 by the sum alone, 1.001 with it; 8 seeds),
//! as it lowered the fleet's steady-state excess (BENCHMARKS.md, *The own count breaks
//! ties*). `Fleet::blind` ranks by the sum alone, as before.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvmesh_policy::{
    EngineMember, EngineView, LeastRequestConfig, MAX_CANDIDATES, Policy, PolicyConfig, PolicyKind,
    RequestCtx, Rng, RouterSlot, stable_hash,
};

const ENGINES: usize = 8;
const CLIENTS: usize = 96;
/// Simulated run and the warm-up excluded from the samples, µs.
const RUN_US: u64 = 30_000_000;
const WARM_US: u64 = 2_000_000;
/// Decode step: requests end on its boundaries.
const STEP_US: u64 = 20_000;
/// In-flight counts sampled this often (as the bench samples the engines).
const SAMPLE_US: u64 = 20_000;

#[derive(Clone, Copy)]
struct Fleet {
    routers: usize,
    /// Each client keeps one router (`false`: every request goes to the next router).
    sticky: bool,
    own_bias: f64,
    /// Routers split engines tied for least loaded by their rank, as the gateway's do
    /// (`Policy::with_router_slot`); `false`: ties at random.
    split: bool,
    /// Routers rank by the sum alone, blind to their own part of it (`own_in_flight` 0): no
    /// own bias and no tie-break by the own count, as least request ranked before the own
    /// count broke ties. `false`: as the gateway's routers do.
    blind: bool,
    /// How late counts reach the other routers.
    delay: Delay,
    seed: u64,
}

/// How late a router's count reaches its peers.
#[derive(Clone, Copy)]
enum Delay {
    /// The mesh's thread at normal priority on a busy machine, as measured on the bench's
    /// fleet (counts untold at the others: p50 ~0.15 ms, p90 ~0.5 ms, p99 ~2 ms).
    Late,
    /// The mesh's thread at real-time priority (envelope ages p50 ≤ 0.05 ms, p99 ≤ 0.2 ms).
    Realtime,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A client's next request reaches a router.
    Arrive { client: usize },
    /// A request ends at its engine; its router learns it at once.
    End { router: usize, engine: usize },
    /// Router `to` learns that `from` has `count` requests in flight to `engine` (version
    /// `version`: the newest wins, as in the mesh's load entries).
    Tell {
        to: usize,
        from: usize,
        engine: usize,
        count: u32,
        version: u64,
    },
}

struct Model {
    fleet: Fleet,
    /// Each router's policy.
    policies: Vec<Policy>,
    rng: Rng,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    /// `own[r][e]`: router r's requests in flight to engine e.
    own: Vec<[u32; ENGINES]>,
    /// `seen[r][p][e]`: what router r last heard of router p's count at e, and its version.
    seen: Vec<Vec<[(u32, u64); ENGINES]>>,
    version: u64,
    rr: usize,
    decisions: u64,
}

impl Model {
    fn new(fleet: Fleet) -> Model {
        let members: Vec<EngineMember> = (0..ENGINES)
            .map(|i| EngineMember::new(stable_hash(format!("engine-{i}").as_bytes())))
            .collect();
        let mut cfg = PolicyConfig {
            policy: PolicyKind::LeastRequest,
            ..PolicyConfig::default()
        };
        cfg.least_request.own_bias = Some(fleet.own_bias);
        let r = fleet.routers;
        let policies = (0..r)
            .map(|rank| {
                let slot = RouterSlot {
                    rank: rank as u32,
                    routers: if fleet.split { r as u32 } else { 1 },
                };
                Policy::new(&cfg, &members, fleet.seed ^ rank as u64).with_router_slot(slot)
            })
            .collect();
        Model {
            fleet,
            policies,
            rng: Rng::new(fleet.seed),
            queue: BinaryHeap::new(),
            seq: 0,
            own: vec![[0; ENGINES]; r],
            seen: vec![vec![[(0, 0); ENGINES]; r]; r],
            version: 0,
            rr: 0,
            decisions: 0,
        }
    }

    fn at(&mut self, t: u64, e: Event) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, e)));
    }

    /// The delay of one load message (see [`Delay`]).
    fn network_delay(&mut self) -> u64 {
        let r = self.rng.below(100);
        match self.fleet.delay {
            Delay::Late if r < 50 => 50 + self.rng.below(200) as u64,
            Delay::Late if r < 90 => 250 + self.rng.below(350) as u64,
            Delay::Late => 600 + self.rng.below(1_800) as u64,
            Delay::Realtime if r < 99 => 40 + self.rng.below(60) as u64,
            Delay::Realtime => 100 + self.rng.below(100) as u64,
        }
    }

    /// Router `r`'s count at `e` changed at `t`: tell every peer, each after its own delay.
    fn publish(&mut self, t: u64, r: usize, e: usize) {
        self.version += 1;
        for p in 0..self.fleet.routers {
            if p != r {
                let d = self.network_delay();
                let (count, version) = (self.own[r][e], self.version);
                self.at(
                    t + d,
                    Event::Tell {
                        to: p,
                        from: r,
                        engine: e,
                        count,
                        version,
                    },
                );
            }
        }
    }

    fn decide(&mut self, r: usize) -> usize {
        let views: Vec<EngineView> = (0..ENGINES)
            .map(|e| {
                let peers: u32 = (0..self.fleet.routers)
                    .filter(|&p| p != r)
                    .map(|p| self.seen[r][p][e].0)
                    .sum();
                let mut v = EngineView::new(1.0);
                v.in_flight = self.own[r][e] + peers;
                v.own_in_flight = if self.fleet.blind { 0 } else { self.own[r][e] };
                v
            })
            .collect();
        self.decisions += 1;
        let mut out = Vec::with_capacity(MAX_CANDIDATES);
        let ctx = RequestCtx::new(self.fleet.seed ^ self.decisions, 0);
        self.policies[r].pick(&views, &ctx, &mut out);
        out[0]
    }

    /// Runs the fleet; the mean over samples of max/mean in flight per engine.
    fn run(mut self) -> f64 {
        for client in 0..CLIENTS {
            let t = self.rng.below(200_000) as u64;
            self.at(t, Event::Arrive { client });
        }
        let (mut next_sample, mut sum, mut samples) = (WARM_US, 0.0, 0u32);
        while let Some(Reverse((t, _, ev))) = self.queue.pop() {
            while next_sample <= t && next_sample < RUN_US {
                let truth: Vec<u32> = (0..ENGINES)
                    .map(|e| self.own.iter().map(|o| o[e]).sum())
                    .collect();
                let total: u32 = truth.iter().sum();
                if total > 0 {
                    let max = *truth.iter().max().unwrap_or(&0);
                    sum += f64::from(max) * ENGINES as f64 / f64::from(total);
                    samples += 1;
                }
                next_sample += SAMPLE_US;
            }
            if t >= RUN_US {
                break;
            }
            match ev {
                Event::Arrive { client } => {
                    let r = if self.fleet.sticky {
                        client % self.fleet.routers
                    } else {
                        self.rr = (self.rr + 1) % self.fleet.routers;
                        self.rr
                    };
                    let e = self.decide(r);
                    self.own[r][e] += 1;
                    self.publish(t, r, e);
                    // Prefill and decode: 10 to 30 steps, ending on a boundary of the
                    // engine's steps (each engine steps on its own: engines do not end
                    // requests together, as the bench's fleet measured).
                    let steps = 10 + self.rng.below(21) as u64;
                    let phase = (e as u64 * 7_919_000) % STEP_US;
                    let end = ((t + STEP_US - phase) / STEP_US + steps) * STEP_US + phase;
                    self.at(
                        end,
                        Event::End {
                            router: r,
                            engine: e,
                        },
                    );
                    // The client's next turn: its own think and send time after the end.
                    let turn = end + 200 + self.rng.below(400) as u64;
                    self.at(turn, Event::Arrive { client });
                }
                Event::End { router, engine } => {
                    self.own[router][engine] -= 1;
                    self.publish(t, router, engine);
                }
                Event::Tell {
                    to,
                    from,
                    engine,
                    count,
                    version,
                } => {
                    let cell = &mut self.seen[to][from][engine];
                    if version > cell.1 {
                        *cell = (count, version);
                    }
                }
            }
        }
        sum / f64::from(samples.max(1))
    }
}

/// Mean spread over seeds.
fn spread(routers: usize, sticky: bool, own_bias: f64, delay: Delay) -> f64 {
    spread_split(routers, sticky, own_bias, delay, true)
}

/// Mean spread over seeds, the routers splitting ties by rank or not.
fn spread_split(routers: usize, sticky: bool, own_bias: f64, delay: Delay, split: bool) -> f64 {
    spread_with(routers, sticky, own_bias, delay, split, false)
}

/// Mean spread over seeds of routers that rank by the sum alone (see [`Fleet::blind`]).
fn spread_blind(routers: usize, sticky: bool, delay: Delay, split: bool) -> f64 {
    spread_with(routers, sticky, 0.0, delay, split, true)
}

fn spread_with(
    routers: usize,
    sticky: bool,
    own_bias: f64,
    delay: Delay,
    split: bool,
    blind: bool,
) -> f64 {
    let seeds = 1..=8u64;
    let n = seeds.clone().count() as f64;
    seeds
        .map(|seed| {
            Model::new(Fleet {
                routers,
                sticky,
                own_bias,
                split,
                blind,
                delay,
                seed,
            })
            .run()
        })
        .sum::<f64>()
        / n
}

#[test]
fn with_late_counts_routers_that_count_their_own_requests_first_spread_load_as_one_router_does() {
    let bias = LeastRequestConfig::OWN_BIAS_LATE;
    let one = spread(1, true, bias, Delay::Late);
    let blind = spread_blind(3, true, Delay::Late, false);
    let blind_split = spread_blind(3, true, Delay::Late, true);
    let three_flat = spread_split(3, true, 0.0, Delay::Late, false);
    let three_flat_split = spread(3, true, 0.0, Delay::Late);
    let three = spread(3, true, bias, Delay::Late);
    eprintln!(
        "max/mean in flight, late counts: 1 router {one:.4}; 3 routers whose clients keep \
         them: by the sum alone {blind:.4} (ties split by rank {blind_split:.4}), own_bias 0 \
         (own count breaks ties) {three_flat:.4} (split {three_flat_split:.4}), 4 {three:.4}; \
         sprayed: by the sum alone {:.4} (split {:.4}), own_bias 0 {:.4} (split {:.4}), 4 {:.4}",
        spread_blind(3, false, Delay::Late, false),
        spread_blind(3, false, Delay::Late, true),
        spread_split(3, false, 0.0, Delay::Late, false),
        spread(3, false, 0.0, Delay::Late),
        spread(3, false, bias, Delay::Late),
    );
    // One router's own counts are the whole truth: the bias changes nothing there.
    assert!(
        (spread(1, true, 0.0, Delay::Late) - one).abs() < 1e-9,
        "one router: the bias must not change its decisions"
    );
    // Ranking by the late sum alone herds.
    assert!(
        blind > one + 0.005,
        "the model should show the herd: {blind} vs {one}"
    );
    // Splitting ties by rank takes part of the herd away: simultaneous decisions on the same
    // counts no longer pick the same engine of a tie.
    assert!(
        blind_split < blind,
        "ties split by rank {blind_split} vs at random {blind}"
    );
    // The own count as the first tie-break takes nearly all of it away, with or without the
    // split: each router keeps its own share even where the sum cannot tell engines apart.
    for (name, x) in [("ties at random", three_flat), ("split", three_flat_split)] {
        assert!(
            x <= one + 0.002 && x < blind_split,
            "own count breaking ties ({name}) {x} vs 1 router {one}, by the sum {blind_split}"
        );
    }
    assert!(
        three <= one + 0.003,
        "3 routers with the bias {three} vs 1 router {one}"
    );
}

#[test]
fn with_counts_on_time_routers_without_the_bias_spread_load_as_one_router_does() {
    // `own_bias` unset with a real-time mesh thread: 0.
    let one = spread(1, true, 0.0, Delay::Realtime);
    let sticky = spread(3, true, 0.0, Delay::Realtime);
    let spray = spread(3, false, 0.0, Delay::Realtime);
    let spray_bias = spread(3, false, LeastRequestConfig::OWN_BIAS_LATE, Delay::Realtime);
    eprintln!(
        "max/mean in flight, counts within 0.2 ms: 1 router {one:.4}; 3 routers, own_bias 0: \
         clients keep their router {sticky:.4}, sprayed {spray:.4}; sprayed, own_bias 4 \
         {spray_bias:.4}"
    );
    assert!(
        sticky <= one + 0.003,
        "clients keep their router: {sticky} vs {one}"
    );
    assert!(spray <= one + 0.003, "sprayed: {spray} vs {one}");
    // The bias, kept, turns sprayed requests from the least loaded engine.
    assert!(
        spray_bias > spray + 0.03,
        "the model should show what the bias costs: {spray_bias} vs {spray}"
    );
}
