//! The harness of `kv_ingest_python.rs`: the Python publisher's handle, the engine's cache
//! model that gives the keys the router must hold, a router in front of the publisher, and the
//! checks of its index and counters.

use kvmesh_config::{EngineEntry, ServeConfig};
use kvmesh_gateway::{Engine, GatewayServer};
use kvmesh_prefix::{BlockKey, ExtraKeys, block_keys};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BS: usize = 16;
/// Bound on every wait for the router to catch up.
pub const WAIT: Duration = Duration::from_secs(10);
/// Pause the publisher makes at a checkpoint (the test inspects the router meanwhile).
pub const CHECKPOINT_MS: u64 = 4_000;
pub const INSTALL_HINT: &str =
    "Python packages pyzmq and msgpack are required: run scripts/install-test-deps.sh";

// ---------------------------------------------------------------------------------------------
// The Python publisher.

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn require_python() {
    let out = Command::new("python3")
        .args(["-B", "-c", "import zmq, msgpack"])
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!("{INSTALL_HINT}\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => panic!("python3 not runnable ({e}); {INSTALL_HINT}"),
    }
}

/// kv_events_pub.py running a script; killed on drop.
pub struct PyPublisher {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    script: PathBuf,
    endpoint: String,
    replay_endpoint: Option<String>,
}

