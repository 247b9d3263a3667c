//! Seeded randomness and stable hashing, with no dependency and no global state.
//!
//! Everything random in this crate is drawn from an [`Rng`] built from a seed the caller passes
//! in, so the same seeds always give the same decisions. Hashes ([`stable_hash`], [`mix64`]) are
//! fixed functions: they give the same value on every platform and in every version of this
//! crate, which the consistent-hash ring relies on (two routers must agree on where a key goes).

/// The golden-ratio increment of SplitMix64.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// A small, fast, seeded pseudo-random generator (SplitMix64).
///
/// Not cryptographic. One `u64` of state, so a fresh one per request costs nothing:
/// `Rng::new(request_seed)`.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator whose whole sequence is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// A uniform index in `0..n` (`n` must be at least 1; returns 0 for `n == 0`).
    ///
    /// Lemire's multiply-high reduction: the bias is at most `n / 2^64`, negligible here.
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// A uniform `f64` in `[0, 1)`.
    #[inline]
    pub fn unit(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }
}

/// The SplitMix64 finaliser: a bijective mix of 64 bits (good avalanche, fixed forever).
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Maps 64 random bits to a uniform `f64` in `[0, 1)`.
#[inline]
pub fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A stable 64-bit hash of bytes: FNV-1a followed by [`mix64`].
///
/// Use it for the consistent-hash key (the value of the `x-session-id` header or the OpenAI
/// `user` field) and for an engine's identity (its URL), so that every router, on every
/// platform and version, maps the same key to the same place on the ring.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    mix64(h ^ bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_below_in_range() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            let i = a.below(13);
            assert!(i < 13);
            b.below(13);
            let u = a.unit();
            assert!((0.0..1.0).contains(&u));
            b.unit();
        }
        assert_eq!(Rng::new(1).below(0), 0);
    }

    #[test]
    fn below_is_roughly_uniform() {
        let mut r = Rng::new(42);
        let mut counts = [0u32; 10];
        for _ in 0..100_000 {
            counts[r.below(10)] += 1;
        }
        for c in counts {
            assert!((9_500..10_500).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn stable_hash_is_fixed() {
        // Pinned values: changing the hash would move every session to another engine.
        assert_eq!(stable_hash(b""), stable_hash(b""));
        assert_ne!(stable_hash(b"a"), stable_hash(b"b"));
        assert_ne!(stable_hash(b"ab"), stable_hash(b"ba"));
        assert_eq!(stable_hash(b"x-session-id"), 3_209_820_637_447_548_635);
    }
}
