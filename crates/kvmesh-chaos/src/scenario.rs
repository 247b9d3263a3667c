//! Scenario files (`chaos/*.toml`): the topology of routers and engines, the workload, a
//! timeline of faults and the invariants' thresholds. Parsing, validation and the expansion of
//! the timeline (flapping links into partition/heal steps, quick mode) are pure.
//!
//! ```toml
//! name = "partition-halves"
//! about = "two halves of the mesh cannot reach each other for 6 s, then heal"
//! [topology]
//! routers = 4
//! engines = 4
//! [workload]
//! duration_s = 16
//! [invariants]
//! convergence_ms = 8000
//! [[step]]
//! at_s = 3
//! do = "partition"
//! groups = [[0, 1], [2, 3]]
//! [[step]]
//! at_s = 9
//! do = "heal"
//! ```

use serde::Deserialize;

/// A scenario as written in its file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    /// What the scenario is for, one line.
    pub about: String,
    pub topology: Topology,
    #[serde(default)]
    pub workload: Workload,
    /// Overrides of the workload in quick mode (CI).
    #[serde(default)]
    pub quick: Quick,
    #[serde(default)]
    pub invariants: Invariants,
    #[serde(default, rename = "step")]
    pub steps: Vec<Step>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Routers started before the workload (`r0`…).
    pub routers: usize,
    /// Routers started later by a `start_router` step (numbered after the first ones).
    #[serde(default)]
    pub late_routers: usize,
    pub engines: usize,
    /// The routers' policy.
    #[serde(default = "default_policy")]
    pub policy: String,
    /// Routers reading each engine's KV events (0 = all).
    #[serde(default = "default_replicas")]
    pub ingest_replicas: usize,
    /// The simulators' time scale (0.02 = fifty times faster than the modelled GPU).
    #[serde(default = "default_time_scale")]
    pub engine_time_scale: f64,
}

fn default_policy() -> String {
    "precise".into()
}
fn default_replicas() -> usize {
    2
}
fn default_time_scale() -> f64 {
    0.02
}

/// A bounded closed-loop workload: `concurrency` clients, each sending one request at a time,
/// until `duration_s` or `max_requests`, whichever comes first.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Workload {
    pub duration_s: f64,
    pub concurrency: usize,
    pub max_requests: usize,
    /// Conversations (each a long shared system prompt): the prefixes cache-aware routing keeps.
    pub groups: usize,
    pub max_tokens: u32,
    /// A request's deadline across all its attempts (every router, twice).
    pub deadline_s: f64,
    /// One attempt on one router.
    pub attempt_timeout_s: f64,
    /// Seconds after the last step's end that still count as "during" the fault.
    pub settle_s: f64,
    /// Each client's pause between two requests (a bounded rate).
    pub pause_ms: u64,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            duration_s: 16.0,
            concurrency: 3,
            max_requests: 4_000,
            groups: 12,
            max_tokens: 4,
            deadline_s: 30.0,
            attempt_timeout_s: 10.0,
            settle_s: 0.0,
            pause_ms: 25,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quick {
    pub duration_s: Option<f64>,
    pub concurrency: Option<usize>,
    pub max_requests: Option<usize>,
}

/// Thresholds of the invariants (every scenario checks every invariant; these are the bounds).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Invariants {
    /// Live routers' digests (and membership) agree within this long after the last step.
    pub convergence_ms: u64,
    /// Hit rate during the fault ≥ this fraction of the hit rate before it.
    pub hit_rate_during_min: f64,
    /// Hit rate after the fault ≥ this fraction of the hit rate before it.
    pub hit_rate_after_min: f64,
    /// In-flight counters (routers' and engines') back to zero within this long after the load.
    pub in_flight_zero_ms: u64,
}

impl Default for Invariants {
    fn default() -> Self {
        Invariants {
            convergence_ms: 1_000,
            hit_rate_during_min: 0.5,
            hit_rate_after_min: 0.8,
            in_flight_zero_ms: 10_000,
        }
    }
}

/// One step of the timeline, at `at_s` seconds after the workload started.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Step {
    pub at_s: f64,
    #[serde(flatten)]
    pub action: Action,
}

