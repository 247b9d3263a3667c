//! `kvmesh up`: a local cluster on loopback — simulated engines publishing KV events and
//! meshed routers in front of them — for a new user's first ten minutes. It prints what
//! started where, runs a demonstration (the same workload under round robin and under kvmesh
//! on the same engines, [`crate::up_demo`]), shows what to try (a `curl` and an `openai`
//! snippet), then keeps serving until Ctrl-C and stops everything. Logs go to a file (or to
//! stderr with `-v`): stdout is for the human.
//!
//! `--compare p1,p2,...` is the older policy comparison ([`crate::up_compare`]).

use crate::{fleet, up_compare, up_demo};
use clap::Args;
use kvmesh_bench::SharedPrefixWorkload;
use kvmesh_config::{PolicyKind, ServeConfig, SimConfig};
use kvmesh_gateway::GatewayServer;
use std::path::PathBuf;
use std::time::Duration;

fn w() -> SharedPrefixWorkload {
    up_demo::workload()
}

/// The router's default port (`[serve] listen`): `kvmesh up`'s first port.
fn default_base_port() -> u16 {
    ServeConfig::default()
        .listen
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(8080)
}

/// Flags of `kvmesh up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Simulated engines to start.
    #[arg(long, default_value_t = 4)]
    pub engines: u32,
    /// Routers to start in front of all engines, meshed (0 = no router: clients spread their
    /// requests over the engines round robin).
    #[arg(long, default_value_t = 3)]
    pub routers: u32,
    #[arg(long, default_value_t = default_base_port(), help = format!(
        "First port: routers on PORT.., their mesh (UDP) next, then the engines' HTTP, KV-event \
         and replay ports; every port is printed (0 = ports chosen by the OS; --compare \
         always lets the OS choose, each policy on fresh engines) [default: {}, the router's \
         default port]", default_base_port()), hide_default_value = true)]
    pub base_port: u16,
    /// Start the cluster without the demonstration.
    #[arg(long)]
    pub no_demo: bool,
    /// Stop after the demonstration instead of serving until Ctrl-C (scripts and tests).
    #[arg(long)]
    pub exit_after_demo: bool,
    /// Logs on stderr instead of a file.
    #[arg(short, long)]
    pub verbose: bool,
    /// Where the logs go without -v (default: kvmesh-up-<pid>.log in the temporary directory;
    /// removed at exit when nothing was logged).
    #[arg(long, value_name = "PATH")]
    pub log_file: Option<PathBuf>,
    /// Run the routers as independent replicas (no shared state).
    #[arg(long)]
    pub no_mesh: bool,
    /// Routing policy of the routers [default: precise, with the engines publishing KV events].
    #[arg(long, value_name = "NAME", value_parser = parse_policy)]
    pub policy: Option<PolicyKind>,
    /// Run the workload once per policy (comma-separated), each on fresh engines, and print a
    /// comparison table (e.g. round_robin,least_request,cache_aware,precise,scored).
    #[arg(long, value_name = "P1,P2,...", value_delimiter = ',', value_parser = parse_policy, conflicts_with_all = ["policy", "no_demo"])]
    pub compare: Vec<PolicyKind>,
    /// Time scale of the engines (0.5 = twice as fast as real time).
    #[arg(long, default_value_t = up_demo::TIME_SCALE)]
    pub time_scale: f64,
    #[arg(long, value_name = "BLOCKS", help = format!(
        "KV-cache capacity of each engine in blocks of 16 tokens [default: {}: a few groups' \
         system prompts per engine, not all of them, as on a busy GPU; the simulator's own \
         default is {}]", up_demo::KV_BLOCKS, SimConfig::default().engine.num_blocks))]
    pub kv_blocks: Option<u32>,
    #[arg(long, help = format!("Demo workload: groups sharing a system prompt [default: {}]", w().groups))]
    pub groups: Option<u32>,
    #[arg(long, help = format!("Demo workload: users per group [default: {}]", w().users))]
    pub users: Option<u32>,
    #[arg(long, help = format!("Demo workload: turns per conversation [default: {}]", w().turns))]
    pub turns: Option<u32>,
    #[arg(long, help = format!("Demo workload: words per system prompt, ≈ 1.3 tokens each [default: {}]", w().system_words))]
    pub system_words: Option<u32>,
    #[arg(long, help = format!("Demo workload: words per question [default: {}]", w().question_words))]
    pub question_words: Option<u32>,
    #[arg(long, help = format!("Demo workload: completion tokens per turn [default: {}]", w().max_tokens))]
    pub max_tokens: Option<u32>,
    #[arg(long, help = format!("Demo workload: seed of the texts [default: {}]", w().seed))]
    pub workload_seed: Option<u64>,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = up_demo::CONCURRENCY)]
    pub concurrency: usize,
    /// Interval of the routers' in-flight samples, milliseconds (`--compare`).
    #[arg(long, default_value_t = 20)]
    pub sample_ms: u64,
}

