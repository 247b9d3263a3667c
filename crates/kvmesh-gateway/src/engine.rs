//! One engine the router knows: identity (cluster-stable [`EngineId`], URL, where it came
//! from), its live load (this router's in-flight count, what the engine reports), its
//! breaker/health/latency state, its counters, its KV-event ingestion status and its prefix
//! index slot (a lease: freed once the last reference is gone).
//!
//! A leaf of the gateway: it imports only the prefix side's slot lease.

use crate::prefix::SlotLease;
use kvmesh_config::EngineEntry;
use kvmesh_metrics::{Histogram, LATENCY_BUCKETS};
use kvmesh_policy::{EngineTracker, EngineView, Work};
use kvmesh_prefix::EngineId;
use kvmesh_route::FailKind;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use tokio::sync::Notify;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio_util::sync::CancellationToken;

/// Where an engine came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The config file or `--engine`.
    Static,
    /// `POST /admin/engines`.
    Admin,
    /// A DNS name.
    Dns(String),
    /// Another router of the mesh (added through its admin API).
    Mesh,
}

impl Source {
    /// Label for the admin API.
    pub fn label(&self) -> String {
        match self {
            Source::Static => "static".into(),
            Source::Admin => "admin".into(),
            Source::Dns(n) => format!("dns:{n}"),
            Source::Mesh => "mesh".into(),
        }
    }
}

const UNKNOWN: u32 = u32::MAX;

/// Where engines say that this router's in-flight count on them changed: the mesh listens
/// (connected once, when the router joins) and sends the new counts at once. Each engine is
/// queued at most once until the listener has read it (its `load_dirty` flag), so the queue
/// holds at most one entry per engine. Without a mesh nobody listens and a change costs one
/// atomic load.
/// It also keeps the router's total in flight, removed engines' requests included.
#[derive(Default)]
pub struct LoadSignal(OnceLock<UnboundedSender<u64>>, AtomicU64);

impl LoadSignal {
    /// The receiver of changed engines, by their `EngineId` value (`None`: already connected).
    pub fn connect(&self) -> Option<UnboundedReceiver<u64>> {
        let (tx, rx) = unbounded_channel();
        self.0.set(tx).ok().map(|()| rx)
    }

    /// This router's requests in flight to any engine, one that was removed meanwhile too.
    pub fn total(&self) -> u64 {
        self.1.load(Ordering::Relaxed)
    }
}

/// Set in the in-flight count of an engine removed and added again: its count went to its
/// successor ([`Engine::hand_count_to`]), where its requests begin and end from then on.
const HANDED_ON: u32 = 1 << 31;

/// What the count is set to when handed on: the flag, and half the range below it, so that the
/// decrements of the requests still ending there never clear the flag.
const HANDED_ON_AT: u32 = HANDED_ON | (1 << 30);

