//! `[serve.mesh]`: how a router joins the others — its name, its UDP mesh address, the seeds,
//! the cluster id and its certificates, and how it shares state.

use crate::{ConfigError, check};
use serde::{Deserialize, Serialize};

/// The mesh of routers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshConfig {
    /// Join a mesh (false: the router runs alone, `--no-mesh`).
    pub enabled: bool,
    /// This router's name: stable across restarts, unique in the cluster; its certificate is
    /// `<tls_dir>/<node_id>.pem`.
    pub node_id: String,
    /// UDP address of the mesh (QUIC: SWIM datagrams and state streams): an IP:PORT, not a
    /// name.
    pub listen: String,
    /// Seeds, `host:port` of other routers' mesh addresses (any live one will do).
    pub seeds: Vec<String>,
    /// A DNS name (`name:port`) whose addresses are seeds, re-resolved while alone (a
    /// Kubernetes headless Service of the routers).
    pub seed_dns: String,
    /// Routers of another cluster id never change this one's state.
    pub cluster_id: String,
    /// Directory with `ca.pem` and this node's `<node_id>.pem`/`.key` (`kvmesh cert`).
    /// `ca.pem` may hold several CA certificates, each trusted (a CA rotation: README).
    pub tls_dir: String,
    /// The files in `tls_dir` are read again this often, ms, and taken when they changed,
    /// without a restart: a renewed pair is offered from the next handshake on; new trusted
    /// CAs close the open connections, so each peer is verified against them. Files that do
    /// not load, or a pair that does not verify against `ca.pem` (peers trusting the same
    /// CAs would refuse it), leave the certificates as they were (a warning, and
    /// `kvmesh_mesh_tls_reload_failures_total`). 0 = read them only at start.
    pub tls_reload_ms: u64,
    /// Load `<tls_dir>/<cert_name>.pem`/`.key` instead of `<node_id>.*` ("" = node_id):
    /// replicas whose names are not known in advance (a Kubernetes Deployment, node_id =
    /// the pod name) share one pair signed by the cluster CA.
    pub cert_name: String,
    /// Routers reading each engine's KV events, chosen by rendezvous hashing over the live
    /// routers with bounded loads (no router reads more than 1.25 times its fair share,
    /// rounded down, or its share rounded up if that is more: 4 engines over 3 routers, 2 or 3
    /// each; 8 engines over 3 routers, 5 or 6 each; with few engines an engine added or
    /// removed can move a few others, each by hand-over); they send the engine's index
    /// changes to the others (0 = every router reads every engine: small clusters). A new owner takes an engine over from a live owner
    /// (hand-over); when every owner of an engine is lost within one failure-detection time
    /// (about 5 s), the engine's map of its own block hashes is lost with them, and the new
    /// owner reads the engine afresh: with more than `prefix.replay_max_batches` batches of
    /// history it is routed approximately until its next cache reset. Raise it to survive
    /// more routers lost at once (each owner holds the engine's blocks). Give every router
    /// of a cluster the same value: each computes every engine's owners with its own, and
    /// routers that differ disagree on who reads what (`/admin/cluster` shows each router's
    /// `ingest_replicas`); while a change rolls out, an engine may have a reader more or
    /// fewer than either value gives.
    pub ingest_replicas: u32,
    /// Local changes (marks, in-flight counts, registry, feed batches) are batched and sent at
    /// most this often, ms — up to 16 routers; beyond, the period grows with the cluster
    /// (× routers / 16), so that a router's envelope rate stays bounded.
    pub flush_ms: u64,
    /// An in-flight change (a request routed or finished) is sent at once instead of
    /// waiting for the flush, as long as the router's envelopes stay under one per this many
    /// µs × routers over time (bursts of `load_burst` go back to back; past that, a change
    /// waits its turn): peers hear of a request routed or finished within the network's
    /// delay, not a flush later, and a router's envelope rate stays about 1 / this. Up to 16
    /// routers; beyond, the spacing is the flush period (each router holds a small share of
    /// the load). 0 = always with the flush.
    pub load_flush_us: u64,
    /// Envelopes in-flight changes may send back to back before `load_flush_us` spaces
    /// them (an engine ends several requests in one decode step, and their clients' next
    /// turns reach other routers together; 1 = always spaced).
    pub load_burst: u32,
    /// A router compares digests with a random peer this often and both send what differs;
    /// ingest owners announce their feeds' heads (repairs what was lost), ms.
    pub anti_entropy_ms: u64,
    /// Routers expected (sizes failure detection until the real count is known).
    pub expected_routers: u32,
    /// The mesh's thread (QUIC, SWIM, peers' counts and live marks in, this router's counts
    /// out) asks Linux for real-time scheduling (`SCHED_FIFO`) at this priority, so a count is
    /// applied and sent the moment it arrives rather than when a core is free of the busy
    /// threads: on a 2-core machine running the whole bench, the envelopes' age p99 went from
    /// ≤ 1–2 ms to ≤ 0.2 ms. Needs `CAP_SYS_NICE` (root has it; a non-root container does not
    /// get it from `capabilities.add`) or an `RLIMIT_RTPRIO` this high; refused, the thread
    /// runs at normal priority and a warning says so. Its work is bounded per message; the
    /// old marks of a repair or of a joining router's snapshot go to the router's own tasks
    /// (a join of 1M entries was ready in 0.78–0.98 s on that machine). The default of
    /// `least_request.own_bias` follows: 0 with it, 4 without. 0 = never ask. Default 1
    /// (above every normal thread, below the kernel's).
    pub realtime_priority: u8,
    /// The envelope version this router writes to its peers (it reads every version). 2: each
    /// delta and control message on its own, so that a reader skips a kind it does not know (a
    /// later build's) and applies the rest; the plants of config records, which keep routers
    /// restarted together from undoing run-time changes, go in version 2 only. 1: everything
    /// in one piece, what builds before version 2 read: set 1 while upgrading from such a
    /// build, then 2 again in a second rolling restart, as Kafka's
    /// `inter.broker.protocol.version` (README, *Upgrades*).
    pub wire_version: u8,
}

