//! Acceptance 5: bad input gets an OpenAI-shaped 4xx from the router itself (nothing reaches
//! an engine), and the router keeps serving afterwards.

mod common;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_change_nothing() {
    // Two models: model-a on two engines, model-b on one.
    let sims = start_sims(3, |i| {
        instant_sim_cfg(if i < 2 { "model-a" } else { "model-b" })
    })
    .await;
    let engines = urls(&sims);
    let mut cfg = serve_cfg(&engines);
    cfg.max_body_bytes = 4096;
    let router = start_router_with(cfg, "model-a", 2).await;
    wait_routable(&router, "model-b", 1).await;
    let base = router.base_url();
    let c = client();
    let chat = format!("{base}/v1/chat/completions");
    let completions = format!("{base}/v1/completions");

    let (s, models) = get(&c, &format!("{base}/v1/models")).await;
    assert_eq!(s, 200);
    let models: serde_json::Value = serde_json::from_str(&models).expect("json");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["model-a", "model-b"]);
    // Each card repeats what its engine lists (found by QA: the context length was dropped).
    let (_, direct) = get(&c, &format!("{}/v1/models", engines[0])).await;
    let direct: serde_json::Value = serde_json::from_str(&direct).expect("json");
    let len = &direct["data"][0]["max_model_len"];
    assert!(len.as_u64().is_some_and(|n| n > 0), "{direct}");
    assert_eq!(&models["data"][0]["max_model_len"], len, "{models}");
    // One model's card, as the OpenAI client's `models.retrieve` asks for it, its name
    // percent-encoded or not; an unknown model's is OpenAI's 404 (QA31: a 404 for every model).
    for name in ["model-a", "model%2Da"] {
        let (s, card) = get(&c, &format!("{base}/v1/models/{name}")).await;
        assert_eq!(s, 200, "{card}");
        let card: serde_json::Value = serde_json::from_str(&card).expect("json");
        assert_eq!(card, models["data"][0]);
    }
    let r = send(
        &c,
        "GET",
        &format!("{base}/v1/models/model-c"),
        &[],
        Bytes::new(),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        assert_openai_error(&r, 404)["error"]["code"],
        "model_not_found"
    );

    let good = |model: &str| chat_body(model, "hello", 3, false);
    let check_serving = |c: HttpClient, url: String| async move {
        for model in ["model-a", "model-b"] {
            let r = post_json(&c, &url, &chat_body(model, "still there?", 2, false)).await;
            assert!(r.ok(), "{r:?}");
            assert_eq!(r.json()["model"], model);
        }
    };
    check_serving(c.clone(), chat.clone()).await;
    let page = scrape(&c, &base).await;
    let sent_before: f64 = attempts(&page, &engines).iter().sum();

    // Malformed JSON.
    for body in ["{\"model\": \"model-a\", ", "not json", "[1, 2]", ""] {
        let r = send(&c, "POST", &chat, &[], body, Duration::from_secs(10)).await;
        let v = assert_openai_error(&r, 400);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{}", r.body);
    }
    // `model` of the wrong type.
    let r = post_json(&c, &chat, &json!({"model": 7, "messages": []})).await;
    assert_openai_error(&r, 400);

    // Body over the limit: with a Content-Length, and streamed without one.
    let big = chat_body("model-a", &"x".repeat(5000), 3, false).to_string();
    let r = send(&c, "POST", &chat, &[], big.clone(), Duration::from_secs(10)).await;
    let v = assert_openai_error(&r, 413);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("4096"),
        "{}",
        r.body
    );
    let r = send_chunked(&chat, big.into_bytes()).await;
    assert_openai_error(&r, 413);

    // No model while several are served.
    let r = post_json(
        &c,
        &chat,
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    let v = assert_openai_error(&r, 400);
    assert_eq!(v["error"]["param"], "model", "{}", r.body);
    let r = post_json(&c, &completions, &json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_openai_error(&r, 400);

    // Unknown model.
    let r = post_json(&c, &chat, &good("no-such-model")).await;
    let v = assert_openai_error(&r, 404);
    assert_eq!(v["error"]["code"], "model_not_found", "{}", r.body);
    let r = post_json(
        &c,
        &completions,
        &completion_body("no-such-model", "hi", 2, false),
    )
    .await;
    assert_openai_error(&r, 404);

    // Wrong method and unknown path.
    let r = send(&c, "GET", &chat, &[], Bytes::new(), Duration::from_secs(10)).await;
    assert_openai_error(&r, 405);
    // A compressed body: 415, not a misleading UTF-8 error (found by QA).
    let gz = [("content-encoding", "gzip")];
    let r = send(
        &c,
        "POST",
        &chat,
        &gz,
        good("model-a").to_string(),
        Duration::from_secs(10),
    )
    .await;
    let v = assert_openai_error(&r, 415);
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("gzip")),
        "{}",
        r.body
    );
    // HEAD is answered wherever GET is, head only (found by QA: 405).
    for path in ["/health", "/v1/models", "/"] {
        let url = format!("{base}{path}");
        let r = send(&c, "HEAD", &url, &[], Bytes::new(), Duration::from_secs(10)).await;
        assert_eq!((r.status, r.body.as_str()), (200, ""), "HEAD {path}");
    }
    let url = format!("{base}/health");
    let r = send(&c, "PUT", &url, &[], Bytes::new(), Duration::from_secs(10)).await;
    assert_openai_error(&r, 405);
    assert_eq!(r.headers["allow"], "GET, HEAD");
    let r = send(
        &c,
        "POST",
        &format!("{base}/v1/embeddings"),
        &[("x-request-id", "rid-404")],
        good("model-a").to_string(),
        Duration::from_secs(10),
    )
    .await;
    assert_openai_error(&r, 404);
    // Every answer carries the request's id: the client's, else one of the router's (QA27:
    // a 404, a 405 or /v1/models came without).
    assert_eq!(r.headers["x-request-id"], "rid-404");
    let r = send(
        &c,
        "GET",
        &format!("{base}/v1/models"),
        &[],
        Bytes::new(),
        Duration::from_secs(10),
    )
    .await;
    assert!(
        r.headers
            .get("x-request-id")
            .is_some_and(|v| v.as_bytes().starts_with(b"kvm-")),
        "{:?}",
        r.headers
    );

    // None of it reached an engine, and the router still serves both models.
    let page = scrape(&c, &base).await;
    let sent_after: f64 = attempts(&page, &engines).iter().sum();
    assert_eq!(sent_before, sent_after, "bad requests reached an engine");
    check_serving(c.clone(), chat.clone()).await;
    // A request without a model is fine when one model is served: through a router in front
    // of model-b's engine only.
    let single = start_router_with(serve_cfg(&engines[2..]), "model-b", 1).await;
    let r = post_json(
        &c,
        &format!("{}/v1/chat/completions", single.base_url()),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    assert!(r.ok(), "{r:?}");
    assert_eq!(r.json()["model"], "model-b");
    single.shutdown().await;
    router.shutdown().await;
    stop_sims(sims).await;
}

