//! Merge is commutative, associative and idempotent: any order, duplication or batching of the
//! same deltas gives the same digest. And a seeded simulation of 8 routers exchanging deltas
//! over a lossy, duplicating, reordering network, with anti-entropy (a random peer's whole state
//! now and then), ends with identical digests once the network heals.

mod common;

use common::{node, record};
use kvmesh_state::{
    Delta, Envelope, EnvelopeV1, LoadBatch, LoadDelta, LoadMap, MarkDelta, MarkMap, RegistrySet,
    Version, WireError, decode, encode,
};
use proptest::prelude::*;

/// The whole state of one router.
#[derive(Clone)]
struct State {
    load: LoadMap,
    marks: MarkMap,
    registry: RegistrySet,
}

impl State {
    fn new() -> State {
        State {
            load: LoadMap::new(),
            marks: MarkMap::new(100_000),
            registry: RegistrySet::new(),
        }
    }

    fn merge(&mut self, d: &Delta) {
        match d {
            Delta::Load(x) => {
                self.load.merge(x);
            }
            Delta::LoadBatch(b) => {
                for x in b.deltas() {
                    self.load.merge(&x);
                }
            }
            Delta::Mark(x) => {
                self.marks.merge(x);
            }
            Delta::Registry(x) => {
                self.registry.merge(x);
            }
            // A bequest is a feed's snapshot, no part of the merged state.
            Delta::Bequest(_) | Delta::SnapshotPart(_) => {}
            Delta::Planted(x) => {
                self.registry
                    .merge_planted(x, &mut std::collections::BTreeSet::new());
            }
            // Feeds are ordered logs, not joins: tests/feed_props.rs.
            Delta::Feed(_) | Delta::FeedSnapshot(_) | Delta::FeedBatches(_) => {}
        }
    }

    fn digest(&self) -> (u64, u64, u64) {
        (
            self.load.digest(),
            self.marks.digest(),
            self.registry.digest(),
        )
    }

    fn all(&self) -> Vec<Delta> {
        let mut v: Vec<Delta> = self.load.deltas().into_iter().map(Delta::Load).collect();
        v.extend(self.marks.deltas().into_iter().map(Delta::Mark));
        v.extend(self.registry.deltas().into_iter().map(Delta::Registry));
        v
    }
}

/// Deltas as 3 routers produce them from random local actions (so removes name real dots).
fn produce(actions: &[(u8, u8, u8, u32)]) -> Vec<Delta> {
    let mut routers: Vec<State> = (0..3).map(|_| State::new()).collect();
    let mut out = Vec::new();
    for (i, &(r, kind, e, x)) in actions.iter().enumerate() {
        let r = (r % 3) as usize;
        let me = node(r as u8);
        let engine = u64::from(e % 5);
        let now = 1_000 + i as u64;
        let d = match kind % 4 {
            0 => Delta::Load(routers[r].load.set_local(me, 1, engine, x % 50)),
            1 => Delta::Mark(MarkDelta {
                engine,
                keys: (0..(x % 6 + 1))
                    .map(|k| u64::from(x) * 31 + u64::from(k))
                    .collect(),
                expiry_us: 2_000 + u64::from(x % 97),
            }),
            2 => Delta::Registry(routers[r].registry.add(
                me,
                now,
                engine,
                record(engine, x % 4000),
            )),
            _ => match routers[r].registry.remove(engine) {
                Some(d) => Delta::Registry(d),
                None => continue,
            },
        };
        routers[r].merge(&d);
        // Routers hear each other now and then (so removes see others' adds).
        if x % 3 == 0 {
            for o in &mut routers {
                o.merge(&d);
            }
        }
        out.push(d);
    }
    out
}

