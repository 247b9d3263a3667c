//! The job client: replays a [`JobSet`] against OpenAI-compatible endpoints as streaming
//! `/v1/completions` (token-id prompts, or text with a word per token), closed loop (at most
//! `concurrency` conversations at once) or open loop (each job at its arrival ÷ speed-up, at most
//! `max_in_flight` at once). Every request has a timeout and the run a deadline.

use crate::jobs::{Arrival, Job, JobSet, prompt_text};
use crate::load::Targets;
use crate::sse::{HttpClient, post_stream, usage_counts};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How prompts are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PromptMode {
    /// Token ids (`"prompt": [ids]`): the engine sees exactly the job's tokens.
    #[default]
    Tokens,
    /// Text, one word per token id (for routers that need text, e.g. SMG).
    Text,
}

/// Options of a replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Model name to send.
    pub model: String,
    /// Prompts as token ids or text.
    pub prompts: PromptMode,
    /// Closed loop: conversations at once.
    pub concurrency: usize,
    /// Open loop: requests in flight at most (later arrivals wait).
    pub max_in_flight: usize,
    /// Open loop: trace time ÷ this.
    pub speedup: f64,
    /// Timeout of one request.
    pub request_timeout: Duration,
    /// Deadline of the whole run: jobs not started by then are counted as errors.
    pub deadline: Duration,
    /// Closed loop over several targets: each client keeps one target for all its
    /// conversations (client `i` → target `i mod n`, as a client resolving DNS once and
    /// holding a keep-alive connection would); `false`: every request goes to the next
    /// target (a conversation's turns through different routers: the mesh's hard case).
    pub sticky_clients: bool,
    /// Closed loop: a client's mean pause after each request (a user reading the answer, an
    /// agent running a tool) before it sends the next; each pause is drawn uniformly from
    /// `[0, 2 × think]`, fixed by the job. Zero: the next request leaves as soon as the answer
    /// has ended (the default; every turn of the fleet's clients then follows an engine's
    /// decode step at once).
    pub think: Duration,
}

/// The pause after job `id` for a mean of `think`: uniform in `[0, 2 × think]`, the same in
/// every run of the job set, and never longer than `left` (what remains of the run's
/// deadline: a client does not sleep past the end of the run).
pub fn think_pause(think: Duration, id: u64, left: Duration) -> Duration {
    let span = u64::try_from(think.as_micros().saturating_mul(2)).unwrap_or(u64::MAX);
    if span == 0 {
        return Duration::ZERO;
    }
    let draw = kvmesh_policy::mix64(id ^ 0x7417_C0DE) % span.saturating_add(1);
    Duration::from_micros(draw).min(left)
}

/// The outcome of one request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Record {
    /// The job.
    pub job: u64,
    /// When it was sent, seconds since the run's start.
    pub sent_s: f64,
    /// Which endpoint served it (the router's `x-kvmesh-engine`, else the base URL).
    pub served_by: String,
    /// Time to the first streamed choice, seconds.
    pub ttft_s: f64,
    /// Time to the end of the stream, seconds.
    pub e2e_s: f64,
    /// Mean gap between streamed chunks after the first, seconds (None with < 2 chunks).
    pub itl_s: Option<f64>,
    /// Prompt tokens (usage).
    pub prompt_tokens: u64,
    /// Prompt tokens the engine served from cache (usage).
    pub cached_tokens: u64,
    /// Completion tokens (usage).
    pub completion_tokens: u64,
    /// The router's predicted cached tokens (`x-kvmesh-predicted-cached-tokens`).
    pub predicted_cached_tokens: Option<u64>,
    /// The error, for a failed request.
    pub error: Option<String>,
}

