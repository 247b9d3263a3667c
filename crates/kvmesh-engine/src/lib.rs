//! A pure, deterministic model of a vLLM V1 inference engine.
//!
//! No I/O, no threads, no clock: time and seeds are passed in, so the same inputs always give the
//! same outputs, events and timings. It models what routing depends on:
//!
//! * a **paged prefix cache** ([`Engine::cached_blocks`]): blocks of `block_size` tokens,
//!   identified by a chained, per-engine-seeded hash (LoRA name on every block, cache salt on
//!   the first), reference counts, an LRU free queue, eviction on allocation, only full blocks
//!   cached (generated tokens too), hits capped at `prompt_len - 1` tokens;
//! * **continuous batching** as vLLM V1's scheduler does it: a token budget per step, running
//!   requests first (decodes and prefill chunks), then waiting requests FCFS while the budget,
//!   `max_num_seqs` and free blocks allow, preemption (recompute) of the newest running request
//!   when blocks run out;
//! * **step timing** from a named [`TimingProfile`] (prefill tokens, prefill attention, decoding
//!   sequences, decode context), × a slowdown factor;
//! * **KV events** with vLLM's semantics ([`EngineEvent`]) and **metrics** under vLLM's names
//!   ([`EngineStats`]).
//!
//! [`drive`] runs engines in virtual time. The crate README documents the model, the timing
//! formula, each profile's sources, and where the model departs from vLLM.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod drive;
mod engine;
mod hash;
mod params;
mod pool;
mod profile;
mod types;

pub use engine::Engine;
pub use params::{DuplicateBlocks, EngineParams};
pub use profile::{BatchShape, TimingProfile};
pub use types::{
    AdmitError, CachedBlock, EngineEvent, EngineStats, FinishedRequest, Micros, RequestId,
    RequestSpec, StepOutput, TokenOutput,
};
