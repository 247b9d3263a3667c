//! The router's `/metrics` on `prometheus-client` (OpenMetrics text). Every metric name of
//! the router is in this file.
//!
//! The request path only touches atomics: counters are `prometheus-client` handles (routes
//! hold their decision series, taken at snapshot rebuild), histograms are lock-free
//! fixed-bucket ones, the p99-TTFT window rotates between two of them. A scrape registers
//! those handles in a fresh `prometheus_client` registry together with a [`Snapshot`]
//! collector that reads the engines and the prefix index at that instant.

use crate::engine::Engine;
use crate::prefix::PrefixState;
use crate::registry::Registry;
use kvmesh_metrics::{Histogram, LATENCY_BUCKETS, MICRO_BUCKETS};
use kvmesh_policy::{BreakerState, SlowStartConfig};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

pub use kvmesh_route::FailKind;

/// Labels of `kvmesh_error_responses_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    /// The HTTP status.
    pub status: u16,
}

/// Router-wide metrics.
pub struct GatewayMetrics {
    /// Requests received on the inference endpoints.
    pub requests: Counter,
    /// Retries sent (attempts after the first).
    pub retries: Counter,
    /// Retries refused by the retry budget.
    pub budget_exhausted: Counter,
    /// Answers with an error status (its own or an engine's), by status.
    error_responses: Family<StatusLabels, Counter>,
    /// Time spent deciding.
    pub decision_time: Arc<Histogram>,
    /// Client connections the accept loop closed on its own.
    pub connections: Arc<kvmesh_http::ConnCounters>,
    ttft: TtftWindow,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        GatewayMetrics {
            requests: Counter::default(),
            retries: Counter::default(),
            budget_exhausted: Counter::default(),
            error_responses: Family::default(),
            decision_time: Arc::new(Histogram::new(MICRO_BUCKETS)),
            connections: Arc::default(),
            ttft: TtftWindow::default(),
        }
    }
}

/// Length of the window over which the p99-TTFT gauge is computed (µs).
const TTFT_WINDOW_US: u64 = 60_000_000;

/// TTFTs of the current minute for the p99 gauge, without a lock: two histograms, the one
/// in use swapped (and the other cleared) when the minute is over.
struct TtftWindow {
    hist: [Histogram; 2],
    current: AtomicUsize,
    started_us: AtomicU64,
    last_p99_bits: AtomicU64,
}

impl Default for TtftWindow {
    fn default() -> Self {
        TtftWindow {
            hist: [
                Histogram::new(LATENCY_BUCKETS),
                Histogram::new(LATENCY_BUCKETS),
            ],
            current: AtomicUsize::new(0),
            started_us: AtomicU64::new(0),
            last_p99_bits: AtomicU64::new(f64::NAN.to_bits()),
        }
    }
}

impl TtftWindow {
    fn observe(&self, now_us: u64, ttft_us: u64) {
        let started = self.started_us.load(Relaxed);
        if now_us.saturating_sub(started) >= TTFT_WINDOW_US
            && self
                .started_us
                .compare_exchange(started, now_us, Relaxed, Relaxed)
                .is_ok()
        {
            // This thread closes the window: keep its p99, start the other one empty.
            let cur = self.current.load(Relaxed);
            if let Some(p) = self.hist[cur].quantile_bound(0.99) {
                self.last_p99_bits.store(p.to_bits(), Relaxed);
            }
            self.hist[1 - cur].reset();
            self.current.store(1 - cur, Relaxed);
        }
        self.hist[self.current.load(Relaxed)].observe_us(ttft_us);
    }

    fn p99(&self) -> f64 {
        self.hist[self.current.load(Relaxed)]
            .quantile_bound(0.99)
            .unwrap_or_else(|| f64::from_bits(self.last_p99_bits.load(Relaxed)))
    }
}

impl GatewayMetrics {
    /// Counts an answer the router gave with an error status (rare: the family's lookup
    /// is a read lock on an existing series).
    pub fn error_response(&self, status: u16) {
        self.error_responses
            .get_or_create(&StatusLabels { status })
            .inc();
    }

    /// Records a TTFT into the rolling p99 window.
    pub fn observe_ttft(&self, now_us: u64, ttft_us: u64) {
        self.ttft.observe(now_us, ttft_us);
    }

