//! The upstream HTTP client behind a trait: a pool of HTTP/1.1 connections driven by the
//! request's own task in production ([`PoolUpstream`]), one multiplexed HTTP/2 connection per
//! engine for engines that serve h2c ([`H2Upstream`], in `h2c.rs`), hyper's pooled client
//! ([`HyperUpstream`], kept for comparison) and a scripted mock beside them ([`MockUpstream`])
//! so that the request path — retries, breakers, budget, timeouts, cancellation — is tested on
//! tokio's paused time without sockets.
//!
//! Why not hyper's pooled client on the request path: it runs every connection in a task of
//! its own and hands the response body over through a channel that holds one chunk, so each
//! SSE frame crosses tasks separately and is written to the client on its own. [`PoolUpstream`]
//! polls the connection from the body ([`PooledBody`]): every frame the engine's bytes already
//! hold is decoded in the same poll, and the proxy can write them out together.

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::client::conn::http1;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

mod h2c;
pub use h2c::H2Upstream;

/// Errors of a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The future of one upstream request (up to its response head).
pub type UpstreamFuture =
    Pin<Box<dyn Future<Output = Result<Response<UpstreamBody>, UpstreamError>> + Send>>;

/// Sends a request to an engine and returns its response head and streaming body.
pub trait Upstream: Send + Sync + 'static {
    /// Sends `req` (absolute URI: `http://host:port/path`).
    fn send(&self, req: Request<Full<Bytes>>) -> UpstreamFuture;

    /// TCP connections to engines opened so far, when this upstream counts them.
    fn connects(&self) -> Option<u64> {
        None
    }
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

/// A response body from upstream: the pool's or hyper's client's (no boxing on the production
/// path), or any other body (the mock).
// The pooled variant holds its connection inline: the body is moved a few times and then boxed
// once with its `TrackedBody`, cheaper than one more allocation per request.
#[allow(clippy::large_enum_variant)]
pub enum UpstreamBody {
    /// From hyper's client ([`HyperUpstream`], and [`H2Upstream`]'s streams).
    Hyper(Incoming),
    /// From [`PoolUpstream`]: the body and the connection it drives.
    Pooled(PooledBody),
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
            UpstreamBody::Pooled(b) => b.poll_frame(cx),
            UpstreamBody::Other(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Hyper(b) => b.is_end_stream(),
            UpstreamBody::Pooled(b) => b.body.is_end_stream(),
            UpstreamBody::Other(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Hyper(b) => b.size_hint(),
            UpstreamBody::Pooled(b) => b.body.size_hint(),
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

type Conn = http1::Connection<TokioIo<tokio::net::TcpStream>, Full<Bytes>>;

/// One upstream HTTP/1.1 connection: its request sender and the connection itself, polled by
/// whoever holds it (no task of its own).
struct PooledConn {
    tx: http1::SendRequest<Full<Bytes>>,
    conn: Conn,
}

impl PooledConn {
    /// Drives the connection; `false` once it is finished (closed or failed).
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        Pin::new(&mut self.conn).poll(cx).is_pending()
    }
}

/// Settings of [`PoolUpstream`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bound of a TCP connect.
    pub connect_timeout: Duration,
    /// An idle connection older than this is closed instead of reused.
    pub idle_timeout: Duration,
    /// Idle connections kept per engine.
    pub max_idle_per_host: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            connect_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(60),
            max_idle_per_host: 1024,
        }
    }
}

struct Idle {
    c: PooledConn,
    since: std::time::Instant,
}

struct IdleSet {
    /// Per `host:port`: idle connections, the most recently used last.
    hosts: HashMap<Box<str>, VecDeque<Idle>>,
    /// Last sweep of every host's expired connections (those of an engine no longer used
    /// would stay open otherwise).
    swept: std::time::Instant,
}

struct Pool {
    cfg: PoolConfig,
    builder: http1::Builder,
    idle: Mutex<IdleSet>,
    connects: std::sync::atomic::AtomicU64,
}

