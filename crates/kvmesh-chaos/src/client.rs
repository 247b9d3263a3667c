//! The client side: a minimal blocking HTTP/1.1 client (bounded by a deadline) and the
//! workload — `concurrency` threads, each sending one chat request at a time, trying the
//! routers in turn as a DNS client with several addresses would (on a refused connection, a
//! timeout, a 5xx or a broken body it tries the next router; twice round at most, within the
//! request's deadline). Bounded in count and time.

use crate::scenario::Workload;
use crate::verdict::{Outcome, Record};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A response: status, lower-case headers, body (chunked bodies decoded).
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Why a request got no response.
#[derive(Debug, Clone, PartialEq)]
pub enum NoResp {
    /// Connection refused or reset before an answer: a clear "not here".
    Refused(String),
    /// Nothing within the time allowed.
    Timeout,
    /// Broken mid-answer.
    Broken(String),
}

/// One request with `Connection: close`, everything bounded by `timeout`.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Resp, NoResp> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&addr, timeout.min(Duration::from_secs(3))).map_err(
        |e| match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => NoResp::Timeout,
            _ => NoResp::Refused(e.kind().to_string()),
        },
    )?;
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => NoResp::Timeout,
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionRefused => {
            NoResp::Refused(e.kind().to_string())
        }
        k => NoResp::Broken(k.to_string()),
    };
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).map_err(io)?;
    s.write_all(body).map_err(io)?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(NoResp::Timeout);
        }
        s.set_read_timeout(Some(left)).map_err(io)?;
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if buf.is_empty() => return Err(io(e)),
            Err(e) => return Err(NoResp::Broken(format!("{} mid-answer", e.kind()))),
        }
    }
    parse(&buf).ok_or_else(|| {
        if buf.is_empty() {
            NoResp::Refused("closed without an answer".into())
        } else {
            NoResp::Broken("incomplete answer".into())
        }
    })
}

fn parse(buf: &[u8]) -> Option<Resp> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let raw = &buf[end + 4..];
    let h = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    let body = if h("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        dechunk(raw)?
    } else if let Some(n) = h("content-length").and_then(|v| v.parse::<usize>().ok()) {
        if raw.len() < n {
            return None;
        }
        raw[..n].to_vec()
    } else {
        raw.to_vec()
    };
    Some(Resp {
        status,
        headers,
        body,
    })
}

/// Decodes a chunked body; None when it is cut short (no final chunk).
fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = raw.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&raw[..eol]).ok()?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        raw = &raw[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        if raw.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// GET returning the body as JSON (Null on any failure).
pub fn get_json(addr: SocketAddr, path: &str) -> serde_json::Value {
    request(addr, "GET", path, b"", Duration::from_secs(3))
        .ok()
        .filter(|r| r.status == 200)
        .map_or(serde_json::Value::Null, |r| r.json())
}

/// Σ of a metric family's samples in a Prometheus text page (None when unreachable).
pub fn metric_sum(addr: SocketAddr, name: &str) -> Option<f64> {
    let r = request(addr, "GET", "/metrics", b"", Duration::from_secs(3)).ok()?;
    (r.status == 200).then(|| {
        r.text()
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    })
}

/// What the workload reads of the lab while it runs: which routers run, how many engines.
#[derive(Debug)]
pub struct Live {
    pub routers: Vec<AtomicBool>,
    pub engines: AtomicUsize,
}

impl Live {
    fn servable(&self) -> bool {
        self.engines.load(Relaxed) > 0 && self.routers.iter().any(|r| r.load(Relaxed))
    }
}

const HANDBOOK: &str = "You answer questions about one shared operations handbook: \
    escalation paths, on-call rotations, runbooks for the storage tier, and the release checklist. ";

/// The body of request `i`: conversation `i % groups` (a long system prompt of its own) and
/// a question of its own.
pub fn chat_body(i: usize, w: &Workload) -> Vec<u8> {
    let g = i % w.groups;
    serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": format!("Conversation {g}. {}", HANDBOOK.repeat(24))},
            {"role": "user", "content": format!("question {i}")},
        ],
        "max_tokens": w.max_tokens,
    })
    .to_string()
    .into_bytes()
}

