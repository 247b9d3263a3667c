//! Background work per engine and per DNS name: active health checks, model discovery
//! (`/v1/models`), load scraping (`/metrics`: running, waiting, KV usage), re-resolution.

use crate::engine::{Engine, Source, Untold};
use crate::gateway::Gateway;
use crate::ingest::{self, IngestCtx};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvmesh_config::{DnsEntry, EngineEntry};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// GET `url` with a timeout (and the engines' key, `engine_api_key`, when set); returns
/// (status, body up to 4 MiB).
async fn get(gw: &Gateway, url: &str, timeout: Duration) -> Result<(u16, Bytes), String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let mut req = http::Request::get(uri).header(crate::hops::VIA, gw.via.clone());
    let key = &gw.cfg.engine_api_key;
    if !key.is_empty() {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let fut = async {
        let resp = gw.client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let body = http_body_util::Limited::new(resp.into_body(), 4 << 20)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| format!("{url}: no answer within {timeout:?}"))?
}

/// One active health check.
pub async fn check_health(gw: &Gateway, e: &Engine) {
    let a = &gw.cfg.routing.health.active;
    if !a.enabled {
        return;
    }
    let ok = matches!(
        get(
            gw,
            &format!("{}{}", e.url, a.path),
            Duration::from_millis(a.timeout_ms)
        )
        .await,
        Ok((200..=299, _))
    );
    let ev = e.tracker().on_health_check(gw.clock.now_us(), ok);
    match ev {
        Some(ev @ kvmesh_policy::HealthEvent::BecameUnhealthy) => {
            tracing::warn!(engine = %e.url, event = ?ev, "health check state changed: no traffic until it passes again");
        }
        Some(ev) => tracing::info!(engine = %e.url, event = ?ev, "health check state changed"),
        None => {}
    }
}

/// The engine's `/v1/models`, when it answers with a model list.
async fn model_list(gw: &Gateway, e: &Engine, t: Duration) -> Option<kvmesh_openai::ModelList> {
    let body = match get(gw, &format!("{}/v1/models", e.url), t).await {
        Ok((200, body)) => body,
        Ok((status @ (401 | 403), _)) => {
            // Said while it keeps the engine out of every route (QA: an engine started with
            // --api-key was never routed to, and nothing said why), at most once a minute.
            if e.models().is_empty() && e.set_untold(Untold::Refused, gw.clock.now_us()) {
                let hint = if gw.cfg.engine_api_key.is_empty() {
                    "an engine started with --api-key: set serve.engine_api_key (or KVMESH_ENGINE_API_KEY)"
                } else {
                    "serve.engine_api_key is not the engine's key"
                };
                tracing::warn!(engine = %e.url, status, "the engine's /v1/models refused the router: it serves no model until it answers ({hint}; or set its models in the config)");
            }
            return None;
        }
        _ => {
            e.set_untold(Untold::NoAnswer, gw.clock.now_us());
            return None;
        }
    };
    serde_json::from_slice(&body)
        .inspect_err(|err| {
            // Said while it keeps the engine out of every route (QA: silent, and the
            // clients' 503 blamed an unreachable engine that had answered).
            if e.models().is_empty() && e.set_untold(Untold::NotAList, gw.clock.now_us()) {
                tracing::warn!(engine = %e.url, error = %err, "the engine's /v1/models is not a model list: it serves no model until it is (or set its models in the config)");
            }
        })
        .ok()
}

