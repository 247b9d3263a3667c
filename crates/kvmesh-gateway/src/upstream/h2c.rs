//! HTTP/2 cleartext with prior knowledge (h2c) to the engines: one multiplexed connection per
//! engine, shared by every request to it ([`H2Upstream`]).
//!
//! Unlike the HTTP/1.1 pool, an HTTP/2 connection serves many requests at once, so it cannot
//! be driven by one request: hyper runs it in tasks of its own (the connection, and a task per
//! request body it sends). The connection is opened on first use — concurrent first requests
//! wait for the same connect — and replaced when it has closed (the engine went away, or sent
//! a GOAWAY and finished its streams). A response body dropped early resets its stream
//! (`RST_STREAM(CANCEL)`), which the engine sees as the client gone; the other streams of the
//! connection go on.

use super::{
    PoolConfig, Upstream, UpstreamBody, UpstreamError, UpstreamFuture, authority_of, lock,
};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use http::{Request, Response, Version};
use http_body_util::Full;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Sender = http2::SendRequest<Full<Bytes>>;
type Connecting = Shared<BoxFuture<'static, Result<Sender, UpstreamError>>>;

/// Times a request is sent again when its connection turned out closed before it was sent,
/// or the engine refused its stream unprocessed (each time on a new connection).
const SEND_ROUNDS: usize = 3;

/// The connection to one engine.
enum Conn {
    /// Open (as far as hyper knows: checked at each use).
    Ready(Sender),
    /// Being opened; every request that arrives meanwhile waits for the same connect.
    Connecting(Connecting),
}

struct Host {
    conn: Conn,
    /// Which connection this is (so that a finished connect or a failure replaces only the
    /// connection it concerns, not a newer one).
    id: u64,
    used: Instant,
    /// The connection has carried an answer (an engine that never answers over it may not
    /// speak HTTP/2 at all).
    answered: Arc<AtomicBool>,
}

struct Hosts {
    by_authority: HashMap<Box<str>, Host>,
    /// Last sweep of the connections of engines no longer used.
    swept: Instant,
}

struct H2Pool {
    cfg: PoolConfig,
    builder: http2::Builder<TokioExecutor>,
    hosts: Mutex<Hosts>,
    connects: Arc<AtomicU64>,
    next_id: AtomicU64,
}

/// HTTP/2 cleartext with prior knowledge to the engines: one multiplexed connection per
/// engine (TCP_NODELAY, pings every 30 s to find a dead peer), reopened when it closes.
#[derive(Clone)]
pub struct H2Upstream(Arc<H2Pool>);

impl H2Upstream {
    /// No connection yet. `cfg.max_idle_per_host` does not apply (one connection per engine);
    /// a connection unused for `cfg.idle_timeout` is closed.
    pub fn new(cfg: PoolConfig) -> H2Upstream {
        let mut builder = http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        H2Upstream(Arc::new(H2Pool {
            cfg,
            builder,
            hosts: Mutex::new(Hosts {
                by_authority: HashMap::new(),
                swept: Instant::now(),
            }),
            connects: Arc::new(AtomicU64::new(0)),
            next_id: AtomicU64::new(0),
        }))
    }

    /// TCP connections opened so far.
    pub fn connects(&self) -> u64 {
        self.0.connects.load(Ordering::Relaxed)
    }

    /// Whether an open connection to `authority` (`host:port`) is kept.
    pub fn is_open(&self, authority: &str) -> bool {
        lock(&self.0.hosts)
            .by_authority
            .get(authority)
            .is_some_and(|h| matches!(&h.conn, Conn::Ready(tx) if !tx.is_closed()))
    }
}

impl Upstream for H2Upstream {
    fn send(&self, req: Request<Full<Bytes>>) -> UpstreamFuture {
        let pool = self.0.clone();
        Box::pin(pool.send(req))
    }

    fn connects(&self) -> Option<u64> {
        Some(H2Upstream::connects(self))
    }
}

impl H2Pool {
    async fn send(
        self: Arc<Self>,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        let authority = authority_of(&req)?;
        // The absolute URI gives `:scheme` and `:authority`; HTTP/2 has no Host header.
        *req.version_mut() = Version::HTTP_2;
        req.headers_mut().remove(http::header::HOST);
        let key = authority.as_str();
        let mut stale = None;
        for _ in 0..SEND_ROUNDS {
            let (mut tx, id, answered) = self.sender(key, stale).await?;
            let err = match tx.try_send_request(req).await {
                Ok(r) => {
                    answered.store(true, Ordering::Relaxed);
                    return Ok(r.map(UpstreamBody::Hyper));
                }
                Err(mut e) => match e.take_message() {
                    // Never written: the connection had closed (a GOAWAY, the engine gone).
                    Some(back) => {
                        req = back;
                        stale = Some(id);
                        continue;
                    }
                    None => e.into_error(),
                },
            };
            // Refused unprocessed (RFC 9113 §8.7: safe to send again), as a draining engine
            // refuses the streams it will not serve: like a failed connect, another engine
            // may take it.
            let refused = reason(&err) == Some(h2::Reason::REFUSED_STREAM);
            return Err(UpstreamError {
                connect: refused,
                message: format!(
                    "{key}: {}",
                    describe(&err, answered.load(Ordering::Relaxed))
                ),
            });
        }
        Err(UpstreamError {
            connect: true,
            message: format!("{key}: the connection closed {SEND_ROUNDS} times before sending"),
        })
    }

