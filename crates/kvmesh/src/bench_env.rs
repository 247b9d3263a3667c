//! Where a `kvmesh bench` report comes from and goes: the machine and the commit it names,
//! and the `--out` directory, checked before a run.

/// Creates `--out` and checks that the report's files can be written there, before a run
/// that may take many minutes.
pub fn check_out_dir(out: &std::path::Path) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("--out {}: {e}", out.display()))?;
    for name in ["report.json", "report.md"] {
        if out.join(name).is_dir() {
            return Err(format!("--out {}: {name} is a directory", out.display()));
        }
    }
    let probe = out.join(format!(".kvmesh-bench-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .map_err(|e| format!("--out {}: cannot write there: {e}", out.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!(
        "{} {}, {cores} cores ({cpu})",
        std::env::consts::OS,
        std::env::consts::ARCH
    )
}

pub fn commit() -> String {
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| match env!("KVMESH_BUILD_COMMIT") {
            // Run outside a checkout: the commit the binary was built from.
            "" => "unknown".into(),
            c => format!("{c} (the binary's build)"),
        })
}
