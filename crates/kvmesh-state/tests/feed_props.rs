//! Precise feeds under any delivery: a receiver given an owner's batches and snapshots in any
//! order, with duplicates and losses, answering its own pulls from the owner, ends with
//! exactly the owner's blocks, applying versions that only grow. And hostile bytes never
//! panic the envelope decoder that carries them.

use kvmesh_state::feeds::apply_ops;
use kvmesh_state::{
    Delta, Envelope, EnvelopeV1, FeedApply, FeedBatch, FeedBatches, FeedId, FeedIn, FeedOut,
    NodeId, WireOp, decode, encode,
};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn feed() -> FeedId {
    FeedId {
        source: NodeId(1),
        incarnation: 9,
    }
}

/// The owner's batches from a script of (store?, key) actions.
fn produce(src: &mut FeedOut, script: &[(bool, u8)]) -> Vec<FeedBatch> {
    let mut truth: BTreeMap<u64, u32> = BTreeMap::new();
    script
        .chunks(3)
        .map(|chunk| {
            let mut ops = Vec::new();
            let mut meta = Vec::new();
            for &(store, k) in chunk {
                let k = u64::from(k % 16) + 1;
                if store || !truth.contains_key(&k) {
                    ops.push(WireOp::Stored(k));
                    meta.push((k * 7, 0));
                    *truth.entry(k).or_insert(0) += 1;
                } else {
                    ops.push(WireOp::Removed(k));
                    let c = truth.get_mut(&k).expect("held");
                    *c -= 1;
                    if *c == 0 {
                        truth.remove(&k);
                    }
                }
            }
            src.push(&ops, &meta, false, None)
        })
        .collect()
}

fn replay(applies: &[FeedApply]) -> BTreeMap<u64, u32> {
    let mut m = BTreeMap::new();
    let mut last = (0u32, 0u64);
    for a in applies {
        assert!((a.epoch, a.n) > last || last == (0, 0), "versions grow");
        last = (a.epoch, a.n);
        apply_ops(&mut m, &a.ops);
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn any_order_duplication_and_loss_ends_with_the_owners_blocks(
        script in prop::collection::vec((any::<bool>(), any::<u8>()), 1..120),
        order in prop::collection::vec(any::<u16>(), 0..200),
        lose in prop::collection::vec(any::<bool>(), 0..200),
        snapshot_at in any::<u8>(),
    ) {
        let mut src = FeedOut::new(5, feed(), 1_000);
        let mut rx = FeedIn::new(5);
        let mut out = Vec::new();
        prop_assert!(rx.follow(feed()).is_some());
        let early = produce(&mut src, &script[..script.len() / 2]);
        // The snapshot the receiver asked for is taken at some point of the stream.
        let snap = src.snapshot();
        let late = produce(&mut src, &script[script.len() / 2..]);
        // Deliveries: every batch (some lost, some twice), shuffled, the snapshot among them.
        let mut msgs: Vec<Option<FeedBatch>> = early.into_iter().chain(late).map(Some).collect();
        let dup: Vec<Option<FeedBatch>> = msgs.iter().step_by(3).cloned().collect();
        msgs.extend(dup);
        msgs.insert(usize::from(snapshot_at) % (msgs.len() + 1), None);
        for (i, &o) in order.iter().enumerate() {
            let n = msgs.len();
            msgs.swap(i % n, usize::from(o) % n);
        }
        for (i, m) in msgs.into_iter().enumerate() {
            if lose.get(i).copied().unwrap_or(false) {
                continue;
            }
            match m {
                None => rx.on_snapshot(&snap, &mut out),
                Some(b) => {
                    rx.on_batch(b, &mut out);
                }
            }
        }
        // Then the owner's head is announced until the receiver has everything (bounded).
        for _ in 0..4 {
            let Some(p) = rx.on_head(feed(), src.head()) else { break };
            if p.snapshot {
                rx.on_snapshot(&src.snapshot(), &mut out);
            } else {
                match src.since(p.after) {
                    Some(bs) => {
                        for b in bs {
                            rx.on_batch(b, &mut out);
                        }
                    }
                    None => rx.on_snapshot(&src.snapshot(), &mut out),
                }
            }
        }
        prop_assert!(rx.is_synced());
        prop_assert_eq!(rx.applied(), src.head());
        let want: BTreeMap<u64, u32> = src.snapshot().blocks.iter().map(|b| (b.key, b.copies)).collect();
        prop_assert_eq!(replay(&out), want);
    }

    #[test]
    fn feed_envelopes_round_trip_and_hostile_bytes_never_panic(
        script in prop::collection::vec((any::<bool>(), any::<u8>()), 1..40),
        garbage in prop::collection::vec(any::<u8>(), 0..2_000),
        cut in any::<usize>(),
    ) {
        let mut src = FeedOut::new(5, feed(), 1_000);
        let batches = produce(&mut src, &script);
        // Grouped by feed as they travel, the batches come back the same, in order.
        let grouped = FeedBatches::compact(batches.clone());
        prop_assert_eq!(grouped.len(), 1);
        let back: Vec<FeedBatch> = grouped.iter().cloned().flat_map(FeedBatches::batches).collect();
        prop_assert_eq!(&back, &batches);
        let mut deltas: Vec<Delta> = batches.into_iter().map(Delta::Feed).collect();
        deltas.extend(grouped.into_iter().map(Delta::FeedBatches));
        deltas.push(Delta::FeedSnapshot(src.snapshot()));
        let env = Envelope::V1(EnvelopeV1 { cluster_id: 3, from: NodeId(1), kind: kvmesh_state::EnvelopeKind::Live, sent_us: 1, deltas, control: vec![] });
        let bytes = encode(&env).expect("encode");
        prop_assert_eq!(Envelope::V1(decode(&bytes, 3).expect("decode")), env);
        prop_assert!(decode(&bytes[..cut % bytes.len()], 3).is_err());
        let _ = decode(&garbage, 3);
    }
}
