//! A router restarted before the others declared it down may receive its earlier life's
//! in-flight counts back in a peer's state. It is the only writer of its counts: it never
//! takes them, so the cluster's digests agree again. (Found by QA: after a `kill -9` and a
//! restart within the failure-detection time, the restarted router kept its old count,
//! which the peers had dropped; the load digests differed and anti-entropy repaired every
//! round for as long as it did not route to that engine again.) The same when two routers
//! restart together and meet each other first. Virtual time, no sockets.

use kvmesh_mesh::core::sim::{NetConfig, Sim, sim_config};

/// Three routers formed, with `counts`: (router, engine index, in flight) spread to all.
fn formed_with_counts(seed: u64, counts: &[(usize, usize, u32)]) -> Sim {
    let mut s = Sim::new(3, 4, sim_config(seed, 3), NetConfig::default(), seed);
    s.start_all();
    assert!(
        s.until(20_000_000, |s| s.membership_converged()).is_some(),
        "seed {seed}: the cluster formed"
    );
    let engines: Vec<u64> = s.engines.keys().copied().collect();
    for &(i, e, n) in counts {
        s.nodes[i]
            .as_mut()
            .expect("node")
            .core
            .local_load(engines[e], n);
    }
    assert!(
        s.until(5_000_000, |s| s.digests().windows(2).all(|w| w[0] == w[1]))
            .is_some(),
        "seed {seed}: the counts spread"
    );
    s
}

/// Asserts that the members and their digests agree again within 30 s.
fn agree_again(s: &mut Sim, seed: u64) {
    assert!(
        s.until(30_000_000, |s| s.membership_converged()
            && s.digests().windows(2).all(|w| w[0] == w[1]))
            .is_some(),
        "seed {seed}: the digests never agreed again\n{}",
        s.explain()
    );
}

#[test]
fn a_quick_restart_does_not_take_back_its_earlier_counts() {
    for seed in 1..=8 {
        let mut s = formed_with_counts(seed, &[(0, 0, 5)]);
        let engine = *s.engines.keys().next().expect("an engine");
        // Killed and back within a fraction of the failure-detection time.
        s.kill(0);
        s.run(300_000, |_| {});
        s.start(0, Some(1));
        agree_again(&mut s, seed);
        assert_eq!(
            s.nodes[1]
                .as_ref()
                .expect("node 1")
                .index
                .peer_load
                .get(&engine)
                .copied()
                .unwrap_or(0),
            0,
            "seed {seed}: the earlier life's count is gone"
        );
    }
}

/// Two routers killed with requests in flight and restarted together, each announcing to the
/// other: they meet each other before the router that stayed, whose state still holds their
/// earlier lives' counts. A router that first learns of a peer in a later life than those
/// counts drops them (found by QA: each restarted router kept the other's dead counts for
/// good, its digests apart and anti-entropy repairing every round; 10 of these 32 seeds
/// before).
#[test]
fn routers_restarted_together_drop_each_other_s_earlier_counts() {
    for seed in 1..=32 {
        let mut s = formed_with_counts(seed, &[(1, 0, 3), (2, 1, 3)]);
        s.kill(1);
        s.kill(2);
        s.run(200_000, |_| {});
        s.start(1, Some(2));
        s.start(2, Some(1));
        agree_again(&mut s, seed);
        for i in 0..3 {
            let left: u64 = s.nodes[i]
                .as_ref()
                .expect("node")
                .index
                .peer_load
                .values()
                .sum();
            assert_eq!(left, 0, "seed {seed}: node {i} keeps earlier lives' counts");
        }
    }
}
