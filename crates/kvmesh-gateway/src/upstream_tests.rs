//! [`PoolUpstream`] against a scripted HTTP/1.1 server on loopback: connections are reused,
//! one the server closed while idle is replaced without failing the request, a body dropped
//! mid-stream closes its connection (the engine sees the client leave), and the expired idle
//! connections of an engine no longer used are closed.

use super::*;
use http_body_util::BodyExt;
use std::sync::atomic::AtomicUsize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the server does on each connection after answering `answers` requests.
#[derive(Clone, Copy)]
enum Then {
    /// Keeps serving requests.
    KeepAlive,
    /// Closes the connection after the first answer.
    Close,
    /// Sends the head and one SSE frame, then waits for the client to go (reports it).
    StreamAndWait,
}

struct Server {
    addr: std::net::SocketAddr,
    accepts: Arc<AtomicUsize>,
    gone: tokio::sync::mpsc::UnboundedReceiver<()>,
    closed: tokio::sync::mpsc::UnboundedReceiver<()>,
}

/// Reads one request (head and content-length body); `false` at EOF.
async fn read_request(s: &mut TcpStream) -> bool {
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return true;
            }
        }
        match s.read(&mut b).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
}

async fn server(then: Then) -> Server {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let accepts = Arc::new(AtomicUsize::new(0));
    let (gone_tx, gone) = tokio::sync::mpsc::unbounded_channel();
    let (closed_tx, closed) = tokio::sync::mpsc::unbounded_channel();
    let n = accepts.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            n.fetch_add(1, Ordering::SeqCst);
            let (gone_tx, closed_tx) = (gone_tx.clone(), closed_tx.clone());
            tokio::spawn(async move {
                while read_request(&mut s).await {
                    if let Then::StreamAndWait = then {
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
                            .await;
                        let mut b = [0u8; 64];
                        // Bounded by the test's own timeout: returns when the client closes.
                        while let Ok(n) = s.read(&mut b).await {
                            if n == 0 {
                                break;
                            }
                        }
                        let _ = gone_tx.send(());
                        return;
                    }
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                    if let Then::Close = then {
                        drop(s);
                        let _ = closed_tx.send(());
                        return;
                    }
                }
            });
        }
    });
    Server {
        addr,
        accepts,
        gone,
        closed,
    }
}

fn request(addr: std::net::SocketAddr) -> Request<Full<Bytes>> {
    let mut r = Request::new(Full::new(Bytes::from_static(b"{}")));
    *r.method_mut() = http::Method::POST;
    *r.uri_mut() = format!("http://{addr}/v1/completions")
        .parse()
        .expect("uri");
    r
}

async fn body_of(r: Response<UpstreamBody>) -> Bytes {
    r.into_body().collect().await.expect("body").to_bytes()
}

const BOUND: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_reused_and_one_closed_while_idle_is_replaced() {
    let s = server(Then::KeepAlive).await;
    let pool = PoolUpstream::new(PoolConfig::default());
    for _ in 0..5 {
        let r = pool.send(request(s.addr)).await.expect("response");
        assert_eq!(r.status(), 200);
        assert_eq!(body_of(r).await, "ok");
    }
    assert_eq!(pool.connects(), 1, "one connection for sequential requests");
    assert_eq!(s.accepts.load(Ordering::SeqCst), 1);
    assert_eq!(pool.idle(&s.addr.to_string()), 1);

    let mut s = server(Then::Close).await;
    let pool = PoolUpstream::new(PoolConfig::default());
    let r = pool.send(request(s.addr)).await.expect("response");
    assert_eq!(body_of(r).await, "ok");
    tokio::time::timeout(BOUND, s.closed.recv())
        .await
        .expect("the server closed its side");
    // Let the reactor see the close (the pool may also learn it from the request itself).
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = pool
        .send(request(s.addr))
        .await
        .expect("a closed idle connection is not an error");
    assert_eq!(body_of(r).await, "ok");
    assert_eq!(
        pool.connects(),
        2,
        "a new connection replaced the closed one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_dropped_mid_stream_closes_its_connection() {
    let mut s = server(Then::StreamAndWait).await;
    let pool = PoolUpstream::new(PoolConfig::default());
    let r = pool.send(request(s.addr)).await.expect("response");
    let mut body = r.into_body();
    let f = tokio::time::timeout(BOUND, body.frame())
        .await
        .expect("a frame within the bound")
        .expect("a frame")
        .expect("data");
    assert_eq!(f.into_data().expect("data"), "data: 1\n\n");
    drop(body); // the client leaves
    tokio::time::timeout(BOUND, s.gone.recv())
        .await
        .expect("the server sees the connection close");
    assert_eq!(pool.idle(&s.addr.to_string()), 0, "never kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_of_an_engine_no_longer_used_expire() {
    let a = server(Then::KeepAlive).await;
    let b = server(Then::KeepAlive).await;
    let pool = PoolUpstream::new(PoolConfig {
        idle_timeout: Duration::from_millis(100),
        ..PoolConfig::default()
    });
    let r = pool.send(request(a.addr)).await.expect("response");
    assert_eq!(body_of(r).await, "ok");
    assert_eq!(pool.idle(&a.addr.to_string()), 1);
    // Past the idle timeout, traffic to another engine sweeps the first one's connection.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let r = pool.send(request(b.addr)).await.expect("response");
    assert_eq!(body_of(r).await, "ok");
    assert_eq!(pool.idle(&a.addr.to_string()), 0, "expired and closed");
    assert_eq!(pool.idle(&b.addr.to_string()), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_errors_are_reported_as_such_by_both_protocols() {
    // A port nothing listens on: bound and released.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr");
    let h1 = PoolUpstream::new(PoolConfig::default());
    let h2 = H2Upstream::new(PoolConfig::default());
    for (name, up) in [
        ("http1", &h1 as &dyn Upstream),
        ("http2", &h2 as &dyn Upstream),
    ] {
        let e = tokio::time::timeout(BOUND, up.send(request(addr)))
            .await
            .expect("bounded")
            .err()
            .unwrap_or_else(|| panic!("{name}: nothing listens"));
        assert!(e.connect, "{name}: {e}");
        assert!(e.message.contains(&addr.to_string()), "{name}: {e}");
        assert_eq!(up.connects(), Some(0), "{name}");
    }
    assert!(
        !h2.is_open(&addr.to_string()),
        "a failed connect is not kept"
    );
}
