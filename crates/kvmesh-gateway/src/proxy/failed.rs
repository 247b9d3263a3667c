//! Failed attempts: what one produced, the engine's error answer read whole (or not at all),
//! and the client's response when the attempts give up.

use crate::engine::Engine;
use crate::track::Attempt;
use crate::upstream::UpstreamBody;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use kvmesh_http::{Body, error, strip_hop_by_hop};
use kvmesh_openai::ApiError;
use kvmesh_route::{FailKind, GiveUp};
use std::time::Duration;

/// A failed attempt: its kind, the engine's own error answer when it sent one (returned to
/// the client if no retry is left), and what happened.
pub(super) struct Failed {
    pub kind: FailKind,
    pub answer: Option<(StatusCode, HeaderMap, Bytes)>,
    /// For the log: the engine's URL and the error.
    pub detail: String,
    /// For the client instead of `detail` under `hide_engine_urls`: the engine's id and the
    /// kind of failure (an error's text may hold addresses).
    pub public: Option<String>,
    /// The engine's `x-kvmesh-engine` value: the router's own error names the engine whose
    /// failure it reports, as a passed-on answer does.
    pub engine: HeaderValue,
}

/// What one attempt produced.
pub(super) enum Sent {
    /// A response to pass to the client (2xx, or a 4xx that is the client's fault), tracked
    /// to the end of its body.
    Answer(Response<Body>),
    /// A failure worth retrying elsewhere; the attempt awaits its accounting.
    Failed(Failed, Attempt),
}

/// An engine's error answer (a failure, 5xx or 429) is read whole to be passed on if it is
/// the last: at most this many bytes...
pub(super) const ERROR_BODY_MAX: usize = 64 * 1024;
/// ...within this long.
pub(super) const ERROR_BODY_WAIT: Duration = Duration::from_secs(5);

pub(super) fn failed(kind: FailKind, detail: String, attempt: Attempt) -> Sent {
    Sent::Failed(
        Failed {
            kind,
            answer: None,
            detail,
            public: None,
            engine: attempt.engine().header_value.clone(),
        },
        attempt,
    )
}

/// Why an engine's answer, though well-formed HTTP, answers no completion, if it does not:
/// such an attempt failed and another engine is tried.
/// - A 1xx: hyper skips interim answers but hands on a 101, the end of HTTP on that
///   connection, which no request of the router asks for (QA29: it reached the client).
/// - A 3xx: no completion is a redirect or a "not modified" (QA31: a 302 sent the OpenAI
///   client off to the engine's `location`, a 304 reached it as an error).
/// - A transfer coding other than chunked: hyper takes the chunks off and leaves the rest,
///   which the router does not decode, and the hop-by-hop header that named it is not passed
///   on (QA31: gzip reached the client as its JSON).
pub(super) fn no_answer(resp: &Response<UpstreamBody>) -> Option<String> {
    let status = resp.status();
    if status.is_informational() || status.is_redirection() {
        return Some(format!("a {status} where an answer was due"));
    }
    let other = kvmesh_http::coding_besides_chunked(resp.headers())?;
    Some(format!(
        "an answer in a transfer coding the router does not decode ({})",
        String::from_utf8_lossy(other)
    ))
}

/// An engine's error answer (`kind`), kept to be passed on if no other engine serves: whole,
/// or not at all, and the router's own error then says why (QA: a cut or late body went out
/// as an empty JSON answer).
pub(super) async fn error_answer(
    engine: &Engine,
    kind: FailKind,
    resp: Response<UpstreamBody>,
    attempt: Attempt,
) -> Sent {
    let status = resp.status();
    let (mut p, b) = resp.into_parts();
    // Passed on, it names the engine that failed, as an answer delivered does.
    p.headers
        .insert("x-kvmesh-engine", engine.header_value.clone());
    let read = tokio::time::timeout(
        ERROR_BODY_WAIT,
        http_body_util::Limited::new(b, ERROR_BODY_MAX).collect(),
    )
    .await;
    let (answer, detail) = match read {
        Ok(Ok(c)) => (
            Some((status, p.headers, c.to_bytes())),
            format!("{}: status {status}", engine.url),
        ),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => (
            None,
            format!(
                "{}: status {status}, its body over {} KiB",
                engine.url,
                ERROR_BODY_MAX / 1024
            ),
        ),
        Ok(Err(e)) => (
            None,
            format!("{}: status {status}, its body unreadable: {e}", engine.url),
        ),
        Err(_) => (
            None,
            format!(
                "{}: status {status}, its body not whole within {ERROR_BODY_WAIT:?}",
                engine.url
            ),
        ),
    };
    Sent::Failed(
        Failed {
            kind,
            answer,
            detail,
            public: None,
            engine: engine.header_value.clone(),
        },
        attempt,
    )
}

/// The response when the attempts gave up: the last engine's own error answer (5xx/429) as
/// it was, else an OpenAI-shaped error with the core's status.
pub(super) fn give_up(g: GiveUp, last: Option<Failed>, model: &str) -> Response<Body> {
    match (g, last) {
        (
            GiveUp::BudgetExhausted { .. } | GiveUp::Exhausted { .. },
            Some(Failed {
                answer: Some((status, mut headers, b)),
                ..
            }),
        ) => {
            strip_hop_by_hop(&mut headers);
            let mut r = Response::new(kvmesh_http::full(b));
            *r.status_mut() = status;
            *r.headers_mut() = headers;
            r
        }
        (GiveUp::NoEngines, _) => error(&ApiError::unavailable(format!(
            "no engine is available for model `{model}`"
        ))),
        (GiveUp::AllRefused, _) => error(&ApiError::unavailable(format!(
            "every engine chosen for model `{model}` is refusing traffic (circuit breakers open or unhealthy)"
        ))),
        (g, f) => {
            let what = if g.status() == 504 {
                "upstream timeout"
            } else {
                "upstream failure"
            };
            let Some(f) = f else {
                return error(&ApiError::with_status(g.status(), what));
            };
            let detail = f.public.unwrap_or(f.detail);
            let mut r = error(&ApiError::with_status(
                g.status(),
                format!("{what}: {detail}"),
            ));
            r.headers_mut().insert("x-kvmesh-engine", f.engine);
            r
        }
    }
}