fn apply(deltas: &[Delta], order: &[usize]) -> State {
    let mut s = State::new();
    for &i in order {
        s.merge(&deltas[i % deltas.len()]);
    }
    // Whatever the order, every delta once more at the end: all are delivered at least once.
    for d in deltas {
        s.merge(d);
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn any_order_duplication_and_batching_gives_the_same_state(
        actions in prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), any::<u32>()), 1..80),
        order_a in prop::collection::vec(any::<usize>(), 0..200),
        order_b in prop::collection::vec(any::<usize>(), 0..200),
    ) {
        let deltas = produce(&actions);
        prop_assume!(!deltas.is_empty());
        let a = apply(&deltas, &order_a);
        let b = apply(&deltas, &order_b);
        prop_assert_eq!(a.digest(), b.digest());
        // Batching: a state merged into another as its snapshot (associativity).
        let mut c = State::new();
        let half = apply(&deltas[..deltas.len() / 2], &[]);
        for d in half.all() {
            c.merge(&d);
        }
        for d in deltas.iter().rev() {
            c.merge(d);
        }
        prop_assert_eq!(c.digest(), a.digest());
        // Idempotence: merging a state's own snapshot changes nothing.
        let mut again = a.clone();
        for d in a.all() {
            again.merge(&d);
        }
        prop_assert_eq!(again.digest(), a.digest());
    }

    #[test]
    fn load_batches_carry_exactly_the_deltas_grouped(
        raw in prop::collection::vec((0u8..3, 0u64..3, any::<u64>(), any::<u64>(), any::<u32>()), 0..60),
    ) {
        // Any counters (out of order, far apart, at the extremes): what travels grouped by
        // router and incarnation, with counters as differences, comes back as it was.
        let deltas: Vec<LoadDelta> = raw
            .iter()
            .map(|&(n, inc, counter, engine, in_flight)| LoadDelta {
                node: node(n),
                engine,
                version: Version { incarnation: inc, counter: if engine % 3 == 0 { u64::MAX - counter % 4 } else { counter } },
                in_flight,
            })
            .collect();
        let batches = LoadBatch::compact(deltas.clone());
        let mut back: Vec<LoadDelta> = batches.iter().flat_map(|b| b.deltas().collect::<Vec<_>>()).collect();
        let key = |d: &LoadDelta| (d.node, d.version.incarnation);
        // Grouping keeps the order within each (router, incarnation).
        let mut want = deltas.clone();
        want.sort_by_key(key);
        back.sort_by_key(key);
        prop_assert_eq!(back, want);
        // And it survives the wire.
        let env = Envelope::V1(EnvelopeV1 { cluster_id: 7, from: node(1), kind: kvmesh_state::EnvelopeKind::Live, sent_us: 5, deltas: batches.into_iter().map(Delta::LoadBatch).collect(), control: vec![] });
        let bytes = encode(&env).expect("encode");
        prop_assert_eq!(Envelope::V1(decode(&bytes, 7).expect("decode")), env);
    }

    #[test]
    fn hostile_bytes_never_panic_and_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes, 7);
    }

    #[test]
    fn an_envelope_round_trips_and_any_truncation_is_refused(
        actions in prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), any::<u32>()), 1..30),
        cut in any::<usize>(),
    ) {
        let deltas = produce(&actions);
        let env = Envelope::V1(EnvelopeV1 { cluster_id: 7, from: node(1), kind: kvmesh_state::EnvelopeKind::Live, sent_us: 5, deltas, control: vec![] });
        let bytes = encode(&env).expect("encode");
        let back = decode(&bytes, 7).expect("decode");
        prop_assert_eq!(&Envelope::V1(back), &env);
        let cut = cut % bytes.len();
        prop_assert!(decode(&bytes[..cut], 7).is_err());
        let is_other_cluster = matches!(decode(&bytes, 8), Err(WireError::OtherCluster { got: 7, want: 8 }));
        prop_assert!(is_other_cluster);
        // Version 2 carries the same, part by part.
        let Envelope::V1(contents) = env else { unreachable!() };
        let v2 = kvmesh_state::encode_as(contents.clone(), 2).expect("encode v2");
        prop_assert_eq!(kvmesh_state::decode_counting(&v2, 7).expect("decode v2"), (contents, 0));
        let cut = cut % v2.len();
        prop_assert!(decode(&v2[..cut], 7).is_err());
        let is_other_cluster = matches!(decode(&v2, 8), Err(WireError::OtherCluster { got: 7, want: 8 }));
        prop_assert!(is_other_cluster);
    }
}

/// A version 2 envelope whose parts include some this build cannot decode (a kind a later
/// build added, or garbage): those are skipped and counted, the others applied.
#[test]
fn a_part_that_does_not_decode_is_skipped_and_the_rest_kept() {
    use kvmesh_state::{Control, EnvelopeV2, Part, decode_counting};
    let load = Delta::Load(LoadDelta {
        node: node(2),
        engine: 9,
        version: Version {
            incarnation: 1,
            counter: 4,
        },
        in_flight: 3,
    });
    let env = Envelope::V2(EnvelopeV2 {
        cluster_id: 7,
        from: node(1),
        kind: kvmesh_state::EnvelopeKind::Live,
        sent_us: 5,
        deltas: vec![
            Part::of(&load).expect("part"),
            // Variant 200 of `Delta`: a kind this build does not have.
            Part(vec![200, 1, 2, 3]),
            Part(vec![0xff; 3]),
            // A delta and a byte more: not exactly one value.
            Part([Part::of(&load).expect("part").0, vec![0]].concat()),
        ],
        control: vec![
            Part(vec![250]),
            Part::of(&Control::WantState).expect("part"),
        ],
    });
    let (got, skipped) = decode_counting(&encode(&env).expect("encode"), 7).expect("decodes");
    assert_eq!(skipped, 4);
    assert_eq!(got.deltas, vec![load]);
    assert_eq!(got.control, vec![Control::WantState]);
}

