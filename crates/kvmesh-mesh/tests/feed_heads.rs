//! Feed heads: a receiver behind a feed's head pulls from its owner. The heads announced must
//! be ones whose batches have left (a busy feed over a network that reorders streams costs no
//! pulls), and a feed gone quiet whose last batches were lost is repaired by the settled
//! head's announcement, a period or two later — not at the refresh ten periods later.
//! Virtual time, no sockets.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim};

const ROUTERS: usize = 12;
const ENGINES: u64 = 48;

fn cfg(flush_us: u64) -> CoreConfig {
    CoreConfig {
        cluster_id: 5,
        flush_us,
        load_flush_us: 100,
        load_burst: 8,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: 4_096,
        feed_capacity: 65_536,
        mark_ttls_us: vec![2_000_000],
        expected_size: ROUTERS as u32,
        warm_bound_us: 1_000_000,
        wire_version: 1,
        snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
        first: false,
    }
}

fn cluster(net: NetConfig, flush_us: u64, seed: u64) -> Sim {
    let mut s = Sim::new(ROUTERS, ENGINES, cfg(flush_us), net, seed);
    s.start_all();
    assert!(
        s.until(30_000_000, |s| s.membership_converged()).is_some(),
        "seed {seed}: the cluster formed"
    );
    s
}

fn pulls(s: &Sim) -> u64 {
    s.nodes
        .iter()
        .flatten()
        .map(|n| n.core.counters().feed_pulls)
        .sum()
}

/// Every engine emits a batch every 120 ms (4 engines every 10 ms, in turn) for `for_us`.
fn busy(s: &mut Sim, for_us: u64) {
    let engines: Vec<u64> = s.engines.keys().copied().collect();
    let mut k = 0usize;
    s.run(for_us, |s| {
        for _ in 0..4 {
            k += 1;
            s.engine_event(engines[k % engines.len()]);
        }
    });
}

#[test]
fn a_busy_feed_over_a_reordering_network_costs_no_pulls() {
    // Streams arrive up to 3 ms apart in any order; nothing is lost.
    let net = NetConfig {
        datagram_loss: 0,
        envelope_loss: 0,
        delay_us: 200,
        jitter_us: 3_000,
        dup_per_mille: 0,
    };
    for seed in 1..=4 {
        // A long flush period (160 ms at 128 routers; here 70 ms, not a divisor of the 1 s
        // anti-entropy period): a batch waits in the outbox when the period comes, and goes
        // out in the same flush as the heads — on another stream. Its head must not race it.
        let mut s = cluster(net, 70_000, seed);
        // Owners settle and receivers take their first snapshots.
        busy(&mut s, 4_000_000);
        let before = pulls(&s);
        busy(&mut s, 6_000_000);
        let during = pulls(&s) - before;
        s.run(3_000_000, |_| {});
        assert!(s.indexes_exact(), "seed {seed}: {}", s.explain());
        assert_eq!(
            during, 0,
            "seed {seed}: receivers pulled batches that were on their way"
        );
    }
}

#[test]
fn a_quiet_feed_whose_last_batches_were_lost_is_repaired_by_its_settled_head() {
    for seed in 1..=6 {
        let mut s = cluster(
            NetConfig {
                datagram_loss: 0,
                envelope_loss: 0,
                delay_us: 200,
                jitter_us: 500,
                dup_per_mille: 0,
            },
            5_000,
            seed,
        );
        busy(&mut s, 3_000_000);
        s.run(3_000_000, |_| {});
        assert!(s.indexes_exact(), "seed {seed}: {}", s.explain());
        // A last burst, a fifth of whose envelopes are lost (streams of a connection that
        // broke), then silence: no later batch shows a gap.
        s.net.envelope_loss = 20;
        busy(&mut s, 300_000);
        s.net.envelope_loss = 0;
        let after = s.until(8_000_000, |s| s.indexes_exact());
        println!("seed {seed}: repaired {after:?} µs after the burst");
        // The settled head goes out at the second anti-entropy period after the last batch
        // (≤ 2 s), long before the refresh (10 periods).
        assert!(
            after.is_some_and(|t| t <= 3_000_000),
            "seed {seed}: not repaired within 3 s of the burst: {after:?}\n{}",
            s.explain()
        );
    }
}
