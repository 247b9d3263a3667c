//! Which speculative marks travel: a new prompt's (the decision found nothing: siblings at
//! other routers find the engine by it until its KV events come), and not one that extends a
//! prefix the engine was found holding while the engine's feed is in sync (the events say the
//! same a few ms later); approximate marks (no events) always. Virtual time, no sockets.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim};

const SPECULATIVE_US: u64 = 2_000_000;
const APPROXIMATE_US: u64 = 120_000_000;

fn cluster() -> Sim {
    let cfg = CoreConfig {
        cluster_id: 9,
        flush_us: 5_000,
        load_flush_us: 100,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: 4_096,
        feed_capacity: 4_096,
        mark_ttls_us: vec![SPECULATIVE_US, APPROXIMATE_US],
        expected_size: 3,
        warm_bound_us: 1_000_000,
        first: false,
    };
    let net = NetConfig {
        datagram_loss: 0,
        envelope_loss: 0,
        delay_us: 200,
        jitter_us: 200,
        dup_per_mille: 0,
    };
    let mut s = Sim::new(3, 4, cfg, net, 21);
    s.start_all();
    assert!(s.until(20_000_000, |s| s.membership_converged()).is_some());
    // Every engine's feed in sync everywhere.
    let engines: Vec<u64> = s.engines.keys().copied().collect();
    for &e in &engines {
        s.engine_event(e);
    }
    assert!(s.until(10_000_000, |s| s.indexes_exact()).is_some());
    s.run(2_000_000, |_| {});
    s
}

/// Marks applied by nodes 1 and 2 after node 0 marks `engine` (`known` keys found held).
fn received(s: &mut Sim, engine: u64, known: usize, ttl: u64, salt: u64) -> u64 {
    let before: u64 = (1..3)
        .map(|i| s.nodes[i].as_ref().unwrap().index.marks)
        .sum();
    let now = s.now;
    let keys: Vec<u64> = (0..12).map(|k| (salt << 8 | k) * 2 + 1).collect();
    s.nodes[0]
        .as_mut()
        .unwrap()
        .core
        .local_mark(engine, keys, known, now + ttl);
    s.run(200_000, |_| {});
    (1..3)
        .map(|i| s.nodes[i].as_ref().unwrap().index.marks)
        .sum::<u64>()
        - before
}

#[test]
fn only_new_prompts_speculative_marks_travel_while_the_feed_is_in_sync() {
    let mut s = cluster();
    let e = *s.engines.keys().next().unwrap();
    assert_eq!(
        received(&mut s, e, 0, SPECULATIVE_US, 1),
        2,
        "a new prompt's mark reaches both peers"
    );
    assert_eq!(
        received(&mut s, e, 4, SPECULATIVE_US, 2),
        0,
        "an extension of a found prefix stays local"
    );
    assert_eq!(s.nodes[0].as_ref().unwrap().core.counters().marks_kept, 1);
    assert_eq!(
        received(&mut s, e, 4, APPROXIMATE_US, 3),
        2,
        "approximate marks (no events) always travel"
    );
}
