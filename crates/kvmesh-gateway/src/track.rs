//! Accounting of one attempt on one engine, from sending to the end of the streamed body:
//! in-flight count (RAII: it returns to zero whatever happens), breaker permit, TTFT at the
//! first data frame, end-to-end latency and the success/failure verdict at the end.

use crate::engine::Engine;
use crate::gateway::Gateway;
use crate::sse::EventScan;
use crate::upstream::{BoxError, UpstreamBody};
use bytes::{Bytes, BytesMut};
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use kvmesh_openai::ApiError;
use kvmesh_policy::{BreakerEvent, Permit};
use kvmesh_route::{Accounting, Blame, FailKind, StreamEnd, stream_end};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

/// One attempt. Dropping it without a verdict (client gone) counts as a cancel.
pub struct Attempt {
    gw: Arc<Gateway>,
    engine: Arc<Engine>,
    permit: Option<Permit>,
    sent_us: u64,
    first_byte_seen: bool,
    /// The engine refused the client's request (a 4xx answer passed through).
    refused: bool,
    /// A head that is the whole answer was passed on (not a success's, which waits for its
    /// first data): the engine answered.
    answered_head: bool,
    /// Since when the attempt has had nothing from the engine (cluster µs): when it was sent,
    /// or when its answer's data last came (set as its body is dropped; the drop's own time
    /// when the silence was within the answer's pace).
    quiet_since_us: u64,
    /// A whole answer was asked for (no `"stream": true`): its first byte comes with its
    /// end, so it is no time to first token.
    whole: bool,
}

impl Attempt {
    /// Counts the attempt in flight (`counted`: a reservation's count on this engine was
    /// handed to it, so it is counted already; `whole`: the answer is not streamed).
    pub fn start(
        gw: Arc<Gateway>,
        engine: Arc<Engine>,
        permit: Permit,
        counted: bool,
        whole: bool,
    ) -> Attempt {
        if !counted {
            engine.begin_request();
        }
        engine.metrics.requests.fetch_add(1, Ordering::Relaxed);
        let sent_us = gw.clock.now_us();
        Attempt {
            gw,
            engine,
            permit: Some(permit),
            sent_us,
            first_byte_seen: false,
            refused: false,
            answered_head: false,
            quiet_since_us: sent_us,
            whole,
        }
    }

    /// The engine the attempt was sent to.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Ends the attempt with the core's verdict: `kind` is counted as a failed attempt of
    /// that kind (a 429 is counted but, accounted as a cancel, not held against the engine).
    pub fn account(mut self, account: Accounting, kind: Option<FailKind>) {
        if let Some(k) = kind {
            self.engine.metrics.failed(k);
        }
        let Some(p) = self.permit.take() else {
            return;
        };
        let now = self.gw.clock.now_us();
        match account {
            Accounting::Success => {
                let e2e = now.saturating_sub(self.sent_us);
                self.engine.metrics.e2e.observe_us(e2e);
                let ev = self.engine.tracker().on_success(now, p, e2e);
                if ev == Some(BreakerEvent::Closed) {
                    tracing::info!(engine = %self.engine.url, "circuit breaker closed: engine recovered");
                }
            }
            Accounting::Cancel => self.engine.tracker().on_cancel(p),
            Accounting::Failure => {
                let may_open = self.may_open();
                let ev = self.engine.tracker().on_failure(now, p, may_open);
                self.breaker_moved(ev);
            }
        }
    }

    /// Whether the ejection cap lets one more engine's breaker open (reads every engine's
    /// tracker: call it without this engine's tracker locked).
    fn may_open(&self) -> bool {
        let fleet = self.gw.registry.len();
        self.gw
            .ejection
            .may_eject(self.gw.registry.ejected_count(), fleet)
    }

    /// Counts and logs what a failure did to the breaker.
    fn breaker_moved(&self, ev: Option<BreakerEvent>) {
        match ev {
            Some(BreakerEvent::Opened { for_us }) => {
                self.engine
                    .metrics
                    .ejections
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(engine = %self.engine.url, open_ms = for_us / 1000, "circuit breaker opened");
            }
            Some(BreakerEvent::OpenSuppressed) => {
                tracing::warn!(engine = %self.engine.url, "breaker would open but too much of the fleet is ejected");
            }
            _ => {}
        }
    }

    /// Time since the attempt was sent.
    pub fn elapsed(&self) -> Duration {
        Duration::from_micros(self.gw.clock.now_us().saturating_sub(self.sent_us))
    }

