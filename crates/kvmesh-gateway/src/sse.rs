//! What the router reads of an engine's event stream as it passes through: whether the
//! answer so far ends with the stream's terminator (`data: [DONE]`), and the first error event
//! (`data: {"error": …}`) and whose error it reports. Pure and bounded: the scan keeps a
//! line's first [`HEAD`] bytes, and an error event's line (at most [`ERROR_LINE_MAX`] bytes)
//! only when there is one; the bytes themselves pass through untouched.
//!
//! SSE's rules: a line ends with LF, CRLF or CR, and the space after `data:` is optional (QA34:
//! `data:[DONE]` and CRLF line ends). An event's JSON holds no raw line end, so a line that
//! starts `data: {"error"` is an error event and nothing else.

use kvmesh_route::Blame;

/// A line's first bytes kept: enough for the terminator's line and an error event's start.
const HEAD: usize = 16;

/// An error event's line read at most this far (its JSON is parsed only when whole).
pub const ERROR_LINE_MAX: usize = 4096;

/// An error event of the answer: whose error, what it said, and whether it opened the answer
/// (no other line came before it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorEvent {
    /// Whose error, by the event's code or type.
    pub blame: Blame,
    /// Its message (at most 200 characters), or what was wrong with it.
    pub message: String,
    /// It is the answer's first line: nothing of the answer came before it.
    pub opening: bool,
}

/// The scan of one answer (see the module).
#[derive(Default)]
pub struct EventScan {
    /// The current line's first bytes.
    head: [u8; HEAD],
    head_len: usize,
    /// Bytes in the current line so far.
    line_len: usize,
    /// The current line was checked for an error event's start.
    checked: bool,
    /// The current line is an error event: its bytes from the JSON's `{` (bounded).
    capture: Option<Vec<u8>>,
    /// Bytes of the captured line were let go at the bound.
    capture_cut: bool,
    /// Lines seen that were not empty.
    lines: u64,
    /// The answer so far ends with the terminator's line and line ends.
    done: bool,
    error: Option<ErrorEvent>,
}

impl EventScan {
    /// Reads the answer's next bytes.
    pub fn push(&mut self, mut data: &[u8]) {
        while let Some(i) = memchr::memchr2(b'\n', b'\r', data) {
            self.feed(&data[..i]);
            self.end_line();
            data = &data[i + 1..];
        }
        self.feed(data);
    }

    /// The answer so far ends with the event stream's terminator line, ended (after it,
    /// nothing but line ends).
    pub fn ended(&self) -> bool {
        self.done
    }

    /// The answer's first error event, once its line is whole.
    pub fn error(&self) -> Option<&ErrorEvent> {
        self.error.as_ref()
    }

    /// The answer ended: an error event whose line was never ended is read as it is.
    pub fn finish(&mut self) {
        if self.capture.is_some() {
            self.end_line();
        }
    }

    fn feed(&mut self, part: &[u8]) {
        if part.is_empty() {
            return;
        }
        self.done = false;
        self.line_len = self.line_len.saturating_add(part.len());
        let take = part.len().min(HEAD - self.head_len);
        self.head[self.head_len..self.head_len + take].copy_from_slice(&part[..take]);
        self.head_len += take;
        if let Some(c) = self.capture.as_mut() {
            self.capture_cut |= keep(c, part);
        } else if !self.checked && self.head_len >= 14 {
            self.checked = true;
            if self.error.is_none()
                && let Some(p) = error_start(&self.head[..self.head_len])
            {
                let mut c = Vec::with_capacity(256);
                c.extend_from_slice(&self.head[p..self.head_len]);
                self.capture_cut = keep(&mut c, &part[take..]);
                self.capture = Some(c);
            }
        }
    }

    fn end_line(&mut self) {
        if self.line_len > 0 {
            let line = &self.head[..self.head_len];
            if self.line_len == self.head_len && (line == b"data: [DONE]" || line == b"data:[DONE]")
            {
                self.done = true;
            }
            if let Some(c) = self.capture.take() {
                self.error = Some(read_error(&c, !self.capture_cut, self.lines == 0));
            }
            self.lines += 1;
        }
        self.head_len = 0;
        self.line_len = 0;
        self.checked = false;
    }
}

/// Appends `part` to an error line, up to [`ERROR_LINE_MAX`] bytes; whether bytes were let go.
fn keep(c: &mut Vec<u8>, part: &[u8]) -> bool {
    let room = ERROR_LINE_MAX.saturating_sub(c.len());
    c.extend_from_slice(&part[..part.len().min(room)]);
    part.len() > room
}

