//! The feed side of one node, driven directly: ownership that goes and comes back, and pulls
//! that reach an owner before its handover does.

use super::*;
use kvmesh_state::ownership::score;

const A: NodeId = NodeId(0xA);
const F: NodeId = NodeId(0xF);
const N: NodeId = NodeId(0x3);

/// An engine that `N` outranks `A` for, and `A` outranks `F` (alone, so ownership is plain
/// rendezvous hashing).
fn engine() -> u64 {
    (1..10_000u64)
        .find(|&e| score(e, N) > score(e, A) && score(e, A) > score(e, F))
        .expect("such an engine")
}

fn feeds(me: NodeId, engine: u64) -> Feeds {
    let mut f = Feeds::new(me, 1, 1, 1_000);
    f.set_engines([engine].into());
    f
}

/// A membership change as the node makes it: the owners table follows the members, then
/// ownership.
fn members_changed(f: &mut Feeds, now_us: u64, live: &[Live], applies: &mut Vec<Apply>) {
    let ids: Vec<NodeId> = live.iter().map(|l| l.0).collect();
    f.refresh(&ids);
    f.rebalance(now_us, live, &mut Vec::new(), applies);
}

/// `me` reading `engine` among `live`: nobody answered its handover asks, so it reads the
/// engine afresh.
fn reading(me: NodeId, engine: u64, live: &[Live]) -> Feeds {
    let (mut f, mut applies) = (feeds(me, engine), Vec::new());
    members_changed(&mut f, 0, live, &mut applies);
    f.expire_handovers(u64::MAX, live, &mut applies);
    assert!(f.feed_out(engine).is_some(), "{me:?} reads the engine");
    f
}

fn stored(keys: &[u64]) -> Vec<WireOp> {
    keys.iter().map(|&k| WireOp::Stored(k)).collect()
}

#[test]
fn a_router_that_owns_an_engine_again_numbers_its_new_feed_past_the_old_one() {
    let e = engine();
    let two = [(A, 1), (F, 1)];
    let (mut a, mut applies) = (reading(A, e, &two), Vec::new());
    // A follower of A's feed, at its head.
    let mut fin = FeedIn::new(e);
    let _ = fin.follow(a.feed_out(e).expect("owned").id());
    let mut got = Vec::new();
    fin.on_snapshot(&a.feed_out(e).expect("owned").snapshot(), &mut got);
    for k in 0..5u64 {
        let b = a.local(e, &stored(&[k]), &[], false, Some(k + 1), &mut Vec::new());
        let _ = fin.on_batch(b.expect("owned"), &mut got);
    }
    let old_head = fin.applied();
    assert_eq!(old_head, 5);
    // N comes and takes the engine; it goes again before the follower's view moved, and A
    // reads the engine afresh (nobody to hand it over).
    members_changed(&mut a, 1, &[(A, 1), (F, 1), (N, 1)], &mut applies);
    assert!(a.feed_out(e).is_none(), "N owns it");
    members_changed(&mut a, 2, &two, &mut applies);
    a.expire_handovers(u64::MAX, &two, &mut applies);
    let out = a.feed_out(e).expect("A owns it again");
    assert_eq!(out.id(), fin.feed().expect("followed"), "the same feed id");
    assert!(
        out.head() > old_head,
        "new head {} after {old_head}",
        out.head()
    );
    // The follower that never moved away takes the new feed: its snapshot at once, or its
    // first batch shows a gap and it pulls (here: the snapshot such a pull gets).
    let b = a.local(e, &stored(&[100]), &[], false, Some(1), &mut Vec::new());
    let pull = fin.on_batch(b.expect("owned"), &mut got);
    let p = pull.expect("a gap: the follower asks");
    assert_eq!(p.after, old_head);
    for d in a.serve_pull(F, &p) {
        match d {
            Delta::FeedSnapshot(s) => fin.on_snapshot(&s, &mut got),
            Delta::Feed(b) => drop(fin.on_batch(b, &mut got)),
            other => panic!("unexpected {other:?}"),
        }
    }
    let mut blocks = Default::default();
    for g in &got {
        kvmesh_state::feeds::apply_ops(&mut blocks, &g.ops);
    }
    let want = a.feed_out(e).expect("owned").snapshot();
    assert!(fin.is_synced());
    assert_eq!(fin.applied(), a.feed_out(e).expect("owned").head());
    let mut have: Vec<u64> = blocks.keys().copied().collect();
    have.sort_unstable();
    let want: Vec<u64> = want.blocks.iter().map(|b| b.key).collect();
    assert_eq!(
        have, want,
        "the follower holds the new feed's blocks, not the old ones"
    );
}

