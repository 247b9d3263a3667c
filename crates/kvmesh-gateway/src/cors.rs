//! Requests from web pages of other origins (CORS, `serve.cors_allowed_origins`): a browser
//! asks first with an `OPTIONS` preflight and reads an answer only when it names the page's
//! origin. vLLM and SGLang answer them (vLLM allows every origin by default); a router in
//! front that did not would break a browser client that worked against the engine. Off
//! unless origins are configured: the router then answers `OPTIONS` with its `Allow` header
//! only, and adds nothing to other answers.

use http::header::{self, HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use kvmesh_http::Body;

/// How long a browser may keep a preflight's answer, s.
const MAX_AGE_S: &str = "600";
/// The longest `Access-Control-Request-Headers` echoed back.
const REQUEST_HEADERS_MAX: usize = 1024;

/// The origins allowed, from the config.
#[derive(Debug)]
pub struct Cors {
    /// `*` is among them: any origin, answered with `*`.
    any: bool,
    /// Each as a browser sends it (`scheme://host[:port]`), lower case.
    origins: Vec<String>,
    /// The response headers a page may read: the request id's, the engine's.
    expose: HeaderValue,
}

impl Cors {
    /// From `serve.cors_allowed_origins` (validated by the config); `None` when empty.
    pub fn new(origins: &[String], request_id: Option<&header::HeaderName>) -> Option<Cors> {
        if origins.is_empty() {
            return None;
        }
        let mut expose = String::from("x-kvmesh-engine");
        if let Some(n) = request_id {
            expose = format!("{n}, {expose}");
        }
        Some(Cors {
            any: origins.iter().any(|o| o == "*"),
            origins: origins
                .iter()
                .filter(|o| *o != "*")
                .map(|o| o.to_ascii_lowercase())
                .collect(),
            expose: HeaderValue::from_str(&expose)
                .unwrap_or_else(|_| HeaderValue::from_static("x-kvmesh-engine")),
        })
    }

    /// What `Access-Control-Allow-Origin` says to a request from `origin`, if it is allowed.
    fn allow(&self, origin: &HeaderValue) -> Option<HeaderValue> {
        if self.any {
            return Some(HeaderValue::from_static("*"));
        }
        let o = origin.to_str().ok()?;
        self.origins
            .iter()
            .any(|a| a.eq_ignore_ascii_case(o))
            .then(|| origin.clone())
    }

    /// Adds to `resp` what lets the page of `origin` read it (nothing when not allowed).
    pub fn decorate(&self, origin: &HeaderValue, resp: &mut Response<Body>) {
        let Some(allow) = self.allow(origin) else {
            return;
        };
        let h = resp.headers_mut();
        if !self.any {
            h.append(header::VARY, HeaderValue::from_static("origin"));
        }
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, self.expose.clone());
    }

    /// A preflight's answer (204) for a path that takes `allow`, when its origin is allowed
    /// and it is one (`Access-Control-Request-Method`); else `None`.
    fn preflight(&self, headers: &HeaderMap, allow: &'static str) -> Option<Response<Body>> {
        let origin = headers.get(header::ORIGIN)?;
        headers.get(header::ACCESS_CONTROL_REQUEST_METHOD)?;
        let allow_origin = self.allow(origin)?;
        let mut r = no_content(allow);
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow_origin);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(allow),
        );
        if let Some(asked) = headers
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .filter(|v| v.len() <= REQUEST_HEADERS_MAX)
        {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
        }
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static(MAX_AGE_S),
        );
        h.insert(
            header::VARY,
            HeaderValue::from_static(
                "origin, access-control-request-method, access-control-request-headers",
            ),
        );
        Some(r)
    }
}

/// 204 with the methods `path` takes (`Allow`, RFC 9110 §9.3.7).
fn no_content(allow: &'static str) -> Response<Body> {
    let mut r = kvmesh_http::ok_empty();
    *r.status_mut() = StatusCode::NO_CONTENT;
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// The methods each of the router's paths takes (`OPTIONS` among them); `None`: no such path.
pub fn methods_of(path: &str) -> Option<&'static str> {
    Some(match path {
        "/v1/chat/completions" | "/v1/completions" => "POST, OPTIONS",
        "/admin/engines" => "GET, POST, PATCH, DELETE, OPTIONS",
        "/v1/models" | "/health" | "/metrics" | "/admin/cluster" | "/" | "/status.json" => {
            "GET, HEAD, OPTIONS"
        }
        p if p.starts_with("/v1/models/") => "GET, HEAD, OPTIONS",
        // The server's own (RFC 9110 §9.3.7): every method some path takes.
        "*" => "GET, HEAD, POST, PATCH, DELETE, OPTIONS",
        _ => return None,
    })
}

/// The answer to `OPTIONS` on `path` (one of the router's, see [`methods_of`]): a preflight's
/// when CORS allows it, else 204 with `Allow`.
pub fn options(cors: Option<&Cors>, headers: &HeaderMap, allow: &'static str) -> Response<Body> {
    cors.and_then(|c| c.preflight(headers, allow))
        .unwrap_or_else(|| no_content(allow))
}
