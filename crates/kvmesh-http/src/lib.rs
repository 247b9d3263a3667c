//! HTTP plumbing shared by `kvmesh sim` and `kvmesh serve` (thin, no policy).

#![forbid(unsafe_code)]
use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited, combinators::UnsyncBoxBody};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use kvmesh_openai::ApiError;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

mod send_timeout;
pub use send_timeout::SendTimeout;

/// Response body type of every handler.
pub type Body = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// A complete body.
pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// An empty 200.
pub fn ok_empty() -> Response<Body> {
    Response::new(full(Bytes::new()))
}

/// A JSON response.
pub fn json(status: u16, body: String) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// The OpenAI-shaped error response.
pub fn error(e: &ApiError) -> Response<Body> {
    json(e.status, e.to_json())
}

/// A 405 for `method` on `path`, with the `Allow` header naming the methods it takes
/// (RFC 9110 §15.5.6).
pub fn not_allowed(method: &http::Method, path: &str, allow: &'static str) -> Response<Body> {
    let mut r = error(&ApiError::method_not_allowed(method.as_str(), path));
    r.headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static(allow));
    r
}

/// A Prometheus text response.
pub fn prometheus(text: String) -> Response<Body> {
    let mut r = Response::new(full(text));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

/// An OpenMetrics text response (what `prometheus-client` encodes).
pub fn openmetrics(text: String) -> Response<Body> {
    let mut r = Response::new(full(text));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    r
}

/// Reads the whole body under the size limit (413 above it, checked against Content-Length
/// first so that an oversized body is refused before it is read) and before `deadline`
/// (408: a client that stalls its body cannot hold the request forever).
pub async fn read_body(
    headers: &HeaderMap,
    body: Incoming,
    limit: usize,
    deadline: Duration,
) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(deadline, read_body_unbounded(headers, body, limit)).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::body_timeout(deadline)),
    }
}

async fn read_body_unbounded(
    headers: &HeaderMap,
    body: Incoming,
    limit: usize,
) -> Result<Bytes, ApiError> {
    // A compressed body would reach the engine as bytes it cannot read either (vLLM and
    // SGLang do not decompress requests): refused here, before it is read.
    if let Some(enc) = headers.get(header::CONTENT_ENCODING)
        && !enc.as_bytes().eq_ignore_ascii_case(b"identity")
    {
        return Err(ApiError::with_status(
            415,
            format!(
                "content-encoding {:?} is not supported: send the body uncompressed",
                String::from_utf8_lossy(enc.as_bytes())
            ),
        ));
    }
    // hyper takes the chunks off a body and leaves any other coding on it (it refuses a
    // request whose codings do not end in chunked): gzip would reach the engine as its JSON.
    if let Some(coding) = coding_besides_chunked(headers) {
        return Err(ApiError::unsupported_transfer_coding(
            &String::from_utf8_lossy(coding),
        ));
    }
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(ApiError::body_too_large(limit));
    }
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::body_too_large(limit))
        }
        Err(e) if client_closed(&*e) => Err(ApiError::client_closed()),
        Err(e) => Err(ApiError::bad_request(
            "body_read_error",
            format!("failed to read the request body: {e}"),
        )),
    }
}

/// The first transfer coding a message names besides chunked (hyper takes chunks off a body
/// and leaves any other coding on it), if any.
pub fn coding_besides_chunked(h: &HeaderMap) -> Option<&[u8]> {
    h.get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .find(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"chunked"))
}

/// Decodes `%XX` escapes (a query's values, a path's segments); a `%` not followed by two hex
/// digits stays as it is, and bytes that are not UTF-8 are replaced.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b.get(i + 1..i + 3) {
            Some(hex) if b[i] == b'%' && hex.iter().all(u8::is_ascii_hexdigit) => {
                let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
                out.push(digit(hex[0]) << 4 | digit(hex[1]));
                i += 3;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A body read that failed because the client's connection ended (hyper's error over an
/// I/O error of an early end or a reset), not because of what it sent.
fn client_closed(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe
            )
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Headers that describe one connection and must not be forwarded by a proxy (RFC 9110
/// §7.6.1), plus every header the `Connection` header names. A `Content-Length` sent beside a
/// `Transfer-Encoding` goes too: the transfer coding frames that message and the length is
/// not its body's (RFC 9112 §6.3; QA: an engine's chunked answer that also said
/// `content-length: 5` reached the client cut to 5 bytes, as a whole 200).
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    if h.contains_key(header::TRANSFER_ENCODING) {
        h.remove(header::CONTENT_LENGTH);
    }
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
    ] {
        h.remove(n);
    }
    h.remove("keep-alive");
    h.remove("proxy-connection");
}

