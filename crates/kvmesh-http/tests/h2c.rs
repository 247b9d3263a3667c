//! The accept loop with `ServeLimits::http2`: HTTP/1.1 and h2c prior knowledge on one port, and
//! a graceful drain that waits for an HTTP/2 stream in flight (GOAWAY, then the answer).

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvmesh_http::{Body, ServeLimits, full, serve};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot};

const BOUND: Duration = Duration::from_secs(10);

#[derive(Default)]
struct State {
    /// A `/slow` request arrived.
    arrived: Notify,
    /// Lets `/slow` answer.
    release: Notify,
}

/// Answers with the request's HTTP version; `/slow` first waits to be released.
async fn handler(st: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    if req.uri().path() == "/slow" {
        st.arrived.notify_one();
        st.release.notified().await;
    }
    Response::new(full(format!("{:?}", req.version())))
}

fn get(path: &str) -> Request<Empty<Bytes>> {
    Request::builder()
        .uri(format!("http://localhost{path}"))
        .body(Empty::new())
        .expect("request")
}

async fn text(r: Response<Incoming>) -> String {
    let b = r.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8_lossy(&b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_protocols_on_one_port_and_the_drain_waits_for_an_http2_stream() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let st = Arc::new(State::default());
    let (stop, stopped) = oneshot::channel();
    let limits = ServeLimits {
        http2: true,
        ..ServeLimits::default()
    };
    let server = tokio::spawn(serve(listener, st.clone(), handler, stopped, BOUND, limits));

    // HTTP/1.1.
    let io = TokioIo::new(TcpStream::connect(addr).await.expect("connect"));
    let (mut h1, conn) = hyper::client::conn::http1::handshake(io).await.expect("h1");
    tokio::spawn(conn);
    let r = tokio::time::timeout(BOUND, h1.send_request(get("/")))
        .await
        .expect("bounded")
        .expect("h1 response");
    assert_eq!(text(r).await, "HTTP/1.1");
    drop(h1);

    // h2c prior knowledge on the same port.
    let io = TokioIo::new(TcpStream::connect(addr).await.expect("connect"));
    let (mut h2, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .expect("h2");
    tokio::spawn(conn);
    let r = tokio::time::timeout(BOUND, h2.send_request(get("/")))
        .await
        .expect("bounded")
        .expect("h2 response");
    assert_eq!(text(r).await, "HTTP/2.0");

    // A stream in flight when the server is told to stop: the drain waits for it.
    let slow = tokio::spawn(h2.send_request(get("/slow")));
    tokio::time::timeout(BOUND, st.arrived.notified())
        .await
        .expect("the slow request arrived");
    stop.send(()).expect("server running");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !server.is_finished(),
        "the server finished with an HTTP/2 stream in flight"
    );
    st.release.notify_one();
    let r = tokio::time::timeout(BOUND, slow)
        .await
        .expect("bounded")
        .expect("task")
        .expect("the stream in flight is answered");
    assert_eq!(text(r).await, "HTTP/2.0");
    tokio::time::timeout(BOUND, server)
        .await
        .expect("the server finishes once drained")
        .expect("server task");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}
