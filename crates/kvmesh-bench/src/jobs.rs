//! Workloads as token-id jobs (pure: no I/O but the trace file read, no clock): what the load
//! client replays against real endpoints and what the virtual-time evaluator feeds to the engine
//! model, so that both see exactly the same prompts.
//!
//! * **shared-prefix** ([`shared_prefix_jobs`]): the [`SharedPrefixWorkload`] in token space —
//!   one token per word: each group's system prompt, each user's questions, and for every
//!   earlier turn a fixed stand-in for the answer (`max_tokens` tokens), so turn `t` resends
//!   turn `t − 1`'s prompt plus that answer plus the next question. Closed loop: the turns of a
//!   conversation run one after the other.
//! * **trace** ([`trace_jobs`]): Mooncake-format JSONL lines `{"timestamp": ms,
//!   "input_length", "output_length", "hash_ids": [..]}` with 512-token blocks; each hash id
//!   maps deterministically to a fixed block of token ids ([`hash_block`]); a prompt is the
//!   concatenation of its blocks truncated to `input_length`. Open loop: each request leaves at
//!   its timestamp ÷ the speed-up.
//! * **overhead** ([`overhead_jobs`]): tiny unrelated prompts with one output token: what the
//!   router itself costs.

use crate::workload::SharedPrefixWorkload;
use serde::{Deserialize, Serialize};

/// Tokens per Mooncake hash id.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Token ids used for prompts: inside every real vocabulary (Qwen3 has 151k) and away from the
/// special tokens at both ends.
const TOKEN_LO: u64 = 1_000;
const TOKEN_SPAN: u64 = 100_000;

/// The trace excerpt shipped with the crate: the last 600 lines of the synthetic Mooncake
/// trace (142 s, 12.3 M prompt tokens, 68% of them a prefix seen earlier in the excerpt; see
/// `data/README.md`).
pub const BUNDLED_TRACE: &str = include_str!("../data/synthetic_trace_tail600.jsonl");

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// Index in the job set.
    pub id: u64,
    /// The conversation it belongs to: jobs of one conversation run in order, one at a time.
    pub conv: u32,
    /// Arrival offset from the start of the run (open-loop workloads), µs of trace time.
    pub at_us: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Completion tokens.
    pub max_tokens: u32,
}

/// How a job set is offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// Conversations, at most `concurrency` at once, each turn sent when the previous ended.
    Closed,
    /// Every job at its `at_us` (÷ speed-up), whatever is still running.
    Open,
}

/// A workload's jobs.
#[derive(Debug, Clone)]
pub struct JobSet {
    /// Workload name (`shared-prefix`, `trace`, `overhead`).
    pub name: String,
    /// The jobs, conversations' turns in order.
    pub jobs: Vec<Job>,
    /// How they arrive.
    pub arrival: Arrival,
    /// Jobs dropped when building (longer than the engines' context).
    pub skipped: usize,
}

impl JobSet {
    /// Prompt tokens of all jobs.
    pub fn prompt_tokens(&self) -> u64 {
        self.jobs.iter().map(|j| j.prompt.len() as u64).sum()
    }

    /// Jobs grouped by conversation, in order of first appearance (each group in turn order).
    pub fn conversations(&self) -> Vec<Vec<usize>> {
        let mut index: std::collections::HashMap<u32, usize> = Default::default();
        let mut out: Vec<Vec<usize>> = Vec::new();
        for (i, j) in self.jobs.iter().enumerate() {
            let k = *index.entry(j.conv).or_insert_with(|| {
                out.push(Vec::new());
                out.len() - 1
            });
            out[k].push(i);
        }
        out
    }
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `n` deterministic token ids selected by `salt`.
pub fn tokens(salt: u64, n: usize) -> Vec<u32> {
    let mut x = mix(salt);
    (0..n)
        .map(|_| {
            x = mix(x);
            (TOKEN_LO + x % TOKEN_SPAN) as u32
        })
        .collect()
}

/// The fixed block of [`TRACE_BLOCK_TOKENS`] token ids a Mooncake hash id stands for.
pub fn hash_block(hash_id: u64) -> Vec<u32> {
    tokens(0x7472_6163_6500_0000 ^ hash_id, TRACE_BLOCK_TOKENS)
}

/// The shared-prefix workload as token-id jobs (one token per word; see the module doc).
pub fn shared_prefix_jobs(w: &SharedPrefixWorkload) -> JobSet {
    let mut jobs = Vec::with_capacity(w.requests() as usize);
    for g in 0..w.groups {
        let system = tokens(w.seed ^ (0xA5A5 + g as u64 * 7919), w.system_words as usize);
        for u in 0..w.users {
            let conv = g * w.users + u;
            let mut prompt = system.clone();
            for t in 0..w.turns {
                let salt = w.seed ^ ((g as u64) << 40 | (u as u64) << 20 | t as u64);
                if t > 0 {
                    prompt.extend(tokens(salt ^ 0xA115_EE00, w.max_tokens as usize));
                }
                prompt.extend(tokens(salt, w.question_words as usize));
                jobs.push(Job {
                    id: jobs.len() as u64,
                    conv,
                    at_us: 0,
                    prompt: prompt.clone(),
                    max_tokens: w.max_tokens.max(1),
                });
            }
        }
    }
    JobSet {
        name: "shared-prefix".into(),
        jobs,
        arrival: Arrival::Closed,
        skipped: 0,
    }
}

/// One line of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceLine {
    /// Arrival, ms from the trace's start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Completion tokens.
    pub output_length: u32,
    /// The prompt's 512-token blocks.
    pub hash_ids: Vec<u64>,
}