impl PyPublisher {
    /// Binds on OS-chosen loopback ports (with a replay ROUTER if `replay`) and waits for one
    /// subscriber before running `steps`.
    pub fn start(steps: &[Value], replay: bool) -> PyPublisher {
        require_python();
        // Process id, time and a counter: tests starting at once may read the time alike.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let script = std::env::temp_dir().join(format!(
            "kv_ingest_script_{}_{nanos}_{n}.json",
            std::process::id()
        ));
        std::fs::write(
            &script,
            serde_json::to_vec(&json!({"encoding": "map", "steps": steps})).unwrap(),
        )
        .unwrap();
        let mut cmd = Command::new("python3");
        cmd.arg("-B")
            .arg("-u")
            .arg(repo_root().join("tests/python/kv_events_pub.py"))
            .args(["--endpoint", "tcp://127.0.0.1:*"]);
        if replay {
            cmd.args(["--replay-endpoint", "tcp://127.0.0.1:*"]);
        }
        cmd.arg("--script")
            .arg(&script)
            .args(["--wait-subscribers", "1", "--exit-on-stdin-eof"])
            .args(["--timeout", "60"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn python3 kv_events_pub.py: {e}; {INSTALL_HINT}"));
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = PyPublisher {
            child,
            stdin,
            lines,
            script,
            endpoint: String::new(),
            replay_endpoint: None,
        };
        let first = p.next_json(WAIT);
        p.endpoint = first["endpoint"]
            .as_str()
            .unwrap_or_else(|| panic!("no endpoint in {first}"))
            .to_string();
        p.replay_endpoint = first["replay_endpoint"].as_str().map(str::to_string);
        assert_eq!(p.replay_endpoint.is_some(), replay, "{first}");
        p
    }

    pub fn next_json(&self, timeout: Duration) -> Value {
        let line = self.lines.recv_timeout(timeout).unwrap_or_else(|e| {
            panic!("kv_events_pub.py: no output line within {timeout:?} ({e})")
        });
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad JSON {line:?}: {e}"))
    }

    /// Waits for the script's end; returns `next_seq`.
    pub fn wait_done(&self) -> u64 {
        let limit = WAIT + Duration::from_millis(2 * CHECKPOINT_MS);
        let v = tokio::task::block_in_place(|| self.next_json(limit));
        assert_eq!(v["done"], json!(true), "{v}");
        v["next_seq"].as_u64().expect("next_seq")
    }

    /// Closes stdin (the script exits) and waits for a clean exit.
    pub fn finish(mut self) {
        self.stdin.take();
        let deadline = Instant::now() + WAIT;
        tokio::task::block_in_place(|| {
            loop {
                if let Ok(Some(st)) = self.child.try_wait() {
                    assert!(st.success(), "kv_events_pub.py exited with {st}");
                    return;
                }
                assert!(Instant::now() < deadline, "kv_events_pub.py did not exit");
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    }
}

impl Drop for PyPublisher {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.script);
    }
}

// ---------------------------------------------------------------------------------------------
// The engine's cache as the test knows it, and the canonical batch JSON of its events.

#[derive(Clone, Debug)]
pub enum H {
    Int(u64),
    Bytes(Vec<u8>),
}

impl H {
    pub fn bytes(tag: u8, i: u8) -> H {
        H::Bytes((0..32).map(|k| tag.wrapping_mul(31) ^ i ^ k).collect())
    }

    pub fn json(&self) -> Value {
        match self {
            H::Int(v) => json!(v),
            H::Bytes(b) => {
                let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
                json!({"$bytes": hex})
            }
        }
    }

    pub fn id(&self) -> String {
        self.json().to_string()
    }
}

/// The router's key of the last block of `path` (token ids from the chain's root).
pub fn key_of(path: &[u32]) -> BlockKey {
    let mut out = Vec::new();
    block_keys(path, BS, ExtraKeys::default(), &mut out);
    assert_eq!(out.len() * BS, path.len());
    *out.last().expect("at least one block")
}

/// What the engine holds: engine hash → token ids from its chain's root to it.
#[derive(Default)]
pub struct Cache {
    next_token: u32,
    held: HashMap<String, Vec<u32>>,
    /// Paths of blocks the engine no longer holds (removed, cleared, lost in a restart).
    gone: Vec<Vec<u32>>,
}

impl Cache {
    /// `BlockStored` of fresh blocks `hashes` chained after `parent` (which the engine holds).
    pub fn store(&mut self, hashes: &[H], parent: Option<&H>, medium: Option<&str>) -> Value {
        let mut path = match parent {
            Some(p) => self.held[&p.id()].clone(),
            None => Vec::new(),
        };
        let mut tokens = Vec::new();
        for h in hashes {
            for _ in 0..BS {
                // Token ids of real vocabularies: below 2^18, never repeating in this test.
                let t = 1000 + self.next_token;
                self.next_token += 1;
                path.push(t);
                tokens.push(t);
            }
            self.held.insert(h.id(), path.clone());
        }
        json!({
            "type": "BlockStored",
            "block_hashes": hashes.iter().map(H::json).collect::<Vec<_>>(),
            "parent_block_hash": parent.map(H::json),
            "token_ids": tokens,
            "block_size": BS,
            "lora_id": null,
            "medium": medium,
            "lora_name": null,
        })
    }

    pub fn remove(&mut self, hashes: &[H]) -> Value {
        for h in hashes {
            let path = self.held.remove(&h.id()).expect("removing a held block");
            self.gone.push(path);
        }
        json!({"type": "BlockRemoved", "block_hashes": hashes.iter().map(H::json).collect::<Vec<_>>(), "medium": "GPU"})
    }

    pub fn clear(&mut self) -> Value {
        self.drop_all();
        json!({"type": "AllBlocksCleared"})
    }

    /// The engine lost everything (restart).
    pub fn drop_all(&mut self) {
        let held = std::mem::take(&mut self.held);
        self.gone.extend(held.into_values());
    }

    pub fn key(&self, h: &H) -> BlockKey {
        key_of(&self.held[&h.id()])
    }

    pub fn expected(&self) -> Vec<BlockKey> {
        self.held.values().map(|p| key_of(p)).collect()
    }

    pub fn gone_keys(&self) -> Vec<BlockKey> {
        let held = self.expected();
        self.gone
            .iter()
            .map(|p| key_of(p))
            .filter(|k| !held.contains(k))
            .collect()
    }
}

pub fn batch(ts: f64, events: Vec<Value>, enc: &str) -> Value {
    json!({"batch": {"ts": ts, "events": events, "data_parallel_rank": 0}, "encoding": enc})
}

pub fn other(enc: &str) -> &'static str {
    if enc == "array" { "map" } else { "array" }
}

// ---------------------------------------------------------------------------------------------
// The router.

/// A loopback port nothing listens on (the engine's HTTP API need not answer).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

