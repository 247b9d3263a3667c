//! The engine registry against a model with tombstones kept forever: 3 routers (restarting
//! now and then) add, update and remove engines and hear each other partially; every delta
//! they produced, and whole states taken at random moments (in fragments), are merged in
//! random orders with duplicates. Whatever the order: the same digest, exactly the engines and
//! records of the model, commutative / associative / idempotent joins of whole states, and a
//! context of one interval per router run instead of one tombstone per removed add. Some adds
//! come with a note that a config seeded them: every note reaches every order, and outlives
//! its engine's removal.

mod common;

use common::{node, record};
use kvmesh_state::{EngineRecord, RegistryDelta, RegistrySet, Span};
use proptest::prelude::*;
use std::collections::BTreeMap;

/// What 3 routers produced: every delta (their local changes and whole-state fragments), the
/// router runs, and the routers' final states.
struct Run {
    deltas: Vec<RegistryDelta>,
    /// The local changes, each with its router's registry just before it.
    local: Vec<(RegistrySet, RegistryDelta)>,
    runs: usize,
    finals: Vec<RegistrySet>,
}

/// Actions: (router, kind, engine, x). Kinds: add/update, remove, restart, a whole state sent
/// to another router (its fragments are deltas too), hear everything.
fn produce(actions: &[(u8, u8, u8, u32)]) -> Run {
    let mut routers: Vec<RegistrySet> = (0..3).map(|_| RegistrySet::new()).collect();
    let mut deltas = Vec::new();
    let mut local = Vec::new();
    let mut runs = 3;
    for (i, &(r, kind, e, x)) in actions.iter().enumerate() {
        let r = (r % 3) as usize;
        let engine = u64::from(e % 5);
        // Cluster time: 10 µs per action, so a restart's clock is past the previous run's.
        let now = 1_000 + 10 * i as u64;
        let before = routers[r].clone();
        let made = match kind % 8 {
            0..=2 => {
                let rec = record(engine, x % 4000);
                let mut made = vec![routers[r].add(node(r), now, engine, rec.clone())];
                // A config's engine (now and then the same record again: noted once).
                if x % 5 < 2 {
                    made.extend(routers[r].note_seeded(now, engine, &record(engine, x % 2)));
                }
                made
            }
            3..=4 => routers[r].remove(engine).into_iter().collect(),
            5 => {
                // Restart: same id, empty registry (learns from peers only afterwards).
                routers[r] = RegistrySet::new();
                runs += 1;
                Vec::new()
            }
            6 => {
                let to = (r + 1 + (x as usize % 2)) % 3;
                let frags = routers[r].deltas();
                for f in &frags {
                    routers[to].merge(f);
                }
                frags
            }
            _ => {
                let all = deltas.clone();
                for d in &all {
                    routers[r].merge(d);
                }
                Vec::new()
            }
        };
        if kind % 8 <= 4 {
            local.extend(made.iter().map(|d| (before.clone(), d.clone())));
        }
        // Routers hear each other's changes now and then (so removes see others' adds).
        for d in &made {
            for (o, other) in routers.iter_mut().enumerate() {
                if o == r || x % 3 == 0 {
                    other.merge(d);
                }
            }
        }
        deltas.extend(made);
    }
    Run {
        deltas,
        local,
        runs,
        finals: routers,
    }
}

/// The model: an add is present iff no delta saw its dot without holding it (tombstones are
/// never collected); an engine's record is its present add's with the newest stamp.
fn model(deltas: &[RegistryDelta]) -> BTreeMap<u64, EngineRecord> {
    let covers = |s: &Span, d: &kvmesh_state::Dot| {
        s.node == d.node && s.lo.max(1) <= d.counter && d.counter <= s.hi
    };
    let mut best: BTreeMap<u64, (kvmesh_state::Stamp, EngineRecord)> = BTreeMap::new();
    for a in deltas.iter().flat_map(|d| &d.adds) {
        let killed = deltas.iter().any(|f| {
            f.seen.iter().any(|s| covers(s, &a.dot)) && !f.adds.iter().any(|b| b.dot == a.dot)
        });
        if killed {
            continue;
        }
        let cand = (a.stamp, a.record.clone());
        match best.get(&a.engine) {
            Some(b) if *b >= cand => {}
            _ => {
                best.insert(a.engine, cand);
            }
        }
    }
    best.into_iter().map(|(e, (_, r))| (e, r)).collect()
}

/// Every (engine, record) a delta noted as seeded: all of them, whatever was removed.
fn noted(deltas: &[RegistryDelta]) -> std::collections::BTreeSet<(u64, u32)> {
    deltas
        .iter()
        .flat_map(|d| &d.seeded)
        .map(|n| {
            let w = (0..2)
                .find(|&w| record(n.engine, w).digest() == n.record)
                .expect("a record of the test");
            (n.engine, w)
        })
        .collect()
}

/// The test's possible config records that `s` has notes of.
fn notes_of(s: &RegistrySet) -> std::collections::BTreeSet<(u64, u32)> {
    (0..5u64)
        .flat_map(|e| (0..2).map(move |w| (e, w)))
        .filter(|&(e, w)| s.was_seeded(e, &record(e, w)))
        .collect()
}

fn contents(s: &RegistrySet) -> BTreeMap<u64, EngineRecord> {
    s.engines().map(|(e, r)| (e, r.clone())).collect()
}

