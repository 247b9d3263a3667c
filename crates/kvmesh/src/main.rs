//! The `kvmesh` command.

#![forbid(unsafe_code)]

// The command's own lines to stdout and stderr. Rust ignores SIGPIPE, so std's print macros
// panic when their stream is gone (`kvmesh bench ... 2>&1 | head` closes the pipe early, QA):
// these shadow them in the whole crate and drop a line that cannot be written instead, and
// the run goes on (a benchmark still writes its report to `--out`).
macro_rules! println {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}
macro_rules! print {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($t)*);
    }};
}
macro_rules! eprintln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

mod bench_cmd;
mod bench_env;
mod bench_routers;
mod chaos_cmd;
mod fleet;
mod load_decisions;
mod nginx;
mod serve_cmd;
mod sim_cmd;
mod smg;
mod up_cmd;
mod up_compare;
mod up_demo;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// kvmesh: a cluster of LLM-inference routers that share prefix-cache and load state without a
/// central store. Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=debug) for more.
#[derive(Debug, Parser)]
#[command(name = "kvmesh", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run a router in front of inference engines (OpenAI API).
    Serve(serve_cmd::ServeArgs),
    /// Run one simulated inference engine (OpenAI API, vLLM metrics and KV events).
    Sim(sim_cmd::SimArgs),
    /// Run a local cluster on loopback and serve a demo workload through it.
    Up(up_cmd::UpArgs),
    /// Benchmark policies side by side on a local simulated fleet (or given targets): JSON,
    /// markdown and SVG reports, with the virtual-time evaluator and its oracle.
    Bench(bench_cmd::BenchArgs),
    /// The chaos suite: scripted partitions, loss, kills and gray engines across real
    /// processes, with invariants checked (chaos/README.md).
    #[command(subcommand)]
    Chaos(chaos_cmd::ChaosCmd),
    /// Configuration helpers.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Write a certificate per router node for the mesh's mutual TLS, signed by the CA in
    /// --out (nodes added to a cluster) or by a new one; an existing file is never overwritten.
    Cert {
        /// Directory to write ca.pem, ca.key and <node>.pem, <node>.key into.
        #[arg(long)]
        out: std::path::PathBuf,
        /// Node names, comma-separated (each node loads its own pair by name).
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigCmd {
    /// Print every key with its default value, as TOML.
    Defaults,
    /// Print the configuration reference (every key, default and meaning) as markdown.
    Reference,
    /// Check a config file (its values and the files it names) and print the effective
    /// configuration; what `serve` may still get from its flags (engines, --node-id) is noted,
    /// not refused.
    Check {
        /// The file.
        file: std::path::PathBuf,
    },
}

/// Resolves on Ctrl-C, SIGTERM or SIGHUP. A hangup (the terminal that started the process
/// closed, or a `reload` sent to a service without a reload action) ends the process as
/// SIGTERM does, gracefully: left to its default action it killed the router with its
/// streams cut and no leave (QA26). The configuration is not reloaded: engines and weights
/// change at run time through the admin API.
pub async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) else {
            let _ = ctrl_c.await;
            return;
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
            _ = hup.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Refused before its log file is made.
    if let Cmd::Up(a) = &cli.cmd
        && let Err(e) = a.check()
    {
        eprintln!("kvmesh: error: {e}");
        return ExitCode::from(2);
    }
    // The bench starts routers per contender: their start-up lines would bury its progress.
    let default_filter = if matches!(cli.cmd, Cmd::Bench(_)) {
        "warn"
    } else {
        "info"
    };
    let logs = tracing_subscriber::fmt().with_env_filter(
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
    );
    // `kvmesh up` prints for a human on stdout; its logs go to a file unless -v.
    let log_file = match &cli.cmd {
        Cmd::Up(a) => up_cmd::log_file(a),
        _ => None,
    };
    let file = match log_file.as_ref().map(std::fs::File::create) {
        Some(Err(e)) => {
            eprintln!("kvmesh: error: cannot write the log file: {e}");
            return ExitCode::from(2);
        }
        f => f.and_then(Result::ok),
    };
    match file {
        Some(f) => logs
            .with_writer(std::sync::Mutex::new(f))
            .with_ansi(false)
            .init(),
        None => logs
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    let result = match cli.cmd {
        Cmd::Sim(args) => {
            if args.list_profiles {
                sim_cmd::list_profiles();
                return ExitCode::SUCCESS;
            }
            match args.resolve() {
                Ok(cfg) => runtime().and_then(|rt| rt.block_on(sim_cmd::run(cfg))),
                Err(e) => Err(e),
            }
        }
        Cmd::Serve(args) => match args.resolve() {
            Ok(cfg) if args.check_config => cfg
                .check_files()
                .inspect(|()| {
                    if let Some(note) = serve_cmd::attempts_note(&cfg) {
                        eprintln!("note: {note}");
                    }
                })
                .map_err(|e| e.to_string())
                .and_then(|()| kvmesh_gateway::check_tokenizers(&cfg))
                .and_then(|()| serve_cmd::check_mesh_certificates(&cfg))
                .map(|()| {
                    let whole = kvmesh_config::KvmeshConfig {
                        serve: cfg,
                        ..Default::default()
                    };
                    print!("{}", toml_of(&whole, true));
                }),
            Ok(cfg) => runtime().and_then(|rt| rt.block_on(serve_cmd::run(cfg))),
            Err(e) => Err(e),
        },
        Cmd::Up(args) => runtime().and_then(|rt| rt.block_on(up_cmd::run(args))),
        Cmd::Bench(args) => runtime().and_then(|rt| rt.block_on(bench_cmd::run(args))),
        Cmd::Chaos(cmd) => runtime().and_then(|rt| rt.block_on(chaos_cmd::run(cmd))),
        Cmd::Cert { out, nodes } => kvmesh_mesh::certs::add_to_dir(&out, &nodes)
            .map(|existing| {
                let ca = if existing {
                    "signed by its CA (ca.pem, ca.key):"
                } else {
                    "ca.pem, ca.key (keep it off the nodes), and"
                };
                println!(
                    "wrote {}: {ca} {} node pair{}: {}",
                    out.display(),
                    nodes.len(),
                    if nodes.len() == 1 { "" } else { "s" },
                    nodes
                        .iter()
                        .map(|n| format!("{n}.pem/{n}.key"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            })
            .map_err(|e| e.to_string()),
        Cmd::Config(ConfigCmd::Defaults) => {
            print!("{}", kvmesh_config::KvmeshConfig::defaults_toml());
            Ok(())
        }
        Cmd::Config(ConfigCmd::Reference) => {
            print!("{}", kvmesh_config::reference_markdown());
            Ok(())
        }
        Cmd::Config(ConfigCmd::Check { file }) => config_check(&file),
    };
    // A run that logged nothing (a start refused early) leaves no empty file behind.
    if let Some(p) = &log_file
        && std::fs::metadata(p).is_ok_and(|m| m.len() == 0)
    {
        let _ = std::fs::remove_file(p);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvmesh: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// `kvmesh config check FILE`: what `serve` and `sim` would refuse at start (the files they
/// load included), and the effective configuration. What a router's flags or environment may
/// still give is said, not refused: its name (one file for every router, as the Kubernetes
/// ConfigMap does) and its engines (`--engine`, `--dns`, `--node-id`, `--admin-token`).
fn config_check(file: &std::path::Path) -> Result<(), String> {
    let c = kvmesh_config::KvmeshConfig::read(file).map_err(|e| e.to_string())?;
    let mut checked = c.clone();
    if checked.serve.mesh.enabled && checked.serve.mesh.node_id.is_empty() {
        eprintln!(
            "note: serve.mesh.node_id is not set here: each router gives its own (`kvmesh serve --node-id NAME`)"
        );
        checked.serve.mesh.node_id = "node".into();
    }
    checked.validate().map_err(|e| e.to_string())?;
    // Only for a file that configures a router (QA35: said of a simulator's file).
    let has_serve = std::fs::read_to_string(file)
        .ok()
        .and_then(|t| t.parse::<toml::Table>().ok())
        .is_some_and(|t| t.contains_key("serve"));
    if has_serve && let Some(note) = serve_cmd::no_engines_note(&c.serve) {
        eprintln!("note: {note}");
    }
    if let Some(note) = serve_cmd::attempts_note(&c.serve) {
        eprintln!("note: {note}");
    }
    c.serve.check_files().map_err(|e| e.to_string())?;
    c.sim.check_files().map_err(|e| e.to_string())?;
    // The tokenizers load, as at start (QA34: only `serve --check-config` loaded them).
    kvmesh_gateway::check_tokenizers(&c.serve)?;
    if !c.sim.tokenizer.is_empty() {
        kvmesh_gateway::prefix::load_tokenizer(&c.sim.tokenizer)
            .map_err(|e| format!("sim.tokenizer: {e}"))?;
    }
    kvmesh_engine::EngineParams::from_config(&c.sim.engine, c.sim.max_model_len, c.sim.seed)
        .map_err(|e| format!("invalid value in `sim.engine`: {e}"))?;
    // The certificates as the router loads them at start, when the file names the router
    // (its pair is named after it).
    if c.serve.mesh.enabled {
        if c.serve.mesh.node_id.is_empty() {
            eprintln!(
                "note: the mesh certificates are not checked here (the pair is the router's: `kvmesh serve --node-id NAME ... --check-config` checks it)"
            );
        } else {
            serve_cmd::check_mesh_certificates(&c.serve)?;
        }
    }
    print!("{}", toml_of(&c, false));
    Ok(())
}

/// The configuration as TOML (`serve_only`: its `[serve]` section), with the admin token and
/// the engines' key masked: a check's output lands in pod and CI logs (QA: the token from
/// `KVMESH_ADMIN_TOKEN` was printed).
fn toml_of(c: &kvmesh_config::KvmeshConfig, serve_only: bool) -> String {
    let mut c = c.clone();
    for secret in [&mut c.serve.admin_token, &mut c.serve.engine_api_key] {
        if !secret.is_empty() {
            *secret = "<redacted>".into();
        }
    }
    if serve_only {
        c.serve_toml()
    } else {
        c.to_toml()
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}