impl Default for MeshConfig {
    fn default() -> Self {
        MeshConfig {
            enabled: false,
            node_id: String::new(),
            listen: "127.0.0.1:7946".into(),
            seeds: Vec::new(),
            seed_dns: String::new(),
            cluster_id: "kvmesh".into(),
            tls_dir: String::new(),
            cert_name: String::new(),
            tls_reload_ms: 10_000,
            ingest_replicas: 2,
            flush_ms: 5,
            load_flush_us: 100,
            load_burst: 8,
            anti_entropy_ms: 1_000,
            expected_routers: 3,
            realtime_priority: 1,
            wire_version: 2,
        }
    }
}

impl MeshConfig {
    pub(crate) fn validate(&self, at: &str) -> Result<(), ConfigError> {
        check(
            self.listen.parse::<std::net::SocketAddr>().is_ok(),
            &format!("{at}.listen"),
            "must be IP:PORT",
        )?;
        check(
            (1..=10_000).contains(&self.flush_ms),
            &format!("{at}.flush_ms"),
            "must be between 1 and 10000",
        )?;
        check(
            self.load_flush_us <= 1_000_000,
            &format!("{at}.load_flush_us"),
            "must be between 0 (with the flush) and 1000000",
        )?;
        check(
            (1..=1_024).contains(&self.load_burst),
            &format!("{at}.load_burst"),
            "must be between 1 and 1024",
        )?;
        check(
            self.tls_reload_ms == 0 || (100..=86_400_000).contains(&self.tls_reload_ms),
            &format!("{at}.tls_reload_ms"),
            "must be 0 (only at start) or between 100 and 86400000",
        )?;
        check(
            (1..=2).contains(&self.wire_version),
            &format!("{at}.wire_version"),
            "must be 1 or 2",
        )?;
        check(
            self.realtime_priority <= 99,
            &format!("{at}.realtime_priority"),
            "must be between 0 (never ask) and 99",
        )?;
        check(
            (10..=600_000).contains(&self.anti_entropy_ms),
            &format!("{at}.anti_entropy_ms"),
            "must be between 10 and 600000",
        )?;
        check(
            self.ingest_replicas <= 64,
            &format!("{at}.ingest_replicas"),
            "must be between 0 (every router) and 64",
        )?;
        check(
            !self.cluster_id.is_empty(),
            &format!("{at}.cluster_id"),
            "must not be empty",
        )?;
        check(
            self.cert_name.is_empty()
                || (self.cert_name.len() <= 63
                    && self
                        .cert_name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))),
            &format!("{at}.cert_name"),
            "letters, digits, '-', '_', '.' (1-63), or \"\" for the node_id",
        )?;
        for seed in &self.seeds {
            check(
                host_port(seed),
                &format!("{at}.seeds"),
                "each seed must be HOST:PORT, e.g. 10.0.0.2:7946 or router-0.kvmesh:7946",
            )?;
        }
        check(
            self.seed_dns.is_empty() || host_port(&self.seed_dns),
            &format!("{at}.seed_dns"),
            "must be NAME:PORT, e.g. kvmesh-mesh.default.svc.cluster.local:7946",
        )?;
        if self.enabled {
            // It is the router's address in the membership: the peers send to it.
            check(
                self.listen
                    .parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| !a.ip().is_unspecified()),
                &format!("{at}.listen"),
                "must be this host's own IP:PORT, the address the other routers reach it at (not 0.0.0.0 or [::])",
            )?;
            check(
                !self.node_id.is_empty()
                    && self.node_id.len() <= 63
                    && self
                        .node_id
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')),
                &format!("{at}.node_id"),
                "a mesh node needs a name of letters, digits, '-', '_', '.' (1-63): set it here or give `kvmesh serve --node-id NAME`",
            )?;
            check(
                !self.tls_dir.is_empty(),
                &format!("{at}.tls_dir"),
                "a mesh node needs its certificates (kvmesh cert --out DIR --nodes ...): set it here or give `kvmesh serve --tls-dir DIR`",
            )?;
        }
        Ok(())
    }
}

/// Whether `s` is `HOST:PORT` (a name or an address; `[v6]:port` for IPv6) with a port 1–65535.
/// A URL (`http://host:port`, QA: accepted, then never resolved: the router ran alone) or
/// anything else with a scheme, path, user or query is not.
pub(crate) fn host_port(s: &str) -> bool {
    s.rsplit_once(':').is_some_and(|(host, port)| {
        let v6 = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
        let host_ok = match v6 {
            Some(a) => a.parse::<std::net::Ipv6Addr>().is_ok(),
            None => {
                !host.is_empty()
                    && host
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
            }
        };
        host_ok && port.parse::<u16>().is_ok_and(|p| p > 0)
    })
}
