//! The request path: read and check the body, pick engines with the model's policy, forward,
//! retry on another engine while nothing has reached the client, stream the answer through.

use crate::Gateway;
use crate::metrics::FailKind;
use crate::prefix::{self, Endpoint, ParsedRequest};
use crate::registry::{Engine, ModelRoute, RouteView};
use crate::track::{Attempt, TrackedBody};
use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvmesh_http::{Body, error, read_body, strip_hop_by_hop};
use kvmesh_openai::{ApiError, parse_body};
use kvmesh_policy::{MAX_CANDIDATES, PrefixInput, Reason, RequestCtx, stable_hash};
use serde::Deserialize;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The fields of a request body the router reads (the rest passes through untouched).
#[derive(Deserialize)]
struct Peek {
    model: Option<String>,
    user: Option<String>,
}

/// What one attempt on one engine produced.
enum Outcome {
    /// A response to pass to the client (2xx, or a 4xx that is the client's fault).
    Answer(Response<Body>),
    /// A failure worth retrying elsewhere; `answer` is the engine's own error response when it
    /// sent one (returned to the client if no retry is left).
    Retryable {
        kind: FailKind,
        answer: Option<(http::StatusCode, http::HeaderMap, Bytes)>,
        detail: String,
    },
}

/// `POST /v1/chat/completions` and `POST /v1/completions`.
pub async fn inference(
    gw: Arc<Gateway>,
    req: Request<Incoming>,
    request_id: String,
) -> Response<Body> {
    gw.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let (parts, body) = req.into_parts();
    let endpoint = if parts.uri.path() == "/v1/chat/completions" {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let result = async {
        let body = read_body(&parts.headers, body, gw.cfg.max_body_bytes).await?;
        let snap = gw.registry.snapshot();
        // Cache-aware routes need the prompt: parse the whole body once and read the model
        // from it. Otherwise (or when it does not parse as such a request) peek at the model
        // only; the engine reports what is wrong with the rest.
        let parsed = snap
            .any_prefix_route
            .then(|| ParsedRequest::parse(endpoint, &body).ok())
            .flatten();
        let (model, user) = match &parsed {
            Some(p) => (p.model().map(str::to_string), p.user().map(str::to_string)),
            None => {
                let peek: Peek = parse_body(&body)?;
                (peek.model, peek.user)
            }
        };
        let route = match model.as_deref() {
            Some(m) => snap
                .routes
                .get(m)
                .cloned()
                .ok_or_else(|| ApiError::model_not_found(m))?,
            None if snap.routes.len() == 1 => snap
                .routes
                .values()
                .next()
                .cloned()
                .ok_or_else(|| ApiError::unavailable("no engine serves any model"))?,
            None => {
                return Err(ApiError::invalid_param(
                    "model",
                    "`model` is required: this router serves several models (see /v1/models)",
                ));
            }
        };
        let key = hash_key(&route, &parts.headers, user.as_deref());
        Ok::<_, ApiError>((body, route, key, parsed))
    }
    .await;
    let (body, route, key, parsed) = match result {
        Ok(v) => v,
        Err(e) => {
            gw.metrics.error_response(e.status);
            let mut r = error(&e);
            set_request_id(&mut r, &gw.cfg.request_id_header, &request_id);
            return r;
        }
    };
    let mut resp = forward(&gw, &parts, body, &route, key, parsed.as_ref(), &request_id).await;
    set_request_id(&mut resp, &gw.cfg.request_id_header, &request_id);
    if !resp.status().is_success() {
        gw.metrics.error_response(resp.status().as_u16());
    }
    resp
}

fn set_request_id(r: &mut Response<Body>, name: &str, id: &str) {
    if let (Ok(n), Ok(v)) = (
        http::HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(id),
    ) {
        r.headers_mut().insert(n, v);
    }
}

/// The consistent-hash key: the configured header, else the OpenAI `user` field.
fn hash_key(route: &ModelRoute, headers: &http::HeaderMap, user: Option<&str>) -> Option<u64> {
    let ch = &route.policy_cfg.consistent_hash;
    if !ch.header.is_empty()
        && let Some(v) = headers.get(ch.header.as_str())
    {
        return Some(stable_hash(v.as_bytes()));
    }
    if ch.use_user_field {
        return user.map(|u| stable_hash(u.as_bytes()));
    }
    None
}

async fn forward(
    gw: &Arc<Gateway>,
    parts: &http::request::Parts,
    body: Bytes,
    route: &Arc<ModelRoute>,
    key: Option<u64>,
    parsed: Option<&ParsedRequest>,
    request_id: &str,
) -> Response<Body> {
    // Decide: one policy call gives the first choice and the fallbacks.
    let mut candidates = Vec::with_capacity(MAX_CANDIDATES);
    let now = gw.clock.now_us();
    let view = RouteView {
        engines: &route.engines,
        now_us: now,
        fleet_latency_us: gw.registry.fleet_latency_us(),
    };
    let mut ctx = RequestCtx::new(gw.next_seed(), now);
    if let Some(k) = key {
        ctx = ctx.with_hash_key(k);
    }
    let mut decide_us = 0;
    let mut reserved: Option<Reservation> = None;
    // Cache-aware routes: prompt → block keys → matches → decision → speculative entries for
    // the chosen engine, all synchronous (the per-thread buffers never cross an await).
    let (reason, cand_blocks, lookup) = match &route.prefix {
        Some(rp) => prefix::with_scratch(|s| {
            let state = &gw.registry.prefix;
            let lookup = match parsed {
                Some(req) => prefix::prompt_keys(state, rp, req, s),
                None => {
                    // The body is not a request of this endpoint: routed on load (the engine
                    // answers with the real error).
                    state
                        .metrics
                        .tokenize_failures
                        .fetch_add(1, Ordering::Relaxed);
                    None
                }
            };
            let Some(l) = lookup else {
                let t = Instant::now();
                let reason = route.policy.pick(&view, &ctx, &mut candidates);
                decide_us = t.elapsed().as_micros() as u64;
                return (reason, [0; MAX_CANDIDATES], None);
            };
            // Lookup, decision and speculative entries under one hold of the index lock:
            // otherwise two siblings of a new prefix could both look up before either marked
            // its engine, and split (a few µs of lock per request; tokenization stays outside).
            let mut index = state.index_mut();
            prefix::match_engines(state, &index, rp, now, s);
            let c = ctx.with_prefix(PrefixInput {
                total_blocks: l.total_blocks,
                matches: &s.matches,
            });
            let t = Instant::now();
            let reason = route.policy.pick(&view, &c, &mut candidates);
            decide_us = t.elapsed().as_micros() as u64;
            let held = prefix::held_blocks(&index, &route.engines, &candidates, &s.keys, now);
            if let Some(&first) = candidates.first() {
                prefix::remember(state, &mut index, rp, &route.engines[first], &s.keys, now);
                // Counted in flight before the lock is released, so that the next decision's
                // load guard sees this request (the attempt takes the count over).
                reserved = Some(Reservation::new(route.engines[first].clone()));
            }
            drop(index);
            (reason, held, lookup)
        }),
        None => {
            let t = Instant::now();
            let reason = route.policy.pick(&view, &ctx, &mut candidates);
            decide_us = t.elapsed().as_micros() as u64;
            (reason, [0; MAX_CANDIDATES], None)
        }
    };
    gw.metrics.decision(
        &route.model,
        route.policy_cfg.policy.as_str(),
        reason.as_str(),
        decide_us,
    );
    if candidates.is_empty() || reason == Reason::NoEngines {
        return error(&ApiError::unavailable(format!(
            "no engine is available for model `{}`",
            route.model
        )));
    }
    gw.retry_budget().on_request(now);

    let max_attempts = (gw.cfg.retry.max_attempts as usize)
        .min(candidates.len())
        .max(1);
    let mut last: Option<Outcome> = None;
    let mut attempts = 0usize;
    for (pos, &idx) in candidates.iter().enumerate() {
        if attempts >= max_attempts {
            break;
        }
        let engine = &route.engines[idx];
        let now = gw.clock.now_us();
        let permit = if reason == Reason::AllIneligible {
            // Panic mode: every engine failed its health checks; try them anyway rather than
            // refuse everything (a broken health endpoint must not take the fleet down).
            engine.tracker().try_acquire_ignoring_health(now)
        } else {
            engine.tracker().try_acquire(now)
        };
        let Some(permit) = permit else {
            // The breaker refuses (open, or half-open with its probe out): next candidate.
            continue;
        };
        if attempts > 0 {
            if !gw.retry_budget().try_retry(gw.clock.now_us()) {
                gw.metrics.budget_exhausted.fetch_add(1, Ordering::Relaxed);
                engine.tracker().on_cancel(permit);
                break;
            }
            gw.metrics.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(gw.backoff(attempts)).await;
        }
        attempts += 1;
        let attempt = Attempt::start(gw.clone(), engine.clone(), permit);
        drop(reserved.take());
        match send(gw, engine, parts, body.clone(), request_id, attempt).await {
            Outcome::Answer(mut r) => {
                if let (Some(l), Some(rp)) = (lookup, &route.prefix) {
                    let predicted = u64::from(cand_blocks[pos]) * u64::from(rp.block_size);
                    engine
                        .prompt_tokens
                        .fetch_add(u64::from(l.prompt_tokens), Ordering::Relaxed);
                    engine
                        .predicted_cached_tokens
                        .fetch_add(predicted, Ordering::Relaxed);
                    r.headers_mut().insert(
                        "x-kvmesh-predicted-cached-tokens",
                        HeaderValue::from(predicted),
                    );
                }
                return r;
            }
            other => {
                if let Outcome::Retryable { kind, detail, .. } = &other {
                    tracing::debug!(request_id, engine = %engine.url, kind = kind.as_str(), %detail, "attempt failed");
                }
                last = Some(other);
            }
        }
    }
    match last {
        Some(Outcome::Retryable {
            answer: Some((status, mut headers, b)),
            ..
        }) => {
            // The engine's own error answer (5xx/429) goes back as it was.
            strip_hop_by_hop(&mut headers);
            let mut r = Response::new(kvmesh_http::full(b));
            *r.status_mut() = status;
            *r.headers_mut() = headers;
            r
        }
        Some(Outcome::Retryable { kind, detail, .. }) => {
            let e = match kind {
                FailKind::Timeout => {
                    ApiError::with_status(504, format!("upstream timeout: {detail}"))
                }
                _ => ApiError::with_status(502, format!("upstream failure: {detail}")),
            };
            error(&e)
        }
        Some(Outcome::Answer(r)) => r,
        None => error(&ApiError::unavailable(format!(
            "every engine chosen for model `{}` is refusing traffic (circuit breakers open or unhealthy)",
            route.model
        ))),
    }
}

/// One request counted in flight on an engine between the decision and its attempt.
struct Reservation(Arc<Engine>);

impl Reservation {
    fn new(e: Arc<Engine>) -> Reservation {
        e.in_flight.fetch_add(1, Ordering::Relaxed);
        Reservation(e)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One attempt: forward, wait for the response head, classify.
async fn send(
    gw: &Arc<Gateway>,
    engine: &Arc<Engine>,
    parts: &http::request::Parts,
    body: Bytes,
    request_id: &str,
    attempt: Attempt,
) -> Outcome {
    let mut headers = parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    if let (Ok(n), Ok(v)) = (
        http::HeaderName::from_bytes(gw.cfg.request_id_header.as_bytes()),
        HeaderValue::from_str(request_id),
    ) {
        headers.insert(n, v);
    }
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let uri = match http::Uri::builder()
        .scheme("http")
        .authority(engine.authority.clone())
        .path_and_query(pq)
        .build()
    {
        Ok(u) => u,
        Err(e) => {
            attempt.fail(FailKind::Transport);
            return Outcome::Retryable {
                kind: FailKind::Transport,
                answer: None,
                detail: e.to_string(),
            };
        }
    };
    let mut up = Request::new(Full::new(body));
    *up.method_mut() = parts.method.clone();
    *up.uri_mut() = uri;
    *up.headers_mut() = headers;
    let first_byte = Duration::from_millis(gw.cfg.timeouts.first_byte_ms);
    let resp = match tokio::time::timeout(first_byte, gw.client.request(up)).await {
        Err(_) => {
            attempt.fail(FailKind::Timeout);
            return Outcome::Retryable {
                kind: FailKind::Timeout,
                answer: None,
                detail: format!("{}: no response within {first_byte:?}", engine.url),
            };
        }
        Ok(Err(e)) => {
            let kind = if e.is_connect() {
                FailKind::Connect
            } else {
                FailKind::Transport
            };
            attempt.fail(kind);
            return Outcome::Retryable {
                kind,
                answer: None,
                detail: format!("{}: {e}", engine.url),
            };
        }
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    let retry_429 = status.as_u16() == 429 && gw.cfg.retry.on_429;
    if status.is_server_error() || retry_429 {
        let kind = if retry_429 {
            FailKind::Status429
        } else {
            FailKind::Status5xx
        };
        // 429 says "busy", not "broken": it is retried but does not count against the
        // engine's health; 5xx does.
        if retry_429 {
            attempt.cancel_with(kind);
        } else {
            attempt.fail(kind);
        }
        let (p, b) = resp.into_parts();
        let bytes = tokio::time::timeout(
            Duration::from_secs(5),
            Limited::collect_limited(b, 64 * 1024),
        )
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
        return Outcome::Retryable {
            kind,
            answer: Some((status, p.headers, bytes)),
            detail: format!("{}: status {status}", engine.url),
        };
    }
    // Success or the client's own error: stream it through, tracked to the end.
    let (mut p, b) = resp.into_parts();
    strip_hop_by_hop(&mut p.headers);
    if let Ok(v) = HeaderValue::from_str(&engine.url) {
        p.headers.insert("x-kvmesh-engine", v);
    }
    let total = Duration::from_millis(gw.cfg.timeouts.total_ms);
    let tracked = TrackedBody::new(b, attempt, total);
    Outcome::Answer(Response::from_parts(p, tracked.boxed_unsync()))
}

/// Collecting a small error body with a size cap.
struct Limited;

impl Limited {
    async fn collect_limited(b: Incoming, limit: usize) -> Option<Bytes> {
        http_body_util::Limited::new(b, limit)
            .collect()
            .await
            .ok()
            .map(|c| c.to_bytes())
    }
}