/// What a step does.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "do", rename_all = "snake_case", deny_unknown_fields)]
pub enum Action {
    /// Packets between routers of different groups are dropped (both ways).
    Partition { groups: Vec<Vec<usize>> },
    /// One router cannot reach any other router, nor they it (clients still reach it).
    Isolate { router: usize },
    /// A one-way fault: packets from the routers of `from` to those of `to` are dropped,
    /// while `to` still reaches `from` (a firewall rule on one side, a broken route one way).
    /// Replaces the partition in force, as `partition` and `isolate` do.
    Cut { from: Vec<usize>, to: Vec<usize> },
    /// `times` × (isolate `router` for `down_s`, heal for `up_s`): expanded at load.
    Flap {
        router: usize,
        times: u32,
        down_s: f64,
        up_s: f64,
    },
    /// `percent`% of packets between any two routers dropped at random, each way.
    Loss { percent: u32 },
    /// Every UDP packet between two routers held `ms` ± `jitter_ms` (uniform) before it is
    /// delivered, each way (a round trip gains 2 × `ms`), arrival order kept: between the
    /// pairs of `between`, or between any two routers when it is absent. NFQUEUE, not netem
    /// (chaos/README.md). Replaces a delay in force; `heal` removes it.
    Delay {
        ms: u32,
        #[serde(default)]
        jitter_ms: u32,
        #[serde(default)]
        between: Option<Vec<[usize; 2]>>,
    },
    /// Every network rule removed.
    Heal,
    /// SIGKILL a router.
    KillRouter { router: usize },
    /// SIGSTOP a router: it holds its sockets and its state and answers nothing, as a
    /// process frozen by a stalled disk, a VM paused or a debugger would; `resume_router`
    /// sends SIGCONT.
    PauseRouter { router: usize },
    /// SIGCONT a paused router: it wakes with the state it had, late for everything.
    ResumeRouter { router: usize },
    /// Start a router (a killed one again under the same name, or a late one): returns when
    /// it is ready (warm).
    StartRouter { router: usize },
    /// Stop a router (SIGKILL, or SIGTERM when `graceful`) and start it again, ready; with
    /// `skew_ms`, its wall clock runs that far off from then on (libfaketime), as a router
    /// with a bad clock would.
    RestartRouter {
        router: usize,
        #[serde(default)]
        graceful: bool,
        #[serde(default)]
        skew_ms: i64,
    },
    /// SIGKILL an engine.
    KillEngine { engine: usize },
    /// Start a killed engine again (empty cache, event seq from 0).
    StartEngine { engine: usize },
    /// The simulator's `/admin/faults` patch (`{slowdown = 5}`, `{drop_events = true}`…);
    /// `clear = true` removes every fault instead.
    EngineFaults {
        engine: usize,
        #[serde(default)]
        set: Option<toml::Table>,
        #[serde(default)]
        clear: bool,
    },
    /// The simulator's `/admin/restart`: new engine, empty cache, event seq back to 0.
    EngineRestart { engine: usize },
    /// The cluster CA rotated through the routers' certificate files while they run
    /// (`crate::rotate`): both CAs trusted, then pairs of the new CA, then the old CA dropped,
    /// each phase router by router, each router's reload awaited (10 s at most) before the
    /// next. Once, and with every running router awake.
    RotateCa,
    /// Garbage datagrams (random bytes, and QUIC Initial-shaped packets) and half-open QUIC
    /// handshakes (answers never returned) at a router's mesh port.
    Flood {
        router: usize,
        datagrams: u32,
        #[serde(default)]
        handshakes: u32,
    },
}