#[test]
fn a_pull_that_reaches_an_owner_before_its_handover_is_answered_when_it_starts() {
    let e = engine();
    let all = [(A, 1), (F, 1), (N, 1)];
    // N has just come: it owns the engine and waits for A to hand it over.
    let (mut n, mut pulls, mut applies) = (feeds(N, e), Vec::new(), Vec::new());
    n.refresh(&[A, F, N]);
    n.rebalance(0, &all, &mut pulls, &mut applies);
    assert!(pulls.iter().any(|(to, _)| *to == A), "N asks A: {pulls:?}");
    assert!(n.feed_out(e).is_none(), "waiting");
    // F follows N already and asks for its snapshot: nothing to answer yet.
    let ask = FeedPull {
        engine: e,
        feed: FeedId {
            source: N,
            incarnation: 1,
        },
        after: 0,
        snapshot: true,
    };
    assert!(n.serve_pull(F, &ask).is_empty());
    assert!(n.take_answers().is_empty());
    // A's handover arrives: N starts, and F gets the snapshot it asked for.
    let mut a = FeedOut::new(
        e,
        FeedId {
            source: A,
            incarnation: 1,
        },
        1_000,
    );
    let _ = a.push(&stored(&[7, 8]), &[], false, Some(3));
    n.on_snapshot(a.snapshot(), &all, &mut applies);
    let answers = n.take_answers();
    assert_eq!(answers.len(), 1, "{answers:?}");
    let (to, d) = &answers[0];
    assert_eq!(*to, F);
    let Delta::FeedSnapshot(s) = d else {
        panic!("a snapshot: {d:?}")
    };
    assert_eq!(s.feed.source, N);
    assert_eq!(s.blocks.len(), 2);
    assert!(n.take_answers().is_empty(), "answered once");
}

#[test]
fn an_engine_removed_that_this_node_read_counts_as_a_move() {
    let e = engine();
    let two = [(A, 1), (F, 1)];
    let mut a = reading(A, e, &two);
    // QA: a DELETE of an engine left `kvmesh_mesh_ownership_moves` as it was.
    assert_eq!(a.set_engines(BTreeSet::new()), 1);
    assert!(a.feed_out(e).is_none());
    let mut f = feeds(F, e);
    members_changed(&mut f, 0, &two, &mut Vec::new());
    assert_eq!(f.set_engines(BTreeSet::new()), 0, "F only followed it");
}

/// A leaving router's feed, with the blocks and the engine seq it read up to.
fn bequest_of(from: NodeId, e: u64) -> FeedSnapshot {
    let mut out = FeedOut::new(
        e,
        FeedId {
            source: from,
            incarnation: 1,
        },
        1_000,
    );
    let _ = out.push(
        &stored(&[7, 8, 9]),
        &[(70, 0), (80, 1), (90, 2)],
        false,
        Some(42),
    );
    out.snapshot()
}

fn resumed_at(applies: &[Apply], e: u64) -> Option<Option<u64>> {
    applies.iter().rev().find_map(|a| match a {
        Apply::Own { engine, from } if *engine == e => Some(from.as_ref().and_then(|s| s.next_seq)),
        _ => None,
    })
}

#[test]
fn a_bequest_that_comes_before_the_leave_is_taken_up_when_the_engine_comes() {
    let e = engine();
    // One owner (r = 1): N outranks A, which reads the engine once N is gone.
    let mut a = feeds(A, e);
    let three = [(A, 1), (F, 1), (N, 1)];
    members_changed(&mut a, 0, &three, &mut Vec::new());
    assert!(a.feed_out(e).is_none(), "N reads it");
    // N leaves: its bequest reaches A before its leave does.
    let mut applies = Vec::new();
    assert_eq!(a.on_bequest(bequest_of(N, e), &three, &mut applies), 0);
    assert!(
        resumed_at(&applies, e).is_none(),
        "kept: A does not own it yet"
    );
    members_changed(&mut a, 1, &[(A, 1), (F, 1)], &mut applies);
    assert_eq!(resumed_at(&applies, e), Some(Some(42)), "{applies:?}");
    assert_eq!(a.feed_out(e).expect("A reads it").len(), 3);
    assert_eq!(a.taken, 1);
}