pub async fn start_router(p: &PyPublisher) -> (GatewayServer, Arc<Engine>) {
    let cfg = ServeConfig {
        listen: "127.0.0.1:0".into(),
        engines: vec![EngineEntry {
            url: format!("http://127.0.0.1:{}", closed_port()),
            kv_events: p.endpoint.clone(),
            kv_replay: p.replay_endpoint.clone().unwrap_or_default(),
            models: vec!["m".into()],
            ..Default::default()
        }],
        ..Default::default()
    };
    assert_eq!(cfg.prefix.block_size as usize, BS);
    let server = kvmesh_gateway::start(cfg).await.expect("start router");
    let members = server.gateway.registry.members();
    assert_eq!(members.len(), 1);
    let e = members[0].clone();
    (server, e)
}

pub fn counters(e: &Engine) -> String {
    let s = &e.ingest;
    format!(
        "connected={} stale={} batches={} dropped={} malformed={} gaps={} replays_ok={} \
         replays_failed={} restarts={} epoch={} tracked={}",
        s.connected.load(Relaxed),
        s.stale.load(Relaxed),
        s.batches.load(Relaxed),
        s.dropped.load(Relaxed),
        s.malformed.load(Relaxed),
        s.gaps.load(Relaxed),
        s.replays_ok.load(Relaxed),
        s.replays_failed.load(Relaxed),
        s.restarts.load(Relaxed),
        s.epoch.load(Relaxed),
        s.tracked_blocks.load(Relaxed),
    )
}

/// The engine's index entries are exactly `expected` (all confirmed), none of `absent`.
pub fn index_is(
    server: &GatewayServer,
    e: &Engine,
    expected: &[BlockKey],
    absent: &[BlockKey],
) -> Result<(), String> {
    let gw = &server.gateway;
    let now = gw.clock.now_us();
    let idx = gw.registry.prefix.index();
    let c = idx
        .engine_counts(e.slot)
        .ok_or_else(|| "engine slot not in the index".to_string())?;
    if c.confirmed as usize != expected.len() || c.entries as usize != expected.len() {
        return Err(format!(
            "index has {} entries ({} confirmed), the engine holds {} blocks",
            c.entries,
            c.confirmed,
            expected.len()
        ));
    }
    let missing = expected
        .iter()
        .filter(|k| !idx.holds(e.slot, **k, now))
        .count();
    if missing > 0 {
        return Err(format!("{missing} held blocks missing from the index"));
    }
    let extra = absent
        .iter()
        .filter(|k| idx.holds(e.slot, **k, now))
        .count();
    if extra > 0 {
        return Err(format!(
            "{extra} blocks the engine dropped still in the index"
        ));
    }
    Ok(())
}

/// Whether the index says the engine holds every one of `keys` now.
pub fn holds_all(server: &GatewayServer, e: &Engine, keys: &[BlockKey]) -> bool {
    let now = server.gateway.clock.now_us();
    let idx = server.gateway.registry.prefix.index();
    keys.iter().all(|k| idx.holds(e.slot, *k, now))
}

/// [`holds_all`] as a [`wait_for`] condition.
pub fn present(
    server: &GatewayServer,
    e: &Engine,
    keys: &[BlockKey],
    what: &str,
) -> Result<(), String> {
    if holds_all(server, e, keys) {
        Ok(())
    } else {
        Err(format!("{what} not in the index yet"))
    }
}

/// Polls `cond` every 20 ms until it holds; panics after `WAIT` with its last complaint.
pub async fn wait_for(what: &str, e: &Engine, mut cond: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + WAIT;
    loop {
        let r = cond();
        match r {
            Ok(()) => return,
            Err(why) if Instant::now() >= deadline => {
                panic!(
                    "{what}: not reached within {WAIT:?}: {why}\n  ingest: {}",
                    counters(e)
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

pub fn batches_at_least(e: &Engine, n: u64) -> Result<(), String> {
    let b = e.ingest.batches.load(Relaxed);
    if b >= n {
        Ok(())
    } else {
        Err(format!("{b} of {n} batches applied"))
    }
}

/// The value of a per-engine gauge in the router's `/metrics` text.
pub fn metric(server: &GatewayServer, name: &str) -> f64 {
    let gw = &server.gateway;
    let page = gw.metrics.render(&gw.registry, gw.clock.now_us());
    let prefix = format!("{name}{{");
    let vals: Vec<f64> = page
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(vals.len(), 1, "{name} samples in:\n{page}");
    vals[0]
}
