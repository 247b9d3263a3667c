//! One streamed OpenAI request as the bench's clients send it: the routing headers of the
//! answer's head, then the JSON chunks of its server-sent events, then the usage.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use std::time::Instant;

/// The bench's HTTP client (plain HTTP/1.1 to loopback routers and engines).
pub(crate) type HttpClient =
    Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Longest part of an error answer's body quoted in the error.
const QUOTED_CHARS: usize = 300;

/// An answer being streamed.
pub(crate) struct Streamed {
    /// The engine that served it (`x-kvmesh-engine`), else the target.
    pub served_by: String,
    /// The router's predicted cached tokens (`x-kvmesh-predicted-cached-tokens`).
    pub predicted_cached_tokens: Option<u64>,
    /// When the request was sent.
    pub t0: Instant,
    base: String,
    body: Incoming,
    buf: Vec<u8>,
}

/// Sends `body` to `{base}{path}` and returns the answer's stream; an answer that is not a
/// success is an error quoting its body.
pub(crate) async fn post_stream(
    client: &HttpClient,
    base: &str,
    path: &str,
    body: &serde_json::Value,
) -> Result<Streamed, String> {
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("{base}: {e}"))?;
    let status = resp.status();
    let header = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let served_by = header("x-kvmesh-engine").unwrap_or_else(|| base.to_string());
    let predicted_cached_tokens =
        header("x-kvmesh-predicted-cached-tokens").and_then(|v| v.parse().ok());
    let body = resp.into_body();
    if !status.is_success() {
        let b = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let text: String = String::from_utf8_lossy(&b)
            .chars()
            .take(QUOTED_CHARS)
            .collect();
        return Err(format!("{base}: {status}: {text}"));
    }
    Ok(Streamed {
        served_by,
        predicted_cached_tokens,
        t0,
        base: base.to_string(),
        body,
        buf: Vec::new(),
    })
}

impl Streamed {
    /// The next chunk (a `data:` event's JSON; `[DONE]` and other lines skipped), `None` at the
    /// end of the body. A body error, a chunk that is not JSON or an `error` object in the
    /// stream is an error.
    pub(crate) async fn next_chunk(&mut self) -> Result<Option<serde_json::Value>, String> {
        loop {
            while let Some(pos) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..pos + 2).collect();
                let line = String::from_utf8_lossy(&event);
                let Some(payload) = line.trim().strip_prefix("data: ") else {
                    continue;
                };
                if payload == "[DONE]" {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(payload)
                    .map_err(|e| format!("{}: bad chunk: {e}", self.base))?;
                if v.get("error").is_some() {
                    return Err(format!("{}: error in stream: {payload}", self.base));
                }
                return Ok(Some(v));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(format!("{}: stream: {e}", self.base)),
                Some(Ok(frame)) => {
                    if let Ok(d) = frame.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }
}

/// The token counts of a `usage` object: prompt, cached (`prompt_tokens_details`), completion.
pub(crate) fn usage_counts(usage: &serde_json::Value) -> (u64, u64, u64) {
    (
        usage["prompt_tokens"].as_u64().unwrap_or(0),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        usage["completion_tokens"].as_u64().unwrap_or(0),
    )
}
