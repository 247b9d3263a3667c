//! A healed partition is repaired by the routers meeting again, not by anti-entropy's random
//! rounds: with anti-entropy so slow that it never runs in the window, 8 nodes (formed
//! quietly) split in halves, busy on both sides (marks, KV events read by each side's owners) until the very
//! moment of the heal, must agree — membership, digests, every engine's blocks in every index,
//! ownership — within a few announce periods of virtual time after it. Seeded, no loss, no
//! sockets.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim};

const N: usize = 8;

fn cfg() -> CoreConfig {
    CoreConfig {
        cluster_id: 3,
        flush_us: 20_000,
        load_flush_us: 100,
        load_burst: 8,
        // Never within the test's window after the heal.
        anti_entropy_us: 600_000_000,
        ingest_replicas: 2,
        mark_capacity: 512,
        feed_capacity: 4_096,
        mark_ttls_us: vec![600_000_000],
        expected_size: N as u32,
        warm_bound_us: 2_000_000,
        wire_version: 1,
        snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
        first: false,
    }
}

/// No loss, 0.3–1.3 ms of delay.
const NET: NetConfig = NetConfig {
    datagram_loss: 0,
    envelope_loss: 0,
    delay_us: 300,
    jitter_us: 1_000,
    dup_per_mille: 0,
};

/// `N` nodes started one at a time, so that each asks a warm member for its state (a cold
/// node asks again only at the next anti-entropy round), node `i` writing envelopes of
/// `version(i)`; formed and converged, or the test fails.
fn formed(seed: u64, version: impl Fn(usize) -> u8) -> Sim {
    let mut s = Sim::new(N, 8, cfg(), NET, seed);
    s.cfg.wire_version = version(0);
    s.start(0, None);
    for i in 1..N {
        s.run(500_000, |_| {});
        s.cfg.wire_version = version(i);
        s.start(i, Some(0));
    }
    s.run(3_000_000, |_| {});
    assert!(
        s.until(30_000_000, |s| s.converged()).is_some(),
        "seed {seed}: the cluster never formed\n{}",
        s.explain()
    );
    s
}

fn activity(s: &mut Sim) {
    let alive = s.alive();
    let engines: Vec<u64> = s.engines.keys().copied().collect();
    let e = engines[s.rng.below(engines.len() as u64) as usize];
    s.engine_event(e);
    let i = alive[s.rng.below(alive.len() as u64) as usize];
    let e = engines[s.rng.below(engines.len() as u64) as usize];
    let (load, key, now) = (s.rng.below(8) as u32, s.rng.next_u64(), s.now);
    if let Some(n) = s.nodes[i].as_mut() {
        n.core.local_load(e, load);
        n.core
            .local_mark(e, vec![key | 1, key | 3], 0, now + 600_000_000);
    }
}

#[test]
fn a_healed_partition_is_repaired_when_the_halves_meet_not_by_anti_entropy() {
    for seed in 1..=20 {
        let mut s = formed(seed, |_| 1);
        for i in 0..N {
            s.group[i] = u8::from(i >= N / 2);
        }
        // Long enough for each half to declare the other down; busy to the last moment.
        s.run(15_000_000, activity);
        assert!(
            s.view(0).len() < N - 1,
            "seed {seed}: the partition was not seen"
        );
        for g in &mut s.group {
            *g = 0;
        }
        let healed = s.until(5_000_000, |s| s.converged());
        assert!(
            healed.is_some(),
            "seed {seed}: not converged 5 s after the heal: membership {}, indexes {}, ownership {}, digests equal {}\n{}",
            s.membership_converged(),
            s.indexes_exact(),
            s.ownership_covered(),
            {
                let d = s.digests();
                d.windows(2).all(|w| w[0] == w[1])
            },
            s.explain()
        );
        println!(
            "seed {seed}: converged {:.2} s after the heal (virtual)",
            healed.unwrap_or(0) as f64 / 1e6
        );
    }
}

/// Three nodes (4 engines), 1 and 2 seeded by 0, once their cluster has formed.
fn three_formed(cfg: &CoreConfig, net: NetConfig, seed: u64) -> Sim {
    let mut s = Sim::new(3, 4, cfg.clone(), net, seed);
    s.start(0, None);
    for i in 1..3 {
        s.run(500_000, |_| {});
        s.start(i, Some(0));
    }
    s.run(3_000_000, |_| {});
    assert!(
        s.until(30_000_000, |s| s.converged()).is_some(),
        "seed {seed}: the cluster never formed"
    );
    s
}

