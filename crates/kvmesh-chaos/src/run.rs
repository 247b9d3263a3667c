//! Runs one scenario: the lab up (namespaces, certificates, engines, routers, the mesh
//! formed), a warm-up turn per conversation, then the workload and the timeline together,
//! convergence measured after the last step, in-flight counters after the load, panics in the
//! logs, the lab torn down (and checked gone). Returns the scenario's row of the report.

use crate::client::{self, Live};
use crate::lab::{Lab, Proc};
use crate::rotate::Rotation;
use crate::scenario::{Action, Plan, Scenario, blocked_pairs, delayed_pairs};
use crate::verdict::{self, Observations, Row};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The cluster id of the routers a scenario runs.
const CLUSTER: &str = "chaos";

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    /// Logs, certificates and reports go under `<out>/<scenario>/`.
    pub out: PathBuf,
    /// The `kvmesh` binary to start.
    pub exe: PathBuf,
}

fn wait(within: Duration, ok: impl FnMut() -> bool) -> Option<Duration> {
    wait_every(within, Duration::from_millis(50), ok)
}

/// Polls `ok` every `every` until it holds (how long that took), `within` passes or the run
/// is interrupted (`None`).
pub(crate) fn wait_every(
    within: Duration,
    every: Duration,
    mut ok: impl FnMut() -> bool,
) -> Option<Duration> {
    let t = Instant::now();
    loop {
        if ok() {
            return Some(t.elapsed());
        }
        if t.elapsed() >= within || crate::aborted() {
            return None;
        }
        std::thread::sleep(every);
    }
}

fn healthy(addr: SocketAddr) -> bool {
    client::request(addr, "GET", "/health", b"", Duration::from_secs(2))
        .is_ok_and(|r| r.status == 200)
}

/// The lab's processes and what the network rules are.
struct Cluster {
    lab: Lab,
    plan: Plan,
    routers: Vec<Option<Proc>>,
    router_args: Vec<String>,
    engines: Vec<Option<Proc>>,
    engine_args: Vec<Vec<String>>,
    engine_addrs: Vec<SocketAddr>,
    /// Packets dropped, `(from, to)` (see [`blocked_pairs`]).
    blocked: Vec<(usize, usize)>,
    /// Routers stopped by SIGSTOP (not asked anything until resumed).
    paused: Vec<bool>,
    loss: u32,
    /// The delay in force.
    delay: Option<Delay>,
    live: Arc<Live>,
    /// The certificates every router reads (`kvmesh cert`'s directory).
    tls: PathBuf,
    /// Per-router certificate links, when the scenario rotates its CA.
    rotation: Option<Rotation>,
}

/// A delay in force: `ms` ± `jitter_ms` on the packets between each pair.
struct Delay {
    ms: u32,
    jitter_ms: u32,
    pairs: Vec<(usize, usize)>,
}

impl Cluster {
    fn n(&self) -> usize {
        self.routers.len()
    }

    fn start_engine(&mut self, e: usize) -> Result<(), String> {
        let p = self
            .lab
            .start_engine(&format!("e{e}"), &self.engine_args[e])?;
        self.engines[e] = Some(p);
        let addr = self.engine_addrs[e];
        wait(Duration::from_secs(60), || healthy(addr))
            .ok_or(format!("engine e{e} never became healthy"))?;
        self.live.engines.fetch_add(1, Relaxed);
        Ok(())
    }

    fn start_router(&mut self, i: usize, skew_ms: i64) -> Result<(), String> {
        let mut args = self.router_args.clone();
        let node = format!("r{i}");
        let tls = self
            .rotation
            .as_ref()
            .map_or(self.tls.clone(), |r| r.link(&node));
        args.extend(["--tls-dir".into(), tls.display().to_string()]);
        args.extend(["--node-id".into(), node]);
        for j in (0..self.n()).filter(|&j| j != i) {
            args.extend(["--seed".into(), self.lab.router_mesh(j).to_string()]);
        }
        let p = self.lab.start_router(i, &args, skew_ms)?;
        self.routers[i] = Some(p);
        let addr = self.lab.router_http(i);
        // /health answers 200 once the router is warm (its state pulled from a member).
        wait(Duration::from_secs(60), || healthy(addr))
            .ok_or(format!("router r{i} never became ready"))?;
        self.live.routers[i].store(true, Relaxed);
        Ok(())
    }