/// Replays `set` against `targets`; `progress` is called once per finished job.
pub async fn replay(
    set: &JobSet,
    targets: Targets,
    opts: &ReplayOptions,
    progress: Arc<dyn Fn() + Send + Sync>,
) -> (Vec<Record>, Duration) {
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let start = Instant::now();
    let jobs = Arc::new(set.jobs.clone());
    let rr = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    match set.arrival {
        Arrival::Closed => {
            let convs = Arc::new(set.conversations());
            let next = Arc::new(AtomicUsize::new(0));
            for client_no in 0..opts.concurrency.max(1) {
                let (convs, next, jobs, rr, client, targets, opts, progress) = (
                    convs.clone(),
                    next.clone(),
                    jobs.clone(),
                    rr.clone(),
                    client.clone(),
                    targets.clone(),
                    opts.clone(),
                    progress.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(conv) = convs.get(i) else { break };
                        let mut failed = false;
                        for &j in conv {
                            let job = &jobs[j];
                            let r = if failed || start.elapsed() > opts.deadline {
                                Record::failed(job, "not sent: deadline or earlier turn failed")
                            } else {
                                let base = match &targets {
                                    Targets::RoundRobin(v)
                                        if opts.sticky_clients && !v.is_empty() =>
                                    {
                                        v[client_no % v.len()].clone()
                                    }
                                    _ => pick(&targets, &rr),
                                };
                                send(&client, &base, job, &opts, start).await
                            };
                            failed |= r.error.is_some();
                            progress();
                            out.push(r);
                            let left = opts.deadline.saturating_sub(start.elapsed());
                            let pause = think_pause(opts.think, job.id, left);
                            if !failed && !pause.is_zero() {
                                tokio::time::sleep(pause).await;
                            }
                        }
                    }
                    out
                }));
            }
        }
        Arrival::Open => {
            let gate = Arc::new(tokio::sync::Semaphore::new(opts.max_in_flight.max(1)));
            let speed = if opts.speedup > 0.0 {
                opts.speedup
            } else {
                1.0
            };
            for j in 0..jobs.len() {
                let due = Duration::from_secs_f64(jobs[j].at_us as f64 / 1e6 / speed);
                if due > opts.deadline {
                    tasks.push(tokio::spawn({
                        let (jobs, progress) = (jobs.clone(), progress.clone());
                        async move {
                            progress();
                            vec![Record::failed(&jobs[j], "not sent: beyond the deadline")]
                        }
                    }));
                    continue;
                }
                tokio::time::sleep_until((start + due).into()).await;
                let permit = gate.clone().acquire_owned().await;
                let (jobs, rr, client, targets, opts, progress) = (
                    jobs.clone(),
                    rr.clone(),
                    client.clone(),
                    targets.clone(),
                    opts.clone(),
                    progress.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let _permit = permit;
                    let base = pick(&targets, &rr);
                    let r = send(&client, &base, &jobs[j], &opts, start).await;
                    progress();
                    vec![r]
                }));
            }
        }
    }
    let mut out = Vec::with_capacity(set.jobs.len());
    for t in tasks {
        if let Ok(r) = t.await {
            out.extend(r);
        }
    }
    out.sort_by_key(|r| r.job);
    (out, start.elapsed())
}

impl Record {
    fn failed(job: &Job, e: &str) -> Record {
        Record {
            job: job.id,
            error: Some(e.to_string()),
            ..Record::default()
        }
    }
}

fn pick(targets: &Targets, rr: &AtomicUsize) -> String {
    match targets {
        Targets::RoundRobin(v) if !v.is_empty() => {
            v[rr.fetch_add(1, Ordering::Relaxed) % v.len()].clone()
        }
        Targets::Single(u) => u.clone(),
        Targets::RoundRobin(_) => String::new(),
    }
}

async fn send(
    client: &HttpClient,
    base: &str,
    job: &Job,
    opts: &ReplayOptions,
    start: Instant,
) -> Record {
    let sent_s = start.elapsed().as_secs_f64();
    let prompt = match opts.prompts {
        PromptMode::Tokens => json!(job.prompt),
        PromptMode::Text => json!(prompt_text(&job.prompt)),
    };
    let body = json!({
        "model": opts.model,
        "prompt": prompt,
        "max_tokens": job.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "user": format!("c{}", job.conv),
    });
    let mut r = match tokio::time::timeout(opts.request_timeout, stream(client, base, body)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Record {
            error: Some(e),
            ..Record::default()
        },
        Err(_) => Record {
            error: Some(format!(
                "timeout after {:?} on {base}",
                opts.request_timeout
            )),
            ..Record::default()
        },
    };
    r.job = job.id;
    r.sent_s = sent_s;
    r
}

