//! A bounded load client: runs a workload's conversations against OpenAI-compatible endpoints
//! (streaming chat with usage), measuring TTFT, end-to-end latency and cached prompt tokens.
//! Every request has a timeout and the whole run a deadline, so a run always ends by itself.

use crate::sse::{HttpClient, post_stream, usage_counts};
use crate::workload::{Conversation, SharedPrefixWorkload};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How requests pick their endpoint.
#[derive(Debug, Clone)]
pub enum Targets {
    /// Round robin over these base URLs, per request (what DNS round robin gives).
    RoundRobin(Vec<String>),
    /// Every request to this base URL (a router).
    Single(String),
}

/// Options of a load run.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Model name to send.
    pub model: String,
    /// Conversations in flight at once.
    pub concurrency: usize,
    /// Timeout of one request.
    pub request_timeout: Duration,
    /// Deadline of the whole run.
    pub deadline: Duration,
}

/// The outcome of one request.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Which endpoint served it (base URL, or the router's `x-kvmesh-engine`).
    pub served_by: String,
    /// Time to the first content byte.
    pub ttft: Duration,
    /// Time to the end of the stream.
    pub e2e: Duration,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the engine's prefix cache.
    pub cached_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// The router's prediction of `cached_tokens` (`x-kvmesh-predicted-cached-tokens`, sent by
    /// cache-aware routes), if any.
    pub predicted_cached_tokens: Option<u64>,
}

/// Results of a run.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// Successful requests.
    pub samples: Vec<Sample>,
    /// Failed requests with their error.
    pub errors: Vec<String>,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl LoadReport {
    /// Fraction of prompt tokens served from cache.
    pub fn hit_rate(&self) -> f64 {
        let p: u64 = self.samples.iter().map(|s| s.prompt_tokens).sum();
        let c: u64 = self.samples.iter().map(|s| s.cached_tokens).sum();
        if p == 0 { 0.0 } else { c as f64 / p as f64 }
    }

    /// Σ predicted / Σ actual cached tokens over the requests that carry a prediction (1 =
    /// the router's view matched the engines'; above 1 it expected hits the engines did not
    /// have), or `None` without predictions.
    pub fn prediction_ratio(&self) -> Option<f64> {
        let (mut p, mut c, mut n) = (0u64, 0u64, 0usize);
        for s in &self.samples {
            if let Some(x) = s.predicted_cached_tokens {
                p += x;
                c += s.cached_tokens;
                n += 1;
            }
        }
        (n > 0).then(|| {
            if c == 0 {
                f64::INFINITY
            } else {
                p as f64 / c as f64
            }
        })
    }

    /// A TTFT percentile (0..=100).
    pub fn ttft_percentile(&self, p: f64) -> Duration {
        let mut v: Vec<Duration> = self.samples.iter().map(|s| s.ttft).collect();
        v.sort_unstable();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
        v[i.min(v.len() - 1)]
    }

    /// Requests per endpoint, sorted by name.
    pub fn per_endpoint(&self) -> Vec<(String, usize, f64)> {
        let mut m: std::collections::BTreeMap<String, (usize, u64, u64)> = Default::default();
        for s in &self.samples {
            let e = m.entry(s.served_by.clone()).or_default();
            e.0 += 1;
            e.1 += s.prompt_tokens;
            e.2 += s.cached_tokens;
        }
        m.into_iter()
            .map(|(k, (n, p, c))| (k, n, if p == 0 { 0.0 } else { c as f64 / p as f64 }))
            .collect()
    }

    /// Output tokens per second of wall time.
    pub fn output_tokens_per_sec(&self) -> f64 {
        let t: u64 = self.samples.iter().map(|s| s.completion_tokens).sum();
        t as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Runs every conversation of `w` (each sequential over its turns) with at most
/// `opts.concurrency` conversations at once.
pub async fn run_shared_prefix(
    w: &SharedPrefixWorkload,
    targets: Targets,
    opts: LoadOptions,
) -> LoadReport {
    run_shared_prefix_with_progress(w, targets, opts, Arc::new(|| {})).await
}

/// [`run_shared_prefix`], calling `progress` once per request as it ends (answered or failed;
/// a failed turn ends its conversation, so its later turns are never counted).
pub async fn run_shared_prefix_with_progress(
    w: &SharedPrefixWorkload,
    targets: Targets,
    opts: LoadOptions,
    progress: Arc<dyn Fn() + Send + Sync>,
) -> LoadReport {
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let start = Instant::now();
    let convs = Arc::new(w.conversations());
    let next = Arc::new(AtomicUsize::new(0));
    let rr = Arc::new(AtomicUsize::new(0));
    let max_tokens = w.max_tokens;
    let mut tasks = Vec::new();
    for _ in 0..opts.concurrency.max(1) {
        let (convs, next, rr, client, targets, opts, progress) = (
            convs.clone(),
            next.clone(),
            rr.clone(),
            client.clone(),
            targets.clone(),
            opts.clone(),
            progress.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut report = LoadReport::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(conv) = convs.get(i) else { break };
                if start.elapsed() > opts.deadline {
                    report
                        .errors
                        .push("deadline reached before the conversation".into());
                    continue;
                }
                run_conversation(
                    &client,
                    conv,
                    &targets,
                    &rr,
                    &opts,
                    max_tokens,
                    &mut report,
                    &*progress,
                )
                .await;
            }
            report
        }));
    }
    let mut report = LoadReport::default();
    for t in tasks {
        if let Ok(r) = t.await {
            report.samples.extend(r.samples);
            report.errors.extend(r.errors);
        }
    }
    report.elapsed = start.elapsed();
    report
}

