//! The KV-event shell of one engine: a ZMQ SUB socket → a bounded queue → the pure
//! [`EngineIngest`] state machine → [`IndexOp`]s applied to the shared index.
//!
//! ```text
//! reader task: Subscriber::recv ──try_send──▶ queue (ingest_queue_batches) ──▶ applier task
//!   full queue → batch dropped (counted)          on_decoded → ops → index (write lock)
//!   malformed frame → counted                      Gap → replay socket (bounded) → in order
//!   socket error → reconnect (backoff)             no replay / replay short → mark_stale
//!   subscribed 200 ms ago, nothing since ──────▶   catch-up: replay from the next seq expected
//!                                                  restart hint (probe saw a new process
//!                                                  start time, no seq regression yet) → clear
//! ```
//!
//! A dropped or malformed batch is just a missing seq: the next batch opens a gap, which the
//! replay socket fills or the engine goes stale (routed approximately) until its next exact
//! resynchronisation point (`AllBlocksCleared` or a restart).

use crate::clock::Clock;
use crate::engine::Engine;
use crate::prefix::PrefixState;
use crate::tasks::Tasks;
use kvmesh_config::ServeConfig;
use kvmesh_kvevents::{
    DecodeLimits, DecodedBatch, KvEvent, KvFrame, RecvError, Subscriber, decode_batch,
    replay_at_most,
};
use kvmesh_mesh::node::Input;
use kvmesh_prefix::{BlockKey, EngineIngest, IndexOp, IngestConfig, IngestOutcome, OpVersion};
use kvmesh_state::{FeedSnapshot, WireOp};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What the ingestion of an engine needs from the router: its config, the prefix side and
/// the clock — not the whole gateway.
#[derive(Clone)]
pub struct IngestCtx {
    /// The router's config (`[serve.prefix]`, per-model block sizes).
    pub cfg: Arc<ServeConfig>,
    /// The index the ops go to.
    pub prefix: Arc<PrefixState>,
    /// Cluster time.
    pub clock: Clock,
    /// Meshed: the ops go to the mesh as this router's feed of the engine (which applies them
    /// to the index in its order) instead of straight into the index.
    pub feed: Option<mpsc::Sender<Input>>,
}

/// Starts the reader and applier tasks of `e` if it has a KV-event endpoint; they end when
/// the engine is removed, the router stops, or [`stop`] is called (the mesh moved the
/// engine's ownership away). `from` is a handover: another owner's blocks (with the engine's
/// hashes) and the seq to resume at.
pub fn spawn(ctx: &IngestCtx, tasks: &Tasks, e: &Arc<Engine>, from: Option<&FeedSnapshot>) {
    if e.kv_events.is_empty() {
        return;
    }
    let run = e.stop.child_token();
    if let Some(old) = lock_run(e).replace(run.clone()) {
        old.cancel();
    }
    let (tx, rx) = mpsc::channel(ctx.cfg.prefix.ingest_queue_batches);
    e.ingest.has_applier.store(true, Relaxed);
    let (c, en, stop) = (ctx.clone(), e.clone(), run.clone());
    tasks.spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = read_loop(c, en, tx) => {}
        }
    });
    let (c, en, stop) = (ctx.clone(), e.clone(), run);
    let import = from.map(|s| {
        (
            s.blocks
                .iter()
                .map(|b| (b.engine_hash, BlockKey(b.key), b.pos, b.copies))
                .collect::<Vec<_>>(),
            s.next_seq,
            s.stale,
        )
    });
    tasks.spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = apply_loop(c, en, rx, import) => {}
        }
    });
}

fn lock_run(e: &Engine) -> std::sync::MutexGuard<'_, Option<CancellationToken>> {
    e.ingest.run.lock().unwrap_or_else(|p| p.into_inner())
}

/// Stops this router's reading of `e` (its blocks keep arriving from the mesh).
pub fn stop(e: &Engine) {
    if let Some(t) = lock_run(e).take() {
        t.cancel();
    }
    e.ingest.has_applier.store(false, Relaxed);
    e.ingest.connected.store(false, Relaxed);
    // What this reader found goes with it (a former reader showed its last figures for good).
    e.ingest.stale.store(false, Relaxed);
    e.ingest.tracked_blocks.store(0, Relaxed);
}

/// The index of the last replayed batch holding an `AllBlocksCleared` (the engine's exact
/// resync point: nothing before it matters), if any.
fn last_clear(batches: &[(u64, DecodedBatch)]) -> Option<usize> {
    batches.iter().rposition(|(_, b)| {
        b.batch
            .events
            .iter()
            .any(|e| matches!(e, KvEvent::AllBlocksCleared))
    })
}

