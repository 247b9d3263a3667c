//! ZMQ subscriber and replay client for vLLM KV-event streams.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::decode::{DecodeLimits, FrameError, KvFrame, decode_frame, parse_seq};
use crate::publisher::{END_SEQ, TransportError};

/// Default bound on connection establishment.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors from [`Subscriber::recv`].
#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    /// One message was malformed; the stream itself is fine, keep receiving.
    #[error("malformed kv-events message: {0}")]
    Frame(#[from] FrameError),
    /// The socket failed.
    #[error("zmq receive failed: {0}")]
    Transport(#[from] zeromq::ZmqError),
}

/// A SUB socket decoding vLLM KV-event messages.
pub struct Subscriber {
    sock: SubSocket,
    limits: DecodeLimits,
    endpoint: String,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl Subscriber {
    /// Subscribes to `topic` (a ZMQ prefix filter; `""` receives everything)
    /// and connects to a publisher, with default limits and connect timeout.
    pub async fn connect(endpoint: &str, topic: &str) -> Result<Subscriber, TransportError> {
        Self::connect_with(
            endpoint,
            topic,
            DecodeLimits::default(),
            DEFAULT_CONNECT_TIMEOUT,
        )
        .await
    }

    /// Like [`connect`](Subscriber::connect) with explicit limits and timeout.
    /// The connection is established when this returns, but the publisher may
    /// still need a moment to register the subscription (ZMQ slow joiner).
    pub async fn connect_with(
        endpoint: &str,
        topic: &str,
        limits: DecodeLimits,
        connect_timeout: Duration,
    ) -> Result<Subscriber, TransportError> {
        let mut opts = SocketOptions::default();
        opts.connect_timeout(connect_timeout);
        let mut sock = SubSocket::with_options(opts);
        let zerr = |source| TransportError::Zmq {
            endpoint: endpoint.to_string(),
            source,
        };
        // Subscribing first makes the socket send the subscription as soon
        // as the connection is up.
        sock.subscribe(topic).await.map_err(zerr)?;
        tokio::time::timeout(connect_timeout, sock.connect(endpoint))
            .await
            .map_err(|_| TransportError::Timeout(connect_timeout))?
            .map_err(zerr)?;
        Ok(Subscriber {
            sock,
            limits,
            endpoint: endpoint.to_string(),
        })
    }

    pub fn limits(&self) -> &DecodeLimits {
        &self.limits
    }

    pub fn set_limits(&mut self, limits: DecodeLimits) {
        self.limits = limits;
    }

    /// Receives and decodes the next message.
    pub async fn recv(&mut self) -> Result<KvFrame, RecvError> {
        let msg = self.sock.recv().await?;
        let frames = msg.into_vec();
        Ok(decode_frame(&frames, &self.limits)?)
    }

    /// [`recv`](Subscriber::recv) bounded by `timeout`; `Ok(None)` on timeout.
    pub async fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<KvFrame>, RecvError> {
        match tokio::time::timeout(timeout, self.recv()).await {
            Ok(r) => r.map(Some),
            Err(_) => Ok(None),
        }
    }
}

/// One batch returned by the replay socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayedBatch {
    pub seq: u64,
    /// Present when the publisher uses the `[topic, seq, payload]` framing.
    pub topic: Option<Bytes>,
    pub payload: Bytes,
}

/// Most batches accepted from one replay (vLLM keeps 10,000 by default).
pub const MAX_REPLAY_BATCHES: usize = 1_000_000;

/// Asks a vLLM-style replay socket (ROUTER) for every buffered batch with
/// seq ≥ `start_seq`. Sends `["", start_seq as 8-byte BE]` from a DEALER (the
/// envelope a REQ socket would produce, which vLLM requires) and reads replies
/// until the end marker (seq = -1). Accepts both reply framings
/// (`[topic, seq, payload]` and legacy `[seq, payload]`). The whole exchange,
/// connection included, is bounded by `timeout`.
pub async fn replay(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Vec<ReplayedBatch>, TransportError> {
    match replay_at_most(endpoint, start_seq, MAX_REPLAY_BATCHES, timeout).await? {
        (out, true) => Ok(out),
        (_, false) => Err(TransportError::Protocol("replay too long".into())),
    }
}

/// [`replay`], reading at most `max_batches` batches: past them the exchange is dropped (the
/// socket closed, the rest unread) and the batches read so far come back with `false` (not
/// complete); `true` when the end marker came. A router asks an engine with a long history
/// (vLLM buffers 10,000 batches) for no more than it will use.
pub async fn replay_at_most(
    endpoint: &str,
    start_seq: u64,
    max_batches: usize,
    timeout: Duration,
) -> Result<(Vec<ReplayedBatch>, bool), TransportError> {
    let mut opts = SocketOptions::default();
    opts.connect_timeout(timeout);
    let mut sock = DealerSocket::with_options(opts);
    let zerr = |source| TransportError::Zmq {
        endpoint: endpoint.to_string(),
        source,
    };
    let exchange = async {
        sock.connect(endpoint).await.map_err(zerr)?;
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&start_seq.to_be_bytes()),
        ])
        .map_err(|_| TransportError::Protocol("empty request".into()))?;
        sock.send(request).await.map_err(zerr)?;
        let mut out = Vec::new();
        loop {
            let frames = sock.recv().await.map_err(zerr)?.into_vec();
            let parts = match frames.split_first() {
                Some((first, rest)) if first.is_empty() => rest,
                _ => frames.as_slice(),
            };
            let (topic, seq, payload) = match parts {
                [topic, seq, payload] => (Some(topic.clone()), seq, payload),
                [seq, payload] => (None, seq, payload),
                other => {
                    return Err(TransportError::Protocol(format!(
                        "replay reply with {} frames",
                        other.len()
                    )));
                }
            };
            if seq.as_ref() == END_SEQ {
                return Ok((out, true));
            }
            let seq = parse_seq(seq).map_err(|e| TransportError::Protocol(e.to_string()))?;
            if out.len() >= max_batches {
                return Ok((out, false));
            }
            out.push(ReplayedBatch {
                seq,
                topic,
                payload: payload.clone(),
            });
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| TransportError::Timeout(timeout))?
}
