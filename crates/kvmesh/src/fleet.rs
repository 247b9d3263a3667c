//! A local fleet on loopback, shared by `kvmesh up` and `kvmesh bench`: simulated engines
//! (in-process `kvmesh sim` servers) and routers in front of them, meshed (certificates
//! generated on the fly) or as independent replicas.

use kvmesh_bench::{EngineCounters, InFlightSampler, Targets};
use kvmesh_config::{EngineEntry, PolicyKind, ServeConfig, SimConfig};
use kvmesh_gateway::GatewayServer;
use kvmesh_sim::LocalFleet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What engines to start.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// How many.
    pub engines: u32,
    /// Their time scale.
    pub time_scale: f64,
    /// KV-cache blocks per engine (`None`: the sim's default).
    pub kv_blocks: Option<u32>,
    /// Longest prompt + completion (capped at the cache's size in tokens); `None`: the sim's
    /// default.
    pub max_model_len: Option<u32>,
    /// Timing profile (`None`: the sim's default).
    pub profile: Option<String>,
    /// Publish KV events (what `precise` and `scored` read).
    pub kv_events: bool,
    /// Print each engine's URL.
    pub log: bool,
}

impl EngineSpec {
    /// The config of engine `i`.
    pub fn config(&self, i: usize) -> SimConfig {
        let mut cfg = SimConfig {
            time_scale: self.time_scale,
            seed: i as u64,
            ..SimConfig::default()
        };
        if let Some(m) = self.max_model_len {
            cfg.max_model_len = m;
        }
        if let Some(p) = &self.profile {
            cfg.engine.profile = p.clone();
        }
        if let Some(b) = self.kv_blocks {
            cfg.engine.num_blocks = b;
        }
        // The cache must hold one max-length sequence.
        cfg.max_model_len = cfg
            .max_model_len
            .min(cfg.engine.num_blocks.saturating_mul(cfg.engine.block_size));
        cfg
    }
}

/// The ports of engine `i` (HTTP, KV-event PUB, replay), when they are chosen.
pub type EnginePorts = dyn Fn(usize) -> (u16, u16, u16) + Send + Sync;

/// Starts the engines on OS-assigned ports.
pub async fn start_engines(spec: &EngineSpec) -> Result<LocalFleet, String> {
    start_engines_at(spec, None).await
}

/// Starts the engines, on the ports `ports(i)` gives engine `i` when set (a port taken
/// names itself in the error), else on OS-assigned ports.
pub async fn start_engines_at(
    spec: &EngineSpec,
    ports: Option<&EnginePorts>,
) -> Result<LocalFleet, String> {
    let fleet = match ports {
        None => kvmesh_sim::start_fleet(spec.engines as usize, spec.kv_events, |i| spec.config(i))
            .await
            .map_err(|e| e.to_string())?,
        Some(ports) => {
            let mut fleet = LocalFleet {
                sims: Vec::new(),
                entries: Vec::new(),
            };
            for i in 0..spec.engines as usize {
                let (http, pub_port, replay) = ports(i);
                let mut c = spec.config(i);
                c.listen = format!("127.0.0.1:{http}");
                if spec.kv_events {
                    c.kv_events.endpoint = format!("tcp://127.0.0.1:{pub_port}");
                    c.kv_events.replay_endpoint = format!("tcp://127.0.0.1:{replay}");
                }
                let s = match kvmesh_sim::start(c).await {
                    Ok(s) => s,
                    Err(e) => {
                        fleet.shutdown(Duration::from_secs(5)).await;
                        return Err(format!(
                            "engine {i} (ports {http}, {pub_port}, {replay}): {e}"
                        ));
                    }
                };
                fleet.entries.push(EngineEntry {
                    url: s.base_url(),
                    kv_events: s.kv_events_endpoint.clone().unwrap_or_default(),
                    kv_replay: s.kv_replay_endpoint.clone().unwrap_or_default(),
                    ..EngineEntry::default()
                });
                fleet.sims.push(s);
            }
            fleet
        }
    };
    if spec.log {
        for (i, url) in fleet.urls().iter().enumerate() {
            eprintln!("engine {i}: {url}");
        }
    }
    Ok(fleet)
}

/// Starts `n` routers with `policy` in front of `entries`, meshed when `mesh` and `n > 1`
/// (returns once every router sees the others). `seed` seeds the routers' random choices.
pub async fn start_routers(
    entries: &[EngineEntry],
    n: u32,
    mesh: bool,
    policy: PolicyKind,
    seed: u64,
    log: bool,
) -> Result<Vec<GatewayServer>, String> {
    start_routers_at(entries, n, mesh, policy, seed, log, None).await
}