/// Reads `/v1/models` and `/metrics`.
pub async fn discover(gw: &Gateway, e: &Engine) {
    let t = Duration::from_millis(gw.cfg.routing.health.active.timeout_ms.max(500));
    let list = if e.static_models.is_empty() {
        model_list(gw, e, t).await
    } else {
        None
    };
    if let Some(list) = list {
        let adapters = list
            .data
            .iter()
            .filter(|m| m.parent.is_some())
            .map(|m| m.id.clone())
            .collect();
        let ids = list.data.iter().map(|m| m.id.clone()).collect();
        let lengths_changed = e.set_cards(list.data);
        if !gw.registry.set_discovered_models(e, ids, adapters) && lengths_changed {
            gw.registry.rebuild();
        }
    }
    // The page counts our requests running when it was rendered: at most those in flight
    // now plus those started before the answer came back.
    // Likewise the mesh peers' requests: at most the most they had in flight, before or
    // after (their counts arrive by gossip; a start during the read may be missed).
    let in_flight = e.in_flight.load(Ordering::Relaxed);
    let started = e.metrics.requests.load(Ordering::Relaxed);
    let peers_before = e.peer_in_flight.load(Ordering::Relaxed);
    if let Ok((200, body)) = get(gw, &format!("{}/metrics", e.url), t).await {
        let mut peers = peers_before.max(e.peer_in_flight.load(Ordering::Relaxed));
        if gw.mesh.get().is_some() {
            // A peer's request the page counted may not have reached us yet: counted as load
            // no router knows of, it would stay a phantom until the next read. Its count is in
            // once the mesh has carried it (well under this wait on a LAN).
            tokio::time::sleep(PEER_SETTLE).await;
            peers = peers.max(e.peer_in_flight.load(Ordering::Relaxed));
        }
        let text = String::from_utf8_lossy(&body);
        let started_since = e
            .metrics
            .requests
            .load(Ordering::Relaxed)
            .saturating_sub(started);
        e.set_reported(
            scrape(&text, "vllm:num_requests_running").map(|v| v as u32),
            scrape(&text, "vllm:num_requests_waiting").map(|v| v as u32),
            scrape(&text, "vllm:kv_cache_usage_perc"),
            in_flight.saturating_add(u32::try_from(started_since).unwrap_or(u32::MAX)),
            peers,
        );
        note_prefix_counters(e, &text);
        let work = WORK_COUNTERS
            .iter()
            .filter_map(|c| scrape(&text, c))
            .reduce(|a, b| a + b);
        if let Some(w) = work {
            e.note_work(gw.clock.now_us(), w);
        }
        note_start_time(gw, e, scrape(&text, "process_start_time_seconds"));
    }
}

/// The counters of an engine's metrics that grow while it works: tokens generated, prompt
/// tokens done, prompt tokens looked up in the prefix cache at scheduling, and engine steps
/// (vLLM's `iteration_tokens_total` histogram counts one per step, prefill chunks included:
/// a long prefill shows as work before its first token).
pub(crate) const WORK_COUNTERS: [&str; 4] = [
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:iteration_tokens_total_count",
];

/// How long after reading an engine's page the peers' in-flight count on it is read again
/// (see [`discover`]): many times the mesh's propagation of a count on a LAN.
const PEER_SETTLE: Duration = Duration::from_millis(20);

/// Records the engine's own prefix-cache counters and the predicted-vs-actual ratio of cached
/// tokens over the window since the last ratio (see [`RatioWindow`]).
fn note_prefix_counters(e: &Engine, page: &str) {
    let (Some(hits), Some(queries)) = (
        scrape(page, "vllm:prefix_cache_hits_total")
            .or_else(|| scrape(page, "vllm:prefix_cache_hits")),
        scrape(page, "vllm:prefix_cache_queries_total")
            .or_else(|| scrape(page, "vllm:prefix_cache_queries")),
    ) else {
        return;
    };
    e.engine_hits_bits.store(hits.to_bits(), Ordering::Relaxed);
    e.engine_queries_bits
        .store(queries.to_bits(), Ordering::Relaxed);
    let [b_hits, b_queries, b_pred, b_prompt] = &e.ratio_base;
    let base = RatioWindow {
        hits: f64::from_bits(b_hits.load(Ordering::Relaxed)),
        queries: f64::from_bits(b_queries.load(Ordering::Relaxed)),
        predicted: b_pred.load(Ordering::Relaxed),
        prompt: b_prompt.load(Ordering::Relaxed),
    };
    let now = RatioWindow {
        hits,
        queries,
        predicted: e.predicted_cached_tokens.load(Ordering::Relaxed),
        prompt: e.prompt_tokens.load(Ordering::Relaxed),
    };
    let (ratio, rebase) = base.close(&now);
    if let Some(r) = ratio {
        e.prediction_ratio_bits
            .store(r.to_bits(), Ordering::Relaxed);
    }
    if rebase {
        b_hits.store(now.hits.to_bits(), Ordering::Relaxed);
        b_queries.store(now.queries.to_bits(), Ordering::Relaxed);
        b_pred.store(now.predicted, Ordering::Relaxed);
        b_prompt.store(now.prompt, Ordering::Relaxed);
    }
}