impl UpArgs {
    /// The demo workload: the defaults with the flags applied.
    pub fn workload(&self) -> SharedPrefixWorkload {
        let d = w();
        SharedPrefixWorkload {
            groups: self.groups.unwrap_or(d.groups),
            users: self.users.unwrap_or(d.users),
            turns: self.turns.unwrap_or(d.turns),
            system_words: self.system_words.unwrap_or(d.system_words),
            question_words: self.question_words.unwrap_or(d.question_words),
            max_tokens: self.max_tokens.unwrap_or(d.max_tokens),
            seed: self.workload_seed.unwrap_or(d.seed),
        }
    }

    /// KV blocks per engine.
    pub fn kv_blocks(&self) -> u32 {
        self.kv_blocks.unwrap_or(up_demo::KV_BLOCKS)
    }
}

pub(crate) fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    PolicyKind::ALL
        .iter()
        .copied()
        .find(|p| p.as_str() == s.trim())
        .ok_or_else(|| {
            let all: Vec<_> = PolicyKind::ALL.iter().map(|p| p.as_str()).collect();
            format!("unknown policy `{s}` (one of {})", all.join(", "))
        })
}

/// Where `kvmesh up` writes its logs (`None`: stderr, with `-v`).
pub fn log_file(a: &UpArgs) -> Option<PathBuf> {
    (!a.verbose).then(|| {
        a.log_file.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("kvmesh-up-{}.log", std::process::id()))
        })
    })
}

/// The ports of a cluster started at `base` (every one ≥ `base`), or all OS-assigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    base: u16,
    routers: u16,
    engines: u16,
}

impl Layout {
    /// Routers' HTTP ports first, then their mesh (UDP) ports, then per engine its HTTP port,
    /// then the KV-event PUB ports, then the replay ports.
    pub fn new(base: u16, routers: u32, engines: u32) -> Result<Layout, String> {
        let total = 2 * u64::from(routers) + 3 * u64::from(engines);
        if base != 0 && u64::from(base) + total > 65_536 {
            return Err(format!(
                "--base-port {base}: {total} ports from there pass 65535; choose a lower one"
            ));
        }
        Ok(Layout {
            base,
            routers: routers as u16,
            engines: engines as u16,
        })
    }

    /// (first router HTTP port, first mesh port), or `None` for OS-assigned ports.
    pub fn routers(&self) -> Option<(u16, u16)> {
        (self.base != 0).then(|| (self.base, self.base + self.routers))
    }

    /// Engine `i`'s (HTTP, KV-event PUB, replay) ports.
    pub fn engine(&self, i: usize) -> (u16, u16, u16) {
        let first = self.base + 2 * self.routers;
        let i = i as u16;
        (
            first + i,
            first + self.engines + i,
            first + 2 * self.engines + i,
        )
    }

    /// The last port used.
    pub fn last(&self) -> u16 {
        self.base + 2 * self.routers + 3 * self.engines - 1
    }
}

/// The engines and routers `kvmesh up` runs.
pub struct Cluster {
    /// The engines.
    pub sims: kvmesh_sim::LocalFleet,
    /// The routers.
    pub routers: Vec<GatewayServer>,
    /// Their policy.
    pub policy: PolicyKind,
}

impl Cluster {
    async fn start(a: &UpArgs, layout: Layout, policy: PolicyKind) -> Result<Cluster, String> {
        let spec = fleet::EngineSpec {
            engines: a.engines,
            time_scale: a.time_scale,
            kv_blocks: Some(a.kv_blocks()),
            max_model_len: None,
            profile: None,
            kv_events: true,
            log: false,
        };
        let ports = move |i: usize| layout.engine(i);
        let sims = fleet::start_engines_at(&spec, (layout.base != 0).then_some(&ports as _))
            .await
            .map_err(port_hint)?;
        let routers = match fleet::start_routers_at(
            &sims.entries,
            a.routers,
            !a.no_mesh,
            policy,
            1,
            false,
            layout.routers(),
        )
        .await
        {
            Ok(r) => r,
            Err(e) => {
                sims.shutdown(Duration::from_secs(5)).await;
                return Err(port_hint(e));
            }
        };
        Ok(Cluster {
            sims,
            routers,
            policy,
        })
    }

