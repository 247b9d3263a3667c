//! The index against a naive model (maps and vectors, no cleverness) over random operation
//! sequences: lookups equal, capacities never exceeded, counts consistent, structure intact.
//! Marks arrive whole (a local decision) or as a peer sends them, naming only the top key of
//! each anchor window (covering marks).

use kvmesh_prefix::{
    BlockKey, EngineCounts, ExtraKeys, IndexOp, Match, PrefixIndex, block_keys, window_top,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy, Default)]
struct MEntry {
    count: u32,
    expiry: u64,
}

#[derive(Debug, Default)]
struct MEngine {
    cap: u32,
    /// Most recently used first.
    lru: Vec<u64>,
    map: HashMap<u64, MEntry>,
}

impl MEngine {
    fn touch(&mut self, k: u64) {
        let p = self.lru.iter().position(|&x| x == k).unwrap();
        self.lru.remove(p);
        self.lru.insert(0, k);
    }
    fn drop_key(&mut self, k: u64) {
        self.map.remove(&k);
        let p = self.lru.iter().position(|&x| x == k).unwrap();
        self.lru.remove(p);
    }
    fn create(&mut self, k: u64, e: MEntry) {
        if self.cap == 0 {
            return;
        }
        if self.lru.len() as u32 >= self.cap {
            let victim = self.lru.pop().unwrap();
            self.map.remove(&victim);
        }
        self.map.insert(k, e);
        self.lru.insert(0, k);
    }
    fn live(&self, k: u64, now: u64) -> bool {
        self.map
            .get(&k)
            .is_some_and(|e| e.count > 0 || e.expiry > now)
    }
    /// Leading blocks held: live entries, and the positions a live speculative entry later in
    /// their anchor window vouches for.
    fn held(&self, keys: &[BlockKey], now: u64) -> usize {
        let mut d = 0;
        while d < keys.len() {
            if self.live(keys[d].0, now) {
                d += 1;
                continue;
            }
            let top = window_top(d, keys.len()).unwrap();
            match (d + 1..=top).find(|&q| self.map.get(&keys[q].0).is_some_and(|e| e.expiry > now))
            {
                Some(q) => d = q + 1,
                None => break,
            }
        }
        d
    }
}

#[derive(Debug, Default)]
struct Model {
    engines: BTreeMap<u32, MEngine>,
}

impl Model {
    fn store(&mut self, eng: u32, k: u64) {
        let Some(m) = self.engines.get_mut(&eng) else {
            return;
        };
        if let Some(e) = m.map.get_mut(&k) {
            e.count += 1;
            m.touch(k);
        } else {
            m.create(
                k,
                MEntry {
                    count: 1,
                    expiry: 0,
                },
            );
        }
    }
    fn remove(&mut self, eng: u32, k: u64) {
        let Some(m) = self.engines.get_mut(&eng) else {
            return;
        };
        if let Some(e) = m.map.get_mut(&k)
            && e.count > 0
        {
            e.count -= 1;
            // The last copy goes with any mark: the engine said it holds the block no more.
            if e.count == 0 {
                m.drop_key(k);
            }
        }
    }
    fn spec(&mut self, eng: u32, keys: &[BlockKey], exp: u64, now: u64) {
        if exp <= now {
            return;
        }
        let Some(m) = self.engines.get_mut(&eng) else {
            return;
        };
        for k in keys.iter().rev() {
            if let Some(e) = m.map.get_mut(&k.0) {
                e.expiry = e.expiry.max(exp);
                m.touch(k.0);
            } else {
                m.create(
                    k.0,
                    MEntry {
                        count: 0,
                        expiry: exp,
                    },
                );
            }
        }
    }
    fn expire(&mut self, now: u64) {
        for m in self.engines.values_mut() {
            let mut gone = Vec::new();
            for (k, e) in m.map.iter_mut() {
                if e.expiry != 0 && e.expiry <= now {
                    e.expiry = 0;
                    if e.count == 0 {
                        gone.push(*k);
                    }
                }
            }
            for k in gone {
                m.drop_key(k);
            }
        }
    }
    fn lookup(&self, keys: &[BlockKey], min: usize, now: u64) -> Vec<Match> {
        let mut out = Vec::new();
        for (&id, m) in &self.engines {
            let d = m.held(keys, now);
            if d >= min.max(1) {
                out.push(Match {
                    engine: id,
                    blocks: d as u32,
                });
            }
        }
        out
    }
    fn counts(&self, eng: u32) -> Option<EngineCounts> {
        self.engines.get(&eng).map(|m| EngineCounts {
            entries: m.map.len() as u32,
            confirmed: m.map.values().filter(|e| e.count > 0).count() as u32,
            speculative: m.map.values().filter(|e| e.expiry != 0).count() as u32,
            capacity: m.cap,
        })
    }
}

