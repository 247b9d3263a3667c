//! In-flight changes travel ahead of the outbox's flush period: a router that ends a request
//! tells its peers at once (plus the network) while its envelopes stay under one per
//! `load_flush_us` × routers with bursts of `load_burst`, not a whole flush later, so that a
//! client's next turn through another router finds the engine's load as it is. Virtual time,
//! no sockets.

use kvmesh_mesh::core::sim::{NetConfig, Sim};
use kvmesh_mesh::core::{CoreConfig, MeshCore};

const FLUSH_US: u64 = 20_000;
const DELAY_US: u64 = 200;
const BURST: u64 = 8;

fn cfg(load_flush_us: u64) -> CoreConfig {
    CoreConfig {
        cluster_id: 3,
        flush_us: FLUSH_US,
        load_flush_us,
        load_burst: BURST,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: 512,
        feed_capacity: 4_096,
        mark_ttls_us: vec![2_000_000],
        expected_size: 3,
        warm_bound_us: 1_000_000,
        wire_version: 1,
        snapshot_part_blocks: kvmesh_state::SNAPSHOT_PART_BLOCKS,
        first: false,
    }
}

/// Three routers over a lossless network of fixed delay, formed and quiet for 2 s.
fn formed(load_flush_us: u64) -> Sim {
    let net = NetConfig {
        datagram_loss: 0,
        envelope_loss: 0,
        delay_us: DELAY_US,
        jitter_us: 0,
        dup_per_mille: 0,
    };
    let mut s = Sim::new(3, 4, cfg(load_flush_us), net, 11);
    s.start_all();
    assert!(
        s.until(20_000_000, |s| s.membership_converged()).is_some(),
        "the cluster formed"
    );
    s.run(2_000_000, |_| {});
    s
}

/// Node 0, where the changes are made.
fn node0(s: &mut Sim) -> &mut MeshCore {
    &mut s.nodes[0].as_mut().expect("node 0").core
}

/// The peers' count node 1 holds for `engine` (node 0's, the only one changed).
fn seen(s: &Sim, engine: u64) -> Option<u64> {
    s.nodes[1]
        .as_ref()
        .expect("node 1")
        .index
        .peer_load
        .get(&engine)
        .copied()
}

/// How long after a change at node 0 node 1 applies it (µs), over `changes` changes.
fn delays(load_flush_us: u64, changes: u32) -> Vec<u64> {
    let mut s = formed(load_flush_us);
    let mut out = Vec::new();
    for k in 1..=changes {
        // Changes at odd moments relative to the flush period.
        s.run(7_300 + u64::from(k) * 1_100, |_| {});
        let at = s.now;
        node0(&mut s).local_load(2, k);
        let arrived = (0..400).find_map(|_| {
            s.run(100, |_| {});
            (seen(&s, 2) == Some(u64::from(k))).then(|| s.now - at)
        });
        out.push(arrived.expect("the change arrived within 40 ms"));
    }
    out
}

#[test]
fn in_flight_changes_arrive_within_the_load_spacing_not_the_flush_period() {
    // 3 routers × 100 µs = 300 µs after the previous flush, + 200 µs of network, + the
    // 100 µs steps of this loop.
    let eager = delays(100, 20);
    let worst = *eager.iter().max().unwrap();
    println!("eager {eager:?}");
    assert!(worst <= 300 + DELAY_US + 200, "eager: {eager:?}");
    // With the flush period only, some change waits most of a period.
    let lazy = delays(0, 20);
    let worst_lazy = *lazy.iter().max().unwrap();
    println!("flush only {lazy:?}");
    assert!(worst_lazy > FLUSH_US / 2, "flush only: {lazy:?}");
}

#[test]
fn a_burst_of_changes_goes_at_once_and_a_stream_keeps_to_the_spacing() {
    let mut s = formed(100);
    // A burst (an engine's decode step ends several requests, on several engines): each
    // change 10 µs after the previous, all told after the network's delay alone, none held
    // for the spacing (300 µs at 3 routers) behind the one before.
    let burst = BURST as u32;
    let mut at = Vec::new();
    for k in 0..burst {
        s.run(10, |_| {});
        at.push(s.now);
        node0(&mut s).local_load(u64::from(k % 4), 100 + k);
    }
    let mut arrived = vec![None; burst as usize];
    for _ in 0..2_000 {
        s.run(10, |_| {});
        for (k, a) in arrived.iter_mut().enumerate() {
            let want = 100 + k as u64;
            // A later change to the same engine overwrites the count: either counts it.
            let got = seen(&s, k as u64 % 4);
            if a.is_none() && got.is_some_and(|g| g >= want) {
                *a = Some(s.now - at[k]);
            }
        }
        if arrived.iter().all(Option::is_some) {
            break;
        }
    }
    let arrived: Vec<u64> = arrived
        .into_iter()
        .map(|a| a.expect("every change of the burst arrived"))
        .collect();
    println!("burst {arrived:?}");
    assert!(
        arrived.iter().all(|&d| d <= DELAY_US + 20),
        "a burst goes at once: {arrived:?}"
    );

    // A steady stream (a change every 20 µs for 100 ms): the envelopes keep to one per
    // spacing over time, plus the burst, the flush period's own and anti-entropy's.
    let before = node0(&mut s).counters().envelopes_sent;
    let spacing = node0(&mut s).load_flush_spacing();
    assert_eq!(spacing, 300);
    let span = 100_000u64;
    for k in 0..(span / 20) {
        s.run(20, |_| {});
        node0(&mut s).local_load(k % 4, 1_000 + k as u32);
    }
    let sent = node0(&mut s).counters().envelopes_sent - before;
    let peers = 2;
    let most = peers * (span / spacing + BURST + span / FLUSH_US + 4);
    let least = peers * (span / spacing) * 9 / 10;
    println!("stream: {sent} envelopes in {span} µs (between {least} and {most})");
    assert!(sent <= most, "{sent} envelopes > {most}");
    assert!(
        sent >= least,
        "{sent} envelopes < {least}: the stream waited for the flush period"
    );
}

#[test]
fn a_mark_reaches_a_peer_no_later_than_the_count_made_after_it() {
    // A router marks a new prompt's engine, then counts the request in flight: both go in the
    // next envelope, and the peer applies the mark first. Seeing the count alone, it would
    // take the engine for busier than it is and send a sibling of the prompt elsewhere.
    let mut s = formed(100);
    for k in 1..=5u32 {
        let engine = u64::from(k % 4);
        let expiry = s.now + 2_000_000;
        let keys = vec![0x5EED_0000 + u64::from(k)];
        node0(&mut s).local_mark(engine, keys, 0, expiry);
        node0(&mut s).local_load(engine, k);
        let node1 = |s: &Sim| s.nodes[1].as_ref().expect("node 1").index.order.clone();
        let before = node1(&s).len();
        let arrived = (0..400).any(|_| {
            s.run(100, |_| {});
            seen(&s, engine) == Some(u64::from(k))
        });
        assert!(arrived, "change {k} arrived");
        let got: Vec<(u8, u64)> = node1(&s).into_iter().skip(before).collect();
        assert_eq!(got, [(b'm', engine), (b'l', engine)], "change {k}");
    }
}