    /// Every router's name, running or not.
    fn names(&self) -> Vec<String> {
        (0..self.n()).map(|i| format!("r{i}")).collect()
    }

    fn running_routers(&mut self) -> Vec<usize> {
        (0..self.n())
            .filter(|&i| self.routers[i].as_mut().is_some_and(Proc::running))
            .collect()
    }

    fn apply_rules(&self) -> Result<(), String> {
        for i in 0..self.n() {
            // The rules sit on the receiver: router i drops what comes from these.
            let drop_to: Vec<usize> = self
                .blocked
                .iter()
                .filter_map(|&(from, to)| (to == i).then_some(from))
                .collect();
            let others: Vec<usize> = (0..self.n()).filter(|&j| j != i).collect();
            self.lab.set_rules(i, &drop_to, &others, self.loss)?;
        }
        Ok(())
    }

    /// Each router's delay rule: the peers whose packets it holds on arrival.
    fn apply_delay(&self) -> Result<(), String> {
        let Some(d) = &self.delay else {
            return Ok(());
        };
        let ms = |v: u32| Duration::from_millis(u64::from(v));
        for i in 0..self.n() {
            let from: Vec<usize> = d
                .pairs
                .iter()
                .filter_map(|&(a, b)| (a == i).then_some(b).or((b == i).then_some(a)))
                .collect();
            self.lab.set_delay(i, &from, ms(d.ms), ms(d.jitter_ms))?;
        }
        Ok(())
    }

    /// `r0←r1 51.2` …: each running router's `delta_lag_ms` of each member.
    fn lags(&mut self) -> String {
        let mut out = Vec::new();
        for i in self.running_routers() {
            let c = client::get_json(self.lab.router_http(i), "/admin/cluster");
            for m in c["members"].as_array().into_iter().flatten() {
                if let (Some(name), Some(lag)) = (m["name"].as_str(), m["delta_lag_ms"].as_f64()) {
                    out.push(format!("r{i}←{name} {lag:.1}"));
                }
            }
        }
        format!("{} ms", out.join(", "))
    }

