//! The mesh transport: one quinn endpoint per node (one UDP socket, both directions), mutual
//! TLS 1.3 verified against the cluster CA on every connection, one connection per peer
//! reused for everything, and one QUIC primitive per traffic class:
//!
//! * **datagrams** ([`Class::Datagram`]): SWIM packets, each ≤ the path's datagram size;
//! * **unidirectional streams** ([`Class::Delta`]): a delta batch per stream, length-bounded;
//! * **datagrams** ([`Class::Load`]) too for a batch of in-flight counts small enough for
//!   one: the fastest way across (no stream to open, no task per send), and a lost one costs
//!   nothing lasting — each count is the newest version of its entry, the next change or
//!   anti-entropy repairs it.
//!
//! Every datagram starts with a byte naming its class; anything else is counted and dropped.
//! The payloads are opaque here (`kvmesh-state` envelopes carry their version and cluster id).
//! A peer without a certificate from the cluster CA never completes a handshake, so nothing it
//! sends reaches the program; bytes that are not QUIC are dropped by quinn.

use crate::certs::{NodeTls, SERVER_NAME, TlsSummary};
use crate::udp_count::{CountingSocket, UdpCounts};
use crate::warn_every::WarnEvery;
use bytes::Bytes;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint};
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// The ALPN protocol of the mesh; a node offers it with its cluster id (see [`alpn`]).
pub const ALPN: &[u8] = b"kvmesh/1";

/// The cluster id on the wire (envelopes and the handshake's ALPN): 64 bits of blake3 over
/// the configured name.
pub fn cluster_id(name: &str) -> u64 {
    let h = blake3::hash(format!("kvmesh/cluster/v1\0{name}").as_bytes());
    let mut x = [0u8; 8];
    x.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(x)
}

/// The ALPN protocol a node of `cluster_id` offers and accepts: a router of another cluster
/// (the same CA, another id) fails the handshake, so it never reaches SWIM membership, ingest
/// ownership or any state (envelopes carry the id too, and are refused on their own).
pub fn alpn(cluster_id: u64) -> Vec<u8> {
    format!("{}/{cluster_id:016x}", String::from_utf8_lossy(ALPN)).into_bytes()
}

/// The largest delta batch accepted on one stream (bytes).
pub const MAX_DELTA_BYTES: usize = 4 << 20;

/// Transport errors.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// TLS configuration.
    #[error("tls: {0}")]
    Tls(String),
    /// The socket.
    #[error("endpoint: {0}")]
    Io(#[from] std::io::Error),
    /// Connecting to a peer (unreachable, refused certificate, timeout).
    #[error("connect to {peer}: {detail}")]
    Connect {
        /// The peer.
        peer: SocketAddr,
        /// What happened.
        detail: String,
    },
    /// Sending on an established connection.
    #[error("send to {peer}: {detail}")]
    Send {
        /// The peer.
        peer: SocketAddr,
        /// What happened.
        detail: String,
    },
}

/// A traffic class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// QUIC datagrams (SWIM).
    Datagram,
    /// Unidirectional streams (delta batches).
    Delta,
    /// QUIC datagrams carrying a batch of in-flight counts (an envelope, as on a stream).
    Load,
    /// A connection with the peer was just established (no payload): after a silence long
    /// enough to close the previous one — a healed partition — the two compare states.
    Connected,
}

/// Something a peer sent.
#[derive(Debug, Clone)]
pub struct Inbound {
    /// The peer's address.
    pub from: SocketAddr,
    /// Its class.
    pub class: Class,
    /// The payload.
    pub payload: Bytes,
}

/// Counters of the transport (per class: [`CLASSES`], indexed by [`Class::index`]).
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes sent.
    pub bytes_sent: [AtomicU64; CLASSES.len()],
    /// Bytes received.
    pub bytes_received: [AtomicU64; CLASSES.len()],
    /// Messages sent.
    pub sent: [AtomicU64; CLASSES.len()],
    /// Messages received.
    pub received: [AtomicU64; CLASSES.len()],
    /// Datagrams dropped on an authenticated connection: empty, or of no known class. (UDP
    /// packets that are not QUIC, or do not decrypt, never get this far: quinn drops them;
    /// `udp` counts them among all.)
    pub dropped_datagrams: AtomicU64,
    /// Handshakes refused by TLS (a certificate from another CA, another cluster id).
    pub handshake_failures: AtomicU64,
    /// Delta streams dropped (over the size limit or broken).
    pub dropped_streams: AtomicU64,
    /// Every UDP datagram the mesh port received, garbage included.
    pub udp: Arc<UdpCounts>,
    /// Certificates taken while running ([`Transport::reload_tls`]).
    pub tls_reloads: AtomicU64,
    /// Certificate files that changed but did not load (kept the ones before), counted by
    /// the node's shell.
    pub tls_reload_failures: AtomicU64,
}