impl Action {
    /// A step that ends a fault (the convergence clock starts after the last step of all).
    pub fn label(&self) -> String {
        match self {
            Action::Partition { groups } => format!("partition {groups:?}"),
            Action::Isolate { router } => format!("isolate r{router}"),
            Action::Cut { from, to } => {
                let names = |v: &[usize]| {
                    v.iter()
                        .map(|i| format!("r{i}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                };
                format!("cut {} → {} (one way)", names(from), names(to))
            }
            Action::Flap { router, times, .. } => format!("flap r{router} ×{times}"),
            Action::Loss { percent } => format!("loss {percent}%"),
            Action::Delay {
                ms,
                jitter_ms,
                between,
            } => format!(
                "delay {ms}{} ms {}",
                if *jitter_ms > 0 {
                    format!(" ± {jitter_ms}")
                } else {
                    String::new()
                },
                match between {
                    None => "between all routers".to_string(),
                    Some(p) => format!(
                        "between {}",
                        p.iter()
                            .map(|[a, b]| format!("r{a}–r{b}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                }
            ),
            Action::Heal => "heal".into(),
            Action::KillRouter { router } => format!("kill -9 r{router}"),
            Action::PauseRouter { router } => format!("pause r{router} (SIGSTOP)"),
            Action::ResumeRouter { router } => format!("resume r{router} (SIGCONT)"),
            Action::StartRouter { router } => format!("start r{router}"),
            Action::RestartRouter {
                router,
                graceful,
                skew_ms,
            } => format!(
                "restart r{router}{}{}",
                if *graceful { " (TERM)" } else { "" },
                if *skew_ms != 0 {
                    format!(" with its clock {skew_ms:+} ms off")
                } else {
                    String::new()
                }
            ),
            Action::KillEngine { engine } => format!("kill -9 e{engine}"),
            Action::StartEngine { engine } => format!("start e{engine}"),
            Action::EngineFaults { engine, set, clear } => match (set, clear) {
                (_, true) => format!("e{engine} faults cleared"),
                (Some(t), false) => format!("e{engine} faults {}", t.to_string().trim()),
                (None, false) => format!("e{engine} faults (none)"),
            },
            Action::EngineRestart { engine } => format!("e{engine} cache reset"),
            Action::RotateCa => "rotate the CA (3 phases, router by router)".into(),
            Action::Flood {
                router,
                datagrams,
                handshakes,
            } => format!("flood r{router}: {datagrams} garbage datagrams, {handshakes} half-open"),
        }
    }
}

/// The scenario after validation and expansion: what the runner executes.
#[derive(Debug, Clone)]
pub struct Plan {
    pub name: String,
    pub about: String,
    pub topology: Topology,
    pub workload: Workload,
    pub invariants: Invariants,
    /// Sorted by time; no `Flap` left.
    pub steps: Vec<Step>,
}

impl Scenario {
    /// Parses a scenario file's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Scenario, String> {
        toml::from_str(text).map_err(|e| format!("{origin}: {e}"))
    }

    /// Validates and expands into a [`Plan`]; `quick` applies the `[quick]` overrides.
    pub fn plan(&self, quick: bool) -> Result<Plan, String> {
        let t = &self.topology;
        let all_routers = t.routers + t.late_routers;
        let name = self.name.clone();
        let e = |m: String| -> Result<Plan, String> { Err(format!("{name}: {m}")) };
        if t.routers == 0 || all_routers > 16 {
            return e(format!("routers: 1..=16 in all, got {all_routers}"));
        }
        if t.engines == 0 || t.engines > 16 {
            return e(format!("engines: 1..=16, got {}", t.engines));
        }
        let mut w = self.workload.clone();
        if quick {
            w.duration_s = self.quick.duration_s.unwrap_or(w.duration_s);
            w.concurrency = self.quick.concurrency.unwrap_or(w.concurrency);
            w.max_requests = self.quick.max_requests.unwrap_or(w.max_requests);
        }
        if !(w.duration_s > 0.0 && w.duration_s <= 600.0) {
            return e(format!(
                "workload.duration_s: (0, 600], got {}",
                w.duration_s
            ));
        }
        if w.concurrency == 0 || w.concurrency > 64 || w.max_requests == 0 || w.groups == 0 {
            return e("workload: concurrency 1..=64, max_requests and groups ≥ 1".into());
        }
        if !(w.deadline_s > 0.0 && w.attempt_timeout_s > 0.0 && w.settle_s >= 0.0) {
            return e("workload: deadline_s, attempt_timeout_s > 0, settle_s ≥ 0".into());
        }
        let inv = &self.invariants;
        if !(0.0..=1.0).contains(&inv.hit_rate_during_min)
            || !(0.0..=1.0).contains(&inv.hit_rate_after_min)
        {
            return e("invariants: hit-rate fractions in [0, 1]".into());
        }
        let mut steps = Vec::new();
        for s in &self.steps {
            if !(s.at_s >= 0.0 && s.at_s < w.duration_s) {
                return e(format!(
                    "step `{}` at {} s: outside the workload's {} s",
                    s.action.label(),
                    s.at_s,
                    w.duration_s
                ));
            }
            if let Err(m) = check_indices(&s.action, all_routers, t.engines) {
                return e(m);
            }
            match &s.action {
                Action::Flap {
                    router,
                    times,
                    down_s,
                    up_s,
                } => {
                    if *times == 0 || *down_s <= 0.0 || *up_s < 0.0 {
                        return e("flap: times ≥ 1, down_s > 0, up_s ≥ 0".into());
                    }
                    let mut at = s.at_s;
                    for _ in 0..*times {
                        steps.push(Step {
                            at_s: at,
                            action: Action::Isolate { router: *router },
                        });
                        steps.push(Step {
                            at_s: at + down_s,
                            action: Action::Heal,
                        });
                        at += down_s + up_s;
                    }
                }
                a => steps.push(Step {
                    at_s: s.at_s,
                    action: a.clone(),
                }),
            }
        }
        steps.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        if let Some(last) = steps.last()
            && last.at_s >= w.duration_s
        {
            return e(format!(
                "the timeline ends at {} s, after the workload's {} s",
                last.at_s, w.duration_s
            ));
        }
        // Routers that exist at each step: late routers only after their start; paused
        // ones until they are resumed.
        let mut up: Vec<bool> = (0..all_routers).map(|i| i < t.routers).collect();
        let mut paused = vec![false; all_routers];
        let mut rotated = false;
        for s in &steps {
            let not = |what: &str, router: usize| {
                e(format!("{what} r{router} at {} s: not running", s.at_s))
            };
            match &s.action {
                Action::StartRouter { router } => up[*router] = true,
                Action::KillRouter { router } => {
                    up[*router] = false;
                    paused[*router] = false;
                }
                Action::RestartRouter { router, .. } if !up[*router] => {
                    return not("restart", *router);
                }
                Action::RestartRouter { router, .. } => paused[*router] = false,
                Action::PauseRouter { router } if !up[*router] || paused[*router] => {
                    return not("pause", *router);
                }
                Action::PauseRouter { router } => paused[*router] = true,
                Action::ResumeRouter { router } if !paused[*router] => {
                    return e(format!("resume r{router} at {} s: not paused", s.at_s));
                }
                Action::ResumeRouter { router } => paused[*router] = false,
                Action::RotateCa if rotated => {
                    return e(format!("rotate_ca at {} s: the CA is rotated once", s.at_s));
                }
                Action::RotateCa => {
                    if let Some(i) = paused.iter().position(|&p| p) {
                        return e(format!(
                            "rotate_ca at {} s: r{i} is paused and cannot take it",
                            s.at_s
                        ));
                    }
                    rotated = true;
                }
                _ => {}
            }
            if !up.iter().zip(&paused).any(|(&u, &p)| u && !p) {
                return e(format!(
                    "at {} s no router is running: the client cannot be served",
                    s.at_s
                ));
            }
        }
        Ok(Plan {
            name: self.name.clone(),
            about: self.about.clone(),
            topology: t.clone(),
            workload: w,
            invariants: inv.clone(),
            steps,
        })
    }
}

fn check_indices(a: &Action, routers: usize, engines: usize) -> Result<(), String> {
    let r = |i: usize| {
        if i < routers {
            Ok(())
        } else {
            Err(format!("`{}`: no router r{i}", a.label()))
        }
    };
    let en = |i: usize| {
        if i < engines {
            Ok(())
        } else {
            Err(format!("`{}`: no engine e{i}", a.label()))
        }
    };
    match a {
        Action::Partition { groups } => {
            let mut seen = vec![false; routers];
            for &i in groups.iter().flatten() {
                r(i)?;
                if std::mem::replace(&mut seen[i], true) {
                    return Err(format!("`{}`: r{i} in two groups", a.label()));
                }
            }
            if groups.len() < 2 {
                return Err(format!("`{}`: at least two groups", a.label()));
            }
            Ok(())
        }
        Action::Cut { from, to } => {
            for &i in from.iter().chain(to) {
                r(i)?;
            }
            if from.is_empty() || to.is_empty() || from.iter().any(|i| to.contains(i)) {
                return Err(format!(
                    "`{}`: `from` and `to` each list routers, none in both",
                    a.label()
                ));
            }
            Ok(())
        }
        Action::Isolate { router }
        | Action::Flap { router, .. }
        | Action::KillRouter { router }
        | Action::PauseRouter { router }
        | Action::ResumeRouter { router }
        | Action::StartRouter { router }
        | Action::Flood { router, .. } => r(*router),
        Action::RestartRouter {
            router, skew_ms, ..
        } => {
            r(*router)?;
            if skew_ms.abs() > 60_000 {
                return Err(format!("`{}`: skew_ms within ±60 000", a.label()));
            }
            Ok(())
        }
        Action::Loss { percent } if *percent == 0 || *percent > 100 => {
            Err(format!("`{}`: percent in 1..=100", a.label()))
        }
        Action::Delay {
            ms,
            jitter_ms,
            between,
        } => {
            if !(1..=2000).contains(ms) {
                return Err(format!("`{}`: ms in 1..=2000", a.label()));
            }
            if jitter_ms > ms {
                return Err(format!("`{}`: jitter_ms ≤ ms", a.label()));
            }
            if let Some(pairs) = between {
                if pairs.is_empty() {
                    return Err(format!(
                        "`{}`: `between` lists pairs of routers (omit it for all)",
                        a.label()
                    ));
                }
                for &[x, y] in pairs {
                    r(x)?;
                    r(y)?;
                    if x == y {
                        return Err(format!("`{}`: a pair of one router r{x}", a.label()));
                    }
                }
            }
            Ok(())
        }
        Action::KillEngine { engine }
        | Action::StartEngine { engine }
        | Action::EngineRestart { engine } => en(*engine),
        Action::EngineFaults { engine, set, clear } => {
            en(*engine)?;
            if set.is_some() == *clear {
                return Err(format!("`{}`: either `set` or `clear = true`", a.label()));
            }
            Ok(())
        }
        Action::Loss { .. } | Action::Heal | Action::RotateCa => Ok(()),
    }
}

/// The pairs of routers whose packets a delay holds (`between`, or every pair), each
/// `(low, high)`, sorted, without repeats.
pub fn delayed_pairs(between: Option<&[[usize; 2]]>, routers: usize) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = match between {
        Some(p) => p.iter().map(|&[a, b]| (a.min(b), a.max(b))).collect(),
        None => (0..routers)
            .flat_map(|a| (a + 1..routers).map(move |b| (a, b)))
            .collect(),
    };
    out.sort_unstable();
    out.dedup();
    out
}

/// Which packets between routers are dropped, from the rules in force: `(from, to)`, the
/// packets from router `from` to router `to`. `Partition`: both ways between routers of
/// different groups (routers in no group reach everyone); `Isolate`: both ways between the
/// router and every other; `Cut`: from each of `from` to each of `to` only.
pub fn blocked_pairs(a: &Action, routers: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    match a {
        Action::Partition { groups } => {
            for (gi, g) in groups.iter().enumerate() {
                for h in &groups[gi + 1..] {
                    for &x in g {
                        for &y in h {
                            out.extend([(x, y), (y, x)]);
                        }
                    }
                }
            }
        }
        Action::Isolate { router } => {
            for y in (0..routers).filter(|y| y != router) {
                out.extend([(*router, y), (y, *router)]);
            }
        }
        Action::Cut { from, to } => {
            for &x in from {
                out.extend(to.iter().map(|&y| (x, y)));
            }
        }
        _ => {}
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests;