/// POSTs a body in 1 KiB chunks without a Content-Length.
async fn send_chunked(url: &str, body: Vec<u8>) -> Reply {
    // The shared client sends `Full` bodies (with a length): a one-off client streams.
    let client: hyper_util::client::legacy::Client<_, http_body_util::StreamBody<_>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let chunks: Vec<Result<hyper::body::Frame<Bytes>, std::convert::Infallible>> = body
        .chunks(1024)
        .map(|ch| Ok(hyper::body::Frame::data(Bytes::copy_from_slice(ch))))
        .collect();
    let stream = http_body_util::StreamBody::new(futures::stream::iter(chunks));
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(stream)
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("answer in time")
        .expect("send");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    Reply {
        headers: http::HeaderMap::new(),
        status,
        engine: None,
        body: String::from_utf8_lossy(&body).into_owned(),
        complete: true,
        error: None,
        sent_at: Duration::ZERO,
    }
}

/// Browsers (CORS): `OPTIONS` is answered with the methods a path takes; with
/// `cors_allowed_origins`, a preflight from an allowed origin gets what it asks for and the
/// answers name the origin (streamed ones too), while another origin gets no CORS header
/// (QA: a preflight met a 405, so a browser client that worked against vLLM broke).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browsers_get_cors_answers_from_the_origins_allowed() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let t = Duration::from_secs(10);
    let c = client();
    let preflight = |origin: &'static str| {
        [
            ("origin", origin),
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "authorization, content-type",
            ),
        ]
    };
    // Off (the default): OPTIONS says what the path takes, and nothing of CORS.
    let plain = start_router_with(serve_cfg(&urls(&sims)), "m", 1).await;
    let chat = format!("{}/v1/chat/completions", plain.base_url());
    let r = options(&c, &chat, &preflight("https://app.example.com")).await;
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(r.headers["allow"], "POST, OPTIONS");
    assert!(r.headers.get("access-control-allow-origin").is_none());
    let r = options(&c, &format!("{}/nowhere", plain.base_url()), &[]).await;
    assert_openai_error(&r, 404);
    let r = options(&c, &format!("{}/v1/models/m", plain.base_url()), &[]).await;
    assert_eq!(
        (r.status, r.headers["allow"].to_str().ok()),
        (204, Some("GET, HEAD, OPTIONS"))
    );
    // The server's own: every method a path takes (QA31: a 404).
    let star = "OPTIONS * HTTP/1.1\r\nhost: kvmesh\r\nconnection: close\r\n\r\n";
    let got = raw_exchange(plain.addr, star, false).await;
    assert!(got.starts_with("http/1.1 204"), "{got:?}");
    assert!(
        got.contains("allow: get, head, post, patch, delete, options"),
        "{got:?}"
    );
    let r = send(
        &c,
        "POST",
        &chat,
        &[("origin", "https://app.example.com")],
        chat_body("m", "hi", 2, false).to_string(),
        t,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.headers.get("access-control-allow-origin").is_none());

    let mut cfg = serve_cfg(&urls(&sims));
    cfg.cors_allowed_origins = vec!["https://app.example.com".into()];
    let router = start_router_with(cfg, "m", 1).await;
    let chat = format!("{}/v1/chat/completions", router.base_url());
    let r = options(&c, &chat, &preflight("https://app.example.com")).await;
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(
        r.headers["access-control-allow-origin"],
        "https://app.example.com"
    );
    assert_eq!(r.headers["access-control-allow-methods"], "POST, OPTIONS");
    assert_eq!(
        r.headers["access-control-allow-headers"],
        "authorization, content-type"
    );
    assert!(r.headers.contains_key("access-control-max-age"));
    let r = options(&c, &chat, &preflight("https://evil.example")).await;
    assert_eq!(r.status, 204);
    assert!(r.headers.get("access-control-allow-origin").is_none());
    for stream in [false, true] {
        let r = send(
            &c,
            "POST",
            &chat,
            &[("origin", "https://app.example.com")],
            chat_body("m", "hi", 2, stream).to_string(),
            t,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.headers["access-control-allow-origin"],
            "https://app.example.com"
        );
        assert_eq!(r.headers["vary"], "origin");
        let exposed = r.headers["access-control-expose-headers"].to_str().unwrap();
        assert!(exposed.contains("x-request-id") && exposed.contains("x-kvmesh-engine"));
    }
    // An error is readable too (the page can show it); another origin's is not.
    let r = send(
        &c,
        "POST",
        &chat,
        &[("origin", "https://app.example.com")],
        "{",
        t,
    )
    .await;
    assert_openai_error(&r, 400);
    assert_eq!(
        r.headers["access-control-allow-origin"],
        "https://app.example.com"
    );
    let r = send(
        &c,
        "GET",
        &format!("{}/v1/models", router.base_url()),
        &[("origin", "https://evil.example")],
        Bytes::new(),
        t,
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.headers.get("access-control-allow-origin").is_none());
    stop_sims(sims).await;
}