#[allow(clippy::too_many_arguments)]
async fn run_conversation(
    client: &HttpClient,
    conv: &Conversation,
    targets: &Targets,
    rr: &AtomicUsize,
    opts: &LoadOptions,
    max_tokens: u32,
    report: &mut LoadReport,
    progress: &(dyn Fn() + Send + Sync),
) {
    let mut messages = vec![json!({"role": "system", "content": conv.system})];
    for q in &conv.questions {
        messages.push(json!({"role": "user", "content": q}));
        let base = match targets {
            Targets::RoundRobin(v) if !v.is_empty() => {
                v[rr.fetch_add(1, Ordering::Relaxed) % v.len()].clone()
            }
            Targets::Single(u) => u.clone(),
            Targets::RoundRobin(_) => {
                report.errors.push("no targets".into());
                return;
            }
        };
        let body = json!({
            "model": opts.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "user": format!("g{}u{}", conv.group, conv.user),
        });
        let outcome =
            tokio::time::timeout(opts.request_timeout, stream_chat(client, &base, body)).await;
        progress();
        match outcome {
            Ok(Ok((sample, answer))) => {
                messages.push(json!({"role": "assistant", "content": answer}));
                report.samples.push(sample);
            }
            Ok(Err(e)) => {
                report.errors.push(e);
                return;
            }
            Err(_) => {
                report.errors.push(format!(
                    "timeout after {:?} on {base}",
                    opts.request_timeout
                ));
                return;
            }
        }
    }
}

async fn stream_chat(
    client: &HttpClient,
    base: &str,
    body: serde_json::Value,
) -> Result<(Sample, String), String> {
    let mut s = post_stream(client, base, "/v1/chat/completions", &body).await?;
    let mut ttft = None;
    let mut answer = String::new();
    let mut usage = None;
    while let Some(v) = s.next_chunk().await? {
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str()
            && !c.is_empty()
        {
            ttft.get_or_insert_with(|| s.t0.elapsed());
            answer.push_str(c);
        }
        if v["usage"].is_object() {
            usage = Some(v["usage"].clone());
        }
    }
    let usage = usage.ok_or_else(|| format!("{base}: stream ended without usage"))?;
    let e2e = s.t0.elapsed();
    let (prompt_tokens, cached_tokens, completion_tokens) = usage_counts(&usage);
    Ok((
        Sample {
            served_by: s.served_by,
            ttft: ttft.unwrap_or(e2e),
            e2e,
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            predicted_cached_tokens: s.predicted_cached_tokens,
        },
        answer,
    ))
}

