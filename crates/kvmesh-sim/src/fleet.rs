//! Several simulated engines on loopback, and the router's engine entries for them (what
//! `kvmesh up`, the benchmark harness and end-to-end tests start).

use crate::{SimError, SimServer, start};
use kvmesh_config::{EngineEntry, SimConfig};
use std::time::Duration;

/// Engines started together, with the entries a router needs to reach them.
pub struct LocalFleet {
    /// The engines, in start order.
    pub sims: Vec<SimServer>,
    /// One router entry per engine (URL, and the KV-event endpoints when they publish).
    pub entries: Vec<EngineEntry>,
}

impl LocalFleet {
    /// The engines' base URLs.
    pub fn urls(&self) -> Vec<String> {
        self.entries.iter().map(|e| e.url.clone()).collect()
    }

    /// Stops every engine (each drains for up to `drain`).
    pub async fn shutdown(self, drain: Duration) {
        for s in self.sims {
            s.shutdown(drain).await;
        }
    }
}

/// A free TCP port on 127.0.0.1 (ZMQ endpoints bind by number: the port is read from a
/// listener the OS assigned, then released; another process could take it in between).
pub fn free_loopback_port() -> Result<u16, SimError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `n` engines on 127.0.0.1 with the configs `cfg(i)` returns (its `listen` is replaced
/// by an OS-assigned port). With `kv_events`, each publishes vLLM KV events with a replay
/// socket, on OS-assigned ports, and its entry names both.
pub async fn start_fleet(
    n: usize,
    kv_events: bool,
    cfg: impl Fn(usize) -> SimConfig,
) -> Result<LocalFleet, SimError> {
    let mut fleet = LocalFleet {
        sims: Vec::with_capacity(n),
        entries: Vec::with_capacity(n),
    };
    for i in 0..n {
        let mut c = cfg(i);
        c.listen = "127.0.0.1:0".into();
        if kv_events {
            c.kv_events.endpoint = format!("tcp://127.0.0.1:{}", free_loopback_port()?);
            c.kv_events.replay_endpoint = format!("tcp://127.0.0.1:{}", free_loopback_port()?);
        }
        let s = start(c.clone()).await?;
        fleet.entries.push(EngineEntry {
            url: s.base_url(),
            kv_events: c.kv_events.endpoint.clone(),
            kv_replay: c.kv_events.replay_endpoint.clone(),
            ..EngineEntry::default()
        });
        fleet.sims.push(s);
    }
    Ok(fleet)
}
