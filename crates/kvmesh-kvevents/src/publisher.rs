//! ZMQ publisher compatible with vLLM's `ZmqEventPublisher`.
//!
//! Layout: callers encode on their own thread and hand `(seq, payload)` to a
//! publisher task over a bounded channel (no lock is ever held across an
//! await). The publisher task owns the PUB socket and the replay ring; a
//! second task owns the ROUTER replay socket and answers replay requests from
//! a snapshot of the ring.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqError, ZmqMessage};

use crate::encode::encode_batch;
use crate::types::{EventBatch, WireEncoding};

/// Seq value of the replay end marker (`(-1).to_bytes(8, "big", signed=True)`).
pub const END_SEQ: [u8; 8] = [0xff; 8];
/// vLLM's default number of batches kept for replay (`buffer_steps`).
pub const DEFAULT_BUFFER_LEN: usize = 10_000;
/// vLLM's default queue bound (`max_queue_size`).
pub const DEFAULT_QUEUE_LEN: usize = 100_000;
/// Longest time one replay request may take before it is abandoned.
pub const REPLAY_SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Framing of replay replies (after the ROUTER identity and empty delimiter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayFraming {
    /// `[topic, seq, payload]`, end marker `["", -1, ""]` (vLLM PR #45177, 2026-06).
    #[default]
    WithTopic,
    /// `[seq, payload]`, end marker `[-1, ""]` (vLLM before PR #45177).
    Legacy,
}

/// How the PUB socket attaches to its endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttachMode {
    /// Always bind (`*` is rewritten to `0.0.0.0`).
    #[default]
    Bind,
    /// Always connect (for a SUB that binds).
    Connect,
    /// vLLM's heuristic: bind if the address contains `*` or `::` or is
    /// `ipc://` / `inproc://`, otherwise connect.
    Auto,
}

/// Full publisher configuration; [`Publisher::bind`] covers the common case.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Batches kept for replay (0 disables buffering).
    pub buffer_len: usize,
    /// Bound of the channel between callers and the publisher task.
    pub queue_len: usize,
    pub attach: AttachMode,
    pub replay_framing: ReplayFraming,
}

impl PublisherConfig {
    pub fn new(endpoint: impl Into<String>) -> Self {
        PublisherConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_len: DEFAULT_BUFFER_LEN,
            queue_len: DEFAULT_QUEUE_LEN,
            attach: AttachMode::Bind,
            replay_framing: ReplayFraming::WithTopic,
        }
    }
}

/// Errors setting up sockets.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("zmq error on {endpoint}: {source}")]
    Zmq {
        endpoint: String,
        #[source]
        source: ZmqError,
    },
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Protocol(String),
}

/// Errors handing a batch to the publisher task.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    #[error("publisher queue full ({0} pending): batch not published, seq not consumed")]
    QueueFull(usize),
    #[error("publisher is shut down")]
    Closed,
}

/// Rewrites a ZMQ wildcard host (`tcp://*:5557`) to `0.0.0.0`, which is what
/// libzmq binds for `*`; the pure-Rust `zeromq` crate does not accept `*`.
pub fn normalize_bind_endpoint(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    }
}

/// vLLM's bind-or-connect heuristic (`ZmqEventPublisher._socket_setup`).
pub fn vllm_binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

enum Cmd {
    Publish {
        seq: u64,
        payload: Bytes,
        send: bool,
    },
    Reset,
    Flush(oneshot::Sender<()>),
}

type Ring = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

struct Inner {
    tx: mpsc::Sender<Cmd>,
    /// Next sequence number; the lock also orders channel sends.
    next_seq: Mutex<u64>,
    endpoint: String,
    replay_endpoint: Option<String>,
    queue_len: usize,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Cloneable handle to a running publisher. All methods except
/// [`flush`](Publisher::flush) are synchronous and never block on I/O, so an
/// engine loop can call them directly. Dropping the last clone stops the
/// tasks and closes the sockets.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.inner.endpoint)
            .field("replay_endpoint", &self.inner.replay_endpoint)
            .finish_non_exhaustive()
    }
}

fn zmq_err(endpoint: &str) -> impl FnOnce(ZmqError) -> TransportError + '_ {
    move |source| TransportError::Zmq {
        endpoint: endpoint.to_string(),
        source,
    }
}

