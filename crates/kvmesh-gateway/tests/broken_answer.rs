//! An engine that breaks right after the first bytes of its answer: the router cannot retry
//! it (bytes were taken), so the client must get what the engine sent, its head and first
//! event, then an error event saying why the stream ends, before the connection closes on the
//! break. Without that, the client would see a
//! request never answered at all (no status) and take it for one it may safely send again.
//! An engine that answers with an empty 200, on the other hand, has sent nothing the client
//! could take: that request goes to another engine.
//!
//! The engine is a raw TCP server on loopback that writes the head and one chunk of an event
//! stream and closes in the same instant, so that the router's upstream body holds the data
//! and the break together. The client is a raw TCP client that reads until the router closes.
//! Every wait is bounded. Engines that break HTTP's own rules (an answer framed twice, an old
//! version, an upgrade nobody asked for) are raw TCP servers too.

mod common;

use common::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(10);
const FIRST_EVENT: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n";

/// Reads one request (head, then `content-length` bytes); its method, `None` at EOF.
async fn read_request(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() > 64 * 1024 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    head.split(' ').next().map(str::to_string)
}

/// The engine: every GET (model list, health) answers the model list; every POST gets the
/// head of an event stream and one event, and the connection closes at once (no terminating
/// chunk: the answer is broken).
async fn breaking_engine() -> String {
    fake_engine(EngineAnswer::Breaks).await
}

/// What a fake engine answers to a POST.
#[derive(Clone)]
enum EngineAnswer {
    /// The head of an event stream and one event, then the connection closes.
    Breaks,
    /// These bytes, the connection kept.
    Raw(String),
    /// The head of an event stream and one event, then nothing more (the connection kept
    /// open for a minute): a wedged engine.
    Stalls,
}

async fn fake_engine(answer: EngineAnswer) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                while let Some(method) = read_request(&mut s).await {
                    if method == "get" {
                        let body = r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
                        let r = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                             content-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if s.write_all(r.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    if let EngineAnswer::Raw(r) = &answer {
                        if s.write_all(r.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let r = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                         transfer-encoding: chunked\r\n\r\n{:x}\r\n{FIRST_EVENT}\r\n",
                        FIRST_EVENT.len()
                    );
                    let _ = s.write_all(r.as_bytes()).await;
                    if let EngineAnswer::Stalls = answer {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                    let _ = s.shutdown().await;
                    return;
                }
            });
        }
    });
    url
}

/// A streamed chat request to the router on a new connection; everything the router sent
/// until it closed the connection.
async fn ask(router: std::net::SocketAddr) -> String {
    let body = serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": true,
    })
    .to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {router}\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = TcpStream::connect(router).await.expect("connect");
    s.write_all(req.as_bytes()).await.expect("send");
    let mut got = Vec::new();
    let closed = tokio::time::timeout(WAIT, s.read_to_end(&mut got)).await;
    let got = String::from_utf8_lossy(&got).into_owned();
    assert!(
        closed.is_ok(),
        "the router did not close the broken answer's connection; it sent {got:?}"
    );
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_broken_after_its_first_event_reaches_the_client_up_to_the_break() {
    let engine = breaking_engine().await;
    let mut cfg = serve_cfg(&[engine]);
    cfg.engines[0].models = vec!["m".into()];
    // Every answer of this engine breaks: its breaker would eject it after a few.
    cfg.routing.health.breaker.enabled = false;
    let router = start_router_with(cfg, "m", 1).await;
    for i in 0..20 {
        let got = ask(router.addr).await;
        assert!(
            got.starts_with("HTTP/1.1 200"),
            "request {i}: the client got no head: {got:?}"
        );
        assert!(
            got.contains(FIRST_EVENT),
            "request {i}: the first event did not reach the client: {got:?}"
        );
        assert!(
            !got.ends_with("0\r\n\r\n"),
            "request {i}: a broken answer must not look whole: {got:?}"
        );
        // After what the engine sent, an error event says why the stream ends (an OpenAI
        // client raises it as an API error, not as a bare connection reset).
        let after = got.split(FIRST_EVENT).nth(1).unwrap_or("");
        assert!(
            after.contains("data: {\"error\":") && after.contains("broke off"),
            "request {i}: no error event after the break: {got:?}"
        );
    }
    router.shutdown().await;
}