    /// The exposition text (OpenMetrics).
    pub fn render(&self, reg: &Registry, now_us: u64) -> String {
        self.render_with(reg, now_us, None)
    }

    /// The exposition text with another collector's families (the mesh's).
    pub fn render_with(
        &self,
        reg: &Registry,
        now_us: u64,
        extra: Option<Box<dyn Collector>>,
    ) -> String {
        let mut r = prometheus_client::registry::Registry::default();
        r.register(
            "kvmesh_requests",
            "Requests received on the inference endpoints",
            self.requests.clone(),
        );
        r.register(
            "kvmesh_retries",
            "Attempts sent to another engine after a failed attempt",
            self.retries.clone(),
        );
        r.register(
            "kvmesh_retry_budget_exhausted",
            "Retries not sent because the retry budget was spent",
            self.budget_exhausted.clone(),
        );
        r.register(
            "kvmesh_error_responses",
            "Answers with an error status, by status",
            self.error_responses.clone(),
        );
        r.register(
            "kvmesh_routing_decisions",
            "Routing decisions by model, policy and reason",
            reg.decisions.clone(),
        );
        let mut engines = reg.members();
        engines.sort_by(|a, b| a.url.cmp(&b.url));
        let draining = reg.draining();
        let meshed = extra.is_some();
        if let Some(c) = extra {
            r.register_collector(c);
        }
        r.register_collector(Box::new(Snapshot {
            engines,
            draining,
            meshed,
            prefix: reg.prefix.clone(),
            decision_time: self.decision_time.clone(),
            connections: self.connections.clone(),
            ttft_p99: self.ttft.p99(),
            in_flight_total: reg.load_signal.total(),
            now_us,
            fleet_latency_us: reg.fleet_latency_us(),
            slow_start: reg.health_cfg().slow_start,
        }));
        let mut out = String::with_capacity(32 * 1024);
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        out
    }
}

/// What a scrape reads, taken at one instant.
struct Snapshot {
    engines: Vec<Arc<Engine>>,
    /// Removed engines whose requests still run: only their in-flight count is shown.
    draining: Vec<Arc<Engine>>,
    /// The router is in a mesh (engines it does not read come through their owners).
    meshed: bool,
    prefix: Arc<PrefixState>,
    decision_time: Arc<Histogram>,
    connections: Arc<kvmesh_http::ConnCounters>,
    ttft_p99: f64,
    in_flight_total: u64,
    now_us: u64,
    fleet_latency_us: f64,
    slow_start: SlowStartConfig,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("engines", &self.engines.len())
            .finish()
    }
}

/// A value encoded as a counter or a gauge.
enum Value {
    Counter(u64),
    CounterF(f64),
    Gauge(i64),
    GaugeF(f64),
}

fn put(m: &mut MetricEncoder<'_>, v: &Value) -> std::fmt::Result {
    match v {
        Value::Counter(x) => m.encode_counter::<NoLabelSet, _, u64>(x, None),
        Value::CounterF(x) => m.encode_counter::<NoLabelSet, _, f64>(x, None),
        Value::Gauge(x) => m.encode_gauge(x),
        Value::GaugeF(x) => m.encode_gauge(x),
    }
}

fn kind(v: &Value) -> MetricType {
    match v {
        Value::Counter(_) | Value::CounterF(_) => MetricType::Counter,
        Value::Gauge(_) | Value::GaugeF(_) => MetricType::Gauge,
    }
}

/// One unlabelled sample.
fn single(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: Value) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, kind(&v))?;
    put(&mut m, &v)
}

/// A histogram family: one series per label set.
pub(crate) fn histogram(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: &[(&[(&str, &str)], &Histogram)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, h) in series {
        if labels.is_empty() {
            m.encode_histogram::<NoLabelSet>(h.sum_secs(), h.count(), &h.buckets(), None)?;
        } else {
            let mut f = m.encode_family(labels)?;
            f.encode_histogram::<NoLabelSet>(h.sum_secs(), h.count(), &h.buckets(), None)?;
        }
    }
    Ok(())
}