/// An engine's own prefix-cache counters, read from its Prometheus `/metrics` (vLLM's
/// `vllm:prefix_cache_hits_total` and `vllm:prefix_cache_queries_total`, in tokens, and
/// `vllm:num_preemptions_total`), summed over label sets and, with `+`, over engines.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineCounters {
    /// Prompt tokens served from the prefix cache.
    pub hits: f64,
    /// Prompt tokens looked up in the prefix cache.
    pub queries: f64,
    /// Requests preempted (KV cache full).
    pub preemptions: f64,
    /// Requests finished (`vllm:request_success_total`).
    pub requests: f64,
}

impl EngineCounters {
    /// Reads the counters from an exposition page (absent metrics count 0).
    pub fn parse(page: &str) -> EngineCounters {
        EngineCounters {
            hits: metric_sum(page, "vllm:prefix_cache_hits_total"),
            queries: metric_sum(page, "vllm:prefix_cache_queries_total"),
            preemptions: metric_sum(page, "vllm:num_preemptions_total"),
            requests: metric_sum(page, "vllm:request_success_total"),
        }
    }

    /// The engine-reported hit rate: hits / queries (0 without queries).
    pub fn hit_rate(&self) -> f64 {
        if self.queries > 0.0 {
            self.hits / self.queries
        } else {
            0.0
        }
    }

    /// The increase since `before` (counters of the same engines read earlier).
    pub fn since(&self, before: &EngineCounters) -> EngineCounters {
        EngineCounters {
            hits: self.hits - before.hits,
            queries: self.queries - before.queries,
            preemptions: self.preemptions - before.preemptions,
            requests: self.requests - before.requests,
        }
    }
}

impl std::ops::Add for EngineCounters {
    type Output = EngineCounters;
    fn add(self, o: EngineCounters) -> EngineCounters {
        EngineCounters {
            hits: self.hits + o.hits,
            queries: self.queries + o.queries,
            preemptions: self.preemptions + o.preemptions,
            requests: self.requests + o.requests,
        }
    }
}

/// Sum of the samples of metric `name` (any labels) in a Prometheus exposition page.
fn metric_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(name))
        .filter(|rest| rest.starts_with('{') || rest.starts_with(' '))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        .filter(|v| v.is_finite())
        .sum()
}

/// GETs `url` and returns the body as text (bounded by `timeout`; non-2xx is an error).
pub async fn fetch_text(url: &str, timeout: Duration) -> Result<String, String> {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::builder()
        .uri(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("{url}: {e}"))?;
    tokio::time::timeout(timeout, async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{url}: {}", resp.status()));
        }
        let b = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        Ok(String::from_utf8_lossy(&b).into_owned())
    })
    .await
    .map_err(|_| format!("{url}: timeout after {timeout:?}"))?
}

/// GETs `{base}/metrics` of every engine (bounded by `timeout` each) and sums their counters.
pub async fn engine_counters(
    bases: &[String],
    timeout: Duration,
) -> Result<EngineCounters, String> {
    Ok(engine_counters_each(bases, timeout)
        .await?
        .into_iter()
        .fold(EngineCounters::default(), |a, b| a + b))
}

/// Every engine's counters (same order as `bases`).
pub async fn engine_counters_each(
    bases: &[String],
    timeout: Duration,
) -> Result<Vec<EngineCounters>, String> {
    let mut out = Vec::with_capacity(bases.len());
    for base in bases {
        let page = fetch_text(&format!("{base}/metrics"), timeout).await?;
        out.push(EngineCounters::parse(&page));
    }
    Ok(out)
}

