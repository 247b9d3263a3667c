//! `/admin/engines`: list, add, reweigh and remove engines at run time, behind a bearer
//! token. Meshed, an add, a weight and a removal reach every router (see the mesh's
//! registry); an engine its DNS name resolves is that name's to remove.

use crate::engine::Source;
use crate::gateway::Gateway;
use crate::probe;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use kvmesh_config::{ConfigError, EngineEntry, WEIGHT_RULE, canonical_base_url, valid_weight};
use kvmesh_http::{Body, bearer_ok, error, json, not_allowed, percent_decode, read_body};
use kvmesh_openai::{ApiError, parse_body};
use kvmesh_policy::BreakerState;
use kvmesh_prefix::EngineId;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// `GET | POST | PATCH | DELETE /admin/engines`.
pub async fn engines(gw: &Arc<Gateway>, req: Request<Incoming>) -> Response<Body> {
    if gw.cfg.admin_token.is_empty() {
        return error(&ApiError::with_status(
            403,
            "the admin API is disabled: start the router with --admin-token (or KVMESH_ADMIN_TOKEN)",
        ));
    }
    if !bearer_ok(req.headers(), &gw.cfg.admin_token) {
        return error(&ApiError::unauthorized());
    }
    let method = req.method().clone();
    // A change made before the router holds the cluster's registry would be undone by it (a
    // removal of an engine the cluster holds comes back with the cluster's state).
    if method != Method::GET && gw.mesh.get().is_some_and(|m| !m.is_warm()) {
        let mut r = error(&ApiError::unavailable(
            "this router is joining the cluster and does not hold its registry yet: retry in a moment, or send the change to another router",
        ));
        r.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
        return r;
    }
    let query = req.uri().query().map(str::to_string);
    let result = match method {
        Method::GET => Ok(list(gw)),
        Method::POST => add(gw, req).await,
        Method::PATCH => reweigh(gw, req).await,
        Method::DELETE => remove(gw, req, query).await,
        m => return not_allowed(&m, "/admin/engines", "GET, POST, PATCH, DELETE"),
    };
    result.unwrap_or_else(|e| error(&e))
}

/// An admin request's body: at most 64 KiB, within the router's body-read timeout.
async fn admin_body(gw: &Gateway, req: Request<Incoming>) -> Result<bytes::Bytes, ApiError> {
    let (parts, body) = req.into_parts();
    read_body(
        &parts.headers,
        body,
        64 * 1024,
        std::time::Duration::from_millis(gw.cfg.body_read_timeout_ms),
    )
    .await
}

fn list(gw: &Gateway) -> Response<Body> {
    let now = gw.clock.now_us();
    let fleet = gw.registry.fleet_latency_us();
    let engines: Vec<serde_json::Value> = gw
        .registry
        .shown()
        .into_iter()
        .map(|(e, state)| {
            let t = e.tracker();
            let breaker = match t.breaker().state(now) {
                BreakerState::Closed => "closed",
                BreakerState::Open { .. } => "open",
                BreakerState::HalfOpen => "half_open",
            };
            let healthy = t.health().is_healthy();
            drop(t);
            serde_json::json!({
                "url": e.url,
                "state": state,
                "weight": e.base_weight(),
                "effective_weight": e.view(now, fleet).weight,
                "kv_events": e.kv_events,
                "kv_replay": e.kv_replay,
                "models": e.models(),
                "source": e.source.label(),
                "in_flight": e.in_flight.load(Ordering::Relaxed),
                "healthy": healthy,
                "breaker": breaker,
                "queue": e.reported_waiting(),
                "kv_cache_usage": e.kv_usage(),
            })
        })
        .collect();
    json(200, serde_json::json!({ "engines": engines }).to_string())
}

async fn add(gw: &Arc<Gateway>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = admin_body(gw, req).await?;
    let entry: EngineEntry = parse_body(&body)?;
    // Named as missing, as PATCH's weight is (QA35: told as an invalid URL "").
    if entry.url.is_empty() {
        return Err(ApiError {
            param: Some("url".into()),
            ..ApiError::bad_request(
                "missing_required_parameter",
                "missing required parameter `url` (the engine's base URL, e.g. http://127.0.0.1:8000)",
            )
        });
    }
    entry.validate("engine").map_err(entry_error)?;
    // The same engine posted again with the same settings (a retry, or the same change made
    // through another router once it arrived) is done already: 200, nothing changes. With
    // other settings it is a 409 that says which.
    let url = engine_url(&entry.url)?;
    gw.registry
        .refuse_own_address(&url)
        .map_err(|m| ApiError::invalid_param("url", m))?;
    if let Some(have) = gw.registry.get(EngineId::from_url(&url))
        && !matches!(have.source, Source::Dns(_))
    {
        let differs = entry_difference(&have.entry(), &entry);
        if differs.is_empty() {
            return Ok(json(
                200,
                serde_json::json!({ "url": have.url, "weight": have.base_weight(), "models": have.models() })
                    .to_string(),
            ));
        }
        // PATCH sets a weight and nothing else (QA32: a models mismatch was told to PATCH).
        let remedy = if differs.len() == 1 && differs[0].starts_with("weight ") {
            "set its weight with PATCH"
        } else {
            "DELETE it and POST it again"
        };
        return Err(ApiError::with_status(
            409,
            format!(
                "engine {} is already registered with other settings ({}): {remedy}",
                have.url,
                differs.join(", ")
            ),
        ));
    }
    let e = probe::add_engine(gw, &entry, Source::Admin, true)
        .map_err(|m| ApiError::with_status(409, m))?;
    if let Some(m) = gw.mesh.get() {
        m.engine_added(&entry);
    }
    // Learn its models now so that it takes traffic without waiting for the next round.
    probe::discover(gw, &e).await;
    // The weight this router holds now: a concurrent POST of the same engine through another
    // router may win in the cluster (read GET after concurrent changes).
    Ok(json(
        201,
        serde_json::json!({ "url": e.url, "weight": e.base_weight(), "models": e.models() })
            .to_string(),
    ))
}