    /// When it was sent (cluster µs).
    pub fn sent_us(&self) -> u64 {
        self.sent_us
    }

    /// The answer's first data reached the router (once per attempt): the engine's latency
    /// for its tracker (peak EWMA, automatic weights), and for a streamed answer its TTFT
    /// (a whole answer's first byte is its end: QA found the TTFT figures equal to e2e).
    /// The body of an answer that is not a success (a refusal, a redirect) is neither: the
    /// API server answers those without the engine stepping, so they say nothing of its
    /// latency nor that it works (QA: a hung engine refusing bad requests at once looked
    /// fast, and answering, which kept its unanswered attempts from being held against it).
    pub fn first_byte(&mut self) {
        if self.first_byte_seen {
            return;
        }
        self.first_byte_seen = true;
        if self.answered_head {
            return;
        }
        let now = self.gw.clock.now_us();
        let ttft = now.saturating_sub(self.sent_us);
        self.engine.tracker().on_first_byte(now, ttft);
        if !self.whole {
            self.engine.metrics.ttft.observe_us(ttft);
            self.gw.metrics.observe_ttft(now, ttft);
        }
    }

    /// The answer is the engine's refusal of the client's request (4xx): its end is
    /// accounted as neither success nor failure.
    pub fn refused(&mut self) {
        self.refused = true;
    }

    /// A head other than a success's was passed on as the answer (a refusal, a redirect):
    /// the engine answered, whether or not its body is read.
    pub fn answered_head(&mut self) {
        self.answered_head = true;
    }

    fn end(self, end: StreamEnd) {
        if matches!(
            end,
            StreamEnd::BodyError | StreamEnd::TotalTimeout | StreamEnd::Stalled
        ) {
            tracing::warn!(engine = %self.engine.url, ?end, "an answer broke off after it reached the client (not retried)");
        }
        if end == StreamEnd::ErrorEvent(Blame::Engine) {
            tracing::warn!(engine = %self.engine.url, "the engine's answer told of its own error after it reached the client (not retried)");
        }
        let end = match end {
            StreamEnd::Complete | StreamEnd::ErrorEvent(_) if self.refused => StreamEnd::Refused,
            e => e,
        };
        let (account, kind) = stream_end(end);
        self.account(account, kind);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if let Some(p) = self.permit.take() {
            // No verdict: the client went away (or the router is shutting down):
            // `stream_end(StreamEnd::ClientGone)` is a cancel, unless the engine had gone
            // silent on it — nothing of the answer (or nothing more of it) for a long wait in
            // which the engine answered nobody and did no work (a hung engine that passes its
            // health checks: `health.unanswered`).
            let (now, since) = (self.gw.clock.now_us(), self.quiet_since_us);
            let work = self.engine.work();
            let silent = !self.answered_head && self.engine.tracker().went_silent(now, since, work);
            if silent {
                // The ejection cap reads every engine's tracker: asked without this one's
                // locked, and only for a failure.
                let may_open = self.may_open();
                let ev = self.engine.tracker().on_failure(now, p, may_open);
                self.engine.metrics.failed(FailKind::Unanswered);
                tracing::debug!(engine = %self.engine.url, waited_ms = now.saturating_sub(since) / 1000, "the client left an attempt the engine had gone silent on");
                self.breaker_moved(ev);
            } else {
                self.engine.tracker().on_cancel(p);
            }
        }
        self.engine.end_request();
    }
}

/// Why an event stream that ended without its terminator is a broken answer.
const CUT_SHORT: &str = "the engine ended its event stream without data: [DONE]";

/// Upper bound of one coalesced write to the client.
pub const COALESCE_MAX: usize = 64 * 1024;

/// How long an engine may keep its body open after the event stream's terminator
/// (`data: [DONE]`) before the router ends the client's answer itself.
pub const AFTER_TERMINATOR: Duration = Duration::from_secs(1);

