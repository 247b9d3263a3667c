//! A bounded load client: runs a workload's conversations against OpenAI-compatible endpoints
//! (streaming chat with usage), measuring TTFT, end-to-end latency and cached prompt tokens.
//! Every request has a timeout and the whole run a deadline, so a run always ends by itself.

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

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Runs every conversation of `w` (each sequential over its turns) with at most
/// `opts.concurrency` conversations at once.
pub async fn run_shared_prefix(
    w: &SharedPrefixWorkload,
    targets: Targets,
    opts: LoadOptions,
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
        let (convs, next, rr, client, targets, opts) = (
            convs.clone(),
            next.clone(),
            rr.clone(),
            client.clone(),
            targets.clone(),
            opts.clone(),
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
                run_conversation(&client, conv, &targets, &rr, &opts, max_tokens, &mut report)
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

async fn run_conversation(
    client: &HttpClient,
    conv: &Conversation,
    targets: &Targets,
    rr: &AtomicUsize,
    opts: &LoadOptions,
    max_tokens: u32,
    report: &mut LoadReport,
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
        match tokio::time::timeout(opts.request_timeout, stream_chat(client, &base, body)).await {
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
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("{base}: {e}"))?;
    let status = resp.status();
    let served_by = resp
        .headers()
        .get("x-kvmesh-engine")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| base.to_string());
    let mut body = resp.into_body();
    if !status.is_success() {
        let b = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        return Err(format!("{base}: {status}: {}", String::from_utf8_lossy(&b)));
    }
    let mut ttft = None;
    let mut buf = Vec::new();
    let mut answer = String::new();
    let mut usage = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("{base}: stream: {e}"))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let Some(payload) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            if payload == "[DONE]" {
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(payload).map_err(|e| format!("{base}: bad chunk: {e}"))?;
            if v.get("error").is_some() {
                return Err(format!("{base}: error in stream: {payload}"));
            }
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str()
                && !c.is_empty()
            {
                ttft.get_or_insert_with(|| t0.elapsed());
                answer.push_str(c);
            }
            if v["usage"].is_object() {
                usage = Some(v["usage"].clone());
            }
        }
    }
    let usage = usage.ok_or_else(|| format!("{base}: stream ended without usage"))?;
    let e2e = t0.elapsed();
    Ok((
        Sample {
            served_by,
            ttft: ttft.unwrap_or(e2e),
            e2e,
            prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
            completion_tokens: usage["completion_tokens"].as_u64().unwrap_or(0),
        },
        answer,
    ))
}
