//! The request path, a thin driver of the pure core ([`kvmesh_route`]):
//!
//! 1. **read**: the body under the size limit (413);
//! 2. **prepare**: model → route of the current snapshot (404/400), consistent-hash key,
//!    and for cache-aware routes prompt → block keys ([`prefix::prompt_keys`], no lock);
//! 3. **decide**: [`kvmesh_route::decide`] — for cache-aware routes under the prefix index
//!    lock with the lookup and the speculative mark, then the reservation (the count in
//!    flight, after the mark, so that a peer router never learns of the load before the
//!    mark); a prompt no engine holds is decided, marked and reserved under one hold of the
//!    write lock, so that a sibling request sees both the mark and the load;
//! 4. **attempt**: [`Attempts::next`] (breaker permit, retry budget, backoff) → forward →
//!    [`classify_status`] → [`Attempts::on_head`] (deliver, or account and try the next);
//! 5. **stream**: the answer through [`TrackedBody`], accounted at its end
//!    ([`kvmesh_route::stream_end`]).

use crate::engine::{Engine, Untold};
use crate::gateway::Gateway;
use crate::prefix::{self, Endpoint, Lookup, ParsedRequest};
use crate::registry::{ModelRoute, RouteView};
use crate::sse::{ErrorEvent, EventScan};
use crate::track::{Attempt, ReadAhead, TrackedBody};
use crate::upstream::{BoxError, UpstreamBody};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper::body::Incoming;
use kvmesh_http::{Body, error, read_body, strip_hop_by_hop};
use kvmesh_openai::{ApiError, parse_body};
use kvmesh_policy::{MAX_CANDIDATES, RequestCtx, stable_hash, unit_f64};
use kvmesh_prefix::PrefixIndex;
use kvmesh_route::{
    Accounting, Action, Attempts, Blame, Decision, FailKind, GiveUp, Next, PrefixPlan, Verdict,
    classify_status, decide,
};
use serde::Deserialize;

#[path = "proxy/answered.rs"]
mod answered;
#[path = "proxy/failed.rs"]
mod failed;
#[path = "proxy/silence.rs"]
mod silence;
#[path = "proxy/views.rs"]
mod views;
use failed::{Failed, Sent, failed, give_up};
use silence::Waited;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
pub use views::IndexProbe;
use views::RouteFleet;

/// The fields of a request body the router reads (the rest passes through untouched).
#[derive(Deserialize)]
struct Peek {
    model: Option<String>,
    user: Option<String>,
    stream: Option<bool>,
}

/// `POST /v1/chat/completions` and `POST /v1/completions`.
pub async fn inference(
    gw: Arc<Gateway>,
    req: Request<Incoming>,
    request_id: HeaderValue,
) -> Response<Body> {
    gw.metrics.requests.inc();
    let (parts, body) = req.into_parts();
    let deadline = Duration::from_millis(gw.cfg.body_read_timeout_ms);
    let mut resp = match read_body(&parts.headers, body, gw.cfg.max_body_bytes, deadline).await {
        Ok(body) => handle(&gw, &parts, body, &request_id).await,
        Err(e) => {
            gw.metrics.error_response(e.status);
            error(&e)
        }
    };
    if let Some(n) = &gw.request_id_name {
        resp.headers_mut().insert(n.clone(), request_id);
    }
    resp
}