/// An engine that answers a completion with a 200 and no body has given no answer, and
/// nothing has reached the client: the request goes to another engine (QA: the client got
/// the empty 200, which an OpenAI client cannot parse, and the engine was credited with a
/// success). With no other engine, the client gets a 502 that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_answer_is_retried_on_another_engine() {
    let empty = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n";
    no_answer_is_retried_elsewhere(empty, "empty answer").await;
}

/// An engine whose every answer to a completion (`raw`) is no answer: beside a simulator,
/// every request is served (round robin sends half of them to it first); alone, the client
/// gets a 502 whose message holds `why`.
async fn no_answer_is_retried_elsewhere(raw: &str, why: &str) {
    let bad = fake_engine(EngineAnswer::Raw(raw.into())).await;
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let mut engines = vec![bad.clone()];
    engines.extend(urls(&sims));
    let mut cfg = serve_cfg(&engines);
    cfg.engines[0].models = vec!["m".into()];
    cfg.routing.policy.policy = kvmesh_policy::PolicyKind::RoundRobin;
    cfg.routing.health.breaker.enabled = false;
    let router = start_router_with(cfg, "m", 2).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", router.base_url());
    let chat = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    for i in 0..8 {
        let r = send(&c, "POST", &url, &[], chat.clone(), WAIT).await;
        assert_eq!(r.status, 200, "request {i}: {}", r.body);
        assert!(r.json()["choices"].is_array(), "request {i}: {}", r.body);
    }
    router.shutdown().await;

    let mut cfg = serve_cfg(std::slice::from_ref(&bad));
    cfg.engines[0].models = vec!["m".into()];
    cfg.routing.health.breaker.enabled = false;
    let router = start_router_with(cfg, "m", 1).await;
    let url = format!("{}/v1/chat/completions", router.base_url());
    let r = send(&c, "POST", &url, &[], chat, WAIT).await;
    assert_openai_error(&r, 502);
    assert!(r.body.contains(why), "{}", r.body);
    router.shutdown().await;
    stop_sims(sims).await;
}

/// A stream the router's total timeout cuts ends with an error event whose code says a
/// timeout, as the 504 of a whole answer does (QA: it said `upstream_error`, as a broken
/// answer does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_the_total_timeout_says_timeout() {
    let engine = fake_engine(EngineAnswer::Stalls).await;
    let mut cfg = serve_cfg(&[engine]);
    cfg.engines[0].models = vec!["m".into()];
    cfg.timeouts.first_byte_ms = 300;
    cfg.timeouts.total_ms = 1_000;
    let router = start_router_with(cfg, "m", 1).await;
    let got = ask(router.addr).await;
    let after = got.split(FIRST_EVENT).nth(1).unwrap_or("");
    assert!(
        after.contains("data: {\"error\":") && after.contains(r#""code":"timeout""#),
        "{got:?}"
    );
    router.shutdown().await;
}

/// A whole chat answer, as an engine sends it.
const ANSWER: &str = r#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"whole"},"finish_reason":"stop"}]}"#;

/// An engine's chunked answer that also carries a `content-length` reaches the client whole:
/// the chunks frame it, the length is not its body's (QA: the client got a 200 cut to the
/// length, without a word).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_answer_with_a_content_length_reaches_the_client_whole() {
    let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                transfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n";
    let raw = format!("{head}{:x}\r\n{ANSWER}\r\n0\r\n\r\n", ANSWER.len());
    let engine = fake_engine(EngineAnswer::Raw(raw)).await;
    let mut cfg = serve_cfg(&[engine]);
    cfg.engines[0].models = vec!["m".into()];
    let router = start_router_with(cfg, "m", 1).await;
    let url = format!("{}/v1/chat/completions", router.base_url());
    let chat = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let r = send(&client(), "POST", &url, &[], chat, WAIT).await;
    assert_eq!((r.status, r.body.as_str()), (200, ANSWER));
    router.shutdown().await;
}

