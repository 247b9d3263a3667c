//! The shared state of one router: its config, registry, metrics, clocks, clients, retry
//! budget and background tasks. Above the registry and the metrics; below the drivers
//! (probe, track, proxy, admin) that take it.

use crate::clock::Clock;
use crate::metrics::GatewayMetrics;
use crate::recent::Recent;
use crate::registry::Registry;
use crate::tasks::Tasks;
use crate::upstream::{H2Upstream, PoolConfig, PoolUpstream, Upstream};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvmesh_config::{ServeConfig, UpstreamProtocol};
use kvmesh_policy::{AtomicRetryBudget, EjectionGuard, mix64};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What the mesh wants to hear of local changes that are not index changes (those go through
/// the prefix state's delta sink): engines added or removed through this router's admin API.
pub trait MeshHook: Send + Sync {
    /// An engine was added here.
    fn engine_added(&self, entry: &kvmesh_config::EngineEntry);
    /// An engine was removed here.
    fn engine_removed(&self, url: &str);
    /// `GET /admin/cluster`: members, digests, counters, and `slot`: where this router stands
    /// among the live routers as its policies were built with it (the registry's copy);
    /// `url_of` names an engine by its id (the registry's).
    fn status(
        &self,
        slot: kvmesh_policy::RouterSlot,
        url_of: &dyn Fn(u64) -> Option<String>,
    ) -> serde_json::Value;
    /// The router holds the cluster's state (ready to route as its peers do).
    fn is_warm(&self) -> bool;
    /// The mesh's metric families for `/metrics`, read at this instant.
    fn collector(&self) -> Box<dyn prometheus_client::collector::Collector>;
}

/// Watches this router's routing decisions as they are made (the benchmark's count of load
/// decisions against every router's own counts); not set in service.
pub trait DecisionObserver: Send + Sync {
    /// `engines[chosen]` (the route's engines) was chosen first, for `reason`, at `now_us` on
    /// the router's clock; `reserved`: this router's count on it already holds the request.
    fn decided(
        &self,
        engines: &[Arc<crate::engine::Engine>],
        chosen: usize,
        reason: kvmesh_policy::Reason,
        now_us: u64,
        reserved: bool,
    );
}

/// Shared state of one router.
pub struct Gateway {
    /// The configuration it started with.
    pub cfg: Arc<ServeConfig>,
    /// Engines and the routing snapshot.
    pub registry: Registry,
    /// HTTP client of the probes (health checks, discovery, scrapes).
    pub client: Client<HttpConnector, Full<Bytes>>,
    /// Where requests are forwarded (the in-task HTTP/1.1 pool or the HTTP/2 connections, as
    /// `upstream.protocol` says, or a mock in tests).
    pub upstream: Arc<dyn Upstream>,
    /// Metrics.
    pub metrics: GatewayMetrics,
    /// The last routing decisions (the status page's sample).
    pub recent: Recent,
    /// Time base.
    pub clock: Clock,
    /// Caps how much of the fleet breakers may eject.
    pub ejection: EjectionGuard,
    /// Background tasks: stopped and joined on shutdown.
    pub tasks: Tasks,
    /// The mesh, when this router is part of one.
    pub mesh: std::sync::OnceLock<Arc<dyn MeshHook>>,
    /// Told of every decision when set (benchmarks; one `OnceLock` load per request).
    pub decision_observer: std::sync::OnceLock<Arc<dyn DecisionObserver>>,
    /// Bounds retries to a fraction of requests (lock-free).
    pub retry_budget: AtomicRetryBudget,
    /// `cfg.request_id_header` parsed once (`None` when it is not a valid header name).
    pub request_id_name: Option<http::HeaderName>,
    /// Requests from web pages of other origins (`cors_allowed_origins`; `None`: off).
    pub(crate) cors: Option<crate::cors::Cors>,
    /// This router's mark on what it sends to engines (`x-kvmesh-via`, [`crate::hops`]):
    /// random per process.
    pub via: http::HeaderValue,
    seed: AtomicU64,
    pub(crate) started_unix: u64,
    /// Told to stop: `/health` answers 503 so that load balancers take the router out while
    /// it still serves (`shutdown_delay_ms`), then it stops accepting and drains.
    pub(crate) stopping: std::sync::atomic::AtomicBool,
    /// When the drain ends the answers still streaming (µs, cluster time; 0 = not
    /// draining): each is told with an error event before its connection closes.
    drain_cut_us: AtomicU64,
}

impl Gateway {
    /// The answers still streaming at `at` are ended there (see [`crate::track::TrackedBody`]).
    pub(crate) fn set_drain_cut(&self, at: tokio::time::Instant) {
        let us = self.clock.at_us(at).max(1);
        self.drain_cut_us.store(us, Ordering::Relaxed);
    }

    /// When the drain ends the answers still streaming, once the router drains.
    pub(crate) fn drain_cut(&self) -> Option<tokio::time::Instant> {
        match self.drain_cut_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(self.clock.instant_at(us)),
        }
    }

    /// A router's shared state, forwarding through `upstream` ([`PoolUpstream`] when `None`).
    /// No task is started: [`start`] does that.
    pub fn new(cfg: ServeConfig, upstream: Option<Arc<dyn Upstream>>) -> Gateway {
        let clock = Clock::default();
        let cfg = Arc::new(cfg);
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(cfg.timeouts.connect_ms)));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            .build(connector);
        let seed = if cfg.seed == 0 {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        } else {
            cfg.seed
        };
        let request_id_name = http::HeaderName::from_bytes(cfg.request_id_header.as_bytes()).ok();
        Gateway {
            cors: crate::cors::Cors::new(&cfg.cors_allowed_origins, request_id_name.as_ref()),
            registry: Registry::new(cfg.clone(), clock),
            ejection: EjectionGuard::new(&cfg.routing.health.ejection),
            retry_budget: AtomicRetryBudget::new(&cfg.routing.retry_budget, clock.now_us()),
            upstream: upstream.unwrap_or_else(|| {
                let pool = PoolConfig {
                    connect_timeout: Duration::from_millis(cfg.timeouts.connect_ms),
                    ..PoolConfig::default()
                };
                match cfg.upstream.protocol {
                    UpstreamProtocol::Http1 => Arc::new(PoolUpstream::new(pool)),
                    UpstreamProtocol::Http2 => Arc::new(H2Upstream::new(pool)),
                }
            }),
            client,
            metrics: GatewayMetrics::default(),
            recent: Recent::default(),
            clock,
            tasks: Tasks::default(),
            mesh: std::sync::OnceLock::new(),
            decision_observer: std::sync::OnceLock::new(),
            request_id_name,
            via: crate::hops::new_via(),
            seed: AtomicU64::new(seed),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            stopping: std::sync::atomic::AtomicBool::new(false),
            drain_cut_us: AtomicU64::new(0),
            cfg,
        }
    }

    /// A fresh per-request random seed.
    pub fn next_seed(&self) -> u64 {
        mix64(
            self.seed
                .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed),
        )
    }
}
