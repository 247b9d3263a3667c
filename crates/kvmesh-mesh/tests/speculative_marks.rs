//! Which speculative marks travel: a new prompt's (the decision found nothing: siblings at
//! other routers find the engine by it until its KV events come), and not one that extends a
//! prefix the engine was found holding while the engine's feed is in sync (the events say the
//! same a few ms later); approximate marks (no events) always. A mark names the top key of
//! each anchor window it covers, not every key. A mark received as news is told apart from
//! an old one received in a transfer of state. Virtual time, no sockets.

use kvmesh_mesh::core::CoreConfig;
use kvmesh_mesh::core::sim::{NetConfig, Sim};

const SPECULATIVE_US: u64 = 2_000_000;
const APPROXIMATE_US: u64 = 120_000_000;

fn cfg() -> CoreConfig {
    CoreConfig {
        cluster_id: 9,
        flush_us: 5_000,
        load_flush_us: 100,
        load_burst: 8,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: 4_096,
        feed_capacity: 4_096,
        mark_ttls_us: vec![SPECULATIVE_US, APPROXIMATE_US],
        expected_size: 3,
        warm_bound_us: 1_000_000,
        wire_version: 1,
        snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
        first: false,
    }
}

const NET: NetConfig = NetConfig {
    datagram_loss: 0,
    envelope_loss: 0,
    delay_us: 200,
    jitter_us: 200,
    dup_per_mille: 0,
};

