//! The mesh endpoint's UDP socket, counting every datagram it receives: garbage and floods
//! included, which quinn drops before anything else sees them. Everything else is the
//! runtime's own socket.

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};

/// Datagrams and bytes the socket received, whatever they held.
#[derive(Debug, Default)]
pub struct UdpCounts {
    /// Datagrams (each segment of a coalesced receive counted).
    pub datagrams: AtomicU64,
    /// Their bytes.
    pub bytes: AtomicU64,
}

/// The runtime's socket, its receives counted.
#[derive(Debug)]
pub struct CountingSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    counts: Arc<UdpCounts>,
}

impl CountingSocket {
    /// Wraps `inner`; receives are added to `counts`.
    pub fn new(inner: Arc<dyn AsyncUdpSocket>, counts: Arc<UdpCounts>) -> Self {
        CountingSocket { inner, counts }
    }
}

/// Datagrams in one receive of `len` bytes split at `stride` (GRO), at least one.
fn segments(len: usize, stride: usize) -> u64 {
    if stride == 0 || len <= stride {
        1
    } else {
        len.div_ceil(stride) as u64
    }
}

impl AsyncUdpSocket for CountingSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let r = self.inner.poll_recv(cx, bufs, meta);
        if let Poll::Ready(Ok(n)) = &r {
            for m in meta.iter().take(*n) {
                self.counts
                    .datagrams
                    .fetch_add(segments(m.len, m.stride), Relaxed);
                self.counts.bytes.fetch_add(m.len as u64, Relaxed);
            }
        }
        r
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::segments;

    #[test]
    fn a_coalesced_receive_counts_each_datagram() {
        assert_eq!(segments(1200, 1200), 1);
        assert_eq!(segments(300, 1200), 1);
        assert_eq!(segments(0, 0), 1);
        assert_eq!(segments(3600, 1200), 3);
        assert_eq!(segments(3601, 1200), 4);
    }
}