/// Every delta at least once, in an order drawn from `order`, with duplicates.
fn deliver(deltas: &[RegistryDelta], order: &[usize]) -> RegistrySet {
    deliver_onto(&RegistrySet::new(), deltas, order)
}

fn join(a: &RegistrySet, b: &RegistrySet) -> RegistrySet {
    let mut x = a.clone();
    for d in b.deltas() {
        x.merge(&d);
    }
    x
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn any_order_of_any_deltas_ends_as_the_tombstone_model(
        actions in prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), any::<u32>()), 1..120),
        order_a in prop::collection::vec(any::<usize>(), 0..400),
        order_b in prop::collection::vec(any::<usize>(), 0..400),
    ) {
        let run = produce(&actions);
        prop_assume!(!run.deltas.is_empty());
        let a = deliver(&run.deltas, &order_a);
        let b = deliver(&run.deltas, &order_b);
        prop_assert_eq!(a.digest(), b.digest());
        prop_assert_eq!(contents(&a), model(&run.deltas));
        prop_assert_eq!(contents(&b), contents(&a));
        prop_assert_eq!(notes_of(&a), noted(&run.deltas));
        prop_assert_eq!(a.seeded_len(), noted(&run.deltas).len());
        // No local change removes an add its router had not seen (a restarted router's
        // first add leaves its previous run's adds alone).
        for (before, d) in &run.local {
            for x in run.deltas.iter().flat_map(|d| &d.adds).map(|a| a.dot) {
                let claimed = d.seen.iter().any(|s| s.node == x.node && s.lo <= x.counter && x.counter <= s.hi);
                if claimed && !d.adds.iter().any(|a| a.dot == x) {
                    prop_assert!(before.has_seen(x), "{:?} removed unseen {:?}", d, x);
                }
            }
        }
        // The bound: no removed add is kept, and the context is one interval per router run
        // once every delta is in.
        prop_assert_eq!(a.adds(), a.deltas().iter().map(|d| d.adds.len()).sum::<usize>());
        prop_assert!(a.adds() <= 5 * run.runs);
        prop_assert!(a.context_len() <= run.runs, "{} intervals, {} runs", a.context_len(), run.runs);
        // Its own whole state changes nothing (idempotent), and rebuilds it exactly.
        let mut again = a.clone();
        for d in a.deltas() {
            prop_assert!(!again.merge(&d));
        }
        prop_assert_eq!(join(&RegistrySet::new(), &a).digest(), a.digest());
    }

    #[test]
    fn joins_of_whole_states_are_commutative_associative_and_idempotent(
        actions in prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), any::<u32>()), 1..120),
    ) {
        let run = produce(&actions);
        let [x, y, z] = [&run.finals[0], &run.finals[1], &run.finals[2]];
        prop_assert_eq!(join(x, y).digest(), join(y, x).digest());
        prop_assert_eq!(join(&join(x, y), z).digest(), join(x, &join(y, z)).digest());
        prop_assert_eq!(join(x, x).digest(), x.digest());
        // Joined, and given every delta (some died with a restarted router), the three hold
        // what the model says of everything they produced.
        let mut all = join(&join(x, y), z);
        for d in &run.deltas {
            all.merge(d);
        }
        prop_assert_eq!(contents(&all), model(&run.deltas));
        prop_assert_eq!(notes_of(&all), noted(&run.deltas));
    }

    #[test]
    fn a_whole_state_merges_the_same_split_reordered_and_interleaved(
        actions in prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), any::<u32>()), 1..120),
        order in prop::collection::vec(any::<usize>(), 0..400),
    ) {
        let run = produce(&actions);
        // Router 1 takes router 0's whole state, fragments shuffled among router 2's.
        let mut mixed = run.finals[0].deltas();
        let n0 = mixed.len();
        mixed.extend(run.finals[2].deltas());
        let got = deliver_onto(&run.finals[1], &mixed, &order);
        let want = join(&join(&run.finals[1], &run.finals[0]), &run.finals[2]);
        prop_assert_eq!(got.digest(), want.digest());
        // A joining router (empty) rebuilds router 0 from its fragments in any order.
        prop_assert_eq!(deliver(&mixed[..n0], &order).digest(), run.finals[0].digest());
        // And router 0's fragments alone, in any order, give the join with router 0 only.
        let got0 = deliver_onto(&run.finals[1], &mixed[..n0], &order);
        prop_assert_eq!(got0.digest(), join(&run.finals[1], &run.finals[0]).digest());
    }
}

fn deliver_onto(base: &RegistrySet, deltas: &[RegistryDelta], order: &[usize]) -> RegistrySet {
    if deltas.is_empty() {
        return base.clone();
    }
    let mut s = base.clone();
    for d in deliver_list(deltas, order) {
        s.merge(d);
    }
    s
}

fn deliver_list<'a>(deltas: &'a [RegistryDelta], order: &[usize]) -> Vec<&'a RegistryDelta> {
    let n = deltas.len();
    let mut idx: Vec<usize> = (0..n).collect();
    for (k, w) in order.iter().enumerate().take(n.saturating_sub(1)) {
        let j = k + w % (n - k);
        idx.swap(k, j);
    }
    for (k, w) in order.iter().enumerate().skip(n) {
        idx.insert(k % (idx.len() + 1), w % n);
    }
    idx.into_iter().map(|i| &deltas[i]).collect()
}