/// The router answers its client in its own HTTP/1.1, whatever version the engine spoke
/// (QA: an engine's `HTTP/1.0` status line reached the client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_answer_reaches_the_client_as_http_1_1() {
    let raw = format!(
        "HTTP/1.0 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER}",
        ANSWER.len()
    );
    let engine = fake_engine(EngineAnswer::Raw(raw)).await;
    let mut cfg = serve_cfg(&[engine]);
    cfg.engines[0].models = vec!["m".into()];
    let router = start_router_with(cfg, "m", 1).await;
    let got = ask(router.addr).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    assert!(got.ends_with(ANSWER), "{got:?}");
    router.shutdown().await;
}

/// An engine that switches protocols on a request that asked for no upgrade has not
/// answered it: another engine serves it, and with none left the client gets a 502 that
/// says why (QA: the 101 reached the client as the router's answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_nobody_asked_for_is_no_answer() {
    let raw =
        "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n";
    no_answer_is_retried_elsewhere(raw, "101").await;
}

/// No completion is a redirect or a "not modified": another engine serves it (QA31: a 302
/// sent the OpenAI client off to the engine's `location`, a 304 reached it as an error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_no_answer() {
    let found = "HTTP/1.1 302 Found\r\nlocation: http://example.com/\r\ncontent-length: 0\r\n\r\n";
    no_answer_is_retried_elsewhere(found, "302 Found").await;
    no_answer_is_retried_elsewhere("HTTP/1.1 304 Not Modified\r\n\r\n", "304").await;
}

/// An answer in a transfer coding besides chunked (gzip) is one the router cannot pass on:
/// the coding's name goes with the hop, and the client would take the coded bytes for JSON
/// (QA31: it did, and the engine was credited with a success).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_in_a_transfer_coding_the_router_does_not_decode_is_no_answer() {
    let coded = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                 transfer-encoding: gzip, chunked\r\n\r\n4\r\n\x1f\x08\x00\x00\r\n0\r\n\r\n";
    no_answer_is_retried_elsewhere(coded, "transfer coding").await;
}

/// An event stream whose body ends without `data: [DONE]` (every OpenAI stream ends with it)
/// was cut short: the client gets what the engine sent, then an error event, and the
/// connection closes on the break; the attempt is the engine's failure (QA31: it reached the
/// client as a whole answer and was credited as a success). With the terminator, the same
/// answer is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_that_ends_without_its_terminator_was_cut_short() {
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                transfer-encoding: chunked\r\n\r\n";
    let event = |e: &str| format!("{:x}\r\n{e}\r\n", e.len());
    let cut = format!("{head}{}0\r\n\r\n", event(FIRST_EVENT));
    let whole = |done: &str| format!("{head}{}{}0\r\n\r\n", event(FIRST_EVENT), event(done));
    // SSE's other spellings of the terminator are whole too (QA34: no space after `data:`,
    // CRLF line ends).
    for (raw, broken) in [
        (cut, true),
        (whole("data: [DONE]\n\n"), false),
        (whole("data:[DONE]\n\n"), false),
        (whole("data: [DONE]\r\n\r\n"), false),
    ] {
        let engine = fake_engine(EngineAnswer::Raw(raw)).await;
        let mut cfg = serve_cfg(std::slice::from_ref(&engine));
        cfg.engines[0].models = vec!["m".into()];
        let router = start_router_with(cfg, "m", 1).await;
        let got = ask(router.addr).await;
        assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
        let after = got
            .split(FIRST_EVENT)
            .nth(1)
            .expect("the event reached the client");
        let page = scrape(&client(), &router.base_url()).await;
        let failed = engine_kind_metric(&page, "kvmesh_engine_errors_total", &engine, "stream");
        if broken {
            assert!(
                after.contains("data: {\"error\":") && after.contains("without data: [DONE]"),
                "{got:?}"
            );
            assert!(
                !got.ends_with("0\r\n\r\n"),
                "a cut answer must not look whole: {got:?}"
            );
            assert_eq!(failed, 1.0, "{page}");
        } else {
            assert!(
                after.contains("[DONE]") && !after.contains("error"),
                "{got:?}"
            );
            assert!(got.ends_with("0\r\n\r\n"), "{got:?}");
            assert_eq!(failed, 0.0, "{page}");
        }
        router.shutdown().await;
    }
}

