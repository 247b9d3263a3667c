//! The mesh at scale, in virtual time (the sans-IO nodes of `kvmesh_mesh::core` over the
//! seeded simulated network of `core::sim`): R routers (default 128) and E engines with KV
//! events (default 4,096, ingest replicas 2), a cluster-wide request rate (default 10,000/s:
//! each request an in-flight change at its router for one second and its decision's mark — a
//! shared group prefix of 64 blocks plus 8 of its own — for 2 s with precise routing, whose
//! engines publish KV events read by their owners (one batch per request), or for 120 s with
//! approximate routing, `KVMESH_SCALE_MODE=approximate`, without events).
//!
//! Reports (not asserted): state bytes received per router per second under steady load, and
//! the time from the heal of a partition into halves until every router agrees (membership,
//! digests, every engine's blocks in every index, ownership covered), p50/p99 over seeds.
//!
//!   cargo bench -p kvmesh-mesh --bench mesh_scale
//!   KVMESH_SCALE_MODE=approximate cargo bench -p kvmesh-mesh --bench mesh_scale
//!   KVMESH_SCALE_KINDS=1 …   # also the steady window's bytes by kind (decodes every envelope)
//!   KVMESH_SCALE_FIRST_SEED=4 …   # seeds from 4 (runs of one seed side by side)
//!   KVMESH_SCALE_WIRE=1 …   # every router writes version 1 envelopes (2, the default: each part on its own)
//!   KVMESH_SCALE_ROUTERS=32 KVMESH_SCALE_ENGINES=1024 KVMESH_SCALE_RATE=2000 \
//!     KVMESH_SCALE_SEEDS=3 cargo bench -p kvmesh-mesh --bench mesh_scale

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim};
use std::collections::VecDeque;
use std::time::Instant;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Requests: (due to end, router, engine); in-flight per (router, engine).
struct Load {
    /// Precise routing: engines publish KV events (their owners' feeds travel) and decisions
    /// make speculative marks of 2 s. Approximate: no events; decisions' marks live 120 s.
    precise: bool,
    rate: u64,
    groups: u64,
    ending: VecDeque<(u64, usize, u64)>,
    in_flight: std::collections::HashMap<(usize, u64), u32>,
    /// Groups whose prefix their engine holds (the decision finds it: `known` = 64 blocks).
    seen: std::collections::HashSet<u64>,
    busy: bool,
}

impl Load {
    fn tick(&mut self, s: &mut Sim) {
        let now = s.now;
        let engines: Vec<u64> = s.engines.keys().copied().collect();
        let alive = s.alive();
        // Requests that end.
        while let Some(&(due, r, e)) = self.ending.front() {
            if due > now {
                break;
            }
            self.ending.pop_front();
            let c = self.in_flight.entry((r, e)).or_default();
            *c = c.saturating_sub(1);
            let v = *c;
            if let Some(n) = s.nodes[r].as_mut() {
                n.core.local_load(e, v);
            }
        }
        if !self.busy || alive.is_empty() {
            return;
        }
        // This 10 ms's new requests.
        for _ in 0..self.rate / 100 {
            let g = s.rng.below(self.groups);
            let e = engines[(g.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) as usize % engines.len()];
            let r = alive[s.rng.below(alive.len() as u64) as usize];
            let mut keys: Vec<u64> = (0..64u64).map(|j| (g << 8 | j) * 2 + 1).collect();
            keys.extend((0..8).map(|_| s.rng.next_u64() | 1));
            let c = self.in_flight.entry((r, e)).or_default();
            *c += 1;
            let v = *c;
            let ttl = if self.precise { 2_000_000 } else { 120_000_000 };
            if let Some(n) = s.nodes[r].as_mut() {
                let known = if self.seen.insert(g) { 0 } else { 64 };
                n.core.local_mark(e, keys, known, now + ttl);
                n.core.local_load(e, v);
            }
            self.ending.push_back((now + 1_000_000, r, e));
            if self.precise {
                s.engine_event(e);
            }
        }
    }
}