/// Samples per-engine in-flight counts at a fixed interval while a run goes on.
pub struct InFlightSampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<Vec<Vec<u32>>>,
}

impl InFlightSampler {
    /// Calls `read` (one count per engine) every `every` until [`stop`](Self::stop).
    pub fn start(every: Duration, read: impl Fn() -> Vec<u32> + Send + 'static) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut out = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                tick.tick().await;
                out.push(read());
            }
            out
        });
        InFlightSampler { stop, task }
    }

    /// Stops sampling (within one interval) and returns the samples.
    pub async fn stop(self) -> InFlightSamples {
        self.stop.store(true, Ordering::Relaxed);
        InFlightSamples {
            samples: self.task.await.unwrap_or_default(),
        }
    }
}

/// Per-engine in-flight counts, one vector per sampled moment.
#[derive(Debug, Clone, Default)]
pub struct InFlightSamples {
    /// The samples, in time order.
    pub samples: Vec<Vec<u32>>,
}

/// One sampled moment's spread of load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Imbalance {
    /// Index of the sample.
    pub at: usize,
    /// The most requests in flight to one engine.
    pub max: u32,
    /// The mean over engines.
    pub mean: f64,
    /// The fewest the busiest engine could hold with this many in flight: ⌈total / engines⌉.
    pub fewest: u32,
}

impl Imbalance {
    /// max / mean.
    pub fn ratio(&self) -> f64 {
        if self.mean > 0.0 {
            f64::from(self.max) / self.mean
        } else {
            0.0
        }
    }
}

impl InFlightSamples {
    /// Each sample's max and mean (samples of no engine are skipped).
    pub fn moments(&self) -> impl Iterator<Item = Imbalance> + '_ {
        self.samples
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .map(|(at, s)| {
                let total: u32 = s.iter().sum();
                Imbalance {
                    at,
                    max: s.iter().copied().max().unwrap_or(0),
                    mean: f64::from(total) / s.len() as f64,
                    fewest: total.div_ceil(s.len() as u32),
                }
            })
    }

    /// The moments whose mean in flight per engine is at least `min_mean` (and above 0):
    /// the samples every figure below is taken over.
    fn under_load(&self, min_mean: f64) -> impl Iterator<Item = Imbalance> + '_ {
        self.moments()
            .filter(move |m| m.mean >= min_mean && m.mean > 0.0)
    }

    /// Over the samples whose mean is at least `min_mean`: the mean of max / mean and its 99th
    /// percentile; `None` without such samples.
    pub fn spread(&self, min_mean: f64) -> Option<(f64, f64)> {
        let mut r: Vec<f64> = self.under_load(min_mean).map(|m| m.ratio()).collect();
        if r.is_empty() {
            return None;
        }
        r.sort_by(f64::total_cmp);
        let mean = r.iter().sum::<f64>() / r.len() as f64;
        let p99 = r[((0.99 * (r.len() - 1) as f64).round() as usize).min(r.len() - 1)];
        Some((mean, p99))
    }

    /// Over the samples whose mean is at least `min_mean`: the mean in flight per engine, and
    /// the mean of how many requests the busiest engine held above the fewest possible for
    /// that many in flight (max − ⌈total / engines⌉). The second separates how requests were
    /// spread from how many were in flight, which max / mean mixes: with fewer in flight (a
    /// longer turnaround between a request's end and its client's next one) max / mean rises
    /// even when every engine holds at most one more than another. `None` without such samples.
    pub fn shape(&self, min_mean: f64) -> Option<(f64, f64)> {
        let (n, mean, excess) = self
            .under_load(min_mean)
            .fold((0usize, 0.0, 0.0), |(n, a, b), m| {
                (n + 1, a + m.mean, b + f64::from(m.max - m.fewest))
            });
        (n > 0).then(|| (mean / n as f64, excess / n as f64))
    }

    /// The sample of the highest max / mean among those whose mean is at least `min_mean`.
    pub fn worst(&self, min_mean: f64) -> Option<Imbalance> {
        self.under_load(min_mean)
            .max_by(|a, b| a.ratio().total_cmp(&b.ratio()))
    }

    /// Samples whose mean is at least `min_mean`, and how many of them exceed `bound` × mean.
    pub fn count_over(&self, min_mean: f64, bound: f64) -> (usize, usize) {
        self.under_load(min_mean).fold((0, 0), |(n, over), m| {
            (n + 1, over + usize::from(f64::from(m.max) > bound * m.mean))
        })
    }

    /// The mean over samples of the mean in flight per engine.
    pub fn average_mean(&self) -> f64 {
        let (n, s) = self
            .moments()
            .fold((0usize, 0.0), |(n, s), m| (n + 1, s + m.mean));
        if n == 0 { 0.0 } else { s / n as f64 }
    }
}

