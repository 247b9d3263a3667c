//! Helpers for the router's acceptance tests: simulated engines and routers started
//! in-process on loopback, an HTTP client, a bounded load generator, metric scraping and
//! waits on conditions with deadlines.
#![allow(dead_code)]

pub mod mesh;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvmesh_config::{EngineEntry, ServeConfig, SimConfig};
use kvmesh_gateway::GatewayServer;
use kvmesh_sim::SimServer;
use serde_json::{Value, json};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled HTTP/1.1 client (loopback only in these tests).
pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Repository root (for tests/python).
pub fn repo_root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

// ---------------------------------------------------------------------------------------------
// Engines and routers.

/// A simulator config: ephemeral loopback port, the model name, fast time.
pub fn sim_cfg(model: &str) -> SimConfig {
    SimConfig {
        listen: "127.0.0.1:0".into(),
        model: model.into(),
        time_scale: 0.05,
        ..SimConfig::default()
    }
}

/// The same with the `instant` profile (every engine step takes zero time).
pub fn instant_sim_cfg(model: &str) -> SimConfig {
    let mut c = sim_cfg(model);
    c.engine.profile = "instant".into();
    c
}

/// Starts `n` simulators from `cfg(i)`.
pub async fn start_sims(n: usize, cfg: impl Fn(usize) -> SimConfig) -> Vec<SimServer> {
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let mut c = cfg(i);
        c.seed = i as u64 + 1;
        v.push(kvmesh_sim::start(c).await.expect("start sim"));
    }
    v
}

/// A router config in front of `engines`: loopback, fixed seed, and intervals short enough
/// that the health, breaker and slow-start state machines act within seconds.
pub fn serve_cfg(engines: &[String]) -> ServeConfig {
    let mut c = ServeConfig {
        listen: "127.0.0.1:0".into(),
        engines: engines
            .iter()
            .map(|u| EngineEntry {
                url: u.clone(),
                ..EngineEntry::default()
            })
            .collect(),
        seed: 42,
        discovery_interval_ms: 500,
        drain_timeout_ms: 10_000,
        ..ServeConfig::default()
    };
    let h = &mut c.routing.health;
    // Generous timeouts: on a loaded 2-core machine a check may take 100+ ms.
    h.active.interval_ms = 300;
    h.active.timeout_ms = 300;
    h.breaker.open_ms = 1_000;
    h.breaker.open_max_ms = 4_000;
    h.slow_start.window_ms = 3_000;
    c.timeouts.first_byte_ms = 20_000;
    c.timeouts.total_ms = 60_000;
    // `KVMESH_TEST_UPSTREAM=http2` runs the suite's routers over HTTP/2 to the engines.
    if std::env::var("KVMESH_TEST_UPSTREAM").is_ok_and(|v| v == "http2") {
        c.upstream.protocol = kvmesh_config::UpstreamProtocol::Http2;
    }
    c
}

/// Scales the router's latency bookkeeping by `f` (priors of 200 ms TTFT and 2 s end to end,
/// decay τ = 10 s, failure penalty ≥ 10 s: made for real engines) for engines that run `f`
/// times real time (`time_scale`), so that latency differences show as they would in a real
/// fleet and a failure's penalty fades on the same compressed time scale as the test.
pub fn scale_latency(cfg: &mut ServeConfig, f: f64) {
    let l = &mut cfg.routing.health.latency;
    let s = |v: u64| ((v as f64 * f) as u64).max(1);
    l.initial_ttft_ms = s(l.initial_ttft_ms);
    l.initial_e2e_ms = s(l.initial_e2e_ms);
    l.decay_ms = s(l.decay_ms);
    l.failure_penalty_ms = s(l.failure_penalty_ms);
}

/// Starts a router.
pub async fn start_router(cfg: ServeConfig) -> GatewayServer {
    kvmesh_gateway::start(cfg).await.expect("start router")
}

/// Starts a router and waits until `model` is routed to `n` engines (the first discovery
/// round is bounded; on a loaded machine an engine may be discovered by its loop a bit later).
pub async fn start_router_with(cfg: ServeConfig, model: &str, n: usize) -> GatewayServer {
    let router = start_router(cfg).await;
    wait_routable(&router, model, n).await;
    router
}