/// How a posted entry differs from the registered one, field by field (the URL is the same
/// engine's; weights as the mesh carries them, in thousandths).
fn entry_difference(have: &EngineEntry, posted: &EngineEntry) -> Vec<String> {
    let mut d = Vec::new();
    if kvmesh_config::weight_milli(have.weight) != kvmesh_config::weight_milli(posted.weight) {
        d.push(format!(
            "weight {} here, {} posted",
            have.weight, posted.weight
        ));
    }
    for (field, h, p) in [
        ("kv_events", &have.kv_events, &posted.kv_events),
        ("kv_replay", &have.kv_replay, &posted.kv_replay),
    ] {
        if h != p {
            d.push(format!("{field} {h:?} here, {p:?} posted"));
        }
    }
    if have.models != posted.models {
        d.push(format!(
            "models {:?} here, {:?} posted",
            have.models, posted.models
        ));
    }
    d
}

/// An engine entry's refusal, with the field it names as `param`.
fn entry_error(e: ConfigError) -> ApiError {
    let param = match &e {
        ConfigError::Invalid { key, .. } => ["url", "weight", "kv_events", "kv_replay", "models"]
            .into_iter()
            .find(|p| key.strip_suffix(p).is_some_and(|k| k.ends_with('.'))),
        _ => None,
    };
    match param {
        Some(p) => ApiError::invalid_param(p, e.to_string()),
        None => ApiError::bad_request("invalid_value", e.to_string()),
    }
}

/// `PATCH {"url": …, "weight": N}`: the engine's configured weight, here and (meshed) on
/// every router.
async fn reweigh(gw: &Arc<Gateway>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Patch {
        url: String,
        weight: f64,
    }
    let body = admin_body(gw, req).await?;
    let p: Patch = parse_body(&body)?;
    if !valid_weight(p.weight) {
        return Err(ApiError::invalid_param(
            "weight",
            format!("weight {WEIGHT_RULE}"),
        ));
    }
    let url = engine_url(&p.url)?;
    // A resolved engine's weight is its DNS name's (`serve.dns`), on the routers that
    // resolve it: set here, it would also add the engine to every router through the
    // registry (QA), and outlive the name's next resolution.
    not_resolved(gw, &url, "its weight is the name's (serve.dns weight)")?;
    let e = gw
        .registry
        .set_weight(EngineId::from_url(&url), p.weight)
        .ok_or_else(|| ApiError::with_status(404, format!("no engine {url}")))?;
    if let Some(m) = gw.mesh.get() {
        m.engine_added(&e.entry());
    }
    tracing::info!(engine = %e.url, weight = e.base_weight(), "engine weight set by the admin API");
    Ok(json(
        200,
        serde_json::json!({ "url": e.url, "weight": e.base_weight() }).to_string(),
    ))
}

/// The engine a change names, spelt as the registry spells it; a URL no engine can have is
/// refused as `POST` refuses it (a 400 that says why, not a 404).
fn engine_url(url: &str) -> Result<String, ApiError> {
    let canonical = canonical_base_url(url);
    if !kvmesh_config::valid_base_url(&canonical) {
        return Err(ApiError::invalid_param(
            "url",
            format!("{url:?} {}", kvmesh_config::BASE_URL_RULE),
        ));
    }
    Ok(canonical)
}

/// A 409 for an engine this router resolves from a DNS name (the name rules it), saying
/// `why` the change is refused.
fn not_resolved(gw: &Gateway, url: &str, why: &str) -> Result<(), ApiError> {
    if let Some(e) = gw.registry.get(EngineId::from_url(url))
        && let Source::Dns(name) = &e.source
    {
        return Err(ApiError::with_status(
            409,
            format!("engine {} comes from DNS name {name}: {why}", e.url),
        ));
    }
    Ok(())
}

async fn remove(
    gw: &Arc<Gateway>,
    req: Request<Incoming>,
    query: Option<String>,
) -> Result<Response<Body>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Del {
        url: String,
    }
    let from_query = query.as_deref().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("url="))
            .map(percent_decode)
    });
    let url = match from_query {
        Some(u) => u,
        None => parse_body::<Del>(&admin_body(gw, req).await?)?.url,
    };
    let url = engine_url(&url)?;
    not_resolved(
        gw,
        &url,
        "resolved again and again, it would come back; remove it from the DNS records",
    )?;
    match gw.registry.remove(&url) {
        Some(e) => {
            if let Some(m) = gw.mesh.get() {
                m.engine_removed(&e.url);
            }
            tracing::info!(engine = %e.url, "engine removed by the admin API");
            Ok(json(
                200,
                serde_json::json!({ "removed": e.url }).to_string(),
            ))
        }
        None => {
            // This router's own address, taken as an engine by a peer's admin API: the peers
            // route to it (through this router), this router refused it. Removed from every
            // router through here too, as the cluster's other engines are (QA26: a 404, so it
            // could be removed only through a router that had it).
            if let (Some(m), Err(_)) = (gw.mesh.get(), gw.registry.refuse_own_address(&url)) {
                m.engine_removed(&url);
                tracing::info!(engine = %url, "engine (this router's own address) removed from the cluster by the admin API");
                return Ok(json(200, serde_json::json!({ "removed": url }).to_string()));
            }
            Err(ApiError::with_status(404, format!("no engine {url}")))
        }
    }
}
