//! In-flight changes travel ahead of the outbox's flush period: a router that ends a request
//! tells its peers within `load_flush_us` × routers (plus the network), not a whole flush
//! later, so that a client's next turn through another router finds the engine's load as it
//! is. Virtual time, no sockets.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim};

const FLUSH_US: u64 = 20_000;
const DELAY_US: u64 = 200;

fn cfg(load_flush_us: u64) -> CoreConfig {
    CoreConfig {
        cluster_id: 3,
        flush_us: FLUSH_US,
        load_flush_us,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: 512,
        feed_capacity: 4_096,
        mark_ttls_us: vec![2_000_000],
        expected_size: 3,
        warm_bound_us: 1_000_000,
        first: false,
    }
}

/// How long after a change at node 0 node 1 applies it (µs), over `changes` changes.
fn delays(load_flush_us: u64, changes: u32) -> Vec<u64> {
    let net = NetConfig {
        datagram_loss: 0,
        envelope_loss: 0,
        delay_us: DELAY_US,
        jitter_us: 0,
        dup_per_mille: 0,
    };
    let mut s = Sim::new(3, 4, cfg(load_flush_us), net, 11);
    s.start_all();
    assert!(
        s.until(20_000_000, |s| s.membership_converged()).is_some(),
        "the cluster formed"
    );
    s.run(2_000_000, |_| {});
    let mut out = Vec::new();
    for k in 1..=changes {
        // Changes at odd moments relative to the flush period.
        s.run(7_300 + u64::from(k) * 1_100, |_| {});
        let at = s.now;
        s.nodes[0].as_mut().expect("node 0").core.local_load(2, k);
        let arrived = (0..400).find_map(|_| {
            s.run(100, |_| {});
            let got = s.nodes[1]
                .as_ref()
                .expect("node 1")
                .index
                .peer_load
                .get(&2)
                .copied();
            (got == Some(u64::from(k))).then(|| s.now - at)
        });
        out.push(arrived.expect("the change arrived within 40 ms"));
    }
    out
}

#[test]
fn in_flight_changes_arrive_within_the_load_spacing_not_the_flush_period() {
    // 3 routers × 100 µs = 300 µs after the previous flush, + 200 µs of network, + the
    // 100 µs steps of this loop.
    let eager = delays(100, 20);
    let worst = *eager.iter().max().unwrap();
    println!("eager {eager:?}");
    assert!(worst <= 300 + DELAY_US + 200, "eager: {eager:?}");
    // With the flush period only, some change waits most of a period.
    let lazy = delays(0, 20);
    let worst_lazy = *lazy.iter().max().unwrap();
    println!("flush only {lazy:?}");
    assert!(worst_lazy > FLUSH_US / 2, "flush only: {lazy:?}");
}
