//! Routers meshed in process on loopback (mutual TLS, certificates generated per test): their
//! mesh settings, the admin API, `/admin/cluster`, waits on the cluster's state.

use super::*;
use kvmesh_config::MeshConfig;
use kvmesh_gateway::GatewayServer;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// `/admin/engines` of `router` (token `t`), `body` as JSON.
pub async fn admin(
    c: &HttpClient,
    router: &GatewayServer,
    method: &str,
    body: serde_json::Value,
) -> Reply {
    send(
        c,
        method,
        &format!("{}/admin/engines", router.base_url()),
        &[("authorization", "Bearer t")],
        body.to_string(),
        Duration::from_secs(10),
    )
    .await
}

/// Sets `url`'s weight through `through`'s admin API and waits (within `within`) until every
/// router of `on` has it.
pub async fn reweigh_everywhere(
    c: &HttpClient,
    through: &GatewayServer,
    url: &str,
    weight: f64,
    on: &[&GatewayServer],
    within: Duration,
) -> bool {
    let r = admin(
        c,
        through,
        "PATCH",
        serde_json::json!({ "url": url, "weight": weight }),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let id = kvmesh_prefix::EngineId::from_url(url);
    until(within, || {
        on.iter().all(|r| {
            r.gateway
                .registry
                .get(id)
                .is_some_and(|e| e.base_weight() == weight)
        })
    })
    .await
}

/// A router's mesh address, as its peers give it as a seed.
pub fn mesh_addr(r: &GatewayServer) -> String {
    r.cluster
        .as_ref()
        .and_then(|c| c.addr())
        .expect("a mesh address")
        .to_string()
}

pub fn mesh_cfg(dir: &std::path::Path, name: &str, seeds: Vec<String>) -> MeshConfig {
    MeshConfig {
        enabled: true,
        node_id: name.into(),
        listen: "127.0.0.1:0".into(),
        seeds,
        tls_dir: dir.display().to_string(),
        cluster_id: "test".into(),
        ..MeshConfig::default()
    }
}

/// Polls `ok` every 20 ms until it holds or `within` passes.
pub async fn until(within: Duration, ok: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !ok() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

pub async fn cluster_json(c: &HttpClient, r: &GatewayServer) -> serde_json::Value {
    let (s, body) = get(c, &format!("{}/admin/cluster", r.base_url())).await;
    assert_eq!(s, 200);
    serde_json::from_str(&body).expect("json")
}

/// Whether the routers' load and registry digests agree within 5 s.
pub async fn digests_agree(c: &HttpClient, routers: [&GatewayServer; 3]) -> bool {
    for _ in 0..100 {
        let mut ds = Vec::new();
        for r in routers {
            ds.push(cluster_json(c, r).await["digests"].clone());
        }
        if ds
            .iter()
            .all(|d| d["registry"] == ds[0]["registry"] && d["load"] == ds[0]["load"])
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The requests the other routers have in flight, as `r` counts them.
pub fn peer_load(r: &GatewayServer) -> u32 {
    r.gateway
        .registry
        .members()
        .iter()
        .map(|e| e.peer_in_flight.load(Relaxed))
        .sum()
}

/// A long streamed chat request through `r`, held in a task of its own.
pub fn hold_stream(
    c: &HttpClient,
    r: &GatewayServer,
    max_tokens: u32,
) -> tokio::task::JoinHandle<Reply> {
    let long = serde_json::json!({
        "model": "m", "messages": [{"role": "user", "content": "tell a long story"}],
        "max_tokens": max_tokens, "stream": true,
    });
    let (c, url) = (c.clone(), r.base_url());
    tokio::spawn(async move { post_json(&c, &format!("{url}/v1/chat/completions"), &long).await })
}

/// Whether the router's mesh node is warm.
pub fn cluster_warm(r: &GatewayServer) -> bool {
    r.cluster.as_ref().is_some_and(|c| c.is_warm())
}

pub async fn wait_members(c: &HttpClient, r: &GatewayServer, n: usize) {
    for _ in 0..200 {
        if cluster_json(c, r).await["members"]
            .as_array()
            .map_or(0, Vec::len)
            == n
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "{} never saw {n} members: {}",
        r.base_url(),
        cluster_json(c, r).await
    );
}

/// Three routers meshed through the first (certificates written to a fresh directory), each
/// configured by `cfg(name)` (of its mesh settings, the anti-entropy period) and waited for until every one sees the two others.
pub async fn mesh_of_three(
    tag: &str,
    engines: usize,
    cfg: impl Fn(&str) -> kvmesh_config::ServeConfig,
) -> (std::path::PathBuf, [GatewayServer; 3]) {
    let dir = std::env::temp_dir().join(format!("kvmesh-{tag}-{}", std::process::id()));
    let certs = kvmesh_mesh::certs::generate(&["a".into(), "b".into(), "c".into()]).expect("certs");
    kvmesh_mesh::certs::write_dir(&dir, &certs).expect("write");
    let with_mesh = |name: &str, seeds: Vec<String>| {
        let mut c = cfg(name);
        // The identity, the seeds and the certificates are the test's; the rest of the
        // mesh's settings `cfg`'s.
        c.mesh = MeshConfig {
            anti_entropy_ms: c.mesh.anti_entropy_ms,
            ..mesh_cfg(&dir, name, seeds)
        };
        c
    };
    let a = start_router_with(with_mesh("a", vec![]), "m", engines).await;
    let seed = mesh_addr(&a);
    let b = start_router_with(with_mesh("b", vec![seed.clone()]), "m", engines).await;
    let c = start_router_with(with_mesh("c", vec![seed]), "m", engines).await;
    let http = client();
    for r in [&a, &b, &c] {
        wait_members(&http, r, 2).await;
    }
    (dir, [a, b, c])
}