    /// The engines' base URLs.
    pub fn engine_urls(&self) -> Vec<String> {
        self.sims.urls()
    }

    async fn shutdown(self) {
        fleet::shutdown_routers(self.routers).await;
        self.sims.shutdown(Duration::from_secs(5)).await;
    }
}

/// A start-up error, with a hint at `--base-port` when a port was taken (found by QA: the
/// hint came with every error, a bad `--kv-blocks` too).
fn port_hint(e: String) -> String {
    let l = e.to_ascii_lowercase();
    if l.contains("in use") || l.contains("bind") {
        format!("{e} (another port range: --base-port P)")
    } else {
        e
    }
}

impl UpArgs {
    /// Refuses values that cannot make a cluster or a demo, before anything starts (or a log
    /// file is made).
    pub fn check(&self) -> Result<(), String> {
        let wl = self.workload();
        for (flag, v) in [
            ("--engines", u64::from(self.engines)),
            ("--concurrency", self.concurrency as u64),
            ("--groups", u64::from(wl.groups)),
            ("--users", u64::from(wl.users)),
            ("--turns", u64::from(wl.turns)),
            ("--question-words", u64::from(wl.question_words)),
            ("--max-tokens", u64::from(wl.max_tokens)),
            ("--sample-ms", self.sample_ms),
        ] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if !(self.time_scale > 0.0 && self.time_scale <= 10.0) {
            return Err("--time-scale must be in (0, 10]".into());
        }
        if !(2..=kvmesh_config::MAX_NUM_BLOCKS).contains(&self.kv_blocks()) {
            return Err(format!(
                "--kv-blocks must be from 2 to {}",
                kvmesh_config::MAX_NUM_BLOCKS
            ));
        }
        if let Some(p) = &self.log_file {
            if self.verbose {
                return Err("--log-file and -v: the logs go to one or the other".into());
            }
            let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
            if p.is_dir() || dir.is_some_and(|d| !d.is_dir()) {
                return Err(format!(
                    "--log-file {}: not a file in an existing directory",
                    p.display()
                ));
            }
        }
        if self.compare.is_empty() {
            Layout::new(self.base_port, self.routers, self.engines)?;
        } else if self.routers == 0 {
            return Err("--compare needs at least one router (--routers 1)".into());
        }
        Ok(())
    }
}

/// Runs `kvmesh up`.
pub async fn run(a: UpArgs) -> Result<(), String> {
    a.check()?;
    let wl = a.workload();
    if !a.compare.is_empty() {
        return up_compare::compare(&a, &wl).await;
    }
    let layout = Layout::new(a.base_port, a.routers, a.engines)?;
    let policy = a.policy.unwrap_or(PolicyKind::Precise);
    println!("kvmesh up: a local cluster on loopback");
    match log_file(&a) {
        Some(p) => println!("  logs: {} (-v prints them here)", p.display()),
        None => println!("  logs: on stderr"),
    }
    let c = Cluster::start(&a, layout, policy).await?;
    print!("{}", describe(&a, &c, layout));
    let outcome = tokio::select! {
        r = demo_then_serve(&a, &c, &wl) => r,
        _ = crate::wait_for_signal() => {
            println!();
            Ok(())
        }
    };
    if c.routers.is_empty() {
        println!("stopping the engines");
    } else {
        println!("stopping: the routers drain their requests, then the engines stop");
    }
    c.shutdown().await;
    println!("stopped");
    outcome
}

async fn demo_then_serve(a: &UpArgs, c: &Cluster, wl: &SharedPrefixWorkload) -> Result<(), String> {
    let demo = if a.no_demo {
        Ok(())
    } else {
        up_demo::run(a, c, wl).await
    };
    if let Err(e) = &demo {
        println!("demo: {e}");
    }
    if a.exit_after_demo {
        return demo;
    }
    print!("{}", try_it(c));
    // Serves until the caller's Ctrl-C ends this future.
    std::future::pending::<()>().await;
    Ok(())
}

