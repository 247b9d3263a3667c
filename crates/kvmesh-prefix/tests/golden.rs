//! Golden block keys. Each key is recomputed here from the byte layout documented in
//! `src/keys.rs` with the `blake3` crate directly, and pinned as a literal: a change of layout,
//! of the anchor flag or of the hash breaks this test (and every index in a mixed-version mesh).

use kvmesh_prefix::{BlockKey, ExtraKeys, block_key, block_keys, extend_block_keys};

/// The documented layout, written out byte by byte.
fn manual(
    parent: Option<u64>,
    position: usize,
    tokens: &[u32],
    lora: Option<&str>,
    salt: Option<&str>,
) -> u64 {
    let salt = if parent.is_none() { salt } else { None };
    let mut extras: Vec<u8> = Vec::new();
    if let Some(l) = lora {
        extras.push(b'L');
        extras.extend_from_slice(&(l.len() as u32).to_le_bytes());
        extras.extend_from_slice(l.as_bytes());
    }
    if let Some(s) = salt {
        extras.push(b'S');
        extras.extend_from_slice(&(s.len() as u32).to_le_bytes());
        extras.extend_from_slice(s.as_bytes());
    }
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&parent.unwrap_or(0).to_le_bytes());
    key[8] = 0x01; // layout version
    key[9] = u8::from(parent.is_some()) | (u8::from(!extras.is_empty()) << 1);
    if !extras.is_empty() {
        key[16..].copy_from_slice(&blake3::hash(&extras).as_bytes()[..16]);
    }
    let input: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let d = blake3::keyed_hash(&key, &input);
    let v = u64::from_le_bytes(d.as_bytes()[..8].try_into().unwrap());
    (v & !1) | u64::from(position.is_multiple_of(8))
}

#[test]
fn keys_follow_the_documented_layout_and_are_pinned() {
    let t0: Vec<u32> = (0..16).collect();
    let t1: Vec<u32> = (16..32).collect();
    let big: Vec<u32> = (0..100).map(|i| 151_643 + i).collect();

    let k0 = block_key(None, 0, &t0, ExtraKeys::NONE);
    assert_eq!(k0.0, manual(None, 0, &t0, None, None));
    let k1 = block_key(Some(k0), 1, &t1, ExtraKeys::NONE);
    assert_eq!(k1.0, manual(Some(k0.0), 1, &t1, None, None));
    let both = ExtraKeys {
        lora_name: Some("sql-adapter"),
        cache_salt: Some("tenant-a"),
    };
    let k2 = block_key(None, 0, &t0, both);
    assert_eq!(
        k2.0,
        manual(None, 0, &t0, Some("sql-adapter"), Some("tenant-a"))
    );
    // Salt only on the first block, LoRA on every block.
    let k3 = block_key(Some(k2), 8, &t1, both);
    assert_eq!(k3.0, manual(Some(k2.0), 8, &t1, Some("sql-adapter"), None));
    let k4 = block_key(None, 0, &big, ExtraKeys::salt("s"));
    assert_eq!(k4.0, manual(None, 0, &big, None, Some("s")));
    let k5 = block_key(None, 0, &[42], ExtraKeys::NONE);
    assert_eq!(k5.0, manual(None, 0, &[42], None, None));

    let got = [k0.0, k1.0, k2.0, k3.0, k4.0, k5.0];
    let pinned: [u64; 6] = PINNED;
    if got != pinned {
        panic!("block keys changed: {got:#018x?}");
    }
    assert!(k0.is_anchor() && !k1.is_anchor() && k3.is_anchor());
}

const PINNED: [u64; 6] = [
    0x67ee_70ff_3a4e_c0b1,
    0xe727_ce52_c5a9_4288,
    0x5e90_b53d_e30e_cb1d,
    0x123b_ceb1_805a_d515,
    0x8b49_3898_48e0_8e6f,
    0xc14a_e79f_bb59_95a1,
];

#[test]
fn chains_for_any_block_size_and_incremental_reuse() {
    let toks: Vec<u32> = (0..100).map(|i| (i * 37 + 11) % 1000).collect();
    for bs in [1usize, 3, 16, 64, 100, 101] {
        let mut keys = Vec::new();
        block_keys(&toks, bs, ExtraKeys::lora("l"), &mut keys);
        assert_eq!(keys.len(), toks.len() / bs, "only full blocks");
        let mut parent = None;
        for (i, k) in keys.iter().enumerate() {
            let m = manual(
                parent.map(|p: BlockKey| p.0),
                i,
                &toks[i * bs..(i + 1) * bs],
                Some("l"),
                None,
            );
            assert_eq!(k.0, m, "bs {bs} block {i}");
            parent = Some(*k);
        }
        // Multi-turn: the previous turn's keys are extended, not recomputed.
        let mut inc = Vec::new();
        block_keys(&toks[..toks.len() / 2], bs, ExtraKeys::lora("l"), &mut inc);
        extend_block_keys(&toks, bs, ExtraKeys::lora("l"), &mut inc);
        assert_eq!(inc, keys);
    }
}
