//! The HTTP routes of the simulator: OpenAI endpoints (in `api`), metrics, admin endpoints.

use crate::api;
use crate::engine_thread::Command;
use crate::state::AppState;
use bytes::Bytes;
use http::{Method, Request, Response};
use hyper::body::Incoming;
pub use kvmesh_http::{Body, error, full, json};
use kvmesh_openai::{ApiError, ModelCard, ModelList};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// A 405 naming the methods `path` takes, counted as rejected.
fn not_allowed_counted(
    st: &AppState,
    method: &Method,
    path: &str,
    allow: &'static str,
) -> Response<Body> {
    st.metrics.rejected();
    kvmesh_http::not_allowed(method, path, allow)
}

/// Time a client has to send its whole request body (then 408).
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Routes one request.
pub async fn route(st: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    if req.version() == http::Version::HTTP_2 {
        st.metrics.http2_request();
    }
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let res = match (&method, path.as_str()) {
        (&Method::POST, "/v1/chat/completions") => api::chat(&st, req).await,
        (&Method::POST, "/v1/completions") => api::completions(&st, req).await,
        (&Method::GET, "/v1/models") => Ok(models(&st)),
        (&Method::GET, "/health") => Ok(Response::new(full(Bytes::new()))),
        (&Method::GET, "/metrics") => Ok(metrics(&st)),
        (&Method::POST, "/tokenize") => api::tokenize(&st, req).await,
        (&Method::POST, "/detokenize") => api::detokenize(&st, req).await,
        (&Method::POST, "/reset_prefix_cache") => reset_prefix_cache(&st).await,
        (&Method::GET, "/admin/faults") => Ok(faults_json(&st.faults_snapshot())),
        (&Method::POST, "/admin/faults") => set_faults(&st, req).await,
        (&Method::DELETE, "/admin/faults") => {
            let f = st.clear_faults();
            Ok(faults_json(&f))
        }
        (&Method::POST, "/admin/crash") => crash(),
        (&Method::POST, "/admin/restart") => restart(&st).await,
        (&Method::GET, "/admin/kv_cache") => kv_cache(&st).await,
        (
            _,
            "/v1/chat/completions"
            | "/v1/completions"
            | "/tokenize"
            | "/detokenize"
            | "/reset_prefix_cache"
            | "/admin/crash"
            | "/admin/restart",
        ) => Ok(not_allowed_counted(&st, &method, &path, "POST")),
        (_, "/v1/models" | "/health" | "/metrics" | "/admin/kv_cache") => {
            Ok(not_allowed_counted(&st, &method, &path, "GET"))
        }
        (_, "/admin/faults") => Ok(not_allowed_counted(
            &st,
            &method,
            &path,
            "GET, POST, DELETE",
        )),
        _ => Err(ApiError::not_found(method.as_str(), &path)),
    };
    res.unwrap_or_else(|e| {
        if e.status < 500 {
            st.metrics.rejected();
        }
        error(&e)
    })
}

/// Reads the whole body of `req` under the size limit (413 above it).
pub async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    let (parts, body) = req.into_parts();
    kvmesh_http::read_body(&parts.headers, body, limit, BODY_READ_TIMEOUT).await
}

fn models(st: &AppState) -> Response<Body> {
    let list = ModelList {
        object: "list".into(),
        data: std::iter::once(ModelCard {
            id: st.cfg.model.clone(),
            object: "model".into(),
            created: st.started_unix,
            owned_by: "vllm".into(),
            root: Some(st.cfg.model.clone()),
            max_model_len: Some(st.cfg.max_model_len),
            parent: None,
        })
        .chain(st.cfg.lora_modules.iter().map(|l| ModelCard {
            id: l.clone(),
            object: "model".into(),
            created: st.started_unix,
            owned_by: "vllm".into(),
            root: Some(format!("/adapters/{l}")),
            max_model_len: Some(st.cfg.max_model_len),
            parent: Some(st.cfg.model.clone()),
        }))
        .collect(),
    };
    json(200, serde_json::to_string(&list).unwrap_or_default())
}

fn metrics(st: &AppState) -> Response<Body> {
    kvmesh_http::prometheus(st.metrics.render())
}

async fn reset_prefix_cache(st: &AppState) -> Result<Response<Body>, ApiError> {
    let (tx, rx) = oneshot::channel();
    if !st.engine.send(Command::ResetPrefixCache(tx)) {
        return Err(ApiError::unavailable("the engine is not running"));
    }
    match rx.await {
        Ok(true) => Ok(Response::new(full(Bytes::new()))),
        // vLLM refuses while blocks are in use (requests running).
        Ok(false) => Err(ApiError::with_status(
            409,
            "failed to reset the prefix cache: blocks are in use by running requests",
        )),
        Err(_) => Err(ApiError::unavailable("the engine is not running")),
    }
}

fn faults_json(f: &kvmesh_config::FaultConfig) -> Response<Body> {
    json(200, serde_json::to_string(f).unwrap_or_default())
}

async fn set_faults(st: &AppState, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = read_body(req, 64 * 1024).await?;
    let f = st.apply_faults(&body)?;
    Ok(faults_json(&f))
}

fn crash() -> Result<Response<Body>, ApiError> {
    tracing::warn!("POST /admin/crash: exiting abruptly");
    // Abrupt on purpose: no drain, no flush, like a killed engine. A moment's delay lets the
    // caller see that the request was accepted.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(20));
        std::process::exit(137);
    });
    Ok(json(200, r#"{"status":"crashing"}"#.to_string()))
}

async fn restart(st: &AppState) -> Result<Response<Body>, ApiError> {
    let (tx, rx) = oneshot::channel();
    if !st.engine.send(Command::Restart(tx)) {
        return Err(ApiError::unavailable("the engine is not running"));
    }
    rx.await
        .map_err(|_| ApiError::unavailable("the engine is not running"))?;
    Ok(json(200, r#"{"status":"restarted"}"#.to_string()))
}

/// `GET /admin/kv_cache`: every cached block (engine hash, parent, token ids), for tests that
/// check that KV events reproduce the cache.
async fn kv_cache(st: &AppState) -> Result<Response<Body>, ApiError> {
    let (tx, rx) = oneshot::channel();
    if !st.engine.send(Command::DumpCache(tx)) {
        return Err(ApiError::unavailable("the engine is not running"));
    }
    let blocks = rx
        .await
        .map_err(|_| ApiError::unavailable("the engine is not running"))?;
    let list: Vec<serde_json::Value> = blocks
        .iter()
        .map(|b| {
            serde_json::json!({
                "hash": b.hash,
                "parent": b.parent,
                "token_ids": b.token_ids,
                "lora_name": b.lora_name,
            })
        })
        .collect();
    Ok(json(200, serde_json::json!({ "blocks": list }).to_string()))
}
