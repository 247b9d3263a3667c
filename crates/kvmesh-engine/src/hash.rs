//! The engine's private block hash and its output-token sampler.
//!
//! Like vLLM (whose default block hash is SHA-256 over a pickle, seeded per process), the hash
//! is keyed by a per-engine seed: a router cannot reproduce it and must rehash the token ids of
//! `BlockStored` events with its own function. Here: blake3 in keyed mode, the key derived from
//! the seed, over (parent hash or a root marker, the block's token ids, extra keys), truncated
//! to 64 bits like vLLM's integer event hashes.

/// Computes the engine's chained block hashes.
#[derive(Debug, Clone)]
pub(crate) struct BlockHasher {
    key: [u8; 32],
}

impl BlockHasher {
    /// A hasher keyed by `seed`.
    pub(crate) fn new(seed: u64) -> BlockHasher {
        BlockHasher {
            key: blake3::derive_key("kvmesh-engine block hash v1", &seed.to_le_bytes()),
        }
    }

    /// Hash of one full block: `parent` is the previous block's hash (`None` for the first
    /// block), `lora` is mixed into every block and `salt` only into the first (the caller
    /// passes it for block 0 only).
    pub(crate) fn hash_block(
        &self,
        parent: Option<u64>,
        tokens: &[u32],
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> u64 {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        match parent {
            Some(p) => {
                let mut b = [0u8; 9];
                b[0] = 1;
                b[1..].copy_from_slice(&p.to_le_bytes());
                h.update(&b);
            }
            None => {
                h.update(&[0u8]);
            }
        }
        let mut buf = [0u8; 256];
        for chunk in tokens.chunks(64) {
            for (i, t) in chunk.iter().enumerate() {
                buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        for (tag, v) in [(b'L', lora), (b'S', salt)] {
            if let Some(v) = v {
                h.update(&[tag]);
                h.update(&(v.len() as u64).to_le_bytes());
                h.update(v.as_bytes());
            }
        }
        let out = h.finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&out.as_bytes()[..8]);
        u64::from_le_bytes(b)
    }

    /// Hashes of the full blocks of `tokens` from block `from` on, appended to `out` (which
    /// must already hold the hashes of blocks `0..from`).
    pub(crate) fn extend_hashes(
        &self,
        out: &mut Vec<u64>,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&str>,
        salt: Option<&str>,
    ) {
        let full = tokens.len() / block_size;
        for i in out.len()..full {
            let parent = if i == 0 { None } else { Some(out[i - 1]) };
            let salt = if i == 0 { salt } else { None };
            let blk = &tokens[i * block_size..(i + 1) * block_size];
            out.push(self.hash_block(parent, blk, lora, salt));
        }
    }
}

/// SplitMix64 finaliser: a bijective, well-mixed 64-bit permutation.
pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The `index`-th output token of request `id` under `seed`: a pure function, so a request's
/// output does not depend on what else the engine is running, on preemptions or on aborts.
pub(crate) fn sample_token(seed: u64, id: u64, index: u32, vocab: &[u32]) -> u32 {
    let x = splitmix64(splitmix64(seed ^ 0x6b76_6d65_7368_0001) ^ id);
    let x = splitmix64(x ^ index as u64);
    if vocab.is_empty() {
        (x % 1000) as u32
    } else {
        vocab[(x % vocab.len() as u64) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_keyed_and_extra_keys_matter() {
        let a = BlockHasher::new(1);
        let b = BlockHasher::new(2);
        let t: Vec<u32> = (0..16).collect();
        let h = a.hash_block(None, &t, None, None);
        assert_eq!(h, a.hash_block(None, &t, None, None));
        assert_ne!(h, b.hash_block(None, &t, None, None));
        assert_ne!(h, a.hash_block(Some(0), &t, None, None));
        assert_ne!(h, a.hash_block(None, &t, Some("x"), None));
        assert_ne!(h, a.hash_block(None, &t, None, Some("x")));
        assert_ne!(
            a.hash_block(None, &t, Some("x"), None),
            a.hash_block(None, &t, None, Some("x"))
        );
        let mut v = Vec::new();
        let toks: Vec<u32> = (0..40).collect();
        a.extend_hashes(&mut v, &toks, 16, None, None);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0], h);
        assert_eq!(v[1], a.hash_block(Some(h), &toks[16..32], None, None));
    }

    #[test]
    fn sampling_is_pure_and_uses_the_vocab() {
        assert_eq!(sample_token(3, 4, 5, &[]), sample_token(3, 4, 5, &[]));
        assert!(sample_token(3, 4, 5, &[]) < 1000);
        assert_eq!(sample_token(3, 4, 5, &[7]), 7);
        let distinct: std::collections::BTreeSet<u32> =
            (0..100).map(|i| sample_token(0, 1, i, &[])).collect();
        assert!(distinct.len() > 80);
    }
}
