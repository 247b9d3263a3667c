//! `kvmesh serve`: the router's HTTP shell around the pure policies of [`kvmesh_policy`].
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions`: routed per model, proxied with
//!   retries on another engine before the first byte, streamed through unbuffered;
//! - `GET /v1/models` (union of the engines' models), `GET /v1/models/{model}`,
//!   `GET /health`, `GET /metrics`;
//! - `GET/POST/DELETE /admin/engines` behind a bearer token;
//! - `GET /` the status page, polling `GET /status.json` and `GET /admin/cluster`.
//!
//! Per engine a background loop runs active health checks and reads `/v1/models` and
//! `/metrics`; DNS names are re-resolved periodically.

#![forbid(unsafe_code)]
// Modules import one way only, leaves first: clock, upstream, tasks, hops, cors, recent, memo,
// prefix, engine, registry, metrics, gateway, models, ingest, track, probe, cluster, proxy,
// admin, status
// (ARCHITECTURE.md, "The gateway's modules"; tests/module_order.rs holds it).
mod admin;
mod clock;
mod cluster;
mod cors;
mod engine;
mod gateway;
pub mod hops;
pub mod ingest;
pub mod memo;
mod metrics;
mod models;
pub mod prefix;
mod probe;
mod proxy;
pub mod recent;
mod registry;
mod sse;
mod status;
mod tasks;
mod track;
pub mod upstream;

pub use clock::Clock;
pub use engine::{Engine, EngineMetrics, IngestStatus, Source};
pub use gateway::{DecisionObserver, Gateway};
pub use probe::scrape;
pub use registry::{Registry, Snapshot};
pub use tasks::Tasks;
pub use upstream::{MockReply, MockUpstream, Upstream};

use http::{Method, Request, Response};
use hyper::body::Incoming;
use kvmesh_config::ServeConfig;
use kvmesh_http::{Body, error, json, not_allowed, ok_empty, openmetrics};
use kvmesh_openai::ApiError;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Invalid configuration.
    #[error("{0}")]
    Config(String),
    /// The listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// A running router.
pub struct GatewayServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its shared state (tests read metrics and the registry).
    pub gateway: Arc<Gateway>,
    /// Its part in the mesh, when it is in one.
    pub cluster: Option<Arc<cluster::Cluster>>,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl GatewayServer {
    /// `http://ADDR`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answers `/health` with 503 from now on while serving as before: load balancers and
    /// readiness probes take the router out before it stops accepting
    /// ([`GatewayServer::stop`] waits `shutdown_delay_ms` after this).
    pub fn announce_stop(&self) {
        self.gateway
            .stopping
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// A stop as a signal asks for it: [`GatewayServer::announce_stop`], `shutdown_delay_ms`
    /// of serving on (cut short by `early`, a second signal), then [`GatewayServer::shutdown`].
    pub async fn stop(self, early: impl std::future::Future<Output = ()>) {
        self.announce_stop();
        let delay = Duration::from_millis(self.gateway.cfg.shutdown_delay_ms);
        if !delay.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = early => {}
            }
        }
        self.shutdown().await;
    }

    /// Stops accepting, drains in-flight requests (bounded by the config's drain timeout),
    /// then leaves the mesh: while it drains, its peers still count its requests, and the
    /// engines it reads the events of are still read.
    pub async fn shutdown(mut self) {
        // Answers still streaming when the drain ends are told why before their connections
        // close: a little before, so that the error event is written first.
        let timeout = Duration::from_millis(self.gateway.cfg.drain_timeout_ms);
        let early = (timeout / 10).min(Duration::from_millis(250));
        self.gateway
            .set_drain_cut(tokio::time::Instant::now() + (timeout - early));
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let drain = Duration::from_millis(self.gateway.cfg.drain_timeout_ms.saturating_add(1000));
        let _ = tokio::time::timeout(drain, &mut self.task).await;
        if let Some(c) = &self.cluster {
            c.leave().await;
        }
        // Requests drained: stop and join the background tasks.
        self.gateway.tasks.shutdown(Duration::from_secs(5)).await;
    }
}