/// Keep-alive HTTP/1.1 connections to the engines, each driven by the request that holds it
/// (TCP_NODELAY). A connection goes back to the pool when its response body has been read to
/// the end; dropping the body before (client gone) closes it, which aborts the engine's work.
#[derive(Clone)]
pub struct PoolUpstream(Arc<Pool>);

impl PoolUpstream {
    /// An empty pool.
    pub fn new(cfg: PoolConfig) -> PoolUpstream {
        PoolUpstream(Arc::new(Pool {
            cfg,
            builder: http1::Builder::new(),
            idle: Mutex::new(IdleSet {
                hosts: HashMap::new(),
                swept: std::time::Instant::now(),
            }),
            connects: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// TCP connections opened so far.
    pub fn connects(&self) -> u64 {
        self.0.connects.load(Ordering::Relaxed)
    }

    /// Idle connections kept for `authority` (`host:port`).
    pub fn idle(&self, authority: &str) -> usize {
        lock(&self.0.idle)
            .hosts
            .get(authority)
            .map_or(0, VecDeque::len)
    }
}

/// The `host:port` an upstream request goes to (a connect error without one: the engine's
/// URL is malformed, another engine may do).
fn authority_of(req: &Request<Full<Bytes>>) -> Result<http::uri::Authority, UpstreamError> {
    req.uri().authority().cloned().ok_or_else(|| UpstreamError {
        connect: true,
        message: format!("no host in the upstream URI {}", req.uri()),
    })
}

impl Upstream for PoolUpstream {
    fn send(&self, req: Request<Full<Bytes>>) -> UpstreamFuture {
        let pool = self.0.clone();
        Box::pin(pool.send(req))
    }

    fn connects(&self) -> Option<u64> {
        Some(PoolUpstream::connects(self))
    }
}

impl Pool {
    async fn send(
        self: Arc<Self>,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        let authority = authority_of(&req)?;
        // Origin-form request line, and the Host header hyper's client would have set.
        let mut parts = http::uri::Parts::default();
        parts.path_and_query = req.uri().path_and_query().cloned();
        if let Ok(u) = http::Uri::from_parts(parts) {
            *req.uri_mut() = u;
        }
        if !req.headers().contains_key(http::header::HOST)
            && let Ok(v) = http::HeaderValue::from_str(authority.as_str())
        {
            req.headers_mut().insert(http::header::HOST, v);
        }
        let key = authority.as_str();
        let mut req = req;
        loop {
            let (c, reused) = match self.take(key) {
                Some(c) => (c, true),
                None => (self.connect(key).await?, false),
            };
            match self.exchange(c, req, &authority).await {
                Ok(r) => return Ok(r),
                // A kept connection the engine closed while it was idle gives the request back
                // unsent: once more on another (or a new) connection.
                Err((_, Some(back))) if reused => req = back,
                Err((e, _)) => {
                    return Err(UpstreamError {
                        connect: false,
                        message: format!("{key}: {e}"),
                    });
                }
            }
        }
    }

    /// Sends `req` on `c`, driving the connection until the response head.
    async fn exchange(
        self: &Arc<Self>,
        c: PooledConn,
        req: Request<Full<Bytes>>,
        authority: &http::uri::Authority,
    ) -> Result<Response<UpstreamBody>, (hyper::Error, Option<Request<Full<Bytes>>>)> {
        let PooledConn { mut tx, conn } = c;
        let mut conn = Some(conn);
        let mut head = std::pin::pin!(tx.try_send_request(req));
        let head = std::future::poll_fn(|cx| {
            if let Some(c) = conn.as_mut()
                && Pin::new(c).poll(cx).is_ready()
            {
                // Finished: dropping it fails the pending request, if any.
                conn = None;
            }
            head.as_mut().poll(cx)
        })
        .await;
        match head {
            Ok(r) => Ok(r.map(|body| {
                UpstreamBody::Pooled(PooledBody {
                    body,
                    conn: conn.map(|conn| PooledConn { tx, conn }),
                    pool: self.clone(),
                    authority: authority.clone(),
                })
            })),
            Err(mut e) => {
                let back = e.take_message();
                Err((e.into_error(), back))
            }
        }
    }

    async fn connect(&self, authority: &str) -> Result<PooledConn, UpstreamError> {
        let err = |message: String| UpstreamError {
            connect: true,
            message,
        };
        let t = self.cfg.connect_timeout;
        let stream = tokio::time::timeout(t, tokio::net::TcpStream::connect(authority))
            .await
            .map_err(|_| err(format!("{authority}: no connection within {t:?}")))?
            .map_err(|e| err(format!("{authority}: {e}")))?;
        let _ = stream.set_nodelay(true);
        self.connects.fetch_add(1, Ordering::Relaxed);
        let (tx, conn) = self
            .builder
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| err(format!("{authority}: {e}")))?;
        Ok(PooledConn { tx, conn })
    }

    /// The most recently used idle connection that is still open.
    fn take(&self, authority: &str) -> Option<PooledConn> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let now = std::time::Instant::now();
        let mut stale = Vec::new();
        let found = {
            let mut idle = lock(&self.idle);
            let list = idle.hosts.get_mut(authority)?;
            let mut found = None;
            while let Some(mut i) = list.pop_back() {
                // Polling notices an engine that closed it meanwhile.
                if now.duration_since(i.since) < self.cfg.idle_timeout
                    && i.c.drive(&mut cx)
                    && i.c.tx.is_ready()
                {
                    found = Some(i.c);
                    break;
                }
                stale.push(i);
            }
            found
        };
        drop(stale); // closed outside the lock
        found
    }

    /// Keeps `c` for the next request to `authority` (it finished its exchange).
    fn put(&self, authority: &http::uri::Authority, mut c: PooledConn, cx: &mut Context<'_>) {
        // One more poll lets the connection turn idle (ready for the next request).
        if !c.drive(cx) || !c.tx.is_ready() {
            return;
        }
        let now = std::time::Instant::now();
        let mut evicted = Vec::new();
        {
            let expired = |i: &Idle| now.duration_since(i.since) >= self.cfg.idle_timeout;
            let mut idle = lock(&self.idle);
            let list = match idle.hosts.get_mut(authority.as_str()) {
                Some(l) => l,
                None => idle.hosts.entry(authority.as_str().into()).or_default(),
            };
            while list.front().is_some_and(expired)
                || list.len() >= self.cfg.max_idle_per_host.max(1)
            {
                evicted.extend(list.pop_front());
            }
            list.push_back(Idle { c, since: now });
            if now.duration_since(idle.swept) >= self.cfg.idle_timeout / 2 {
                idle.swept = now;
                idle.hosts.retain(|_, l| {
                    while l.front().is_some_and(expired) {
                        evicted.extend(l.pop_front());
                    }
                    !l.is_empty()
                });
            }
        }
        drop(evicted);
    }
}

/// A response body of [`PoolUpstream`]: polling it drives its connection, so every frame whose
/// bytes have arrived is decoded in the same poll. At its end the connection returns to the
/// pool; dropped before, it is closed.
pub struct PooledBody {
    body: Incoming,
    conn: Option<PooledConn>,
    pool: Arc<Pool>,
    authority: http::uri::Authority,
}

impl PooledBody {
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(c) = self.conn.as_mut()
            && !c.drive(cx)
        {
            // Finished (closed, or failed: the body gets the error). Not reusable.
            self.conn = None;
        }
        match Pin::new(&mut self.body).poll_frame(cx) {
            Poll::Ready(None) => {
                if let Some(c) = self.conn.take() {
                    self.pool.put(&self.authority, c, cx);
                }
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                self.conn = None;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(Some(Ok(f))) => Poll::Ready(Some(Ok(f))),
            Poll::Pending => Poll::Pending,
        }
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

#[cfg(test)]
#[path = "upstream_tests.rs"]
mod tests;
