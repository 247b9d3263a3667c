//! Block keys: a blake3 chain over token ids and extra keys, computed by the router from the
//! prompt's tokens and by the ingestion from `BlockStored.token_ids`, so the engine's own hash
//! (seeded per process) never matters.
//!
//! # Byte layout (version 1)
//!
//! One block costs one blake3 compression per 64 bytes of tokens (one for 16-token blocks):
//! the chain and the extra keys go into the 32-byte **key** of blake3's keyed mode (its
//! initial chaining value, free), the tokens into the input.
//!
//! ```text
//! digest = blake3::keyed_hash(K, tokens as u32 little-endian, concatenated)
//! K[0..8]   = parent key (BlockKey value) little-endian; zeros for the first block
//! K[8]      = layout version 0x01
//! K[9]      = flags: bit 0 = has a parent, bit 1 = has extra keys
//! K[10..16] = zeros
//! K[16..32] = first 16 bytes of blake3(extras) when there are extra keys, else zeros
//! extras    = [b'L', u32 LE length, LoRA name UTF-8]      (every block, if a LoRA)
//!           ‖ [b'S', u32 LE length, cache salt UTF-8]     (first block only, if a salt)
//!           ‖ [b'X', 32-byte digest of opaque extra keys] (ingestion only, see below)
//! key       = u64::from_le_bytes(digest[0..8]) with bit 0 := anchor flag
//! ```
//!
//! The input length (hence the block size) is bound by blake3 itself. The anchor flag is 1
//! when the block's position in its chain is a multiple of [`ANCHOR_STRIDE`] (the first block
//! always is); the index keeps posting lists (which engines hold a key) for anchor keys only,
//! see [`crate::PrefixIndex`]. Opaque extras are extra keys of a `BlockStored` the router
//! cannot compute from token ids (multimodal identifiers...): mixing their digest in makes
//! such blocks unreachable from router-computed keys, never falsely matched.
//!
//! # Collisions
//!
//! Keys keep 63 bits of the digest. A lookup probes (engine, key) pairs; a probe falsely
//! succeeds when that engine holds another block whose key has the same 63 bits: probability
//! `N_e / 2^63` for an engine holding `N_e` blocks, 1.8e-15 at 16k blocks. A router doing
//! 10^4 lookups/s of 500 blocks makes 1.6e14 probes a year: ~0.3 false single-block matches a
//! year. A false match extends a real match by one block (the next key chains from ours, not
//! from the colliding block), and costs at worst one suboptimal routing decision: the engine
//! checks its own hash, outputs are never affected. Index-wide birthday collisions between
//! unrelated blocks (`N² / 2^64`, 6e-8 at 2^20 blocks) have the same harmless effect. 64-bit
//! keys halve the index memory against 128-bit ones; vLLM itself publishes 64-bit integer
//! hashes. An adversary can find a 63-bit collision with ~2^32 work, which buys nothing but
//! misrouting its own request.

/// Tokens are grouped into blocks whose position is a multiple of this stride ("anchors");
/// the index keeps a posting list per anchor key. Lookups asking for at least `m` blocks start
/// at the last anchor before `m`, skipping engines that share only a shorter prefix.
pub const ANCHOR_STRIDE: usize = 8;

/// The top of chain position `i`'s anchor window in a chain of `len` keys: the next anchor
/// position at or after `i`, or the chain's last position when the chain ends first; `None`
/// when `i` is past the chain. A speculative entry at a window's top vouches for the window's
/// earlier positions (see [`crate::PrefixIndex::held_prefix`]).
#[inline]
pub fn window_top(i: usize, len: usize) -> Option<usize> {
    if i >= len {
        return None;
    }
    Some(i.next_multiple_of(ANCHOR_STRIDE).min(len - 1))
}

/// Version byte at the start of the hashed layout (see the module docs).
pub const KEY_LAYOUT_VERSION: u8 = 1;

/// The router's identity of one full KV block: a 64-bit value derived from the blake3 chain
/// (63 bits of digest + the anchor flag in bit 0). Stable across processes and platforms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockKey(pub u64);

impl BlockKey {
    /// True when the block's chain position is a multiple of [`ANCHOR_STRIDE`].
    #[inline]
    pub fn is_anchor(self) -> bool {
        self.0 & 1 == 1
    }

    /// Builds the key of a block at `position` from a 64-bit digest value.
    #[inline]
    pub fn from_digest(digest_u64: u64, position: usize) -> BlockKey {
        BlockKey((digest_u64 & !1) | u64::from(position.is_multiple_of(ANCHOR_STRIDE)))
    }
}

