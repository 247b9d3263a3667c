//! Accounting of one attempt on one engine, from sending to the end of the streamed body:
//! in-flight count (RAII: it returns to zero whatever happens), breaker permit, TTFT at the
//! first data frame, end-to-end latency and the success/failure verdict at the end.

use crate::engine::Engine;
use crate::gateway::Gateway;
use crate::upstream::{BoxError, UpstreamBody};
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use kvmesh_policy::{BreakerEvent, Permit};
use kvmesh_route::{Accounting, FailKind, StreamEnd, stream_end};
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
}

impl Attempt {
    /// Counts the attempt in flight.
    pub fn start(gw: Arc<Gateway>, engine: Arc<Engine>, permit: Permit) -> Attempt {
        engine.in_flight.fetch_add(1, Ordering::Relaxed);
        engine.metrics.requests.fetch_add(1, Ordering::Relaxed);
        let sent_us = gw.clock.now_us();
        Attempt {
            gw,
            engine,
            permit: Some(permit),
            sent_us,
            first_byte_seen: false,
        }
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
                let fleet = self.gw.registry.len();
                let may_open = self
                    .gw
                    .ejection
                    .may_eject(self.gw.registry.ejected_count(), fleet);
                match self.engine.tracker().on_failure(now, p, may_open) {
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
        }
    }

    /// Time since the attempt was sent.
    pub fn elapsed(&self) -> Duration {
        Duration::from_micros(self.gw.clock.now_us().saturating_sub(self.sent_us))
    }

    fn first_byte(&mut self) {
        if self.first_byte_seen {
            return;
        }
        self.first_byte_seen = true;
        let now = self.gw.clock.now_us();
        let ttft = now.saturating_sub(self.sent_us);
        self.engine.tracker().on_first_byte(now, ttft);
        self.engine.metrics.ttft.observe_us(ttft);
        self.gw.metrics.observe_ttft(now, ttft);
    }

    fn end(self, end: StreamEnd) {
        let (account, kind) = stream_end(end);
        self.account(account, kind);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if let Some(p) = self.permit.take() {
            // No verdict: the client went away (or the router is shutting down):
            // `stream_end(StreamEnd::ClientGone)` is a cancel.
            self.engine.tracker().on_cancel(p);
        }
        self.engine.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The engine's response body passed through frame by frame (never buffered), reporting the
/// first data frame and the end to the attempt. Dropping it (client disconnect) drops the
/// upstream body, which closes the upstream connection: the engine aborts the request.
pub struct TrackedBody {
    inner: UpstreamBody,
    attempt: Option<Attempt>,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl TrackedBody {
    /// Wraps `inner`; `total` bounds the whole attempt, counted from when it was sent.
    pub fn new(inner: UpstreamBody, attempt: Attempt, total: Duration) -> Self {
        let left = total.saturating_sub(attempt.elapsed());
        TrackedBody {
            inner,
            attempt: Some(attempt),
            deadline: Box::pin(tokio::time::sleep(left)),
        }
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
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data()
                    && let Some(a) = this.attempt.as_mut()
                {
                    a.first_byte();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                if let Some(a) = this.attempt.take() {
                    a.end(StreamEnd::BodyError);
                }
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                if let Some(a) = this.attempt.take() {
                    a.end(StreamEnd::Complete);
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.attempt.is_some() && this.deadline.as_mut().poll(cx).is_ready() {
                    if let Some(a) = this.attempt.take() {
                        a.end(StreamEnd::TotalTimeout);
                    }
                    return Poll::Ready(Some(Err("the request exceeded the total timeout".into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // Never claim the end before the inner body said so: the verdict is taken there.
        self.attempt.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