/// Steps 2–5 for a request whose body has been read.
pub async fn handle(
    gw: &Arc<Gateway>,
    parts: &http::request::Parts,
    body: Bytes,
    request_id: &HeaderValue,
) -> Response<Body> {
    let endpoint = if parts.uri.path() == "/v1/chat/completions" {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let started = tokio::time::Instant::now();
    let (route, key, parsed, stream) = match prepare(gw, endpoint, &parts.headers, &body) {
        Ok(v) => v,
        Err(e) => {
            gw.metrics.error_response(e.status);
            return error(&e);
        }
    };
    // A long prompt is prepared on the blocking pool, off this runtime thread.
    let (parsed, prepared) = match (&route.prefix, parsed) {
        (Some(rp), Some(req)) => {
            prefix::prompt_keys_offloaded(&gw.registry.prefix, rp, req, body.len()).await
        }
        (_, parsed) => (parsed, None),
    };
    let (decision, reservation, lookup, hold) =
        decide_step(gw, &route, key, parsed.as_ref(), prepared);
    if let Some(&first) = decision.candidates.first() {
        let now = gw.clock.now_us();
        if let Some(o) = gw.decision_observer.get() {
            let reserved = reservation.is_some() && decision.reserve == Some(first);
            o.decided(&route.engines, first, decision.reason, now, reserved);
        }
        let block = route.prefix.as_ref().map_or(0, |p| u64::from(p.block_size));
        gw.recent.record(
            now,
            &route.model,
            &route.engines[first].url,
            decision.reason.as_str(),
            lookup.as_ref().map_or(0, |l| l.prompt_tokens),
            u64::from(decision.predicted(0)) * block,
        );
    }
    if decision.is_empty() {
        let e = ApiError::unavailable(format!(
            "no engine is available for model `{}`",
            route.model
        ));
        gw.metrics.error_response(e.status);
        return error(&e);
    }
    // A streamed answer starts once the prompt is prefilled: the first-byte timeout bounds
    // the wait for it. A whole answer comes once the generation ends, however long it is: the
    // request's total timeout bounds it, and none is tried again once that has passed.
    let wait = if stream {
        Wait::FirstByte
    } else {
        Wait::Until(started + Duration::from_millis(gw.cfg.timeouts.total_ms))
    };
    let body_len = body.len();
    let (resp, answered) = attempt_step(
        gw,
        parts,
        body,
        &route,
        &decision,
        reservation,
        lookup,
        request_id,
        wait,
    )
    .await;
    if let Some(engine) = answered {
        answered::settle_mark(
            gw,
            &route,
            &decision,
            hold,
            engine,
            resp.status(),
            parsed,
            body_len,
        );
    }
    if !resp.status().is_success() {
        gw.metrics.error_response(resp.status().as_u16());
    }
    resp
}

/// What `prepare` gives: the route, the consistent-hash key, the parsed body, whether the
/// answer is streamed.
type Prepared = (Arc<ModelRoute>, Option<u64>, Option<ParsedRequest>, bool);

/// Step 2: the route and the consistent-hash key; the parsed body when a route is
/// cache-aware (parsed once for model, user and prompt).
fn prepare(
    gw: &Gateway,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Prepared, ApiError> {
    let snap = gw.registry.snapshot();
    // Cache-aware routes need the prompt: parse the whole body once and read the model from
    // it. Otherwise (or when it does not parse as such a request) peek at the model only;
    // the engine reports what is wrong with the rest.
    let parsed = snap
        .any_prefix_route
        .then(|| ParsedRequest::parse(endpoint, body).ok())
        .flatten();
    let (model, user, stream) = match &parsed {
        Some(p) => {
            p.check_openai()?;
            let (m, u) = (p.model().map(str::to_string), p.user().map(str::to_string));
            (m, u, p.stream())
        }
        None => {
            let peek: Peek = parse_body(body)?;
            (peek.model, peek.user, peek.stream.unwrap_or(false))
        }
    };
    let route = match model.as_deref() {
        Some(m) => match snap.routes.get(m) {
            Some(r) => r.clone(),
            None => return Err(unknown_model(&snap.engines, Some(m))),
        },
        // No model routed yet: the engines' models are not known (QA27: "this router serves
        // several models" while /v1/models listed none).
        None if snap.routes.is_empty() => return Err(unknown_model(&snap.engines, None)),
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
    let key = hash_key(&route, headers, user.as_deref());
    Ok((route, key, parsed, stream))
}

/// No route serves `model` (`None`: a request without one, and no model routed at all).
/// While some engine has not yet told its models (unreachable since the router started,
/// models not configured), the model may be one of them: 503, to be retried, rather than a
/// 404 that clients take as final.
/// With no engine at all (a router started empty, or its last engine removed: engines come
/// from its admin API or its mesh), 503 as well.
fn unknown_model(engines: &[Arc<Engine>], model: Option<&str>) -> ApiError {
    if engines.is_empty() {
        return ApiError::unavailable(
            "this router has no engines: they come from its admin API (/admin/engines) or its mesh",
        );
    }
    let untold: Vec<Untold> = engines
        .iter()
        .filter(|e| e.models().is_empty())
        .map(|e| e.untold())
        .collect();
    if untold.is_empty() {
        return match model {
            Some(m) => ApiError::model_not_found(m),
            None => ApiError::unavailable("no engine serves any model"),
        };
    }
    // Why, as their /v1/models answered (QA35: an engine refusing the router's key was
    // called unreachable).
    let count = |w: Untold| untold.iter().filter(|&&u| u == w).count();
    let why: Vec<String> = [
        (Untold::NoAnswer, "not answered (unreachable, or starting)"),
        (
            Untold::Refused,
            "refused the router (401/403: set serve.engine_api_key to the engines' --api-key)",
        ),
        (
            Untold::NotAList,
            "answered something that is not a model list",
        ),
    ]
    .into_iter()
    .filter(|(w, _)| count(*w) > 0)
    .map(|(w, what)| format!("{} {what}", count(w)))
    .collect();
    let what = match model {
        Some(m) => format!("model `{}`", kvmesh_openai::clip(m)),
        None => "any model".into(),
    };
    ApiError::unavailable(format!(
        "no engine is known to serve {what} yet: {} engine(s) have not told their models: their /v1/models {}",
        untold.len(),
        why.join(", ")
    ))
}

/// The consistent-hash key: the configured header, else the OpenAI `user` field.
fn hash_key(route: &ModelRoute, headers: &HeaderMap, user: Option<&str>) -> Option<u64> {
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

/// Step 3: the decision. Cache-aware routes: prompt → block keys (no lock), then lookup,
/// decision and speculative mark under the index lock, then the reservation (the per-thread
/// buffers never cross an await: this is synchronous).
fn decide_step(
    gw: &Gateway,
    route: &ModelRoute,
    key: Option<u64>,
    parsed: Option<&ParsedRequest>,
    prepared: Option<prefix::Prepared>,
) -> (
    Decision,
    Option<Reservation>,
    Option<Lookup>,
    Option<prefix::Hold>,
) {
    let now = gw.clock.now_us();
    let mut view = RouteView {
        engines: &route.engines,
        now_us: now,
        fleet_latency_us: gw.registry.fleet_latency_us(),
        totals: &route.totals,
        context: &route.context,
        need_tokens: 0,
    };
    let mut ctx = RequestCtx::new(gw.next_seed(), now);
    if let Some(k) = key {
        ctx = ctx.with_hash_key(k);
    }
    let out = Vec::with_capacity(MAX_CANDIDATES);
    let t = Instant::now();
    let (decision, reservation, lookup, hold) = match &route.prefix {
        None => {
            let d = decide::<_, IndexProbe>(&route.policy, &view, ctx, None, out);
            let r = Reservation::of(route, &d);
            (d, r, None, None)
        }
        Some(rp) => prefix::with_scratch(|s| {
            let state = &gw.registry.prefix;
            let lookup = match (prepared, parsed) {
                (Some(p), _) => {
                    s.keys = p.keys;
                    p.lookup
                }
                (None, Some(req)) => prefix::prompt_keys(state, rp, req, s),
                (None, None) => {
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
                let d = decide::<_, IndexProbe>(&route.policy, &view, ctx, None, out);
                let r = Reservation::of(route, &d);
                return (d, r, None, None);
            };
            // As vLLM counts against its context length: the prompt plus `max_tokens`, or
            // one more token when not given; a lower bound when the prompt was cut at
            // `max_prompt_tokens`, so a long enough engine is never judged short.
            let completion = parsed.and_then(ParsedRequest::max_tokens).unwrap_or(1);
            let need = l.prompt_tokens.saturating_add(completion.max(1));
            // Longer than every engine holds: routed all the same, to an engine of the longest
            // context (its own 400 tells the client the longest window there is), but not
            // remembered as cached where it will be refused.
            let refused = route.context_max > 0 && need > route.context_max;
            if route.context_differs {
                view.need_tokens = if refused { route.context_max } else { need };
            }
            let depth = route.policy_cfg.prefix.cold_prefix_blocks as usize;
            let cold_key = s.keys.get(s.keys.len().min(depth).wrapping_sub(1));
            let cold_key = cold_key.map_or(0, |k| k.0);
            let ttl = prefix::ttl_plan(state.config());
            // Lookup (into the scratch buffers) and decision over one view of the index;
            // `None` when a match is required and no engine holds a usable prefix.
            let decide_on = |index: &PrefixIndex,
                             s: &mut prefix::Scratch,
                             out: Vec<usize>,
                             need_match: bool| {
                prefix::match_engines(state, index, rp, now, s);
                if need_match && s.matches.is_empty() {
                    return None;
                }
                let probe = IndexProbe {
                    index,
                    engines: &route.engines,
                    keys: &s.keys,
                    now_us: now,
                };
                let plan = PrefixPlan {
                    total_blocks: l.total_blocks,
                    matches: &s.matches,
                    cold_key,
                    probe: &probe,
                    ttl,
                };
                let mut d = decide(&route.policy, &view, ctx, Some(plan), out);
                if refused {
                    d.mark = None;
                }
                Some(d)
            };
            // Most prompts match an engine: lookup and decision under the shared lock
            // (concurrent with other lookups), then the mark under a brief write lock.
            let warm = decide_on(&state.index(), s, out, true);
            let (d, r, hold) = match warm {
                Some(d) => {
                    let hold = d.mark.and_then(|m| {
                        let known = d.predicted_blocks[0] as usize;
                        state.mark(
                            route.engines[m.engine].target(),
                            &s.keys,
                            known,
                            m.expiry_us,
                            now,
                        )
                    });
                    let r = Reservation::of(route, &d);
                    (d, r, hold)
                }
                // No engine holds a usable part of the prompt: lookup, decision, mark and
                // reservation again under the write lock, so that siblings of a new prefix
                // arriving together see each other's mark and land on one engine.
                None => state.exclusive(|x| {
                    let Some(d) =
                        decide_on(x.index(), s, Vec::with_capacity(MAX_CANDIDATES), false)
                    else {
                        unreachable!("a decision is made when no match is required")
                    };
                    let hold = d.mark.and_then(|m| {
                        let known = d.predicted_blocks[0] as usize;
                        x.mark(
                            route.engines[m.engine].target(),
                            &s.keys,
                            known,
                            m.expiry_us,
                            now,
                        )
                    });
                    let r = Reservation::of(route, &d);
                    (d, r, hold)
                }),
            };
            (d, r, Some(l), hold)
        }),
    };
    gw.metrics
        .decision_time
        .observe_us(t.elapsed().as_micros() as u64);
    route.count_decision(decision.reason);
    (decision, reservation, lookup, hold)
}

/// How long an attempt waits for the answer's head and first data.
#[derive(Clone, Copy)]
enum Wait {
    /// `timeouts.first_byte_ms` from the attempt's start (a streamed answer).
    FirstByte,
    /// Until the request's total deadline (a whole answer: it comes after the generation),
    /// or until the engine is silent for `silence::silence_limit`.
    Until(tokio::time::Instant),
}

/// Steps 4 and 5: attempts until one is delivered or the machine gives up; with the route
/// index of the engine whose answer (a success or its own refusal) was delivered.
#[allow(clippy::too_many_arguments)]
async fn attempt_step(
    gw: &Arc<Gateway>,
    parts: &http::request::Parts,
    body: Bytes,
    route: &ModelRoute,
    decision: &Decision,
    mut reservation: Option<Reservation>,
    lookup: Option<Lookup>,
    request_id: &HeaderValue,
    wait: Wait,
) -> (Response<Body>, Option<usize>) {
    let mut attempts = Attempts::new(decision, &gw.cfg.retry);
    let mut budget = &gw.retry_budget;
    budget.on_request(gw.clock.now_us());
    let mut last: Option<Failed> = None;
    loop {
        if let (Wait::Until(end), Some(f)) = (wait, &last)
            && tokio::time::Instant::now() >= end
        {
            // The whole answer's time is spent: another engine would start the generation
            // over with none of it left.
            tracing::warn!(request_id = ?request_id, model = %route.model, last_failure = %f.detail, "request given up: its total timeout passed");
            let g = GiveUp::Exhausted { last: f.kind };
            return (give_up(g, last, &route.model), None);
        }
        let u = unit_f64(gw.next_seed());
        let next = attempts.next(
            &decision.candidates,
            &mut RouteFleet(&route.engines),
            &mut budget,
            gw.clock.now_us(),
            u,
        );
        let (pos, index, permit) = match next {
            Next::Send {
                pos,
                engine,
                permit,
                attempt,
                backoff_us,
            } => {
                if attempt > 1 {
                    gw.metrics.retries.inc();
                    tokio::time::sleep(Duration::from_micros(backoff_us)).await;
                }
                (pos, engine, permit)
            }
            Next::GiveUp(g) => {
                if matches!(g, GiveUp::BudgetExhausted { .. }) {
                    gw.metrics.budget_exhausted.inc();
                }
                let last_failure = last
                    .as_ref()
                    .map_or("none: no attempt was sent", |f| f.detail.as_str());
                tracing::warn!(request_id = ?request_id, model = %route.model, verdict = ?g, last_failure, "request given up");
                return (give_up(g, last, &route.model), None);
            }
        };
        let engine = &route.engines[index];
        // The first attempt on the reserved engine takes the reservation's count over; any
        // other attempt counts itself (and the reservation ends).
        let counted = reservation.take().is_some_and(|r| r.hand_over(engine));
        let whole = matches!(wait, Wait::Until(_));
        let attempt = Attempt::start(gw.clone(), engine.clone(), permit, counted, whole);
        let retry_429 = attempts.retries_429();
        match send(
            gw,
            engine,
            parts,
            body.clone(),
            request_id,
            attempt,
            retry_429,
            wait,
        )
        .await
        {
            Sent::Answer(mut r) => {
                // The engine's own refusal (4xx) served no prompt: it is left out of the
                // predicted-vs-served figures.
                if let (Some(l), Some(rp), true) = (lookup, &route.prefix, r.status().is_success())
                {
                    let predicted = u64::from(decision.predicted(pos)) * u64::from(rp.block_size);
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
                return (r, Some(index));
            }
            Sent::Failed(mut f, attempt) => {
                if gw.cfg.hide_engine_urls {
                    let what = match f.kind {
                        FailKind::Connect => "could not connect",
                        FailKind::Timeout | FailKind::Unanswered => "no answer in time",
                        FailKind::Transport | FailKind::Stream => "the connection broke",
                        FailKind::Status5xx | FailKind::Status429 => "an error status",
                    };
                    let id = String::from_utf8_lossy(f.engine.as_bytes());
                    f.public = Some(format!("engine {id}: {what}"));
                }
                tracing::debug!(request_id = ?request_id, engine = %engine.url, kind = f.kind.as_str(), detail = %f.detail, "attempt failed");
                match attempts.on_head(Verdict::Failed(f.kind)) {
                    // A whole answer cut by the request's total timeout while the engine was
                    // generating (its token counter grew since the attempt was sent): the
                    // router's budget ran out, not the engine (a long generation opened
                    // healthy engines' breakers, QA). One that generated nothing failed.
                    Action::TryNext { .. }
                        if matches!(wait, Wait::Until(_))
                            && f.kind == FailKind::Timeout
                            && engine.worked_at_us.load(Ordering::Relaxed) > attempt.sent_us() =>
                    {
                        attempt.account(Accounting::Cancel, None);
                    }
                    Action::TryNext { account } => attempt.account(account, Some(f.kind)),
                    Action::Deliver => unreachable!("a failed attempt is never delivered"),
                }
                last = Some(f);
            }
        }
    }
}

/// One request counted in flight on an engine between the decision and its attempt.
struct Reservation(Option<Arc<Engine>>);

impl Reservation {
    /// The decision's reservation, counted in flight right away so that the next decision's
    /// load guard sees this request (the attempt takes the count over). Made after the
    /// decision's mark: the mesh sends a mark no later than the counts that follow it, so a
    /// peer router never sees this request's load without its mark (and sends a sibling of
    /// a new prefix elsewhere for it).
    fn of(route: &ModelRoute, d: &Decision) -> Option<Reservation> {
        d.reserve
            .map(|i| Reservation::new(route.engines[i].clone()))
    }

    fn new(e: Arc<Engine>) -> Reservation {
        e.begin_request();
        Reservation(Some(e))
    }

    /// Hands the count to an attempt on `engine` when it is the reserved one (the count does
    /// not move: no change for the mesh to carry, no moment counted twice); else the
    /// reservation ends here. Whether it was handed over.
    fn hand_over(mut self, engine: &Arc<Engine>) -> bool {
        let same = self.0.as_ref().is_some_and(|e| Arc::ptr_eq(e, engine));
        if same {
            self.0 = None;
        }
        same
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(e) = self.0.take() {
            e.end_request();
        }
    }
}

/// One attempt: forward, wait for the response head and, for a success, its body's first
/// data (both bounded by `wait`), classify it.
#[allow(clippy::too_many_arguments)]
async fn send(
    gw: &Gateway,
    engine: &Engine,
    parts: &http::request::Parts,
    body: Bytes,
    request_id: &HeaderValue,
    mut attempt: Attempt,
    retry_429: bool,
    wait: Wait,
) -> Sent {
    let mut headers = parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    // Cross-origin answers are the router's to allow (`cors_allowed_origins`), not the
    // engine's: vLLM allows any origin by default and would say so to the browser.
    headers.remove(header::ORIGIN);
    if let Some(n) = &gw.request_id_name {
        headers.insert(n.clone(), request_id.clone());
    }
    headers.append(crate::hops::VIA, gw.via.clone());
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
        Err(e) => return failed(FailKind::Transport, e.to_string(), attempt),
    };
    let mut up = Request::new(Full::new(body));
    *up.method_mut() = parts.method.clone();
    *up.uri_mut() = uri;
    *up.headers_mut() = headers;
    let first_byte = match wait {
        Wait::FirstByte => Duration::from_millis(gw.cfg.timeouts.first_byte_ms),
        Wait::Until(end) => end.saturating_duration_since(tokio::time::Instant::now()),
    };
    let waited = match wait {
        Wait::FirstByte => match tokio::time::timeout(first_byte, gw.upstream.send(up)).await {
            Ok(r) => Waited::Done(r),
            Err(_) => Waited::Deadline,
        },
        Wait::Until(end) => {
            let sent = attempt.sent_us();
            silence::until_or_silent(gw, engine, sent, end, gw.upstream.send(up)).await
        }
    };
    let resp = match waited {
        Waited::Deadline => {
            let detail = format!("{}: no response within {first_byte:?}", engine.url);
            return failed(FailKind::Timeout, detail, attempt);
        }
        Waited::Silent(quiet) => {
            let detail = format!(
                "{}: the engine answered nothing and did no work for {quiet:?}",
                engine.url
            );
            return failed(FailKind::Timeout, detail, attempt);
        }
        Waited::Done(Err(e)) => {
            let kind = if e.connect {
                FailKind::Connect
            } else {
                FailKind::Transport
            };
            return failed(kind, format!("{}: {e}", engine.url), attempt);
        }
        Waited::Done(Ok(r)) => r,
    };
    let status = resp.status();
    if let Some(why) = failed::no_answer(&resp) {
        return failed(
            FailKind::Transport,
            format!("{}: {why}", engine.url),
            attempt,
        );
    }
    if let Verdict::Failed(kind) = classify_status(status.as_u16(), retry_429) {
        return failed::error_answer(engine, kind, resp, attempt).await;
    }
    // Success or the client's own error: stream it through, tracked to the end. A success's
    // head waits for its body's first frame (within the same first-byte timeout): an engine
    // that fails after its head but before any byte of the answer (it died during the
    // prefill) is retried on another engine like one that failed before its head, since
    // nothing has reached the client yet.
    let (mut p, mut b) = resp.into_parts();
    let event_stream = p
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let ahead = if status.is_success() {
        let left = first_byte.saturating_sub(attempt.elapsed());
        match tokio::time::timeout(left, first_frame(&mut b)).await {
            Err(_) => {
                let detail = format!("{}: no answer within {first_byte:?}", engine.url);
                return failed(FailKind::Timeout, detail, attempt);
            }
            Ok(Err(e)) => {
                let detail = format!(
                    "{}: the answer broke before its first byte: {e}",
                    engine.url
                );
                return failed(FailKind::Transport, detail, attempt);
            }
            Ok(Ok(Some(f))) => {
                match f.data_ref().and_then(|d| opening_error(event_stream, d)) {
                    // The engine's stream opened with an error of its own: nothing has
                    // reached the client, so another engine is tried.
                    // (An overload, as a 429 head is, only when 429s are retried.)
                    Some(e)
                        if e.blame == Blame::Engine
                            || (e.blame == Blame::Overloaded && retry_429) =>
                    {
                        let kind = match e.blame {
                            Blame::Overloaded => FailKind::Status429,
                            _ => FailKind::Status5xx,
                        };
                        let detail = format!(
                            "{}: its event stream opened with an error: {}",
                            engine.url, e.message
                        );
                        return failed(kind, detail, attempt);
                    }
                    // Passed on (the client's error, or an overload not retried): it says
                    // nothing of the engine's latency; its end is accounted as the event says.
                    Some(_) => attempt.answered_head(),
                    None if f.is_data() => attempt.first_byte(),
                    None => {}
                }
                ReadAhead::First(f)
            }
            // A success without a body is no answer to a completion (QA: it reached the
            // client as a 200 it could not parse, and the engine was credited): nothing has
            // reached the client, so another engine is tried.
            Ok(Ok(None)) => {
                let detail = format!("{}: an empty answer ({status} without a body)", engine.url);
                return failed(FailKind::Transport, detail, attempt);
            }
        }
    } else {
        if status.is_client_error() {
            attempt.refused();
        }
        attempt.answered_head();
        ReadAhead::Nothing
    };
    strip_hop_by_hop(&mut p.headers);
    // The router speaks its own HTTP to the client (QA: an engine's `HTTP/1.0` status line
    // reached an HTTP/1.1 client).
    p.version = http::Version::HTTP_11;
    p.headers
        .insert("x-kvmesh-engine", engine.header_value.clone());
    let total = Duration::from_millis(gw.cfg.timeouts.total_ms);
    let tracked = TrackedBody::new(b, attempt, total, ahead, event_stream);
    Sent::Answer(Response::from_parts(p, tracked.boxed_unsync()))
}

/// The error event an event stream's first frame opens with (whole in the frame), if it does
/// (vLLM and SGLang answer 200 and tell of a failure in the stream: the engine died in the
/// prefill, or it refuses the request only once it is streaming).
fn opening_error(event_stream: bool, first: &[u8]) -> Option<ErrorEvent> {
    if !event_stream {
        return None;
    }
    let mut scan = EventScan::default();
    scan.push(first);
    scan.error().filter(|e| e.opening).cloned()
}

/// The body's first frame that is not empty data (`None`: it ended without one).
async fn first_frame(b: &mut UpstreamBody) -> Result<Option<Frame<Bytes>>, BoxError> {
    while let Some(f) = b.frame().await {
        let f = f?;
        if f.data_ref().is_some_and(Bytes::is_empty) {
            continue;
        }
        return Ok(Some(f));
    }
    Ok(None)
}

#[cfg(test)]
#[path = "proxy_tests.rs"]
mod tests;
