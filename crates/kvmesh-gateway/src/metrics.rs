//! The router's `/metrics` (Prometheus text). Every metric name of the router is in this file.

use crate::engine::Engine;
use crate::registry::Registry;
use kvmesh_metrics::{
    Histogram, LATENCY_BUCKETS, MICRO_BUCKETS, escape_label, family, header, sample,
};
use kvmesh_policy::BreakerState;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

pub use kvmesh_route::FailKind;

/// Decisions of one model by (policy, reason).
type DecisionCounts = BTreeMap<(&'static str, &'static str), u64>;

/// Router-wide metrics.
pub struct GatewayMetrics {
    /// Requests received on the inference endpoints.
    pub requests: AtomicU64,
    /// Retries sent (attempts after the first).
    pub retries: AtomicU64,
    /// Retries refused by the retry budget.
    pub budget_exhausted: AtomicU64,
    /// Requests that ended in an error answer from the router (by status).
    responses_by_status: Mutex<BTreeMap<u16, u64>>,
    /// Routing decisions by model, then (policy, reason).
    decisions: Mutex<BTreeMap<String, DecisionCounts>>,
    /// Time spent deciding (policy only).
    pub decision_time: Histogram,
    /// TTFT of all requests in the current window, for the p99 gauge.
    ttft_window: Mutex<(Histogram, u64)>,
    ttft_last_p99: AtomicU64,
}

/// Length of the window over which the p99-TTFT gauge is computed (µs).
const TTFT_WINDOW_US: u64 = 60_000_000;