async fn stream(
    client: &HttpClient,
    base: &str,
    body: serde_json::Value,
) -> Result<Record, String> {
    if base.is_empty() {
        return Err("no targets".into());
    }
    let mut s = post_stream(client, base, "/v1/completions", &body).await?;
    let (mut first, mut last, mut chunks, mut any) = (None, None, 0u32, None);
    let mut usage = None;
    while let Some(v) = s.next_chunk().await? {
        // Chunks with text: the first one is the TTFT, the gaps between them the ITL (the
        // closing chunk with empty text counts only if nothing came before it).
        if let Some(t) = v["choices"][0]["text"].as_str() {
            let now = s.t0.elapsed();
            if !t.is_empty() {
                first.get_or_insert(now);
                last = Some(now);
                chunks += 1;
            } else {
                any.get_or_insert(now);
            }
        }
        if v["usage"].is_object() {
            usage = Some(v["usage"].clone());
        }
    }
    let usage = usage.ok_or_else(|| format!("{base}: stream ended without usage"))?;
    let e2e = s.t0.elapsed();
    let itl_s = match (first, last) {
        (Some(f), Some(l)) if chunks >= 2 => Some((l - f).as_secs_f64() / f64::from(chunks - 1)),
        _ => None,
    };
    let (prompt_tokens, cached_tokens, completion_tokens) = usage_counts(&usage);
    Ok(Record {
        served_by: s.served_by,
        ttft_s: first.or(any).unwrap_or(e2e).as_secs_f64(),
        e2e_s: e2e.as_secs_f64(),
        itl_s,
        prompt_tokens,
        cached_tokens,
        completion_tokens,
        predicted_cached_tokens: s.predicted_cached_tokens,
        ..Record::default()
    })
}

/// POSTs an empty body to `url` (bounded by `timeout`; non-2xx is an error).
pub async fn post_empty(url: &str, timeout: Duration) -> Result<(), String> {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::builder()
        .method("POST")
        .uri(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("{url}: {e}"))?;
    tokio::time::timeout(timeout, async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let _ = resp.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("{url}: {status}"))
        }
    })
    .await
    .map_err(|_| format!("{url}: timeout after {timeout:?}"))?
}

#[cfg(test)]
mod tests {
    use super::think_pause;
    use std::time::Duration;

    #[test]
    fn think_pauses_are_fixed_by_the_job_and_average_the_mean() {
        let run = Duration::from_secs(60);
        assert_eq!(think_pause(Duration::ZERO, 7, run), Duration::ZERO);
        let think = Duration::from_millis(20);
        assert_eq!(think_pause(think, 7, run), think_pause(think, 7, run));
        let n = 20_000u64;
        let pauses: Vec<Duration> = (0..n).map(|id| think_pause(think, id, run)).collect();
        assert!(pauses.iter().all(|p| *p <= 2 * think));
        let mean = pauses.iter().sum::<Duration>() / n as u32;
        assert!(
            mean > Duration::from_millis(19) && mean < Duration::from_millis(21),
            "mean pause {mean:?} for a mean of {think:?}"
        );
        assert!(pauses.iter().any(|p| *p < Duration::from_millis(1)));
        assert!(pauses.iter().any(|p| *p > Duration::from_millis(39)));
        // Never past the run's deadline, whatever the mean.
        let short = Duration::from_millis(3);
        assert!((0..1_000).all(|id| think_pause(think, id, short) <= short));
        assert!((0..100).all(|id| think_pause(Duration::MAX, id, run) <= run));
    }
}