fn main() {
    let routers = env("KVMESH_SCALE_ROUTERS", 128) as usize;
    let engines = env("KVMESH_SCALE_ENGINES", 4_096);
    let rate = env("KVMESH_SCALE_RATE", 10_000);
    let seeds = env("KVMESH_SCALE_SEEDS", 3);
    let steady_s = env("KVMESH_SCALE_STEADY_S", 5);
    let precise = std::env::var("KVMESH_SCALE_MODE").map_or(true, |m| m != "approximate");
    println!(
        "mesh scale (virtual time): {routers} routers, {engines} engines (ingest replicas 2), {rate} requests/s cluster-wide, {} routing, {seeds} seeds",
        if precise {
            "precise (KV events: owners' feeds, 2 s marks)"
        } else {
            "approximate (no events, 120 s marks)"
        }
    );
    let mut heals = Vec::new();
    let first_seed = env("KVMESH_SCALE_FIRST_SEED", 1);
    for seed in first_seed..first_seed + seeds {
        let wall = Instant::now();
        let cfg = CoreConfig {
            cluster_id: 1,
            flush_us: 20_000,
            load_flush_us: std::env::var("KVMESH_SCALE_LOAD_FLUSH_US")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(100),
            load_burst: std::env::var("KVMESH_SCALE_LOAD_BURST")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(8),
            anti_entropy_us: 1_000_000,
            ingest_replicas: 2,
            mark_capacity: 131_072,
            feed_capacity: 131_072,
            mark_ttls_us: vec![2_000_000, 120_000_000],
            expected_size: routers as u32,
            warm_bound_us: 5_000_000,
            // `KVMESH_SCALE_WIRE=1`: every router writes version 1 envelopes (the config's
            // default, 2, otherwise).
            wire_version: std::env::var("KVMESH_SCALE_WIRE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(kvmesh_config::MeshConfig::default().wire_version),
            snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
            first: false,
        };
        let net = NetConfig {
            datagram_loss: 1,
            envelope_loss: 0,
            delay_us: 200,
            jitter_us: 1_000,
            dup_per_mille: 1,
        };
        let mut s = Sim::new(routers, engines, cfg, net, seed);
        s.start_all();
        let formed = s.until(300_000_000, |s| s.membership_converged());
        let mut load = Load {
            precise,
            rate,
            groups: 2_000,
            ending: VecDeque::new(),
            in_flight: Default::default(),
            seen: Default::default(),
            busy: true,
        };
        // Warm-up (past the cluster's formation: its new owners wait up to
        // `HANDOVER_WAIT_US` for a handover nobody can give, then read their engines and
        // every router pulls their feeds), then the steady window whose received bytes are
        // counted.
        s.run(6_000_000, |s| load.tick(s));
        let before: Vec<u64> = s.bytes_in.clone();
        let counts = |s: &Sim| {
            s.nodes
                .iter()
                .flatten()
                .fold((0u64, 0u64, 0u64), |(a, r, p), n| {
                    let c = n.core.counters();
                    (a + c.anti_entropy_rounds, r + c.repairs, p + c.feed_pulls)
                })
        };
        let (ae0, rep0, pull0) = counts(&s);
        if std::env::var("KVMESH_SCALE_KINDS").is_ok_and(|v| v == "1") {
            s.by_kind = Some(Default::default());
        }

        s.run(steady_s * 1_000_000, |s| load.tick(s));
        let per_router: Vec<f64> = s
            .bytes_in
            .iter()
            .zip(&before)
            .map(|(a, b)| (a - b) as f64 / steady_s as f64)
            .collect();
        let (ae1, rep1, pull1) = counts(&s);
        let per_s = |x: u64| x as f64 / steady_s as f64 / routers as f64;
        println!(
            "seed {seed}: steady window, per router per second: {:.2} anti-entropy rounds (digest exchanges started, meetings included), {:.2} repairs, {:.2} feed pulls",
            per_s(ae1 - ae0),
            per_s(rep1 - rep0),
            per_s(pull1 - pull0)
        );
        if let Some(kinds) = s.by_kind.take() {
            let total: u64 = kinds.values().sum();
            let mut v: Vec<_> = kinds.into_iter().collect();
            v.sort_by_key(|(_, b)| std::cmp::Reverse(*b));
            let shares: Vec<String> = v
                .iter()
                .map(|(k, b)| {
                    format!(
                        "{k} {:.0} KB/s ({:.0}%)",
                        *b as f64 / steady_s as f64 / routers as f64 / 1e3,
                        100.0 * *b as f64 / total.max(1) as f64
                    )
                })
                .collect();
            println!(
                "seed {seed}: received per router by kind: {}",
                shares.join(", ")
            );
        }
        let mean = per_router.iter().sum::<f64>() / per_router.len() as f64;
        let max = per_router.iter().cloned().fold(0.0, f64::max);
        // Partition into halves under load, heal, quiet: time to agreement.
        for i in 0..routers {
            s.group[i] = u8::from(i >= routers / 2);
        }
        s.run(10_000_000, |s| load.tick(s));
        for g in &mut s.group {
            *g = 0;
        }
        load.busy = false;
        // When each part agreed first (membership, every index, ownership, digests).
        let mut parts: [Option<u64>; 4] = [None; 4];
        let start = s.now;
        let healed = s.until(120_000_000, |s| {
            let at = s.now - start;
            let ok = [
                s.membership_converged(),
                s.indexes_exact(),
                s.ownership_covered(),
                s.digests().windows(2).all(|w| w[0] == w[1]),
            ];
            for (p, ok) in parts.iter_mut().zip(ok) {
                if ok && p.is_none() {
                    *p = Some(at);
                }
            }
            if (5_000_000..5_100_000).contains(&at) && !ok.iter().all(|x| *x) {
                println!("seed {seed}: 5 s after the heal, agreed {ok:?} (membership, indexes, ownership, digests)\n{}", s.explain().lines().take(16).collect::<Vec<_>>().join("\n"));
            }
            ok.iter().all(|x| *x)
        });
        let (ignored, refused, orphans) =
            s.nodes.iter().flatten().fold((0, 0, 0), |(i, r, o), n| {
                let c = n.core.counters();
                (
                    i + c.digests_ignored,
                    r + c.deltas_refused,
                    o + c.orphan_entries_dropped,
                )
            });
        println!(
            "seed {seed}: whole run, all routers: {ignored} digests ignored, {refused} deltas refused, {orphans} orphan entries dropped"
        );
        let secs = |t: Option<u64>| t.map_or("-".to_string(), |t| format!("{:.1}", t as f64 / 1e6));
        println!(
            "seed {seed}: after the heal, first agreed (s): membership {}, indexes {}, ownership {}, digests {}",
            secs(parts[0]),
            secs(parts[1]),
            secs(parts[2]),
            secs(parts[3])
        );
        println!(
            "seed {seed}: formed {:?} s; steady state: {:.0} KB/s received per router (mean), {:.0} KB/s (max); converged {} after the heal (virtual); wall {:.1} s",
            formed.map(|t| t as f64 / 1e6),
            mean / 1e3,
            max / 1e3,
            healed.map_or("NOT within 120 s".into(), |t| format!(
                "{:.1} s",
                t as f64 / 1e6
            )),
            wall.elapsed().as_secs_f64()
        );
        if let Some(t) = healed {
            heals.push(t as f64 / 1e6);
        }
    }
    heals.sort_by(|a, b| a.total_cmp(b));
    if !heals.is_empty() {
        let p = |q: f64| heals[((heals.len() as f64 - 1.0) * q).round() as usize];
        println!(
            "convergence after heal: p50 {:.1} s, p99 {:.1} s over {} seeds (virtual)",
            p(0.5),
            p(0.99),
            heals.len()
        );
    }
}
