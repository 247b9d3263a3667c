//! The KV-event shell of one engine: a ZMQ SUB socket → a bounded queue → the pure
//! [`EngineIngest`] state machine → [`IndexOp`]s applied to the shared index.
//!
//! ```text
//! reader task: Subscriber::recv ──try_send──▶ queue (ingest_queue_batches) ──▶ applier task
//!   full queue → batch dropped (counted)          on_decoded → ops → index (write lock)
//!   malformed frame → counted                      Gap → replay socket (bounded) → in order
//!   socket error → reconnect (backoff)             no replay / replay short → mark_stale
//!                                                  restart hint (probe saw a new process
//!                                                  start time, no seq regression yet) → clear
//! ```
//!
//! A dropped or malformed batch is just a missing seq: the next batch opens a gap, which the
//! replay socket fills or the engine goes stale (routed approximately) until its next exact
//! resynchronisation point (`AllBlocksCleared` or a restart).

use crate::Gateway;
use crate::registry::Engine;
use kvmesh_kvevents::{DecodeLimits, KvFrame, RecvError, Subscriber, decode_batch, replay};
use kvmesh_prefix::{EngineIngest, IndexOp, IngestConfig, IngestOutcome};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Duration;
use tokio::sync::mpsc;

/// What the applier task receives.
#[derive(Debug)]
pub enum IngestMsg {
    /// A batch from the socket.
    Frame(KvFrame),
    /// The engine's process start time changed; `epoch` is the ingestion epoch the probe saw
    /// with the previous start time. Ignored when a seq regression already started a newer
    /// epoch (the events said it first).
    RestartHint {
        /// Epoch at the previous scrape.
        epoch: u32,
    },
}

/// Per-engine ingestion counters and state (read by `/metrics` and the request path).
#[derive(Default)]
pub struct IngestStatus {
    /// The SUB socket is connected.
    pub connected: AtomicBool,
    /// The engine's blocks are not exactly known (gap open or given up, or never synced).
    pub stale: AtomicBool,
    /// Batches applied.
    pub batches: AtomicU64,
    /// Batches dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Messages that could not be decoded.
    pub malformed: AtomicU64,
    /// Gaps opened.
    pub gaps: AtomicU64,
    /// Replays that filled their gap.
    pub replays_ok: AtomicU64,
    /// Replays that failed or came back short (engine marked stale).
    pub replays_failed: AtomicU64,
    /// Restarts seen (seq regressions and restart hints).
    pub restarts: AtomicU64,
    /// Events skipped for a block-size mismatch.
    pub skipped_block_size: AtomicU64,
    /// The ingestion epoch (restarts so far).
    pub epoch: AtomicU32,
    /// Blocks the engine holds according to its events (engine hashes tracked).
    pub tracked_blocks: AtomicU64,
    /// Sender of the applier's queue (restart hints from the probe).
    pub(crate) tx: std::sync::OnceLock<mpsc::Sender<IngestMsg>>,
}

/// Starts the reader and applier tasks of `e` if it has a KV-event endpoint.
pub fn spawn(gw: &Arc<Gateway>, e: &Arc<Engine>) {
    if e.kv_events.is_empty() {
        return;
    }
    let (tx, rx) = mpsc::channel(gw.cfg.prefix.ingest_queue_batches);
    let _ = e.ingest.tx.set(tx.clone());
    tokio::spawn(read_loop(gw.clone(), e.clone(), tx));
    tokio::spawn(apply_loop(gw.clone(), e.clone(), rx));
}

fn stopped(gw: &Gateway, e: &Engine) -> bool {
    gw.stopping.load(Relaxed) || e.removed.load(Relaxed)
}