/// A partition too short for SWIM to declare anyone down changes no membership, so no join
/// exchange happens; the link coming back as a new connection (the transport closes one
/// silent for 2 s) makes the two sides meet the same way.
#[test]
fn a_link_back_after_a_short_partition_is_repaired_by_the_new_connection() {
    let net = NET;
    let mut cfg = cfg();
    cfg.expected_size = 3;
    for seed in 1..=10 {
        let mut runs = Vec::new();
        for reconnect in [false, true] {
            let mut s = three_formed(&cfg, net, seed);
            // Node 0 alone for 1.5 s, routing (marks, load) to the last moment.
            s.group[0] = 1;
            s.run(1_500_000, |s| {
                let (key, now) = (s.rng.next_u64(), s.now);
                let e = *s.engines.keys().next().unwrap_or(&0);
                if let Some(n) = s.nodes[0].as_mut() {
                    n.core
                        .local_mark(e, vec![key | 1, key | 3], 0, now + 600_000_000);
                }
            });
            s.group[0] = 0;
            assert_eq!(s.view(1).len(), 2, "seed {seed}: node 0 was declared down");
            if reconnect {
                s.reconnect(0, 1);
                s.reconnect(0, 2);
            }
            runs.push(s.until(3_000_000, |s| {
                let d = s.digests();
                d.windows(2).all(|w| w[0] == w[1])
            }));
        }
        // Without the meeting nothing repairs the newest marks before anti-entropy (never,
        // here); with it, they agree.
        assert_eq!(runs[0], None, "seed {seed}: agreed without meeting");
        assert!(
            runs[1].is_some(),
            "seed {seed}: no agreement after the reconnect"
        );
    }
}

/// Routers that write version 1 envelopes and routers that write version 2 (an upgrade
/// between its two rolling restarts: every router reads both) form one cluster, stay busy,
/// split, heal and agree — membership, digests, every engine's blocks in every index,
/// ownership — as routers of one version do; nothing is skipped.
#[test]
fn routers_writing_both_envelope_versions_form_one_cluster_and_heal() {
    for seed in 1..=5 {
        // Odd routers write version 2.
        let mut s = formed(seed, |i| 1 + (i % 2) as u8);
        // Split so that each half holds both versions.
        for i in 0..N {
            s.group[i] = u8::from(i >= N / 2);
        }
        s.run(15_000_000, activity);
        for g in &mut s.group {
            *g = 0;
        }
        assert!(
            s.until(5_000_000, |s| s.converged()).is_some(),
            "seed {seed}: not converged 5 s after the heal\n{}",
            s.explain()
        );
        for i in 0..N {
            let n = s.nodes[i].as_ref().expect("running");
            assert_eq!(n.core.counters().parts_skipped, 0, "seed {seed}: r{i}");
        }
    }
}

/// Routers r0, r1, r2, r1 and r2 seeded with r0 only. r0 leaves, then r1 leaves and restarts
/// (its only seed, r0, gone): r2, left with no live member, holds r1 down and is the only one
/// that can find it again — by announcing to its down members. foca announces to down
/// members only while it has a live one, so the two stayed apart until r0 came back.
#[test]
fn a_router_left_alone_finds_a_restarted_peer_it_holds_down() {
    let mut cfg = cfg();
    cfg.expected_size = 3;
    for seed in 1..=10 {
        let mut s = three_formed(&cfg, NET, seed);
        s.leave(0);
        assert!(
            s.until(10_000_000, |s| s.membership_converged()).is_some(),
            "seed {seed}: r0's leave not seen\n{}",
            s.explain()
        );
        s.leave(1);
        assert!(
            s.until(10_000_000, |s| s.view(2).is_empty()).is_some(),
            "seed {seed}: r1's leave not seen"
        );
        // r2 alone for a while (its periodic timers long gone), then r1 restarts with r0,
        // which nobody answers, as its only seed.
        s.run(3_000_000, |_| {});
        s.start(1, Some(0));
        let met = s.until(5_000_000, |s| s.converged());
        assert!(
            met.is_some(),
            "seed {seed}: r1 and r2 did not meet again within 5 s\n{}",
            s.explain()
        );
    }
}