/// One row of a policy comparison (`kvmesh up --compare`, the prefix comparison test).
#[derive(Debug, Clone, Default)]
pub struct CompareRow {
    /// Policy name.
    pub policy: String,
    /// Engine-reported prefix-cache hit rate over the run (Δhits / Δqueries of every engine).
    pub engine_hit_rate: f64,
    /// Client-side fraction of prompt tokens reported cached (`usage.prompt_tokens_details`).
    pub client_cached_rate: f64,
    /// The router's predicted / actual cached tokens ([`LoadReport::prediction_ratio`]).
    pub prediction_ratio: Option<f64>,
    /// Preemptions over the run, all engines.
    pub preemptions: f64,
    /// TTFT percentiles (wall time; divide by the time scale for simulated time).
    pub ttft_p50: Duration,
    /// See `ttft_p50`.
    pub ttft_p99: Duration,
    /// The worst sampled max / mean in-flight ratio (samples above the floor), and its sample.
    pub worst: Option<Imbalance>,
    /// The most requests in flight on one engine at any sample.
    pub max_in_flight: Option<u32>,
    /// The mean in flight per engine, averaged over every sample.
    pub mean_in_flight: f64,
    /// Samples counted for `worst` (and all samples taken).
    pub samples_counted: usize,
    /// See `samples_counted`.
    pub samples_total: usize,
    /// Successful and failed requests.
    pub ok: usize,
    /// See `ok`.
    pub errors: usize,
    /// Wall time of the load.
    pub elapsed: Duration,
}

