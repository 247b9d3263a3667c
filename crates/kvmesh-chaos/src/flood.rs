//! Garbage at a mesh port: random datagrams of every size and datagrams shaped like QUIC
//! Initial packets (long header, version 1, connection ids, padded to 1200 bytes) whose
//! contents are random — the decoder and the handshake path must drop them and keep serving
//! the router's peers; and half-open handshakes: real QUIC clients (the cluster's ALPN) whose
//! Initials reach the router through a black hole that never returns its answers, so every
//! connection waits on the router's side until its handshake times out. Bounded in count;
//! paced so the kernel's socket buffer is not the only thing exercised.

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
    let len = if k.is_multiple_of(4) {
        1200
    } else {
        1 + (rng.next() % 1400) as usize
    };
    while out.len() < len {
        out.extend_from_slice(&rng.next().to_le_bytes());
    }
    out.truncate(len);
    if k.is_multiple_of(4) {
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

/// Opens `count` half-open QUIC handshakes from `from` to `target` (a router of the mesh
/// named `cluster`): the client's packets are relayed for `hold`, the router's answers
/// dropped. Returns how many were started and how many datagrams the router answered with
/// (each dropped: proof that it took them up).
pub fn half_open(
    target: SocketAddr,
    from: IpAddr,
    cluster: &str,
    count: u32,
    hold: Duration,
) -> Result<(u32, u64), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let e = |x: &dyn std::fmt::Display| format!("half-open handshakes: {x}");
        let hole = tokio::net::UdpSocket::bind((from, 0))
            .await
            .map_err(|x| e(&x))?;
        let hole_addr = hole.local_addr().map_err(|x| e(&x))?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|x| e(&x))?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        tls.alpn_protocols = vec![kvmesh_mesh::transport::alpn(
            kvmesh_mesh::transport::cluster_id(cluster),
        )];
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|x| e(&x))?;
        let cfg = quinn::ClientConfig::new(std::sync::Arc::new(quic));
        let client = quinn::Endpoint::client(SocketAddr::new(from, 0)).map_err(|x| e(&x))?;
        let client_addr = client.local_addr().map_err(|x| e(&x))?;
        // The black hole: the client's datagrams go on to the router, the router's are dropped.
        let answers = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = answers.clone();
        let relay = tokio::spawn(async move {
            let mut buf = vec![0u8; 65_536];
            while let Ok((n, src)) = hole.recv_from(&mut buf).await {
                if src == client_addr {
                    let _ = hole.send_to(&buf[..n], target).await;
                } else if src == target {
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        let mut started = 0;
        for _ in 0..count {
            if crate::aborted() {
                break;
            }
            let Ok(connecting) =
                client.connect_with(cfg.clone(), hole_addr, kvmesh_mesh::certs::SERVER_NAME)
            else {
                continue;
            };
            started += 1;
            tokio::spawn(async move {
                let _ = tokio::time::timeout(hold, connecting).await;
            });
            if started % 50 == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        tokio::time::sleep(hold).await;
        relay.abort();
        Ok((started, answers.load(std::sync::atomic::Ordering::Relaxed)))
    })
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
