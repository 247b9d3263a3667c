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

/// Starts `n` engines on 127.0.0.1 with the configs `cfg(i)` returns (its `listen` is replaced
/// by an OS-assigned port). With `kv_events`, each publishes vLLM KV events with a replay
/// socket, bound to OS-assigned ports (port 0: no window in which another process could take
/// a port picked in advance), and its entry names both as bound.
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
            c.kv_events.endpoint = "tcp://127.0.0.1:0".into();
            c.kv_events.replay_endpoint = "tcp://127.0.0.1:0".into();
        }
        let s = start(c).await?;
        fleet.entries.push(EngineEntry {
            url: s.base_url(),
            kv_events: s.kv_events_endpoint.clone().unwrap_or_default(),
            kv_replay: s.kv_replay_endpoint.clone().unwrap_or_default(),
            ..EngineEntry::default()
        });
        fleet.sims.push(s);
    }
    Ok(fleet)
}