/// A `cache_aware` router in front of `sims` (all serving model `m`), once it routes to every
/// one of them; with the engines' URLs.
pub async fn cache_aware_router(sims: &[SimServer]) -> (GatewayServer, Vec<String>) {
    let engines = urls(sims);
    let mut cfg = serve_cfg(&engines);
    cfg.routing.policy.policy = kvmesh_policy::PolicyKind::CacheAware;
    let router = start_router_with(cfg, "m", engines.len()).await;
    (router, engines)
}

/// Waits until `model` is routed to `n` engines.
pub async fn wait_routable(router: &GatewayServer, model: &str, n: usize) {
    let gw = router.gateway.clone();
    let routed = || {
        gw.registry
            .snapshot()
            .routes
            .get(model)
            .map_or(0, |r| r.engines.len())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while routed() != n {
        if Instant::now() >= deadline {
            // Say what each engine answers, for the failure message.
            let c = client();
            let mut seen = Vec::new();
            for e in gw.registry.members() {
                let t = Instant::now();
                let r = send(
                    &c,
                    "GET",
                    &format!("{}/v1/models", e.url),
                    &[],
                    Bytes::new(),
                    Duration::from_secs(5),
                )
                .await;
                seen.push(format!(
                    "{}: models {:?}, healthy {}, GET /v1/models -> {} {:?} in {:?}",
                    e.url,
                    e.models(),
                    e.tracker().health().is_healthy(),
                    r.status,
                    r.error,
                    t.elapsed()
                ));
            }
            panic!("{model} not routed to {n} engines after 20 s: {seen:#?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// URLs of the simulators.
pub fn urls(sims: &[SimServer]) -> Vec<String> {
    sims.iter().map(|s| s.base_url()).collect()
}

/// Stops every simulator.
pub async fn stop_sims(sims: Vec<SimServer>) {
    for s in sims {
        s.shutdown(Duration::from_secs(2)).await;
    }
}

/// A TCP forwarder in front of an engine that can crash like a killed process: the listener
/// closes (new connections are refused) and every open connection is reset at once, in-flight
/// streams included. The router is given the proxy's address as the engine URL.
///
/// Between [`CrashProxy::crash`] and [`CrashProxy::restart`] the port stays reserved by a
/// bound socket that does not listen: connections to it are refused as they are by a dead
/// process, and no other socket on the machine (an outgoing connection's ephemeral port, a
/// listener bound to port 0) can take it, so the engine comes back on the address the router
/// knows.
pub struct CrashProxy {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    kill: tokio::sync::watch::Sender<bool>,
    accept: Option<tokio::task::JoinHandle<()>>,
    /// Where new connections are forwarded.
    target: Arc<std::sync::Mutex<std::net::SocketAddr>>,
    /// Holds the port while crashed.
    reserved: Option<tokio::net::TcpSocket>,
    /// Set: the engine is frozen (see [`CrashProxy::freeze`]).
    frozen: tokio::sync::watch::Sender<bool>,
}

/// A socket that can share its port with the proxy's other sockets (SO_REUSEPORT), bound to
/// `addr`.
fn shared_port_socket(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    let s = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    s.set_reuseaddr(true)?;
    s.set_reuseport(true)?;
    s.bind(addr)?;
    Ok(s)
}

impl CrashProxy {
    /// Listens on `listen` (port 0 for any) and forwards every connection to `target`.
    pub async fn start(listen: std::net::SocketAddr, target: std::net::SocketAddr) -> CrashProxy {
        let listener = shared_port_socket(listen)
            .and_then(|s| s.listen(1024))
            .unwrap_or_else(|e| panic!("cannot listen on {listen}: {e}"));
        let addr = listener.local_addr().expect("proxy addr");
        let target = Arc::new(std::sync::Mutex::new(target));
        let frozen = tokio::sync::watch::channel(false).0;
        let (kill, accept) = Self::serve(listener, target.clone(), frozen.subscribe());
        CrashProxy {
            addr,
            kill,
            accept: Some(accept),
            target,
            reserved: None,
            frozen,
        }
    }

    fn serve(
        listener: tokio::net::TcpListener,
        target: Arc<std::sync::Mutex<std::net::SocketAddr>>,
        frozen: tokio::sync::watch::Receiver<bool>,
    ) -> (
        tokio::sync::watch::Sender<bool>,
        tokio::task::JoinHandle<()>,
    ) {
        let (kill, rx) = tokio::sync::watch::channel(false);
        let accept = tokio::spawn(async move {
            let mut rx_accept = rx.clone();
            loop {
                let (mut down, _) = tokio::select! {
                    a = listener.accept() => match a {
                        Ok(a) => a,
                        Err(_) => continue,
                    },
                    _ = rx_accept.wait_for(|k| *k) => return,
                };
                let mut rx = rx.clone();
                let mut frozen = frozen.clone();
                let target = *target.lock().expect("proxy target");
                tokio::spawn(async move {
                    let _ = down.set_nodelay(true);
                    if *frozen.borrow() {
                        // Accepted (by the kernel, as a stopped process's are), never answered.
                        let _ = rx.wait_for(|k| *k).await;
                        return;
                    }
                    let Ok(mut up) = tokio::net::TcpStream::connect(target).await else {
                        let _ = down.set_zero_linger();
                        return;
                    };
                    let _ = up.set_nodelay(true);
                    let froze = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => false,
                        _ = rx.wait_for(|k| *k) => {
                            // Reset both sides, as a dying process's sockets are.
                            let _ = down.set_zero_linger();
                            let _ = up.set_zero_linger();
                            false
                        }
                        _ = frozen.wait_for(|f| *f) => true,
                    };
                    if froze {
                        // Open and silent until killed.
                        let _ = rx.wait_for(|k| *k).await;
                    }
                });
            }
        });
        (kill, accept)
    }

    /// Freezes, as `kill -STOP` does: connections stay open and new ones are accepted, but
    /// nothing is forwarded or answered any more.
    pub fn freeze(&self) {
        let _ = self.frozen.send(true);
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Crashes: stops listening and resets every open connection. When it returns the
    /// listener is closed and the port is held by a socket that refuses connections.
    pub async fn crash(&mut self) {
        if self.reserved.is_none() {
            self.reserved = Some(
                shared_port_socket(self.addr)
                    .unwrap_or_else(|e| panic!("cannot reserve {}: {e}", self.addr)),
            );
        }
        let _ = self.kill.send(true);
        if let Some(accept) = self.accept.take() {
            let _ = accept.await;
        }
    }

    /// Forwards the connections accepted from now on to `target`; open ones stay where they
    /// are (an engine restarted elsewhere behind the same address).
    pub fn retarget(&self, target: std::net::SocketAddr) {
        *self.target.lock().expect("proxy target") = target;
    }

    /// Comes back on the same address, now forwarding to `target` (a restarted engine).
    pub async fn restart(&mut self, target: std::net::SocketAddr) {
        assert!(self.accept.is_none(), "restart without a crash");
        let listener = shared_port_socket(self.addr)
            .and_then(|s| s.listen(1024))
            .unwrap_or_else(|e| panic!("cannot listen again on {}: {e}", self.addr));
        self.reserved = None;
        self.retarget(target);
        let (kill, accept) = Self::serve(listener, self.target.clone(), self.frozen.subscribe());
        self.kill = kill;
        self.accept = Some(accept);
    }
}

impl Drop for CrashProxy {
    fn drop(&mut self) {
        let _ = self.kill.send(true);
    }
}

// ---------------------------------------------------------------------------------------------
// Requests.

/// One answer as the client saw it.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status of the response head (0 when none arrived).
    pub status: u16,
    /// `x-kvmesh-engine`, when present.
    pub engine: Option<String>,
    /// Every response header.
    pub headers: http::HeaderMap,
    /// The body (as much as arrived).
    pub body: String,
    /// The body was read to its end without a transport error or timeout.
    pub complete: bool,
    /// Transport error or timeout, if any.
    pub error: Option<String>,
    /// When the request was sent, since the load started.
    pub sent_at: Duration,
}

impl Reply {
    /// A 2xx whose body arrived whole; for a stream, one that ended with `[DONE]` and carried
    /// no error event.
    pub fn ok(&self) -> bool {
        if !(200..300).contains(&self.status) || !self.complete {
            return false;
        }
        if self.is_stream() {
            self.body.contains("data: [DONE]") && !self.body.contains("data: {\"error\"")
        } else {
            true
        }
    }

    fn is_stream(&self) -> bool {
        self.body.starts_with("data: ")
    }

    /// The body as JSON (non-streaming answers).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::String(self.body.clone()))
    }
}

/// Sends a request and reads the whole answer, bounded by `timeout`.
pub async fn send(
    c: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
    timeout: Duration,
) -> Reply {
    let mut b = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(body.into())).expect("request");
    let mut reply = Reply {
        status: 0,
        engine: None,
        headers: http::HeaderMap::new(),
        body: String::new(),
        complete: false,
        error: None,
        sent_at: Duration::ZERO,
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let resp = match tokio::time::timeout_at(deadline, c.request(req)).await {
        Err(_) => {
            reply.error = Some("timeout before the response head".into());
            return reply;
        }
        Ok(Err(e)) => {
            reply.error = Some(format!("{e:?}"));
            return reply;
        }
        Ok(Ok(r)) => r,
    };
    reply.status = resp.status().as_u16();
    reply.engine = resp
        .headers()
        .get("x-kvmesh-engine")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    reply.headers = resp.headers().clone();
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                reply.error = Some("timeout in the body".into());
                break;
            }
            Ok(None) => {
                reply.complete = true;
                break;
            }
            Ok(Some(Err(e))) => {
                reply.error = Some(format!("{e:?}"));
                break;
            }
            Ok(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    buf.extend_from_slice(d);
                }
            }
        }
    }
    reply.body = String::from_utf8_lossy(&buf).into_owned();
    reply
}

