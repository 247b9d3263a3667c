//! The defaults of `kvmesh bench`, in one place: quick mode (CI smoke, ≤ 2 minutes on a shared
//! 2-core VM) and full mode (minutes, for the committed report). The command's flags override
//! single fields; `--help` prints these values.

use crate::workload::SharedPrefixWorkload;
use serde::{Deserialize, Serialize};

/// Every knob of a benchmark run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchSettings {
    /// Simulated engines started by the bench.
    pub engines: u32,
    /// KV-cache blocks (16 tokens) per engine: small enough that the shared-prefix workload's
    /// system prompts do not all fit on every engine (what makes routing matter: 600 blocks =
    /// 9,600 tokens against 16–32 groups × 2,000-token system prompts).
    pub kv_blocks: u32,
    /// Engines' time scale (0.1 = ten times faster than real time).
    pub time_scale: f64,
    /// Routers per contender.
    pub routers: u32,
    /// Repeats of every contender (interleaved).
    pub repeats: u32,
    /// Seed of the workload and of the routers' random choices.
    pub seed: u64,
    /// Shared-prefix workload shape (its seed is replaced by `seed`).
    pub shared_prefix: SharedPrefixWorkload,
    /// Closed loop: conversations in flight at once.
    pub concurrency: usize,
    /// Closed loop: a client's mean pause after each request before its next, ms (each pause
    /// uniform in `[0, 2 ×` this`]`, fixed by the job); 0 = the next turn leaves at once.
    pub think_ms: u64,
    /// KV-cache blocks per engine for the trace (its prompts are long: 15k tokens on average;
    /// prompt + completion above `blocks × 16` tokens are skipped, counted).
    pub trace_kv_blocks: u32,
    /// Trace: lines replayed (from the start of the trace).
    pub trace_requests: usize,
    /// Trace: time speed-up (wall = trace time ÷ this; in simulated time the trace runs at
    /// `trace_speedup × time_scale` its speed: 0.4 in both modes, since the synthetic trace
    /// at its own speed asks 4 engines for more prefill than they have).
    pub trace_speedup: f64,
    /// Trace: requests in flight at most.
    pub trace_max_in_flight: usize,
    /// Overhead workload: requests.
    pub overhead_requests: usize,
    /// Overhead workload: concurrency.
    pub overhead_concurrency: usize,
    /// Timeout of one request, seconds.
    pub request_timeout_s: u64,
    /// Deadline of one contender's run, seconds.
    pub run_deadline_s: u64,
    /// Default contenders (kvmesh policies).
    pub policies: Vec<String>,
}

impl BenchSettings {
    /// Quick mode: ≤ 2 minutes on a shared 2-core VM with the default three contenders.
    pub fn quick() -> BenchSettings {
        BenchSettings {
            engines: 4,
            kv_blocks: 600,
            time_scale: 0.5,
            routers: 1,
            repeats: 1,
            seed: 1,
            shared_prefix: SharedPrefixWorkload {
                groups: 16,
                users: 3,
                turns: 3,
                system_words: 2_000,
                question_words: 60,
                max_tokens: 24,
                seed: 1,
            },
            concurrency: 32,
            think_ms: 0,
            trace_kv_blocks: 8_000,
            trace_requests: 60,
            trace_speedup: 0.8,
            trace_max_in_flight: 64,
            overhead_requests: 400,
            overhead_concurrency: 16,
            request_timeout_s: 60,
            run_deadline_s: 30,
            policies: vec!["round_robin".into(), "cache_aware".into(), "precise".into()],
        }
    }

    /// Full mode: the committed report's size.
    pub fn full() -> BenchSettings {
        BenchSettings {
            time_scale: 1.0,
            repeats: 3,
            shared_prefix: SharedPrefixWorkload {
                groups: 32,
                ..BenchSettings::quick().shared_prefix
            },
            concurrency: 40,
            trace_requests: 200,
            trace_speedup: 0.4,
            trace_max_in_flight: 128,
            overhead_requests: 3_000,
            overhead_concurrency: 32,
            run_deadline_s: 300,
            policies: vec![
                "round_robin".into(),
                "least_request".into(),
                "cache_aware".into(),
                "precise".into(),
            ],
            ..BenchSettings::quick()
        }
    }
}