/// A request with as many headers as the router takes (hyper's 100) reaches the engine, to
/// which the router adds its own (QA: the simulator answered 431 to 99 headers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_as_many_headers_as_the_router_takes_is_served() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let router = start_router_with(serve_cfg(&urls(&sims)), "m", 1).await;
    let names: Vec<String> = (0..97).map(|i| format!("x-client-{i}")).collect();
    // With `host` and `content-type`, 99 headers.
    let headers: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "v")).collect();
    let r = send(
        &client(),
        "POST",
        &format!("{}/v1/chat/completions", router.base_url()),
        &headers,
        chat_body("m", "hi", 2, false).to_string(),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    stop_sims(sims).await;
}

/// `OPTIONS url` with `headers` (a browser's preflight, or none).
async fn options(c: &HttpClient, url: &str, headers: &[(&str, &str)]) -> Reply {
    send(
        c,
        "OPTIONS",
        url,
        headers,
        Bytes::new(),
        Duration::from_secs(10),
    )
    .await
}

/// Sends `req` on a new connection (`close`: then shuts its writing side) and reads all the
/// router sends until it closes, lower-cased.
async fn raw_exchange(router: std::net::SocketAddr, req: &str, close: bool) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(router)
        .await
        .expect("connect");
    s.write_all(req.as_bytes()).await.expect("send");
    if close {
        s.shutdown().await.expect("shutdown");
    }
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
        .await
        .expect("an answer in time")
        .expect("read");
    String::from_utf8_lossy(&got).to_ascii_lowercase()
}

