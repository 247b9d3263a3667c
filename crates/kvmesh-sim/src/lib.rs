//! `kvmesh sim`: one simulated inference engine behind vLLM's interfaces.
//!
//! A thin shell around the pure engine model ([`kvmesh_engine`]):
//! - an OpenAI-compatible HTTP API (hyper) with vLLM's extras (`/metrics`, `/tokenize`,
//!   `/reset_prefix_cache`) and run-time fault control (`/admin/*`);
//! - an OS thread that steps the model in real time (scaled by `time_scale`);
//! - a ZMQ publisher of vLLM-format KV-cache events (with an optional replay socket).
//!
//! Start one in-process with [`start`] (tests do) or from the `kvmesh sim` command.

#![forbid(unsafe_code)]
mod api;
mod engine_thread;
mod events;
mod faults;
mod fleet;
mod http;
mod metrics;
mod state;

pub use engine_thread::EngineHandle;
pub use events::to_kv_event;
pub use fleet::{LocalFleet, start_fleet};

use kvmesh_config::SimConfig;
use kvmesh_engine::EngineParams;
use kvmesh_tokenize::Tokenizer;
use metrics::SimMetrics;
use state::AppState;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
use tokio::sync::oneshot;

/// Headers a request to the simulator may have (see `start`).
pub const SIM_MAX_HEADERS: usize = 256;

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Invalid configuration.
    #[error("{0}")]
    Config(String),
    /// The tokenizer could not be loaded.
    #[error("sim.tokenizer (--tokenizer): {0}")]
    Tokenizer(String),
    /// A socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The KV-event publisher could not start.
    #[error("KV events: {0}")]
    Events(String),
    /// Any other I/O failure.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A running simulator.
pub struct SimServer {
    /// Where the HTTP API listens (the real port when 0 was asked).
    pub http_addr: SocketAddr,
    /// The KV-event PUB endpoint as bound (the real port when 0 was asked), if events are on.
    pub kv_events_endpoint: Option<String>,
    /// The KV-event replay endpoint as bound, if there is one.
    pub kv_replay_endpoint: Option<String>,
    shutdown: Option<oneshot::Sender<()>>,
    http_task: tokio::task::JoinHandle<()>,
    engine: EngineHandle,
    engine_join: Option<std::thread::JoinHandle<()>>,
}

impl SimServer {
    /// `http://ADDR`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// Stops accepting, drains open requests for up to `drain`, stops the engine.
    pub async fn shutdown(mut self, drain: Duration) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = tokio::time::timeout(drain + Duration::from_secs(1), &mut self.http_task).await;
        self.engine.send(engine_thread::Command::Shutdown);
        if let Some(j) = self.engine_join.take() {
            let _ = tokio::task::spawn_blocking(move || j.join()).await;
        }
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.engine.send(engine_thread::Command::Shutdown);
    }
}

/// Loads the tokenizer named by the config (empty = the bundled Qwen3).
pub fn load_tokenizer(path: &str) -> Result<Tokenizer, SimError> {
    if path.is_empty() {
        Tokenizer::bundled_default()
    } else {
        Tokenizer::from_path(std::path::Path::new(path))
    }
    .map_err(|e| SimError::Tokenizer(e.to_string()))
}

/// Token ids the engine samples its outputs from: the tokens of an ordinary English text, so
/// that generated answers read as words and re-tokenize stably in later turns.
fn output_vocab(tok: &Tokenizer) -> Vec<u32> {
    const TEXT: &str = "The router sends each request to the engine that already holds the \
        longest prefix of its prompt in the cache, so the prefill is short and the first token \
        comes back quickly. When the engines are busy it weighs the load as well, because a \
        cache hit on an overloaded engine is slower than a miss on an idle one. Every answer \
        here is made of plain words like these, chosen at random from a small list.";
    let mut ids = tok.encode(TEXT, false).unwrap_or_default();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Starts a simulator: binds the HTTP listener and the KV-event sockets, loads the tokenizer,
/// starts the engine thread. Must be called inside a tokio runtime.
pub async fn start(cfg: SimConfig) -> Result<SimServer, SimError> {
    let wrapper = kvmesh_config::KvmeshConfig {
        sim: cfg.clone(),
        ..Default::default()
    };
    wrapper
        .validate()
        .map_err(|e| SimError::Config(e.to_string()))?;
    let tokenizer = load_tokenizer(&cfg.tokenizer)?;
    let mut params = EngineParams::from_config(&cfg.engine, cfg.max_model_len, cfg.seed)
        .map_err(SimError::Config)?;
    params.output_vocab = output_vocab(&tokenizer);

    let metrics = Arc::new(SimMetrics::new(&cfg.model));
    let drop_events = Arc::new(AtomicBool::new(cfg.faults.drop_events));
    let events = if cfg.kv_events.endpoint.is_empty() {
        None
    } else {
        Some(events::EventSink::start(&cfg.kv_events, drop_events.clone(), metrics.clone()).await?)
    };
    let (kv_events_endpoint, kv_replay_endpoint) = match &events {
        Some(sink) => {
            let (e, r) = sink.endpoints();
            (Some(e), r)
        }
        None => (None, None),
    };
    let (engine, engine_join) = engine_thread::spawn(
        params,
        cfg.time_scale,
        cfg.faults.slowdown,
        cfg.faults.hang,
        events,
        metrics.clone(),
    )?;
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .map_err(|source| SimError::Bind {
            addr: cfg.listen.clone(),
            source,
        })?;
    let http_addr = listener.local_addr()?;
    let state = Arc::new(AppState::new(
        cfg,
        tokenizer,
        engine.clone(),
        metrics,
        drop_events,
    ));
    let (tx, rx) = oneshot::channel();
    let http_task = tokio::spawn(kvmesh_http::serve(
        listener,
        state,
        http::route,
        rx,
        Duration::from_secs(30),
        // HTTP/1.1 as vLLM serves it, and h2c on the same port for routers that speak it.
        // More headers than a router takes from its clients (hyper's 100): a router adds its
        // own (`x-kvmesh-via`, the request id), and uvicorn, which vLLM runs on, bounds
        // their size, not their number (QA: a client's 99 headers came back as the sim's 431).
        kvmesh_http::ServeLimits {
            http2: true,
            max_headers: Some(SIM_MAX_HEADERS),
            ..kvmesh_http::ServeLimits::default()
        },
    ));
    tracing::info!(%http_addr, "kvmesh sim listening");
    Ok(SimServer {
        http_addr,
        kv_events_endpoint,
        kv_replay_endpoint,
        shutdown: Some(tx),
        http_task,
        engine,
        engine_join: Some(engine_join),
    })
}
