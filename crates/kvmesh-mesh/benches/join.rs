//! A router joining a cluster whose state is large: node A (real QUIC + mutual TLS on
//! loopback) holds N speculative index entries (default 1,048,576: 128 engines × 8,192 window
//! tops of covering marks); node B starts with A as its seed. Reports (not asserted) how long B takes from its
//! start to warm (A's whole state received: B would report ready) and until it holds all N
//! entries, and the bytes that crossed.
//!
//!   cargo bench -p kvmesh-mesh --bench join
//!   KVMESH_JOIN_ENTRIES=4000000 cargo bench -p kvmesh-mesh --bench join

use kvmesh_mesh::certs::{NodeTls, generate};
use kvmesh_mesh::core::{Apply, CoreConfig};
use kvmesh_mesh::node::{Input, MeshNode, NowFn, Seeds};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

fn cfg(first: bool) -> CoreConfig {
    CoreConfig {
        cluster_id: 1,
        flush_us: 20_000,
        load_flush_us: 0,
        load_burst: 8,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: 1 << 20,
        feed_capacity: 1 << 16,
        mark_ttls_us: vec![2_000_000, 120_000_000],
        expected_size: 2,
        warm_bound_us: 60_000_000,
        wire_version: 1,
        snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
        first,
    }
}

fn main() {
    let entries: u64 = std::env::var("KVMESH_JOIN_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 20);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let now: NowFn = Arc::new(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_micros() as u64)
                .unwrap_or(0)
        });
        let certs = generate(&["a".into(), "b".into()]).expect("certs");
        let tls = |n: &str| NodeTls::from_cluster(&certs, n).expect("tls");
        let any = "127.0.0.1:0".parse().expect("addr");
        let (a, mut a_applies) = MeshNode::start("a", any, &tls("a"), Seeds::default(), cfg(true), now.clone(), None, 0)
            .await
            .expect("a");
        tokio::spawn(async move { while a_applies.recv().await.is_some() {} });
        // The routers' engines, as the gateway tells them (no KV events: marks only).
        let all: std::collections::BTreeSet<u64> = (1..=128).collect();
        let told = Input::Engines { all: all.clone(), events: Default::default() };
        a.input.send(told.clone()).await.expect("input");
        // A's state: marks of 128 engines, 8,192 entries each: chains of 2,048 blocks, a mark
        // naming the top key of each of a chain's 256 anchor windows (covering marks).
        let engines = 128u64;
        let per_engine = entries.div_ceil(engines);
        // Within the longest lifetime (120 s): a mark past it + 10 s is refused.
        let expiry = now() + 100_000_000;
        const CHAIN: u64 = 2_048;
        for e in 0..engines {
            // 257 window tops per chain (position 0, every 8th, the last).
            for chain in 0..per_engine.div_ceil(CHAIN / 8 + 1) {
                let keys: Vec<u64> = (0..CHAIN)
                    .map(|p| (e << 40 | chain << 16 | p).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
                    .collect();
                a.input
                    .send(Input::Mark { engine: e + 1, keys, known: 0, expiry_us: expiry })
                    .await
                    .expect("input");
            }
        }
        let held = |n: &MeshNode| n.core.lock().map(|c| c.sizes().1).unwrap_or(0) as u64;
        let t = Instant::now();
        let tops = engines * per_engine.div_ceil(CHAIN / 8 + 1) * (CHAIN / 8 + 1);
        while held(&a) < tops && t.elapsed() < Duration::from_secs(120) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let want = held(&a);
        println!("a holds {want} index entries (marks) after {:?}", t.elapsed());
        // B joins with A as its seed.
        let seed = Seeds { addrs: vec![a.id.addr.to_string()], dns: None };
        let t0 = Instant::now();
        let (b, mut b_applies) = MeshNode::start("b", any, &tls("b"), seed, cfg(false), now.clone(), None, 0)
            .await
            .expect("b");
        b.input.send(told).await.expect("input");
        let warm_at = Arc::new(AtomicU64::new(0));
        let w = warm_at.clone();
        tokio::spawn(async move {
            while let Some(x) = b_applies.recv().await {
                if matches!(x, Apply::Warm { .. }) {
                    w.store(t0.elapsed().as_micros() as u64, Relaxed);
                }
            }
        });
        let mut all_at = None;
        while t0.elapsed() < Duration::from_secs(120) {
            if all_at.is_none() && held(&b) >= want {
                all_at = Some(t0.elapsed());
            }
            if all_at.is_some() && warm_at.load(Relaxed) > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let bytes = b.transport.counters().bytes_received[1].load(Relaxed);
        println!(
            "b joined: warm (ready) {:.2} s after its start, all {} entries held {} ; {:.1} MB of state received",
            warm_at.load(Relaxed) as f64 / 1e6,
            want,
            all_at.map_or("NOT within 120 s".into(), |d| format!("{:.2} s after its start", d.as_secs_f64())),
            bytes as f64 / 1e6
        );
        b.leave().await;
        a.leave().await;
    });
}