/// One engine and its live state. Shared (`Arc`) by the snapshot, in-flight requests and its
/// probe task; a removed engine lives on until its last request ends.
pub struct Engine {
    /// Base URL, `http://host:port`.
    pub url: String,
    /// `host:port`.
    pub authority: http::uri::Authority,
    /// Cluster-stable identity (every router derives the same from the URL): consistent
    /// hashing's ring positions, the registry's map key, the mesh's name for the engine.
    pub id: EngineId,
    /// Value of the `x-kvmesh-engine` response header (its URL, or its id when
    /// `hide_engine_urls`), built once.
    pub header_value: http::HeaderValue,
    /// Configured weight (f64 bits): the config's, the admin API's or a peer's (see
    /// [`Engine::set_base_weight`]).
    base_weight_bits: AtomicU64,
    /// KV-event endpoint (precise routing), or empty.
    pub kv_events: String,
    /// KV-event replay endpoint, or empty.
    pub kv_replay: String,
    /// Where it came from.
    pub source: Source,
    /// Models given in its config (empty = discovered).
    pub static_models: Vec<String>,
    /// Requests this router has in flight to it, until the end of each stream (read inline
    /// by every decision). Removed while requests ran and added again, the engine hands it to
    /// its successor ([`Engine::hand_count_to`]).
    pub in_flight: AtomicU32,
    /// Requests the other routers of the mesh have in flight to it (their gossiped counts).
    pub peer_in_flight: AtomicU32,
    /// Queued on `load_signal` since the listener last read `in_flight`.
    load_dirty: AtomicBool,
    /// The engine of the same id added again after this one was removed, which holds the
    /// count of this one's requests.
    successor: std::sync::OnceLock<Arc<Engine>>,
    /// The registry's: where in-flight changes are told.
    load_signal: Arc<LoadSignal>,
    /// Breaker, health, latency, slow start.
    pub tracker: Mutex<EngineTracker>,
    /// Running + waiting requests the engine last reported (`UNKNOWN` if never).
    reported_load: AtomicU32,
    /// This router's own requests in flight to it when that report was read.
    own_at_report: AtomicU32,
    /// The mesh peers' requests in flight to it then (as gossiped).
    peers_at_report: AtomicU32,
    /// Waiting requests the engine last reported.
    reported_waiting: AtomicU32,
    /// KV-cache usage × 1e6 the engine last reported.
    kv_usage_ppm: AtomicU32,
    /// Models discovered from `/v1/models`.
    discovered: Mutex<Vec<String>>,
    /// Those of them that are LoRA adapters (listed with a `parent`).
    adapters: Mutex<Vec<String>>,
    /// The engine's `/v1/models` cards as it last listed them (its context length, an
    /// adapter's base model and path): the router's own list repeats them.
    cards: Mutex<Vec<kvmesh_openai::ModelCard>>,
    /// Cancelled when removed: its probe and ingestion tasks stop.
    pub stop: CancellationToken,
    /// Counters and histograms.
    pub metrics: EngineMetrics,
    /// Its slot in the prefix index (the lease's slot, copied for the hot path).
    pub slot: u32,
    /// Returns the slot to the prefix side when the last reference to the engine is gone.
    _lease: SlotLease,
    /// KV-event ingestion state (when it has a `kv_events` endpoint).
    pub ingest: IngestStatus,
    /// `process_start_time_seconds` at the last scrape (f64 bits; NaN = unknown) and the
    /// ingestion epoch then: a new start time without a seq regression is a restart.
    pub(crate) start_time_bits: AtomicU64,
    pub(crate) epoch_at_scrape: AtomicU32,
    /// Prompt tokens of requests routed to it, and how many of them the router predicted
    /// cached (cache-aware routes).
    pub prompt_tokens: AtomicU64,
    /// See `prompt_tokens`.
    pub predicted_cached_tokens: AtomicU64,
    /// The engine's own `vllm:prefix_cache_hits_total` / `queries_total` at the last scrape
    /// (NaN bits = unknown).
    pub(crate) engine_hits_bits: AtomicU64,
    pub(crate) engine_queries_bits: AtomicU64,
    /// The router's predicted hit rate over the engine's reported one, over the last window
    /// with prompts on both sides and a hit on the engine's (f64 bits; NaN = none yet).
    pub(crate) prediction_ratio_bits: AtomicU64,
    /// Where the open window of that ratio starts: the engine's hits and queries (f64 bits;
    /// NaN = no scrape yet) and this router's predicted and prompt tokens.
    pub(crate) ratio_base: [AtomicU64; 4],
    /// The engine's work counters at the last scrape, summed (f64 bits; NaN = its metrics
    /// have none): [`WORK_COUNTERS`](crate::probe::WORK_COUNTERS).
    pub(crate) work_bits: AtomicU64,
    /// When (cluster µs) a scrape last found them changed: the engine was working then; and
    /// when the scrape before that one was made: the work it found came after.
    pub worked_at_us: AtomicU64,
    pub(crate) worked_after_us: AtomicU64,
    /// When the last two scrapes that read them were made (cluster µs; 0 = none): the
    /// last, and the one before.
    pub(crate) scraped_us: [AtomicU64; 2],
    /// Why its last `/v1/models` read told no models ([`Untold`] as u32), and when (cluster
    /// µs) that was last warned of (at most once a minute).
    pub(crate) untold: AtomicU32,
    pub(crate) untold_warned_us: AtomicU64,
}