/// The traffic classes' names as counters and metrics label them, by [`Class::index`]:
/// SWIM datagrams, state on streams, in-flight counts on datagrams.
pub const CLASSES: [&str; 3] = ["swim", "state", "load"];

/// The first byte of a SWIM datagram.
const TAG_SWIM: u8 = 0;
/// The first byte of a datagram of in-flight counts.
const TAG_LOAD: u8 = 1;

impl Class {
    /// Its counters' index (see [`CLASSES`]).
    pub fn index(self) -> usize {
        match self {
            Class::Datagram | Class::Connected => 0,
            Class::Delta => 1,
            Class::Load => 2,
        }
    }
}

/// One node's endpoint and its connections.
pub struct Transport {
    endpoint: Endpoint,
    cluster_id: u64,
    /// What new connections to peers are made with (replaced by [`Transport::reload_tls`]).
    client: Mutex<quinn::ClientConfig>,
    /// What the node presents and trusts now (the trusted CAs' fingerprints among it: what
    /// a reload compares).
    summary: Mutex<TlsSummary>,
    conns: Mutex<HashMap<SocketAddr, Connection>>,
    tx: mpsc::Sender<Inbound>,
    counters: Arc<Counters>,
    /// Failed handshakes logged as warnings, at most once a minute per address.
    warned: Mutex<WarnEvery>,
}

fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(e.to_string())
}

/// A connection silent this long is closed; a handshake taking longer is given up.
const IDLE_TIMEOUT: Duration = Duration::from_secs(2);

fn configs(
    tls: &NodeTls,
    cluster_id: u64,
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), TransportError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for ca in &tls.cas {
        roots.add(ca.clone()).map_err(tls_err)?;
    }
    let roots = Arc::new(roots);
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(tls_err)?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(tls.chain.clone(), tls.key.clone_key())
        .map_err(tls_err)?;
    server.alpn_protocols = vec![alpn(cluster_id)];
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_root_certificates(roots)
        .with_client_auth_cert(tls.chain.clone(), tls.key.clone_key())
        .map_err(tls_err)?;
    client.alpn_protocols = vec![alpn(cluster_id)];
    let mut transport = quinn::TransportConfig::default();
    transport
        // A connection that heard nothing for 2 s is closed, and the next send opens a new one.
        // A connection that lived through a partition is otherwise stuck after the heal: all
        // it sent was lost, its congestion window is full and its probe timeout has doubled
        // with every probe lost, so nothing goes out until that timer fires — as late after
        // the heal as the partition lasted. Keep-alives every 400 ms keep a quiet one open.
        .max_idle_timeout(Some(IDLE_TIMEOUT.try_into().map_err(tls_err)?))
        .keep_alive_interval(Some(Duration::from_millis(400)))
        .max_concurrent_bidi_streams(64u32.into())
        .max_concurrent_uni_streams(256u32.into())
        .datagram_send_buffer_size(DATAGRAM_SEND_BUFFER);
    let transport = Arc::new(transport);
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(
        QuicServerConfig::try_from(server).map_err(tls_err)?,
    ));
    sc.transport_config(transport.clone());
    let mut cc = quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(client).map_err(tls_err)?,
    ));
    cc.transport_config(transport);
    Ok((sc, cc))
}

/// How long a closing endpoint waits for the datagrams queued on its connections (the leave)
/// to be written out.
const FLUSH_WAIT: Duration = Duration::from_millis(200);
/// quinn's datagram send buffer (its default, set explicitly so that an empty one is known).
const DATAGRAM_SEND_BUFFER: usize = 1024 * 1024;
/// How long a closing endpoint waits for its connections' closes to be delivered.
const CLOSE_WAIT: Duration = Duration::from_millis(500);