/// One series per engine of `engines` (values `None` are left out: unknown).
fn per_engine(
    enc: &mut DescriptorEncoder<'_>,
    engines: &[&Engine],
    name: &str,
    help: &str,
    kind_of: MetricType,
    f: &dyn Fn(&Engine) -> Option<Value>,
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, kind_of)?;
    for e in engines {
        if let Some(v) = f(e) {
            let labels = [("engine", e.url.as_str())];
            let mut fam = m.encode_family(&labels)?;
            put(&mut fam, &v)?;
        }
    }
    Ok(())
}

fn finite(bits: &AtomicU64) -> Option<f64> {
    Some(f64::from_bits(bits.load(Relaxed))).filter(|v| v.is_finite())
}

fn count(a: &AtomicU64) -> Option<Value> {
    Some(Value::Counter(a.load(Relaxed)))
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let engines: Vec<&Engine> = self.engines.iter().map(|e| &**e).collect();
        histogram(
            &mut enc,
            "kvmesh_routing_decision_seconds",
            "Time a routing decision took (lookup, policy and mark)",
            &[(&[], &self.decision_time)],
        )?;
        let queue: u64 = engines
            .iter()
            .filter_map(|e| e.reported_waiting())
            .map(u64::from)
            .sum();
        single(
            &mut enc,
            "kvmesh_queue_depth",
            "Requests waiting in the engines' queues (sum of vllm:num_requests_waiting); a scale-out signal",
            Value::Gauge(queue as i64),
        )?;
        let in_flight = self.in_flight_total;
        single(
            &mut enc,
            "kvmesh_in_flight",
            "Requests this router has in flight",
            Value::Gauge(in_flight as i64),
        )?;
        let mut m = enc.encode_descriptor(
            "kvmesh_connections_closed",
            "Client connections the router closed on its own: over serve.max_connections (answered 503), or one whose answer could not be written for serve.send_timeout_ms",
            None,
            MetricType::Counter,
        )?;
        let c = &self.connections;
        for (reason, n) in [
            ("over_limit", &c.refused),
            ("send_timeout", &c.send_timeouts),
        ] {
            let labels = [("reason", reason)];
            let mut f = m.encode_family(&labels)?;
            put(&mut f, &Value::Counter(n.load(Relaxed)))?;
        }
        if self.ttft_p99.is_finite() {
            single(
                &mut enc,
                "kvmesh_ttft_p99_seconds",
                "p99 time to first byte over the last minute (bucket upper bound); a scale-out signal",
                Value::GaugeF(self.ttft_p99),
            )?;
        }
        self.encode_engines(&mut enc, &engines)?;
        self.encode_prefix(&mut enc, &engines)?;
        self.encode_ingest(&mut enc, &engines)
    }
}