/// POSTs JSON (30 s bound).
pub async fn post_json(c: &HttpClient, url: &str, body: &Value) -> Reply {
    send(
        c,
        "POST",
        url,
        &[],
        body.to_string(),
        Duration::from_secs(30),
    )
    .await
}

/// GETs (30 s bound); returns (status, body).
pub async fn get(c: &HttpClient, url: &str) -> (u16, String) {
    let r = send(c, "GET", url, &[], Bytes::new(), Duration::from_secs(30)).await;
    assert!(r.complete, "GET {url}: {:?}", r.error);
    (r.status, r.body)
}

/// A chat request body.
pub fn chat_body(model: &str, text: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// A completion request body.
pub fn completion_body(model: &str, text: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": model, "prompt": text, "max_tokens": max_tokens, "stream": stream})
}

/// Sets faults on a simulator.
pub async fn set_faults(c: &HttpClient, sim_base: &str, faults: Value) {
    let r = post_json(c, &format!("{sim_base}/admin/faults"), &faults).await;
    assert_eq!(r.status, 200, "faults {faults}: {}", r.body);
}

/// Clears a simulator's faults.
pub async fn clear_faults(c: &HttpClient, sim_base: &str) {
    let r = send(
        c,
        "DELETE",
        &format!("{sim_base}/admin/faults"),
        &[],
        Bytes::new(),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

// ---------------------------------------------------------------------------------------------
// Load.

/// A bounded closed-loop load: `concurrency` workers send requests back to back until
/// `max_requests` were sent, `max_time` passed, or `stop` was set, whichever comes first.
pub struct Load {
    pub concurrency: usize,
    pub max_requests: u64,
    pub max_time: Duration,
    /// Per-request bound.
    pub request_timeout: Duration,
}

impl Default for Load {
    fn default() -> Self {
        Load {
            concurrency: 8,
            max_requests: 400,
            max_time: Duration::from_secs(20),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// What request number `i` sends: extra headers and the JSON body.
pub type MakeRequest = Arc<dyn Fn(u64) -> (Vec<(String, String)>, Value) + Send + Sync>;

/// Runs the load against `url`; returns the replies in completion order.
pub async fn run_load(
    c: &HttpClient,
    url: &str,
    load: &Load,
    stop: Arc<AtomicBool>,
    make: MakeRequest,
) -> Vec<Reply> {
    let next = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..load.concurrency {
        let (c, url, next, stop, make) = (
            c.clone(),
            url.to_string(),
            next.clone(),
            stop.clone(),
            make.clone(),
        );
        let (max_requests, max_time, timeout) =
            (load.max_requests, load.max_time, load.request_timeout);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                if stop.load(Ordering::Relaxed) || t0.elapsed() >= max_time {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= max_requests {
                    break;
                }
                let (headers, body) = make(i);
                let h: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                let sent_at = t0.elapsed();
                let mut r = send(&c, "POST", &url, &h, body.to_string(), timeout).await;
                r.sent_at = sent_at;
                out.push(r);
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("load worker"));
    }
    all
}

/// Replies that are not [`Reply::ok`], summarised for an assertion message.
pub fn failures(replies: &[Reply]) -> Vec<String> {
    replies
        .iter()
        .filter(|r| !r.ok())
        .map(|r| {
            format!(
                "status {} engine {:?} error {:?} body {:.200}",
                r.status, r.engine, r.error, r.body
            )
        })
        .collect()
}

/// The router's `x-kvmesh-predicted-cached-tokens` of a reply (0 when absent).
pub fn predicted_tokens(r: &Reply) -> u64 {
    r.headers
        .get("x-kvmesh-predicted-cached-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Metrics.

/// Sum of the samples of `name` (all label sets) in a Prometheus page.
pub fn metric(page: &str, name: &str) -> f64 {
    samples(page, name, |_| true)
}

/// Sum of the samples of `name` whose labels contain `engine="URL"`.
pub fn engine_metric(page: &str, name: &str, engine: &str) -> f64 {
    let label = format!("engine=\"{engine}\"");
    samples(page, name, |labels| labels.contains(&label))
}

/// The same, restricted to samples with `kind="KIND"` too.
pub fn engine_kind_metric(page: &str, name: &str, engine: &str, kind: &str) -> f64 {
    let label = format!("engine=\"{engine}\"");
    let k = format!("kind=\"{kind}\"");
    samples(page, name, |labels| {
        labels.contains(&label) && labels.contains(&k)
    })
}

fn samples(page: &str, name: &str, keep: impl Fn(&str) -> bool) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
                let (labels, v) = r.split_once('}')?;
                (labels, v)
            } else if rest.starts_with(' ') {
                ("", rest)
            } else {
                return None;
            };
            keep(labels).then(|| value.trim().parse::<f64>().ok())?
        })
        .fold(0.0, |a, b| a + b)
}

/// A router's (or engine's) `/metrics` page.
pub async fn scrape(c: &HttpClient, base: &str) -> String {
    let (s, b) = get(c, &format!("{base}/metrics")).await;
    assert_eq!(s, 200, "{b}");
    b
}

/// Attempts sent to each engine, from the router's page.
pub fn attempts(page: &str, engines: &[String]) -> Vec<f64> {
    engines
        .iter()
        .map(|e| engine_metric(page, "kvmesh_engine_requests_total", e))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Waiting.

/// Polls `cond` every 20 ms until it is true; panics with `what` after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if cond().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An OpenAI-shaped error body: `{"error": {"message": str, "type": str, ...}}`.
pub fn assert_openai_error(r: &Reply, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "not an OpenAI error: {}",
        r.body
    );
    assert!(v["error"]["type"].is_string(), "no error.type: {}", r.body);
    v
}

/// Streams the chat request `body` to the router at `base` (a 200 expected) and reads its
/// first `frames` data frames: the answer's headers, its body and what it held so far.
pub async fn stream_started(
    c: &HttpClient,
    base: &str,
    body: &Value,
    frames: usize,
) -> (http::HeaderMap, hyper::body::Incoming, Vec<u8>) {
    let req = http::Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(20), c.request(req))
        .await
        .expect("head in time")
        .expect("send");
    assert_eq!(resp.status(), 200);
    let (head, mut stream) = resp.into_parts();
    let mut text = Vec::new();
    for _ in 0..frames {
        let f = tokio::time::timeout(Duration::from_secs(10), stream.frame())
            .await
            .expect("frame in time")
            .expect("a frame")
            .expect("frame ok");
        text.extend_from_slice(f.data_ref().expect("data"));
    }
    (head.headers, stream, text)
}
