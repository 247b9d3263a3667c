//! Workloads, generated deterministically from a seed (pure: no I/O, no clock).
//!
//! **Shared-prefix groups** (the llm-d benchmark shape, scaled down): `groups` groups, each with
//! its own long system prompt; `users` users per group, each asking its own questions over
//! `turns` turns, every turn resending the whole conversation (system prompt, earlier questions
//! and the answers the server gave). Requests of one conversation are sequential; different
//! conversations run concurrently.

use serde::{Deserialize, Serialize};

/// Parameters of the shared-prefix multi-turn workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedPrefixWorkload {
    /// Groups sharing a system prompt.
    pub groups: u32,
    /// Users (conversations) per group.
    pub users: u32,
    /// Turns per conversation.
    pub turns: u32,
    /// Words in each group's system prompt (≈ 1.3 tokens per word with Qwen3).
    pub system_words: u32,
    /// Words in each question.
    pub question_words: u32,
    /// Completion tokens per turn.
    pub max_tokens: u32,
    /// Seed of every word choice.
    pub seed: u64,
}

impl Default for SharedPrefixWorkload {
    fn default() -> Self {
        SharedPrefixWorkload {
            groups: 4,
            users: 4,
            turns: 3,
            system_words: 1200,
            question_words: 60,
            max_tokens: 32,
            seed: 1,
        }
    }
}

const WORDS: &[&str] = &[
    "account",
    "balance",
    "cluster",
    "deploy",
    "engine",
    "failover",
    "gateway",
    "handler",
    "index",
    "journal",
    "kernel",
    "latency",
    "memory",
    "network",
    "operator",
    "partition",
    "quorum",
    "replica",
    "schedule",
    "tenant",
    "upgrade",
    "version",
    "workload",
    "yield",
    "zone",
    "policy",
    "prefix",
    "cache",
    "token",
    "stream",
    "batch",
    "queue",
    "router",
    "shard",
    "budget",
    "circuit",
    "retry",
    "health",
    "weight",
    "session",
    "context",
    "window",
];

/// The word standing for token id `t` in text prompts.
pub fn word(t: u64) -> &'static str {
    WORDS[(t % WORDS.len() as u64) as usize]
}

/// Deterministic text of `n` words; `salt` selects the text.
pub fn words(salt: u64, n: u32) -> String {
    let mut x = salt
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0xD1B5_4A32_D192_ED03)
        | 1;
    let mut out = String::with_capacity(n as usize * 8);
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(if i % 17 == 0 { '.' } else { ' ' });
            if i % 17 == 0 {
                out.push(' ');
            }
        }
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}

/// One conversation of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// Group index.
    pub group: u32,
    /// User index within the group.
    pub user: u32,
    /// The group's system prompt.
    pub system: String,
    /// The questions, one per turn.
    pub questions: Vec<String>,
}

impl SharedPrefixWorkload {
    /// Every conversation, in a deterministic order.
    pub fn conversations(&self) -> Vec<Conversation> {
        let mut out = Vec::with_capacity((self.groups * self.users) as usize);
        for g in 0..self.groups {
            let system = format!(
                "You are the assistant of team {g}. Follow the runbook below.\n{}",
                words(self.seed ^ (0xA5A5 + g as u64 * 7919), self.system_words)
            );
            for u in 0..self.users {
                let questions = (0..self.turns)
                    .map(|t| {
                        let salt = self.seed ^ ((g as u64) << 40 | (u as u64) << 20 | t as u64);
                        format!(
                            "Question {t} from user {u}: {}?",
                            words(salt, self.question_words)
                        )
                    })
                    .collect();
                out.push(Conversation {
                    group: g,
                    user: u,
                    system: system.clone(),
                    questions,
                });
            }
        }
        out
    }

    /// Total requests of the workload.
    pub fn requests(&self) -> u64 {
        self.groups as u64 * self.users as u64 * self.turns as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_shaped() {
        let w = SharedPrefixWorkload::default();
        let a = w.conversations();
        assert_eq!(a, w.conversations());
        assert_eq!(a.len(), 16);
        assert_eq!(w.requests(), 48);
        // Same group shares the system prompt; different groups do not.
        assert_eq!(a[0].system, a[1].system);
        assert_ne!(a[0].system, a[4].system);
        assert_ne!(a[0].questions[0], a[1].questions[0]);
        let other = SharedPrefixWorkload { seed: 2, ..w };
        assert_ne!(other.conversations()[0].system, a[0].system);
    }
}
