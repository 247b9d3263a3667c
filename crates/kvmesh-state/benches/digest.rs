//! What anti-entropy's digests cost at the scale target: a registry of 4,096 engines and the
//! load entries of 128 routers × 4,096 engines (524,288). Each digest exchange computes this
//! router's digests and, when the load differs, its per-router load digests, on the mesh's
//! thread. Also the merge of a load delta (the mesh's most frequent state change).
//!
//! `cargo bench -p kvmesh-state --bench digest` (bounded: a fixed number of iterations).

use kvmesh_state::{EngineRecord, LoadDelta, LoadMap, NodeId, RegistrySet, Version};
use std::hint::black_box;
use std::time::{Duration, Instant};

const ROUTERS: u64 = 128;
const ENGINES: u64 = 4_096;

/// Median of `n` timings of `f`.
fn median(n: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..n)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[n / 2]
}

fn main() {
    let me = NodeId::from_name("router-0");
    let mut reg = RegistrySet::new();
    for e in 0..ENGINES {
        let url = format!("http://10.0.{}.{}:8000", e / 256, e % 256);
        let record = EngineRecord {
            kv_events: url.replace("http", "tcp").replace("8000", "5557"),
            url,
            weight_milli: 1_000,
            kv_replay: String::new(),
            models: vec![],
        };
        reg.add(me, 1_000 + e, e * 7 + 1, record);
    }
    let nodes: Vec<NodeId> = (0..ROUTERS)
        .map(|r| NodeId::from_name(&format!("router-{r}")))
        .collect();
    let mut load = LoadMap::new();
    let start = Instant::now();
    for (r, &n) in nodes.iter().enumerate() {
        for e in 0..ENGINES {
            load.merge(&LoadDelta {
                node: n,
                engine: e * 7 + 1,
                version: Version {
                    incarnation: 1,
                    counter: e + 1,
                },
                in_flight: ((e + r as u64) % 5) as u32,
            });
        }
    }
    let fill = start.elapsed();
    let mut counter = ENGINES;
    let mut k = 0u64;
    let merges = 1_024 * ROUTERS as usize;
    let merge = median(5, || {
        for &n in &nodes {
            for e in 0..1_024u64 {
                k += 1;
                load.merge(&LoadDelta {
                    node: n,
                    engine: e * 7 + 1,
                    version: Version {
                        incarnation: 1,
                        counter: counter + e + 1,
                    },
                    in_flight: (k % 7) as u32,
                });
            }
        }
        counter += 1_024;
    });
    let reg_first = {
        let s = Instant::now();
        black_box(reg.digest());
        s.elapsed()
    };
    let reg_again = median(101, || {
        black_box(reg.digest());
    });
    let load_digest = median(101, || {
        black_box(load.digest());
    });
    let node_digests = median(101, || {
        black_box(load.node_digests());
    });
    println!(
        "registry of {ENGINES} engines, load of {ROUTERS} routers × {ENGINES} engines ({} entries, filled in {fill:.1?})",
        load.len()
    );
    println!("  registry digest: {reg_first:.2?} computed, {reg_again:.2?} unchanged since");
    println!("  load digest: {load_digest:.2?}; per-router load digests: {node_digests:.2?}");
    println!(
        "  load merge: {:.0} ns per delta (median of 5 × {merges} replacing deltas)",
        merge.as_nanos() as f64 / merges as f64
    );
}