/// [`start_routers`] on chosen ports: router `i` listens on `http + i` and, meshed, on UDP
/// `mesh + i` when `ports = Some((http, mesh))`.
pub async fn start_routers_at(
    entries: &[EngineEntry],
    n: u32,
    mesh: bool,
    policy: PolicyKind,
    seed: u64,
    log: bool,
    ports: Option<(u16, u16)>,
) -> Result<Vec<GatewayServer>, String> {
    let mesh = n > 1 && mesh;
    let names: Vec<String> = (0..n).map(|i| format!("router-{i}")).collect();
    let tls_dir = std::env::temp_dir().join(format!(
        "kvmesh-fleet-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    // The run's CA key is in there: removed on every way out of this function.
    let _remove = RemoveOnDrop(tls_dir.clone());
    if mesh {
        let certs = kvmesh_mesh::certs::generate(&names).map_err(|e| e.to_string())?;
        kvmesh_mesh::certs::write_dir(&tls_dir, &certs).map_err(|e| e.to_string())?;
    }
    let mut routers: Vec<GatewayServer> = Vec::new();
    for i in 0..n {
        let port = |base: u16| base.checked_add(i as u16).unwrap_or(0);
        let mut cfg = ServeConfig {
            listen: format!("127.0.0.1:{}", ports.map_or(0, |p| port(p.0))),
            engines: entries.to_vec(),
            seed: seed.wrapping_add(i as u64),
            ..ServeConfig::default()
        };
        cfg.routing.policy.policy = policy;
        if mesh {
            cfg.mesh.enabled = true;
            cfg.mesh.node_id = names[i as usize].clone();
            cfg.mesh.listen = format!("127.0.0.1:{}", ports.map_or(0, |p| port(p.1)));
            cfg.mesh.tls_dir = tls_dir.display().to_string();
            // The certificates are made for this run and removed once the mesh has formed:
            // nothing to read again.
            cfg.mesh.tls_reload_ms = 0;
            cfg.mesh.expected_routers = n;
            if let Some(seed) = routers
                .first()
                .and_then(|r| r.cluster.as_ref())
                .and_then(|c| c.addr())
            {
                cfg.mesh.seeds = vec![seed.to_string()];
            }
        }
        let r = match kvmesh_gateway::start(cfg).await {
            Ok(r) => r,
            Err(e) => {
                shutdown_routers(routers).await;
                return Err(format!("router {i}: {e}"));
            }
        };
        if log {
            let at = r
                .cluster
                .as_ref()
                .and_then(|c| c.addr())
                .map(|m| format!(" (mesh {m})"))
                .unwrap_or_default();
            eprintln!("router {i}: {}{at}", r.base_url());
        }
        routers.push(r);
    }
    if mesh {
        let want = routers.len() - 1;
        let formed = async {
            while !routers.iter().all(|r| {
                r.cluster
                    .as_ref()
                    .is_some_and(|c| c.members().len() == want)
            }) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let ok = tokio::time::timeout(Duration::from_secs(30), formed)
            .await
            .is_ok();
        let _ = std::fs::remove_dir_all(&tls_dir);
        if !ok {
            shutdown_routers(routers).await;
            return Err("the routers did not form a mesh within 30 s".into());
        }
        if log {
            eprintln!("mesh formed: {} routers", n);
        }
    }
    // Every engine that publishes KV events is read before the fleet is used (meshed: its
    // owners chosen, which takes a few seconds at a cold start, and their feeds followed):
    // a run started earlier would route its first seconds approximately.
    let read = || {
        routers.iter().all(|r| {
            r.gateway
                .registry
                .members()
                .iter()
                .all(|e| e.kv_events.is_empty() || e.events_live())
        })
    };
    let waited = tokio::time::timeout(Duration::from_secs(15), async {
        while !read() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    if waited.is_err() {
        eprintln!(
            "warning: some engine's KV events are not read by every router after 15 s: starting anyway"
        );
    }
    Ok(routers)
}

/// Removes a directory when dropped.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Stops routers (each drains its requests).
pub async fn shutdown_routers(routers: Vec<GatewayServer>) {
    for r in routers {
        r.shutdown().await;
    }
}

/// Where clients send requests: round robin over the routers (as DNS would), or over the
/// engines without routers.
pub fn targets(routers: &[GatewayServer], engine_urls: &[String]) -> Targets {
    if routers.is_empty() {
        Targets::RoundRobin(engine_urls.to_vec())
    } else {
        Targets::RoundRobin(routers.iter().map(|r| r.base_url()).collect())
    }
}

/// Samples the routers' in-flight count per engine (summed over routers), or `None` without
/// routers.
pub fn in_flight_sampler(
    routers: &[GatewayServer],
    engine_urls: &[String],
    every: Duration,
) -> Option<InFlightSampler> {
    if routers.is_empty() {
        return None;
    }
    let gws: Vec<_> = routers.iter().map(|r| r.gateway.clone()).collect();
    let urls = Arc::new(engine_urls.to_vec());
    Some(InFlightSampler::start(every, move || {
        let mut v = vec![0u32; urls.len()];
        for g in &gws {
            for e in g.registry.members() {
                if let Some(i) = urls.iter().position(|u| *u == e.url) {
                    v[i] += e.in_flight.load(Ordering::Relaxed);
                }
            }
        }
        v
    }))
}

/// Forgets what the meshed routers' histograms of envelope ages hold so far (the mesh's
/// forming), so that [`envelope_age`] covers what follows.
pub fn reset_envelope_ages(routers: &[GatewayServer]) {
    for c in routers.iter().filter_map(|r| r.cluster.as_ref()) {
        c.envelope_age().reset();
    }
}

/// The ages of the state envelopes the meshed routers received, all together: the upper
/// bounds (ms) of the buckets holding the median and the 99th percentile (the last bound,
/// 1 s, for ages beyond it); `None` without a mesh or without envelopes.
pub fn envelope_age(routers: &[GatewayServer]) -> Option<(f64, f64)> {
    let all = kvmesh_metrics::Histogram::new(kvmesh_mesh::core::ENVELOPE_AGE_BUCKETS);
    for c in routers.iter().filter_map(|r| r.cluster.as_ref()) {
        all.merge_from(c.envelope_age());
    }
    let q = |x: f64| all.quantile_bound(x).map(|s| s * 1e3);
    q(0.5).zip(q(0.99))
}

/// The engines' prefix-cache and preemption counters, summed.
pub async fn counters(engine_urls: &[String]) -> Result<EngineCounters, String> {
    kvmesh_bench::engine_counters(engine_urls, Duration::from_secs(10)).await
}