impl Publisher {
    /// Binds a PUB socket (and optionally a ROUTER replay socket) and starts
    /// the publisher. Must be called inside a tokio runtime. Port 0 picks a
    /// free port; see [`endpoint`](Publisher::endpoint) for the result.
    pub async fn bind(
        endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: String,
        buffer_len: usize,
    ) -> Result<Publisher, TransportError> {
        let mut cfg = PublisherConfig::new(endpoint);
        cfg.replay_endpoint = replay_endpoint.map(str::to_string);
        cfg.topic = topic;
        cfg.buffer_len = buffer_len;
        Self::start(cfg).await
    }

    /// Starts a publisher from a full configuration.
    pub async fn start(cfg: PublisherConfig) -> Result<Publisher, TransportError> {
        let mut pub_sock = PubSocket::new();
        let bind = match cfg.attach {
            AttachMode::Bind => true,
            AttachMode::Connect => false,
            AttachMode::Auto => vllm_binds(&cfg.endpoint),
        };
        let endpoint = if bind {
            let ep = normalize_bind_endpoint(&cfg.endpoint);
            pub_sock.bind(&ep).await.map_err(zmq_err(&ep))?.to_string()
        } else {
            pub_sock
                .connect(&cfg.endpoint)
                .await
                .map_err(zmq_err(&cfg.endpoint))?;
            cfg.endpoint.clone()
        };

        let ring: Ring = Arc::new(Mutex::new(VecDeque::new()));
        let topic = Bytes::from(cfg.topic.clone().into_bytes());
        let mut tasks = Vec::new();
        let mut replay_ep = None;
        if let Some(rep) = &cfg.replay_endpoint {
            let ep = normalize_bind_endpoint(rep);
            let mut router = RouterSocket::new();
            let bound = router.bind(&ep).await.map_err(zmq_err(&ep))?;
            replay_ep = Some(bound.to_string());
            tasks.push(tokio::spawn(run_replay(
                router,
                ring.clone(),
                topic.clone(),
                cfg.replay_framing,
            )));
        }
        let queue_len = cfg.queue_len.max(1);
        let (tx, rx) = mpsc::channel(queue_len);
        tasks.push(tokio::spawn(run_publisher(
            pub_sock,
            rx,
            ring,
            topic,
            cfg.buffer_len,
        )));
        Ok(Publisher {
            inner: Arc::new(Inner {
                tx,
                next_seq: Mutex::new(0),
                endpoint,
                replay_endpoint: replay_ep,
                queue_len,
                tasks,
            }),
        })
    }