/// Compares secrets in time independent of where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carries `Authorization: Bearer <token>` (false when `token` is empty).
pub fn bearer_ok(h: &HeaderMap, token: &str) -> bool {
    if token.is_empty() {
        return false;
    }
    // The scheme name is case-insensitive (RFC 9110 §11.1).
    h.get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .is_some_and(|(_, t)| constant_time_eq(t.trim().as_bytes(), token.as_bytes()))
}

/// Serves HTTP/1.1 (and, with [`ServeLimits::http2`], HTTP/2 cleartext with prior knowledge on
/// the same port) until `shutdown` resolves, then stops accepting and waits up to `drain` for
/// open connections (and the requests on them) to finish; HTTP/2 connections are sent a
/// GOAWAY.
pub async fn serve<S, H, F>(
    listener: TcpListener,
    state: Arc<S>,
    handler: H,
    mut shutdown: oneshot::Receiver<()>,
    drain: Duration,
    limits: ServeLimits,
) where
    S: Send + Sync + 'static,
    H: Fn(Arc<S>, Request<Incoming>) -> F + Send + Sync + Copy + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let mut h1 = http1::Builder::new();
    h1.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    if let Some(n) = limits.max_headers {
        h1.max_headers(n);
    }
    // Both protocols: the connection preface tells them apart (h2c prior knowledge, no
    // upgrade). HTTP/1.1 only keeps hyper's plain server, without the peek at the preface.
    let both = limits.http2.then(|| {
        let mut b = auto::Builder::new(TokioExecutor::new());
        b.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout);
        if let Some(n) = limits.max_headers {
            b.http1().max_headers(n);
        }
        b.http2().timer(TokioTimer::new());
        b
    });
    let mut refusals = AcceptBackoff::default();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(s) => {
                        refusals.reset();
                        s
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tokio::time::sleep(refusals.failed(&e)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    // Full: a clear 503 and the connection closed, never queued unboundedly.
                    if let Some(c) = &limits.counters {
                        c.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    tokio::spawn(refuse(stream, limits.max_connections));
                    continue;
                };
                let st = state.clone();
                let svc = service_fn(move |req| {
                    let fut = handler(st.clone(), req);
                    async move { Ok::<_, Infallible>(fut.await) }
                });
                let io = SendTimeout::new(stream, limits.send_timeout)
                    .counted(limits.counters.clone());
                let io = TokioIo::new(io);
                match &both {
                    Some(b) => {
                        let conn = graceful.watch(b.serve_connection(io, svc).into_owned());
                        tokio::spawn(async move {
                            let _ = conn.await;
                            drop(slot);
                        });
                    }
                    None => {
                        let conn = graceful.watch(h1.serve_connection(io, svc));
                        tokio::spawn(async move {
                            let _ = conn.await;
                            drop(slot);
                        });
                    }
                }
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(?drain, "drain timeout: closing the remaining connections");
    }
}

/// Connections the accept loop closed on its own, by reason.
#[derive(Debug, Default)]
pub struct ConnCounters {
    /// Refused over [`ServeLimits::max_connections`] (answered 503).
    pub refused: std::sync::atomic::AtomicU64,
    /// Closed because no part of the answer could be written for
    /// [`ServeLimits::send_timeout`].
    pub send_timeouts: std::sync::atomic::AtomicU64,
}