/// Where an error event's JSON starts in a line's first bytes, if the line is one.
fn error_start(head: &[u8]) -> Option<usize> {
    let rest = head.strip_prefix(b"data:")?;
    let p = if rest.first() == Some(&b' ') { 6 } else { 5 };
    head[p..].starts_with(b"{\"error\"").then_some(p)
}

/// Whose error an error event's JSON reports (`whole`: its line was read to its end).
/// Its code first, a number or a string of digits as vLLM and SGLang give it (vLLM gives
/// some of its own failures 400, which are then read as the client's: never held against
/// the engine, never counted its success either); else its type as OpenAI names them. An
/// event that cannot be read is the engine's: it said it failed, and not that the client did.
fn read_error(json: &[u8], whole: bool, opening: bool) -> ErrorEvent {
    let parsed = whole
        .then(|| serde_json::from_slice::<serde_json::Value>(json).ok())
        .flatten();
    let Some(err) = parsed.as_ref().and_then(|v| v.get("error")) else {
        let why = if whole {
            "an error event that is not JSON"
        } else {
            "an error event over 4 KiB"
        };
        return ErrorEvent {
            blame: Blame::Engine,
            message: why.into(),
            opening,
        };
    };
    let code = err.get("code").and_then(|c| {
        c.as_u64()
            .or_else(|| c.as_str().and_then(|s| s.trim().parse().ok()))
    });
    let kind = err
        .get("type")
        .and_then(|t| t.as_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let blame = match code {
        Some(429) => Blame::Overloaded,
        Some(400..=499) => Blame::Client,
        Some(500..=599) => Blame::Engine,
        _ if kind.contains("rate_limit") || kind.contains("ratelimit") => Blame::Overloaded,
        _ if [
            "invalid_request",
            "badrequest",
            "notfound",
            "authentication",
            "permission",
        ]
        .iter()
        .any(|k| kind.contains(k)) =>
        {
            Blame::Client
        }
        _ => Blame::Engine,
    };
    let message = match err.get("message").and_then(|m| m.as_str()) {
        Some(m) => m.chars().take(200).collect(),
        None => err.to_string().chars().take(200).collect(),
    };
    ErrorEvent {
        blame,
        message,
        opening,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(pieces: &[&str]) -> EventScan {
        let mut s = EventScan::default();
        for p in pieces {
            s.push(p.as_bytes());
        }
        s
    }

    fn ends(pieces: &[&str]) -> bool {
        scan(pieces).ended()
    }

    #[test]
    fn the_terminator_is_found_however_the_frames_split_it() {
        assert!(ends(&["data: 1\n\ndata: [DONE]\n\n"]));
        assert!(ends(&["data: [DONE]\n\n"]));
        assert!(ends(&["data: 1\n\n", "data: [DO", "NE]\n\n"]));
        assert!(ends(&["data: 1\n\n", "d", "a", "ta: [DONE]", "\n", "\n"]));
        assert!(ends(&["data: 1\n", "\n", "data: [DONE]\n\n", ""]));
        assert!(!ends(&["data: 1\n\n"]));
        assert!(!ends(&["xdata: [DONE]\n\n"]));
        assert!(!ends(&["x", "data: [DONE]\n\n"]));
        assert!(!ends(&["data: [DONE]\n\n", "data: 2\n\n"]));
        assert!(!ends(&[]));
        // SSE's other spellings of the same line (QA34).
        assert!(ends(&["data: 1\r\n\r\ndata: [DONE]\r\n\r\n"]));
        assert!(ends(&["data: 1\n\ndata:[DONE]\n\n"]));
        assert!(ends(&["data: 1\r\rdata: [DONE]\r\r"]));
        assert!(ends(&["data:[DONE]", "\r", "\n"]));
        // A line not ended yet, or the marker inside another line.
        assert!(!ends(&["data: 1\n\ndata: [DONE]"]));
        assert!(!ends(&["data: x data: [DONE]\n\n"]));
        assert!(!ends(&["data: [DONE] x\n\n"]));
        let long = format!("{}xdata: [DONE]\n\n", "y".repeat(40));
        assert!(!ends(&[&long]));
        assert!(!ends(&["y".repeat(40).as_str(), "xdata: [DONE]\n\n"]));
        assert!(ends(&["y".repeat(40).as_str(), "\ndata: [DONE]\n\n"]));
    }

    const CHUNK: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";

    fn blame_of(event: &str) -> Option<(Blame, bool)> {
        let s = scan(&[CHUNK, event, "data: [DONE]\n\n"]);
        assert!(s.ended(), "{event}");
        s.error().map(|e| (e.blame, e.opening))
    }

    #[test]
    fn an_error_event_is_read_with_whose_error_it_is() {
        // vLLM's (a number code), SGLang's, OpenAI's and this router's own (a string code).
        let vllm = |code: u32, t: &str| {
            format!(
                "data: {{\"error\": {{\"object\": \"error\", \"message\": \"m\", \"type\": \"{t}\", \"param\": null, \"code\": {code}}}}}\n\n"
            )
        };
        assert_eq!(
            blame_of(&vllm(500, "InternalServerError")),
            Some((Blame::Engine, false))
        );
        assert_eq!(
            blame_of(&vllm(400, "BadRequestError")),
            Some((Blame::Client, false))
        );
        assert_eq!(
            blame_of(&vllm(429, "TooManyRequests")),
            Some((Blame::Overloaded, false))
        );
        let openai = |t: &str, code: &str| {
            format!(
                "data: {{\"error\":{{\"message\":\"m\",\"type\":\"{t}\",\"param\":null,\"code\":\"{code}\"}}}}\n\n"
            )
        };
        assert_eq!(
            blame_of(&openai("server_error", "internal_error")),
            Some((Blame::Engine, false))
        );
        assert_eq!(
            blame_of(&openai("invalid_request_error", "invalid_request")),
            Some((Blame::Client, false))
        );
        assert_eq!(
            blame_of(&openai("rate_limit_error", "rate_limit_exceeded")),
            Some((Blame::Overloaded, false))
        );
        assert_eq!(
            blame_of(&openai("server_error", "503")),
            Some((Blame::Engine, false))
        );
        // No space after `data:`, CRLF line ends.
        assert_eq!(
            blame_of("data:{\"error\":{\"code\":502}}\r\n\r\n"),
            Some((Blame::Engine, false))
        );
        // What cannot be read is the engine's.
        assert_eq!(
            blame_of("data: {\"error\" oops\n\n"),
            Some((Blame::Engine, false))
        );
        // Not error events: a chunk whose text says error, an error key not first.
        assert_eq!(
            blame_of("data: {\"choices\":[{\"delta\":{\"content\":\"{\\\"error\\\"\"}}]}\n\n"),
            None
        );
        assert_eq!(
            blame_of("data: {\"id\":1,\"error\":{\"code\":500}}\n\n"),
            None
        );
        assert_eq!(blame_of("xdata: {\"error\":{\"code\":500}}\n\n"), None);
    }

    #[test]
    fn an_error_event_is_found_however_the_frames_split_it() {
        let event = "data: {\"error\": {\"message\": \"engine dead\", \"code\": 500}}\n\n";
        for cut in 0..=event.len() {
            for second in [cut, (cut + 7).min(event.len())] {
                let s = scan(&[
                    &event[..cut],
                    &event[cut..second],
                    &event[second..],
                    "data: [DONE]\n\n",
                ]);
                let e = s.error().expect("found");
                assert_eq!(
                    (e.blame, e.opening, e.message.as_str()),
                    (Blame::Engine, true, "engine dead"),
                    "cut at {cut}, {second}"
                );
                assert!(s.ended());
            }
        }
    }

    #[test]
    fn the_first_error_event_is_kept_and_a_long_one_is_bounded() {
        let mut s = scan(&[
            "data: {\"error\":{\"code\":400}}\n\n",
            "data: {\"error\":{\"code\":500}}\n\n",
        ]);
        assert_eq!(s.error().map(|e| e.blame), Some(Blame::Client));
        let long = format!(
            "data: {{\"error\":{{\"code\":400,\"message\":\"{}\"}}}}\n\n",
            "x".repeat(10_000)
        );
        s = scan(&[CHUNK, &long[..5_000], &long[5_000..]]);
        let e = s.error().expect("found");
        assert_eq!((e.blame, e.opening), (Blame::Engine, false), "{e:?}");
        assert!(e.message.contains("over 4 KiB"));
        // One just under the bound is read.
        let fits = format!(
            "data: {{\"error\":{{\"code\":400,\"message\":\"{}\"}}}}\n\n",
            "x".repeat(ERROR_LINE_MAX - 40)
        );
        assert_eq!(scan(&[&fits]).error().map(|e| e.blame), Some(Blame::Client));
        // A line never ended is read at the answer's end.
        s = scan(&["data: {\"error\":{\"code\":503}}"]);
        assert!(s.error().is_none());
        s.finish();
        assert_eq!(s.error().map(|e| e.blame), Some(Blame::Engine));
        assert!(!s.ended());
    }
}
