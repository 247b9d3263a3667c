//! The benchmark harness: deterministic workloads (shared-prefix groups, Mooncake trace
//! replay, tiny overhead requests), a bounded load client, the virtual-time policy evaluator
//! with the oracle, and the reports of `kvmesh bench` (JSON, markdown, SVG plots).

#![forbid(unsafe_code)]
pub mod eval;
pub mod jobs;
pub mod load;
pub mod plot;
pub mod replay;
pub mod report;
pub mod settings;
mod sse;
pub mod workload;

pub use load::{
    CompareRow, EngineCounters, Imbalance, InFlightSampler, InFlightSamples, LoadOptions,
    LoadReport, Sample, Targets, engine_counters, engine_counters_each, fetch_text,
    format_compare_table, run_shared_prefix, run_shared_prefix_with_progress,
};
pub use workload::{Conversation, SharedPrefixWorkload, word, words};