/// The four counters a prediction ratio compares, read at one scrape: the engine's own
/// prefix-cache hits and queries, and the predicted cached and prompt tokens this router
/// routed there.
#[derive(Clone, Copy, Debug, PartialEq)]
struct RatioWindow {
    hits: f64,
    queries: f64,
    predicted: u64,
    prompt: u64,
}

impl RatioWindow {
    /// The ratio over the window from `self` (its start) to `now`, and whether `now` starts
    /// the next window. A window stays open across scrapes until both sides saw prompts and
    /// the engine a hit: a request the router counted just before a scrape is served (and
    /// counted by the engine) just after it, so scrape intervals alone would split most
    /// windows of light traffic into a half with prompts only and a half with hits only,
    /// and never give a ratio. A first scrape or counters that went back (a restart) start
    /// a new window without a ratio.
    fn close(&self, now: &RatioWindow) -> (Option<f64>, bool) {
        let fresh = !(self.hits.is_finite() && self.queries.is_finite())
            || now.hits < self.hits
            || now.queries < self.queries
            || now.predicted < self.predicted
            || now.prompt < self.prompt;
        if fresh {
            return (None, true);
        }
        let ratio = prediction_ratio(
            (now.hits - self.hits, now.queries - self.queries),
            (now.predicted - self.predicted, now.prompt - self.prompt),
        );
        (ratio, ratio.is_some())
    }
}

/// The router's predicted hit rate on an engine over an interval (its predicted cached
/// tokens / the prompt tokens it routed there) over the engine's own (hits / queries, every
/// client's and every router's requests alike): 1 when the index matches the engine. A rate
/// and not a count, because the engine's counters include traffic from other routers of the
/// mesh and from elsewhere. `None` when either side saw no prompt or the engine no hit in the
/// interval, or its counters went back (a restart; NaN on the first scrape).
fn prediction_ratio(engine: (f64, f64), router: (u64, u64)) -> Option<f64> {
    let ((d_hits, d_queries), (d_pred, d_prompt)) = (engine, router);
    if !(d_hits > 0.0 && d_queries > 0.0) || d_prompt == 0 {
        return None;
    }
    let predicted_rate = d_pred as f64 / d_prompt as f64;
    Some(predicted_rate / (d_hits / d_queries))
}

/// A new `process_start_time_seconds` means a new engine process: its cache is empty. The
/// KV events say so too (seq back to 0) once the new process publishes; this catches the
/// restart when it publishes nothing.
fn note_start_time(gw: &Gateway, e: &Engine, t: Option<f64>) {
    let Some(t) = t else { return };
    let epoch_now = e.ingest.epoch.load(Ordering::Relaxed);
    let prev = f64::from_bits(e.start_time_bits.swap(t.to_bits(), Ordering::Relaxed));
    let prev_epoch = e.epoch_at_scrape.swap(epoch_now, Ordering::Relaxed);
    if prev.is_finite() && (t - prev).abs() > 1e-6 {
        tracing::info!(engine = %e.url, "engine process start time changed: restarted");
        if e.ingest.has_applier.load(Ordering::Relaxed) {
            // The applier decides: it knows whether the events already told it.
            e.ingest.hint_restart(prev_epoch);
        } else {
            // What routing decisions expected of the old process is void. Blocks its owners'
            // feed brought stay: the owners see the restart (from the events, or this same
            // hint) and the feed carries the clear and the new process's blocks, some of
            // which may be here already; clearing them here would lose them for good, the
            // feed counting them as applied (QA).
            gw.registry.prefix.clear_marks(e.target());
        }
    }
}