    /// The open connection to `authority`, or a new one (one connect for all the requests
    /// that wait for it). `stale`: a connection found closed, to be replaced.
    async fn sender(
        &self,
        authority: &str,
        stale: Option<u64>,
    ) -> Result<(Sender, u64, Arc<AtomicBool>), UpstreamError> {
        let now = Instant::now();
        let mut dropped: Vec<Conn> = Vec::new();
        let (connecting, id, answered) = {
            let mut hosts = lock(&self.hosts);
            if now.duration_since(hosts.swept) >= self.cfg.idle_timeout / 2 {
                hosts.swept = now;
                let idle = self.cfg.idle_timeout;
                let expired: Vec<Box<str>> = hosts
                    .by_authority
                    .iter()
                    .filter(|(_, h)| now.duration_since(h.used) >= idle)
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in expired {
                    dropped.extend(hosts.by_authority.remove(&k).map(|h| h.conn));
                }
            }
            match hosts.by_authority.get_mut(authority) {
                Some(h) => {
                    h.used = now;
                    match &h.conn {
                        Conn::Ready(tx) if !tx.is_closed() && stale != Some(h.id) => {
                            return Ok((tx.clone(), h.id, h.answered.clone()));
                        }
                        Conn::Connecting(c) if stale != Some(h.id) => {
                            (c.clone(), h.id, h.answered.clone())
                        }
                        _ => {
                            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                            let c = self.open(authority);
                            dropped
                                .push(std::mem::replace(&mut h.conn, Conn::Connecting(c.clone())));
                            h.id = id;
                            h.answered = Arc::default();
                            (c, id, h.answered.clone())
                        }
                    }
                }
                None => {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    let c = self.open(authority);
                    let answered = Arc::<AtomicBool>::default();
                    hosts.by_authority.insert(
                        authority.into(),
                        Host {
                            conn: Conn::Connecting(c.clone()),
                            id,
                            used: now,
                            answered: answered.clone(),
                        },
                    );
                    (c, id, answered)
                }
            }
        };
        drop(dropped); // closed outside the lock
        let r = connecting.await;
        let mut hosts = lock(&self.hosts);
        if let Some(h) = hosts.by_authority.get_mut(authority)
            && h.id == id
            && matches!(h.conn, Conn::Connecting(_))
        {
            match &r {
                Ok(tx) => h.conn = Conn::Ready(tx.clone()),
                // The next request tries a new connect.
                Err(_) => {
                    hosts.by_authority.remove(authority);
                }
            }
        }
        r.map(|tx| (tx, id, answered))
    }

    /// The connect to `authority`, shared by whoever waits for it.
    fn open(&self, authority: &str) -> Connecting {
        connect(
            self.builder.clone(),
            authority.into(),
            self.cfg.connect_timeout,
            self.connects.clone(),
        )
        .boxed()
        .shared()
    }
}

/// TCP connect and HTTP/2 handshake, each bounded by `timeout`; the connection then runs in a
/// task of its own until it closes.
async fn connect(
    builder: http2::Builder<TokioExecutor>,
    authority: Box<str>,
    timeout: Duration,
    connects: Arc<AtomicU64>,
) -> Result<Sender, UpstreamError> {
    let err = |message: String| UpstreamError {
        connect: true,
        message,
    };
    let stream = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&*authority))
        .await
        .map_err(|_| err(format!("{authority}: no connection within {timeout:?}")))?
        .map_err(|e| err(format!("{authority}: {e}")))?;
    let _ = stream.set_nodelay(true);
    connects.fetch_add(1, Ordering::Relaxed);
    let (tx, conn) = tokio::time::timeout(timeout, builder.handshake(TokioIo::new(stream)))
        .await
        .map_err(|_| {
            err(format!(
                "{authority}: no HTTP/2 handshake within {timeout:?}"
            ))
        })?
        .map_err(|e| err(format!("{authority}: HTTP/2 handshake: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(%authority, error = %e, "HTTP/2 connection to an engine ended");
        }
    });
    Ok(tx)
}

/// A hyper error with its causes. A connection that never carried an answer, or a frame the
/// engine's answer cannot be read as, says what is likely (QA35: the client was told "http2
/// error"): an engine that speaks HTTP/1.1 answers the HTTP/2 preface with an HTTP/1.1 400,
/// which reads as a frame far too large, and closes, which breaks the router's writes.
fn describe(e: &hyper::Error, answered: bool) -> String {
    let mut text = e.to_string();
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    let unreadable = matches!(
        reason(e),
        Some(h2::Reason::FRAME_SIZE_ERROR | h2::Reason::PROTOCOL_ERROR)
    );
    if unreadable || !answered {
        text.push_str(" (does the engine speak HTTP/2 without TLS, h2c? serve.upstream.protocol = \"http2\" (--upstream-http2) needs it; vLLM and SGLang serve HTTP/1.1)");
    }
    text
}

/// The HTTP/2 reason of a hyper error, if it carries one.
fn reason(e: &hyper::Error) -> Option<h2::Reason> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<h2::Error>() {
            return h.reason();
        }
        source = s.source();
    }
    None
}