/// How long after subscribing, when no batch came meanwhile, the applier asks the replay
/// socket for what the subscription missed (a subscription reaches the publisher within a
/// round trip or two).
const CATCH_UP_AFTER: Duration = Duration::from_millis(200);

/// How long subscribing to an engine's events may fail before it is warned of.
const SUBSCRIBE_WARN_AFTER: Duration = Duration::from_secs(10);

async fn read_loop(ctx: IngestCtx, e: Arc<Engine>, tx: mpsc::Sender<KvFrame>) {
    let limits = DecodeLimits::default();
    let mut backoff = Duration::from_millis(100);
    // Failing to subscribe is logged at debug at each try, and warned of once it has lasted
    // SUBSCRIBE_WARN_AFTER (QA33: a wrong `kv_events` address logged nothing at all).
    let mut failing_since: Option<tokio::time::Instant> = None;
    let mut warned = false;
    loop {
        let sub = Subscriber::connect_with(
            &e.kv_events,
            &ctx.cfg.prefix.kv_events_topic,
            limits.clone(),
            Duration::from_secs(2),
        )
        .await;
        let mut sub = match sub {
            Ok(s) => s,
            Err(err) => {
                tracing::debug!(engine = %e.url, endpoint = %e.kv_events, error = %err, "kv-event subscribe failed");
                let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
                if !warned && since.elapsed() >= SUBSCRIBE_WARN_AFTER {
                    warned = true;
                    tracing::warn!(engine = %e.url, endpoint = %e.kv_events, error = %err, "cannot subscribe to the engine's kv events (still trying): it is routed approximately; check its kv_events address");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        (failing_since, warned) = (None, false);
        e.ingest.connected.store(true, Relaxed);
        tracing::info!(engine = %e.url, endpoint = %e.kv_events, "subscribed to kv events");
        // If nothing arrives before the subscription has surely reached the publisher, the
        // applier catches up on what was published before it (ZMQ's slow joiner: those
        // batches never arrive here, and with no later batch no gap would reveal them). A
        // batch that does arrive reveals any gap itself, and its seq bounds the replay.
        let mut catch_up_at = Some(tokio::time::Instant::now() + CATCH_UP_AFTER);
        loop {
            if catch_up_at.is_some_and(|t| tokio::time::Instant::now() >= t) {
                catch_up_at = None;
                e.ingest.catch_up.store(true, Relaxed);
                e.ingest.wake.notify_one();
            }
            let wait = catch_up_at.map_or(Duration::from_millis(250), |t| {
                t.saturating_duration_since(tokio::time::Instant::now())
                    .max(Duration::from_millis(1))
            });
            match sub.recv_timeout(wait).await {
                Ok(Some(frame)) => {
                    catch_up_at = None;
                    if tx.try_send(frame).is_err() {
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
    ctx: IngestCtx,
    e: Arc<Engine>,
    ingest: EngineIngest,
    ops: Vec<IndexOp>,
    meta: Vec<(u64, u32)>,
    /// Meshed: batches for the mesh, sent after each step.
    to_mesh: Vec<Input>,
    /// The staleness the mesh last heard of.
    told_stale: bool,
    limits: DecodeLimits,
}

/// A handover: blocks (engine hash, key, chain position, copies), next seq, stale.
type Import = (Vec<(u64, BlockKey, u32, u32)>, Option<u64>, bool);

/// The block size of the engine's events: its models' (`[serve.models."M"] block_size`),
/// else `[serve.prefix] block_size`. Read per batch: an engine found through DNS has no models
/// until its first discovery, which may come after its first events.
fn block_size(cfg: &ServeConfig, e: &Engine) -> u32 {
    e.models()
        .iter()
        .find_map(|m| cfg.models.get(m).and_then(|c| c.block_size))
        .unwrap_or(cfg.prefix.block_size)
}

async fn apply_loop(
    ctx: IngestCtx,
    e: Arc<Engine>,
    mut rx: mpsc::Receiver<KvFrame>,
    import: Option<Import>,
) {
    let mut a = Applier {
        ingest: EngineIngest::new(IngestConfig {
            block_size: block_size(&ctx.cfg, &e),
            capacity: ctx.cfg.prefix.engine_capacity_blocks as usize,
        }),
        ctx,
        e,
        ops: Vec::new(),
        meta: Vec::new(),
        to_mesh: Vec::new(),
        told_stale: false,
        limits: DecodeLimits::default(),
    };
    if let Some((blocks, next_seq, stale)) = import {
        let now = a.now();
        a.ingest.import(blocks, next_seq, stale, now);
        match next_seq {
            Some(next_seq) => {
                tracing::info!(engine = %a.e.url, next_seq, "kv events taken over from another router");
            }
            // The previous reader had seen no batch (or had none to hand over): the feed
            // resumes at the engine's next batch, any gap before it replayed or marked stale.
            None => {
                tracing::info!(engine = %a.e.url, "kv events taken over from another router, which had no position in them to hand over");
            }
        }
    }
    loop {
        tokio::select! {
            f = rx.recv() => {
                let Some(f) = f else { break };
                a.refresh_block_size();
                a.on_frame(f.seq, &f.batch).await;
            }
            _ = a.e.ingest.wake.notified() => {}
        }
        if a.e.ingest.catch_up.swap(false, Relaxed) {
            a.catch_up().await;
        }
        // A restart hint from the probe (a new process start time) at the epoch it saw. When
        // the epoch moved on since, the events showed a restart, but maybe not this one (a
        // second, whose batches all went by while the subscription came back: QA): the
        // replay socket tells.
        let hinted = match a.e.ingest.take_restart_hint() {
            Some(epoch) if a.ingest.epoch() == epoch => true,
            // Nothing exact held for the new epoch (its first batches lost with the process
            // that published them): start over from the new process's replay rather than
            // keep what may be another process's blocks. Else the replay tells whether the
            // epoch's stream is this process's.
            Some(_) if a.ingest.next_seq().is_none() || a.ingest.is_stale() => true,
            Some(_) => a.stream_replaced().await,
            None => false,
        };
        if hinted {
            a.ops.clear();
            a.ingest.on_restart(&mut a.ops);
            let version = OpVersion {
                epoch: a.ingest.epoch(),
                seq: None,
            };
            a.apply(version);
            a.e.ingest.restarts.fetch_add(1, Relaxed);
            tracing::info!(engine = %a.e.url, "engine restarted (new process start time): its blocks are dropped");
            // What the new process published before this hint — batches the subscription
            // missed while it reconnected, or ones applied already that this clear just
            // dropped (its first batch comes as seq 0, which after an earlier clear starts no
            // epoch of its own) — comes back from its replay socket, from seq 0 (QA).
            a.catch_up().await;
        }
        a.publish();
        a.flush_to_mesh().await;
    }
}

impl Applier {
    fn now(&self) -> u64 {
        self.ctx.clock.now_us()
    }

    /// The engine's block size as its models say now (discovery may have found them since
    /// the last batch): set before every batch, live or replayed.
    fn refresh_block_size(&mut self) {
        let bs = block_size(&self.ctx.cfg, &self.e);
        let now = self.now();
        self.ingest.set_block_size(bs, now);
    }

    /// Sends the ops of one batch (or of a restart) to the index as a versioned batch. Only
    /// batches that produced ops are sent: a batch held back by a gap sends nothing, so the
    /// replayed batches before it still count as newer.
    fn apply(&mut self, version: OpVersion) {
        self.ingest.take_stored_meta(&mut self.meta);
        let stale = self.ingest.is_stale();
        // Meshed, a change of staleness travels even without ops.
        if self.ops.is_empty() && (self.ctx.feed.is_none() || stale == self.told_stale) {
            return;
        }
        self.told_stale = stale;
        if self.ctx.feed.is_none() {
            self.ctx
                .prefix
                .apply_batch(self.e.target(), version, &self.ops);
            return;
        }
        let ops = self
            .ops
            .iter()
            .map(|op| match *op {
                IndexOp::Stored(k) => WireOp::Stored(k.0),
                IndexOp::Removed(k) => WireOp::Removed(k.0),
                IndexOp::Cleared => WireOp::Cleared,
            })
            .collect();
        self.to_mesh.push(Input::Feed {
            engine: self.e.id.0,
            ops,
            meta: std::mem::take(&mut self.meta),
            stale,
            next_seq: self.ingest.next_seq(),
        });
    }

    /// Meshed: the batches of the last step go to the mesh, in order, never dropped (the
    /// applier waits for room).
    async fn flush_to_mesh(&mut self) {
        let Some(tx) = self.ctx.feed.clone() else {
            return;
        };
        for b in self.to_mesh.drain(..) {
            if tx.send(b).await.is_err() {
                break;
            }
        }
    }

    /// One batch; returns the open gap's start if it was not applied because of a gap.
    fn step(&mut self, seq: u64, batch: &kvmesh_kvevents::DecodedBatch) -> Option<u64> {
        self.ops.clear();
        let now = self.now();
        let out = self.ingest.on_decoded(seq, batch, now, &mut self.ops);
        // A restart revealed with a gap (the new process's first batches lost) carries only
        // the clear: it is the new epoch's start, before the batches the replay will bring.
        let held_back = matches!(
            out,
            IngestOutcome::Gap { .. } | IngestOutcome::Restarted { gap: Some(_), .. }
        );
        let version = OpVersion {
            epoch: self.ingest.epoch(),
            seq: (!held_back).then_some(seq),
        };
        self.apply(version);
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
        if !self.resync(from, seq).await {
            // Given up: the batch that revealed the gap was held back; it is the new baseline
            // (it may carry AllBlocksCleared, the engine's exact resync point), whatever its seq
            // — one the replay moved the expected seq past starts a new epoch with it (see
            // `EngineIngest::mark_stale`).
            let _ = self.step(seq, batch);
        }
    }

    /// Fills the open gap `from..to` (`to`: the batch that revealed it) from the replay
    /// socket; false when it gave up (engine stale). Replayed batches apply from the last
    /// `AllBlocksCleared` among them when there is one (what came before a reset is void: not
    /// decoded into the index, not sent to the mesh). A gap wider than `replay_max_batches` (a
    /// new stream on an engine with a long history) is not filled: only the last
    /// `replay_max_batches` batches before `to` are read, and the stream resynchronises from
    /// the last `AllBlocksCleared` among them — exact from there — or gives up.
    async fn resync(&mut self, from: u64, to: u64) -> bool {
        if self.e.kv_replay.is_empty() {
            self.ingest.mark_stale(self.now());
            return false;
        }
        let max = self.ctx.cfg.prefix.replay_max_batches;
        let wide = to.saturating_sub(from) > max;
        let start = if wide { to - max } else { from };
        // The gap, `to`, and as many newer batches again at most.
        let read = usize::try_from(to - start + max).unwrap_or(usize::MAX);
        let timeout = Duration::from_millis(self.ctx.cfg.prefix.replay_timeout_ms);
        let mut batches = match replay_at_most(&self.e.kv_replay, start, read, timeout).await {
            Ok((batches, _)) => self.decode_all(&batches),
            Err(err) => {
                self.e.ingest.replays_failed.fetch_add(1, Relaxed);
                tracing::warn!(engine = %self.e.url, from, error = %err, "kv-event replay failed: engine routed approximately until it resyncs");
                self.ingest.mark_stale(self.now());
                return false;
            }
        };
        if !self.keep_from_last_reset(&mut batches, !wide) {
            self.e.ingest.replays_failed.fetch_add(1, Relaxed);
            tracing::warn!(engine = %self.e.url, from, to, "kv events: {} batches missing, more than replay_max_batches, and no cache reset among the last ones: engine routed approximately until its next clear", to - from);
            self.ingest.mark_stale(self.now());
            return false;
        }
        for (seq, b) in &batches {
            if self.step(*seq, b).is_some() {
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

    /// Keeps the replayed `batches` from the engine's last cache reset among them: what came
    /// before a reset is void, and the batch holding it becomes the baseline (applied whatever
    /// its seq; the reset makes the engine exact). `continues`: the batches start where the
    /// stream stands. False when they neither continue it nor hold a reset (nothing to apply).
    fn keep_from_last_reset(
        &mut self,
        batches: &mut Vec<(u64, DecodedBatch)>,
        continues: bool,
    ) -> bool {
        match last_clear(batches) {
            Some(j) if j > 0 || !continues => {
                self.ingest.mark_stale(self.now());
                batches.drain(..j);
                tracing::info!(engine = %self.e.url, at = batches[0].0, "kv events: resynchronised from the engine's last cache reset");
                true
            }
            Some(_) => true,
            None => continues,
        }
    }

    /// Whether the engine's stream, as its replay socket holds it from seq 0, is not the one
    /// applied in this epoch (see `EngineIngest::is_another_stream`). Without a replay socket,
    /// no: the events' restart is taken to be this one. With one that cannot tell (no
    /// answer, or a history longer than `replay_max_batches`, unlikely for a process that
    /// started since the previous read of its page), yes: blocks to read again rather than
    /// another process's kept.
    async fn stream_replaced(&self) -> bool {
        if self.e.kv_replay.is_empty() {
            return false;
        }
        let max = usize::try_from(self.ctx.cfg.prefix.replay_max_batches).unwrap_or(usize::MAX);
        let timeout = Duration::from_millis(self.ctx.cfg.prefix.replay_timeout_ms);
        match replay_at_most(&self.e.kv_replay, 0, max, timeout).await {
            Ok((batches, true)) => {
                let decoded = self.decode_all(&batches);
                decoded.len() < batches.len()
                    || self
                        .ingest
                        .is_another_stream(decoded.iter().map(|(s, d)| (*s, &d.batch)))
            }
            _ => true,
        }
    }

    /// Replayed batches decoded, up to the first that does not decode (counted).
    fn decode_all(&self, batches: &[kvmesh_kvevents::ReplayedBatch]) -> Vec<(u64, DecodedBatch)> {
        let mut out = Vec::with_capacity(batches.len());
        for b in batches {
            match decode_batch(&b.payload, &self.limits) {
                Ok(db) => out.push((b.seq, db)),
                Err(_) => {
                    self.e.ingest.malformed.fetch_add(1, Relaxed);
                    break;
                }
            }
        }
        out
    }

    /// After a (re)subscription: what the engine published since the last batch applied
    /// (from seq 0 for a new stream), from the replay socket, when it is at most
    /// `replay_max_batches` (a longer history is left to the gap the next live batch reveals,
    /// which reads only the last batches before it), from the engine's last cache reset among
    /// them if any. Batches the live stream also brings are recognised as duplicates. When the
    /// buffer no longer reaches back that far and holds no reset, the engine is stale until its
    /// next clear and the next live batch is the baseline. No answer: nothing is known to be
    /// missing, nothing changes.
    async fn catch_up(&mut self) {
        if self.e.kv_replay.is_empty() || self.ingest.pending_gap().is_some() {
            return;
        }
        // No live batch may have come yet: the block size is still the one from before the
        // engine's models were discovered.
        self.refresh_block_size();
        let from = self.ingest.next_seq().unwrap_or(0);
        let max = usize::try_from(self.ctx.cfg.prefix.replay_max_batches).unwrap_or(usize::MAX);
        let timeout = Duration::from_millis(self.ctx.cfg.prefix.replay_timeout_ms);
        let batches = match replay_at_most(&self.e.kv_replay, from, max, timeout).await {
            Ok((b, true)) => b,
            Ok((_, false)) => {
                // More than `replay_max_batches` since `from`: a long history, which this
                // router lacks. The engine is stale now — not only once the next live batch
                // shows the gap (an idle engine showed its blocks gone as exact: QA) — and
                // that batch's gap reads only the last ones before it, resyncing from a reset
                // among them; applying the oldest here would be wasted work.
                if !self.ingest.is_stale() {
                    tracing::info!(engine = %self.e.url, from, max, "kv events: more batches since this router's position than replay_max_batches: routed approximately until the engine's next cache reset");
                    self.ingest.mark_stale(self.now());
                }
                return;
            }
            Err(err) => {
                tracing::debug!(engine = %self.e.url, from, error = %err, "kv-event catch-up replay failed");
                return;
            }
        };
        let Some(oldest) = batches.first().map(|b| b.seq) else {
            return;
        };
        let mut batches = self.decode_all(&batches);
        if !self.keep_from_last_reset(&mut batches, oldest <= from) {
            if !self.ingest.is_stale() {
                tracing::info!(engine = %self.e.url, from, oldest, "kv events: the engine's replay buffer no longer reaches back to what this router lacks: routed approximately until its next cache reset");
                self.ingest.mark_stale(self.now());
            }
            return;
        }
        let applied = self.ingest.stats().batches_applied;
        for (seq, db) in batches {
            self.on_frame(seq, &db).await;
        }
        if self.ingest.stats().batches_applied > applied {
            self.e.ingest.caught_up.fetch_add(1, Relaxed);
            tracing::info!(engine = %self.e.url, from, "kv events caught up after subscribing");
        }
    }

    fn publish(&self) {
        let s = &self.e.ingest;
        let st = self.ingest.stats();
        s.stale.store(self.ingest.is_stale(), Relaxed);
        s.batches.store(st.batches_applied, Relaxed);
        let before = s.skipped_block_size.swap(st.skipped_block_size, Relaxed);
        if before == 0 && st.skipped_block_size > 0 {
            // Once per reader (QA33: only a counter showed it).
            tracing::warn!(engine = %self.e.url, "kv events of another block size than this router's for the engine's model are skipped ([serve.prefix] block_size, or its model's block_size, must be the engine's --block-size): its blocks are not indexed");
        }
        s.epoch.store(self.ingest.epoch(), Relaxed);
        s.tracked_blocks
            .store(self.ingest.tracked_hashes() as u64, Relaxed);
    }
}