#[derive(Debug, Clone)]
enum Op {
    Add(u32, u32),
    RemoveEngine(u32),
    Clear(u32),
    /// Store blocks `..depth` of a chain (tail first, as the ingestion emits them).
    Store(u32, usize, usize),
    Remove(u32, usize, usize),
    Spec(u32, usize, usize, u64),
    /// A peer's mark of blocks `from..depth`: the top key of each window they touch.
    Covering(u32, usize, usize, usize, u64),
    Advance(u64),
    Expire,
    Lookup(usize, usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let e = 0u32..6;
    let c = 0usize..CHAINS;
    let d = 1usize..=BLOCKS;
    prop_oneof![
        1 => (e.clone(), 0u32..40).prop_map(|(e, cap)| Op::Add(e, cap)),
        1 => e.clone().prop_map(Op::RemoveEngine),
        1 => e.clone().prop_map(Op::Clear),
        8 => (e.clone(), c.clone(), d.clone()).prop_map(|(e, c, d)| Op::Store(e, c, d)),
        5 => (e.clone(), c.clone(), d.clone()).prop_map(|(e, c, d)| Op::Remove(e, c, d)),
        5 => (e.clone(), c.clone(), d.clone(), 1u64..12).prop_map(|(e, c, d, t)| Op::Spec(e, c, d, t)),
        5 => (e, c.clone(), 0usize..BLOCKS, d.clone(), 1u64..12)
            .prop_map(|(e, c, f, d, t)| Op::Covering(e, c, f.min(d - 1), d, t)),
        3 => (0u64..6).prop_map(Op::Advance),
        2 => Just(Op::Expire),
        6 => (c, d, 1usize..20).prop_map(|(c, d, m)| Op::Lookup(c, d, m)),
    ]
}

const CHAINS: usize = 10;
const BLOCKS: usize = 20;

/// Chains of keys with many shared prefixes: tokens over a 2-letter alphabet, block size 2.
fn chains(seed: u64) -> Vec<Vec<BlockKey>> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out: Vec<Vec<u32>> = Vec::new();
    for i in 0..CHAINS {
        // Start from an earlier chain's prefix half the time.
        let mut toks: Vec<u32> = if i > 0 && next() % 2 == 0 {
            let base = &out[(next() % i as u64) as usize];
            base[..(next() as usize % base.len()) & !1].to_vec()
        } else {
            Vec::new()
        };
        while toks.len() < BLOCKS * 2 {
            toks.push((next() % 2) as u32);
        }
        out.push(toks);
    }
    out.iter()
        .map(|t| {
            let mut k = Vec::new();
            block_keys(t, 2, ExtraKeys::NONE, &mut k);
            k
        })
        .collect()
}