/// Sums the samples of one metric in a Prometheus text page.
pub fn scrape(page: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in page.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if let Some(v) = sample_value(rest)
            && v.is_finite()
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// The value of a sample line after its metric name: `{labels} value [timestamp]` or
/// ` value [timestamp]`. Label values may hold spaces, braces and escaped quotes; the value is
/// the first token after the labels (a trailing timestamp is not the value).
fn sample_value(rest: &str) -> Option<f64> {
    let after = if let Some(labels) = rest.strip_prefix('{') {
        let mut in_quotes = false;
        let mut escaped = false;
        let mut end = None;
        for (i, c) in labels.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if in_quotes => escaped = true,
                '"' => in_quotes = !in_quotes,
                '}' if !in_quotes => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        &labels[end? + 1..]
    } else if rest.starts_with([' ', '\t']) {
        rest
    } else {
        return None; // another metric whose name starts with this one
    };
    let v = after.split_whitespace().next()?;
    match v {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => v.parse::<f64>().ok(),
    }
}

/// The loop of one engine: until it is removed, check health every interval and discover
/// every discovery interval.
pub fn spawn_engine_loop(gw: Arc<Gateway>, e: Arc<Engine>) {
    let stop = e.stop.clone();
    let g = gw.clone();
    gw.tasks.spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = engine_loop(g, e) => {}
        }
    });
}

/// An engine's health checks and its discovery, each on its own schedule: a discovery that
/// waits out its timeouts (an engine that accepts connections and answers nothing) never
/// holds a health check back. (One `select!` over both ran the checks a fraction of the time
/// against such an engine, which was marked unhealthy after 26–90 s instead of about 17 s:
/// QA.)
async fn engine_loop(gw: Arc<Gateway>, e: Arc<Engine>) {
    let every = |ms: u64| {
        let mut t = tokio::time::interval(Duration::from_millis(ms));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    };
    let health = async {
        let mut tick = every(gw.cfg.routing.health.active.interval_ms);
        loop {
            tick.tick().await;
            check_health(&gw, &e).await;
        }
    };
    let discovery = async {
        let mut tick = every(gw.cfg.discovery_interval_ms);
        loop {
            tick.tick().await;
            discover(&gw, &e).await;
        }
    };
    tokio::join!(health, discovery);
}

/// What an engine's ingestion needs from the router.
/// The ingestion's context; `feed` when meshed (the ops go to the mesh).
pub fn ingest_ctx(
    gw: &Gateway,
    feed: Option<tokio::sync::mpsc::Sender<kvmesh_mesh::node::Input>>,
) -> IngestCtx {
    IngestCtx {
        cfg: gw.cfg.clone(),
        prefix: gw.registry.prefix.clone(),
        clock: gw.clock,
        feed,
    }
}

/// Adds an engine and starts its loop; returns it.
pub fn add_engine(
    gw: &Arc<Gateway>,
    entry: &EngineEntry,
    source: Source,
    ramp: bool,
) -> Result<Arc<Engine>, String> {
    let e = gw.registry.add(entry, source, ramp)?;
    spawn_engine_loop(gw.clone(), e.clone());
    // Meshed, the engine's owners read its events (the cluster module starts them).
    if !gw.cfg.mesh.enabled {
        ingest::spawn(&ingest_ctx(gw, None), &gw.tasks, &e, None);
    }
    tracing::info!(engine = %e.url, weight = e.base_weight(), "engine added");
    Ok(e)
}