/// The engine's response body passed through as it arrives (never waiting to fill a buffer),
/// reporting the first data frame and the end to the attempt. Dropping it (client disconnect)
/// drops the upstream body, which closes the upstream connection: the engine aborts the request.
///
/// Coalescing: after a data frame, the frames the upstream body has *already* available
/// (`Ready` when polled again) are appended to it, up to [`COALESCE_MAX`] bytes, so that a
/// burst of SSE frames leaves in one write to the client. The first `Pending` ends the batch:
/// what is in hand is returned at once, so a lone frame is never held back. An error or trailers
/// met while coalescing are kept and returned on the next poll, after the data (the verdict is
/// taken when they are met).
///
/// An error after data is returned only after one `Pending`: hyper's connection writes
/// frames into its buffer and flushes it when the body is pending, and a body error closes the
/// connection without flushing. Without the pause, an engine that broke right after its first
/// frame would leave the client with nothing at all, not even the head, as though the request
/// had never been answered, while this router can no longer retry it.
pub struct TrackedBody {
    inner: UpstreamBody,
    /// The body's first frame, read before the head was passed on (see `proxy::send`):
    /// returned before anything else is polled.
    first: Option<Frame<Bytes>>,
    attempt: Option<Attempt>,
    /// When the total timeout ends the attempt; its timer is made at the first `Pending`
    /// (a body that is there at once never registers one).
    deadline_at: tokio::time::Instant,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// When the engine last sent data (read at a `Pending` after data: once per burst). At
    /// the total timeout, an engine silent for a whole stream idle timeout is the one that
    /// failed; one still sending is not (the router's budget ran out).
    last_data: tokio::time::Instant,
    /// An engine silent this long in the middle of its answer (`timeouts.stream_idle_ms`) has
    /// hung: the attempt ends there as a stall.
    idle: Duration,
    /// When the router's drain ends this answer (read at the first `Pending` after the drain
    /// began; the timer is made again to wake at it).
    cut: Option<tokio::time::Instant>,
    /// The longest wait between two bursts of data so far: this answer's own pace.
    longest_gap: Duration,
    held: Option<Held>,
    /// The upstream body returned its end (it is never polled again).
    ended: bool,
    /// Data was returned since the last `Pending`: hyper may hold it unflushed.
    unflushed: bool,
    /// The answer is an event stream whose break the client has not been told of yet: an
    /// error event goes before the error that closes the connection (an OpenAI client
    /// raises it as an API error, not as a bare connection reset).
    tell_break: bool,
    /// What was read of the answer as it passed, as an event stream: its terminator (the
    /// answer is whole there; an event stream whose body ends without it was cut short) and
    /// its error events (an answer that told of an error is not the engine's success).
    scan: EventScan,
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        // The client went away in the middle of the answer: its attempt has had nothing
        // from the engine since the last data came. A silence within this answer's own pace
        // (under 3 × its longest gap so far: a slow engine between two steps) is no sign of a
        // hang (QA: a working engine 1.7 s between tokens was held to have gone silent).
        if let Some(a) = self.attempt.as_mut()
            && a.first_byte_seen
        {
            let quiet = self.last_data.elapsed();
            a.quiet_since_us = if quiet < 3 * self.longest_gap {
                a.gw.clock.now_us()
            } else {
                let quiet = quiet.as_micros() as u64;
                a.gw.clock.now_us().saturating_sub(quiet).max(a.sent_us)
            };
        }
    }
}

/// What the caller of [`TrackedBody::new`] read of the upstream body before the head was
/// passed on.
pub enum ReadAhead {
    /// Nothing: the body is polled from its start.
    Nothing,
    /// Its first frame (its TTFT observed by the caller), returned first.
    First(Frame<Bytes>),
}

/// What the coalescing loop met after data: returned on the next poll.
enum Held {
    Frame(Frame<Bytes>),
    Error(BoxError),
}

impl TrackedBody {
    /// Wraps `inner`; `total` bounds the whole attempt, counted from when it was sent;
    /// `ahead`: what the caller read of the body already.
    /// `event_stream`: the answer is an SSE stream (its break is told as an error event).
    pub fn new(
        inner: UpstreamBody,
        attempt: Attempt,
        total: Duration,
        ahead: ReadAhead,
        event_stream: bool,
    ) -> Self {
        let left = total.saturating_sub(attempt.elapsed());
        let idle = Duration::from_millis(attempt.gw.cfg.timeouts.stream_idle_ms);
        let first = match ahead {
            ReadAhead::Nothing => None,
            ReadAhead::First(f) => Some(f),
        };
        TrackedBody {
            inner,
            first,
            attempt: Some(attempt),
            deadline_at: tokio::time::Instant::now() + left,
            deadline: None,
            last_data: tokio::time::Instant::now(),
            idle,
            cut: None,
            longest_gap: Duration::ZERO,
            held: None,
            ended: false,
            unflushed: false,
            tell_break: event_stream,
            scan: EventScan::default(),
        }
    }

