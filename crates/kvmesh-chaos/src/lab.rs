//! The lab: a Linux bridge in the root namespace (the engines and the client live there, on
//! its address), one network namespace per router joined to it by a veth pair, nftables
//! rules inside the routers' namespaces for partitions and loss, and the `kvmesh` processes.
//! Everything is named after the runner's pid and removed on drop — on success, failure,
//! panic and Ctrl-C — and [`sweep`] removes what a runner killed with SIGKILL left.
//!
//! Delay: an iptables-nft NFQUEUE rule per router namespace and a [`delay::Agent`] thread
//! bound to that queue inside it (crate::delay).
//!
//! Needs root, iproute2 and nftables, and iptables for delay (`scripts/install-test-deps.sh`
//! installs them).

use crate::delay;

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NS_PREFIX: &str = "kvmesh-chaos-";
const HTTP_PORT: u16 = 8080;
const MESH_PORT: u16 = 7946;
/// libfaketime (Debian `libfaketime`): the clock-skew step preloads it into a router.
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
/// The NFQUEUE number of the delay rules (queues are per network namespace).
pub const DELAY_QUEUE: u16 = 7946;

/// Whether `iptables` (iptables-nft: the NFQUEUE xt target through nft_compat) can run: the
/// delay step needs it, the kernel's nftables `queue` statement being absent here.
pub fn check_iptables() -> Result<(), String> {
    match Command::new("iptables")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "`iptables --version` failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!(
            "iptables: {e} — the delay step needs iptables (Debian package `iptables`, the \
             iptables-nft variant; scripts/install-test-deps.sh installs it)"
        )),
    }
}

fn sh(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e} (is it installed?)", args[0]))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether a process runs (a zombie does not).
fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
        st.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    })
}

/// The lab's links in the root namespace: `(owner pid, name)` of the bridge `kvcbr<pid>` and
/// the veth ends `kvc<pid>r<i>` / `kvc<pid>e`.
fn links() -> Vec<(u32, String)> {
    let out = sh(&["ip", "-o", "link", "show"]).unwrap_or_default();
    out.lines()
        .filter_map(|l| {
            let name = l.split(':').nth(1)?.trim();
            let name = name.split('@').next().unwrap_or(name);
            let digits = name
                .strip_prefix("kvcbr")
                .or_else(|| name.strip_prefix("kvc"))?;
            let pid: String = digits.chars().take_while(char::is_ascii_digit).collect();
            Some((pid.parse().ok()?, name.to_string()))
        })
        .collect()
}

/// Removes the namespaces (killing what runs in them) and links of runners that no longer run
/// (a runner killed with SIGKILL). Returns what it removed. A dead runner's delay leaves
/// nothing else to sweep: its agents were threads of it (gone with it; the kernel unbinds their
/// queues, and `--queue-bypass` lets packets through meanwhile) and its iptables rules live in
/// its namespaces, deleted here.
pub fn sweep() -> Vec<String> {
    let me = std::process::id();
    let mut removed = Vec::new();
    let list = sh(&["ip", "netns", "list"]).unwrap_or_default();
    for ns in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(rest) = ns.strip_prefix(NS_PREFIX) else {
            continue;
        };
        let owner = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if owner.is_some_and(|p| p != me && !pid_alive(p)) {
            for pid in sh(&["ip", "netns", "pids", ns]).unwrap_or_default().lines() {
                let _ = sh(&["kill", "-9", pid.trim()]);
            }
            if sh(&["ip", "netns", "delete", ns]).is_ok() {
                removed.push(format!("netns {ns}"));
            }
        }
    }
    for (p, name) in links() {
        if p != me && !pid_alive(p) && sh(&["ip", "link", "delete", &name]).is_ok() {
            removed.push(format!("link {name}"));
        }
    }
    removed
}

/// What of runner `pid`'s lab exists on the machine (namespaces — with the iptables rules in
/// them —, links and, for this process, delay agents): empty once torn down.
pub fn resources_of(pid: u32) -> Vec<String> {
    let mut out: Vec<String> = sh(&["ip", "netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{NS_PREFIX}{pid}-")))
        .map(|n| format!("netns {n}"))
        .collect();
    out.extend(
        links()
            .into_iter()
            .filter(|(p, _)| *p == pid)
            .map(|(_, n)| format!("link {n}")),
    );
    if pid == std::process::id() && delay::running() > 0 {
        out.push(format!("{} delay agent(s) running", delay::running()));
    }
    out
}