/// An HTTP/1.1 request without exactly one `Host`, or with one that is not `host[:port]`,
/// gets a 400 that says so, and reaches no engine (RFC 9112 §3.2; QA29: the router served
/// one; QA31: `Host: a, b`, two lines a proxy merged). HTTP/1.0 needs none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_one_host_is_refused() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let engines = urls(&sims);
    let router = start_router_with(serve_cfg(&engines), "m", 1).await;
    let body = chat_body("m", "hi", 2, false).to_string();
    let raw = |version: &str, hosts: &str| {
        format!(
            "POST /v1/chat/completions {version}\r\n{hosts}connection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let bad = [
        "",
        "host: a\r\nhost: b\r\n",
        "host: a, b\r\n",
        "host: a/b\r\n",
        "host: a:99999\r\n",
    ];
    for hosts in bad {
        let got = raw_exchange(router.addr, &raw("HTTP/1.1", hosts), false).await;
        assert!(got.starts_with("http/1.1 400"), "{got:?}");
        assert!(got.contains(r#""code":"invalid_host""#), "{got:?}");
        assert!(got.contains("x-request-id: kvm-"), "{got:?}");
    }
    let page = scrape(&client(), &router.base_url()).await;
    assert_eq!(attempts(&page, &engines).iter().sum::<f64>(), 0.0);
    for hosts in ["host: kvmesh\r\n", "host: [::1]:8000\r\n"] {
        let got = raw_exchange(router.addr, &raw("HTTP/1.1", hosts), false).await;
        assert!(got.starts_with("http/1.1 200"), "{got:?}");
    }
    let got = raw_exchange(router.addr, &raw("HTTP/1.0", ""), false).await;
    assert!(
        got.starts_with("http/1.0 200") || got.starts_with("http/1.1 200"),
        "{got:?}"
    );
    router.shutdown().await;
    stop_sims(sims).await;
}

/// A request body in a transfer coding besides chunked gets a 501 that says so (hyper takes
/// the chunks off and leaves the gzip: QA31 got "not valid UTF-8"); a client that closes
/// before its body is whole is counted as a 499, not as a bad request of its own (QA31: a
/// 400 that nobody received). Neither reaches an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_the_router_cannot_read_is_told_apart() {
    let sims = start_sims(1, |_| instant_sim_cfg("m")).await;
    let engines = urls(&sims);
    let router = start_router_with(serve_cfg(&engines), "m", 1).await;
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: kvmesh\r\n\
                content-type: application/json\r\n";
    let coded = format!(
        "{head}connection: close\r\ntransfer-encoding: gzip, chunked\r\n\r\n4\r\n\x1f\x08\0\0\r\n0\r\n\r\n"
    );
    let got = raw_exchange(router.addr, &coded, false).await;
    assert!(got.starts_with("http/1.1 501"), "{got:?}");
    assert!(
        got.contains(r#""code":"unsupported_transfer_coding""#),
        "{got:?}"
    );
    let cut = format!("{head}content-length: 1000\r\n\r\n{{\"model\": \"m\"");
    raw_exchange(router.addr, &cut, true).await;
    let errors = |page: &str, status: &str| {
        let line = format!("kvmesh_error_responses_total{{status=\"{status}\"}} ");
        page.lines()
            .find_map(|l| l.strip_prefix(&line))
            .map_or(0.0, |v| v.trim().parse().expect("a number"))
    };
    let c = client();
    let base = router.base_url();
    wait_until("the cut request counted", Duration::from_secs(5), || {
        let c = c.clone();
        let base = base.clone();
        async move { errors(&scrape(&c, &base).await, "499") == 1.0 }
    })
    .await;
    let page = scrape(&c, &base).await;
    assert_eq!(errors(&page, "400"), 0.0, "{page}");
    assert_eq!(errors(&page, "501"), 1.0, "{page}");
    assert_eq!(attempts(&page, &engines).iter().sum::<f64>(), 0.0);
    router.shutdown().await;
    stop_sims(sims).await;
}