    /// The PUB endpoint as bound (port resolved) or connected.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    /// The bound replay endpoint, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.inner.replay_endpoint.as_deref()
    }

    /// The seq the next published batch will get.
    pub fn next_seq(&self) -> u64 {
        *lock(&self.inner.next_seq)
    }

    fn enqueue(&self, make: impl FnOnce(u64) -> Option<Cmd>) -> Result<u64, PublishError> {
        let mut next = lock(&self.inner.next_seq);
        let seq = *next;
        if let Some(cmd) = make(seq) {
            self.inner.tx.try_send(cmd).map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => PublishError::QueueFull(self.inner.queue_len),
                mpsc::error::TrySendError::Closed(_) => PublishError::Closed,
            })?;
        } else if self.inner.tx.is_closed() {
            return Err(PublishError::Closed);
        }
        *next = seq.wrapping_add(1);
        Ok(seq)
    }

    /// Encodes and publishes one batch; returns its seq. The payload is kept
    /// in the replay ring. If the queue is full the batch is rejected and the
    /// seq is not consumed.
    pub fn publish(&self, batch: &EventBatch, encoding: WireEncoding) -> Result<u64, PublishError> {
        self.publish_payload(Bytes::from(encode_batch(batch, encoding)))
    }

    /// Publishes an already-encoded payload (e.g. hostile bytes in tests).
    pub fn publish_payload(&self, payload: Bytes) -> Result<u64, PublishError> {
        self.enqueue(|seq| {
            Some(Cmd::Publish {
                seq,
                payload,
                send: true,
            })
        })
    }

    /// Fault injection: consumes a seq and keeps the batch in the replay ring
    /// but does not send it, as when the PUB socket drops it. Subscribers see
    /// a gap that replay can fill.
    pub fn publish_dropped(
        &self,
        batch: &EventBatch,
        encoding: WireEncoding,
    ) -> Result<u64, PublishError> {
        let payload = Bytes::from(encode_batch(batch, encoding));
        self.enqueue(|seq| {
            Some(Cmd::Publish {
                seq,
                payload,
                send: false,
            })
        })
    }

    /// Fault injection: consumes a seq without sending or buffering anything
    /// (a gap replay cannot fill). Returns the skipped seq.
    pub fn skip_seq(&self) -> Result<u64, PublishError> {
        self.enqueue(|_| None)
    }

    /// Simulated engine restart: the next batch gets seq 0 and the replay
    /// ring is cleared (after every batch queued before this call).
    pub fn reset_seq(&self) -> Result<(), PublishError> {
        let mut next = lock(&self.inner.next_seq);
        self.inner.tx.try_send(Cmd::Reset).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => PublishError::QueueFull(self.inner.queue_len),
            mpsc::error::TrySendError::Closed(_) => PublishError::Closed,
        })?;
        *next = 0;
        Ok(())
    }

    /// Waits until every command queued before this call reached the PUB
    /// socket and the replay ring.
    pub async fn flush(&self) -> Result<(), PublishError> {
        let (tx, rx) = oneshot::channel();
        self.inner
            .tx
            .send(Cmd::Flush(tx))
            .await
            .map_err(|_| PublishError::Closed)?;
        rx.await.map_err(|_| PublishError::Closed)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn run_publisher(
    mut sock: PubSocket,
    mut rx: mpsc::Receiver<Cmd>,
    ring: Ring,
    topic: Bytes,
    buffer_len: usize,
) {
    while let Some(cmd) = rx.recv().await {
        match cmd {
            Cmd::Publish { seq, payload, send } => {
                if send {
                    let frames = vec![
                        topic.clone(),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload.clone(),
                    ];
                    if let Ok(msg) = ZmqMessage::try_from(frames)
                        && let Err(e) = sock.send(msg).await
                    {
                        tracing::warn!(seq, error = %e, "kv-events PUB send failed");
                    }
                }
                if buffer_len > 0 {
                    let mut r = lock(&ring);
                    while r.len() >= buffer_len {
                        r.pop_front();
                    }
                    r.push_back((seq, payload));
                }
            }
            Cmd::Reset => lock(&ring).clear(),
            Cmd::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

async fn run_replay(router: RouterSocket, ring: Ring, topic: Bytes, framing: ReplayFraming) {
    let (mut send, mut recv) = router.split();
    loop {
        let msg = match recv.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "kv-events replay recv error");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let frames = msg.into_vec();
        // [identity, "", start] from REQ / DEALER-with-delimiter clients (what
        // vLLM accepts); [identity, start] from bare DEALER clients.
        let (identity, delimited, start) = match frames.as_slice() {
            [id, empty, start] if empty.is_empty() => (id.clone(), true, start.clone()),
            [id, start] => (id.clone(), false, start.clone()),
            other => {
                tracing::warn!(frames = other.len(), "invalid kv-events replay request");
                continue;
            }
        };
        if start.len() > 8 {
            tracing::warn!(len = start.len(), "invalid kv-events replay start seq");
            continue;
        }
        let start_seq = start.iter().fold(0u64, |acc, b| (acc << 8) | *b as u64);
        let snapshot: Vec<(u64, Bytes)> = lock(&ring)
            .iter()
            .filter(|(seq, _)| *seq >= start_seq)
            .cloned()
            .collect();
        let reply = |parts: Vec<Bytes>| {
            let mut frames = vec![identity.clone()];
            if delimited {
                frames.push(Bytes::new());
            }
            frames.extend(parts);
            ZmqMessage::try_from(frames).ok()
        };
        let serve = async {
            for (seq, payload) in snapshot {
                let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
                let parts = match framing {
                    ReplayFraming::WithTopic => vec![topic.clone(), seq, payload],
                    ReplayFraming::Legacy => vec![seq, payload],
                };
                if let Some(m) = reply(parts) {
                    send.send(m).await?;
                }
            }
            let end = Bytes::from_static(&END_SEQ);
            let parts = match framing {
                ReplayFraming::WithTopic => vec![Bytes::new(), end, Bytes::new()],
                ReplayFraming::Legacy => vec![end, Bytes::new()],
            };
            if let Some(m) = reply(parts) {
                send.send(m).await?;
            }
            Ok::<(), ZmqError>(())
        };
        match tokio::time::timeout(REPLAY_SEND_TIMEOUT, serve).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "kv-events replay send failed"),
            Err(_) => tracing::warn!("kv-events replay timed out"),
        }
    }
}