/// The loop of one DNS name, resolved once already at start-up (`known`: what that
/// resolution told): every `refresh_ms` resolve, add new addresses, remove vanished ones.
pub fn spawn_dns_loop(gw: Arc<Gateway>, d: DnsEntry, mut known: Known) {
    let g = gw.clone();
    gw.tasks.spawn(async move {
        let every = Duration::from_millis(d.refresh_ms);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            resolve_once(&g, &d, true, &mut known).await;
        }
    });
}

/// What a DNS name's loop has told the operator: the addresses it could not add (registered
/// from another source), warned of once each, not at every resolution (QA33).
#[derive(Default)]
pub struct Known {
    refused: BTreeSet<String>,
}

/// Resolves a DNS entry once and reconciles the engines it owns; `ramp`: new engines slow-start
/// (false at start-up, where every engine is new).
pub async fn resolve_once(gw: &Arc<Gateway>, d: &DnsEntry, ramp: bool, known: &mut Known) {
    let addrs = match tokio::net::lookup_host(d.name.as_str()).await {
        Ok(a) => a.collect::<Vec<_>>(),
        Err(e) => {
            // Keep the current engines: a resolver hiccup must not empty the fleet.
            tracing::warn!(name = %d.name, error = %e, "DNS resolution failed");
            return;
        }
    };
    let zmq = |a: &std::net::SocketAddr, port: u16| {
        if port == 0 {
            String::new()
        } else {
            format!("tcp://{}", std::net::SocketAddr::new(a.ip(), port))
        }
    };
    let endpoints: std::collections::BTreeMap<String, (String, String)> = addrs
        .iter()
        .map(|a| {
            (
                format!("http://{a}"),
                (zmq(a, d.kv_events_port), zmq(a, d.kv_replay_port)),
            )
        })
        .collect();
    let want: BTreeSet<String> = endpoints.keys().cloned().collect();
    let source = Source::Dns(d.name.clone());
    let have: BTreeSet<String> = gw
        .registry
        .members()
        .iter()
        .filter(|e| e.source == source)
        .map(|e| e.url.clone())
        .collect();
    for url in want.difference(&have) {
        let (kv_events, kv_replay) = endpoints.get(url).cloned().unwrap_or_default();
        let entry = EngineEntry {
            url: url.clone(),
            weight: d.weight,
            kv_events,
            kv_replay,
            ..EngineEntry::default()
        };
        match add_engine(gw, &entry, source.clone(), ramp) {
            Ok(_) => {
                known.refused.remove(url);
            }
            Err(e) if known.refused.insert(url.clone()) => {
                tracing::warn!(%url, name = %d.name, error = %e, "cannot add resolved engine (said once while it lasts)");
            }
            Err(e) => tracing::debug!(%url, error = %e, "cannot add resolved engine"),
        }
    }
    known.refused.retain(|u| want.contains(u));
    for url in have.difference(&want) {
        gw.registry.remove(url);
        tracing::info!(%url, name = %d.name, "engine no longer resolved: removed");
    }
}

#[cfg(test)]
mod tests {
    use super::scrape;

    #[test]
    fn scrapes_vllm_metrics() {
        let page = "# HELP vllm:num_requests_waiting x\n\
                    vllm:num_requests_waiting{model_name=\"a\",engine=\"0\"} 3\n\
                    vllm:num_requests_waiting_other 9\n\
                    vllm:num_requests_running{model_name=\"a\"} 2\n\
                    vllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\n";
        assert_eq!(scrape(page, "vllm:num_requests_waiting"), Some(3.0));
        assert_eq!(scrape(page, "vllm:num_requests_running"), Some(2.0));
        assert_eq!(scrape(page, "vllm:kv_cache_usage_perc"), Some(0.25));
        assert_eq!(scrape(page, "vllm:nothing"), None);
    }

