//! A small HTTP client and helpers for the simulator's tests (loopback only).
#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_config::SimConfig;
use std::time::Duration;

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A simulator config on an ephemeral loopback port, fast time.
pub fn cfg() -> SimConfig {
    SimConfig {
        listen: "127.0.0.1:0".into(),
        time_scale: 0.05,
        model: "sim-model".into(),
        ..SimConfig::default()
    }
}

/// Sends a request; returns (status, body). Bounded by a 30 s timeout.
pub async fn request(
    c: &HttpClient,
    method: &str,
    url: &str,
    body: impl Into<Bytes>,
) -> (u16, String) {
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .expect("request");
    let fut = async {
        let resp = c.request(req).await.expect("send");
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("request timed out")
}

pub async fn post(c: &HttpClient, url: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let (s, b) = request(c, "POST", url, body.to_string()).await;
    (
        s,
        serde_json::from_str(&b).unwrap_or(serde_json::Value::String(b)),
    )
}

pub async fn get(c: &HttpClient, url: &str) -> (u16, String) {
    request(c, "GET", url, Bytes::new()).await
}

/// Reads one sample (summed over label sets) from a Prometheus text page.
pub fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub async fn metrics(c: &HttpClient, base: &str) -> String {
    let (s, b) = get(c, &format!("{base}/metrics")).await;
    assert_eq!(s, 200);
    b
}

/// A text of about `words` English words, distinct per `seed`.
pub fn long_text(seed: u64, words: usize) -> String {
    const W: &[&str] = &[
        "router",
        "engine",
        "cache",
        "prefix",
        "block",
        "token",
        "request",
        "latency",
        "batch",
        "queue",
        "gossip",
        "mesh",
        "policy",
        "weight",
        "health",
        "stream",
        "model",
        "prompt",
        "decode",
        "prefill",
        "memory",
        "event",
        "replay",
        "cluster",
        "node",
        "partition",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(words * 8);
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(W[(x % W.len() as u64) as usize]);
    }
    out
}