fn run(seed: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let chains = chains(seed);
    let mut idx = PrefixIndex::new();
    let mut model = Model::default();
    let mut now = 1u64;
    let mut out = Vec::new();
    for op in ops {
        match op {
            Op::Add(e, cap) => {
                idx.add_engine(*e, *cap).unwrap();
                let m = model.engines.entry(*e).or_default();
                m.cap = *cap;
                while m.lru.len() as u32 > *cap {
                    let v = m.lru.pop().unwrap();
                    m.map.remove(&v);
                }
            }
            Op::RemoveEngine(e) => {
                idx.remove_engine(*e);
                model.engines.remove(e);
            }
            Op::Clear(e) => {
                idx.apply(*e, IndexOp::Cleared);
                if let Some(m) = model.engines.get_mut(e) {
                    m.map.clear();
                    m.lru.clear();
                }
            }
            Op::Store(e, c, d) => {
                for k in chains[*c][..*d].iter().rev() {
                    idx.apply(*e, IndexOp::Stored(*k));
                    model.store(*e, k.0);
                }
            }
            Op::Remove(e, c, d) => {
                for k in &chains[*c][..*d] {
                    idx.apply(*e, IndexOp::Removed(*k));
                    model.remove(*e, k.0);
                }
            }
            Op::Spec(e, c, d, ttl) => {
                idx.insert_speculative(*e, &chains[*c][..*d], now + ttl, now);
                model.spec(*e, &chains[*c][..*d], now + ttl, now);
            }
            Op::Covering(e, c, f, d, ttl) => {
                let chain = &chains[*c][..*d];
                let mut keys: Vec<BlockKey> = (*f..*d)
                    .map(|i| chain[window_top(i, chain.len()).unwrap()])
                    .collect();
                keys.dedup();
                idx.insert_speculative(*e, &keys, now + ttl, now);
                model.spec(*e, &keys, now + ttl, now);
            }
            Op::Advance(dt) => now += dt,
            Op::Expire => {
                idx.expire(now);
                model.expire(now);
            }
            Op::Lookup(c, d, m) => {
                let keys = &chains[*c][..*d];
                idx.lookup_min(keys, *m, now, &mut out);
                prop_assert_eq!(&out, &model.lookup(keys, *m, now), "min {}", m);
                for (&e, me) in &model.engines {
                    prop_assert_eq!(idx.held_prefix(e, keys, now) as usize, me.held(keys, now));
                }
            }
        }
        if let Err(e) = idx.check_invariants() {
            return Err(TestCaseError::fail(format!("after {op:?}: {e}")));
        }
        for e in 0..6 {
            prop_assert_eq!(idx.engine_counts(e), model.counts(e), "engine {}", e);
            if let Some(c) = idx.engine_counts(e) {
                prop_assert!(c.entries <= c.capacity);
            }
        }
        let total: usize = model.engines.values().map(|m| m.map.len()).sum();
        prop_assert_eq!(idx.len(), total);
    }
    // Every chain prefix, every minimum, at the end.
    for c in &chains {
        for d in 1..=c.len() {
            for m in [1, 8, 9, 17] {
                idx.lookup_min(&c[..d], m, now, &mut out);
                prop_assert_eq!(&out, &model.lookup(&c[..d], m, now));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_naive_model(seed in any::<u64>(), ops in prop::collection::vec(op(), 1..250)) {
        run(seed, &ops)?;
    }
}

#[test]
fn duplicate_copies_are_counted() {
    let mut keys = Vec::new();
    block_keys(&[1, 2, 3, 4, 5, 6], 2, ExtraKeys::NONE, &mut keys);
    let mut idx = PrefixIndex::new();
    idx.add_engine(0, 100).unwrap();
    let mut out = Vec::new();
    for k in keys.iter().rev() {
        idx.store(0, *k);
    }
    // The last block is cached twice (vLLM does not de-duplicate).
    idx.store(0, keys[2]);
    assert!(idx.remove(0, keys[2]));
    idx.lookup(&keys, 0, &mut out);
    assert_eq!(
        out,
        vec![Match {
            engine: 0,
            blocks: 3
        }]
    );
    assert!(idx.remove(0, keys[2]));
    assert!(!idx.remove(0, keys[2]), "no copy left");
    idx.lookup(&keys, 0, &mut out);
    assert_eq!(
        out,
        vec![Match {
            engine: 0,
            blocks: 2
        }]
    );
    idx.check_invariants().unwrap();
}

#[test]
fn an_evicted_block_takes_its_mark_with_it_and_a_restart_takes_only_marks() {
    let mut keys = Vec::new();
    block_keys(&[1, 2, 3, 4, 5, 6, 7, 8], 2, ExtraKeys::NONE, &mut keys);
    let mut idx = PrefixIndex::new();
    idx.add_engine(0, 100).unwrap();
    // A decision marks the 4 blocks for 2 s; the engine computes them (its events), then
    // evicts the last two.
    idx.insert_speculative(0, &keys, 2_000_000, 0);
    for k in &keys {
        idx.store(0, *k);
    }
    assert!(idx.remove(0, keys[3]));
    assert!(idx.remove(0, keys[2]));
    assert_eq!(idx.held_prefix(0, &keys, 1_000), 2, "not the mark's 4");
    assert!(!idx.holds(0, keys[2], 1_000));
    // A mark alone stays through a removal it has no copy for.
    idx.insert_speculative(0, &keys, 3_000_000, 1_000);
    assert!(!idx.remove(0, keys[3]), "no copy of it");
    assert!(idx.holds(0, keys[3], 2_000));
    idx.check_invariants().unwrap();
    // The engine restarted: marks go, confirmed copies stay for its events to clear.
    idx.clear_marks(0);
    assert_eq!(idx.held_prefix(0, &keys, 2_000), 2);
    assert!(!idx.holds(0, keys[3], 2_000));
    assert_eq!(idx.stats().speculative, 0);
    assert_eq!(idx.stats().confirmed, 2);
    idx.check_invariants().unwrap();
    // A refused request's decision is taken back: its marks (by their expiry), not a later
    // decision's, nor the confirmed copies.
    idx.insert_speculative(0, &keys, 5_000_000, 2_000);
    idx.insert_speculative(0, &keys[..1], 7_000_000, 2_500);
    idx.unmark(0, &keys, 5_000_000);
    assert!(idx.holds(0, keys[0], 3_000), "a later mark and a copy");
    assert!(idx.holds(0, keys[1], 3_000), "a confirmed copy");
    assert!(!idx.holds(0, keys[2], 3_000) && !idx.holds(0, keys[3], 3_000));
    assert_eq!(idx.stats().speculative, 1);
    idx.check_invariants().unwrap();
}

#[test]
fn speculative_entries_expire_and_join_by_max() {
    let mut keys = Vec::new();
    block_keys(&[7; 40], 4, ExtraKeys::NONE, &mut keys);
    let mut idx = PrefixIndex::new();
    idx.add_engine(3, 100).unwrap();
    let mut out = Vec::new();
    idx.insert_speculative(3, &keys[..4], 2_000, 1_000);
    idx.insert_speculative(3, &keys[..2], 1_500, 1_000); // max: stays 2_000
    idx.insert_speculative(3, &keys, 500, 1_000); // already expired: no-op
    assert_eq!(idx.len(), 4);
    idx.lookup(&keys, 1_999, &mut out);
    assert_eq!(
        out,
        vec![Match {
            engine: 3,
            blocks: 4
        }]
    );
    // Expired entries never match, swept or not.
    idx.lookup(&keys, 2_000, &mut out);
    assert!(out.is_empty());
    // A confirmed copy survives the sweep of its speculative mark.
    idx.store(3, keys[0]);
    assert_eq!(idx.expire(2_000), 3);
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.stats().speculative, 0);
    idx.lookup(&keys, 5_000, &mut out);
    assert_eq!(
        out,
        vec![Match {
            engine: 3,
            blocks: 1
        }]
    );
    idx.check_invariants().unwrap();
}

#[test]
fn capacity_evicts_deepest_blocks_first() {
    let mut keys = Vec::new();
    block_keys(
        &(0..40).collect::<Vec<u32>>(),
        4,
        ExtraKeys::NONE,
        &mut keys,
    );
    let mut idx = PrefixIndex::new();
    idx.add_engine(1, 6).unwrap();
    idx.insert_speculative(1, &keys, 10, 0);
    assert_eq!(idx.engine_counts(1).unwrap().entries, 6);
    assert_eq!(idx.stats().evicted, 4);
    let mut out = Vec::new();
    idx.lookup(&keys, 0, &mut out);
    assert_eq!(
        out,
        vec![Match {
            engine: 1,
            blocks: 6
        }]
    );
    idx.set_capacity(1, 2);
    idx.lookup(&keys, 0, &mut out);
    assert_eq!(
        out,
        vec![Match {
            engine: 1,
            blocks: 2
        }]
    );
    assert!(idx.add_engine(kvmesh_prefix::MAX_ENGINES, 1).is_err());
    idx.check_invariants().unwrap();
}
