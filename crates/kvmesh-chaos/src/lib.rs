//! The chaos suite of kvmesh.
//!
//! Pure part (no I/O, unit tested): [`scenario`] (the TOML scenario files: topology, workload,
//! a timeline of faults, invariant thresholds; flapping links expanded into steps, quick mode)
//! and [`verdict`] (a run's observations → per-phase figures, the invariants' checks and the
//! verdict table).
//!
//! Shell: [`lab`] (one network namespace per router on a bridge, nftables rules for partitions
//! and loss, iptables NFQUEUE rules and [`delay`] agents for delay, the `kvmesh serve` / `kvmesh sim` processes, cleanup on every path), [`client`]
//! (a bounded workload that retries on another router, as a DNS client would), [`flood`]
//! (garbage datagrams and half-open QUIC handshakes at a mesh port), [`rotate`] (the
//! certificate files of a CA rotation, swapped per router) and [`run`] (drives a
//! scenario: lab up, workload, steps on schedule, measurements, verdict).

pub mod client;
pub mod delay;
pub mod flood;
pub mod lab;
pub mod rotate;
pub mod run;
pub mod scenario;
pub mod verdict;

use std::sync::atomic::{AtomicBool, Ordering};

static ABORT: AtomicBool = AtomicBool::new(false);

/// Asks a running scenario to stop (Ctrl-C): waits and loads end, the lab is torn down.
pub fn abort() {
    ABORT.store(true, Ordering::SeqCst);
}

/// Whether [`abort`] was called.
pub fn aborted() -> bool {
    ABORT.load(Ordering::SeqCst)
}
