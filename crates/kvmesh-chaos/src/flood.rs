//! Garbage at a mesh port: random datagrams of every size and datagrams shaped like QUIC
//! Initial packets (long header, version 1, connection ids, padded to 1200 bytes) whose
//! contents are random — the decoder and the handshake path must drop them and keep serving
//! the router's peers. Bounded in count; paced so the kernel's socket buffer is not the only
//! thing exercised.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::Duration;

/// xorshift64*: the flood's bytes are reproducible from `seed`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Datagram `k` of the flood: every fourth QUIC-Initial-shaped, the others random bytes of
/// 1..=1400 bytes.
pub fn datagram(rng_seed: u64, k: u32, out: &mut Vec<u8>) {
    let mut rng = Rng(rng_seed ^ (u64::from(k) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    out.clear();
    let len = if k % 4 == 0 {
        1200
    } else {
        1 + (rng.next() % 1400) as usize
    };
    while out.len() < len {
        out.extend_from_slice(&rng.next().to_le_bytes());
    }
    out.truncate(len);
    if k % 4 == 0 {
        // Long header, Initial, version 1, 8-byte DCID and SCID, no token, a length.
        out[0] = 0xC3;
        out[1..5].copy_from_slice(&1u32.to_be_bytes());
        out[5] = 8;
        out[14] = 8;
        out[23] = 0;
        out[24] = 0x44;
        out[25] = 0x9A;
    }
}

/// Sends `count` garbage datagrams from `from` to `target`; returns how many were sent.
pub fn flood(target: SocketAddr, from: IpAddr, count: u32, seed: u64) -> Result<u32, String> {
    let sock = UdpSocket::bind((from, 0)).map_err(|e| format!("flood socket: {e}"))?;
    let mut buf = Vec::with_capacity(1400);
    let mut sent = 0;
    for k in 0..count {
        if crate::aborted() {
            break;
        }
        datagram(seed, k, &mut buf);
        if sock.send_to(&buf, target).is_ok() {
            sent += 1;
        }
        if k % 200 == 199 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_are_reproducible_and_every_fourth_looks_like_a_quic_initial() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for k in 0..64 {
            datagram(7, k, &mut a);
            datagram(7, k, &mut b);
            assert_eq!(a, b);
            assert!((1..=1400).contains(&a.len()));
            if k % 4 == 0 {
                assert_eq!((a.len(), a[0], &a[1..5]), (1200, 0xC3, &[0, 0, 0, 1][..]));
            }
        }
        datagram(8, 1, &mut b);
        datagram(7, 1, &mut a);
        assert_ne!(a, b);
    }
}