/// Limits of the accept loop against clients that hold connections.
#[derive(Debug, Clone)]
pub struct ServeLimits {
    /// Connections served at once; one more gets a 503 JSON error and is closed.
    pub max_connections: usize,
    /// Time a client has to send a request's headers; also closes keep-alive connections idle
    /// that long (hyper's header-read timeout, which needs the timer set here).
    pub header_read_timeout: Duration,
    /// Also serve HTTP/2 cleartext with prior knowledge (h2c) on the same port (the simulator;
    /// the router serves HTTP/1.1 only). The header-read timeout then applies once the first
    /// bytes told the protocol apart: a connection that sends nothing is held until it closes
    /// or the server drains, bounded in number by `max_connections`.
    pub http2: bool,
    /// A connection whose answer cannot be written for this long is closed
    /// ([`SendTimeout`], nginx's `send_timeout`).
    pub send_timeout: Duration,
    /// Where the connections closed over these limits are counted, if anywhere.
    pub counters: Option<Arc<ConnCounters>>,
    /// Headers a request may have (HTTP/1.1; more is a 431). `None`: hyper's 100, parsed
    /// on the stack; a larger bound costs a heap allocation per request.
    pub max_headers: Option<usize>,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_connections: 10_000,
            header_read_timeout: Duration::from_secs(30),
            http2: false,
            send_timeout: Duration::from_secs(60),
            counters: None,
            max_headers: None,
        }
    }
}

/// Failed accepts (out of file descriptors, mostly): a wait that doubles from 5 ms to 500 ms
/// while they go on, and one log line a second at most, with the count (QA: 120 lines a
/// second). New connections wait in the listen backlog meanwhile.
#[derive(Default)]
struct AcceptBackoff {
    wait: Duration,
    unlogged: u64,
    logged_at: Option<std::time::Instant>,
}

impl AcceptBackoff {
    fn failed(&mut self, e: &std::io::Error) -> Duration {
        self.unlogged += 1;
        let now = std::time::Instant::now();
        if self
            .logged_at
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            tracing::warn!(error = %e, failures = self.unlogged, "accept failed (new connections wait in the listen backlog; out of file descriptors? see ulimit -n)");
            self.unlogged = 0;
            self.logged_at = Some(now);
        }
        self.wait = (self.wait * 2).clamp(Duration::from_millis(5), Duration::from_millis(500));
        self.wait
    }

    fn reset(&mut self) {
        self.wait = Duration::ZERO;
    }
}

/// Answers a connection over the limit with a 503 and closes it (bounded: a client that does
/// not read is dropped after a second).
async fn refuse(mut stream: tokio::net::TcpStream, limit: usize) {
    use tokio::io::AsyncWriteExt;
    let body = ApiError::too_many_connections(limit).to_json();
    let msg = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(msg.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_accepts_back_off_doubling_to_a_cap_and_start_over_after_one_succeeds() {
        let mut b = AcceptBackoff::default();
        let e = std::io::Error::from_raw_os_error(24); // EMFILE
        let waits: Vec<u64> = (0..9).map(|_| b.failed(&e).as_millis() as u64).collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 320, 500, 500]);
        b.reset();
        assert_eq!(b.failed(&e), Duration::from_millis(5));
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, x-private".parse().expect("v"),
        );
        h.insert("keep-alive", "timeout=5".parse().expect("v"));
        h.insert("x-private", "1".parse().expect("v"));
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().expect("v"));
        h.insert(header::CONTENT_LENGTH, "5".parse().expect("v"));
        h.insert("x-request-id", "abc".parse().expect("v"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-request-id"));
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("http%3A%2F%2Fa%3A1"), "http://a:1");
        assert_eq!(percent_decode("Qwen%2FQwen3-0.6B"), "Qwen/Qwen3-0.6B");
        assert_eq!(percent_decode("abc%2"), "abc%2");
        assert_eq!(percent_decode("%zz"), "%zz");
        assert_eq!(percent_decode("a%+1"), "a%+1");
        assert_eq!(percent_decode("%41%"), "A%");
    }

    #[test]
    fn bearer_tokens() {
        let mut h = HeaderMap::new();
        assert!(!bearer_ok(&h, "s3cret"));
        h.insert(header::AUTHORIZATION, "Bearer s3cret".parse().expect("v"));
        assert!(bearer_ok(&h, "s3cret"));
        h.insert(header::AUTHORIZATION, "bearer s3cret".parse().expect("v"));
        assert!(bearer_ok(&h, "s3cret"));
        h.insert(header::AUTHORIZATION, "Basic s3cret".parse().expect("v"));
        assert!(!bearer_ok(&h, "s3cret"));
        h.insert(header::AUTHORIZATION, "Bearer s3cret".parse().expect("v"));
        assert!(!bearer_ok(&h, "s3cre"));
        assert!(!bearer_ok(&h, ""));
    }
}