impl Snapshot {
    fn encode_engines(
        &self,
        enc: &mut DescriptorEncoder<'_>,
        engines: &[&Engine],
    ) -> std::fmt::Result {
        use MetricType::{Counter as C, Gauge as G};
        let now = self.now_us;
        let with_draining: Vec<&Engine> = engines
            .iter()
            .copied()
            .chain(self.draining.iter().map(|e| &**e))
            .collect();
        per_engine(
            enc,
            &with_draining,
            "kvmesh_engine_in_flight",
            "Requests in flight to the engine (a removed engine's while they drain)",
            G,
            &|e| Some(Value::Gauge(i64::from(e.in_flight.load(Relaxed)))),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_requests",
            "Attempts sent to the engine",
            C,
            &|e| count(&e.metrics.requests),
        )?;
        {
            let mut m =
                enc.encode_descriptor("kvmesh_engine_errors", "Failed attempts by kind", None, C)?;
            for e in engines {
                for k in FailKind::ALL {
                    let labels = [("engine", e.url.as_str()), ("kind", k.as_str())];
                    let mut f = m.encode_family(&labels)?;
                    put(
                        &mut f,
                        &Value::Counter(e.metrics.errors[k.index()].load(Relaxed)),
                    )?;
                }
            }
        }
        per_engine(
            enc,
            engines,
            "kvmesh_engine_ejections",
            "Times the engine's circuit breaker opened",
            C,
            &|e| count(&e.metrics.ejections),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_breaker_state",
            "Circuit breaker: 0 closed, 1 open, 2 half-open",
            G,
            &|e| {
                Some(Value::Gauge(match e.tracker().breaker().state(now) {
                    BreakerState::Closed => 0,
                    BreakerState::Open { .. } => 1,
                    BreakerState::HalfOpen => 2,
                }))
            },
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_healthy",
            "Active health checks pass (1) or not (0)",
            G,
            &|e| Some(Value::Gauge(i64::from(e.tracker().health().is_healthy()))),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_effective_weight",
            "Weight the policies use: base × automatic factor × slow-start ramp",
            G,
            &|e| Some(Value::GaugeF(e.view(now, self.fleet_latency_us).weight)),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_slow_start_factor",
            "Slow-start ramp of the engine's weight (1 = full traffic)",
            G,
            &|e| {
                Some(Value::GaugeF(
                    e.tracker().slow_start().factor(&self.slow_start, now),
                ))
            },
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_queue",
            "Requests waiting in the engine (reported by it)",
            G,
            &|e| e.reported_waiting().map(|v| Value::Gauge(i64::from(v))),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_kv_cache_usage",
            "KV-cache usage reported by the engine (0..1)",
            G,
            &|e| e.kv_usage().map(|v| Value::GaugeF(f64::from(v))),
        )?;
        let labels: Vec<[(&str, &str); 1]> = engines
            .iter()
            .map(|e| [("engine", e.url.as_str())])
            .collect();
        let ttft: Vec<(&[(&str, &str)], &Histogram)> = engines
            .iter()
            .zip(&labels)
            .map(|(e, l)| (&l[..], &e.metrics.ttft))
            .collect();
        histogram(
            enc,
            "kvmesh_engine_ttft_seconds",
            "Time to the first body byte, per engine",
            &ttft,
        )?;
        let e2e: Vec<(&[(&str, &str)], &Histogram)> = engines
            .iter()
            .zip(&labels)
            .map(|(e, l)| (&l[..], &e.metrics.e2e))
            .collect();
        histogram(
            enc,
            "kvmesh_engine_e2e_seconds",
            "Time to the end of the body, per engine",
            &e2e,
        )
    }

    /// Cache-aware routing: the index, the request path, predicted vs actual hits.
    fn encode_prefix(
        &self,
        enc: &mut DescriptorEncoder<'_>,
        engines: &[&Engine],
    ) -> std::fmt::Result {
        use MetricType::{Counter as C, Gauge as G};
        let p = &self.prefix;
        let st = p.index().stats();
        let (pieces, memos) = p.cache_bytes();
        for (name, help, v) in [
            (
                "kvmesh_prefix_index_entries",
                "Entries (engine, block) in the prefix index",
                Value::Gauge(st.entries as i64),
            ),
            (
                "kvmesh_prefix_index_confirmed_entries",
                "Entries confirmed by KV events",
                Value::Gauge(st.confirmed as i64),
            ),
            (
                "kvmesh_prefix_index_speculative_entries",
                "Entries carrying a speculative/approximate mark from a routing decision",
                Value::Gauge(st.speculative as i64),
            ),
            (
                "kvmesh_prefix_index_memory_bytes",
                "Heap bytes held by the prefix index",
                Value::Gauge(st.memory_bytes as i64),
            ),
            (
                "kvmesh_prefix_piece_cache_bytes",
                "Bytes of the tokenizers' piece caches, as counted for their bound (up to twice tokenizer_cache_tokens x 4 per tokenizer: they fill over the first hour of a busy router)",
                Value::Gauge(pieces as i64),
            ),
            (
                "kvmesh_prefix_prompt_memo_bytes",
                "Bytes of the prompt memos (up to prompt_memo_bytes per tokenizer)",
                Value::Gauge(memos as i64),
            ),
            (
                "kvmesh_prefix_index_evicted",
                "Entries evicted because their engine was at capacity",
                Value::Counter(st.evicted),
            ),
            (
                "kvmesh_prefix_index_expired",
                "Entries dropped because their mark expired",
                Value::Counter(st.expired),
            ),
            (
                "kvmesh_prefix_lookups",
                "Requests whose prompt was tokenized and looked up",
                Value::Counter(p.metrics.lookups.load(Relaxed)),
            ),
            (
                "kvmesh_prefix_tokenize_failures",
                "Requests of cache-aware routes whose prompt could not be read (routed on load)",
                Value::Counter(p.metrics.tokenize_failures.load(Relaxed)),
            ),
        ] {
            single(enc, name, help, v)?;
        }
        histogram(
            enc,
            "kvmesh_prefix_prepare_seconds",
            "Render + tokenize + block keys of a prompt",
            &[(&[], &p.metrics.prepare_time)],
        )?;
        histogram(
            enc,
            "kvmesh_prefix_lookup_seconds",
            "Prefix-index lookup of a prompt's block keys",
            &[(&[], &p.metrics.lookup_time)],
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_prompt_tokens",
            "Prompt tokens of requests routed to the engine by cache-aware routes",
            C,
            &|e| count(&e.prompt_tokens),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_predicted_cached_tokens",
            "Prompt tokens the router predicted the engine had cached when it routed there",
            C,
            &|e| count(&e.predicted_cached_tokens),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_prefix_cache_hits",
            "The engine's own vllm:prefix_cache_hits_total at the last scrape (actual cached tokens)",
            C,
            &|e| finite(&e.engine_hits_bits).map(Value::CounterF),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_prefix_cache_queries",
            "The engine's own vllm:prefix_cache_queries_total at the last scrape",
            C,
            &|e| finite(&e.engine_queries_bits).map(Value::CounterF),
        )?;
        per_engine(
            enc,
            engines,
            "kvmesh_engine_prefix_prediction_ratio",
            "The router's predicted hit rate on the engine (predicted cached / prompt tokens it routed there) over the engine's own (vllm:prefix_cache_hits / queries, all its traffic), over the last window (one scrape interval or more) with prompts on both sides and a hit on the engine's (1 = the index matches the engine; above 1 it over-predicts)",
            G,
            &|e| finite(&e.prediction_ratio_bits).map(Value::GaugeF),
        )?;
        let index = p.index();
        per_engine(
            enc,
            engines,
            "kvmesh_engine_index_entries",
            "Prefix-index entries of the engine",
            G,
            &|e| {
                Some(Value::Gauge(i64::from(
                    index.engine_counts(e.slot).map_or(0, |c| c.entries),
                )))
            },
        )
    }

