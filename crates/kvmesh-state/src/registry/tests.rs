//! The registry's unit tests: add wins, LWW records, a restarted router's counter, the
//! context's bound, whole-state fragments.

use super::*;

fn rec(url: &str, w: u32) -> EngineRecord {
    EngineRecord {
        url: url.into(),
        weight_milli: w,
        kv_events: String::new(),
        kv_replay: String::new(),
        models: vec![],
    }
}

fn merge_all(into: &mut RegistrySet, from: &RegistrySet) {
    for d in from.deltas() {
        into.merge(&d);
    }
}

#[test]
fn an_add_concurrent_with_a_remove_wins_and_attributes_are_lww() {
    let a = NodeId::from_name("a");
    let mut ra = RegistrySet::new();
    let mut rb = RegistrySet::new();
    let add1 = ra.add(a, 10, 7, rec("http://e:1", 1000));
    rb.merge(&add1);
    // b removes what it saw while a concurrently updates the weight (a new add).
    let rm = rb.remove(7).expect("present");
    let add2 = ra.add(a, 20, 7, rec("http://e:1", 2000));
    rb.merge(&add2);
    ra.merge(&rm);
    assert!(ra.contains(7) && rb.contains(7), "add wins");
    assert_eq!(ra.get(7).map(|r| r.weight_milli), Some(2000));
    assert_eq!(rb.get(7).map(|r| r.weight_milli), Some(2000));
    assert_eq!(ra.digest(), rb.digest());
    // A remove after seeing both adds removes it everywhere, and leaves no record behind.
    let rm2 = rb.remove(7).expect("present");
    ra.merge(&rm2);
    assert!(!ra.contains(7) && !rb.contains(7));
    assert_eq!((ra.adds(), ra.get(7)), (0, None));
    assert_eq!(ra.digest(), rb.digest());
    // Late duplicates of old adds do not resurrect it.
    assert!(!ra.merge(&add1) && !ra.merge(&add2));
    assert!(!ra.contains(7));
    // A new add carries its own record.
    let add3 = rb.add(NodeId::from_name("b"), 30, 7, rec("http://e:1", 3000));
    ra.merge(&add3);
    assert_eq!(ra.get(7).map(|r| r.weight_milli), Some(3000));
    assert_eq!(ra.digest(), rb.digest());
}

#[test]
fn concurrent_updates_keep_the_newest_record_in_any_order_and_an_update_replaces_what_it_saw() {
    let (a, b) = (NodeId::from_name("a"), NodeId::from_name("b"));
    let mut ra = RegistrySet::new();
    let mut rb = RegistrySet::new();
    let first = ra.add(a, 100, 7, rec("http://e:1", 1000));
    rb.merge(&first);
    // Concurrent updates: b's is newer (time 300 against 200).
    let ua = ra.add(a, 200, 7, rec("http://e:1", 2000));
    let ub = rb.add(b, 300, 7, rec("http://e:1", 3000));
    let mut x = RegistrySet::new();
    let mut y = RegistrySet::new();
    for d in [&first, &ua, &ub] {
        x.merge(d);
    }
    for d in [&ub, &ua, &first] {
        y.merge(d);
    }
    assert_eq!(x.get(7).map(|r| r.weight_milli), Some(3000));
    assert_eq!(x.digest(), y.digest());
    assert_eq!(
        x.adds(),
        2,
        "two concurrent adds, the first replaced by both"
    );
    // a, whose clock is behind, updates after seeing both: its write replaces both, and its
    // stamp is above what it saw, so it is also the newest.
    ra.merge(&ub);
    let late = ra.add(a, 250, 7, rec("http://e:1", 4000));
    x.merge(&late);
    assert_eq!(x.get(7).map(|r| r.weight_milli), Some(4000));
    assert_eq!(x.adds(), 1);
    let RegistryAdd { stamp, .. } = &late.adds[0];
    assert_eq!(stamp.at_us, 301);
}

