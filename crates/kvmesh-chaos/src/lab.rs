//! The lab: a Linux bridge in the root namespace (the engines and the client live there, on
//! its address), one network namespace per router joined to it by a veth pair, nftables
//! rules inside the routers' namespaces for partitions and loss, and the `kvmesh` processes.
//! Everything is named after the runner's pid and removed on drop — on success, failure,
//! panic and Ctrl-C — and [`sweep`] removes what a runner killed with SIGKILL left.
//!
//! Needs root, iproute2 and nftables (`scripts/install-test-deps.sh` installs them).

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NS_PREFIX: &str = "kvmesh-chaos-";
const HTTP_PORT: u16 = 8080;
const MESH_PORT: u16 = 7946;

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

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes namespaces and bridges of runners that no longer run (and kills what still runs in
/// those namespaces). Returns what it removed.
pub fn sweep() -> Vec<String> {
    let mut removed = Vec::new();
    let list = sh(&["ip", "netns", "list"]).unwrap_or_default();
    for ns in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(rest) = ns.strip_prefix(NS_PREFIX) else {
            continue;
        };
        let owner = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if owner.is_some_and(|p| p != std::process::id() && !pid_alive(p)) {
            for pid in sh(&["ip", "netns", "pids", ns]).unwrap_or_default().lines() {
                let _ = sh(&["kill", "-9", pid.trim()]);
            }
            if sh(&["ip", "netns", "delete", ns]).is_ok() {
                removed.push(format!("netns {ns}"));
            }
        }
    }
    let links = sh(&["ip", "-o", "link", "show", "type", "bridge"]).unwrap_or_default();
    for l in links.lines() {
        let Some(name) = l.split(':').nth(1).map(str::trim) else {
            continue;
        };
        if let Some(p) = name
            .strip_prefix("kvcbr")
            .and_then(|p| p.parse::<u32>().ok())
            && p != std::process::id()
            && !pid_alive(p)
            && sh(&["ip", "link", "delete", name]).is_ok()
        {
            removed.push(format!("bridge {name}"));
        }
    }
    removed
}

/// What a lab consists of, for [`Lab::resources`] (the cleanup check of the tests).
pub fn resources_of(pid: u32) -> Vec<String> {
    let mut out: Vec<String> = sh(&["ip", "netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{NS_PREFIX}{pid}-")))
        .map(|n| format!("netns {n}"))
        .collect();
    let links = sh(&["ip", "-o", "link", "show"]).unwrap_or_default();
    for l in links.lines() {
        let Some(name) = l
            .split(':')
            .nth(1)
            .map(|n| n.trim().split('@').next().unwrap_or(n))
        else {
            continue;
        };
        if name == format!("kvcbr{pid}") || name.starts_with(&format!("kvc{pid}r")) {
            out.push(format!("link {name}"));
        }
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

/// The network of one run: the bridge, its subnet, the routers' namespaces.
pub struct Lab {
    pid: u32,
    net: u8,
    routers: usize,
    bridge: Option<String>,
    namespaces: Vec<String>,
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
            bridge: None,
            namespaces: Vec::new(),
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
        for i in 0..routers {
            let ns = lab.ns(i);
            sh(&["ip", "netns", "add", &ns])?;
            lab.namespaces.push(ns.clone());
            let veth = format!("kvc{pid}r{i}");
            sh(&[
                "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            sh(&["ip", "link", "set", &veth, "master", &br, "up"])?;
            let addr = format!("{}/24", lab.router_ip(i));
            sh(&["ip", "-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        // nftables must work in a namespace before any scenario relies on it.
        lab.heal()?;
        Ok(lab)
    }

    fn ns(&self, i: usize) -> String {
        format!("{NS_PREFIX}{}-r{i}", self.pid)
    }

    /// The bridge's address: engines listen there, the client connects from there.
    pub fn host(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.net, 1)
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

    /// A free TCP port on the host address.
    pub fn free_port(&self) -> Result<u16, String> {
        std::net::TcpListener::bind((self.host(), 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("no free port on {}: {e}", self.host()))
    }

    /// Installs the drop rules of router `i`'s namespace: packets to `drop_to` dropped, packets
    /// to `lossy_to` dropped with probability `loss_pct`%. Replaces the rules in force.
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
            rules.push_str(&format!("    ip daddr {{ {} }} drop\n", set(drop_to)));
        }
        if !lossy_to.is_empty() && loss_pct > 0 {
            rules.push_str(&format!(
                "    ip daddr {{ {} }} numgen random mod 100 < {loss_pct} drop\n",
                set(lossy_to)
            ));
        }
        let ruleset = format!(
            "flush ruleset\ntable inet kvmesh_chaos {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n{rules}  }}\n}}\n"
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

    /// Removes every rule in every router's namespace.
    pub fn heal(&self) -> Result<(), String> {
        (0..self.routers).try_for_each(|i| self.set_rules(i, &[], &[], 0))
    }

    fn spawn(&self, name: &str, ns: Option<&str>, args: &[String]) -> Result<Proc, String> {
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
            .env("RUST_LOG", "warn")
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

    /// Starts `kvmesh sim` on the host address.
    pub fn start_engine(&self, name: &str, args: &[String]) -> Result<Proc, String> {
        let mut a = vec!["sim".to_string()];
        a.extend_from_slice(args);
        self.spawn(name, None, &a)
    }

    /// Starts `kvmesh serve` as router `i` in its namespace (HTTP on :8080, mesh on :7946).
    pub fn start_router(&self, i: usize, args: &[String]) -> Result<Proc, String> {
        let mut a = vec![
            "serve".to_string(),
            "--listen".into(),
            self.router_http(i).to_string(),
            "--mesh-listen".into(),
            self.router_mesh(i).to_string(),
        ];
        a.extend_from_slice(args);
        let ns = self.ns(i);
        self.spawn(&format!("r{i}"), Some(&ns), &a)
    }

    /// What of this lab exists on the machine (namespaces, bridge).
    pub fn resources(&self) -> Vec<String> {
        resources_of(self.pid)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // The veth ends in the root namespace first: a namespace's devices go away
        // asynchronously after `ip netns delete`, and the next lab reuses the names.
        for i in 0..self.routers {
            let _ = sh(&["ip", "link", "delete", &format!("kvc{}r{i}", self.pid)]);
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