#[test]
fn oversized_and_trailing_bytes_are_refused() {
    let env = Envelope::V1(EnvelopeV1 {
        cluster_id: 1,
        from: node(0),
        kind: kvmesh_state::EnvelopeKind::Snapshot,
        sent_us: 1,
        control: vec![],
        deltas: vec![Delta::Load(LoadDelta {
            node: node(0),
            engine: 3,
            version: Version {
                incarnation: 1,
                counter: 1,
            },
            in_flight: 2,
        })],
    });
    let mut bytes = encode(&env).expect("encode");
    bytes.push(0);
    assert_eq!(decode(&bytes, 1), Err(WireError::Trailing(1)));
    let huge = vec![0u8; kvmesh_state::MAX_ENVELOPE_BYTES + 1];
    assert!(matches!(decode(&huge, 1), Err(WireError::TooLarge(_))));
    // A length prefix claiming 2^60 deltas is refused without allocating them.
    let mut claim = vec![0u8, 1, 0, 0]; // variant V1, cluster id 1, from 0, not a snapshot
    claim.extend_from_slice(&[0xFD, 0, 0, 0, 0, 0, 0, 0, 0x10]); // varint u64 length
    assert!(decode(&claim, 1).is_err());
}

/// A tiny deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn eight_routers_over_a_lossy_network_converge_after_heal() {
    const N: usize = 8;
    for seed in 1..=50u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut routers: Vec<State> = (0..N).map(|_| State::new()).collect();
        // In flight: (deliver at step, to, delta).
        let mut net: Vec<(u64, usize, Delta)> = Vec::new();
        for step in 0..400u64 {
            let lossy = step < 300; // the network heals at step 300
            // Each router acts.
            for (r, router) in routers.iter_mut().enumerate() {
                let me = node(r as u8);
                let engine = rng.below(6);
                let d = match rng.below(10) {
                    0..=4 => {
                        Delta::Load(router.load.set_local(me, 1, engine, rng.below(40) as u32))
                    }
                    5..=6 => Delta::Mark(MarkDelta {
                        engine,
                        keys: (0..rng.below(8) + 1).map(|_| rng.below(64)).collect(),
                        expiry_us: 10_000 + rng.below(1_000),
                    }),
                    7..=8 => Delta::Registry(router.registry.add(
                        me,
                        step,
                        engine,
                        record(engine, 1000 + rng.below(3) as u32 * 500),
                    )),
                    _ => match router.registry.remove(engine) {
                        Some(d) => Delta::Registry(d),
                        None => continue,
                    },
                };
                // Broadcast: each copy lost (20%), delayed, or duplicated while lossy.
                for to in (0..N).filter(|&t| t != r) {
                    if lossy && rng.below(5) == 0 {
                        continue;
                    }
                    let delay = if lossy { rng.below(20) } else { 1 };
                    net.push((step + delay, to, d.clone()));
                    if lossy && rng.below(10) == 0 {
                        net.push((step + rng.below(30), to, d.clone()));
                    }
                }
            }
            // Deliver what is due, in a shuffled order.
            let (mut due, rest): (Vec<_>, Vec<_>) = net.into_iter().partition(|m| m.0 <= step);
            net = rest;
            for i in (1..due.len()).rev() {
                due.swap(i, rng.below(i as u64 + 1) as usize);
            }
            for (_, to, d) in due {
                routers[to].merge(&d);
            }
            // Anti-entropy: one router pulls a random peer's whole state every 10 steps.
            if step % 10 == 0 {
                let a = rng.below(N as u64) as usize;
                let b = rng.below(N as u64) as usize;
                if !lossy || rng.below(2) == 0 {
                    for d in routers[b].all() {
                        routers[a].merge(&d);
                    }
                }
            }
        }
        // After the heal: deliver everything left, then a round of anti-entropy.
        for (_, to, d) in std::mem::take(&mut net) {
            routers[to].merge(&d);
        }
        for a in 0..N {
            for b in 0..N {
                let snapshot = routers[b].all();
                for d in &snapshot {
                    routers[a].merge(d);
                }
            }
        }
        let first = routers[0].digest();
        for (i, r) in routers.iter().enumerate() {
            assert_eq!(r.digest(), first, "seed {seed}: router {i} diverged");
        }
        // Bounded: the registry keeps its adds present (at most one per engine and router)
        // and one counter interval per router, however many adds were removed; marks
        // expire, a departed router's load goes.
        for r in &routers {
            assert!(
                r.registry.adds() <= 6 * N,
                "seed {seed}: {} adds",
                r.registry.adds()
            );
            assert!(
                r.registry.context_len() <= N,
                "seed {seed}: {} intervals",
                r.registry.context_len()
            );
        }
        let mut r0 = routers[0].clone();
        r0.marks.expire(20_000);
        assert!(r0.marks.is_empty());
        let before = r0.load.len();
        r0.load.remove_node(node(3), 1);
        assert!(r0.load.len() < before);
    }
}