    /// What the delay agents stopped by the last step did, for its log line.
    fn delay_note(&self) -> String {
        self.lab
            .take_stopped_delays()
            .iter()
            .map(|(i, c)| format!("r{i} delay agent: {c}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn engine_admin(&self, e: usize, method: &str, path: &str, body: &str) -> Result<(), String> {
        let r = client::request(
            self.engine_addrs[e],
            method,
            path,
            body.as_bytes(),
            Duration::from_secs(5),
        )
        .map_err(|x| format!("e{e} {path}: {x:?}"))?;
        if r.status / 100 == 2 {
            Ok(())
        } else {
            Err(format!("e{e} {path}: {} {}", r.status, r.text()))
        }
    }

    /// Executes a step; returns a note for the step's log line (may be empty).
    fn act(&mut self, a: &Action) -> Result<String, String> {
        if let Action::Flood {
            router,
            datagrams,
            handshakes,
        } = a
        {
            return self.flood(*router, *datagrams, *handshakes);
        }
        if let Action::RotateCa = a {
            let running: Vec<(usize, SocketAddr)> = self
                .running_routers()
                .into_iter()
                .map(|i| (i, self.lab.router_http(i)))
                .collect();
            let rot = self.rotation.as_ref().ok_or("no rotation material")?;
            return crate::rotate::rotate(rot, &self.names(), &running);
        }
        // Delay: the one-way lag of the last envelope each router received from each member
        // (cluster time, one host: the network delay shows in it), before and under it.
        let lags = match a {
            Action::Delay { .. } => format!("delta lags before: {}", self.lags()),
            Action::Heal if self.delay.is_some() => {
                format!("delta lags under the delay: {}", self.lags())
            }
            _ => String::new(),
        };
        self.act_inner(a)?;
        let notes: Vec<String> = [lags, self.delay_note()]
            .into_iter()
            .filter(|n| !n.is_empty())
            .collect();
        if !notes.is_empty() {
            return Ok(notes.join("; "));
        }
        match a {
            Action::RestartRouter {
                router, skew_ms, ..
            } if *skew_ms != 0 => Ok(self.lag_note(*router)),
            _ => Ok(String::new()),
        }
    }

    /// How the other routers see `router`'s deltas: the lag (their clock − its send time) shows
    /// the skew.
    fn lag_note(&mut self, router: usize) -> String {
        let name = format!("r{router}");
        let mut notes = Vec::new();
        for i in self.running_routers().into_iter().filter(|&i| i != router) {
            let addr = self.lab.router_http(i);
            let mut lag = None;
            wait(Duration::from_secs(5), || {
                let c = client::get_json(addr, "/admin/cluster");
                lag = c["members"].as_array().and_then(|m| {
                    m.iter()
                        .find(|x| x["name"] == name.as_str())
                        .and_then(|x| x["delta_lag_ms"].as_f64())
                });
                lag.is_some()
            });
            notes.push(format!(
                "r{i} sees {name}'s delta lag {}",
                lag.map_or("?".into(), |l| format!("{l:.0} ms"))
            ));
        }
        notes.join(", ")
    }

    fn flood(&self, router: usize, datagrams: u32, handshakes: u32) -> Result<String, String> {
        let (to, from) = (self.lab.router_mesh(router), self.lab.host().into());
        let http = self.lab.router_http(router);
        let udp = || client::get_json(http, "/admin/cluster")["udp_received"]["datagrams"].as_u64();
        let before = udp();
        let sent = crate::flood::flood(to, from, datagrams, 0xC4A05)?;
        let (opened, answers) = if handshakes > 0 {
            crate::flood::half_open(to, from, CLUSTER, handshakes, Duration::from_secs(2))?
        } else {
            (0, 0)
        };
        let counted = match (before, udp()) {
            (Some(b), Some(a)) => format!(
                "; r{router}'s mesh socket counted {} datagrams meanwhile",
                a - b
            ),
            _ => String::new(),
        };
        Ok(format!(
            "{sent} datagrams sent; {opened} half-open handshakes, {answers} answers of the router dropped{counted}"
        ))
    }

    fn act_inner(&mut self, a: &Action) -> Result<(), String> {
        match a {
            Action::Partition { .. } | Action::Isolate { .. } | Action::Cut { .. } => {
                self.blocked = blocked_pairs(a, self.n());
                self.apply_rules()
            }
            Action::Loss { percent } => {
                self.loss = *percent;
                self.apply_rules()
            }
            Action::Delay {
                ms,
                jitter_ms,
                between,
            } => {
                self.delay = Some(Delay {
                    ms: *ms,
                    jitter_ms: *jitter_ms,
                    pairs: delayed_pairs(between.as_deref(), self.n()),
                });
                self.apply_delay()
            }
            Action::Heal => {
                self.blocked.clear();
                self.loss = 0;
                self.delay = None;
                self.lab.heal()
            }
            Action::Flap { .. } => Err("flap is expanded when the scenario is planned".into()),
            Action::KillRouter { router } => {
                self.live.routers[*router].store(false, Relaxed);
                self.paused[*router] = false;
                if let Some(mut p) = self.routers[*router].take() {
                    p.kill();
                }
                Ok(())
            }
            Action::StartRouter { router } => self.start_router(*router, 0),
            Action::PauseRouter { router } | Action::ResumeRouter { router } => {
                let sig = if matches!(a, Action::PauseRouter { .. }) {
                    "STOP"
                } else {
                    "CONT"
                };
                match &self.routers[*router] {
                    Some(p) => p.signal(sig)?,
                    None => return Err(format!("r{router} is not running")),
                }
                self.paused[*router] = matches!(a, Action::PauseRouter { .. });
                Ok(())
            }
            Action::RestartRouter {
                router,
                graceful,
                skew_ms,
            } => {
                self.live.routers[*router].store(false, Relaxed);
                self.paused[*router] = false;
                if let Some(mut p) = self.routers[*router].take() {
                    if *graceful {
                        p.stop(Duration::from_secs(40));
                    } else {
                        p.kill();
                    }
                }
                self.start_router(*router, *skew_ms)
            }
            Action::KillEngine { engine } => {
                if let Some(mut p) = self.engines[*engine].take() {
                    p.kill();
                    self.live.engines.fetch_sub(1, Relaxed);
                }
                Ok(())
            }
            Action::StartEngine { engine } => self.start_engine(*engine),
            Action::EngineFaults { engine, set, clear } => {
                if *clear {
                    self.engine_admin(*engine, "DELETE", "/admin/faults", "")
                } else {
                    let body = serde_json::to_string(set).map_err(|e| e.to_string())?;
                    self.engine_admin(*engine, "POST", "/admin/faults", &body)
                }
            }
            Action::EngineRestart { engine } => {
                self.engine_admin(*engine, "POST", "/admin/restart", "")
            }
            Action::Flood { .. } | Action::RotateCa => {
                Err(format!("{} is run by `act`", a.label()))
            }
        }
    }

    /// Every running router lists exactly the other running routers as members and all
    /// report the same digests.
    fn converged(&mut self) -> bool {
        let up = self.running_routers();
        let mut first: Option<serde_json::Value> = None;
        for &i in &up {
            let c = client::get_json(self.lab.router_http(i), "/admin/cluster");
            let mut names: Vec<String> = c["members"]
                .as_array()
                .map(|m| {
                    m.iter()
                        .filter_map(|x| x["name"].as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            let mut want: Vec<String> = up
                .iter()
                .filter(|&&j| j != i)
                .map(|j| format!("r{j}"))
                .collect();
            want.sort();
            if c.is_null() || names != want {
                return false;
            }
            match &first {
                None => first = Some(c["digests"].clone()),
                Some(d) if *d != c["digests"] => return false,
                Some(_) => {}
            }
        }
        true
    }

    /// Each running router's member count, e.g. `r0:2 r1:2 r2:2`.
    fn view(&mut self) -> String {
        self.running_routers()
            .iter()
            .map(|&i| {
                if self.paused[i] {
                    return format!("r{i}:paused");
                }
                let c = client::get_json(self.lab.router_http(i), "/admin/cluster");
                let m = c["members"]
                    .as_array()
                    .map_or("?".into(), |m| m.len().to_string());
                format!("r{i}:{m}")
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// What is still in flight: routers' `kvmesh_in_flight`, engines' running + waiting.
    fn in_flight(&mut self) -> Vec<String> {
        let mut busy = Vec::new();
        for i in self.running_routers() {
            match client::metric_sum(self.lab.router_http(i), "kvmesh_in_flight") {
                Some(0.0) => {}
                v => busy.push(format!("r{i} kvmesh_in_flight {v:?}")),
            }
        }
        for e in 0..self.engines.len() {
            if !self.engines[e].as_mut().is_some_and(Proc::running) {
                continue;
            }
            for m in ["vllm:num_requests_running", "vllm:num_requests_waiting"] {
                match client::metric_sum(self.engine_addrs[e], m) {
                    Some(0.0) => {}
                    v => busy.push(format!("e{e} {m} {v:?}")),
                }
            }
        }
        busy
    }
}

/// Reads, parses and plans a scenario file without running anything; the error names the
/// file once.
pub fn check_file(path: &Path, quick: bool) -> Result<Plan, String> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{origin}: {e}"))?;
    Scenario::parse(&text, &origin)?
        .plan(quick)
        .map_err(|e| format!("{origin}: {e}"))
}

/// Runs a planned scenario. The lab is torn down before this returns, whatever happened.
pub fn run_plan(plan: Plan, opts: &Options) -> Result<Row, String> {
    let dir = opts.out.join(&plan.name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let n = plan.topology.routers + plan.topology.late_routers;
    if plan
        .steps
        .iter()
        .any(|s| matches!(s.action, Action::Delay { .. }))
    {
        crate::lab::check_iptables()?;
    }
    let lab = Lab::new(n, dir.clone(), opts.exe.clone())?;
    let pid = std::process::id();
    let result = run_in(lab, plan, &dir);
    let left = crate::lab::resources_of(pid);
    if !left.is_empty() {
        return Err(format!("the lab left {left:?} behind"));
    }
    result
}

fn run_in(lab: Lab, plan: Plan, dir: &Path) -> Result<Row, String> {
    let t = &plan.topology;
    let n = t.routers + t.late_routers;
    let tls = dir.join("tls");
    let nodes: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
    cert(&lab.exe, &tls, &nodes)?;
    let rotation = if plan.steps.iter().any(|s| s.action == Action::RotateCa) {
        let next = dir.join("tls-next");
        cert(&lab.exe, &next, &nodes)?;
        Some(Rotation::prepare(dir, &tls, &next, &nodes)?)
    } else {
        None
    };
    let host = lab.engine_ip();
    let mut engine_args = Vec::new();
    let mut engine_addrs = Vec::new();
    let mut entries = Vec::new();
    for e in 0..t.engines {
        let (http, ev, rp) = (lab.free_port(), lab.free_port(), lab.free_port());
        engine_addrs.push(SocketAddr::new(host.into(), http));
        engine_args.push(
            [
                "--listen".to_string(),
                format!("{host}:{http}"),
                "--model".into(),
                "m".into(),
                "--time-scale".into(),
                t.engine_time_scale.to_string(),
                "--seed".into(),
                (e + 1).to_string(),
                "--kv-events".into(),
                format!("tcp://{host}:{ev}"),
                "--kv-events-replay".into(),
                format!("tcp://{host}:{rp}"),
            ]
            .to_vec(),
        );
        entries.push(format!(
            "url=http://{host}:{http},kv_events=tcp://{host}:{ev},kv_replay=tcp://{host}:{rp}"
        ));
    }
    let mut router_args = vec![
        "--policy".to_string(),
        t.policy.clone(),
        "--cluster-id".into(),
        CLUSTER.into(),
        "--ingest-replicas".into(),
        t.ingest_replicas.to_string(),
    ];
    for e in &entries {
        router_args.extend(["--engine".into(), e.clone()]);
    }
    if rotation.is_some() {
        // The routers read their certificate files again while they run (10 s by default).
        let file = dir.join("router.toml");
        let text = format!(
            "[serve.mesh]\ntls_reload_ms = {}\n",
            crate::rotate::RELOAD_MS
        );
        std::fs::write(&file, text).map_err(|e| format!("{}: {e}", file.display()))?;
        router_args.extend(["--config".into(), file.display().to_string()]);
    }
    let live = Arc::new(Live {
        routers: (0..n).map(|_| Default::default()).collect(),
        engines: Default::default(),
    });
    let mut c = Cluster {
        routers: (0..n).map(|_| None).collect(),
        engines: (0..t.engines).map(|_| None).collect(),
        router_args,
        engine_args,
        engine_addrs,
        blocked: Vec::new(),
        paused: vec![false; n],
        loss: 0,
        delay: None,
        live: live.clone(),
        lab,
        plan: plan.clone(),
        tls,
        rotation,
    };
    for e in 0..t.engines {
        c.start_engine(e)?;
    }
    for i in 0..t.routers {
        c.start_router(i, 0)?;
    }
    wait(Duration::from_secs(30), || c.converged()).ok_or("the mesh never formed")?;
    let w = plan.workload.clone();
    let addrs: Vec<SocketAddr> = (0..n).map(|i| c.lab.router_http(i)).collect();
    // One turn per conversation first: the fault-free figure is of warm prefixes.
    for g in 0..w.groups {
        let _ = client::send(g, &w, &addrs[..t.routers]);
    }
    wait(Duration::from_secs(10), || c.converged());
    let t0 = Instant::now();
    let cluster = Arc::new(Mutex::new(c));
    let steps = plan.steps.clone();
    let timeline = {
        let cluster = cluster.clone();
        std::thread::spawn(move || timeline(&cluster, &steps, t0))
    };
    let records = client::run(&w, &addrs, &live, t0);
    let tl = timeline
        .join()
        .map_err(|_| "the timeline thread panicked".to_string())??;
    let mut c = match Arc::try_unwrap(cluster) {
        Ok(m) => m.into_inner().unwrap_or_else(|e| e.into_inner()),
        Err(_) => return Err("the cluster is still shared".into()),
    };
    let in_flight_zero = {
        let mut busy = Vec::new();
        let bound = Duration::from_millis(plan.invariants.in_flight_zero_ms);
        match wait(bound, || {
            busy = c.in_flight();
            busy.is_empty()
        }) {
            Some(d) => Ok(d.as_millis() as u64),
            None => Err(format!(
                "after {} ms: {}",
                bound.as_millis(),
                busy.join(", ")
            )),
        }
    };
    let logs: Vec<(String, PathBuf)> = c
        .routers
        .iter()
        .chain(&c.engines)
        .flatten()
        .map(|p| (p.name.clone(), p.log.clone()))
        .collect();
    // Stop everything before reading the logs: a panic at shutdown counts too.
    for p in c.routers.iter_mut().chain(c.engines.iter_mut()).flatten() {
        p.stop(Duration::from_secs(10));
    }
    let mut panics = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (name, log) in logs
        .into_iter()
        .chain((0..n).map(|i| (format!("r{i}"), dir.join(format!("r{i}.log")))))
        .chain((0..t.engines).map(|e| (format!("e{e}"), dir.join(format!("e{e}.log")))))
    {
        if !seen.insert(log.clone()) {
            continue;
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        panics.extend(
            text.lines()
                .filter(|l| l.contains("panicked at"))
                .map(|l| format!("{name}: {l}")),
        );
    }
    let obs = Observations {
        records,
        during: tl.during,
        convergence_ms: tl.convergence_ms,
        convergence_waited_ms: tl.waited_ms,
        in_flight_zero,
        panics,
    };
    let figures = verdict::figures(&obs);
    let checks = verdict::checks(&obs, &figures, &plan.invariants);
    let row = Row {
        scenario: plan.name.clone(),
        figures,
        checks,
    };
    let steps_log: Vec<String> = tl.log;
    let report = format!(
        "{}\n{}\nsteps:\n{}\nchecks:\n{}\nper router served: {:?}\n",
        plan.name,
        plan.about,
        steps_log.join("\n"),
        row.checks
            .iter()
            .map(|c| format!(
                "  {} {}: {}",
                if c.ok { "ok  " } else { "FAIL" },
                c.name,
                c.detail
            ))
            .collect::<Vec<_>>()
            .join("\n"),
        row.figures.per_router
    );
    let _ = std::fs::write(dir.join("report.txt"), &report);
    print!("{report}");
    drop(c);
    Ok(row)
}

/// `kvmesh cert --out dir --nodes …`: a CA and a pair per node.
fn cert(exe: &Path, dir: &Path, nodes: &[String]) -> Result<(), String> {
    let out = std::process::Command::new(exe)
        .args(["cert", "--out"])
        .arg(dir)
        .args(["--nodes", &nodes.join(",")])
        .output()
        .map_err(|e| format!("kvmesh cert: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "kvmesh cert: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

struct Timeline {
    during: Option<(u64, u64)>,
    convergence_ms: Option<u64>,
    waited_ms: u64,
    log: Vec<String>,
}

fn timeline(
    cluster: &Mutex<Cluster>,
    steps: &[crate::scenario::Step],
    t0: Instant,
) -> Result<Timeline, String> {
    let lock = || cluster.lock().unwrap_or_else(|e| e.into_inner());
    let mut log = Vec::new();
    let mut first = None;
    let mut last_end = None;
    for s in steps {
        let at = t0 + Duration::from_secs_f64(s.at_s);
        while Instant::now() < at {
            if crate::aborted() {
                return Err("interrupted".into());
            }
            std::thread::sleep(Duration::from_millis(10).min(at - Instant::now()));
        }
        let view = lock().view();
        let start = t0.elapsed();
        let note = lock().act(&s.action)?;
        let end = t0.elapsed();
        first.get_or_insert(start);
        last_end = Some(end);
        log.push(format!(
            "  {:>7.2} s … {:>7.2} s  {:<40} (members before: {view}) {note}",
            start.as_secs_f64(),
            end.as_secs_f64(),
            s.action.label()
        ));
    }
    let c = lock();
    let settle = Duration::from_secs_f64(c.plan.workload.settle_s);
    let bound = c.plan.invariants.convergence_ms;
    drop(c);
    // Convergence: polled with the workload still running; waited for up to 3× the bound
    // (at least 10 s) so that a miss reports how far off it was.
    let waited = Duration::from_millis((bound * 3).max(10_000));
    let from = Instant::now();
    let conv = wait(waited, || lock().converged()).map(|_| from.elapsed().as_millis() as u64);
    Ok(Timeline {
        during: first
            .zip(last_end)
            .map(|(a, b)| (a.as_millis() as u64, (b + settle).as_millis() as u64)),
        convergence_ms: conv,
        waited_ms: waited.as_millis() as u64,
        log,
    })
}