    /// KV-event ingestion, per engine that publishes events.
    fn encode_ingest(
        &self,
        enc: &mut DescriptorEncoder<'_>,
        engines: &[&Engine],
    ) -> std::fmt::Result {
        use MetricType::{Counter as C, Gauge as G};
        let ev: Vec<&Engine> = engines
            .iter()
            .copied()
            .filter(|e| !e.kv_events.is_empty())
            .collect();
        let flag = |b: bool| Some(Value::Gauge(i64::from(b)));
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_connected",
            "This router reads the engine's KV events and the engine answers its health checks (1), or not (0)",
            G,
            &|e| flag(e.events_status(self.meshed).0),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_stale",
            "The engine's blocks are not exactly known here (its events not subscribed to, lost batches not replayed, or the feed from its ingest owner not synced); it is routed approximately",
            G,
            &|e| flag(e.events_status(self.meshed).1),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_batches",
            "Event batches applied to the index",
            C,
            &|e| count(&e.ingest.batches),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_dropped_batches",
            "Event batches dropped because the ingestion queue was full",
            C,
            &|e| count(&e.ingest.dropped),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_malformed",
            "Event messages that could not be decoded",
            C,
            &|e| count(&e.ingest.malformed),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_gaps",
            "Sequence gaps (lost batches) detected",
            C,
            &|e| count(&e.ingest.gaps),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_replays",
            "Gaps filled from the engine's replay socket",
            C,
            &|e| count(&e.ingest.replays_ok),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_catch_ups",
            "Batches published before the subscription took effect, fetched from the replay socket after subscribing",
            C,
            &|e| count(&e.ingest.caught_up),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_replay_failures",
            "Gaps the replay could not fill (engine marked stale)",
            C,
            &|e| count(&e.ingest.replays_failed),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_restarts",
            "Engine restarts detected (seq regression or new process start time)",
            C,
            &|e| count(&e.ingest.restarts),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_skipped_block_size",
            "Events skipped because their block size is not the configured one",
            C,
            &|e| count(&e.ingest.skipped_block_size),
        )?;
        per_engine(
            enc,
            &ev,
            "kvmesh_kv_events_tracked_blocks",
            "Blocks the engine holds according to its events",
            G,
            &|e| Some(Value::Gauge(e.ingest.tracked_blocks.load(Relaxed) as i64)),
        )
    }
}
