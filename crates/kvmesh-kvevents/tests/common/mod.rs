//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvmesh_kvevents::{BlockHash, EventBatch, KvEvent, MsgValue};
use serde_json::Value;

pub const INSTALL_HINT: &str =
    "Python packages pyzmq and msgpack are required: run scripts/install-test-deps.sh";

pub fn python_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python")
}

pub fn script(name: &str) -> PathBuf {
    python_dir().join(name)
}

/// Fails the test with an install hint when python3, pyzmq or msgpack is missing.
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

/// Runs a Python script to completion with `stdin` as input, bounded by `timeout`.
pub fn run_python(name: &str, args: &[&str], stdin: &str, timeout: Duration) -> String {
    require_python();
    let mut child = PyChild::spawn(name, args);
    if let Some(mut s) = child.stdin.take() {
        s.write_all(stdin.as_bytes()).expect("write stdin");
    }
    let mut out = String::new();
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match child.lines.recv_timeout(left) {
            Ok(line) => {
                out.push_str(&line);
                out.push('\n');
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("{name} timed out"),
        }
    }
    let status = child.wait(deadline.saturating_duration_since(Instant::now()));
    assert!(
        status == Some(0),
        "{name} exited with {status:?}; stdout:\n{out}"
    );
    out
}

/// A Python child process whose stdout lines arrive on a channel; killed on drop.
pub struct PyChild {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub lines: mpsc::Receiver<String>,
    name: String,
}

impl PyChild {
    pub fn spawn(name: &str, args: &[&str]) -> PyChild {
        let mut child = Command::new("python3")
            .arg("-B")
            .arg("-u")
            .arg(script(name))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn python3 {name}: {e}; {INSTALL_HINT}"));
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        PyChild {
            child,
            stdin,
            lines: rx,
            name: name.to_string(),
        }
    }

    /// Next stdout line parsed as JSON, or panic after `timeout`.
    pub fn next_json(&self, timeout: Duration) -> Value {
        let line = self
            .lines
            .recv_timeout(timeout)
            .unwrap_or_else(|e| panic!("{}: no output line within {timeout:?} ({e})", self.name));
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{}: bad JSON {line:?}: {e}", self.name))
    }

    /// Polls for exit until `timeout`; returns the exit code.
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }
}

impl Drop for PyChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

pub fn stored_full(hashes: Vec<BlockHash>, parent: Option<BlockHash>, block_size: u32) -> KvEvent {
    let n = hashes.len() as u32 * block_size;
    KvEvent::BlockStored {
        token_ids: (0..n).map(|t| t * 1000 + 7).collect(),
        block_hashes: hashes,
        parent_block_hash: parent,
        block_size,
        lora_id: Some(3),
        medium: Some("GPU".into()),
        lora_name: Some("adapter-a".into()),
        extra_keys: Some(vec![
            MsgValue::Array(vec![MsgValue::str("salt-1")]),
            MsgValue::Nil,
        ]),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        kv_cache_spec_sliding_window: Some(4096),
        locality: None,
        ownership: None,
    }
}

/// vLLM-shaped batches exercising every field; no map-only fields, so each
/// round-trips in both encodings.
pub fn sample_batches() -> Vec<EventBatch> {
    vec![
        EventBatch {
            ts: 1757500000.25,
            events: vec![KvEvent::stored(
                vec![BlockHash::Int(0xDEADBEEF12345678), BlockHash::Int(u64::MAX)],
                None,
                (0..32)
                    .map(|t| [0, 127, 128, 255, 256, 65535, 65536, 128255][t % 8])
                    .collect(),
                16,
            )],
            data_parallel_rank: Some(0),
        },
        EventBatch {
            ts: 1757500001.5,
            events: vec![
                stored_full(
                    vec![BlockHash::Int(11), BlockHash::Int(12)],
                    Some(BlockHash::Int(u64::MAX)),
                    2,
                ),
                KvEvent::stored(
                    vec![BlockHash::Bytes((0..32).collect())],
                    Some(BlockHash::Bytes((100..132).collect())),
                    vec![1, 2, 3, 4],
                    4,
                ),
                KvEvent::removed(vec![BlockHash::Int(0x8000000000000001), BlockHash::Int(7)]),
                KvEvent::BlockRemoved {
                    block_hashes: vec![BlockHash::Int(21)],
                    medium: Some("CPU".into()),
                    group_idx: Some(1),
                    locality: None,
                    ownership: None,
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(3),
        },
        EventBatch {
            ts: 0.0,
            events: vec![],
            data_parallel_rank: None,
        },
        EventBatch {
            ts: 1.0e-3,
            events: vec![KvEvent::AllBlocksCleared],
            data_parallel_rank: None,
        },
    ]
}

/// A batch using the map-only fields (`locality`, `ownership`).
pub fn map_only_batch() -> EventBatch {
    let mut stored = stored_full(vec![BlockHash::Int(5)], None, 1);
    if let KvEvent::BlockStored {
        locality,
        ownership,
        ..
    } = &mut stored
    {
        *locality = Some("LOCAL".into());
        *ownership = Some("tier-2".into());
    }
    EventBatch {
        ts: 42.125,
        events: vec![
            stored,
            KvEvent::BlockRemoved {
                block_hashes: vec![BlockHash::Int(5)],
                medium: None,
                group_idx: None,
                locality: Some("REMOTE".into()),
                ownership: None,
            },
        ],
        data_parallel_rank: Some(1),
    }
}

/// Distinct batch `i` of a stream, ts = 1000 + i.
pub fn stream_batch(i: u64) -> EventBatch {
    EventBatch {
        ts: 1000.0 + i as f64,
        events: vec![
            KvEvent::stored(
                vec![BlockHash::Int(i * 2 + 1), BlockHash::Int(i * 2 + 2)],
                (i > 0).then(|| BlockHash::Int(i * 2)),
                (0..8).map(|t| (i * 8 + t) as u32).collect(),
                4,
            ),
            KvEvent::removed(vec![BlockHash::Int(u64::MAX - i)]),
        ],
        data_parallel_rank: Some(0),
    }
}

pub fn warmup_batch() -> EventBatch {
    EventBatch {
        ts: -1.0,
        events: vec![],
        data_parallel_rank: None,
    }
}