/// What started where.
fn describe(a: &UpArgs, c: &Cluster, layout: Layout) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "  engines: {} × kvmesh sim ({}, {} KV blocks of 16 tokens each, time scale {}, \
         publishing vLLM KV events)",
        c.sims.entries.len(),
        SimConfig::default().model,
        a.kv_blocks(),
        a.time_scale
    );
    for (i, e) in c.sims.entries.iter().enumerate() {
        let _ = writeln!(
            s,
            "    engine {i}  {}   KV events {}   replay {}",
            e.url, e.kv_events, e.kv_replay
        );
    }
    if c.routers.is_empty() {
        let _ = writeln!(s, "  routers: none (--routers 0)");
    } else {
        let mesh = if c.routers.len() > 1 && !a.no_mesh {
            "meshed over mutual-TLS QUIC"
        } else {
            "independent"
        };
        let _ = writeln!(
            s,
            "  routers: {} × kvmesh serve, policy {}, {mesh}",
            c.routers.len(),
            c.policy.as_str()
        );
        for (i, r) in c.routers.iter().enumerate() {
            let m = r
                .cluster
                .as_ref()
                .and_then(|m| m.addr())
                .map(|m| format!("   mesh udp {m}"))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "    router-{i}  {}{m}   status page {}/",
                r.base_url(),
                r.base_url()
            );
        }
    }
    if layout.base != 0 {
        let _ = writeln!(s, "  ports {}–{} (--base-port)", layout.base, layout.last());
    }
    s
}

/// What to try once it serves.
fn try_it(c: &Cluster) -> String {
    let base = c
        .routers
        .first()
        .map(GatewayServer::base_url)
        .or_else(|| c.engine_urls().first().cloned())
        .unwrap_or_default();
    let model = SimConfig::default().model;
    // With no router, the first engine answers: it has no status page and no mesh.
    let (who, pages) = if c.routers.is_empty() {
        (
            "no router: this is the first engine",
            format!("metrics {base}/metrics"),
        )
    } else if c.routers.len() == 1 {
        // One router runs alone: no mesh to show.
        (
            "the router answers; its status page shows engines and decisions",
            format!("status page {base}/    metrics {base}/metrics"),
        )
    } else {
        (
            "any router answers; the status page shows members, engines and decisions",
            format!("status page {base}/    metrics {base}/metrics    mesh {base}/admin/cluster"),
        )
    };
    // Flush left: pasted as is into a shell (the heredoc's EOF and Python's indentation).
    format!(
        r#"
serving. Try it ({who}):

curl -s {base}/v1/chat/completions -H 'content-type: application/json' \
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}'

python3 - <<'EOF'
from openai import OpenAI  # pip install openai
client = OpenAI(base_url="{base}/v1", api_key="unused")
r = client.chat.completions.create(model="{model}", max_tokens=16,
    messages=[{{"role": "user", "content": "Hello!"}}])
print(r.choices[0].message.content, r.usage)
EOF

{pages}
Ctrl-C stops everything.
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_port_is_at_or_above_the_base_and_none_repeats() {
        let l = Layout::new(9000, 3, 4).expect("layout");
        let mut ports = Vec::new();
        let (h, m) = l.routers().expect("ports");
        for i in 0..3 {
            ports.push(h + i);
            ports.push(m + i);
        }
        for i in 0..4 {
            let (a, b, c) = l.engine(i);
            ports.extend([a, b, c]);
        }
        assert!(ports.iter().all(|&p| (9000..=l.last()).contains(&p)));
        let n = ports.len();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), n);
        assert_eq!(l.last(), 9000 + 18 - 1);
        assert!(Layout::new(65_530, 3, 4).is_err());
        assert_eq!(Layout::new(0, 3, 4).expect("layout").routers(), None);
    }

    /// QA: `kvmesh up --kv-blocks 4294967295` panicked in the engine's block pool.
    #[test]
    fn kv_blocks_beyond_the_pool_are_refused() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            up: UpArgs,
        }
        let up = |blocks: &str| Cli::parse_from(["t", "--kv-blocks", blocks]).up.check();
        let e = up("4294967295").expect_err("u32::MAX blocks");
        assert!(e.contains("--kv-blocks"), "{e}");
        assert!(up("16777217").is_err());
        up("16777216").expect("the largest pool");
    }

    #[test]
    fn the_first_port_is_the_routers_default() {
        assert_eq!(
            ServeConfig::default().listen,
            format!("127.0.0.1:{}", default_base_port())
        );
    }
}