/// A `kvmesh` process of the lab; its stderr goes to `log`.
pub struct Proc {
    pub name: String,
    pub child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends `signal` (`STOP`, `CONT`) to the process.
    pub fn signal(&self, signal: &str) -> Result<(), String> {
        match &self.child {
            Some(c) => sh(&["kill", &format!("-{signal}"), &c.id().to_string()]).map(|_| ()),
            None => Err(format!("{}: not running", self.name)),
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if let Some(c) = self.child.as_mut() {
            let _ = sh(&["kill", "-TERM", &c.id().to_string()]);
            let t = Instant::now();
            while t.elapsed() < grace {
                if !matches!(c.try_wait(), Ok(None)) {
                    self.child = None;
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.kill();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The network of one run: the bridge, its subnet, the routers' namespaces and the engines'.
pub struct Lab {
    pid: u32,
    net: u8,
    routers: usize,
    next_port: std::cell::Cell<u16>,
    bridge: Option<String>,
    namespaces: Vec<String>,
    /// Routers whose namespace has delay rules, with the agent holding their packets.
    delays: std::sync::Mutex<Vec<(usize, delay::Agent)>>,
    /// The final counters of the agents stopped since [`Lab::take_stopped_delays`].
    stopped: std::sync::Mutex<Vec<(usize, delay::Counts)>>,
    pub dir: PathBuf,
    pub exe: PathBuf,
}

impl Lab {
    /// Creates the bridge and `routers` namespaces. `dir` receives logs and certificates.
    pub fn new(routers: usize, dir: PathBuf, exe: PathBuf) -> Result<Lab, String> {
        sweep();
        let pid = std::process::id();
        let mut lab = Lab {
            pid,
            net: (pid % 200) as u8 + 20,
            routers,
            next_port: std::cell::Cell::new(20_000),
            bridge: None,
            namespaces: Vec::new(),
            delays: Default::default(),
            stopped: Default::default(),
            dir,
            exe,
        };
        let br = format!("kvcbr{pid}");
        sh(&["ip", "link", "add", &br, "type", "bridge"])
            .map_err(|e| format!("{e} (the chaos suite needs root and iproute2)"))?;
        lab.bridge = Some(br.clone());
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", lab.host()),
            "dev",
            &br,
        ])?;
        sh(&["ip", "link", "set", &br, "up"])?;
        // Routers 0.., then the engines' namespace (index `routers`).
        for i in 0..=routers {
            let ns = lab.ns(i);
            sh(&["ip", "netns", "add", &ns])?;
            lab.namespaces.push(ns.clone());
            let veth = lab.veth(i);
            sh(&[
                "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            sh(&["ip", "link", "set", &veth, "master", &br, "up"])?;
            let ip = if i == routers {
                lab.engine_ip()
            } else {
                lab.router_ip(i)
            };
            let addr = format!("{ip}/24");
            sh(&["ip", "-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        // nftables must work in a namespace before any scenario relies on it.
        lab.heal()?;
        Ok(lab)
    }

    /// Router `i`'s namespace; `i == routers`: the engines'.
    pub fn ns(&self, i: usize) -> String {
        if i == self.routers {
            format!("{NS_PREFIX}{}-engines", self.pid)
        } else {
            format!("{NS_PREFIX}{}-r{i}", self.pid)
        }
    }

    fn veth(&self, i: usize) -> String {
        if i == self.routers {
            format!("kvc{}e", self.pid)
        } else {
            format!("kvc{}r{i}", self.pid)
        }
    }

    /// The bridge's address: the client and the flood connect from there.
    pub fn host(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.net, 1)
    }

    /// The engines' address (their own namespace).
    pub fn engine_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.net, 2)
    }

    pub fn router_ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.net, 10 + i as u8)
    }

    pub fn router_http(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.router_ip(i).into(), HTTP_PORT)
    }

    pub fn router_mesh(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.router_ip(i).into(), MESH_PORT)
    }

    /// A port of the engines' namespace not handed out before (nothing else runs there).
    pub fn free_port(&self) -> u16 {
        let p = self.next_port.get();
        self.next_port.set(p + 1);
        p
    }

    /// Installs the drop rules of router `i`'s namespace: packets from `drop_to` dropped, packets
    /// from `lossy_to` dropped with probability `loss_pct`%. Replaces the rules in force. The
    /// rules sit on the input hook: the sender sees its packet leave (no send error, as with a
    /// real network fault) and it never arrives.
    pub fn set_rules(
        &self,
        i: usize,
        drop_to: &[usize],
        lossy_to: &[usize],
        loss_pct: u32,
    ) -> Result<(), String> {
        let set = |v: &[usize]| {
            v.iter()
                .map(|&j| self.router_ip(j).to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut rules = String::new();
        if !drop_to.is_empty() {
            rules.push_str(&format!("    ip saddr {{ {} }} drop\n", set(drop_to)));
        }
        if !lossy_to.is_empty() && loss_pct > 0 {
            rules.push_str(&format!(
                "    ip saddr {{ {} }} numgen random mod 100 < {loss_pct} drop\n",
                set(lossy_to)
            ));
        }
        // Only this chain's rules are replaced: the delay rules (iptables-nft's `ip filter`
        // table) stay. The chain is flushed, never deleted: unregistering a hook makes the
        // kernel drop every packet queued to NFQUEUE in the namespace (nfqnl_nf_hook_drop), i.e.
        // the packets a delay agent holds.
        let ruleset = format!(
            "table inet kvmesh_chaos {{\n  chain inbound {{\n    type filter hook input priority 0; policy accept;\n  }}\n}}\nflush chain inet kvmesh_chaos inbound\ntable inet kvmesh_chaos {{\n  chain inbound {{\n{rules}  }}\n}}\n"
        );
        let path = self.dir.join(format!("nft-r{i}.conf"));
        std::fs::write(&path, ruleset).map_err(|e| format!("{}: {e}", path.display()))?;
        sh(&[
            "ip",
            "netns",
            "exec",
            &self.ns(i),
            "nft",
            "-f",
            path.to_str().unwrap_or_default(),
        ])
        .map(|_| ())
    }

    fn iptables(&self, i: usize, args: &[&str]) -> Result<String, String> {
        let ns = self.ns(i);
        let mut a = vec!["ip", "netns", "exec", &ns, "iptables", "-w"];
        a.extend_from_slice(args);
        sh(&a)
    }

    /// Delays the UDP packets router `i` receives from `from` by `delay` ± `jitter`: an agent
    /// bound to NFQUEUE [`DELAY_QUEUE`] in its namespace, then an iptables-nft rule on the
    /// input path (the receiving side, as the loss rules) sending those packets to the queue,
    /// `--queue-bypass`: with no agent bound they pass undelayed. Replaces router `i`'s delay.
    pub fn set_delay(
        &self,
        i: usize,
        from: &[usize],
        delay: Duration,
        jitter: Duration,
    ) -> Result<(), String> {
        self.clear_delay(i)?;
        if from.is_empty() {
            return Ok(());
        }
        check_iptables()?;
        let agent = delay::Agent::start(&self.ns(i), DELAY_QUEUE, delay, jitter)?;
        self.delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((i, agent));
        let sources = from
            .iter()
            .map(|&j| self.router_ip(j).to_string())
            .collect::<Vec<_>>()
            .join(",");
        let q = DELAY_QUEUE.to_string();
        self.iptables(
            i,
            &[
                "-A",
                "INPUT",
                "-p",
                "udp",
                "-s",
                &sources,
                "-j",
                "NFQUEUE",
                "--queue-num",
                &q,
                "--queue-bypass",
            ],
        )
        .map(|_| ())
    }

    /// Router `i`'s delay rules removed and its agent stopped (held packets accepted at once);
    /// checks that no NFQUEUE rule is left.
    fn clear_delay(&self, i: usize) -> Result<(), String> {
        let agents: Vec<delay::Agent> = {
            let mut d = self.delays.lock().unwrap_or_else(|e| e.into_inner());
            let (mine, rest) = d.drain(..).partition(|(r, _)| *r == i);
            *d = rest;
            mine.into_iter().map(|(_, a)| a).collect()
        };
        if agents.is_empty() {
            return Ok(());
        }
        // Rules first: packets then pass the input hook undelayed; the agent then releases
        // what it holds.
        self.iptables(i, &["-F", "INPUT"])?;
        let mut stopped = self.stopped.lock().unwrap_or_else(|e| e.into_inner());
        for mut a in agents {
            a.stop();
            stopped.push((i, a.stats().counts()));
        }
        drop(stopped);
        let left = self.iptables(i, &["-S", "INPUT"])?;
        if left.contains("NFQUEUE") {
            return Err(format!("r{i}: NFQUEUE rules left after clearing: {left}"));
        }
        Ok(())
    }

    /// Each delay agent's counters, e.g. `r1: 120 held, 120 released, …`.
    pub fn delay_counts(&self) -> Vec<(usize, delay::Counts)> {
        self.delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(i, a)| (*i, a.stats().counts()))
            .collect()
    }

    /// The final counters of the agents stopped (by heal or a new delay) since the last call:
    /// every held packet released by then.
    pub fn take_stopped_delays(&self) -> Vec<(usize, delay::Counts)> {
        std::mem::take(&mut *self.stopped.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Removes every rule in every router's namespace and stops the delay agents.
    pub fn heal(&self) -> Result<(), String> {
        (0..self.routers).try_for_each(|i| {
            self.set_rules(i, &[], &[], 0)?;
            self.clear_delay(i)
        })
    }

    fn spawn(
        &self,
        name: &str,
        ns: Option<&str>,
        args: &[String],
        env: &[(String, String)],
    ) -> Result<Proc, String> {
        let log = self.dir.join(format!("{name}.log"));
        let err = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.exe);
                c
            }
            None => Command::new(&self.exe),
        };
        let child = cmd
            .args(args)
            .env(
                "RUST_LOG",
                "warn,kvmesh_mesh=info,kvmesh_gateway::cluster=info",
            )
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .map_err(|e| format!("spawn {name}: {e}"))?;
        Ok(Proc {
            name: name.into(),
            child: Some(child),
            log,
        })
    }

    /// Starts `kvmesh sim` in the engines' namespace.
    pub fn start_engine(&self, name: &str, args: &[String]) -> Result<Proc, String> {
        let mut a = vec!["sim".to_string()];
        a.extend_from_slice(args);
        let ns = self.ns(self.routers);
        self.spawn(name, Some(&ns), &a, &[])
    }

    /// Starts `kvmesh serve` as router `i` in its namespace (HTTP on :8080, mesh on :7946).
    /// `skew_ms` ≠ 0: the router's wall clock runs that far off (libfaketime; monotonic time
    /// untouched).
    pub fn start_router(&self, i: usize, args: &[String], skew_ms: i64) -> Result<Proc, String> {
        let mut a = vec![
            "serve".to_string(),
            "--listen".into(),
            self.router_http(i).to_string(),
            "--mesh-listen".into(),
            self.router_mesh(i).to_string(),
        ];
        a.extend_from_slice(args);
        let ns = self.ns(i);
        let mut env = Vec::new();
        if skew_ms != 0 {
            if !std::path::Path::new(FAKETIME).exists() {
                return Err(format!(
                    "{FAKETIME} missing: install libfaketime (clock skew)"
                ));
            }
            env = vec![
                ("LD_PRELOAD".to_string(), FAKETIME.to_string()),
                (
                    "FAKETIME".into(),
                    format!("{:+.3}", skew_ms as f64 / 1000.0),
                ),
                ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
            ];
        }
        self.spawn(&format!("r{i}"), Some(&ns), &a, &env)
    }

    /// What of this lab exists on the machine (namespaces, bridge).
    pub fn resources(&self) -> Vec<String> {
        resources_of(self.pid)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // The delay agents first (threads of this process): their rules go with the namespaces.
        for i in 0..self.routers {
            let _ = self.clear_delay(i);
        }
        self.delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        // The veth ends in the root namespace first: a namespace's devices go away
        // asynchronously after `ip netns delete`, and the next lab reuses the names.
        for i in 0..=self.routers {
            let _ = sh(&["ip", "link", "delete", &self.veth(i)]);
        }
        for ns in self.namespaces.drain(..) {
            for pid in sh(&["ip", "netns", "pids", &ns])
                .unwrap_or_default()
                .lines()
            {
                let _ = sh(&["kill", "-9", pid.trim()]);
            }
            let _ = sh(&["ip", "netns", "delete", &ns]);
        }
        if let Some(br) = self.bridge.take() {
            let _ = sh(&["ip", "link", "delete", &br]);
        }
    }
}