impl Transport {
    /// Binds `listen` (UDP) with the node's certificate, for peers of `cluster_id` only;
    /// returns the transport and the receiver of everything peers send (bounded: `queue`
    /// messages, then dropped).
    pub fn bind(
        listen: SocketAddr,
        tls: &NodeTls,
        cluster_id: u64,
        queue: usize,
    ) -> Result<(Arc<Transport>, mpsc::Receiver<Inbound>), TransportError> {
        let (sc, cc) = configs(tls, cluster_id)?;
        let counters = Arc::new(Counters::default());
        // quinn's own server endpoint, on a socket that counts what it receives.
        let runtime = quinn::default_runtime()
            .ok_or_else(|| std::io::Error::other("no async runtime found"))?;
        let bound = std::net::UdpSocket::bind(listen).map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {listen} (UDP): {e}"))
        })?;
        let socket = runtime.wrap_udp_socket(bound)?;
        let socket = Arc::new(CountingSocket::new(socket, counters.udp.clone()));
        let endpoint = Endpoint::new_with_abstract_socket(
            quinn::EndpointConfig::default(),
            Some(sc),
            socket,
            runtime,
        )?;
        let (tx, rx) = mpsc::channel(queue.max(1));
        let t = Arc::new(Transport {
            endpoint,
            cluster_id,
            client: Mutex::new(cc),
            summary: Mutex::new(tls.summary()),
            conns: Mutex::new(HashMap::new()),
            tx,
            counters,
            warned: Mutex::new(WarnEvery::default()),
        });
        let acceptor = t.clone();
        tokio::spawn(async move { acceptor.accept_loop().await });
        Ok((t, rx))
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.endpoint.local_addr()?)
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The node's certificate and trusted CAs now (fingerprints, end of validity).
    pub fn tls_summary(&self) -> TlsSummary {
        self.summary
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes new certificates while running (a renewed pair, a CA bundle): handshakes from
    /// now on offer the new pair and verify peers against the new CAs. When the CAs trusted
    /// changed, every open connection is closed too, so that each peer is verified against
    /// them (the next message reconnects; a peer no longer trusted cannot). Returns whether
    /// they changed. An error leaves everything as it was.
    pub fn reload_tls(&self, tls: &NodeTls) -> Result<bool, TransportError> {
        let (sc, cc) = configs(tls, self.cluster_id)?;
        self.endpoint.set_server_config(Some(sc));
        *self.client.lock().unwrap_or_else(|p| p.into_inner()) = cc;
        let summary = tls.summary();
        let changed = {
            let mut now = self.summary.lock().unwrap_or_else(|p| p.into_inner());
            let changed = now.cas_sha256 != summary.cas_sha256;
            *now = summary;
            changed
        };
        self.counters.tls_reloads.fetch_add(1, Relaxed);
        if changed {
            let conns: Vec<Connection> = self.lock().drain().map(|(_, c)| c).collect();
            for c in conns {
                c.close(0u32.into(), b"trusted CAs changed");
            }
        }
        Ok(changed)
    }

    async fn accept_loop(self: Arc<Self>) {
        while let Some(incoming) = self.endpoint.accept().await {
            let t = self.clone();
            let from = incoming.remote_address();
            tokio::spawn(async move {
                match incoming.await {
                    Ok(conn) => {
                        let peer = conn.remote_address();
                        t.lock().insert(peer, conn.clone());
                        t.connected(peer);
                        t.read_loop(conn).await;
                    }
                    Err(e) => t.handshake_failed(from, "from", &e),
                }
            });
        }
    }

    /// A handshake that failed: a refusal by TLS (a certificate from another CA, another
    /// cluster id's ALPN: a TLS alert, ours or the peer's) is counted and said as a warning
    /// at most once a minute per address (such a router retries every few hundred ms); any
    /// other end (a peer that restarted and closed its attempt, a timeout) only at debug.
    fn handshake_failed(&self, peer: SocketAddr, dir: &str, e: &quinn::ConnectionError) {
        let alert = |code: quinn::TransportErrorCode| (0x100..0x200).contains(&u64::from(code));
        let refused = match e {
            quinn::ConnectionError::TransportError(t) => alert(t.code),
            quinn::ConnectionError::ConnectionClosed(c) => alert(c.error_code),
            _ => false,
        };
        let error = e.to_string();
        if !refused {
            tracing::debug!(%peer, error, "mesh handshake {dir} a peer ended");
            return;
        }
        self.counters.handshake_failures.fetch_add(1, Relaxed);
        let warn = self
            .warned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .due(peer, std::time::Instant::now());
        if warn {
            tracing::warn!(%peer, error, "mesh handshake {dir} a peer refused by TLS (a certificate from another CA, another cluster id, or not a kvmesh node?); said at most once a minute per address");
        } else {
            tracing::debug!(%peer, error, "mesh handshake {dir} a peer refused by TLS");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Connection>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads a connection's datagrams and delta streams until it closes.
    async fn read_loop(self: Arc<Self>, conn: Connection) {
        let from = conn.remote_address();
        loop {
            tokio::select! {
                d = conn.read_datagram() => match d {
                    Ok(b) => match b.first() {
                        Some(&TAG_SWIM) => self.deliver(from, Class::Datagram, b.slice(1..)),
                        Some(&TAG_LOAD) => self.deliver(from, Class::Load, b.slice(1..)),
                        _ => {
                            self.counters.dropped_datagrams.fetch_add(1, Relaxed);
                        }
                    },
                    Err(_) => break,
                },
                s = conn.accept_uni() => match s {
                    Ok(mut recv) => {
                        let t = self.clone();
                        tokio::spawn(async move {
                            match recv.read_to_end(MAX_DELTA_BYTES).await {
                                Ok(v) => t.deliver(from, Class::Delta, Bytes::from(v)),
                                Err(e) => {
                                    t.counters.dropped_streams.fetch_add(1, Relaxed);
                                    tracing::debug!(%from, error = %e, "delta stream dropped");
                                }
                            }
                        });
                    }
                    Err(_) => break,
                },
            }
        }
        let mut conns = self.lock();
        if conns
            .get(&from)
            .is_some_and(|c| c.stable_id() == conn.stable_id())
        {
            conns.remove(&from);
        }
    }

    fn connected(&self, from: SocketAddr) {
        let _ = self.tx.try_send(Inbound {
            from,
            class: Class::Connected,
            payload: Bytes::new(),
        });
    }

    fn deliver(&self, from: SocketAddr, class: Class, payload: Bytes) {
        let c = &self.counters;
        c.received[class.index()].fetch_add(1, Relaxed);
        c.bytes_received[class.index()].fetch_add(payload.len() as u64, Relaxed);
        let _ = self.tx.try_send(Inbound {
            from,
            class,
            payload,
        });
    }

    /// The connection to `peer`: the open one, else a new one (mutual TLS; bounded).
    pub async fn connection(
        self: &Arc<Self>,
        peer: SocketAddr,
    ) -> Result<Connection, TransportError> {
        if let Some(c) = self
            .lock()
            .get(&peer)
            .filter(|c| c.close_reason().is_none())
        {
            return Ok(c.clone());
        }
        let err = |detail: String| TransportError::Connect { peer, detail };
        let client = self
            .client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let connecting = self
            .endpoint
            .connect_with(client, peer, SERVER_NAME)
            .map_err(|e| err(e.to_string()))?;
        let conn = match tokio::time::timeout(IDLE_TIMEOUT, connecting).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                self.handshake_failed(peer, "to", &e);
                return Err(err(e.to_string()));
            }
            Err(_) => return Err(err("handshake timed out".into())),
        };
        self.lock().insert(peer, conn.clone());
        self.connected(peer);
        let t = self.clone();
        let reader = conn.clone();
        tokio::spawn(async move { t.read_loop(reader).await });
        Ok(conn)
    }

    /// Sends one SWIM packet to `peer` as a datagram (dropped by QUIC if lost: SWIM retries
    /// on its own), opening the connection first if there is none.
    pub async fn send_datagram(
        self: &Arc<Self>,
        peer: SocketAddr,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        let conn = self.connection(peer).await?;
        self.datagram_on(&conn, Class::Datagram, &payload)
    }

    /// Sends `payload` of `class` ([`Class::Datagram`] or [`Class::Load`]) at once on the
    /// open connection to `peer`, without waiting for anything; `false` (nothing sent) when
    /// there is no open connection or the datagram does not fit the path (the caller sends
    /// it another way).
    pub fn datagram_now(&self, peer: SocketAddr, class: Class, payload: &[u8]) -> bool {
        let conn = self
            .lock()
            .get(&peer)
            .filter(|c| c.close_reason().is_none())
            .cloned();
        conn.is_some_and(|c| self.datagram_on(&c, class, payload).is_ok())
    }

    fn datagram_on(
        &self,
        conn: &Connection,
        class: Class,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let peer = conn.remote_address();
        let tag = match class {
            Class::Load => TAG_LOAD,
            _ => TAG_SWIM,
        };
        let fits = conn.max_datagram_size().is_some_and(|m| payload.len() < m);
        if !fits {
            return Err(TransportError::Send {
                peer,
                detail: format!("datagram of {} bytes does not fit the path", payload.len()),
            });
        }
        let mut framed = Vec::with_capacity(payload.len() + 1);
        framed.push(tag);
        framed.extend_from_slice(payload);
        conn.send_datagram(Bytes::from(framed))
            .map_err(|e| TransportError::Send {
                peer,
                detail: e.to_string(),
            })?;
        let i = class.index();
        self.counters.sent[i].fetch_add(1, Relaxed);
        self.counters.bytes_sent[i].fetch_add(payload.len() as u64, Relaxed);
        Ok(())
    }

    /// Sends one delta batch to `peer` on its own unidirectional stream (reliable, ordered
    /// within the stream).
    pub async fn send_delta(
        self: &Arc<Self>,
        peer: SocketAddr,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        self.send_stream(peer, payload).await.map(drop)
    }

    /// [`Transport::send_delta`], returning once `peer` acknowledged the whole batch (what a
    /// router leaving waits for: closing the endpoint drops what was not yet delivered).
    pub async fn send_delta_delivered(
        self: &Arc<Self>,
        peer: SocketAddr,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let s = self.send_stream(peer, payload).await?;
        match s.stopped().await {
            Ok(None) => Ok(()),
            Ok(Some(code)) => Err(TransportError::Send {
                peer,
                detail: format!("stream stopped by the peer ({code})"),
            }),
            Err(e) => Err(TransportError::Send {
                peer,
                detail: e.to_string(),
            }),
        }
    }

    async fn send_stream(
        self: &Arc<Self>,
        peer: SocketAddr,
        payload: &[u8],
    ) -> Result<quinn::SendStream, TransportError> {
        let err = |e: String| TransportError::Send { peer, detail: e };
        if payload.len() > MAX_DELTA_BYTES {
            return Err(err(format!(
                "batch of {} bytes over the limit",
                payload.len()
            )));
        }
        let conn = self.connection(peer).await?;
        let mut s = conn.open_uni().await.map_err(|e| err(e.to_string()))?;
        s.write_all(payload).await.map_err(|e| err(e.to_string()))?;
        s.finish().map_err(|e| err(e.to_string()))?;
        self.counters.sent[1].fetch_add(1, Relaxed);
        self.counters.bytes_sent[1].fetch_add(payload.len() as u64, Relaxed);
        Ok(s)
    }

    /// Closes every connection and the endpoint.
    pub async fn close(&self) {
        // The leave just sent is datagrams still queued on the connections: closing drops what
        // was not yet written to the socket (QA: 3 of 11 routers stopped with SIGTERM were
        // seen leaving only by SWIM's probes, 5–6 s later).
        let conns: Vec<Connection> = self.lock().values().cloned().collect();
        let flushed = tokio::time::Instant::now() + FLUSH_WAIT;
        while tokio::time::Instant::now() < flushed
            && conns.iter().any(|c| {
                c.close_reason().is_none() && c.datagram_send_buffer_space() < DATAGRAM_SEND_BUFFER
            })
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.endpoint.close(0u32.into(), b"leaving");
        // The closes reach live peers within a few round trips (~90 ms on loopback). A
        // handshake still open to a peer that already left (members held down are announced
        // to) would hold `wait_idle` to its timeout: a router stopped after its peers took
        // 2 s more per such peer (QA: `kvmesh up` took 0.2–6 s to stop).
        let _ = tokio::time::timeout(CLOSE_WAIT, self.endpoint.wait_idle()).await;
    }
}
