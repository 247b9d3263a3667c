//! The mesh transport on loopback: mutual TLS against the cluster CA, datagrams and delta
//! streams both ways on one reused connection per peer, a node of another CA refused, and
//! garbage datagrams on the mesh port changing nothing. Every wait is bounded.

use bytes::Bytes;
use kvmesh_mesh::certs::{NodeTls, add_to_dir, generate, write_dir};
use kvmesh_mesh::transport::{Class, Inbound, Transport};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio::sync::mpsc;

fn names(n: &[&str]) -> Vec<String> {
    n.iter().map(|s| s.to_string()).collect()
}

async fn next_any(rx: &mut mpsc::Receiver<Inbound>) -> Inbound {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a message within the bound")
        .expect("open channel")
}

/// The next datagram or delta (connection events skipped).
async fn next(rx: &mut mpsc::Receiver<Inbound>) -> Inbound {
    loop {
        let m = next_any(rx).await;
        if m.class != Class::Connected {
            return m;
        }
    }
}

/// The cluster id of these tests' nodes.
const CLUSTER: u64 = 0x6b76_6d65_7368;

fn bind(tls: &NodeTls) -> (Arc<Transport>, mpsc::Receiver<Inbound>) {
    bind_in(tls, CLUSTER)
}

fn bind_in(tls: &NodeTls, cluster_id: u64) -> (Arc<Transport>, mpsc::Receiver<Inbound>) {
    Transport::bind("127.0.0.1:0".parse().expect("addr"), tls, cluster_id, 64).expect("bind")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_nodes_exchange_datagrams_and_deltas_over_mutual_tls() {
    let certs = generate(&names(&["a", "b", "c"])).expect("certs");
    // Through files, as `kvmesh cert` writes them and a node loads them.
    let dir = std::env::temp_dir().join(format!("kvmesh-certs-{}", std::process::id()));
    write_dir(&dir, &certs).expect("write");
    let (a, mut ra) = bind(&NodeTls::load(&dir, "a").expect("load a"));
    let (b, mut rb) = bind(&NodeTls::load(&dir, "b").expect("load b"));
    let (c, _rc) = bind(&NodeTls::from_cluster(&certs, "c").expect("c"));
    let _ = std::fs::remove_dir_all(&dir);
    let (aa, ba) = (a.local_addr().expect("a"), b.local_addr().expect("b"));

    a.send_delta(ba, b"delta from a").await.expect("delta");
    // Both ends tell their node of the new connection first (a healed link is met this way).
    let m = next_any(&mut rb).await;
    assert_eq!((m.class, m.from), (Class::Connected, aa));
    let m = next_any(&mut ra).await;
    assert_eq!((m.class, m.from), (Class::Connected, ba));
    let m = next(&mut rb).await;
    assert_eq!(
        (m.class, &m.payload[..]),
        (Class::Delta, &b"delta from a"[..])
    );
    assert_eq!(m.from, aa);
    a.send_datagram(ba, Bytes::from_static(b"swim ping"))
        .await
        .expect("datagram");
    let m = next(&mut rb).await;
    assert_eq!(
        (m.class, &m.payload[..]),
        (Class::Datagram, &b"swim ping"[..])
    );
    // b answers on the connection a opened (one connection per peer pair).
    b.send_delta(aa, b"delta from b").await.expect("reply");
    let m = next(&mut ra).await;
    assert_eq!(&m.payload[..], b"delta from b");
    // A batch of 1 MiB arrives whole.
    let big = vec![7u8; 1 << 20];
    c.send_delta(aa, &big).await.expect("big");
    let m = next(&mut ra).await;
    assert_eq!(m.payload.len(), big.len());
    assert_eq!(a.counters().handshake_failures.load(Relaxed), 0);
    assert!(a.counters().bytes_received[1].load(Relaxed) >= (1 << 20));
    for t in [a, b, c] {
        t.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_another_ca_cannot_connect_and_garbage_changes_nothing() {
    let ours = generate(&names(&["a", "b"])).expect("certs");
    let theirs = generate(&names(&["intruder"])).expect("other CA");
    let (a, mut ra) = bind(&NodeTls::from_cluster(&ours, "a").expect("a"));
    let (b, _rb) = bind(&NodeTls::from_cluster(&ours, "b").expect("b"));
    let (x, _rx) = bind(&NodeTls::from_cluster(&theirs, "intruder").expect("x"));
    let aa = a.local_addr().expect("a");

    // The intruder's handshake is refused both ways (its certificate is not from our CA, and
    // ours is not from its CA): nothing it sends reaches a.
    assert!(x.send_delta(aa, b"forged").await.is_err());
    assert!(
        x.send_datagram(aa, Bytes::from_static(b"forged"))
            .await
            .is_err()
    );
    // Random and truncated bytes straight to the UDP port.
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("udp");
    let mut seed = 0x1234_5678_9ABC_DEF1u64;
    for i in 0..200usize {
        let mut buf = vec![0u8; 1 + (i * 37) % 1_300];
        for byte in buf.iter_mut() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            *byte = seed as u8;
        }
        if i % 3 == 0 {
            buf[0] = 0xC0; // a long-header (Initial-looking) first byte
        }
        let _ = sock.send_to(&buf, aa).await;
        if i % 20 == 19 {
            // Paced: a burst can overflow the socket's receive buffer on a busy machine.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // They reach the socket and are counted there (quinn drops them after). The kernel may
    // still drop some when the receive buffer is full on a loaded machine (CI): at least
    // half must be counted, and here they usually all are.
    let counted = || a.counters().udp.datagrams.load(Relaxed);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while counted() < 200 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(counted() >= 100, "{} datagrams counted", counted());
    assert!(a.counters().udp.bytes.load(Relaxed) >= 100);
    // The cluster keeps working, and the intruder delivered nothing.
    b.send_delta(aa, b"still here").await.expect("delta");
    let m = next(&mut ra).await;
    assert_eq!(&m.payload[..], b"still here");
    assert!(ra.try_recv().is_err(), "nothing else was delivered");
    assert!(
        a.counters().handshake_failures.load(Relaxed)
            + x.counters().handshake_failures.load(Relaxed)
            >= 1,
        "the refused handshake is counted"
    );
    for t in [a, b, x] {
        t.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_the_same_ca_but_another_cluster_id_cannot_connect() {
    let certs = generate(&names(&["a", "b", "other"])).expect("certs");
    let (a, mut ra) = bind(&NodeTls::from_cluster(&certs, "a").expect("a"));
    let (b, _rb) = bind(&NodeTls::from_cluster(&certs, "b").expect("b"));
    let (x, _rx) = bind_in(
        &NodeTls::from_cluster(&certs, "other").expect("x"),
        CLUSTER + 1,
    );
    let aa = a.local_addr().expect("a");
    // Its certificate is good, its cluster is not: no connection either way, so no SWIM
    // packet of it ever reaches this cluster's membership.
    assert!(
        x.send_datagram(aa, Bytes::from_static(b"swim"))
            .await
            .is_err()
    );
    assert!(
        a.send_datagram(x.local_addr().expect("x"), Bytes::from_static(b"swim"))
            .await
            .is_err()
    );
    b.send_delta(aa, b"ours").await.expect("same cluster");
    assert_eq!(&next(&mut ra).await.payload[..], b"ours");
    assert!(
        ra.try_recv().is_err(),
        "nothing of the other cluster was delivered"
    );
    assert!(a.counters().handshake_failures.load(Relaxed) >= 1);
    for t in [a, b, x] {
        t.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_added_to_a_cert_directory_are_signed_by_its_ca_and_nothing_is_overwritten() {
    let dir = std::env::temp_dir().join(format!("kvmesh-certs-add-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!add_to_dir(&dir, &names(&["a", "b"])).expect("a new CA"));
    let ca_before = std::fs::read(dir.join("ca.pem")).expect("ca");
    assert!(add_to_dir(&dir, &names(&["c"])).expect("signed by the CA there"));
    assert_eq!(std::fs::read(dir.join("ca.pem")).expect("ca"), ca_before);
    // A node's pair is never overwritten (nor is half a CA completed).
    let again = add_to_dir(&dir, &names(&["d", "a"])).expect_err("a.pem exists");
    assert!(again.to_string().contains("a.pem exists"), "{again}");
    assert!(!dir.join("d.pem").exists(), "nothing written when refused");
    // The added node and an old one connect: one CA.
    let (a, mut ra) = bind(&NodeTls::load(&dir, "a").expect("a"));
    let (c, _rc) = bind(&NodeTls::load(&dir, "c").expect("c"));
    c.send_delta(a.local_addr().expect("a"), b"new node")
        .await
        .expect("same CA");
    assert_eq!(&next(&mut ra).await.payload[..], b"new node");
    for t in [a, c] {
        t.close().await;
    }
    // Half a CA (as on a node, which holds no ca.key) is named as such: a new CA there would
    // sign nodes the cluster refuses.
    let half = dir.join("half");
    std::fs::create_dir_all(&half).expect("dir");
    std::fs::copy(dir.join("ca.pem"), half.join("ca.pem")).expect("copy");
    let e = add_to_dir(&half, &names(&["f"])).expect_err("no ca.key");
    assert!(e.to_string().contains("has ca.pem but no ca.key"), "{e}");
    assert!(!half.join("f.pem").exists());
    // A ca.key that is not the CA's is refused.
    let other = generate(&names(&["x"])).expect("other CA");
    std::fs::write(dir.join("ca.key"), other.ca_key_pem).expect("swap the key");
    let e = add_to_dir(&dir, &names(&["e"])).expect_err("mismatched key");
    assert!(e.to_string().contains("not the key of ca.pem"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_node_names_are_refused() {
    assert!(generate(&names(&["ok-1", "../etc"])).is_err());
    assert!(generate(&names(&[""])).is_err());
    assert!(generate(&names(&["ca"])).is_err(), "ca.pem is the CA's");
    assert!(
        generate(&names(&["CA"])).is_err(),
        "ca.pem, case-insensitively"
    );
    let e = generate(&names(&[".hidden"])).expect_err("a dot first");
    assert!(e.to_string().contains("not starting with '.'"), "{e}");
    assert!(generate(&names(&["node.a_b-3"])).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trusting_our_ca_but_holding_a_foreign_certificate_is_refused_by_the_server() {
    let ours = generate(&names(&["a"])).expect("certs");
    let theirs = generate(&names(&["intruder"])).expect("other CA");
    let (a, mut ra) = bind(&NodeTls::from_cluster(&ours, "a").expect("a"));
    let aa = a.local_addr().expect("a");
    // It trusts our CA (so it accepts a's certificate) but presents its own.
    let mut forged = NodeTls::from_cluster(&theirs, "intruder").expect("x");
    forged.cas = NodeTls::from_cluster(&ours, "a").expect("a").cas;
    let (x, _rx) = bind(&forged);
    // The client side may finish its half of the handshake before the server's refusal
    // arrives; whatever it believes, nothing reaches a.
    let _ = x.send_delta(aa, b"forged").await;
    let _ = x.send_datagram(aa, Bytes::from_static(b"forged")).await;
    let waited = tokio::time::timeout(Duration::from_millis(500), ra.recv()).await;
    assert!(waited.is_err(), "nothing delivered: {waited:?}");
    let mut refused = 0;
    for _ in 0..50 {
        refused = a.counters().handshake_failures.load(Relaxed);
        if refused > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(refused >= 1, "the server counted the refused handshake");
    x.close().await;
    a.close().await;
}

/// Sends a delta from `x` to `to` until one arrives (a connection closed a moment ago may
/// still be in `x`'s map), within a bound; whether it arrived.
async fn delivered(
    x: &Arc<Transport>,
    to: std::net::SocketAddr,
    rx: &mut mpsc::Receiver<Inbound>,
    what: &'static [u8],
) -> bool {
    for _ in 0..10 {
        let _ = x.send_delta(to, what).await;
        let until = tokio::time::Instant::now() + Duration::from_millis(300);
        while let Ok(Some(m)) = tokio::time::timeout_at(until, rx.recv()).await {
            if m.class == Class::Delta && m.payload == Bytes::from_static(what) {
                return true;
            }
        }
    }
    false
}

/// A CA rotation without a restart: a node that trusts the old and the new CA (a bundle in
/// `ca.pem`) talks with nodes of either; a node that takes the bundle while running reaches a
/// node of the new CA; a node that stops trusting the old CA closes its connections and
/// refuses the old CA's nodes from then on; a node that takes a new pair while running is
/// accepted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_and_trusted_cas_are_taken_while_running() {
    let old = generate(&names(&["a", "b"])).expect("old CA");
    let new = generate(&names(&["a", "b"])).expect("new CA");
    let pem = |c: &kvmesh_mesh::certs::ClusterCerts, n: &str| {
        c.nodes.iter().find(|x| x.name == n).cloned().expect("node")
    };
    let tls = |ca: &str, c: &kvmesh_mesh::certs::ClusterCerts, n: &str| {
        let p = pem(c, n);
        NodeTls::from_pem(n, ca, &p.cert_pem, &p.key_pem).expect("loads")
    };
    let both = format!("{}{}", old.ca_pem, new.ca_pem);
    // a: the old CA's pair, trusting the old CA; b: the new CA's pair, trusting both.
    let (a, mut ra) = bind(&tls(&old.ca_pem, &old, "a"));
    let (b, mut rb) = bind(&tls(&both, &new, "b"));
    assert_eq!(tls(&both, &new, "b").cas.len(), 2);
    let (aa, ba) = (a.local_addr().expect("a"), b.local_addr().expect("b"));

    assert!(
        !delivered(&a, ba, &mut rb, b"before").await,
        "a does not trust b's CA yet"
    );
    assert!(
        a.reload_tls(&tls(&both, &old, "a")).expect("reload"),
        "a's trusted CAs changed"
    );
    assert!(delivered(&a, ba, &mut rb, b"a trusts both").await);
    assert!(delivered(&b, aa, &mut ra, b"b to a").await);

    // b stops trusting the old CA: its connection with a closes, and a's old pair is refused.
    let refused_before = b.counters().handshake_failures.load(Relaxed);
    assert!(b.reload_tls(&tls(&new.ca_pem, &new, "b")).expect("reload"));
    assert!(
        !delivered(&a, ba, &mut rb, b"old pair").await,
        "b refuses a's certificate of the old CA"
    );
    assert!(b.counters().handshake_failures.load(Relaxed) > refused_before);

    // a takes its pair of the new CA (trusting the new CA alone): accepted again.
    assert!(a.reload_tls(&tls(&new.ca_pem, &new, "a")).expect("reload"));
    assert!(delivered(&a, ba, &mut rb, b"new pair").await);
    // The same CAs again: nothing to close.
    assert!(!a.reload_tls(&tls(&new.ca_pem, &new, "a")).expect("reload"));
    assert_eq!(a.counters().tls_reloads.load(Relaxed), 3);
    a.close().await;
    b.close().await;
}
