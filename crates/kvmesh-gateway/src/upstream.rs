//! The upstream HTTP client behind a trait: hyper's pooled client in production
//! ([`HyperUpstream`]) and a scripted mock beside it ([`MockUpstream`]) so that the request
//! path — retries, breakers, budget, timeouts, cancellation — is tested on tokio's paused time
//! without sockets.

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// Errors of a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The future of one upstream request (up to its response head).
pub type UpstreamFuture =
    Pin<Box<dyn Future<Output = Result<Response<UpstreamBody>, UpstreamError>> + Send>>;

/// Sends a request to an engine and returns its response head and streaming body.
pub trait Upstream: Send + Sync + 'static {
    /// Sends `req` (absolute URI: `http://host:port/path`).
    fn send(&self, req: Request<Full<Bytes>>) -> UpstreamFuture;
}

/// A failure before the response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamError {
    /// The connection could not be established (refused, unreachable, connect timeout).
    pub connect: bool,
    /// What happened.
    pub message: String,
}

impl std::fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A response body from upstream: hyper's own (no boxing on the production path), or any
/// other body (the mock).
pub enum UpstreamBody {
    /// From hyper's client.
    Hyper(Incoming),
    /// Any other body.
    Other(UnsyncBoxBody<Bytes, BoxError>),
}

impl HttpBody for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Hyper(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|o| o.map(|r| r.map_err(|e| Box::new(e) as BoxError))),
            UpstreamBody::Other(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Hyper(b) => b.is_end_stream(),
            UpstreamBody::Other(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Hyper(b) => b.size_hint(),
            UpstreamBody::Other(b) => b.size_hint(),
        }
    }
}

/// hyper's pooled keep-alive client.
#[derive(Clone)]
pub struct HyperUpstream(pub Client<HttpConnector, Full<Bytes>>);

impl Upstream for HyperUpstream {
    fn send(&self, req: Request<Full<Bytes>>) -> UpstreamFuture {
        let client = self.0.clone();
        Box::pin(async move {
            match client.request(req).await {
                Ok(r) => Ok(r.map(UpstreamBody::Hyper)),
                Err(e) => Err(UpstreamError {
                    connect: e.is_connect(),
                    message: e.to_string(),
                }),
            }
        })
    }
}

/// What the mock answers to one request.
#[derive(Debug, Clone)]
pub enum MockReply {
    /// After `head_after`, a response with `status`; then each body chunk after its delay.
    /// A chunk `Err(message)` breaks the body there.
    Respond {
        /// Delay before the response head.
        head_after: Duration,
        /// Status code.
        status: u16,
        /// Body chunks with the delay before each.
        chunks: Vec<(Duration, Result<Bytes, String>)>,
    },
    /// Connection refused.
    ConnectError,
    /// Never answers (a wedged engine): the router's first-byte timeout must end it.
    Hang,
}

impl MockReply {
    /// An immediate response with a one-chunk body.
    pub fn ok(status: u16, body: &str) -> MockReply {
        MockReply::Respond {
            head_after: Duration::ZERO,
            status,
            chunks: vec![(Duration::ZERO, Ok(Bytes::copy_from_slice(body.as_bytes())))],
        }
    }
}

/// One request the mock received.
#[derive(Debug, Clone)]
pub struct MockCall {
    /// `host:port` it was sent to.
    pub authority: String,
    /// Path and query.
    pub path: String,
    /// Its headers.
    pub headers: http::HeaderMap,
}

/// A scripted upstream: per authority, a queue of replies (then a default reply), recording
/// every call and counting the bodies still alive (a body dropped early = the client left).
#[derive(Default)]
pub struct MockUpstream {
    queued: Mutex<HashMap<String, VecDeque<MockReply>>>,
    defaults: Mutex<HashMap<String, MockReply>>,
    calls: Mutex<Vec<MockCall>>,
    live_bodies: Arc<AtomicU32>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl MockUpstream {
    /// An empty script: every authority refuses connections.
    pub fn new() -> Arc<MockUpstream> {
        Arc::new(MockUpstream::default())
    }

    /// Queues `reply` for the next request to `authority`.
    pub fn push(&self, authority: &str, reply: MockReply) {
        lock(&self.queued)
            .entry(authority.to_string())
            .or_default()
            .push_back(reply);
    }

    /// The reply to `authority` once its queue is empty.
    pub fn set_default(&self, authority: &str, reply: MockReply) {
        lock(&self.defaults).insert(authority.to_string(), reply);
    }

    /// Every request received so far.
    pub fn calls(&self) -> Vec<MockCall> {
        lock(&self.calls).clone()
    }

    /// Response bodies handed out and not yet dropped.
    pub fn live_bodies(&self) -> u32 {
        self.live_bodies.load(Ordering::SeqCst)
    }
}

impl Upstream for MockUpstream {
    fn send(&self, req: Request<Full<Bytes>>) -> UpstreamFuture {
        let authority = req
            .uri()
            .authority()
            .map(|a| a.to_string())
            .unwrap_or_default();
        lock(&self.calls).push(MockCall {
            authority: authority.clone(),
            path: req
                .uri()
                .path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
            headers: req.headers().clone(),
        });
        let reply = lock(&self.queued)
            .get_mut(&authority)
            .and_then(|q| q.pop_front())
            .or_else(|| lock(&self.defaults).get(&authority).cloned())
            .unwrap_or(MockReply::ConnectError);
        let live = self.live_bodies.clone();
        Box::pin(async move {
            match reply {
                MockReply::ConnectError => Err(UpstreamError {
                    connect: true,
                    message: format!("{authority}: connection refused (mock)"),
                }),
                MockReply::Hang => {
                    std::future::pending::<()>().await;
                    unreachable!("pending never completes")
                }
                MockReply::Respond {
                    head_after,
                    status,
                    chunks,
                } => {
                    tokio::time::sleep(head_after).await;
                    live.fetch_add(1, Ordering::SeqCst);
                    let body = MockBody {
                        chunks: chunks.into(),
                        sleep: None,
                        live,
                    };
                    let mut r = Response::new(UpstreamBody::Other(UnsyncBoxBody::new(body)));
                    *r.status_mut() =
                        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
                    Ok(r)
                }
            }
        })
    }
}

/// The mock's body: chunks released after their delays (tokio time: pausable).
struct MockBody {
    chunks: VecDeque<(Duration, Result<Bytes, String>)>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    live: Arc<AtomicU32>,
}

impl Drop for MockBody {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl HttpBody for MockBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some((delay, _)) = this.chunks.front() else {
            return Poll::Ready(None);
        };
        if !delay.is_zero() {
            let delay = *delay;
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.sleep = None;
        }
        match this.chunks.pop_front() {
            Some((_, Ok(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Some((_, Err(e))) => Poll::Ready(Some(Err(e.into()))),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }
}
