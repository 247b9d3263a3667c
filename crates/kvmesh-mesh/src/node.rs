//! The tokio shell of one mesh node: the transport's datagrams feed the membership, its timers
//! run on tokio's clock, its packets go out as datagrams; seeds (static addresses, or a DNS
//! name re-resolved) are asked again while the node knows nobody; the live members are
//! published on a `watch`; delta payloads are handed to the program; leaving is graceful.

use crate::certs::NodeTls;
use crate::membership::{Effect, Membership, MeshId};
use crate::transport::{Class, Inbound, Transport, TransportError};
use bytes::Bytes;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

/// How a node finds the cluster.
#[derive(Debug, Clone, Default)]
pub struct Seeds {
    /// `host:port` addresses (resolved at each attempt).
    pub addrs: Vec<String>,
    /// A DNS name (`name:port`) whose addresses are all seeds, re-resolved at each attempt
    /// (a Kubernetes headless Service).
    pub dns: Option<String>,
}

/// A running mesh node.
pub struct MeshNode {
    /// The transport (send deltas with it).
    pub transport: Arc<Transport>,
    /// The live members (not this node).
    pub members: watch::Receiver<Vec<MeshId>>,
    /// This node's identity.
    pub id: MeshId,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

/// A delta batch a peer sent.
#[derive(Debug, Clone)]
pub struct DeltaIn {
    /// The peer's address.
    pub from: SocketAddr,
    /// The payload (a `kvmesh-state` envelope).
    pub payload: Bytes,
}

fn now_us(t0: tokio::time::Instant) -> u64 {
    t0.elapsed().as_micros() as u64
}

async fn resolve(seeds: &Seeds, me: SocketAddr) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for s in seeds.addrs.iter().chain(seeds.dns.iter()) {
        if let Ok(it) = tokio::net::lookup_host(s.as_str()).await {
            out.extend(it.filter(|a| *a != me));
        }
    }
    out.sort();
    out.dedup();
    out
}

impl MeshNode {
    /// Binds `listen`, starts the membership as `name` (its bump: the start time in µs, so a
    /// restart wins over the old identity) and returns the node and the receiver of the
    /// delta batches peers send.
    pub async fn start(
        name: &str,
        listen: SocketAddr,
        tls: &NodeTls,
        seeds: Seeds,
        expected_size: u32,
    ) -> Result<(MeshNode, mpsc::Receiver<DeltaIn>), TransportError> {
        let (transport, mut inbound) = Transport::bind(listen, tls, 4096)?;
        let addr = transport.local_addr()?;
        let bump = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(1);
        let id = MeshId {
            name: name.to_string(),
            addr,
            bump,
        };
        let seed = id.bump ^ u64::from(addr.port());
        let mut m = Membership::new(id.clone(), expected_size, seed);
        let (members_tx, members) = watch::channel(Vec::new());
        let (deltas_tx, deltas) = mpsc::channel(1024);
        let (stop, mut stopped) = oneshot::channel::<()>();
        let t = transport.clone();
        let task = tokio::spawn(async move {
            let t0 = tokio::time::Instant::now();
            let mut reseed = tokio::time::interval(Duration::from_secs(1));
            reseed.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let wake = m
                    .next_due()
                    .map(|d| t0 + Duration::from_micros(d))
                    .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(1));
                tokio::select! {
                    _ = &mut stopped => {
                        m.leave(now_us(t0));
                        run_effects(&t, &mut m, &members_tx).await;
                        break;
                    }
                    msg = inbound.recv() => {
                        let Some(Inbound { from, class, payload }) = msg else { break };
                        match class {
                            Class::Datagram => m.handle_data(&payload, now_us(t0)),
                            Class::Delta => {
                                let _ = deltas_tx.try_send(DeltaIn { from, payload });
                            }
                        }
                    }
                    _ = tokio::time::sleep_until(wake) => m.advance(now_us(t0)),
                    _ = reseed.tick() => {
                        if m.live().next().is_none() {
                            for s in resolve(&seeds, addr).await {
                                m.announce(s, now_us(t0));
                            }
                        }
                    }
                }
                run_effects(&t, &mut m, &members_tx).await;
            }
        });
        Ok((
            MeshNode {
                transport,
                members,
                id,
                stop: Some(stop),
                task,
            },
            deltas,
        ))
    }

    /// Leaves the cluster (the others see this node down at once) and closes the endpoint.
    pub async fn leave(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut self.task).await;
        self.transport.close().await;
    }

    /// Stops without telling anyone (a crash, for tests): the others must detect it.
    pub fn kill(self) {
        self.task.abort();
        let t = self.transport.clone();
        tokio::spawn(async move { t.close().await });
    }
}

async fn run_effects(t: &Arc<Transport>, m: &mut Membership, members: &watch::Sender<Vec<MeshId>>) {
    for e in m.take_effects() {
        match e {
            Effect::Send(to, data) => {
                // Lost packets are SWIM's business (it probes again); a peer that cannot be
                // reached is what failure detection is for.
                let t = t.clone();
                tokio::spawn(async move {
                    let _ = t.send_datagram(to, data).await;
                });
            }
            Effect::Up(_) | Effect::Down(_) => {}
        }
    }
    // Ups, downs and renames (a rejoin with a new bump) all show in the live set.
    let live: Vec<MeshId> = m.live().cloned().collect();
    members.send_if_modified(|cur| {
        if *cur == live {
            false
        } else {
            *cur = live;
            true
        }
    });
}