fn cluster() -> Sim {
    let mut s = Sim::new(3, 4, cfg(), NET, 21);
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

/// Keys node `to` received in marks while node `from` marked `keys` of `engine`.
fn keys_received(
    s: &mut Sim,
    from: usize,
    to: usize,
    engine: u64,
    keys: &[u64],
    known: usize,
) -> u64 {
    let before = s.nodes[to].as_ref().unwrap().index.mark_keys;
    let now = s.now;
    s.nodes[from].as_mut().unwrap().core.local_mark(
        engine,
        keys.to_vec(),
        known,
        now + APPROXIMATE_US,
    );
    s.run(200_000, |_| {});
    s.nodes[to].as_ref().unwrap().index.mark_keys - before
}

#[test]
fn a_mark_names_the_top_key_of_each_window_it_covers() {
    let mut s = cluster();
    let e = *s.engines.keys().next().unwrap();
    // A 72-block prompt (windows end at positions 0, 8, .., 64 and 71), new to the cluster.
    let group: Vec<u64> = (0..64).map(|k| (7 << 16 | k) * 2 + 1).collect();
    let with_own = |own: u64| -> Vec<u64> {
        let mut v = group.clone();
        v.extend((0..8).map(|k| (own << 8 | k) * 2 + 1));
        v
    };
    assert_eq!(
        keys_received(&mut s, 0, 1, e, &with_own(1), 0),
        10,
        "9 anchors and the last key, not 72"
    );
    // A sibling at another router: the group found, its own 8 blocks new → 2 keys.
    assert_eq!(keys_received(&mut s, 2, 1, e, &with_own(2), 64), 2);
    // The same prompt again from a third router: the cluster already covers all of it.
    assert_eq!(keys_received(&mut s, 1, 0, e, &with_own(1), 0), 0);
    // Found only up to 57 (a peer's covering marks end the group's last window at its own
    // 64th key): the rest of the group's window is covered by this prompt's top, 2 keys.
    assert_eq!(keys_received(&mut s, 1, 0, e, &with_own(3), 57), 2);
}

/// Keys of the (news, transferred) marks node `i` has applied.
fn applied(s: &Sim, i: usize) -> (u64, u64) {
    let x = &s.nodes[i].as_ref().expect("alive").index;
    (x.mark_keys, x.transferred_keys)
}

/// Keys a new 12-block prompt's mark names: the tops of the windows ending at positions 0
/// and 8, and its last.
const KEYS: u64 = 3;

/// Node 0 marks `n` new 12-block prompts of engine `e` (approximate: they always travel).
fn mark_new(s: &mut Sim, e: u64, n: u64, salt: u64) {
    let now = s.now;
    for p in 0..n {
        let keys: Vec<u64> = (0..12)
            .map(|k| ((salt << 16 | p << 8 | k) << 1) | 1)
            .collect();
        let core = &mut s.nodes[0].as_mut().expect("node 0").core;
        core.local_mark(e, keys, 0, now + APPROXIMATE_US);
    }
}

/// A router applies news marks at once on its own thread, and old marks of a transfer of
/// state (a joiner's snapshot, a repair after a partition) in its queue: the core says which.
/// A mark made within the last second is news however it came (the repair when two routers
/// meet carries the decisions of the partition's last moments, and the counts made after
/// them).
#[test]
fn old_marks_of_a_snapshot_or_a_repair_are_transfers_and_recent_ones_news() {
    let mut s = Sim::new(3, 4, cfg(), NET, 5);
    let e = *s.engines.keys().next().unwrap();
    s.start(0, None);
    s.run(200_000, |_| {});
    mark_new(&mut s, e, 40, 1);
    s.run(1_500_000, |_| {});
    // Joiners get those 40, made 1.5 s before, in the welcome (and when they meet node 0):
    // transfers only.
    s.start(1, Some(0));
    s.start(2, Some(0));
    assert!(s.until(20_000_000, |s| s.membership_converged()).is_some());
    assert!(
        s.until(5_000_000, |s| s.nodes[1..]
            .iter()
            .all(|n| n.as_ref().is_some_and(|n| n.warm)))
            .is_some()
    );
    s.run(500_000, |_| {});
    for i in 1..3 {
        let (news, transferred) = applied(&s, i);
        assert_eq!(news, 0, "node {i}: a welcome's old marks taken for news");
        assert_eq!(transferred, 40 * KEYS, "node {i}: the welcome's marks");
    }
    // A new decision at node 0 is news at both peers.
    mark_new(&mut s, e, 1, 2);
    s.run(200_000, |_| {});
    assert_eq!(applied(&s, 1), (KEYS, 40 * KEYS));
    assert_eq!(applied(&s, 2), (KEYS, 40 * KEYS));
    // Node 0 cut off for 1.5 s (shorter than failure detection): the flushes of its 5 marks
    // at the start and 2 at the end are lost; once the link is back, the repair brings the
    // old 5 as a transfer and the recent 2 as news.
    s.group[0] = 1;
    mark_new(&mut s, e, 5, 3);
    s.run(1_500_000, |_| {});
    mark_new(&mut s, e, 2, 4);
    s.run(50_000, |_| {});
    s.group[0] = 0;
    assert_eq!(s.view(1).len(), 2, "node 0 was declared down");
    s.reconnect(0, 1);
    s.reconnect(0, 2);
    s.run(500_000, |_| {});
    assert_eq!(applied(&s, 1), (3 * KEYS, 45 * KEYS));
    assert_eq!(applied(&s, 2), (3 * KEYS, 45 * KEYS));
}

/// A mark whose expiry is as far as a u64 goes (a peer's bytes are trusted for nothing but
/// their certificate; or its clock is wrong) goes through the repair rule without overflow
/// (the rule that leaves out the buckets of recent marks), and the peer refuses it: it
/// expires past the longest lifetime + the clock allowance, so it would stay for good.
#[test]
fn a_mark_expiring_at_the_end_of_time_is_offered_without_overflow_and_refused() {
    let mut s = Sim::new(2, 4, cfg(), NET, 7);
    let e = *s.engines.keys().next().unwrap();
    s.start(0, None);
    s.start(1, Some(0));
    assert!(s.until(20_000_000, |s| s.membership_converged()).is_some());
    // Node 0 cut off: its flush is lost, and only the next anti-entropy offers the mark.
    s.group[0] = 1;
    let core = &mut s.nodes[0].as_mut().expect("node 0").core;
    core.local_mark(e, vec![(9 << 1) | 1], 0, u64::MAX);
    s.run(100_000, |_| {});
    s.group[0] = 0;
    let repairs = s.nodes[0].as_ref().unwrap().core.counters().repairs;
    s.run(3_000_000, |_| {});
    let n0 = s.nodes[0].as_ref().unwrap().core.counters();
    assert!(n0.repairs > repairs, "node 0 offered its marks in a repair");
    assert_eq!(applied(&s, 1).1, 0, "the far mark is not applied");
    let n1 = s.nodes[1].as_ref().unwrap().core.counters();
    assert!(
        n1.deltas_refused >= 1,
        "the far mark is refused and counted"
    );
    // One a lifetime long is taken.
    let now = s.now;
    let core = &mut s.nodes[0].as_mut().expect("node 0").core;
    core.local_mark(e, vec![(10 << 1) | 1], 0, now + APPROXIMATE_US);
    s.run(100_000, |_| {});
    assert_eq!(
        applied(&s, 1).0,
        1,
        "a mark of the longest lifetime, as news"
    );
}
