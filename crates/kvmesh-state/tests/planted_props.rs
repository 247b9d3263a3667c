//! Plants of config records against a model: 3 routers (restarting now and then) plant their
//! config's records, update and remove engines at run time, and hear each other partially;
//! every delta and plant they produced is merged in random orders with duplicates. Whatever
//! the order: the same digest and exactly the model's engines, where an add is gone when a
//! delta saw its dot without holding it (a remove), or when it planted a config record that
//! an earlier plant (by time, then dot) had planted already. Whole states, plants included,
//! join commutatively, associatively and idempotently.

mod common;

use common::{node, record};
use kvmesh_state::{Dot, EngineRecord, Planted, RegistryDelta, RegistrySet, Span, Stamp};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone)]
enum D {
    Reg(RegistryDelta),
    Plant(Vec<Planted>),
}

fn apply(s: &mut RegistrySet, d: &D) -> bool {
    match d {
        D::Reg(r) => s.merge(r),
        D::Plant(p) => s.merge_planted(p, &mut BTreeSet::new()),
    }
}

fn whole(s: &RegistrySet) -> Vec<D> {
    let mut v: Vec<D> = s.deltas().into_iter().map(D::Reg).collect();
    v.extend(s.planted().into_iter().map(D::Plant));
    v
}

/// A router's note that its config seeded `rec` (none when noted before).
fn note(r: &mut RegistrySet, now: u64, engine: u64, rec: &EngineRecord) -> Vec<D> {
    r.note_seeded(now, engine, rec)
        .into_iter()
        .map(D::Reg)
        .collect()
}

/// Actions: (router, kind, engine, x). Kinds: plant a config record (weight 0 or 1), update
/// at run time, remove, restart, send the whole state to another router.
fn produce(actions: &[(u8, u8, u8, u32)]) -> (Vec<D>, Vec<RegistrySet>) {
    let mut routers: Vec<RegistrySet> = (0..3).map(|_| RegistrySet::new()).collect();
    let mut out = Vec::new();
    for (i, &(r, kind, e, x)) in actions.iter().enumerate() {
        let r = (r % 3) as usize;
        let engine = u64::from(e % 4);
        let now = 1_000 + 10 * i as u64;
        let made = match kind % 7 {
            // A config record planted as the mesh does: noted (unless noted before, which
            // the mesh would not plant: here it plants anyway, as a router that does not
            // hold the cluster's registry would), then added and told.
            0 | 1 => {
                let rec = record(engine, x % 2);
                let mut v = note(&mut routers[r], now, engine, &rec);
                let (d, p) = routers[r].plant(node(r), now, engine, rec);
                v.extend([D::Reg(d), D::Plant(vec![p])]);
                v
            }
            // As a build before plants were told: noted and added, no plant.
            6 => {
                let rec = record(engine, x % 2);
                let mut v = note(&mut routers[r], now, engine, &rec);
                v.push(D::Reg(routers[r].add(node(r), now, engine, rec)));
                v
            }
            2 => vec![D::Reg(routers[r].add(
                node(r),
                now,
                engine,
                record(engine, 2 + x % 4000),
            ))],
            3 => routers[r].remove(engine).into_iter().map(D::Reg).collect(),
            4 => {
                routers[r] = RegistrySet::new();
                Vec::new()
            }
            5 => {
                let to = (r + 1 + (x as usize % 2)) % 3;
                let all = whole(&routers[r]);
                for d in &all {
                    apply(&mut routers[to], d);
                }
                all
            }
            _ => unreachable!(),
        };
        for d in &made {
            for (o, other) in routers.iter_mut().enumerate() {
                if o != r && x % 3 == 0 {
                    apply(other, d);
                }
            }
        }
        out.extend(made);
    }
    (out, routers)
}

/// The model, with tombstones and every plant kept forever.
fn model(ds: &[D]) -> BTreeMap<u64, EngineRecord> {
    let regs: Vec<&RegistryDelta> = ds
        .iter()
        .filter_map(|d| match d {
            D::Reg(r) => Some(r),
            D::Plant(_) => None,
        })
        .collect();
    let mut first: BTreeMap<(u64, u64), (u64, Dot)> = BTreeMap::new();
    let mut noted: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    for n in regs.iter().flat_map(|d| &d.seeded) {
        let t = noted.entry((n.engine, n.record)).or_insert(n.at_us);
        *t = (*t).min(n.at_us);
    }
    let mut plants = BTreeSet::new();
    let mut late = BTreeSet::new();
    for p in ds.iter().filter_map(|d| match d {
        D::Plant(p) => Some(p),
        D::Reg(_) => None,
    }) {
        for p in p {
            plants.insert(p.dot);
            if noted
                .get(&(p.engine, p.record))
                .is_some_and(|&t| t < p.at_us)
            {
                late.insert(p.dot);
            }
            let f = first
                .entry((p.engine, p.record))
                .or_insert((p.at_us, p.dot));
            *f = (*f).min((p.at_us, p.dot));
        }
    }
    let firsts: BTreeSet<Dot> = first.values().map(|&(_, d)| d).collect();
    let covers =
        |s: &Span, d: &Dot| s.node == d.node && s.lo.max(1) <= d.counter && d.counter <= s.hi;
    let mut best: BTreeMap<u64, (Stamp, EngineRecord)> = BTreeMap::new();
    for a in regs.iter().flat_map(|d| &d.adds) {
        let removed = regs.iter().any(|f| {
            f.seen.iter().any(|s| covers(s, &a.dot)) && !f.adds.iter().any(|b| b.dot == a.dot)
        });
        let void = plants.contains(&a.dot) && (!firsts.contains(&a.dot) || late.contains(&a.dot));
        if removed || void {
            continue;
        }
        let cand = (a.stamp, a.record.clone());
        if best.get(&a.engine).is_none_or(|b| *b < cand) {
            best.insert(a.engine, cand);
        }
    }
    best.into_iter().map(|(e, (_, r))| (e, r)).collect()
}