#[test]
fn a_restarted_router_continues_its_counter_above_its_previous_run() {
    let a = NodeId::from_name("a");
    let mut before = RegistrySet::new();
    let mut peer = RegistrySet::new();
    let e1 = before.add(a, 1_000, 1, rec("http://e:1", 1000));
    let e2 = before.add(a, 1_000, 2, rec("http://e:2", 1000));
    peer.merge(&e1);
    peer.merge(&e2);
    // Restarted: same id, empty registry. A counter starting at 1 again would reuse a dot
    // the cluster has seen, and the add would be lost.
    let stale = RegistryDelta {
        adds: vec![RegistryAdd {
            engine: 3,
            dot: e1.adds[0].dot,
            stamp: Stamp {
                at_us: 2_000,
                node: a,
            },
            record: rec("http://e:3", 1000),
        }],
        seen: vec![Span::dot(e1.adds[0].dot)],
        seeded: vec![],
    };
    assert!(!peer.clone().merge(&stale), "a reused dot is ignored");
    let mut after = RegistrySet::new();
    let e3 = after.add(a, 2_000, 3, rec("http://e:3", 1000));
    assert!(e3.adds[0].dot.counter > e2.adds[0].dot.counter);
    assert!(peer.merge(&e3), "the restarted router's add is accepted");
    assert!(peer.contains(1) && peer.contains(2) && peer.contains(3));
    // Its first add claims only its own dot: the previous run's adds stay.
    merge_all(&mut after, &peer);
    assert!(after.contains(1) && after.contains(2) && after.contains(3));
    assert_eq!(after.digest(), peer.digest());
    // A second add claims the counters in between: one interval for this run.
    let e4 = after.add(a, 5_000, 4, rec("http://e:4", 1000));
    peer.merge(&e4);
    assert_eq!(peer.context_len(), 2, "one interval per run");
    // A run whose clock went back, having heard of the previous runs, continues above them.
    let mut back = RegistrySet::new();
    merge_all(&mut back, &peer);
    let e5 = back.add(a, 10, 5, rec("http://e:5", 1000));
    assert!(e5.adds[0].dot.counter > e4.adds[0].dot.counter);
    assert!(peer.merge(&e5) && peer.contains(5) && peer.contains(4));
}

#[test]
fn add_remove_cycles_leave_one_interval_per_router_not_a_tombstone_per_remove() {
    let nodes: Vec<NodeId> = (0..3)
        .map(|i| NodeId::from_name(&format!("r{i}")))
        .collect();
    let mut rs: Vec<RegistrySet> = (0..3).map(|_| RegistrySet::new()).collect();
    let mut now = 1_000;
    for cycle in 0..1_000usize {
        let r = cycle % 3;
        now += 7;
        let add = rs[r].add(nodes[r], now, 9, rec("http://e:9", 1000));
        for o in rs.iter_mut() {
            o.merge(&add);
        }
        let rm = rs[(r + 1) % 3].remove(9).expect("present");
        for o in rs.iter_mut() {
            o.merge(&rm);
        }
    }
    for r in &rs {
        assert!(!r.contains(9));
        assert_eq!(r.adds(), 0);
        assert_eq!(r.context_len(), 3, "one counter interval per router");
        assert_eq!(r.digest(), rs[0].digest());
    }
    // A missing add leaves a gap until it arrives.
    let mut late = rs[0].clone();
    let skipped = rs[0].add(nodes[0], now + 10, 9, rec("http://e:9", 1000));
    let next = rs[0].add(nodes[0], now + 20, 10, rec("http://e:10", 1000));
    late.merge(&next);
    assert_eq!(late.context_len(), 4, "a gap where the missing add is");
    late.merge(&skipped);
    assert_eq!(late.context_len(), 3);
    assert_eq!(late.digest(), rs[0].digest());
}