/// One request, tried router after router.
pub fn send(i: usize, w: &Workload, routers: &[SocketAddr]) -> Outcome {
    let body = chat_body(i, w);
    let deadline = Instant::now() + Duration::from_secs_f64(w.deadline_s);
    let n = routers.len();
    let mut last: Option<String> = None;
    let mut clear = false;
    let mut attempts = 0;
    for pass in 0..2 {
        if pass > 0 {
            std::thread::sleep(Duration::from_millis(200));
        }
        for k in 0..n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let r = (i + k) % n;
            attempts += 1;
            let t = left.min(Duration::from_secs_f64(w.attempt_timeout_s));
            match request(routers[r], "POST", "/v1/chat/completions", &body, t) {
                Ok(resp) if resp.status == 200 => {
                    let j = resp.json();
                    let usage = &j["usage"];
                    match usage["prompt_tokens"].as_u64() {
                        Some(p) => {
                            return Outcome::Served {
                                router: r,
                                prompt_tokens: p,
                                cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                                    .as_u64()
                                    .unwrap_or(0),
                                attempts,
                            };
                        }
                        None => {
                            last = Some("200 without a complete body".into());
                            clear = true;
                        }
                    }
                }
                Ok(resp) if (400..500).contains(&resp.status) && resp.status != 429 => {
                    return Outcome::Failed {
                        reason: format!("{} {}", resp.status, resp.json()["error"]["type"]),
                    };
                }
                Ok(resp) => {
                    last = Some(format!("{} from every router", resp.status));
                    clear = true;
                }
                Err(NoResp::Refused(e)) => {
                    last = Some(format!("every router: {e}"));
                    clear = true;
                }
                Err(NoResp::Broken(e)) => {
                    last = Some(format!("broken answer: {e}"));
                    clear = true;
                }
                Err(NoResp::Timeout) => last = last.or(Some("timeout".into())),
            }
        }
    }
    match last {
        Some(reason) if clear => Outcome::Failed { reason },
        _ => Outcome::Unanswered,
    }
}

/// Runs the workload until `w.duration_s` after `t0` or `w.max_requests` requests, whichever
/// comes first (or an abort); returns every request's record.
pub fn run(w: &Workload, routers: &[SocketAddr], live: &Arc<Live>, t0: Instant) -> Vec<Record> {
    let next = Arc::new(AtomicUsize::new(0));
    let out = Arc::new(Mutex::new(Vec::new()));
    let until = t0 + Duration::from_secs_f64(w.duration_s);
    std::thread::scope(|s| {
        for _ in 0..w.concurrency {
            let (next, out, live) = (next.clone(), out.clone(), live.clone());
            s.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    if i >= w.max_requests || Instant::now() >= until || crate::aborted() {
                        return;
                    }
                    let start = Instant::now();
                    let servable = live.servable();
                    let outcome = send(i, w, routers);
                    let rec = Record {
                        start_ms: start.duration_since(t0).as_millis() as u64,
                        end_ms: t0.elapsed().as_millis() as u64,
                        outcome,
                        servable,
                    };
                    if let Ok(mut v) = out.lock() {
                        v.push(rec);
                    }
                    std::thread::sleep(Duration::from_millis(w.pause_ms));
                }
            });
        }
    });
    let mut v = std::mem::take(&mut *out.lock().unwrap_or_else(|e| e.into_inner()));
    v.sort_by_key(|r| r.start_ms);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_length_and_chunked_bodies_and_refuses_cut_ones() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"hi"[..]));
        let r = parse(
            b"HTTP/1.1 502 Bad Gateway\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (502, &b"abcde"[..]));
        assert!(
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n").is_none()
        );
        assert!(parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab").is_none());
        assert!(parse(b"HTTP/1.1 200").is_none());
    }

    #[test]
    fn a_closed_port_is_a_refusal_not_a_timeout() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap();
        // The listener is dropped: the port refuses.
        let e = request(port, "GET", "/", b"", Duration::from_secs(2)).unwrap_err();
        assert!(matches!(e, NoResp::Refused(_)), "{e:?}");
    }
}