/// An engine's answer in the event stream format of `events`, each a chunk, then its end.
fn event_stream_answer(events: &[&str]) -> String {
    let mut raw = String::from(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    );
    for e in events {
        raw.push_str(&format!("{:x}\r\n{e}\r\n", e.len()));
    }
    raw + "0\r\n\r\n"
}

/// vLLM and SGLang end a stream whose generation failed with an error event, then
/// `data: [DONE]`: the client gets it as the engine sent it, and the attempt is the engine's
/// failure when the event's code is the engine's (5xx), neither its failure nor its success
/// when it is the client's (4xx) (QA34: every such stream was credited as a success).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_in_the_stream_is_the_engine_s_failure_when_its_code_says_so() {
    let failed = |code: u16| {
        format!(
            "data: {{\"error\": {{\"object\": \"error\", \"message\": \"generation failed\", \"type\": \"E\", \"param\": null, \"code\": {code}}}}}\n\n"
        )
    };
    for (code, stream_failures) in [(500, 1.0), (400, 0.0)] {
        let event = failed(code);
        let raw = event_stream_answer(&[FIRST_EVENT, &event, "data: [DONE]\n\n"]);
        let engine = fake_engine(EngineAnswer::Raw(raw)).await;
        let mut cfg = serve_cfg(std::slice::from_ref(&engine));
        cfg.engines[0].models = vec!["m".into()];
        let router = start_router_with(cfg, "m", 1).await;
        let got = ask(router.addr).await;
        assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
        assert!(
            got.contains(FIRST_EVENT) && got.contains(&event) && got.contains("data: [DONE]"),
            "the client gets the stream as the engine sent it: {got:?}"
        );
        assert!(got.ends_with("0\r\n\r\n"), "whole: {got:?}");
        let page = scrape(&client(), &router.base_url()).await;
        let stream = engine_kind_metric(&page, "kvmesh_engine_errors_total", &engine, "stream");
        assert_eq!(stream, stream_failures, "code {code}: {page}");
        router.shutdown().await;
    }
}

/// A stream that opens with the engine's error event (it failed before anything of the
/// answer: vLLM's engine died in the prefill) has given the client nothing: another engine
/// serves the request. Alone, the client gets a 502 that says what the engine said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_opens_with_the_engine_s_error_is_retried_elsewhere() {
    let event = "data: {\"error\": {\"message\": \"engine dead\", \"type\": \"InternalServerError\", \"code\": 500}}\n\n";
    let raw = event_stream_answer(&[event, "data: [DONE]\n\n"]);
    let bad = fake_engine(EngineAnswer::Raw(raw)).await;
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let mut engines = vec![bad.clone()];
    engines.extend(urls(&sims));
    let mut cfg = serve_cfg(&engines);
    cfg.engines[0].models = vec!["m".into()];
    cfg.routing.policy.policy = kvmesh_policy::PolicyKind::RoundRobin;
    cfg.routing.health.breaker.enabled = false;
    let router = start_router_with(cfg, "m", 2).await;
    for i in 0..6 {
        let got = ask(router.addr).await;
        assert!(got.starts_with("HTTP/1.1 200"), "request {i}: {got:?}");
        assert!(
            got.contains("data: [DONE]") && !got.contains("engine dead"),
            "request {i}: served by the other engine: {got:?}"
        );
    }
    let page = scrape(&client(), &router.base_url()).await;
    let retried = engine_kind_metric(&page, "kvmesh_engine_errors_total", &bad, "5xx");
    assert!(retried >= 1.0, "round robin sent some to it first: {page}");
    router.shutdown().await;

    let mut cfg = serve_cfg(std::slice::from_ref(&bad));
    cfg.engines[0].models = vec!["m".into()];
    cfg.routing.health.breaker.enabled = false;
    let router = start_router_with(cfg, "m", 1).await;
    let got = ask(router.addr).await;
    assert!(got.starts_with("HTTP/1.1 502"), "{got:?}");
    assert!(got.contains("opened with an error: engine dead"), "{got:?}");
    router.shutdown().await;
    stop_sims(sims).await;
}