impl Drop for GatewayServer {
    fn drop(&mut self) {
        self.gateway.tasks.cancel();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Starts a router: registers the engines, runs a first discovery round (so that models are
/// known before the first request), starts the background loops and the listener.
pub async fn start(cfg: ServeConfig) -> Result<GatewayServer, GatewayError> {
    let whole = kvmesh_config::KvmeshConfig {
        serve: cfg.clone(),
        ..Default::default()
    };
    whole
        .validate()
        .map_err(|e| GatewayError::Config(e.to_string()))?;
    let gw = Arc::new(Gateway::new(cfg, None));
    // Tokenizers of cache-aware policies load now: a bad path stops start-up.
    for (key, p) in tokenizers_at_start(&gw.cfg) {
        gw.registry
            .prefix
            .tokenizer(p)
            .map_err(|e| GatewayError::Config(format!("{key}: {e}")))?;
    }
    // The port is taken before anything starts (QA33: engines were added, and logged, before
    // a port in use stopped start-up); connections wait in its backlog until it serves.
    let listener = tokio::net::TcpListener::bind(&gw.cfg.listen)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: gw.cfg.listen.clone(),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| GatewayError::Bind {
        addr: gw.cfg.listen.clone(),
        source,
    })?;
    gw.registry.set_listen(addr);
    spawn_sweeper(&gw);
    spawn_reference_refresh(&gw);
    for e in gw.cfg.engines.clone() {
        probe::add_engine(&gw, &e, Source::Static, false).map_err(GatewayError::Config)?;
    }
    for d in gw.cfg.dns.clone() {
        // Engines found at start-up do not ramp (like the static ones); later ones do.
        let mut known = probe::Known::default();
        probe::resolve_once(&gw, &d, false, &mut known).await;
        probe::spawn_dns_loop(gw.clone(), d, known);
    }
    // First discovery, bounded: engines that do not answer are picked up by their loops.
    let members = gw.registry.members();
    let first = futures_join(members.iter().map(|e| {
        let gw = gw.clone();
        let e = e.clone();
        async move { probe::discover(&gw, &e).await }
    }));
    let _ = tokio::time::timeout(Duration::from_secs(3), first).await;
    gw.registry.refresh_fleet_latency();
    let cluster = if gw.cfg.mesh.enabled {
        Some(
            cluster::Cluster::start(&gw, &gw.cfg.mesh)
                .await
                .map_err(GatewayError::Config)?,
        )
    } else {
        None
    };

    let (tx, rx) = oneshot::channel();
    let drain = Duration::from_millis(gw.cfg.drain_timeout_ms);
    let limits = kvmesh_http::ServeLimits {
        max_connections: gw.cfg.max_connections,
        header_read_timeout: Duration::from_millis(gw.cfg.header_read_timeout_ms),
        http2: false,
        send_timeout: Duration::from_millis(gw.cfg.send_timeout_ms),
        counters: Some(gw.metrics.connections.clone()),
        // hyper's 100, parsed on the stack (the simulator takes more: the router adds its own).
        max_headers: None,
    };
    let task = tokio::spawn(kvmesh_http::serve(
        listener,
        gw.clone(),
        route,
        rx,
        drain,
        limits,
    ));
    tracing::info!(%addr, engines = members.len(), models = ?gw.registry.models(), "kvmesh serve listening");
    Ok(GatewayServer {
        addr,
        cluster,
        gateway: gw,
        shutdown: Some(tx),
        task,
    })
}

/// Drops expired speculative prefix entries once a second (lookups already ignore them; this
/// returns their memory and capacity).
fn spawn_sweeper(gw: &Arc<Gateway>) {
    spawn_every(gw, Duration::from_secs(1), |g| {
        g.registry.prefix.sweep(g.clock.now_us());
    });
}

/// Recomputes the fleet's median latency (the reference of the automatic weights) every
/// `auto_weight.reference_refresh_ms`: one O(engines) pass per period whatever the fleet's
/// size, and a reference that follows a slowdown of the whole fleet before it derates anyone.
fn spawn_reference_refresh(gw: &Arc<Gateway>) {
    let every = Duration::from_millis(gw.cfg.routing.health.auto_weight.reference_refresh_ms);
    spawn_every(gw, every, |g| g.registry.refresh_fleet_latency());
}

/// Runs `f` every `period` (the first time at once) among the router's tasks, until it stops.
fn spawn_every(gw: &Arc<Gateway>, period: Duration, f: impl Fn(&Gateway) + Send + 'static) {
    let g = gw.clone();
    gw.tasks.spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            f(&g);
        }
    });
}