async fn read_loop(gw: Arc<Gateway>, e: Arc<Engine>, tx: mpsc::Sender<IngestMsg>) {
    let limits = DecodeLimits::default();
    let mut backoff = Duration::from_millis(100);
    while !stopped(&gw, &e) {
        let sub = Subscriber::connect_with(
            &e.kv_events,
            &gw.cfg.prefix.kv_events_topic,
            limits.clone(),
            Duration::from_secs(2),
        )
        .await;
        let mut sub = match sub {
            Ok(s) => s,
            Err(err) => {
                tracing::debug!(engine = %e.url, endpoint = %e.kv_events, error = %err, "kv-event subscribe failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        e.ingest.connected.store(true, Relaxed);
        tracing::info!(engine = %e.url, endpoint = %e.kv_events, "subscribed to kv events");
        loop {
            if stopped(&gw, &e) {
                break;
            }
            match sub.recv_timeout(Duration::from_millis(250)).await {
                Ok(Some(frame)) => {
                    if tx.try_send(IngestMsg::Frame(frame)).is_err() {
                        e.ingest.dropped.fetch_add(1, Relaxed);
                    }
                }
                Ok(None) => {}
                Err(RecvError::Frame(err)) => {
                    e.ingest.malformed.fetch_add(1, Relaxed);
                    tracing::debug!(engine = %e.url, error = %err, "malformed kv-event message");
                }
                Err(RecvError::Transport(err)) => {
                    tracing::warn!(engine = %e.url, error = %err, "kv-event socket failed; reconnecting");
                    break;
                }
            }
        }
        e.ingest.connected.store(false, Relaxed);
    }
}

struct Applier {
    gw: Arc<Gateway>,
    e: Arc<Engine>,
    ingest: EngineIngest,
    ops: Vec<IndexOp>,
    limits: DecodeLimits,
}

async fn apply_loop(gw: Arc<Gateway>, e: Arc<Engine>, mut rx: mpsc::Receiver<IngestMsg>) {
    let block_size = e
        .models()
        .iter()
        .find_map(|m| gw.cfg.models.get(m).and_then(|c| c.block_size))
        .unwrap_or(gw.cfg.prefix.block_size);
    let mut a = Applier {
        ingest: EngineIngest::new(IngestConfig {
            block_size,
            capacity: gw.cfg.prefix.engine_capacity_blocks as usize,
        }),
        gw,
        e,
        ops: Vec::new(),
        limits: DecodeLimits::default(),
    };
    loop {
        let msg = tokio::select! {
            m = rx.recv() => m,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                if stopped(&a.gw, &a.e) { break; }
                continue;
            }
        };
        let Some(msg) = msg else { break };
        if stopped(&a.gw, &a.e) {
            break;
        }
        match msg {
            IngestMsg::Frame(f) => a.on_frame(f.seq, &f.batch).await,
            IngestMsg::RestartHint { epoch } => {
                if a.ingest.epoch() == epoch {
                    a.ops.clear();
                    a.ingest.on_restart(&mut a.ops);
                    a.apply();
                    a.e.ingest.restarts.fetch_add(1, Relaxed);
                    tracing::info!(engine = %a.e.url, "engine restarted (new process start time): its blocks are dropped");
                }
            }
        }
        a.publish();
    }
}

impl Applier {
    fn now(&self) -> u64 {
        self.gw.clock.now_us()
    }

    fn apply(&mut self) {
        if !self.ops.is_empty() {
            self.gw
                .registry
                .prefix
                .index_mut()
                .apply_all(self.e.slot, &self.ops);
        }
    }

    /// One batch; returns the open gap's start if it was not applied because of a gap.
    fn step(&mut self, seq: u64, batch: &kvmesh_kvevents::DecodedBatch) -> Option<u64> {
        self.ops.clear();
        let now = self.now();
        let out = self.ingest.on_decoded(seq, batch, now, &mut self.ops);
        self.apply();
        match out {
            IngestOutcome::Applied | IngestOutcome::Duplicate => None,
            IngestOutcome::Gap { from, .. } => Some(from),
            IngestOutcome::Restarted { gap, epoch } => {
                self.e.ingest.restarts.fetch_add(1, Relaxed);
                tracing::info!(engine = %self.e.url, epoch, "kv-event seq went back: engine restarted, its blocks are dropped");
                gap.map(|(from, _)| from)
            }
        }
    }

    async fn on_frame(&mut self, seq: u64, batch: &kvmesh_kvevents::DecodedBatch) {
        let gaps_before = self.ingest.stats().gaps;
        let Some(from) = self.step(seq, batch) else {
            return;
        };
        if self.ingest.stats().gaps == gaps_before {
            // Still the gap a replay is already being attempted for (or given up on).
            return;
        }
        self.e.ingest.gaps.fetch_add(1, Relaxed);
        if !self.resync(from).await {
            // Given up: the batch that revealed the gap was held back; it is the new baseline
            // (it may carry AllBlocksCleared, the engine's exact resync point).
            let _ = self.step(seq, batch);
        }
    }

    /// Fills the open gap from the replay socket; false when it gave up (engine stale).
    async fn resync(&mut self, from: u64) -> bool {
        if self.e.kv_replay.is_empty() {
            self.ingest.mark_stale(self.now());
            return false;
        }
        let timeout = Duration::from_millis(self.gw.cfg.prefix.replay_timeout_ms);
        match replay(&self.e.kv_replay, from, timeout).await {
            Ok(batches) => {
                for b in batches {
                    let Ok(db) = decode_batch(&b.payload, &self.limits) else {
                        self.e.ingest.malformed.fetch_add(1, Relaxed);
                        break;
                    };
                    if self.step(b.seq, &db).is_some() {
                        break;
                    }
                }
                if self.ingest.pending_gap().is_some() {
                    self.e.ingest.replays_failed.fetch_add(1, Relaxed);
                    tracing::warn!(engine = %self.e.url, from, "replay did not cover the gap: engine routed approximately until it resyncs");
                    self.ingest.mark_stale(self.now());
                    false
                } else {
                    self.e.ingest.replays_ok.fetch_add(1, Relaxed);
                    true
                }
            }
            Err(err) => {
                self.e.ingest.replays_failed.fetch_add(1, Relaxed);
                tracing::warn!(engine = %self.e.url, from, error = %err, "kv-event replay failed: engine routed approximately until it resyncs");
                self.ingest.mark_stale(self.now());
                false
            }
        }
    }

    fn publish(&self) {
        let s = &self.e.ingest;
        let st = self.ingest.stats();
        s.stale.store(self.ingest.is_stale(), Relaxed);
        s.batches.store(st.batches_applied, Relaxed);
        s.skipped_block_size.store(st.skipped_block_size, Relaxed);
        s.epoch.store(self.ingest.epoch(), Relaxed);
        s.tracked_blocks
            .store(self.ingest.tracked_hashes() as u64, Relaxed);
    }
}

/// The probe saw the engine's `process_start_time_seconds` change: tell the applier.
pub fn restart_hint(e: &Engine, epoch_at_previous_scrape: u32) {
    if let Some(tx) = e.ingest.tx.get() {
        let _ = tx.try_send(IngestMsg::RestartHint {
            epoch: epoch_at_previous_scrape,
        });
    }
}
