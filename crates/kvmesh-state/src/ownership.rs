//! Ingest ownership: which routers read an engine's KV-event stream.
//!
//! Each engine is owned by `r` live routers chosen by rendezvous hashing (highest random
//! weight over stable ids) **with bounded loads**: the engines, taken in the order of their
//! ids, pick their owners rank by rank (first owners, then second owners, ...), each the best
//! scored router that holds less than 1.5 times its fair share of that rank and 1.25 times its
//! fair share of all ranks (rounded down, and never below the share rounded up). So every
//! router computes the same owners from the same membership and engines; with many engines
//! per router the bounds
//! seldom bind and ownership is nearly plain rendezvous hashing (a router leaving moves little
//! more than the engines it held: 66 ownerships a router at 128 routers × 4,096 engines,
//! against 64 for rendezvous alone); with few, no router owns far more than its share (4
//! engines over 3 routers: 2 or 3 each, where rendezvous alone can give one router all four;
//! 24 over 8: at most 7 and 4 of them first, where rendezvous gave 8 and 8). `r = 0` means
//! every router reads every engine.

use crate::ids::NodeId;
use std::collections::HashMap;

/// The rendezvous score of `node` for `engine` (higher wins).
pub fn score(engine: u64, node: NodeId) -> u64 {
    let mut x = engine ^ node.0.rotate_left(29) ^ 0x6B6D_6573_685F_6F77;
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// `live` routers ranked by their rendezvous score for `engine`, best first, the first `r`
/// (all of them when `r == 0` or `r >= live.len()`); duplicates count once. Without the bounds
/// of [`Ownership`]: whom a new owner asks for a handover (the routers that read an engine
/// before it came rank high here).
pub fn owners(engine: u64, live: &[NodeId], r: usize) -> Vec<NodeId> {
    let mut all: Vec<(u64, NodeId)> = live.iter().map(|&n| (score(engine, n), n)).collect();
    all.sort_unstable_by(|a, b| b.cmp(a));
    all.dedup_by_key(|x| x.1);
    let k = if r == 0 { all.len() } else { r.min(all.len()) };
    all.into_iter().take(k).map(|(_, n)| n).collect()
}

/// The owners of every engine for one membership: see the module's documentation.
#[derive(Debug, Clone)]
pub struct Ownership {
    /// The live routers it was computed for, sorted, without duplicates.
    members: Vec<NodeId>,
    /// Per engine, its owners (first owner first).
    owners: HashMap<u64, Vec<NodeId>>,
}

impl Ownership {
    /// The owners of `engines` among `live` routers, `r` each (every router when `r == 0`).
    /// Costs about `3 · r · engines · routers` scores (4,096 engines over 128 routers: about
    /// 3 million).
    pub fn new(engines: &[u64], live: &[NodeId], r: usize) -> Ownership {
        let (engines, members) = (sorted(engines), sorted(live));
        let m = members.len();
        let k = if r == 0 { m } else { r.min(m) };
        // Fair shares times 1.5 (per rank) or 1.25 (over all ranks), rounded down, and at
        // least the share rounded up: the tighter per-rank bound moved about a quarter more
        // engines when a router left (every rank's placements cascade), for first owners
        // little more even. (Rounding the share up before adding its quarter let 3 routers
        // own 8 engines twice over as 4, 5 and 7, where 7 is over 1.25 × 16 / 3.)
        let cap = |total: usize, part: usize| {
            let m = m.max(1);
            total.div_ceil(m).max(total * (part + 1) / (part * m))
        };
        let mut a = Assign {
            engines: &engines,
            members: &members,
            picks: vec![Vec::with_capacity(k); engines.len()],
            rank_load: vec![0; m],
            all_load: vec![0; m],
            rank_cap: cap(engines.len(), 2),
            all_cap: cap(engines.len() * k, 4),
        };
        for rank in 0..k {
            a.rank_load.iter_mut().for_each(|l| *l = 0);
            for i in 0..engines.len() {
                a.place(i, rank);
            }
        }
        let owners = engines
            .iter()
            .zip(&a.picks)
            .map(|(&e, p)| (e, p.iter().map(|&j| members[j]).collect()))
            .collect();
        Ownership { owners, members }
    }

    /// The owners of `engine`, first owner first (none for an engine it was not computed for).
    pub fn owners(&self, engine: u64) -> &[NodeId] {
        self.owners.get(&engine).map_or(&[], Vec::as_slice)
    }

    /// The live routers it was computed for, sorted.
    pub fn members(&self) -> &[NodeId] {
        &self.members
    }
}

/// The owners being chosen: per engine the routers picked so far (indexes into `members`,
/// rank by rank), the loads of the rank being placed and of all ranks, and their bounds.
struct Assign<'a> {
    engines: &'a [u64],
    members: &'a [NodeId],
    picks: Vec<Vec<usize>>,
    rank_load: Vec<usize>,
    all_load: Vec<usize>,
    rank_cap: usize,
    all_cap: usize,
}