#[test]
fn a_bequest_that_comes_after_the_leave_replaces_the_fresh_start() {
    let e = engine();
    let mut a = feeds(A, e);
    let three = [(A, 1), (F, 1), (N, 1)];
    members_changed(&mut a, 0, &three, &mut Vec::new());
    let mut applies = Vec::new();
    // N's leave first: A asks F, which never read the engine, for it; nobody answers and
    // A reads the engine afresh.
    let two = [(A, 1), (F, 1)];
    members_changed(&mut a, 1, &two, &mut applies);
    a.expire_handovers(u64::MAX, &two, &mut applies);
    assert_eq!(resumed_at(&applies, e), Some(None), "afresh: {applies:?}");
    let _ = a.local(e, &stored(&[1]), &[], true, Some(50), &mut Vec::new());
    let fresh_head = a.feed_out(e).expect("reads").head();
    // The bequest comes: A reads the engine again from it, numbered past its fresh feed.
    applies.clear();
    a.on_bequest(bequest_of(N, e), &two, &mut applies);
    assert_eq!(resumed_at(&applies, e), Some(Some(42)), "{applies:?}");
    let out = a.feed_out(e).expect("reads");
    assert!(out.head() > fresh_head);
    assert_eq!(out.len(), 3);
}

#[test]
fn a_bequest_after_its_window_leaves_the_feed_as_it_is() {
    let e = engine();
    let mut a = feeds(A, e);
    members_changed(&mut a, 0, &[(A, 1), (F, 1), (N, 1)], &mut Vec::new());
    let two = [(A, 1), (F, 1)];
    members_changed(&mut a, 1, &two, &mut Vec::new());
    a.expire_handovers(u64::MAX, &two, &mut Vec::new());
    let _ = a.local(e, &stored(&[1]), &[], true, Some(50), &mut Vec::new());
    for _ in 0..BEQUEST_TICKS {
        let _ = a.periodic(&two);
    }
    let head = a.feed_out(e).expect("reads").head();
    let mut applies = Vec::new();
    a.on_bequest(bequest_of(N, e), &two, &mut applies);
    assert!(resumed_at(&applies, e).is_none(), "{applies:?}");
    let out = a.feed_out(e).expect("reads");
    assert_eq!(
        (out.head(), out.len()),
        (head, 1),
        "the feed went on as it was"
    );
    assert_eq!(a.taken, 0);
}

#[test]
fn a_bequest_that_comes_while_the_engine_waits_for_its_handover_starts_it() {
    let e = engine();
    let mut a = feeds(A, e);
    members_changed(&mut a, 0, &[(A, 1), (F, 1), (N, 1)], &mut Vec::new());
    let two = [(A, 1), (F, 1)];
    let mut applies = Vec::new();
    members_changed(&mut a, 1, &two, &mut applies);
    assert!(a.waits_for_handovers(), "A asks F");
    assert_eq!(a.on_bequest(bequest_of(N, e), &two, &mut applies), 1);
    assert_eq!(resumed_at(&applies, e), Some(Some(42)), "{applies:?}");
    assert!(!a.waits_for_handovers());
}

#[test]
fn a_leaving_router_bequeaths_what_it_reads_and_what_it_keeps_for_a_handover() {
    let e = engine();
    let two = [(A, 1), (F, 1)];
    let mut a = reading(A, e, &two);
    let to = |b: Vec<(NodeId, Delta)>| -> Vec<NodeId> {
        b.into_iter()
            .map(|(n, d)| {
                assert!(matches!(d, Delta::Bequest(ref s) if s.engine == e), "{d:?}");
                n
            })
            .collect()
    };
    // Alone but for F: F reads it once A is gone.
    assert_eq!(to(a.bequeath(&two)), vec![F]);
    // N has come and reads the engine in A's view, but may still wait for its handover: A
    // kept its feed for it, and leaving, hands it to N (and F, next in rank).
    let three = [(A, 1), (F, 1), (N, 1)];
    members_changed(&mut a, 1, &three, &mut Vec::new());
    assert!(a.feed_out(e).is_none(), "retired");
    let got = to(a.bequeath(&three));
    assert!(got.contains(&N) && got.contains(&F), "{got:?}");
    // Every router reads every engine: nothing to hand over.
    let mut all = Feeds::new(A, 1, 0, 1_000);
    all.set_engines([e].into());
    members_changed(&mut all, 0, &two, &mut Vec::new());
    assert!(all.bequeath(&two).is_empty());
}
