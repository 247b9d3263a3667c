//! The status page: `GET /` serves one self-contained HTML page (no external assets: it is
//! compiled in) that polls `GET /status.json` (this router, its engines, its last routing
//! decisions) and `GET /admin/cluster` (the mesh) and redraws itself.
//!
//! Both are read-only and, like `/metrics`, not behind the admin token: they show engine
//! URLs, models, loads and counters, never the token or a certificate. The admin token
//! protects what changes the router (`/admin/engines`).

use crate::engine::Engine;
use crate::gateway::Gateway;
use kvmesh_http::{Body, full, json};
use kvmesh_policy::BreakerState;
use std::sync::atomic::Ordering::Relaxed;

/// The page, as served.
pub const PAGE: &str = include_str!("status.html");

/// `GET /`.
pub fn page() -> http::Response<Body> {
    let mut r = http::Response::new(full(PAGE));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/html; charset=utf-8"),
    );
    r.headers_mut().insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-store"),
    );
    r
}

fn finite(bits: &std::sync::atomic::AtomicU64) -> Option<f64> {
    Some(f64::from_bits(bits.load(Relaxed))).filter(|v| v.is_finite())
}

fn engine_json(e: &Engine, now_us: u64, fleet_latency_us: f64, meshed: bool) -> serde_json::Value {
    let t = e.tracker();
    let breaker = match t.breaker().state(now_us) {
        BreakerState::Closed => "closed",
        BreakerState::Open { .. } => "open",
        BreakerState::HalfOpen => "half_open",
    };
    let healthy = t.health().is_healthy();
    drop(t);
    let events = e.events_status(meshed);
    let prompt = e.prompt_tokens.load(Relaxed);
    let predicted = e.predicted_cached_tokens.load(Relaxed);
    let hits = finite(&e.engine_hits_bits);
    let queries = finite(&e.engine_queries_bits);
    let errors: u64 = e.metrics.errors.iter().map(|a| a.load(Relaxed)).sum();
    serde_json::json!({
        "url": e.url,
        "id": format!("{:016x}", e.id.0),
        "models": e.models(),
        "healthy": healthy,
        "breaker": breaker,
        "in_flight": e.in_flight.load(Relaxed),
        "peer_in_flight": e.peer_in_flight.load(Relaxed),
        "reported_load": e.reported_load(),
        "queue": e.reported_waiting(),
        "kv_cache_usage": e.kv_usage(),
        "requests": e.metrics.requests.load(Relaxed),
        "errors": errors,
        "weight": e.base_weight(),
        "effective_weight": e.view(now_us, fleet_latency_us).weight,
        "kv_events": !e.kv_events.is_empty(),
        "events_connected": events.0,
        "events_stale": events.1,
        "prompt_tokens": prompt,
        "predicted_cached_tokens": predicted,
        "predicted_hit_rate": (prompt > 0).then(|| predicted as f64 / prompt as f64),
        "engine_hit_rate": match (hits, queries) {
            (Some(h), Some(q)) if q > 0.0 => Some(h / q),
            _ => None,
        },
        "prediction_ratio": finite(&e.prediction_ratio_bits),
    })
}

/// `GET /status.json`: this router (policy, mesh node, requests), per engine its health,
/// breaker, attempts and failed attempts, base and effective weight, load (own, peers', engine-reported), the router's predicted hit rate against the
/// engine's own, and the last routing decisions, newest first.
pub fn status_json(gw: &Gateway) -> http::Response<Body> {
    let now = gw.clock.now_us();
    let meshed = gw.mesh.get().is_some();
    let fleet = gw.registry.fleet_latency_us();
    let mut engines: Vec<serde_json::Value> = gw
        .registry
        .shown()
        .into_iter()
        .map(|(e, state)| {
            let mut j = engine_json(&e, now, fleet, meshed);
            j["state"] = state.into();
            j
        })
        .collect();
    engines.sort_by(|a, b| a["url"].as_str().cmp(&b["url"].as_str()));
    let recent: Vec<serde_json::Value> = gw
        .recent
        .newest_first()
        .into_iter()
        .map(|d| {
            serde_json::json!({
                "ms_ago": now.saturating_sub(d.at_us) / 1_000,
                "model": d.model,
                "engine": d.engine,
                "reason": d.reason,
                "prompt_tokens": d.prompt_tokens,
                "predicted_cached_tokens": d.predicted_cached_tokens,
            })
        })
        .collect();
    let (decisions, skipped) = gw.recent.counts();
    let node = gw.mesh.get().map(|_| gw.cfg.mesh.node_id.clone());
    let body = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "node": node,
        "mesh": gw.mesh.get().is_some(),
        "warm": gw.mesh.get().is_none_or(|m| m.is_warm()),
        "policy": gw.cfg.routing.policy.policy.as_str(),
        // The models whose own policy overrides it.
        "model_policies": gw
            .cfg
            .models
            .iter()
            .filter_map(|(m, c)| Some((m.clone(), c.policy.as_ref()?.policy.as_str())))
            .collect::<std::collections::BTreeMap<_, _>>(),
        "models": gw.registry.models(),
        "uptime_s": now.saturating_sub(gw.started_unix.saturating_mul(1_000_000)) / 1_000_000,
        "requests": gw.metrics.requests.get(),
        "decisions": decisions,
        "decisions_not_sampled": skipped,
        "engines": engines,
        "recent": recent,
    });
    json(200, body.to_string())
}
