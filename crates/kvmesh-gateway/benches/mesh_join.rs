//! A **router** joining a cluster whose state is large, end to end: router A (`kvmesh serve`'s
//! gateway, in process, meshed over real QUIC + mutual TLS on loopback, 8 simulated engines)
//! holds N speculative entries in its mesh state (default 1,048,576: 8 engines × 131,072, the
//! per-engine bound of the default config) made through its prefix index as routing
//! decisions make them — marks of chains of 2,048 blocks, each naming the top key of its 257
//! anchor windows (covering marks), so the entries cover about 8M blocks; router B starts
//! with A as its seed. Reports (not asserted) when B's `/health` answers 200 (ready: the
//! cluster's state received and applied in order before it), when B's own prefix index holds
//! the N entries, and the bytes that crossed.
//!
//!   cargo bench -p kvmesh-gateway --bench mesh_join
//!   KVMESH_JOIN_ENGINES=16 cargo bench -p kvmesh-gateway --bench mesh_join   # 2M entries

#[path = "../tests/common/mod.rs"]
mod common;

use common::*;
use kvmesh_config::MeshConfig;
use kvmesh_prefix::BlockKey;
use std::time::{Duration, Instant};

fn mesh_cfg(dir: &std::path::Path, name: &str, seeds: Vec<String>) -> MeshConfig {
    MeshConfig {
        enabled: true,
        node_id: name.into(),
        listen: "127.0.0.1:0".into(),
        seeds,
        tls_dir: dir.display().to_string(),
        cluster_id: "join-bench".into(),
        ..MeshConfig::default()
    }
}

fn index_len(r: &kvmesh_gateway::GatewayServer) -> usize {
    r.gateway.registry.prefix.index().len()
}

fn main() {
    let engines: usize = std::env::var("KVMESH_JOIN_ENGINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let sims = start_sims(engines, |_| sim_cfg("m")).await;
        let urls = urls(&sims);
        let dir = std::env::temp_dir().join(format!("kvmesh-join-bench-{}", std::process::id()));
        let certs = kvmesh_mesh::certs::generate(&["a".into(), "b".into()]).expect("certs");
        kvmesh_mesh::certs::write_dir(&dir, &certs).expect("write");
        let cfg = |name: &str, seeds: Vec<String>| {
            let mut c = serve_cfg(&urls);
            c.mesh = mesh_cfg(&dir, name, seeds);
            c
        };
        let a = start_router_with(cfg("a", vec![]), "m", engines).await;
        let per_engine = a.gateway.cfg.prefix.engine_capacity_blocks as u64;
        let ttl_us = a.gateway.cfg.prefix.approximate_ttl_ms * 1_000;
        // A's decisions: every engine marked with chains of CHAIN blocks until its mesh state
        // holds `per_engine` of their window tops.
        // A chain's tops: position 0, every 8th and its last — 257 for 2,048 blocks.
        const CHAIN: u64 = 2_048;
        let chains = per_engine / (CHAIN / 8 + 1);
        let t = Instant::now();
        for (e_no, e) in a.gateway.registry.members().iter().enumerate() {
            for chain in 0..chains {
                let keys: Vec<BlockKey> = (0..CHAIN)
                    .map(|p| {
                        let h = ((e_no as u64) << 40 | chain << 16 | p).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        BlockKey((h & !1) | u64::from(p % 8 == 0))
                    })
                    .collect();
                let now = a.gateway.clock.now_us();
                a.gateway.registry.prefix.mark(e.target(), &keys, 0, now + ttl_us, now);
                if chain % 2 == 0 {
                    // The mesh's input is bounded: let it drain as routing would.
                    tokio::task::yield_now().await;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        // Until A's mesh state holds them (the mesh's input is bounded: a mark it refused is
        // in A's index only), or its count stops moving.
        let want = (chains * (CHAIN / 8 + 1) * engines as u64) as usize;
        let http = client();
        let mut held = 0u64;
        let settle = Instant::now();
        loop {
            let (_, body) = get(&http, &format!("{}/admin/cluster", a.base_url())).await;
            let v: serde_json::Value = serde_json::from_str(&body).expect("json");
            let now_held = v["entries"]["marks"].as_u64().unwrap_or(0);
            if now_held >= want as u64 || (now_held == held && now_held > 0) || settle.elapsed() > Duration::from_secs(60) {
                held = now_held;
                break;
            }
            held = now_held;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let want = held as usize;
        println!(
            "router a: {engines} engines, {held} entries in its mesh state (covering {} blocks) in {:.1} s",
            held * 8,
            t.elapsed().as_secs_f64()
        );
        let seed = a.cluster.as_ref().and_then(|c| c.addr()).expect("a's mesh address");
        let t0 = Instant::now();
        let b = start_router(cfg("b", vec![seed.to_string()])).await;
        let started = t0.elapsed();
        let mut ready = None;
        let mut all = None;
        while t0.elapsed() < Duration::from_secs(120) && (ready.is_none() || all.is_none()) {
            if ready.is_none() {
                let (s, _) = get(&http, &format!("{}/health", b.base_url())).await;
                if s == 200 {
                    ready = Some(t0.elapsed());
                }
            }
            if all.is_none() && index_len(&b) >= want {
                all = Some(t0.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (_, body) = get(&http, &format!("{}/admin/cluster", b.base_url())).await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        let fmt = |d: Option<Duration>| d.map_or("NOT within 120 s".to_string(), |d| format!("{:.2} s", d.as_secs_f64()));
        println!(
            "router b (seed a): serving {:.2} s after its start; /health ready {}; its index holds all {} entries {} ({} held); {} bytes of state received",
            started.as_secs_f64(),
            fmt(ready),
            want,
            fmt(all),
            index_len(&b),
            v["bytes"]["state_received"]
        );
        let _ = std::fs::remove_dir_all(&dir);
        drop(b);
        drop(a);
        stop_sims(sims).await;
    });
}