/// Parses Mooncake JSONL (blank lines skipped; an error names the line).
pub fn parse_trace(text: &str) -> Result<Vec<TraceLine>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("trace line {}: {e}", i + 1)))
        .collect()
}

/// The first `limit` trace lines as jobs; lines whose prompt + completion exceed
/// `max_model_len` are skipped (counted). Timestamps are made relative to the first line.
pub fn trace_jobs(lines: &[TraceLine], limit: usize, max_model_len: u32) -> JobSet {
    let t0 = lines.iter().map(|l| l.timestamp).min().unwrap_or(0);
    let mut jobs = Vec::new();
    let mut skipped = 0;
    let mut blocks: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    for l in lines.iter().take(limit) {
        let max_tokens = l.output_length.max(1);
        if l.input_length == 0
            || l.input_length as u64 + u64::from(max_tokens) > u64::from(max_model_len)
        {
            skipped += 1;
            continue;
        }
        let mut prompt = Vec::with_capacity(l.input_length);
        for &h in &l.hash_ids {
            if prompt.len() >= l.input_length {
                break;
            }
            prompt.extend_from_slice(blocks.entry(h).or_insert_with(|| hash_block(h)));
        }
        // A trace whose blocks do not cover input_length: pad with the request's own tokens.
        if prompt.len() < l.input_length {
            let pad = l.input_length - prompt.len();
            prompt.extend(tokens(0x9AD0_0000 ^ jobs.len() as u64, pad));
        }
        prompt.truncate(l.input_length);
        let id = jobs.len() as u64;
        jobs.push(Job {
            id,
            conv: id as u32,
            at_us: (l.timestamp - t0) * 1_000,
            prompt,
            max_tokens,
        });
    }
    JobSet {
        name: "trace".into(),
        jobs,
        arrival: Arrival::Open,
        skipped,
    }
}

/// `n` tiny unrelated prompts (8 tokens, 1 completion token), each its own conversation.
pub fn overhead_jobs(n: usize, seed: u64) -> JobSet {
    JobSet {
        name: "overhead".into(),
        jobs: (0..n)
            .map(|i| Job {
                id: i as u64,
                conv: i as u32,
                at_us: 0,
                prompt: tokens(seed ^ 0x0E7E_AD00_0000 ^ i as u64, 8),
                max_tokens: 1,
            })
            .collect(),
        arrival: Arrival::Closed,
        skipped: 0,
    }
}

/// A prompt as text: one word per token id (`--prompts text`; the engine's tokenizer makes its
/// own tokens of it, so the token counts differ from the ids').
pub fn prompt_text(prompt: &[u32]) -> String {
    let mut s = String::with_capacity(prompt.len() * 8);
    for (i, &t) in prompt.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(crate::workload::word(t as u64));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_turns_extend_the_previous_prompt_and_groups_share_the_system_prompt() {
        let w = SharedPrefixWorkload {
            groups: 2,
            users: 2,
            turns: 3,
            system_words: 100,
            question_words: 10,
            max_tokens: 5,
            seed: 3,
        };
        let s = shared_prefix_jobs(&w);
        assert_eq!(s.jobs.len(), 12);
        assert_eq!(s.conversations().len(), 4);
        let (a, b) = (&s.jobs[0].prompt, &s.jobs[1].prompt);
        assert_eq!(a.len(), 110);
        assert_eq!(b.len(), 125);
        assert_eq!(&b[..110], &a[..]);
        // Users of a group share the system prompt, other groups do not.
        assert_eq!(s.jobs[3].prompt[..100], a[..100]);
        assert_ne!(s.jobs[6].prompt[..100], a[..100]);
        assert_eq!(s.jobs, shared_prefix_jobs(&w).jobs);
    }

    #[test]
    fn trace_prompts_are_hash_blocks_truncated_and_timestamps_relative() {
        let text = "{\"timestamp\": 100, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [5, 6]}\n\n\
                    {\"timestamp\": 250, \"input_length\": 600, \"output_length\": 0, \"hash_ids\": [5, 7]}\n\
                    {\"timestamp\": 300, \"input_length\": 9000, \"output_length\": 1, \"hash_ids\": [1]}\n";
        let lines = parse_trace(text).unwrap();
        let s = trace_jobs(&lines, 10, 4096);
        assert_eq!((s.jobs.len(), s.skipped), (2, 1));
        assert_eq!(s.jobs[0].prompt.len(), 700);
        assert_eq!(&s.jobs[0].prompt[..512], &hash_block(5)[..]);
        assert_eq!(&s.jobs[0].prompt[512..], &hash_block(6)[..188]);
        assert_eq!(&s.jobs[1].prompt[..512], &s.jobs[0].prompt[..512]);
        assert_eq!(s.jobs[1].max_tokens, 1);
        assert_eq!((s.jobs[0].at_us, s.jobs[1].at_us), (0, 150_000));
        assert!(
            parse_trace("{\"timestamp\": 1}")
                .unwrap_err()
                .contains("line 1")
        );
    }

    #[test]
    fn bundled_trace_parses() {
        let lines = parse_trace(BUNDLED_TRACE).unwrap();
        assert_eq!(lines.len(), 600);
        let s = trace_jobs(&lines, 50, 262_144);
        assert_eq!(s.jobs.len() + s.skipped, 50);
        assert!(s.jobs.iter().all(|j| j.prompt.iter().all(|&t| t >= 1_000)));
    }

    #[test]
    fn text_prompts_have_a_word_per_token() {
        let t = prompt_text(&[1, 2, 3]);
        assert_eq!(t.split(' ').count(), 3);
        assert_eq!(overhead_jobs(3, 1).jobs[2].prompt.len(), 8);
    }
}
