//! SMG (Shepherd Model Gateway, `pip install smg`) as a `kvmesh bench` contender: started in
//! front of the bench's engines, stopped after its run. SMG tokenizes text itself, so its runs
//! send text prompts.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `smg` on PATH, if any.
pub fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("smg"))
        .find(|p| p.is_file())
}

/// A running SMG router; killed on drop.
pub struct Smg {
    child: Child,
    /// Its base URL.
    pub url: String,
}

impl Drop for Smg {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// Starts `smg launch` with `policy` in front of `workers` and waits (≤ 90 s) until it serves
/// the model list with a worker in it.
pub async fn start(bin: &PathBuf, workers: &[String], policy: &str) -> Result<Smg, String> {
    start_one(bin, workers, policy, None).await.map(|x| x.0)
}

/// `n` SMG gateways meshed with each other (`--enable-mesh`, the first one the others' peer),
/// started in order, each serving before the next starts.
pub async fn start_mesh(
    bin: &PathBuf,
    workers: &[String],
    policy: &str,
    n: usize,
) -> Result<Vec<Smg>, String> {
    let mut out: Vec<Smg> = Vec::with_capacity(n);
    let mut first_mesh: Option<u16> = None;
    for i in 0..n {
        let peer = first_mesh.map(|p| format!("127.0.0.1:{p}"));
        let (smg, mesh_port) = start_one(bin, workers, policy, Some((i, peer))).await?;
        first_mesh = first_mesh.or(mesh_port);
        out.push(smg);
    }
    Ok(out)
}

async fn start_one(
    bin: &PathBuf,
    workers: &[String],
    policy: &str,
    mesh: Option<(usize, Option<String>)>,
) -> Result<(Smg, Option<u16>), String> {
    let (port, prom) = (free_port()?, free_port()?);
    let mut mesh_port = None;
    let mut cmd = Command::new(bin);
    cmd.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            &prom.to_string(),
        ])
        .arg("--worker-urls")
        .args(workers)
        .args(["--policy", policy, "--log-level", "warn"]);
    // Meshed: the options of `launch` (after it).
    if let Some((i, peer)) = &mesh {
        let mut m = free_port()?;
        while m == port || m == prom {
            m = free_port()?;
        }
        mesh_port = Some(m);
        cmd.args(["--enable-mesh", "--mesh-server-name", &format!("gw-{i}")])
            .args(["--mesh-host", "127.0.0.1", "--mesh-port", &m.to_string()]);
        if let Some(p) = peer {
            cmd.args(["--mesh-peer-urls", p]);
        }
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(
        match std::env::var_os("KVMESH_SMG_LOG") {
            // Its log, appended to this file, when asked for (debugging a contender).
            Some(f) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(f)
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null()),
            None => Stdio::null(),
        },
    );
    let child = cmd.spawn().map_err(|e| format!("smg: {e}"))?;
    let smg = Smg {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    let start = Instant::now();
    loop {
        if let Ok(body) =
            kvmesh_bench::fetch_text(&format!("{}/v1/models", smg.url), Duration::from_secs(2))
                .await
            && body.contains("\"id\"")
        {
            return Ok((smg, mesh_port));
        }
        if start.elapsed() > Duration::from_secs(90) {
            return Err("smg did not serve /v1/models within 90 s".into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
