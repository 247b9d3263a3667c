//! Clients that hold connections without finishing their requests (slowloris) cannot stop the
//! router: half-sent headers are dropped after the header-read timeout, stalled bodies get a
//! 408, and past the connection cap a new connection gets a clear 503 — while complete
//! requests from other clients keep being served.

mod common;

use common::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads whatever the server sends until it closes (bounded).
async fn read_to_close(s: &mut TcpStream, within: Duration) -> Option<String> {
    let mut buf = Vec::new();
    match tokio::time::timeout(within, s.read_to_end(&mut buf)).await {
        Ok(_) => Some(String::from_utf8_lossy(&buf).into_owned()),
        Err(_) => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_do_not_stop_other_clients() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let mut cfg = serve_cfg(&urls(&sims));
    cfg.max_connections = 24;
    cfg.header_read_timeout_ms = 1_500;
    cfg.body_read_timeout_ms = 1_500;
    let router = start_router_with(cfg, "m", 1).await;
    let addr = router.addr;
    let c = client();
    let chat = format!("{}/v1/chat/completions", router.base_url());

    // 12 connections that send half a request head and stall.
    let mut heads = Vec::new();
    for _ in 0..12 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-ty")
            .await
            .expect("write");
        heads.push(s);
    }
    // 8 that send the whole head but only part of the body.
    let body = chat_body("m", "hello", 2, false).to_string();
    let mut bodies = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.expect("write");
        s.write_all(&body.as_bytes()[..10]).await.expect("write");
        bodies.push(s);
    }
    // 20 of 24 slots held: complete requests from another client are still served.
    for _ in 0..5 {
        let r = post_json(&c, &chat, &chat_body("m", "hi", 2, false)).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }

    // The stalled bodies get an OpenAI-shaped 408.
    for s in &mut bodies {
        let text = read_to_close(s, Duration::from_secs(10))
            .await
            .expect("answered and closed within the bound");
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("\"code\":\"request_timeout\""), "{text}");
    }
    // The half-sent heads are closed by the server (no response: hyper drops them).
    for s in &mut heads {
        let text = read_to_close(s, Duration::from_secs(10))
            .await
            .expect("closed by the server within the bound");
        assert!(!text.starts_with("HTTP/1.1 200"), "{text}");
    }

    // Fill every slot with idle connections: the next one gets a 503 and is closed.
    let mut idle = Vec::new();
    for _ in 0..24 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GE").await.expect("write");
        idle.push(s);
    }
    // The accept loop counts them as they are accepted: retry until one is refused.
    let mut refused = None;
    for _ in 0..50 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let mut buf = vec![0u8; 4096];
        match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                refused = Some(String::from_utf8_lossy(&buf[..n]).into_owned());
                break;
            }
            _ => idle.push(s),
        }
    }
    let text = refused.expect("a connection past the cap is refused");
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("\"code\":\"connection_limit\""), "{text}");
    assert!(text.contains("connection limit (24"), "{text}");

    // Once they are gone (closed by the client, or by the header timeout), service resumes.
    drop(idle);
    let mut ok = false;
    for _ in 0..50 {
        let r = post_json(&c, &chat, &chat_body("m", "hi", 2, false)).await;
        if r.status == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "served again once the slots are free");
    let closed = |page: &str, reason: &str| {
        let label = format!("reason=\"{reason}\"");
        page.lines()
            .filter(|l| l.starts_with("kvmesh_connections_closed_total{") && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let page = scrape(&c, &router.base_url()).await;
    assert!(closed(&page, "over_limit") >= 1.0, "the refusal counted");
    assert_eq!(closed(&page, "send_timeout"), 0.0);
    router.shutdown().await;
    stop_sims(sims).await;
}

/// A client that stops reading its streamed answer is disconnected after `send_timeout_ms`:
/// its request stops counting as in flight (it used to stay counted for as long as the
/// client kept the socket open) and is not held against the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_let_go_and_its_request_stops_counting() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let engine = urls(&sims)[0].clone();
    let mut cfg = serve_cfg(&urls(&sims));
    cfg.send_timeout_ms = 1_000;
    let router = start_router_with(cfg, "m", 1).await;
    let c = client();
    let base = router.base_url();
    // A small receive window, never read: the router's writes block once the socket's
    // buffers are full (30,000 tokens are several MB of events).
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.set_recv_buffer_size(4096).expect("rcvbuf");
    let mut s = sock.connect(router.addr).await.expect("connect");
    let body = serde_json::json!({"model": "m", "prompt": "never read", "max_tokens": 30000, "stream": true})
        .to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("head");
    s.write_all(body.as_bytes()).await.expect("body");
    wait_until("the request counted", Duration::from_secs(10), || async {
        metric(&scrape(&c, &base).await, "kvmesh_in_flight") == 1.0
    })
    .await;
    // Let go within a few seconds of the limit, the socket still open on this side.
    wait_until(
        "the stalled request let go",
        Duration::from_secs(20),
        || async { metric(&scrape(&c, &base).await, "kvmesh_in_flight") == 0.0 },
    )
    .await;
    let page = scrape(&c, &base).await;
    assert_eq!(
        engine_kind_metric(&page, "kvmesh_engine_errors_total", &engine, "stream"),
        0.0,
        "the client's stall is not the engine's failure"
    );
    assert!(
        page.contains("kvmesh_connections_closed_total{reason=\"send_timeout\"} 1\n"),
        "the cut counted once"
    );
    drop(s);
    stop_sims(sims).await;
}