impl Assign<'_> {
    /// Engine `i`'s owner of `rank`: the best scored router with room (under both bounds)
    /// that does not own it yet; when every router with room owns it already, an engine
    /// placed before it at this rank moves to a router with room and frees its own; failing
    /// that, the best with room in all ranks, then the best.
    fn place(&mut self, i: usize, rank: usize) {
        let j = match self.best(i, |a, j| a.has_room(j)) {
            Some(j) => j,
            None => match self.swap(i, rank) {
                Some((earlier, to, freed)) => {
                    self.picks[earlier][rank] = to;
                    self.count(to, 1);
                    self.count(freed, -1);
                    freed
                }
                None => self
                    .best(i, |a, j| a.all_load[j] < a.all_cap)
                    .or_else(|| self.best(i, |_, _| true))
                    .expect("an engine has fewer owners than there are routers"),
            },
        };
        self.count(j, 1);
        self.picks[i].push(j);
    }

    fn has_room(&self, j: usize) -> bool {
        self.rank_load[j] < self.rank_cap && self.all_load[j] < self.all_cap
    }

    fn count(&mut self, j: usize, by: isize) {
        self.rank_load[j] = self.rank_load[j].saturating_add_signed(by);
        self.all_load[j] = self.all_load[j].saturating_add_signed(by);
    }

    /// The best scored router that `ok` takes and that does not own engine `i` yet.
    fn best(&self, i: usize, ok: impl Fn(&Self, usize) -> bool) -> Option<usize> {
        (0..self.members.len())
            .filter(|&j| !self.picks[i].contains(&j) && ok(self, j))
            .max_by_key(|&j| (score(self.engines[i], self.members[j]), self.members[j]))
    }

    /// For engine `i`, stuck at `rank`: the first engine placed before it at this rank (in
    /// engine order, the same on every router) whose router `i` does not own yet and that can
    /// move to a router with room; with that router and the one it frees.
    fn swap(&self, i: usize, rank: usize) -> Option<(usize, usize, usize)> {
        (0..i).find_map(|earlier| {
            let freed = self.picks[earlier][rank];
            if self.picks[i].contains(&freed) {
                return None;
            }
            self.best(earlier, |a, j| a.has_room(j))
                .map(|to| (earlier, to, freed))
        })
    }
}