    #[test]
    fn a_timestamp_is_not_the_value_and_labels_may_hold_spaces_and_braces() {
        // Regression: the last token of the line was read, i.e. the timestamp.
        let page = "vllm:num_requests_running{model_name=\"a\"} 3 1700000000000\n\
                    vllm:num_requests_waiting 4 1700000000000\n\
                    vllm:kv_cache_usage_perc{model_name=\"my model {v2} \\\"x\\\"\"} 0.5 17\n\
                    process_start_time_seconds 1.7e9\n\
                    x_nan NaN\n\
                    x_inf{a=\"b\"} +Inf\n\
                    x_bad{a=\"unterminated} 5\n";
        assert_eq!(scrape(page, "vllm:num_requests_running"), Some(3.0));
        assert_eq!(scrape(page, "vllm:num_requests_waiting"), Some(4.0));
        assert_eq!(scrape(page, "vllm:kv_cache_usage_perc"), Some(0.5));
        assert_eq!(scrape(page, "process_start_time_seconds"), Some(1.7e9));
        // Non-finite samples are not summed; an unterminated label set is not a sample.
        assert_eq!(scrape(page, "x_nan"), None);
        assert_eq!(scrape(page, "x_inf"), None);
        assert_eq!(scrape(page, "x_bad"), None);
        assert_eq!(super::sample_value(" +Inf"), Some(f64::INFINITY));
        assert!(super::sample_value(" NaN").is_some_and(f64::is_nan));
    }

    #[test]
    fn the_prediction_ratio_compares_rates_so_other_routers_traffic_does_not_skew_it() {
        use super::prediction_ratio;
        // Alone: 1,000 of 1,500 prompt tokens predicted cached, the engine hit 1,000 of 1,500.
        assert_eq!(prediction_ratio((1000.0, 1500.0), (1000, 1500)), Some(1.0));
        // One of three meshed routers sent a third of the engine's prompts, with the same hit
        // rate: counts would give 1/3; the rates agree.
        let r = prediction_ratio((3000.0, 4500.0), (1000, 1500)).expect("a ratio");
        assert!((r - 1.0).abs() < 1e-9, "{r}");
        // Over-prediction shows above 1.
        assert_eq!(prediction_ratio((500.0, 1500.0), (1000, 1500)), Some(2.0));
        // Nothing routed there by this router, no hit, a first scrape, a restart: no ratio
        // (the last one stays).
        assert_eq!(prediction_ratio((3000.0, 4500.0), (0, 0)), None);
        assert_eq!(prediction_ratio((0.0, 4500.0), (1000, 1500)), None);
        assert_eq!(prediction_ratio((f64::NAN, f64::NAN), (1000, 1500)), None);
        assert_eq!(prediction_ratio((-10.0, -20.0), (1000, 1500)), None);
    }

    #[test]
    fn a_window_split_by_a_scrape_stays_open_until_both_sides_saw_prompts() {
        use super::RatioWindow;
        let at = |hits: f64, queries: f64, predicted: u64, prompt: u64| RatioWindow {
            hits,
            queries,
            predicted,
            prompt,
        };
        // The first scrape only starts a window.
        let first = at(f64::NAN, f64::NAN, 0, 0);
        assert_eq!(first.close(&at(0.0, 0.0, 0, 0)), (None, true));
        // The router routed a 1,500-token prompt (1,000 predicted cached) just before a
        // scrape; the engine served it just after: the window stays open...
        let base = at(0.0, 0.0, 0, 0);
        assert_eq!(base.close(&at(0.0, 0.0, 1000, 1500)), (None, false));
        // ...and the next scrape closes it with the whole request on both sides.
        assert_eq!(
            base.close(&at(1000.0, 1500.0, 1000, 1500)),
            (Some(1.0), true)
        );
        // Counters that went back (an engine restart) start a new window, without a ratio.
        let base = at(5000.0, 9000.0, 1000, 1500);
        assert_eq!(base.close(&at(10.0, 20.0, 1100, 1600)), (None, true));
    }
}