fn contents(s: &RegistrySet) -> BTreeMap<u64, EngineRecord> {
    s.engines().map(|(e, r)| (e, r.clone())).collect()
}

fn deliver(base: &RegistrySet, ds: &[D], order: &[usize]) -> RegistrySet {
    let mut s = base.clone();
    let n = ds.len();
    let mut idx: Vec<usize> = (0..n).collect();
    for (k, w) in order.iter().enumerate().take(n.saturating_sub(1)) {
        idx.swap(k, k + w % (n - k));
    }
    for (k, w) in order.iter().enumerate().skip(n) {
        if n > 0 {
            idx.insert(k % (idx.len() + 1), w % n);
        }
    }
    for i in idx {
        apply(&mut s, &ds[i]);
    }
    s
}

fn join(a: &RegistrySet, b: &RegistrySet) -> RegistrySet {
    let mut x = a.clone();
    for d in whole(b) {
        apply(&mut x, &d);
    }
    x
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn plants_in_any_order_end_as_the_model(
        actions in prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), any::<u32>()), 1..100),
        order_a in prop::collection::vec(any::<usize>(), 0..300),
        order_b in prop::collection::vec(any::<usize>(), 0..300),
    ) {
        let (ds, finals) = produce(&actions);
        let a = deliver(&RegistrySet::new(), &ds, &order_a);
        let b = deliver(&RegistrySet::new(), &ds, &order_b);
        prop_assert_eq!(a.digest(), b.digest());
        prop_assert_eq!(contents(&a), model(&ds));
        prop_assert_eq!(contents(&b), contents(&a));
        // One first plant kept per config record planted (the bound: the records, not the
        // plants).
        let records: BTreeSet<(u64, u64)> = ds
            .iter()
            .filter_map(|d| match d {
                D::Plant(p) => Some(p),
                D::Reg(_) => None,
            })
            .flatten()
            .map(|p| (p.engine, p.record))
            .collect();
        prop_assert_eq!(a.planted_len(), records.len());
        // Whole states join as a join should, plants included.
        let [x, y, z] = [&finals[0], &finals[1], &finals[2]];
        prop_assert_eq!(join(x, y).digest(), join(y, x).digest());
        prop_assert_eq!(contents(&join(x, y)), contents(&join(y, x)));
        prop_assert_eq!(join(&join(x, y), z).digest(), join(x, &join(y, z)).digest());
        prop_assert_eq!(join(x, x).digest(), x.digest());
        // Everything joined with every delta: the model.
        let all = deliver(&join(&join(x, y), z), &ds, &[]);
        prop_assert_eq!(contents(&all), model(&ds));
        prop_assert_eq!(all.digest(), a.digest());
    }
}

/// The case found by QA, as the registry sees it: a config's engine planted at the start,
/// removed at run time through router 1; routers 0 and 1 restart, meet each other first and
/// plant it again. Once they hear router 2, their plant is void: the engine stays removed.
#[test]
fn a_later_plant_of_the_same_config_record_does_not_bring_back_a_removed_engine() {
    let (a, b) = (node(0), node(1));
    let mut r2 = RegistrySet::new();
    let mut r0 = RegistrySet::new();
    let (d, p) = r0.plant(a, 100, 7, record(7, 1));
    r2.merge(&d);
    r2.merge_planted(&[p], &mut BTreeSet::new());
    r2.remove(7).expect("present");
    assert!(!r2.contains(7));
    // Restarted: empty, they plant again, later.
    let mut r0 = RegistrySet::new();
    let (d2, p2) = r0.plant(a, 5_000, 7, record(7, 1));
    let mut r1 = RegistrySet::new();
    r1.merge(&d2);
    r1.merge_planted(&[p2], &mut BTreeSet::new());
    assert!(r0.contains(7) && r1.contains(7), "until they meet router 2");
    for r in [&mut r0, &mut r1] {
        for d in whole(&r2) {
            apply(r, &d);
        }
    }
    for d in whole(&r0) {
        apply(&mut r2, &d);
    }
    let mut touched = BTreeSet::new();
    assert!(!r2.merge_planted(&[p2], &mut touched), "known");
    for r in [&r0, &r1, &r2] {
        assert!(!r.contains(7), "the removal holds");
        assert_eq!(r.digest(), r2.digest());
    }
    // A run-time add of the same record is not a plant: it holds.
    let up = r1.add(b, 6_000, 7, record(7, 1));
    r2.merge(&up);
    assert!(r2.contains(7));
}
