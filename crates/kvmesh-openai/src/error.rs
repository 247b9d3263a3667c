//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

use serde::Serialize;
use std::borrow::Cow;

/// An error returned to an API client. Building one never fails; [`ApiError::to_json`] renders
/// the body the OpenAI clients understand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// Machine-readable code, e.g. `model_not_found`.
    pub code: &'static str,
    /// The request parameter at fault, when there is one (a path such as
    /// `messages[0].content` for a value inside one).
    pub param: Option<Cow<'static, str>>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            code,
            param: None,
        }
    }

    /// A 400 naming the parameter at fault.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(Cow::Borrowed(param)),
            ..Self::bad_request("invalid_value", message)
        }
    }

    /// Malformed JSON or a body that does not match the request schema.
    pub fn invalid_json(detail: impl std::fmt::Display) -> Self {
        Self::bad_request("invalid_json", format!("invalid JSON body: {detail}"))
    }

    /// The body exceeds the configured limit.
    pub fn body_too_large(limit: usize) -> Self {
        ApiError {
            status: 413,
            message: format!("request body exceeds the limit of {limit} bytes"),
            kind: "invalid_request_error",
            code: "body_too_large",
            param: None,
        }
    }

    /// The client did not send its whole body in time.
    pub fn body_timeout(after: std::time::Duration) -> Self {
        ApiError {
            status: 408,
            message: format!(
                "the request body did not arrive within {} ms",
                after.as_millis()
            ),
            kind: "invalid_request_error",
            code: "request_timeout",
            param: None,
        }
    }

    /// The client closed its connection before its request's body was whole (nginx's 499):
    /// nobody reads the answer, and it is counted apart from the client's errors.
    pub fn client_closed() -> Self {
        ApiError {
            status: 499,
            message: "the client closed the connection before its request's body was whole".into(),
            kind: "invalid_request_error",
            code: "client_closed_request",
            param: None,
        }
    }

    /// The request's body is framed in a transfer coding the server does not decode (RFC
    /// 9112 §6.1: 501).
    pub fn unsupported_transfer_coding(coding: &str) -> Self {
        ApiError {
            status: 501,
            message: format!(
                "transfer-encoding {:?} is not supported: send the body chunked or with a content-length",
                clip(coding)
            ),
            kind: "invalid_request_error",
            code: "unsupported_transfer_coding",
            param: None,
        }
    }

    /// The server is at its connection limit.
    pub fn too_many_connections(limit: usize) -> Self {
        ApiError {
            status: 503,
            message: format!(
                "the server is at its connection limit ({limit} connections); retry shortly"
            ),
            kind: "server_error",
            code: "connection_limit",
            param: None,
        }
    }

    /// The named model is not served here.
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: 404,
            message: format!("The model `{}` does not exist.", clip(model)),
            kind: "invalid_request_error",
            code: "model_not_found",
            param: Some(Cow::Borrowed("model")),
        }
    }

    /// No route for this method and path.
    pub fn not_found(method: &str, path: &str) -> Self {
        ApiError {
            status: 404,
            message: format!("no route for {method} {path}"),
            kind: "invalid_request_error",
            code: "not_found",
            param: None,
        }
    }

    /// Wrong method on a known path.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        ApiError {
            status: 405,
            message: format!("method {method} is not allowed on {path}"),
            kind: "invalid_request_error",
            code: "method_not_allowed",
            param: None,
        }
    }

    /// Missing or wrong bearer token.
    pub fn unauthorized() -> Self {
        ApiError {
            status: 401,
            message: "missing or invalid bearer token".to_string(),
            kind: "authentication_error",
            code: "invalid_api_key",
            param: None,
        }
    }

    /// A server-side failure.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: 500,
            message: message.into(),
            kind: "server_error",
            code: "internal_error",
            param: None,
        }
    }

    /// Rate limited / overloaded.
    pub fn too_many_requests(message: impl Into<String>) -> Self {
        ApiError {
            status: 429,
            message: message.into(),
            kind: "rate_limit_error",
            code: "rate_limit_exceeded",
            param: None,
        }
    }

    /// The service cannot serve right now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: 503,
            message: message.into(),
            kind: "server_error",
            code: "service_unavailable",
            param: None,
        }
    }

    /// A 508: the request came back to a router it already passed through (a routing loop).
    pub fn loop_detected(message: impl Into<String>) -> Self {
        ApiError {
            status: 508,
            message: message.into(),
            kind: "server_error",
            code: "loop_detected",
            param: None,
        }
    }

    /// An error with an arbitrary status (e.g. injected faults); type and code follow the status.
    pub fn with_status(status: u16, message: impl Into<String>) -> Self {
        let (kind, code) = match status {
            429 => ("rate_limit_error", "rate_limit_exceeded"),
            401 | 403 => ("authentication_error", "forbidden"),
            400..=499 => ("invalid_request_error", "invalid_request"),
            502 => ("server_error", "upstream_error"),
            503 => ("server_error", "service_unavailable"),
            504 => ("server_error", "timeout"),
            _ => ("server_error", "internal_error"),
        };
        ApiError {
            status,
            message: message.into(),
            kind,
            code,
            param: None,
        }
    }

    /// The JSON body.
    pub fn to_json(&self) -> String {
        serde_json::to_string(&Body {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .unwrap_or_else(|_| {
            r#"{"error":{"message":"error","type":"server_error","param":null,"code":"internal_error"}}"#
                .to_string()
        })
    }

    /// The body as an SSE `data:` event, for errors after a stream has started.
    pub fn to_sse(&self) -> String {
        format!("data: {}\n\n", self.to_json())
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

/// A name the client sent, as an error message repeats it: at most 256 bytes (cut at a
/// character boundary, `…` after), so that a huge name is not sent back whole.
pub fn clip(s: &str) -> std::borrow::Cow<'_, str> {
    const MAX: usize = 256;
    if s.len() <= MAX {
        return s.into();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end]).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_is_openai() {
        let e = ApiError::model_not_found("x\"y");
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).expect("valid json");
        assert_eq!(v["error"]["message"], "The model `x\"y` does not exist.");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(e.status, 404);
    }

    #[test]
    fn a_huge_model_name_is_not_sent_back_whole() {
        let e = ApiError::model_not_found(&"é".repeat(100_000));
        assert!(e.message.len() < 300, "{}", e.message.len());
        assert!(e.message.contains("éé…`"), "{}", e.message);
        assert_eq!(clip("short"), "short");
    }

    #[test]
    fn status_mapping() {
        assert_eq!(ApiError::with_status(429, "x").kind, "rate_limit_error");
        assert_eq!(ApiError::with_status(500, "x").kind, "server_error");
        assert_eq!(
            ApiError::with_status(404, "x").kind,
            "invalid_request_error"
        );
        // A client tells a timeout and a failed engine from the router's own failure.
        let codes: Vec<&str> = [500, 502, 504]
            .map(|s| ApiError::with_status(s, "x").code)
            .into();
        assert_eq!(codes, ["internal_error", "upstream_error", "timeout"]);
    }
}
