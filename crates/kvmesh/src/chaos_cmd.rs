//! `kvmesh chaos`: runs scenario files of the chaos suite (see chaos/README.md) and prints the
//! verdict table; `clean` removes what an interrupted run left.

use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Subcommand)]
pub enum ChaosCmd {
    /// Run scenarios (chaos/*.toml) across real processes; exits non-zero when an invariant
    /// breaks. Needs root (network namespaces), iproute2, nftables and, for delay steps,
    /// iptables (iptables-nft).
    Run(RunArgs),
    /// Remove network namespaces, bridges and processes left by runners that are gone.
    Clean,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Scenario files.
    #[arg(required = true)]
    pub scenarios: Vec<PathBuf>,
    /// Quick mode (CI): each scenario's [quick] overrides of its workload.
    #[arg(long)]
    pub quick: bool,
    /// Directory of logs and reports (one sub-directory per scenario).
    #[arg(long, default_value = "target/chaos")]
    pub out: PathBuf,
}

pub async fn run(cmd: ChaosCmd) -> Result<(), String> {
    match cmd {
        ChaosCmd::Clean => {
            let removed = kvmesh_chaos::lab::sweep();
            println!("removed {} item(s): {removed:?}", removed.len());
            Ok(())
        }
        ChaosCmd::Run(args) => {
            let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
            let opts = kvmesh_chaos::run::Options {
                quick: args.quick,
                out: args.out.clone(),
                exe,
            };
            let files = args.scenarios.clone();
            // Every file is checked (and planned) before any runs: a mistake in the last one
            // is not found after the first ran for minutes (QA).
            let (mut plans, mut refused) = (Vec::new(), Vec::new());
            for f in &files {
                match kvmesh_chaos::run::check_file(f, args.quick) {
                    Ok(plan) => plans.push((f.clone(), plan)),
                    Err(e) => refused.push(e),
                }
            }
            if !refused.is_empty() {
                for e in &refused {
                    eprintln!("kvmesh chaos: {e}");
                }
                return Err(format!(
                    "{} of {} scenario file(s) refused; nothing was run",
                    refused.len(),
                    files.len()
                ));
            }
            // The scenarios run on a thread of their own; Ctrl-C / SIGTERM asks them to stop,
            // and the thread tears its lab down before it returns.
            let worker = tokio::task::spawn_blocking(move || {
                let mut rows = Vec::new();
                let mut errors = Vec::new();
                for (f, plan) in plans {
                    if kvmesh_chaos::aborted() {
                        break;
                    }
                    match kvmesh_chaos::run::run_plan(plan, &opts) {
                        Ok(row) => rows.push(row),
                        Err(e) => errors.push(format!("{}: {e}", f.display())),
                    }
                }
                (rows, errors)
            });
            tokio::pin!(worker);
            let (rows, errors) = tokio::select! {
                r = &mut worker => r.map_err(|e| e.to_string())?,
                _ = crate::wait_for_signal() => {
                    eprintln!("kvmesh chaos: interrupted, tearing the lab down");
                    kvmesh_chaos::abort();
                    let _ = worker.await;
                    return Err("interrupted".into());
                }
            };
            let table = kvmesh_chaos::verdict::table(&rows);
            println!("\n{table}");
            let _ = std::fs::create_dir_all(&args.out);
            let _ = std::fs::write(args.out.join("report.md"), &table);
            for e in &errors {
                eprintln!("kvmesh chaos: {e}");
            }
            let failed = rows.iter().filter(|r| !r.passed()).count();
            if failed > 0 || !errors.is_empty() {
                return Err(format!(
                    "{failed} of {} scenario(s) broke an invariant, {} could not run",
                    rows.len(),
                    errors.len()
                ));
            }
            Ok(())
        }
    }
}
