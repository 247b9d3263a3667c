//! The benchmark harness's building blocks: deterministic workloads and a bounded load client.
//! (Trace replay, the virtual-time evaluator and reports grow here.)

#![forbid(unsafe_code)]
pub mod load;
pub mod workload;

pub use load::{
    CompareRow, EngineCounters, Imbalance, InFlightSampler, InFlightSamples, LoadOptions,
    LoadReport, Sample, Targets, engine_counters, fetch_text, format_compare_table,
    run_shared_prefix,
};
pub use workload::{Conversation, SharedPrefixWorkload, words};