/// Why an engine's `/v1/models` told the router no models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Untold {
    /// Not read yet, or it did not answer.
    NoAnswer = 0,
    /// It refused the router (401 or 403): its API key.
    Refused = 1,
    /// It answered something that is not a model list.
    NotAList = 2,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Engine {
    /// An engine from its config entry; `hide_url`: name it by its id in `x-kvmesh-engine`.
    pub fn new(
        entry: &EngineEntry,
        hide_url: bool,
        source: Source,
        tracker: EngineTracker,
        lease: SlotLease,
        load_signal: Arc<LoadSignal>,
    ) -> Result<Engine, String> {
        let url = kvmesh_config::canonical_base_url(&entry.url);
        let authority: http::uri::Authority = url
            .strip_prefix("http://")
            .unwrap_or(&url)
            .parse()
            .map_err(|e| format!("bad engine URL {url}: {e}"))?;
        let id = EngineId::from_url(&url);
        let header_value = if hide_url {
            http::HeaderValue::from_str(&id.to_string())
        } else {
            http::HeaderValue::from_str(&url)
        }
        .map_err(|e| format!("bad engine URL {url}: {e}"))?;
        Ok(Engine {
            id,
            header_value,
            url,
            authority,
            base_weight_bits: AtomicU64::new(milli(entry.weight).to_bits()),
            kv_events: entry.kv_events.clone(),
            kv_replay: entry.kv_replay.clone(),
            source,
            static_models: entry.models.clone(),
            in_flight: AtomicU32::new(0),
            peer_in_flight: AtomicU32::new(0),
            load_dirty: AtomicBool::new(false),
            successor: std::sync::OnceLock::new(),
            load_signal,
            tracker: Mutex::new(tracker),
            reported_load: AtomicU32::new(UNKNOWN),
            own_at_report: AtomicU32::new(0),
            peers_at_report: AtomicU32::new(0),
            reported_waiting: AtomicU32::new(UNKNOWN),
            kv_usage_ppm: AtomicU32::new(UNKNOWN),
            discovered: Mutex::new(Vec::new()),
            adapters: Mutex::new(Vec::new()),
            cards: Mutex::new(Vec::new()),
            stop: CancellationToken::new(),
            metrics: EngineMetrics::default(),
            slot: lease.slot(),
            _lease: lease,
            ingest: IngestStatus::default(),
            start_time_bits: AtomicU64::new(f64::NAN.to_bits()),
            epoch_at_scrape: AtomicU32::new(0),
            prompt_tokens: AtomicU64::new(0),
            predicted_cached_tokens: AtomicU64::new(0),
            engine_hits_bits: AtomicU64::new(f64::NAN.to_bits()),
            engine_queries_bits: AtomicU64::new(f64::NAN.to_bits()),
            prediction_ratio_bits: AtomicU64::new(f64::NAN.to_bits()),
            ratio_base: [
                AtomicU64::new(f64::NAN.to_bits()),
                AtomicU64::new(f64::NAN.to_bits()),
                AtomicU64::new(0),
                AtomicU64::new(0),
            ],
            work_bits: AtomicU64::new(f64::NAN.to_bits()),
            worked_at_us: AtomicU64::new(0),
            worked_after_us: AtomicU64::new(0),
            scraped_us: [AtomicU64::new(0), AtomicU64::new(0)],
            untold: AtomicU32::new(Untold::NoAnswer as u32),
            untold_warned_us: AtomicU64::new(0),
        })
    }

    /// Why its `/v1/models` last told no models.
    pub fn untold(&self) -> Untold {
        match self.untold.load(Relaxed) {
            1 => Untold::Refused,
            2 => Untold::NotAList,
            _ => Untold::NoAnswer,
        }
    }

    /// Records why its `/v1/models` told no models; whether to warn of it now (the first
    /// time, a change, or a minute after the last warning: QA35 found one every second).
    pub(crate) fn set_untold(&self, why: Untold, now_us: u64) -> bool {
        let changed = self.untold.swap(why as u32, Relaxed) != why as u32;
        let last = self.untold_warned_us.load(Relaxed);
        let due = changed || last == 0 || now_us.saturating_sub(last) >= 60_000_000;
        if due {
            self.untold_warned_us.store(now_us.max(1), Relaxed);
        }
        due && why != Untold::NoAnswer
    }

    /// Whether its metrics have work counters.
    pub fn work_known(&self) -> bool {
        !f64::from_bits(self.work_bits.load(Relaxed)).is_nan()
    }

    /// What its metrics showed of its work (for the unanswered rule).
    pub fn work(&self) -> Work {
        if !self.work_known() {
            return Work::Unknown;
        }
        Work::Counted {
            worked_after_us: self.worked_after_us.load(Relaxed),
            prev_scrape_us: self.scraped_us[1].load(Relaxed),
        }
    }

    /// A scrape at `now_us` read its work counters, summed: `work`.
    pub(crate) fn note_work(&self, now_us: u64, work: f64) {
        let before = f64::from_bits(self.work_bits.swap(work.to_bits(), Relaxed));
        let last = self.scraped_us[0].swap(now_us, Relaxed);
        self.scraped_us[1].store(last, Relaxed);
        // Any change: a restarted engine's counters start again from 0.
        if !before.is_nan() && work != before {
            self.worked_after_us.store(last, Relaxed);
            self.worked_at_us.store(now_us, Relaxed);
        }
    }

    /// Its KV events are being received and its blocks are exactly known (precise routing
    /// trusts them; otherwise routing decisions are remembered for the approximate TTL).
    pub fn events_live(&self) -> bool {
        !self.kv_events.is_empty()
            && if self.ingest.has_applier.load(Ordering::Relaxed) {
                self.ingest.connected.load(Ordering::Relaxed)
                    && !self.ingest.stale.load(Ordering::Relaxed)
            } else {
                self.ingest.mesh_live.load(Ordering::Relaxed)
            }
    }

    /// What the operator's pages say of its KV events: (connected, stale). Connected: this
    /// router reads them and the engine answers its health checks (the ZMQ subscription
    /// reconnects silently, so a dead engine's would stay "connected"). Stale (routed
    /// approximately): read here, not subscribed, or as the reader found it (QA35: a
    /// subscription that never connected was shown not stale); read by the mesh's owners
    /// (`meshed`), unless the feed followed here is synced.
    pub fn events_status(&self, meshed: bool) -> (bool, bool) {
        let reads = self.ingest.has_applier.load(Ordering::Relaxed);
        let subscribed = self.ingest.connected.load(Ordering::Relaxed);
        let connected = reads && subscribed && self.tracker().health().is_healthy();
        let stale = if reads {
            !subscribed || self.ingest.stale.load(Ordering::Relaxed)
        } else if !meshed {
            self.ingest.stale.load(Ordering::Relaxed)
        } else {
            !self.ingest.mesh_live.load(Ordering::Relaxed)
        };
        (connected, stale)
    }

    /// Its slot and id: whom an index change is for.
    pub fn target(&self) -> kvmesh_prefix::Target {
        kvmesh_prefix::Target {
            slot: self.slot,
            engine: self.id,
        }
    }

    /// It was removed from the registry (its in-flight requests finish).
    pub fn removed(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// The breaker/health/latency state, locked briefly (never across an await).
    pub fn tracker(&self) -> MutexGuard<'_, EngineTracker> {
        lock(&self.tracker)
    }

    /// The models it serves: its static list, else what discovery found.
    pub fn models(&self) -> Vec<String> {
        if self.static_models.is_empty() {
            lock(&self.discovered).clone()
        } else {
            self.static_models.clone()
        }
    }

    /// Records the models discovered from `/v1/models` (sorted, deduplicated) and which of
    /// them are LoRA adapters; true when they changed.
    pub fn set_discovered(&self, models: Vec<String>, adapters: Vec<String>) -> bool {
        let mut d = lock(&self.discovered);
        let mut a = lock(&self.adapters);
        if *d != models || *a != adapters {
            *d = models;
            *a = adapters;
            true
        } else {
            false
        }
    }

    /// Keeps the engine's `/v1/models` cards; true when a model's context length
    /// (`max_model_len`) changed, which the routes read at their rebuild.
    pub fn set_cards(&self, cards: Vec<kvmesh_openai::ModelCard>) -> bool {
        let mut kept = lock(&self.cards);
        let lengths = |c: &[kvmesh_openai::ModelCard]| {
            let mut v: Vec<(String, Option<u32>)> =
                c.iter().map(|m| (m.id.clone(), m.max_model_len)).collect();
            v.sort();
            v
        };
        let changed = lengths(&kept) != lengths(&cards);
        *kept = cards;
        changed
    }

    /// The context length (`max_model_len`) the engine lists for `model`; 0 when unknown.
    pub fn context_len(&self, model: &str) -> u32 {
        lock(&self.cards)
            .iter()
            .find(|c| c.id == model)
            .and_then(|c| c.max_model_len)
            .unwrap_or(0)
    }

    /// The engine's card of `model`, as it last listed it.
    pub fn card(&self, model: &str) -> Option<kvmesh_openai::ModelCard> {
        lock(&self.cards).iter().find(|c| c.id == model).cloned()
    }

    /// Whether `model` is one of its LoRA adapters (as discovered).
    pub fn is_adapter(&self, model: &str) -> bool {
        lock(&self.adapters).iter().any(|m| m == model)
    }

    /// Records what the engine's `/metrics` said; `own`: how many of this router's requests
    /// the report may count (those in flight to it while the page was read); `peers`: how
    /// many of the mesh peers' it may count.
    pub fn set_reported(
        &self,
        running: Option<u32>,
        waiting: Option<u32>,
        kv_usage: Option<f64>,
        own: u32,
        peers: u32,
    ) {
        self.own_at_report.store(own, Ordering::Relaxed);
        self.peers_at_report.store(peers, Ordering::Relaxed);
        // Neither gauge (an engine without vLLM's metrics): unknown, not u32::MAX − 1 (QA:
        // such an engine looked 4.29 billion requests deep and load-aware policies starved it).
        let load = match (running, waiting) {
            (Some(r), Some(w)) => Some(r.saturating_add(w)),
            (Some(r), None) => Some(r),
            (None, Some(w)) => Some(w),
            (None, None) => None,
        };
        self.reported_load.store(
            load.map_or(UNKNOWN, |l| l.min(UNKNOWN - 1)),
            Ordering::Relaxed,
        );
        self.reported_waiting.store(
            waiting.map_or(UNKNOWN, |w| w.min(UNKNOWN - 1)),
            Ordering::Relaxed,
        );
        self.kv_usage_ppm.store(
            kv_usage.map_or(UNKNOWN, |u| (u.clamp(0.0, 1.0) * 1e6) as u32),
            Ordering::Relaxed,
        );
    }

    /// Engine-reported running + waiting, brought up to date for the requests the mesh
    /// knows of: the report counted this router's and its peers' requests in flight when it
    /// was read, which may have ended since (a stale report would keep them as phantom load
    /// for a whole discovery interval), so they are replaced by the current counts: the load
    /// no router of the mesh knows of (other clients, independent routers) as reported +
    /// ours and the peers' now. Without a mesh, peers count 0: the others' load as reported.
    pub fn reported_load(&self) -> Option<u32> {
        let v = self.reported_load.load(Ordering::Relaxed);
        (v != UNKNOWN).then(|| {
            v.saturating_sub(self.own_at_report.load(Ordering::Relaxed))
                .saturating_sub(self.peers_at_report.load(Ordering::Relaxed))
                .saturating_add(self.in_flight.load(Ordering::Relaxed))
                .saturating_add(self.peer_in_flight.load(Ordering::Relaxed))
        })
    }

    /// Engine-reported waiting (queue depth).
    pub fn reported_waiting(&self) -> Option<u32> {
        let v = self.reported_waiting.load(Ordering::Relaxed);
        (v != UNKNOWN).then_some(v)
    }

    /// Engine-reported KV-cache usage (0..=1).
    pub fn kv_usage(&self) -> Option<f32> {
        let v = self.kv_usage_ppm.load(Ordering::Relaxed);
        (v != UNKNOWN).then_some(v as f32 / 1e6)
    }

    /// One more request of this router in flight to it (told to the mesh).
    pub fn begin_request(&self) {
        // SeqCst with `read_load_change`: a change after the listener's read is queued again.
        if self.in_flight.fetch_add(1, Ordering::SeqCst) & HANDED_ON != 0 {
            return self.handed_on().begin_request();
        }
        self.load_signal.1.fetch_add(1, Ordering::Relaxed);
        self.load_changed();
    }

    /// One request of this router less in flight to it (told to the mesh).
    pub fn end_request(&self) {
        // A change made before the hand-over was handed over with the count; one after it
        // (the flag seen) is the successor's.
        if self.in_flight.fetch_sub(1, Ordering::SeqCst) & HANDED_ON != 0 {
            return self.handed_on().end_request();
        }
        self.load_signal.1.fetch_sub(1, Ordering::Relaxed);
        self.load_changed();
    }

    fn handed_on(&self) -> &Engine {
        self.successor
            .get()
            .expect("the successor is set before the count is handed on")
    }

    /// This engine was removed while requests to it ran, and `next` is the same engine added
    /// again: `next` takes the count over, and those requests begin and end on `next` from now
    /// on, so its decisions and the mesh count them.
    pub fn hand_count_to(&self, next: &Arc<Engine>) {
        if self.successor.set(next.clone()).is_err() {
            return;
        }
        let n = self.in_flight.swap(HANDED_ON_AT, Ordering::SeqCst);
        if n > 0 {
            next.in_flight.fetch_add(n, Ordering::SeqCst);
            next.load_changed();
        }
    }

    /// Queues this engine for the mesh's listener (once until it reads the count).
    pub fn load_changed(&self) {
        if let Some(tx) = self.load_signal.0.get()
            && !self.load_dirty.load(Ordering::SeqCst)
            && !self.load_dirty.swap(true, Ordering::SeqCst)
        {
            let _ = tx.send(self.id.0);
        }
    }

    /// The listener's read of this router's in-flight count after a signal (the next change
    /// signals again).
    pub fn read_load_change(&self) -> u32 {
        self.load_dirty.store(false, Ordering::SeqCst);
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Configured weight.
    pub fn base_weight(&self) -> f64 {
        f64::from_bits(self.base_weight_bits.load(Ordering::Relaxed))
    }

    /// Sets the configured weight (kept to thousandths, as the mesh carries it); whether it
    /// changed. The registry's snapshot must be rebuilt for the policies to see it
    /// ([`crate::registry::Registry::set_weight`] does both).
    pub(crate) fn set_base_weight(&self, weight: f64) -> bool {
        let w = milli(weight).to_bits();
        self.base_weight_bits.swap(w, Ordering::Relaxed) != w
    }

    /// Its entry as it stands: what the mesh's registry records of it.
    pub fn entry(&self) -> kvmesh_config::EngineEntry {
        kvmesh_config::EngineEntry {
            url: self.url.clone(),
            weight: self.base_weight(),
            kv_events: self.kv_events.clone(),
            kv_replay: self.kv_replay.clone(),
            models: self.static_models.clone(),
        }
    }

    /// The view a policy reads: the cluster's in-flight count (this router's and its peers')
    /// and this router's own part of it, the engine's own report, health and weight.
    pub fn view(&self, now_us: u64, fleet_latency_us: f64) -> EngineView {
        let own = self.in_flight.load(Ordering::Relaxed);
        let cluster = own.saturating_add(self.peer_in_flight.load(Ordering::Relaxed));
        let mut v = self.tracker().view(
            now_us,
            self.base_weight(),
            cluster,
            self.reported_load(),
            self.kv_usage(),
            fleet_latency_us,
        );
        v.waiting = self.reported_waiting();
        v.own_in_flight = own;
        v
    }
}

/// Per-engine counters and histograms.
pub struct EngineMetrics {
    /// Attempts sent to this engine.
    pub requests: AtomicU64,
    /// Failed attempts by kind (index = FailKind order).
    pub errors: [AtomicU64; FailKind::ALL.len()],
    /// Times its breaker opened (ejections).
    pub ejections: AtomicU64,
    /// Time to first byte of the body.
    pub ttft: Histogram,
    /// Time to the end of the body.
    pub e2e: Histogram,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        EngineMetrics {
            requests: AtomicU64::new(0),
            errors: Default::default(),
            ejections: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

impl EngineMetrics {
    /// Counts a failed attempt.
    pub fn failed(&self, kind: FailKind) {
        self.errors[kind.index()].fetch_add(1, Relaxed);
    }
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
    /// An applier runs for this engine (its KV events are read).
    pub has_applier: AtomicBool,
    /// Meshed and not reading the engine itself: its blocks arrive from the engine's ingest
    /// owner, synced and exact (set by the cluster module).
    pub mesh_live: AtomicBool,
    /// Stops this router's reading of the engine (the mesh moved its ownership away).
    pub run: std::sync::Mutex<Option<tokio_util::sync::CancellationToken>>,
    /// Restart hint from the probe: the ingestion epoch it saw with the previous process
    /// start time, plus one (0 = none pending).
    pub restart_hint: AtomicU64,
    /// Wakes the applier for a hint.
    pub wake: Notify,
    /// The reader subscribed a moment ago and no batch came since: the applier asks the
    /// replay socket for what was published since the last batch it applied (a SUB socket
    /// misses what the engine publishes before its subscription takes effect, and when no
    /// later batch comes, no gap would ever reveal it).
    pub catch_up: AtomicBool,
    /// Catch-ups that brought batches the subscription had missed.
    pub caught_up: AtomicU64,
}

impl IngestStatus {
    /// The probe saw the engine's process start time change while the ingestion was at
    /// `epoch`: the applier clears the engine unless a seq regression already started a newer
    /// epoch (the events said it first).
    pub fn hint_restart(&self, epoch: u32) {
        self.restart_hint
            .store(u64::from(epoch) + 1, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// Takes the pending restart hint (the epoch it was seen at).
    pub fn take_restart_hint(&self) -> Option<u32> {
        match self.restart_hint.swap(0, Ordering::Relaxed) {
            0 => None,
            e => Some((e - 1) as u32),
        }
    }
}

/// A weight kept to thousandths, as the mesh's registry carries it.
fn milli(w: f64) -> f64 {
    f64::from(kvmesh_config::weight_milli(w)) / 1000.0
}
