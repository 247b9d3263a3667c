//! Ingest ownership: which routers read an engine's KV-event stream. Each engine is owned by
//! the `r` live routers with the highest rendezvous score for it (highest random weight
//! hashing over stable ids), so every router computes the same owners from the same
//! membership, and a router joining or leaving moves only the engines it wins or held
//! (about `r / n` of them), not a reshuffle. `r = 0` means every router reads every engine.

use crate::ids::NodeId;

/// The rendezvous score of `node` for `engine` (higher wins).
pub fn score(engine: u64, node: NodeId) -> u64 {
    let mut x = engine ^ node.0.rotate_left(29) ^ 0x6B6D_6573_685F_6F77;
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// The owners of `engine` among `live` routers: the `r` best scores (all of them when
/// `r == 0` or `r >= live.len()`), best first. Duplicates in `live` count once.
pub fn owners(engine: u64, live: &[NodeId], r: usize) -> Vec<NodeId> {
    let mut all: Vec<(u64, NodeId)> = live.iter().map(|&n| (score(engine, n), n)).collect();
    all.sort_unstable_by(|a, b| b.cmp(a));
    all.dedup_by_key(|x| x.1);
    let k = if r == 0 { all.len() } else { r.min(all.len()) };
    all.into_iter().take(k).map(|(_, n)| n).collect()
}

/// Whether `me` is one of `engine`'s owners.
pub fn owns(engine: u64, me: NodeId, live: &[NodeId], r: usize) -> bool {
    if r == 0 {
        return true;
    }
    let mine = score(engine, me);
    // `me` owns it when fewer than `r` other live routers score above it.
    live.iter()
        .filter(|&&n| n != me && (score(engine, n), n) > (mine, me))
        .take(r)
        .count()
        < r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<NodeId> {
        (0..n)
            .map(|i| NodeId::from_name(&format!("r{i}")))
            .collect()
    }

    #[test]
    fn every_engine_gets_r_owners_the_same_whatever_the_member_order() {
        let live = nodes(5);
        let mut rev = live.clone();
        rev.reverse();
        for e in 0..1_000u64 {
            let o = owners(e, &live, 2);
            assert_eq!(o.len(), 2);
            assert_eq!(o, owners(e, &rev, 2));
            for n in &live {
                assert_eq!(owns(e, *n, &live, 2), o.contains(n), "engine {e}");
            }
        }
        assert_eq!(owners(1, &live, 0).len(), 5);
        assert!(owns(1, live[0], &live, 0));
        assert_eq!(owners(1, &live[..1], 2).len(), 1);
    }

    #[test]
    fn a_joining_router_moves_only_about_r_over_n_of_the_ownerships() {
        let live = nodes(8);
        let mut grown = live.clone();
        grown.push(NodeId::from_name("newcomer"));
        let engines = 4_096u64;
        let (mut moved, mut load) = (0usize, vec![0usize; grown.len()]);
        for e in 0..engines {
            let before = owners(e, &live, 2);
            let after = owners(e, &grown, 2);
            moved += after.iter().filter(|n| !before.contains(n)).count();
            for n in &after {
                load[grown.iter().position(|g| g == n).expect("member")] += 1;
            }
        }
        // Expected: the newcomer becomes an owner of 2/9 of the engines (≈ 910 of the 8,192
        // owner slots, 1/9); nothing else moves.
        let share = moved as f64 / (2.0 * engines as f64);
        assert!((0.08..0.15).contains(&share), "moved {moved} ({share:.3})");
        assert_eq!(moved, load[8], "only the newcomer's slots are new");
        // Spread: every router owns about 2/9 of the engines.
        for (i, l) in load.iter().enumerate() {
            let f = *l as f64 / engines as f64;
            assert!((0.17..0.28).contains(&f), "router {i} owns {f:.3}");
        }
    }
}