    /// Ends the attempt: an answer that ended whole after an error event ends as that event
    /// says.
    fn end(&mut self, end: StreamEnd) {
        if let Some(a) = self.attempt.take() {
            if end == StreamEnd::Complete {
                self.scan.finish();
            }
            let end = match (end, self.scan.error()) {
                (StreamEnd::Complete, Some(e)) => {
                    tracing::debug!(engine = %a.engine.url, blame = ?e.blame, message = %e.message, "the engine's event stream told of an error");
                    StreamEnd::ErrorEvent(e.blame)
                }
                (end, _) => end,
            };
            a.end(end);
        }
    }

    /// The body ended: an event stream without its terminator was cut short (an OpenAI
    /// stream always ends with `data: [DONE]`), a failed attempt the client is told of.
    fn cut_short(&self) -> bool {
        self.tell_break && !self.scan.ended()
    }

    /// Polls the timer, made when missing: due at the total timeout, or, while the attempt
    /// is on, at the idle check (`idle` after the last data) or the drain's end if sooner.
    /// Whether it is due.
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> bool {
        let mut at = self.deadline_at;
        if self.attempt.is_some() {
            at = at.min(self.last_data + self.idle);
            if let Some(cut) = self.cut {
                at = at.min(cut);
            }
        }
        self.deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)))
            .as_mut()
            .poll(cx)
            .is_ready()
    }

    /// Appends to `first` what the upstream body has ready now (never waits).
    fn coalesce(&mut self, first: Bytes, cx: &mut Context<'_>) -> Bytes {
        let mut buf: Option<BytesMut> = None;
        let mut len = first.len();
        while len < COALESCE_MAX {
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(d) => {
                        if d.is_empty() {
                            continue;
                        }
                        let b = buf.get_or_insert_with(|| {
                            let mut b = BytesMut::with_capacity((len + d.len()).max(4096));
                            b.extend_from_slice(&first);
                            b
                        });
                        b.extend_from_slice(&d);
                        len = b.len();
                    }
                    Err(frame) => {
                        self.held = Some(Held::Frame(frame));
                        break;
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    self.end(StreamEnd::BodyError);
                    self.held = Some(Held::Error(e));
                    break;
                }
                Poll::Ready(None) => {
                    // The verdict is taken in `poll_frame`, which has the whole batch.
                    self.ended = true;
                    break;
                }
                Poll::Pending => break,
            }
        }
        match buf {
            Some(b) => b.freeze(),
            None => first,
        }
    }

    /// `e` now when nothing returned since the last `Pending` can be waiting in hyper's
    /// buffer; else `Pending` once (woken at once), so that hyper flushes what the client was
    /// given before the error closes the connection. An event stream is told first, with the
    /// code of `status` (504: the total timeout, 502: the engine's answer broke).
    fn error_after_flush(
        &mut self,
        e: BoxError,
        status: u16,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if std::mem::take(&mut self.tell_break) {
            let event =
                ApiError::with_status(status, format!("the answer broke off: {e}")).to_sse();
            self.held = Some(Held::Error(e));
            self.unflushed = true;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))));
        }
        if !self.unflushed {
            return Poll::Ready(Some(Err(e)));
        }
        self.unflushed = false;
        self.held = Some(Held::Error(e));
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match this.held.take() {
            Some(Held::Frame(f)) => return Poll::Ready(Some(Ok(f))),
            Some(Held::Error(e)) => return this.error_after_flush(e, 502, cx),
            None => {}
        }
        if this.ended {
            // Ended while coalescing (verdict taken): never poll a finished body again.
            return Poll::Ready(None);
        }
        let polled = match this.first.take() {
            Some(f) => Poll::Ready(Some(Ok(f))),
            None => Pin::new(&mut this.inner).poll_frame(cx),
        };
        match polled {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => {
                    if let Some(a) = this.attempt.as_mut() {
                        a.first_byte();
                    }
                    let data = this.coalesce(data, cx);
                    if this.attempt.is_some() {
                        this.scan.push(&data);
                    }
                    if this.ended && this.attempt.is_some() && this.cut_short() {
                        // The body ended in this batch without the terminator: the data goes
                        // out, then the break is told (QA31).
                        this.end(StreamEnd::BodyError);
                        this.held = Some(Held::Error(CUT_SHORT.into()));
                    }
                    // The answer is whole (the upstream body ends here, or the event stream's
                    // terminator came): the attempt ends before the client can see it, so the
                    // client's next request never finds this one still counted (one router
                    // would see one request too many; its peers would hear of the freed slot
                    // only after the next turn).
                    if this.attempt.is_some()
                        && (this.ended || this.inner.is_end_stream() || this.scan.ended())
                    {
                        this.end(StreamEnd::Complete);
                        // An engine that does not end its body after the terminator has it
                        // ended for it, soon (QA: the client waited as long as the engine
                        // held the connection, past the total timeout).
                        let grace = tokio::time::Instant::now() + AFTER_TERMINATOR;
                        if grace < this.deadline_at {
                            this.deadline_at = grace;
                            this.deadline = None;
                        }
                    }
                    this.unflushed = true;
                    Poll::Ready(Some(Ok(Frame::data(data))))
                }
                Err(frame) => Poll::Ready(Some(Ok(frame))),
            },
            Poll::Ready(Some(Err(e))) => {
                this.end(StreamEnd::BodyError);
                this.error_after_flush(e, 502, cx)
            }
            Poll::Ready(None) if this.attempt.is_some() && this.cut_short() => {
                this.ended = true;
                this.end(StreamEnd::BodyError);
                this.error_after_flush(CUT_SHORT.into(), 502, cx)
            }
            Poll::Ready(None) => {
                this.ended = true;
                this.end(StreamEnd::Complete);
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.unflushed {
                    let now = tokio::time::Instant::now();
                    this.longest_gap = this.longest_gap.max(now - this.last_data);
                    this.last_data = now;
                }
                if this.cut.is_none()
                    && let Some(cut) = this.attempt.as_ref().and_then(|a| a.gw.drain_cut())
                {
                    this.cut = Some(cut);
                    this.deadline = None;
                }
                let mut due = this.poll_timer(cx);
                if due
                    && this.attempt.is_some()
                    && this.cut.is_some_and(|c| tokio::time::Instant::now() >= c)
                {
                    // The router is stopping and its drain is over: the client is told why
                    // its answer ends here (its connection closes next), as a cancel, not the
                    // engine's failure.
                    drop(this.attempt.take());
                    let why = "the router is shutting down and its drain timeout (serve.drain_timeout_ms) ended the answer; send the request again";
                    return this.error_after_flush(why.into(), 503, cx);
                }
                if due && this.attempt.is_none() {
                    // Whole since the terminator passed: the client's answer ends here.
                    this.ended = true;
                    return Poll::Ready(None);
                }
                if due && tokio::time::Instant::now() < this.deadline_at {
                    // The idle check, not the total timeout: an engine silent for a whole
                    // stream idle timeout in the middle of its answer has hung (QA: such a
                    // stream held its client until the total timeout, 30 minutes).
                    if this.last_data.elapsed() >= this.idle {
                        this.end(StreamEnd::Stalled);
                        let why = "the engine sent nothing more for the stream idle timeout (serve.timeouts.stream_idle_ms)";
                        return this.error_after_flush(why.into(), 504, cx);
                    }
                    // Data came since the timer was set: check again from the last of it.
                    this.deadline = None;
                    due = this.poll_timer(cx);
                }
                if due && this.attempt.is_some() {
                    let (end, why) = if this.last_data.elapsed() >= this.idle {
                        (
                            StreamEnd::Stalled,
                            "the engine sent nothing more before the request's total timeout",
                        )
                    } else {
                        (
                            StreamEnd::TotalTimeout,
                            "the request exceeded the router's total timeout (serve.timeouts.total_ms)",
                        )
                    };
                    this.end(end);
                    return this.error_after_flush(why.into(), 504, cx);
                }
                this.unflushed = false;
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // Never claim the end before the inner body said so (the verdict is taken there), nor
        // while an error or trailers wait to be returned.
        self.first.is_none()
            && self.held.is_none()
            && self.attempt.is_none()
            && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        // The first frame, read already, is still to come (hyper checks the hint against the
        // engine's content-length).
        let Some(n) = self
            .first
            .as_ref()
            .and_then(Frame::data_ref)
            .map(|d| d.len() as u64)
        else {
            return inner;
        };
        let mut h = SizeHint::new();
        h.set_lower(inner.lower().saturating_add(n));
        if let Some(u) = inner.upper() {
            h.set_upper(u.saturating_add(n));
        }
        h
    }
}