#[test]
fn a_whole_state_in_fragments_merges_in_any_order_and_removes_what_the_sender_removed() {
    let (a, b) = (NodeId::from_name("a"), NodeId::from_name("b"));
    let mut sender = RegistrySet::new();
    let mut stale = RegistrySet::new();
    // 200 engines from a (several fragments), some removed after stale saw them.
    for e in 0..200 {
        let d = sender.add(a, 1_000 + e, e, rec("http://e", 1000));
        stale.merge(&d);
    }
    for e in (0..200).step_by(3) {
        sender.remove(e).expect("present");
    }
    // b's adds, which stale never saw.
    for e in 300..310 {
        sender.add(b, 5_000 + e, e, rec("http://e", 1000));
    }
    let frags = sender.deltas();
    assert_eq!(frags.len(), sender.adds(), "one fragment per add");
    assert!(frags.iter().all(|f| f.adds.len() == 1 && f.seen.len() <= 2));
    // Forward, backward, and each fragment alone then the rest twice.
    let orders: Vec<Vec<usize>> = vec![
        (0..frags.len()).collect(),
        (0..frags.len()).rev().collect(),
        (0..frags.len())
            .flat_map(|i| [i, frags.len() - 1 - i])
            .collect(),
    ];
    for order in orders {
        let mut r = stale.clone();
        let mut merged = Vec::new();
        for &i in &order {
            r.merge(&frags[i]);
            merged.push(i);
            // No engine the sender holds is ever lost on the way.
            for add in merged.iter().flat_map(|&k| &frags[k].adds) {
                assert!(r.contains(add.engine));
            }
            // Nor one it holds that the receiver had, whatever came first.
            for e in (1..200).filter(|e| e % 3 != 0) {
                assert!(r.contains(e));
            }
        }
        assert_eq!(r.digest(), sender.digest());
        assert!(!r.contains(0) && r.contains(1) && r.contains(305));
    }
}

#[test]
fn hostile_fragments_do_not_panic() {
    let a = NodeId::from_name("a");
    let mut r = RegistrySet::new();
    r.add(a, 5, 1, rec("http://e", 1));
    let weird = RegistryDelta {
        adds: vec![RegistryAdd {
            engine: 2,
            dot: Dot {
                node: a,
                counter: 0,
            },
            stamp: Stamp { at_us: 0, node: a },
            record: rec("x", 0),
        }],
        seen: vec![
            Span {
                node: a,
                lo: 9,
                hi: 3,
            },
            Span {
                node: a,
                lo: 0,
                hi: 0,
            },
            Span {
                node: NodeId(7),
                lo: 0,
                hi: u64::MAX,
            },
        ],
        seeded: vec![],
    };
    r.merge(&weird);
    assert!(r.contains(1) && !r.contains(2));
    // Every counter of a router seen: its later adds saturate and are ignored, never panic.
    r.merge(&RegistryDelta {
        seen: vec![Span {
            node: a,
            lo: 1,
            hi: u64::MAX,
        }],
        ..RegistryDelta::default()
    });
    assert!(!r.contains(1));
    let d = r.add(a, 10, 3, rec("x", 0));
    assert_eq!(d.adds[0].dot.counter, u64::MAX);
}

#[test]
fn the_kept_digest_follows_every_change() {
    let (a, b) = (NodeId::from_name("a"), NodeId::from_name("b"));
    let mut x = RegistrySet::new();
    let mut y = RegistrySet::new();
    let fresh = |s: &RegistrySet| {
        assert_eq!(s.digest(), s.compute_digest());
        s.digest()
    };
    let d0 = fresh(&x);
    x.add(a, 10, 1, rec("http://h:1", 1000));
    let d1 = fresh(&x);
    assert_ne!(d0, d1);
    x.add(a, 20, 1, rec("http://h:1", 2000));
    let d2 = fresh(&x);
    assert_ne!(d1, d2, "a new record");
    y.add(b, 15, 2, rec("http://h:2", 1000));
    fresh(&y);
    merge_all(&mut x, &y);
    let d3 = fresh(&x);
    assert_ne!(d2, d3, "a merged engine");
    x.remove(1);
    assert_ne!(fresh(&x), d3, "a removal");
    merge_all(&mut y, &x);
    assert_eq!(fresh(&x), fresh(&y));
}