/// Runs the futures concurrently (one task each) and waits for all of them.
async fn futures_join<F>(futs: impl Iterator<Item = F>)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let tasks: Vec<_> = futs.map(tokio::spawn).collect();
    for t in tasks {
        let _ = t.await;
    }
}

/// The client's request id when it sent a usable one (shared with the request's buffer, no
/// copy), else a new one.
fn request_id(gw: &Gateway, req: &Request<Incoming>) -> http::HeaderValue {
    if let Some(v) = gw
        .request_id_name
        .as_ref()
        .and_then(|n| req.headers().get(n))
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.to_str().is_ok())
    {
        return v.clone();
    }
    // "kvm-" and 16 hex digits, formatted without an intermediate String.
    let mut id = [0u8; 20];
    id[..4].copy_from_slice(b"kvm-");
    let seed = gw.next_seed();
    for (i, b) in id[4..].iter_mut().enumerate() {
        *b = b"0123456789abcdef"[((seed >> (60 - 4 * i)) & 0xf) as usize];
    }
    http::HeaderValue::from_bytes(&id).unwrap_or_else(|_| http::HeaderValue::from_static("kvm"))
}

async fn route(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<Body> {
    // A browser's request from another origin, CORS on: its answer says the origin may read
    // it (the preflight, `OPTIONS`, is answered whole in `other`).
    if gw.cors.is_some()
        && req.method() != Method::OPTIONS
        && let Some(origin) = req.headers().get(http::header::ORIGIN).cloned()
    {
        let g = gw.clone();
        let mut resp = route_all(gw, req).await;
        if let Some(c) = &g.cors {
            c.decorate(&origin, &mut resp);
        }
        return resp;
    }
    route_all(gw, req).await
}

async fn route_all(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<Body> {
    let rid = request_id(&gw, &req);
    let refused = match hops::looped(&gw.via, req.headers()) {
        Some(e) => {
            tracing::warn!(path = %req.uri().path(), error = %e.message, "routing loop refused: an engine's address leads back to this router");
            Some(e)
        }
        None => hostless(&req),
    };
    let mut resp = if let Some(e) = refused {
        gw.metrics.error_response(e.status);
        error(&e)
    } else if req.method() == Method::POST
        && matches!(req.uri().path(), "/v1/chat/completions" | "/v1/completions")
    {
        // The hot path, before anything is copied out of the request.
        return proxy::inference(gw, req, rid).await;
    } else {
        other(&gw, req).await
    };
    // Every answer carries the request's id, as the inference answers do (QA27: a 404, a
    // 405 or /v1/models came without it; QA29: a routing loop's 508).
    if let Some(n) = &gw.request_id_name {
        resp.headers_mut().insert(n.clone(), rid);
    }
    resp
}

/// The tokenizers a router loads at start (those of cache-aware policies, and any a model
/// names), each once, with the key that names it.
fn tokenizers_at_start(cfg: &ServeConfig) -> Vec<(String, &str)> {
    let mut paths: Vec<(String, &str)> = Vec::new();
    if cfg.routing.policy.policy.uses_prefix() {
        paths.push(("serve.prefix.tokenizer".into(), &cfg.prefix.tokenizer));
    }
    for (m, mc) in &cfg.models {
        if cfg.model_policy(m).policy.uses_prefix() || mc.tokenizer.is_some() {
            let key = match mc.tokenizer {
                Some(_) => format!("serve.models.\"{m}\".tokenizer"),
                None => "serve.prefix.tokenizer".into(),
            };
            paths.push((key, cfg.model_tokenizer(m)));
        }
    }
    paths.sort_unstable_by(|a, b| a.1.cmp(b.1));
    paths.dedup_by(|a, b| a.1 == b.1);
    paths
}

/// Loads every tokenizer the router would load at start (`kvmesh serve --check-config`): an
/// error names the key (QA33: the check only saw that the path existed).
pub fn check_tokenizers(cfg: &ServeConfig) -> Result<(), String> {
    for (key, p) in tokenizers_at_start(cfg) {
        prefix::load_tokenizer(p).map_err(|e| format!("{key}: {e}"))?;
    }
    Ok(())
}

/// An HTTP/1.1 request without exactly one `Host`, or with one that is not `host[:port]`, is
/// refused (RFC 9112 §3.2: the server answers it with a 400), as nginx does (QA29: the router
/// served one; QA31: `Host: a, b`, two lines a proxy merged, passed).
fn hostless(req: &Request<Incoming>) -> Option<ApiError> {
    if req.version() != http::Version::HTTP_11 {
        return None;
    }
    let mut hosts = req.headers().get_all(http::header::HOST).iter();
    let why = match (hosts.next(), hosts.next()) {
        (Some(h), None) if host_ok(h.as_bytes()) => return None,
        (Some(h), None) => format!(
            "the Host header is not host[:port]: {:?}",
            kvmesh_openai::clip(&String::from_utf8_lossy(h.as_bytes()))
        ),
        (None, _) => "an HTTP/1.1 request carries a Host header; this one carried none".into(),
        (Some(_), Some(_)) => {
            "an HTTP/1.1 request carries one Host header; this one carried more".into()
        }
    };
    Some(ApiError::bad_request("invalid_host", why))
}

/// `host[:port]` as RFC 9110 §7.2 has it (RFC 3986's IP literal or registered name, and a
/// port up to 65535; empty: a target without an authority). Read in place: no copy.
fn host_ok(h: &[u8]) -> bool {
    let (host, port) = match h.iter().position(|&b| b == b']') {
        Some(i) if h[0] == b'[' => (&h[1..i], &h[i + 1..]),
        Some(_) => return false,
        None => match h.iter().rposition(|&b| b == b':') {
            Some(i) => (&h[..i], &h[i..]),
            None => (h, &h[h.len()..]),
        },
    };
    let port_ok = match port {
        [] | [b':'] => true,
        [b':', d @ ..] => {
            d.len() <= 5
                && d.iter().all(u8::is_ascii_digit)
                && d.iter().fold(0u32, |n, &c| n * 10 + u32::from(c - b'0')) <= 65_535
        }
        _ => false,
    };
    let host_ok = if h.first() == Some(&b'[') {
        // An address, a zone (`%25eth0`) or an IPvFuture: what they are made of.
        !host.is_empty()
            && host
                .iter()
                .all(|&b| b.is_ascii_alphanumeric() || b":.%-_~".contains(&b))
    } else {
        host.iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=%".contains(&b))
    };
    port_ok && host_ok
}

/// Every route but inference.
async fn other(gw: &Arc<Gateway>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    // HEAD is GET without the body (hyper sends the head only).
    let as_method = if method == Method::HEAD {
        Method::GET
    } else {
        method.clone()
    };
    if method == Method::OPTIONS
        && let Some(allow) = cors::methods_of(&path)
    {
        return cors::options(gw.cors.as_ref(), req.headers(), allow);
    }
    match (&as_method, path.as_str()) {
        (&Method::GET, "/v1/models") => models::list(gw),
        (&Method::GET, p) if p.starts_with("/v1/models/") => models::one(gw, &p[11..]),
        (&Method::GET, "/") => status::page(),
        (&Method::GET, "/status.json") => status::status_json(gw),
        (&Method::GET, "/health") => {
            if gw.stopping.load(std::sync::atomic::Ordering::Relaxed) {
                error(&ApiError::unavailable(
                    "shutting down: still serving, no longer ready",
                ))
            } else if gw.registry.models().is_empty() {
                error(&ApiError::unavailable("no engine serves any model yet"))
            } else if gw.mesh.get().is_some_and(|m| !m.is_warm()) {
                error(&ApiError::unavailable(
                    "joining the mesh: the cluster's state has not arrived yet",
                ))
            } else {
                ok_empty()
            }
        }
        (&Method::GET, "/metrics") => openmetrics(gw.metrics.render_with(
            &gw.registry,
            gw.clock.now_us(),
            gw.mesh.get().map(|m| m.collector()),
        )),
        (_, "/admin/engines") => admin::engines(gw, req).await,
        (&Method::GET, "/admin/cluster") => match gw.mesh.get() {
            Some(m) => {
                // From the routing snapshot, read once (no registry lock taken while the
                // status holds the mesh node's).
                let snap = gw.registry.snapshot();
                let urls: std::collections::HashMap<u64, &str> = snap
                    .engines
                    .iter()
                    .map(|e| (e.id.0, e.url.as_str()))
                    .collect();
                let url_of = |id: u64| urls.get(&id).map(|u| (*u).to_string());
                json(
                    200,
                    m.status(gw.registry.router_slot(), &url_of).to_string(),
                )
            }
            None => json(
                200,
                serde_json::json!({ "mesh": "disabled", "members": [] }).to_string(),
            ),
        },
        (_, "/v1/chat/completions" | "/v1/completions") => not_allowed(&method, &path, "POST"),
        (_, "/v1/models" | "/health" | "/metrics" | "/admin/cluster" | "/" | "/status.json") => {
            not_allowed(&method, &path, "GET, HEAD")
        }
        (_, p) if p.starts_with("/v1/models/") => not_allowed(&method, &path, "GET, HEAD"),
        _ => error(&ApiError::not_found(method.as_str(), &path)),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn hosts_are_host_and_port() {
        let good = [
            "a",
            "example.com:8080",
            "127.0.0.1",
            "[::1]:80",
            "[::1]",
            "[fe80::1%25eth0]:1",
            "a:",
            "a:65535",
            "a,b",
            "",
        ];
        for ok in good {
            assert!(super::host_ok(ok.as_bytes()), "{ok}");
        }
        let bad = [
            "a, b",
            "a b",
            "a/b",
            "[::1",
            "::1]",
            "[]",
            "[::1/8]",
            "a:99999999",
            "a:65536",
            "a:x",
            "u@a",
            "a:-1",
            "[::1]x",
            "a\tb",
        ];
        for bad in bad {
            assert!(!super::host_ok(bad.as_bytes()), "{bad}");
        }
    }

    /// `--check-config` loads the tokenizers the router would load, and a refusal names the
    /// key (QA33: a directory without tokenizer.json, or a JSON file that is no tokenizer,
    /// passed the check, which only saw that the path existed, and start-up failed).
    #[test]
    fn the_check_loads_the_tokenizers_start_up_loads() {
        let dir = std::env::temp_dir().join(format!("kvmesh-tok-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let not_one = dir.join("not-a-tokenizer.json");
        std::fs::write(&not_one, "{}").expect("write");
        let mut cfg = kvmesh_config::ServeConfig::default();
        cfg.routing.policy.policy = kvmesh_policy::PolicyKind::CacheAware;
        super::check_tokenizers(&cfg).expect("the bundled tokenizer loads");
        for bad in [&dir, &not_one] {
            cfg.prefix.tokenizer = bad.to_string_lossy().into_owned();
            let e = super::check_tokenizers(&cfg).expect_err("not a tokenizer");
            assert!(
                e.starts_with("serve.prefix.tokenizer: cannot load tokenizer"),
                "{e}"
            );
        }
        // A policy that does not read prompts loads none.
        cfg.routing.policy.policy = kvmesh_policy::PolicyKind::RoundRobin;
        super::check_tokenizers(&cfg).expect("nothing to load");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
