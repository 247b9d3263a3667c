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