/// Extra keys mixed into the block keys, as vLLM mixes them into its block hashes: the LoRA
/// adapter name into every block, the cache salt into the first block only (which isolates the
/// whole chain).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtraKeys<'a> {
    /// LoRA adapter name (the model name the request targets when it is an adapter).
    pub lora_name: Option<&'a str>,
    /// vLLM `cache_salt`.
    pub cache_salt: Option<&'a str>,
}

impl<'a> ExtraKeys<'a> {
    /// No LoRA, no salt.
    pub const NONE: ExtraKeys<'static> = ExtraKeys {
        lora_name: None,
        cache_salt: None,
    };

    /// Extra keys with a LoRA name.
    pub fn lora(name: &'a str) -> Self {
        ExtraKeys {
            lora_name: Some(name),
            cache_salt: None,
        }
    }

    /// Extra keys with a cache salt.
    pub fn salt(salt: &'a str) -> Self {
        ExtraKeys {
            lora_name: None,
            cache_salt: Some(salt),
        }
    }
}

/// The first 16 bytes of the digest of the extra keys of one block (`None` when none).
fn extras_digest(
    lora: Option<&str>,
    salt: Option<&str>,
    opaque: Option<&[u8; 32]>,
) -> Option<[u8; 16]> {
    if lora.is_none() && salt.is_none() && opaque.is_none() {
        return None;
    }
    let mut h = blake3::Hasher::new();
    for (tag, v) in [(b'L', lora), (b'S', salt)] {
        if let Some(v) = v {
            h.update(&[tag]);
            h.update(&(v.len() as u32).to_le_bytes());
            h.update(v.as_bytes());
        }
    }
    if let Some(d) = opaque {
        h.update(b"X");
        h.update(d);
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    Some(out)
}

/// The blake3 key of a block: its parent and its extra keys (see the module docs).
#[inline]
fn chain_key(parent: Option<BlockKey>, extras: Option<&[u8; 16]>) -> [u8; 32] {
    let mut k = [0u8; 32];
    if let Some(p) = parent {
        k[..8].copy_from_slice(&p.0.to_le_bytes());
    }
    k[8] = KEY_LAYOUT_VERSION;
    k[9] = u8::from(parent.is_some()) | (u8::from(extras.is_some()) << 1);
    if let Some(e) = extras {
        k[16..].copy_from_slice(e);
    }
    k
}

/// blake3 keyed hash of the tokens (u32 little-endian), first 8 bytes as a u64.
#[inline]
fn hash_tokens(key: &[u8; 32], tokens: &[u32]) -> u64 {
    let digest = if tokens.len() <= 64 {
        let mut buf = [0u8; 256];
        for (i, t) in tokens.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        blake3::keyed_hash(key, &buf[..tokens.len() * 4])
    } else {
        let mut h = blake3::Hasher::new_keyed(key);
        let mut buf = [0u8; 1024];
        for chunk in tokens.chunks(256) {
            for (i, t) in chunk.iter().enumerate() {
                buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        h.finalize()
    };
    u64::from_le_bytes(digest.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// The key of one full block.
///
/// `parent` is the previous block's key (`None` for the first block of a prompt), `position`
/// the block's index in its chain (0 for the first; it only sets the anchor flag), `tokens`
/// the block's token ids. The salt in `extra` is used only when `parent` is `None`. `opaque`
/// is a digest of engine extra keys the router cannot reproduce (multimodal hashes...): the
/// ingestion passes it so such blocks never match a router-computed key.
pub fn block_key_with(
    parent: Option<BlockKey>,
    position: usize,
    tokens: &[u32],
    extra: ExtraKeys<'_>,
    opaque: Option<&[u8; 32]>,
) -> BlockKey {
    let salt = if parent.is_none() {
        extra.cache_salt
    } else {
        None
    };
    let extras = extras_digest(extra.lora_name, salt, opaque);
    let k = chain_key(parent, extras.as_ref());
    BlockKey::from_digest(hash_tokens(&k, tokens), position)
}

/// The key of one full block (no opaque extras); see [`block_key_with`].
#[inline]
pub fn block_key(
    parent: Option<BlockKey>,
    position: usize,
    tokens: &[u32],
    extra: ExtraKeys<'_>,
) -> BlockKey {
    block_key_with(parent, position, tokens, extra, None)
}

/// The keys of the full blocks of `tokens` (a trailing partial block has no key), written to
/// `out` (cleared first). `block_size` must be at least 1.
pub fn block_keys(
    tokens: &[u32],
    block_size: usize,
    extra: ExtraKeys<'_>,
    out: &mut Vec<BlockKey>,
) {
    out.clear();
    extend_block_keys(tokens, block_size, extra, out);
}

/// Incremental form: `out` already holds the keys of the first `out.len()` blocks of `tokens`
/// (e.g. the previous turn of a conversation, whose tokens are a prefix of this one); the keys
/// of the remaining full blocks are appended. Costs only the new blocks.
///
/// # Panics
/// When `block_size` is 0.
pub fn extend_block_keys(
    tokens: &[u32],
    block_size: usize,
    extra: ExtraKeys<'_>,
    out: &mut Vec<BlockKey>,
) {
    assert!(block_size >= 1, "block_size must be at least 1");
    let full = tokens.len() / block_size;
    if out.len() >= full {
        out.truncate(full);
        return;
    }
    out.reserve(full - out.len());
    // The extras digest is the same for every block but the first (which adds the salt).
    let later = extras_digest(extra.lora_name, None, None);
    for i in out.len()..full {
        let blk = &tokens[i * block_size..(i + 1) * block_size];
        let key = match out.last() {
            None => block_key(None, 0, blk, extra),
            Some(&p) => {
                BlockKey::from_digest(hash_tokens(&chain_key(Some(p), later.as_ref()), blk), i)
            }
        };
        out.push(key);
    }
}

/// The number of leading blocks of a `prompt_len`-token prompt that an engine can serve from
/// its prefix cache: vLLM always computes the last prompt token (it needs its logits), so a
/// block-aligned prompt's last block is never a hit. Pass `&keys[..max_hit_blocks(..)]` to a
/// lookup to predict the engine's hit count exactly.
#[inline]
pub fn max_hit_blocks(prompt_len: usize, block_size: usize) -> usize {
    if prompt_len == 0 || block_size == 0 {
        0
    } else {
        (prompt_len - 1) / block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_and_extras_change_keys() {
        let t: Vec<u32> = (0..16).collect();
        let k = block_key(None, 0, &t, ExtraKeys::NONE);
        assert!(k.is_anchor());
        assert_eq!(k, block_key(None, 0, &t, ExtraKeys::NONE));
        assert_ne!(k, block_key(Some(k), 1, &t, ExtraKeys::NONE));
        assert_ne!(k, block_key(None, 0, &t, ExtraKeys::lora("a")));
        assert_ne!(k, block_key(None, 0, &t, ExtraKeys::salt("a")));
        // Salt is ignored past the first block; LoRA is not.
        assert_eq!(
            block_key(Some(k), 1, &t, ExtraKeys::salt("a")),
            block_key(Some(k), 1, &t, ExtraKeys::NONE)
        );
        assert!(!block_key(Some(k), 1, &t, ExtraKeys::NONE).is_anchor());
        assert!(block_key(Some(k), 8, &t, ExtraKeys::NONE).is_anchor());
    }

    #[test]
    fn incremental_equals_full_and_truncates() {
        let toks: Vec<u32> = (0..1000).map(|i| i * 7 % 31).collect();
        let mut full = Vec::new();
        block_keys(&toks, 16, ExtraKeys::lora("x"), &mut full);
        assert_eq!(full.len(), 62);
        let mut inc = Vec::new();
        block_keys(&toks[..100], 16, ExtraKeys::lora("x"), &mut inc);
        extend_block_keys(&toks, 16, ExtraKeys::lora("x"), &mut inc);
        assert_eq!(inc, full);
        extend_block_keys(&toks[..40], 16, ExtraKeys::lora("x"), &mut inc);
        assert_eq!(inc, full[..2]);
        // Blocks over 64 tokens go through the incremental hasher: same digest.
        let big: Vec<u32> = (0..3000).collect();
        let a = block_key(None, 0, &big, ExtraKeys::NONE);
        let bytes: Vec<u8> = big.iter().flat_map(|t| t.to_le_bytes()).collect();
        let d = blake3::keyed_hash(&chain_key(None, None), &bytes);
        let v = u64::from_le_bytes(d.as_bytes()[..8].try_into().unwrap());
        assert_eq!(a, BlockKey::from_digest(v, 0));
    }

    #[test]
    fn hit_blocks_cap() {
        assert_eq!(max_hit_blocks(0, 16), 0);
        assert_eq!(max_hit_blocks(16, 16), 0);
        assert_eq!(max_hit_blocks(17, 16), 1);
        assert_eq!(max_hit_blocks(32, 16), 1);
        assert_eq!(max_hit_blocks(33, 16), 2);
    }
}
