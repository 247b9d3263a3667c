//! A hostile ZMQ peer at the transport: a publisher (or replay socket) whose frame header
//! declares a huge frame. zeromq 0.7 reserved whatever a peer declared, so 9 bytes aborted the
//! process on the allocation failure (QA: a router, and then every router that came to read
//! the engine). The vendored copy (`vendor/zeromq`) refuses a frame past 64 MiB and drops the
//! connection. Were it not there, this test's process would abort. Loopback only, bounded.

use kvmesh_kvevents::{Subscriber, replay};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A ZMTP 3.0 greeting with the NULL mechanism, as a server sends it.
fn greeting() -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0];
    let mut mech = b"NULL".to_vec();
    mech.resize(20, 0);
    g.extend_from_slice(&mech);
    g.push(0); // as-server
    g.resize(64, 0);
    g
}

/// The READY command announcing `socket_type`.
fn ready(socket_type: &[u8]) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type);
    let mut c = vec![0x04, body.len() as u8];
    c.extend_from_slice(&body);
    c
}

/// A peer on loopback that, on every connection, shakes hands as `socket_type`, then sends a
/// frame header declaring `declared` bytes and holds the connection for a few seconds.
async fn declaring_peer(socket_type: &'static [u8], declared: u64) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("tcp://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move {
        for _ in 0..8 {
            let Ok(Ok((mut s, _))) =
                tokio::time::timeout(Duration::from_secs(10), l.accept()).await
            else {
                return;
            };
            tokio::spawn(async move {
                let mut theirs = [0u8; 64];
                if s.write_all(&greeting()).await.is_err()
                    || s.read_exact(&mut theirs).await.is_err()
                    || s.write_all(&ready(socket_type)).await.is_err()
                {
                    return;
                }
                let mut header = vec![0x02];
                header.extend_from_slice(&declared.to_be_bytes());
                let _ = s.write_all(&header).await;
                let mut sink = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_secs(3), async {
                    while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                })
                .await;
            });
        }
    });
    endpoint
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_declaring_a_huge_frame_is_dropped_not_allocated() {
    for declared in [1u64 << 40, 1 << 30, (64 << 20) + 1] {
        let endpoint = declaring_peer(b"PUB", declared).await;
        let mut sub = Subscriber::connect(&endpoint, "")
            .await
            .expect("the handshake succeeds");
        // Nothing is received: the frame is refused and the connection dropped.
        let got = sub.recv_timeout(Duration::from_millis(1_500)).await;
        assert!(
            !matches!(got, Ok(Some(_))),
            "declared {declared}: a frame was received: {got:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_socket_declaring_a_huge_frame_is_dropped_not_allocated() {
    let endpoint = declaring_peer(b"ROUTER", 1 << 40).await;
    let got = replay(&endpoint, 0, Duration::from_millis(1_500)).await;
    assert!(got.is_err(), "a replay came back: {got:?}");
}
