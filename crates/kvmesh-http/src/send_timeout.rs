//! A connection whose answer cannot be written for a while is closed (nginx's `send_timeout`,
//! between two successive writes: a client that stopped reading, or reads so slowly that the
//! socket's buffer does not drain in that time): a write that stays blocked that long fails,
//! and hyper drops the connection with the response it was sending. Without it, a client
//! that stops reading holds its request, and what the router counts of it, for as long as the
//! client keeps the socket open: the router stops reading the engine once the client's socket
//! is full, so no other deadline of the request is ever looked at.

use crate::ConnCounters;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `inner` whose writes fail once one has been blocked for `limit` (reads pass through).
pub struct SendTimeout<S> {
    inner: S,
    limit: Duration,
    /// Armed when a write is blocked; disarmed by any progress (made only for a blocked
    /// write: a connection that writes at once never allocates it).
    blocked: Option<Pin<Box<Sleep>>>,
    /// Where a connection closed so is counted (once), if anywhere.
    counters: Option<Arc<ConnCounters>>,
    /// It ran out (counted and logged).
    expired: bool,
}

impl<S> SendTimeout<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, limit: Duration) -> Self {
        SendTimeout {
            inner,
            limit,
            blocked: None,
            counters: None,
            expired: false,
        }
    }

    /// Counts in `counters` the connection closed so (`send_timeouts`).
    pub fn counted(mut self, counters: Option<Arc<ConnCounters>>) -> Self {
        self.counters = counters;
        self
    }

    /// Called with a write's outcome: progress disarms the timer; `Pending` arms it, and
    /// turns into an error once it has run out.
    fn watch<T>(
        &mut self,
        polled: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.blocked = None;
            return polled;
        }
        let limit = self.limit;
        let timer = self
            .blocked
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(timer.as_mut().poll(cx));
        if !self.expired {
            self.expired = true;
            if let Some(c) = &self.counters {
                c.send_timeouts.fetch_add(1, Relaxed);
            }
            tracing::info!(
                ?limit,
                "closing a connection whose answer could not be written (send timeout)"
            );
        }
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no part of the answer could be written for {limit:?}"),
        )))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SendTimeout<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SendTimeout<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(polled, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(polled, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(polled, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_write_blocked_past_the_limit_fails_and_progress_resets_the_clock() {
        // A pipe of 64 bytes that nobody reads: the second write blocks.
        let (a, mut b) = tokio::io::duplex(64);
        let c = Arc::new(ConnCounters::default());
        let mut w = SendTimeout::new(a, Duration::from_secs(60)).counted(Some(c.clone()));
        w.write_all(&[1; 64]).await.expect("fits");
        // The reader takes some just before the limit: the write goes on, the clock restarts.
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(59)).await;
            let mut buf = [0; 32];
            b.read_exact(&mut buf).await.expect("read");
            b
        });
        let started = tokio::time::Instant::now();
        w.write_all(&[2; 32])
            .await
            .expect("progress before the limit");
        assert_eq!(started.elapsed(), Duration::from_secs(59));
        let _b = reader.await.expect("reader");
        // Then nothing more is read: the next blocked write fails after the limit.
        let started = tokio::time::Instant::now();
        let e = w
            .write_all(&[3; 64])
            .await
            .expect_err("blocked past the limit");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(60));
        assert_eq!(c.send_timeouts.load(Relaxed), 1, "counted");
        assert!(w.write_all(&[4; 1]).await.is_err());
        assert_eq!(c.send_timeouts.load(Relaxed), 1, "once per connection");
    }
}