impl Default for GatewayMetrics {
    fn default() -> Self {
        GatewayMetrics {
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            budget_exhausted: AtomicU64::new(0),
            responses_by_status: Mutex::new(BTreeMap::new()),
            decisions: Mutex::new(BTreeMap::new()),
            decision_time: Histogram::new(MICRO_BUCKETS),
            ttft_window: Mutex::new((Histogram::new(LATENCY_BUCKETS), 0)),
            ttft_last_p99: AtomicU64::new(f64::NAN.to_bits()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl GatewayMetrics {
    /// Counts one routing decision.
    pub fn decision(&self, model: &str, policy: &'static str, reason: &'static str, took_us: u64) {
        self.decision_time.observe_us(took_us);
        let mut d = lock(&self.decisions);
        // No allocation once the model is known (the common case).
        let per_model = match d.get_mut(model) {
            Some(m) => m,
            None => d.entry(model.to_string()).or_default(),
        };
        *per_model.entry((policy, reason)).or_default() += 1;
    }

    /// Counts an answer the router gave with an error status (its own or an engine's).
    pub fn error_response(&self, status: u16) {
        *lock(&self.responses_by_status).entry(status).or_default() += 1;
    }

    /// Records a TTFT into the rolling p99 window.
    pub fn observe_ttft(&self, now_us: u64, ttft_us: u64) {
        let mut w = lock(&self.ttft_window);
        if now_us.saturating_sub(w.1) >= TTFT_WINDOW_US {
            if let Some(p) = w.0.quantile_bound(0.99) {
                self.ttft_last_p99.store(p.to_bits(), Relaxed);
            }
            *w = (Histogram::new(LATENCY_BUCKETS), now_us);
        }
        w.0.observe_us(ttft_us);
    }

    fn ttft_p99(&self) -> f64 {
        let w = lock(&self.ttft_window);
        w.0.quantile_bound(0.99)
            .unwrap_or_else(|| f64::from_bits(self.ttft_last_p99.load(Relaxed)))
    }

    /// The exposition text.
    pub fn render(&self, reg: &Registry, now_us: u64) -> String {
        let mut out = String::with_capacity(16 * 1024);
        family(
            &mut out,
            "kvmesh_requests_total",
            "Requests received on the inference endpoints.",
            "counter",
            "",
            self.requests.load(Relaxed),
        );
        family(
            &mut out,
            "kvmesh_retries_total",
            "Attempts sent to another engine after a failed attempt.",
            "counter",
            "",
            self.retries.load(Relaxed),
        );
        family(
            &mut out,
            "kvmesh_retry_budget_exhausted_total",
            "Retries not sent because the retry budget was spent.",
            "counter",
            "",
            self.budget_exhausted.load(Relaxed),
        );
        header(
            &mut out,
            "kvmesh_error_responses_total",
            "Answers with an error status, by status.",
            "counter",
        );
        for (status, n) in lock(&self.responses_by_status).iter() {
            sample(
                &mut out,
                "kvmesh_error_responses_total",
                &format!("status=\"{status}\""),
                n,
            );
        }
        header(
            &mut out,
            "kvmesh_routing_decisions_total",
            "Routing decisions by model, policy and reason.",
            "counter",
        );
        for (model, per) in lock(&self.decisions).iter() {
            for ((policy, reason), n) in per {
                sample(
                    &mut out,
                    "kvmesh_routing_decisions_total",
                    &format!(
                        "model=\"{}\",policy=\"{policy}\",reason=\"{reason}\"",
                        escape_label(model)
                    ),
                    n,
                );
            }
        }
        self.decision_time.render(
            &mut out,
            "kvmesh_routing_decision_seconds",
            "Time a routing decision took (policy only).",
            "",
        );
        let members = reg.members();
        let mut engines: Vec<&Engine> = members.iter().map(|e| &**e).collect();
        engines.sort_by(|a, b| a.url.cmp(&b.url));
        let queue: u64 = engines
            .iter()
            .filter_map(|e| e.reported_waiting())
            .map(u64::from)
            .sum();
        family(
            &mut out,
            "kvmesh_queue_depth",
            "Requests waiting in the engines' queues (sum of vllm:num_requests_waiting); a scale-out signal.",
            "gauge",
            "",
            queue,
        );
        let in_flight: u64 = engines
            .iter()
            .map(|e| u64::from(e.in_flight.load(Relaxed)))
            .sum();
        family(
            &mut out,
            "kvmesh_in_flight",
            "Requests this router has in flight.",
            "gauge",
            "",
            in_flight,
        );
        let p99 = self.ttft_p99();
        if p99.is_finite() {
            family(
                &mut out,
                "kvmesh_ttft_p99_seconds",
                "p99 time to first byte over the last minute (bucket upper bound); a scale-out signal.",
                "gauge",
                "",
                p99,
            );
        }
        self.render_engines(&mut out, &engines, reg, now_us);
        render_prefix(&mut out, &engines, reg);
        out
    }

    fn render_engines(&self, out: &mut String, engines: &[&Engine], reg: &Registry, now_us: u64) {
        let label = |e: &Engine| format!("engine=\"{}\"", escape_label(&e.url));
        let per = |out: &mut String,
                   name: &str,
                   help: &str,
                   kind: &str,
                   f: &dyn Fn(&Engine) -> String| {
            header(out, name, help, kind);
            for e in engines {
                sample(out, name, &label(e), f(e));
            }
        };
        per(
            out,
            "kvmesh_engine_in_flight",
            "Requests in flight to the engine.",
            "gauge",
            &|e| e.in_flight.load(Relaxed).to_string(),
        );
        per(
            out,
            "kvmesh_engine_requests_total",
            "Attempts sent to the engine.",
            "counter",
            &|e| e.metrics.requests.load(Relaxed).to_string(),
        );
        header(
            out,
            "kvmesh_engine_errors_total",
            "Failed attempts by kind.",
            "counter",
        );
        for e in engines {
            for (i, k) in FailKind::ALL.iter().enumerate() {
                sample(
                    out,
                    "kvmesh_engine_errors_total",
                    &format!("{},kind=\"{}\"", label(e), k.as_str()),
                    e.metrics.errors[i].load(Relaxed),
                );
            }
        }
        per(
            out,
            "kvmesh_engine_ejections_total",
            "Times the engine's circuit breaker opened.",
            "counter",
            &|e| e.metrics.ejections.load(Relaxed).to_string(),
        );
        per(
            out,
            "kvmesh_engine_breaker_state",
            "Circuit breaker: 0 closed, 1 open, 2 half-open.",
            "gauge",
            &|e| {
                match e.tracker().breaker().state(now_us) {
                    BreakerState::Closed => "0",
                    BreakerState::Open { .. } => "1",
                    BreakerState::HalfOpen => "2",
                }
                .to_string()
            },
        );
        per(
            out,
            "kvmesh_engine_healthy",
            "Active health checks pass (1) or not (0).",
            "gauge",
            &|e| u8::from(e.tracker().health().is_healthy()).to_string(),
        );
        let fleet = reg.fleet_latency_us();
        per(
            out,
            "kvmesh_engine_effective_weight",
            "Weight the policies use: base × automatic factor × slow-start ramp.",
            "gauge",
            &|e| format!("{:.4}", e.view(now_us, fleet).weight),
        );
        per(
            out,
            "kvmesh_engine_slow_start_factor",
            "Slow-start ramp of the engine's weight (1 = full traffic).",
            "gauge",
            &|e| {
                let t = e.tracker();
                let cfg = reg.health_cfg();
                format!("{:.4}", t.slow_start().factor(&cfg.slow_start, now_us))
            },
        );
        per(
            out,
            "kvmesh_engine_queue",
            "Requests waiting in the engine (reported by it).",
            "gauge",
            &|e| e.reported_waiting().map_or("NaN".into(), |v| v.to_string()),
        );
        per(
            out,
            "kvmesh_engine_kv_cache_usage",
            "KV-cache usage reported by the engine (0..1).",
            "gauge",
            &|e| e.kv_usage().map_or("NaN".into(), |v| v.to_string()),
        );
        header(
            out,
            "kvmesh_engine_ttft_seconds",
            "Time to the first body byte, per engine.",
            "histogram",
        );
        for e in engines {
            e.metrics
                .ttft
                .render_series(out, "kvmesh_engine_ttft_seconds", &label(e));
        }
        header(
            out,
            "kvmesh_engine_e2e_seconds",
            "Time to the end of the body, per engine.",
            "histogram",
        );
        for e in engines {
            e.metrics
                .e2e
                .render_series(out, "kvmesh_engine_e2e_seconds", &label(e));
        }
    }
}

fn f64_text(bits: &AtomicU64) -> String {
    let v = f64::from_bits(bits.load(Relaxed));
    if v.is_finite() {
        v.to_string()
    } else {
        "NaN".into()
    }
}

/// Cache-aware routing: the index, the request path, predicted vs actual hits, KV-event
/// ingestion per engine.
fn render_prefix(out: &mut String, engines: &[&Engine], reg: &Registry) {
    let p = &reg.prefix;
    let st = p.index().stats();
    for (name, help, kind, v) in [
        (
            "kvmesh_prefix_index_entries",
            "Entries (engine, block) in the prefix index.",
            "gauge",
            st.entries,
        ),
        (
            "kvmesh_prefix_index_confirmed_entries",
            "Entries confirmed by KV events.",
            "gauge",
            st.confirmed,
        ),
        (
            "kvmesh_prefix_index_speculative_entries",
            "Entries carrying a speculative/approximate mark from a routing decision.",
            "gauge",
            st.speculative,
        ),
        (
            "kvmesh_prefix_index_memory_bytes",
            "Heap bytes held by the prefix index.",
            "gauge",
            st.memory_bytes,
        ),
        (
            "kvmesh_prefix_index_evicted_total",
            "Entries evicted because their engine was at capacity.",
            "counter",
            st.evicted,
        ),
        (
            "kvmesh_prefix_index_expired_total",
            "Entries dropped because their mark expired.",
            "counter",
            st.expired,
        ),
        (
            "kvmesh_prefix_lookups_total",
            "Requests whose prompt was tokenized and looked up.",
            "counter",
            p.metrics.lookups.load(Relaxed),
        ),
        (
            "kvmesh_prefix_tokenize_failures_total",
            "Requests of cache-aware routes whose prompt could not be read (routed on load).",
            "counter",
            p.metrics.tokenize_failures.load(Relaxed),
        ),
    ] {
        family(out, name, help, kind, "", v);
    }
    p.metrics.prepare_time.render(
        out,
        "kvmesh_prefix_prepare_seconds",
        "Render + tokenize + block keys of a prompt.",
        "",
    );
    p.metrics.lookup_time.render(
        out,
        "kvmesh_prefix_lookup_seconds",
        "Prefix-index lookup of a prompt's block keys.",
        "",
    );
    let label = |e: &Engine| format!("engine=\"{}\"", escape_label(&e.url));
    let per =
        |out: &mut String, name: &str, help: &str, kind: &str, f: &dyn Fn(&Engine) -> String| {
            header(out, name, help, kind);
            for e in engines {
                sample(out, name, &label(e), f(e));
            }
        };
    per(
        out,
        "kvmesh_engine_prompt_tokens_total",
        "Prompt tokens of requests routed to the engine by cache-aware routes.",
        "counter",
        &|e| e.prompt_tokens.load(Relaxed).to_string(),
    );
    per(
        out,
        "kvmesh_engine_predicted_cached_tokens_total",
        "Prompt tokens the router predicted the engine had cached when it routed there.",
        "counter",
        &|e| e.predicted_cached_tokens.load(Relaxed).to_string(),
    );
    per(
        out,
        "kvmesh_engine_prefix_cache_hits_total",
        "The engine's own vllm:prefix_cache_hits_total at the last scrape (actual cached tokens).",
        "counter",
        &|e| f64_text(&e.engine_hits_bits),
    );
    per(
        out,
        "kvmesh_engine_prefix_cache_queries_total",
        "The engine's own vllm:prefix_cache_queries_total at the last scrape.",
        "counter",
        &|e| f64_text(&e.engine_queries_bits),
    );
    per(
        out,
        "kvmesh_engine_prefix_prediction_ratio",
        "Predicted / actual cached tokens over the last scrape interval (1 = the index matches the engine; above 1 it over-predicts, e.g. after evictions it missed).",
        "gauge",
        &|e| f64_text(&e.prediction_ratio_bits),
    );
    per(
        out,
        "kvmesh_engine_index_entries",
        "Prefix-index entries of the engine.",
        "gauge",
        &|e| {
            p.index()
                .engine_counts(e.slot)
                .map_or(0, |c| c.entries)
                .to_string()
        },
    );
    let ev: Vec<&Engine> = engines
        .iter()
        .copied()
        .filter(|e| !e.kv_events.is_empty())
        .collect();
    let per_ev =
        |out: &mut String, name: &str, help: &str, kind: &str, f: &dyn Fn(&Engine) -> String| {
            header(out, name, help, kind);
            for e in &ev {
                sample(out, name, &label(e), f(e));
            }
        };
    let a = |x: &AtomicU64| x.load(Relaxed).to_string();
    per_ev(
        out,
        "kvmesh_kv_events_connected",
        "The KV-event subscription is connected (1) or not (0).",
        "gauge",
        &|e| u8::from(e.ingest.connected.load(Relaxed)).to_string(),
    );
    per_ev(
        out,
        "kvmesh_kv_events_stale",
        "The engine's blocks are not exactly known (lost batches not replayed); it is routed approximately.",
        "gauge",
        &|e| u8::from(e.ingest.stale.load(Relaxed)).to_string(),
    );
    per_ev(
        out,
        "kvmesh_kv_events_batches_total",
        "Event batches applied to the index.",
        "counter",
        &|e| a(&e.ingest.batches),
    );
    per_ev(
        out,
        "kvmesh_kv_events_dropped_batches_total",
        "Event batches dropped because the ingestion queue was full.",
        "counter",
        &|e| a(&e.ingest.dropped),
    );
    per_ev(
        out,
        "kvmesh_kv_events_malformed_total",
        "Event messages that could not be decoded.",
        "counter",
        &|e| a(&e.ingest.malformed),
    );
    per_ev(
        out,
        "kvmesh_kv_events_gaps_total",
        "Sequence gaps (lost batches) detected.",
        "counter",
        &|e| a(&e.ingest.gaps),
    );
    per_ev(
        out,
        "kvmesh_kv_events_replays_total",
        "Gaps filled from the engine's replay socket.",
        "counter",
        &|e| a(&e.ingest.replays_ok),
    );
    per_ev(
        out,
        "kvmesh_kv_events_replay_failures_total",
        "Gaps the replay could not fill (engine marked stale).",
        "counter",
        &|e| a(&e.ingest.replays_failed),
    );
    per_ev(
        out,
        "kvmesh_kv_events_restarts_total",
        "Engine restarts detected (seq regression or new process start time).",
        "counter",
        &|e| a(&e.ingest.restarts),
    );
    per_ev(
        out,
        "kvmesh_kv_events_skipped_block_size_total",
        "Events skipped because their block size is not the configured one.",
        "counter",
        &|e| a(&e.ingest.skipped_block_size),
    );
    per_ev(
        out,
        "kvmesh_kv_events_tracked_blocks",
        "Blocks the engine holds according to its events.",
        "gauge",
        &|e| a(&e.ingest.tracked_blocks),
    );
}
