//! `/metrics` in Prometheus text format under vLLM's metric names (vLLM V1,
//! `vllm/v1/metrics/loggers.py`), with vLLM's histogram buckets.
//!
//! Durations are in simulated seconds: equal to real seconds at `time_scale = 1`, and the
//! engine model's own time otherwise (what a real engine would have reported).

use kvmesh_engine::{EngineStats, FinishedRequest, StepOutput};
use kvmesh_metrics::Histogram;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// `vllm:iteration_tokens_total` (tokens per engine step): token counts, recorded through
/// [`Histogram::observe_us`] as "seconds" (a count of n is observed as n × 10⁶ µs), so the
/// rendered buckets and sum are token counts.
const ITERATION_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// Every metric of one simulated engine.
pub struct SimMetrics {
    labels: String,
    ttft: Histogram,
    e2e: Histogram,
    itl: Histogram,
    iteration_tokens: Histogram,
    success: AtomicU64,
    aborted: AtomicU64,
    injected_errors: AtomicU64,
    restarts: AtomicU64,
    rejected: AtomicU64,
    events_dropped: AtomicU64,
    http2_requests: AtomicU64,
    /// `process_start_time_seconds` (f64 bits): set at start and by every simulated restart,
    /// as a restarted vLLM process reports a new one (routers use it to detect restarts).
    start_time_bits: AtomicU64,
    /// Counters of the current engine plus those of engines before restarts (vLLM's counters
    /// restart with the process; we keep them monotonic so that rate() stays meaningful, and
    /// count restarts separately).
    engine: Mutex<(EngineStats, EngineStats)>,
}

impl SimMetrics {
    /// Metrics labelled with the served model name.
    pub fn new(model: &str) -> Self {
        let model = model.replace('\\', "\\\\").replace('"', "\\\"");
        SimMetrics {
            labels: format!("model_name=\"{model}\",engine=\"0\""),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            iteration_tokens: Histogram::new(ITERATION_BUCKETS),
            success: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            injected_errors: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            events_dropped: AtomicU64::new(0),
            http2_requests: AtomicU64::new(0),
            start_time_bits: AtomicU64::new(unix_now().to_bits()),
            engine: Mutex::new((EngineStats::default(), EngineStats::default())),
        }
    }

    /// After each engine step: the tokens it computed (prefill chunks and decodes: vLLM's
    /// `iteration_tokens_total`, one observation per step that scheduled any) and
    /// inter-token latencies (every non-first token waited one step).
    pub fn observe_step(&self, out: &StepOutput) {
        let tokens = out.shape.scheduled_tokens();
        if tokens > 0 {
            self.iteration_tokens
                .observe_us(tokens.saturating_mul(1_000_000));
        }
        for t in &out.tokens {
            if t.index > 0 {
                self.itl.observe_us(out.duration_us);
            }
        }
    }

    /// A request finished.
    pub fn observe_finished(&self, f: &FinishedRequest) {
        self.success.fetch_add(1, Relaxed);
        self.ttft
            .observe_us(f.first_token_at.saturating_sub(f.arrival));
        self.e2e.observe_us(f.finished_at.saturating_sub(f.arrival));
    }

    /// A client disconnected before its request finished.
    pub fn aborted(&self) {
        self.aborted.fetch_add(1, Relaxed);
    }

    /// A request was answered with an injected error.
    pub fn injected_error(&self) {
        self.injected_errors.fetch_add(1, Relaxed);
    }

    /// A request was rejected as invalid (4xx).
    pub fn rejected(&self) {
        self.rejected.fetch_add(1, Relaxed);
    }

    /// A request arrived over HTTP/2 (h2c).
    pub fn http2_request(&self) {
        self.http2_requests.fetch_add(1, Relaxed);
    }

    /// A KV-event batch was dropped by fault injection.
    pub fn event_batch_dropped(&self) {
        self.events_dropped.fetch_add(1, Relaxed);
    }

    /// The engine restarted: fold the old engine's counters into the base.
    pub fn restarted(&self) {
        self.restarts.fetch_add(1, Relaxed);
        let old = f64::from_bits(self.start_time_bits.load(Relaxed));
        let now = unix_now().max(old + 0.001);
        self.start_time_bits.store(now.to_bits(), Relaxed);
        let mut g = match self.engine.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let (base, cur) = &mut *g;
        base.prefix_cache_queries += cur.prefix_cache_queries;
        base.prefix_cache_hits += cur.prefix_cache_hits;
        base.preemptions += cur.preemptions;
        base.prompt_tokens += cur.prompt_tokens;
        base.generation_tokens += cur.generation_tokens;
        *cur = EngineStats::default();
    }

    /// The engine's latest counters and gauges.
    pub fn set_engine_stats(&self, s: &EngineStats) {
        let mut g = match self.engine.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.1 = s.clone();
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let (base, cur) = match self.engine.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        let l = &self.labels;
        let mut out = String::with_capacity(8192);
        let mut gauge = |name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{l}}} {v}"
            );
        };
        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            cur.running as f64,
        );
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            cur.waiting as f64,
        );
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            cur.kv_cache_usage,
        );
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{l}}} {v}"
            );
        };
        counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            base.prefix_cache_queries + cur.prefix_cache_queries,
        );
        counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            base.prefix_cache_hits + cur.prefix_cache_hits,
        );
        counter(
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            base.preemptions + cur.preemptions,
        );
        counter(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            base.prompt_tokens + cur.prompt_tokens,
        );
        counter(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            base.generation_tokens + cur.generation_tokens,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n\
             # TYPE vllm:request_success_total counter\n\
             vllm:request_success_total{{{l},finished_reason=\"length\"}} {}",
            self.success.load(Relaxed)
        );
        self.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            l,
        );
        self.e2e.render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            l,
        );
        self.itl.render(
            &mut out,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            l,
        );
        self.iteration_tokens.render(
            &mut out,
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            l,
        );
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{l}}} {v}"
            );
        };
        counter(
            "kvmesh_sim_aborted_requests_total",
            "Requests aborted because the client disconnected.",
            self.aborted.load(Relaxed),
        );
        counter(
            "kvmesh_sim_injected_errors_total",
            "Requests answered with an injected error status.",
            self.injected_errors.load(Relaxed),
        );
        counter(
            "kvmesh_sim_rejected_requests_total",
            "Requests rejected as invalid (4xx).",
            self.rejected.load(Relaxed),
        );
        counter(
            "kvmesh_sim_restarts_total",
            "Simulated engine restarts (KV-event seq back to 0).",
            self.restarts.load(Relaxed),
        );
        counter(
            "kvmesh_sim_dropped_event_batches_total",
            "KV-event batches dropped by fault injection.",
            self.events_dropped.load(Relaxed),
        );
        counter(
            "kvmesh_sim_http2_requests_total",
            "HTTP requests received over HTTP/2 (h2c prior knowledge).",
            self.http2_requests.load(Relaxed),
        );
        counter(
            "kvmesh_sim_engine_steps_total",
            "Engine steps since the last restart.",
            cur.steps,
        );
        let _ = writeln!(
            out,
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n\
             # TYPE process_start_time_seconds gauge\n\
             process_start_time_seconds {:.3}",
            f64::from_bits(self.start_time_bits.load(Relaxed))
        );
        out
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