/// The comparison as a fixed-width text table.
pub fn format_compare_table(rows: &[CompareRow]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:>10} {:>10} {:>10} {:>8} {:>10} {:>10} {:>11} {:>16} {:>10} {:>8} {:>7}",
        "policy",
        "engine_hit",
        "client_hit",
        "pred/real",
        "preempt",
        "ttft_p50",
        "ttft_p99",
        "mean_inflt",
        "worst_max/mean",
        "max_inflt",
        "ok/err",
        "wall"
    );
    for r in rows {
        let worst = match r.worst {
            Some(w) => format!("{:.2} ({}/{:.1})", w.ratio(), w.max, w.mean),
            None => "n/a".to_string(),
        };
        let _ = writeln!(
            out,
            "{:<14} {:>9.1}% {:>9.1}% {:>10} {:>8} {:>8.1}ms {:>8.1}ms {:>11.1} {:>16} {:>10} {:>8} {:>6.1}s",
            r.policy,
            r.engine_hit_rate * 100.0,
            r.client_cached_rate * 100.0,
            r.prediction_ratio
                .map_or("-".to_string(), |x| format!("{x:.3}")),
            r.preemptions,
            r.ttft_p50.as_secs_f64() * 1e3,
            r.ttft_p99.as_secs_f64() * 1e3,
            r.mean_in_flight,
            worst,
            r.max_in_flight.map_or("-".to_string(), |m| m.to_string()),
            format!("{}/{}", r.ok, r.errors),
            r.elapsed.as_secs_f64()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_counters_sum_label_sets_and_skip_lookalikes() {
        let page = "# HELP vllm:prefix_cache_hits_total x\n\
                    vllm:prefix_cache_hits_total{engine=\"0\"} 30\n\
                    vllm:prefix_cache_hits_total{engine=\"1\"} 10\n\
                    vllm:prefix_cache_hits_totalish 99\n\
                    vllm:prefix_cache_queries_total{engine=\"0\"} 80\n";
        let c = EngineCounters::parse(page);
        assert_eq!((c.hits, c.queries, c.preemptions), (40.0, 80.0, 0.0));
        assert_eq!(c.hit_rate(), 0.5);
        let d = (c + c).since(&c);
        assert_eq!(d, c);
        assert_eq!(EngineCounters::default().hit_rate(), 0.0);
    }

    #[test]
    fn in_flight_imbalance_ignores_moments_below_the_floor() {
        let s = InFlightSamples {
            samples: vec![vec![3, 0, 0, 1], vec![12, 8, 10, 10], vec![20, 10, 5, 5]],
        };
        let w = s.worst(9.0).unwrap();
        assert_eq!((w.at, w.max), (2, 20));
        assert_eq!(w.ratio(), 2.0);
        assert_eq!(s.count_over(9.0, 1.9), (2, 1));
        assert_eq!(s.worst(1.0).unwrap().at, 0);
        assert!(s.worst(50.0).is_none());
        // Mean over the two counted moments: (1.2 + 2.0) / 2; the p99 is the larger.
        let (mean, p99) = s.spread(9.0).unwrap();
        assert!((mean - 1.6).abs() < 1e-9, "{mean}");
        assert_eq!(p99, 2.0);
        assert!(s.spread(50.0).is_none());
    }

    #[test]
    fn the_shape_takes_the_number_in_flight_out_of_the_spread() {
        // 95 and 94 in flight over 8 engines, each spread as evenly as it can be: max / mean
        // differs (12 / 11.875, 12 / 11.75), the excess over the fewest possible is 0 for both.
        let even = InFlightSamples {
            samples: vec![
                vec![12, 12, 12, 12, 12, 12, 12, 11],
                vec![12, 12, 12, 12, 12, 12, 11, 11],
            ],
        };
        let (mean, excess) = even.shape(1.0).unwrap();
        assert!((mean - 11.8125).abs() < 1e-9, "{mean}");
        assert_eq!(excess, 0.0);
        // One engine two above the fewest possible (⌈95 / 8⌉ = 12), then one at the fewest;
        // the moment below the floor is not counted.
        let uneven = InFlightSamples {
            samples: vec![
                vec![14, 12, 12, 12, 12, 11, 11, 11],
                vec![12; 8],
                vec![1, 0, 0, 0],
            ],
        };
        let (mean, excess) = uneven.shape(9.0).unwrap();
        assert!((mean - 11.9375).abs() < 1e-9, "{mean}");
        assert_eq!(excess, 1.0);
        assert!(uneven.shape(50.0).is_none());
    }

    #[test]
    fn the_steady_excess_leaves_the_drain_out() {
        // 96 in flight, evenly and then with a 13th; then the drain (40 in flight) with an
        // engine far above the fewest, which the steady figure does not count.
        let s = InFlightSamples {
            samples: vec![
                vec![12; 8],
                vec![13, 12, 12, 12, 12, 12, 12, 11],
                vec![12, 12, 12, 12, 12, 12, 11, 11],
                vec![10, 10, 10, 4, 3, 1, 1, 1],
            ],
        };
        // The steady part as `kvmesh bench` takes it: at least 90% of the highest mean (12).
        assert_eq!(s.shape(0.9 * 12.0).map(|(_, e)| e), Some(1.0 / 3.0));
        assert_eq!(s.shape(1.0).map(|(_, e)| e), Some((1.0 + 5.0) / 4.0));
        assert_eq!(InFlightSamples::default().shape(0.9), None);
    }
}