/// `v` sorted, without duplicates.
pub fn sorted<T: Ord + Copy>(v: &[T]) -> Vec<T> {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.dedup();
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<NodeId> {
        (0..n)
            .map(|i| NodeId::from_name(&format!("r{i}")))
            .collect()
    }

    /// Engine ids as the router makes them (hashes of their URLs: spread over the u64s).
    fn engines(n: u64) -> Vec<u64> {
        (0..n).map(|i| score(i, NodeId(7))).collect()
    }

    /// Per router (in `live`'s order): engines owned, and engines owned first.
    fn loads(o: &Ownership, es: &[u64], live: &[NodeId]) -> (Vec<usize>, Vec<usize>) {
        let (mut all, mut first) = (vec![0; live.len()], vec![0; live.len()]);
        for &e in es {
            for (rank, n) in o.owners(e).iter().enumerate() {
                let j = live.iter().position(|l| l == n).expect("a member");
                all[j] += 1;
                if rank == 0 {
                    first[j] += 1;
                }
            }
        }
        (all, first)
    }

    #[test]
    fn every_engine_gets_r_owners_the_same_whatever_the_member_order() {
        let live = nodes(5);
        let es = engines(1_000);
        let mut rev = live.clone();
        rev.reverse();
        rev.push(live[2]);
        let (o, p) = (Ownership::new(&es, &live, 2), Ownership::new(&es, &rev, 2));
        for &e in &es {
            let owners = o.owners(e);
            assert_eq!(owners.len(), 2);
            assert_ne!(owners[0], owners[1]);
            assert_eq!(owners, p.owners(e));
        }
        assert_eq!(o.members(), sorted(&rev), "sorted, duplicates once");
        assert_eq!(Ownership::new(&es, &live, 0).owners(es[0]).len(), 5);
        assert_eq!(Ownership::new(&es, &live[..1], 2).owners(es[0]).len(), 1);
        assert!(o.owners(12345).is_empty(), "not one of its engines");
    }

    #[test]
    fn a_joining_router_moves_only_about_r_over_n_of_the_ownerships() {
        let live = nodes(8);
        let mut grown = live.clone();
        grown.push(NodeId::from_name("newcomer"));
        let es = engines(4_096);
        let (before, after) = (
            Ownership::new(&es, &live, 2),
            Ownership::new(&es, &grown, 2),
        );
        let mut moved = 0;
        for &e in &es {
            let b = before.owners(e);
            moved += after.owners(e).iter().filter(|n| !b.contains(n)).count();
            // With 1,024 engines a router, the bounds (1,280) never bind: plain rendezvous.
            assert_eq!(after.owners(e), owners(e, &grown, 2), "engine {e}");
        }
        // Expected: the newcomer becomes an owner of 2/9 of the engines (≈ 910 of the 8,192
        // owner slots, 1/9); nothing else moves.
        let share = moved as f64 / (2.0 * es.len() as f64);
        assert!((0.08..0.15).contains(&share), "moved {moved} ({share:.3})");
        let (load, _) = loads(&after, &es, &grown);
        assert_eq!(moved, load[8], "only the newcomer's slots are new");
        for (i, l) in load.iter().enumerate() {
            let f = *l as f64 / es.len() as f64;
            assert!((0.17..0.28).contains(&f), "router {i} owns {f:.3}");
        }
    }

    #[test]
    fn few_engines_are_shared_out_evenly() {
        // The local cluster's shape: rendezvous alone can give one of 3 routers all 4 engines.
        let (live, es) = (nodes(3), engines(4));
        let (all, first) = loads(&Ownership::new(&es, &live, 2), &es, &live);
        assert!(all.iter().all(|&l| (2..=3).contains(&l)), "{all:?}");
        assert!(first.iter().all(|&l| (1..=2).contains(&l)), "{first:?}");
        // Every shape up to 40 engines over 9 routers: nobody above 1.25 times its share, nor
        // 1.5 times its share of first owners (rounded down, at least the share rounded up),
        // every engine with its r distinct owners.
        for m in 1..=9 {
            let live = nodes(m);
            for n in 1..=40u64 {
                let es = engines(n);
                for r in 0..=3 {
                    let o = Ownership::new(&es, &live, r);
                    let k = if r == 0 { m } else { r.min(m) };
                    for &e in &es {
                        let mut d = o.owners(e).to_vec();
                        d.sort_unstable();
                        d.dedup();
                        assert_eq!(d.len(), k, "{n} engines, {m} routers, r {r}");
                    }
                    let (all, first) = loads(&o, &es, &live);
                    let bound =
                        |t: usize, part: usize| t.div_ceil(m).max(t * (part + 1) / (part * m));
                    let (n, worst) = (n as usize, *all.iter().max().expect("routers"));
                    assert!(worst <= bound(n * k, 4), "{n}, {m}, r {r}: {all:?}");
                    let worst_first = *first.iter().max().expect("routers");
                    assert!(
                        worst_first <= bound(n, 2),
                        "{n}, {m}, r {r}: first {first:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn three_routers_share_eight_engines_twice_over_as_evenly_as_can_be() {
        // The bench's fleet: 16 ownerships over 3 routers are 5, 5 and 6 whatever the ids
        // (rounding the share up before adding its quarter allowed 7: about half of these
        // id sets gave one router 7 of the 8 engines).
        for set in 0..200u64 {
            let live: Vec<NodeId> = (0..3)
                .map(|i| NodeId(score(set * 10 + i, NodeId(9))))
                .collect();
            let es: Vec<u64> = (0..8).map(|i| score(set * 100 + i, NodeId(7))).collect();
            let (all, _) = loads(&Ownership::new(&es, &live, 2), &es, &live);
            assert!(all.iter().all(|&l| l <= 6), "id set {set}: {all:?}");
        }
    }

    #[test]
    fn a_router_leaving_moves_little_more_than_what_it_held() {
        // (routers, engines, moved at most per ownership held, in hundredths)
        for (m, n, most) in [(32, 1_024, 115), (8, 24, 200)] {
            let live = nodes(m);
            let es = engines(n);
            let before = Ownership::new(&es, &live, 2);
            for gone in 0..m {
                let fewer: Vec<NodeId> =
                    live.iter().copied().filter(|&x| x != live[gone]).collect();
                let after = Ownership::new(&es, &fewer, 2);
                let (mut held, mut moved) = (0, 0);
                for &e in &es {
                    held += usize::from(before.owners(e).contains(&live[gone]));
                    moved += after
                        .owners(e)
                        .iter()
                        .filter(|x| !before.owners(e).contains(x))
                        .count();
                }
                // Each ownership it held moves (the least possible); a few more follow where
                // a bound binds (measured, a router leaving: 66 against 63 for rendezvous
                // alone at 32 × 1,024, 8.0 against 6.0 at 8 × 24; with the per-rank bound a
                // quarter instead of a half, 69 and 12.9).
                assert!(
                    moved >= held,
                    "{m} × {n}, router {gone}: {moved} moved, {held} held"
                );
                assert!(
                    moved * 100 <= held * most,
                    "{m} × {n}, router {gone}: {moved} moved, {held} held"
                );
            }
        }
    }
}
