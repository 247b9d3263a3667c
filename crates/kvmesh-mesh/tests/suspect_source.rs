//! A router killed while other routers follow its feeds: until it is declared down (seconds:
//! SWIM's suspicion has to time out) its followers receive nothing of those engines, and
//! switch to another owner only then. Meanwhile a follower that holds it suspect (SWIM's
//! suspicion reaches most followers before the declaration does: 4 s before in some seeds)
//! says through `MeshCore::feed_live` that those engines' feeds are not live: they count as
//! engines whose events are stale (shown so; the router's own decisions on them remembered
//! for the approximate TTL; the blocks indexed before kept). (QA: the follower's feed was
//! reported synced and not stale for 5–7 s after the kill.) Seeded, sans-IO.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim, sim_config};
use kvmesh_state::NodeId;

const ENGINES: u64 = 16;

fn cfg() -> CoreConfig {
    CoreConfig {
        ingest_replicas: 2,
        ..sim_config(21, 4)
    }
}

fn events(s: &mut Sim) {
    let engines: Vec<u64> = s.engines.keys().copied().collect();
    let e = engines[s.rng.below(engines.len() as u64) as usize];
    s.engine_event(e);
}

/// Per live router but `source`, the engines whose feed it follows from `source`.
fn followers_of(s: &Sim, source: NodeId) -> Vec<(usize, Vec<u64>)> {
    s.nodes
        .iter()
        .enumerate()
        .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
        .filter(|(_, n)| n.core.id() != source)
        .map(|(i, n)| {
            let engines = n
                .core
                .feeds_followed()
                .into_iter()
                .filter(|(_, f)| f.is_some_and(|f| f.source == source))
                .map(|(e, _)| e)
                .collect();
            (i, engines)
        })
        .filter(|(_, e): &(usize, Vec<u64>)| !e.is_empty())
        .collect()
}

#[test]
fn a_killed_source_s_feeds_are_not_live_at_its_followers_before_it_is_declared_down() {
    for seed in 1..=8 {
        let mut s = Sim::in_sync(4, ENGINES, cfg(), NetConfig::LOSSLESS, seed).expect("formed");
        s.run(1_000_000, events);
        // The router that the most others follow.
        let victim = (0..4)
            .max_by_key(|&v| {
                followers_of(&s, NodeId::from_name(&format!("r{v}")))
                    .iter()
                    .map(|f| f.1.len())
                    .sum::<usize>()
            })
            .expect("routers");
        let vid = NodeId::from_name(&format!("r{victim}"));
        let followed = followers_of(&s, vid);
        assert!(
            !followed.is_empty(),
            "seed {seed}: nobody follows r{victim}"
        );
        for (i, engines) in &followed {
            let n = s.nodes[*i].as_ref().expect("alive");
            let suspects = n.core.suspects();
            for e in engines {
                assert!(n.core.feed_live(*e, &suspects), "seed {seed}: live before");
            }
        }
        s.kill(victim);
        let killed = s.now;
        // Per follower, in 10 ms steps: when its feeds from the victim stopped being live
        // (or it followed another source), and when it declared the victim down.
        let mut not_live: Vec<Option<u64>> = vec![None; followed.len()];
        let mut down: Vec<Option<u64>> = vec![None; followed.len()];
        while down.iter().any(Option::is_none) && s.now - killed < 30_000_000 {
            s.run(10_000, |_| {});
            for (k, (i, engines)) in followed.iter().enumerate() {
                let n = s.nodes[*i].as_ref().expect("alive");
                let suspects = n.core.suspects();
                let followed_now = n.core.feeds_followed();
                let live = engines.iter().any(|e| {
                    n.core.feed_live(*e, &suspects)
                        && followed_now[e].is_some_and(|f| f.source == vid)
                });
                if !live && not_live[k].is_none() {
                    not_live[k] = Some(s.now - killed);
                }
                let member = n.core.members().any(|m| NodeId::from_name(&m.name) == vid);
                if !member && down[k].is_none() {
                    down[k] = Some(s.now - killed);
                }
            }
        }
        let ms = |v: &[Option<u64>]| -> Vec<u64> {
            v.iter().map(|t| t.expect("within 30 s") / 1_000).collect()
        };
        let (not_live, down) = (ms(&not_live), ms(&down));
        // Never later than the declaration; earlier wherever SWIM's suspicion reached the
        // follower first (a follower may learn the death as a declaration directly).
        for (k, (nl, d)) in not_live.iter().zip(&down).enumerate() {
            assert!(
                nl <= d,
                "seed {seed}: follower {k} not live at {nl} ms, down at {d} ms"
            );
        }
        assert!(
            not_live.iter().zip(&down).any(|(nl, d)| nl < d),
            "seed {seed}: no follower stopped calling the feeds live before the declaration"
        );
    }
}
