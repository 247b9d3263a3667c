//! State shared by the HTTP handlers of one simulated engine.

use crate::engine_thread::{Command, EngineHandle};
use crate::faults::Faults;
use crate::metrics::SimMetrics;
use kvmesh_config::{FaultConfig, SimConfig};
use kvmesh_openai::ApiError;
use kvmesh_tokenize::Tokenizer;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Everything a handler needs. Locks are never held across an await.
pub struct AppState {
    /// The configuration the simulator started with.
    pub cfg: SimConfig,
    /// Tokenizer and chat template (the same the router uses).
    pub tokenizer: Tokenizer,
    /// The engine thread.
    pub engine: EngineHandle,
    /// Metrics.
    pub metrics: Arc<SimMetrics>,
    /// Read by the KV-event publisher: drop batches instead of sending them.
    pub drop_events: Arc<AtomicBool>,
    /// Unix seconds at start-up.
    pub started_unix: u64,
    faults: Mutex<Faults>,
    next_id: AtomicU64,
}

impl AppState {
    /// Shared state; pushes the start-up faults into the engine.
    pub fn new(
        cfg: SimConfig,
        tokenizer: Tokenizer,
        engine: EngineHandle,
        metrics: Arc<SimMetrics>,
        drop_events: Arc<AtomicBool>,
    ) -> Self {
        let faults = Faults::new(cfg.faults.clone(), cfg.seed);
        let started_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        drop_events.store(cfg.faults.drop_events, Ordering::Relaxed);
        AppState {
            cfg,
            tokenizer,
            engine,
            metrics,
            drop_events,
            started_unix,
            faults: Mutex::new(faults),
            next_id: AtomicU64::new(1),
        }
    }

    /// A fresh engine request id.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn faults(&self) -> MutexGuard<'_, Faults> {
        match self.faults.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The faults in force.
    pub fn faults_snapshot(&self) -> FaultConfig {
        self.faults().current().clone()
    }

    /// Merges a fault patch and pushes it to the engine and the publisher.
    pub fn apply_faults(&self, body: &[u8]) -> Result<FaultConfig, ApiError> {
        let f = self.faults().apply(body)?;
        self.push(&f);
        Ok(f)
    }

    /// Clears every fault.
    pub fn clear_faults(&self) -> FaultConfig {
        let f = self.faults().clear();
        self.push(&f);
        f
    }

    fn push(&self, f: &FaultConfig) {
        self.engine.send(Command::SetSlowdown(f.slowdown));
        self.engine.send(Command::SetHang(f.hang));
        self.drop_events.store(f.drop_events, Ordering::Relaxed);
    }

    /// The faults that apply to one arriving request: (added latency ms, injected status).
    pub fn request_faults(&self) -> (u64, Option<u16>) {
        let mut g = self.faults();
        let latency = g.current().added_latency_ms;
        (latency, g.roll_error())
    }
}
