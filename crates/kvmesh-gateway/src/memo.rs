//! Recently routed chat prompts, so that the next turn of a conversation (or the same body
//! again) tokenizes and hashes only what is new.
//!
//! A rendered chat prompt of turn N+1 starts with the rendered prompt of turn N (up to its
//! generation prompt): the memo keeps, per recent prompt, its text, its token ids, its block
//! keys and the points where tokenization can resume (just after each added token that cuts
//! pieces, [`Resume`]). A new prompt is compared byte by byte with the memo found for it; up
//! to the last resume point inside the common prefix its token ids are the memo's
//! ([`kvmesh_tokenize::Tokenizer::resumable`]), and so are the keys of the blocks those ids
//! fill. Only the rest is tokenized (with the piece cache) and hashed. Exact: the reuse is
//! decided by comparing the texts, never by a hash alone (a false probe match only costs the
//! comparison).
//!
//! Finding the memo: it is filed under a probe key of its text's first `2^k` bytes (`2^k` =
//! the largest power of two up to its last resume point), a hash of the length and of 32-byte
//! samples every 512 bytes and of the last 64 bytes of that prefix, mixed with the key
//! parameters (block size, LoRA name, cache salt). A new prompt probes the powers of two up
//! to its own length, longest first, [`PROBES`] of them.
//!
//! Bounded: two generations of at most `max_bytes / 2` each (text + ids + keys + resume
//! points + a fixed overhead per entry), the older dropped when the newer is full, sharded
//! by key.

use kvmesh_prefix::BlockKey;
use kvmesh_tokenize::Resume;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

/// Texts shorter than this are not memoized (their preparation is cheap: ~60 µs at 8 KB).
pub const MIN_MEMO_BYTES: usize = 4096;
/// Powers of two probed per prompt, longest first.
pub const PROBES: usize = 4;
const SHARDS: usize = 8;
/// Bytes counted per entry besides its arrays (the map slot, the `Arc`, allocator headers).
const ENTRY_OVERHEAD: usize = 192;

/// One memoized prompt.
pub struct Memo {
    /// The rendered prompt.
    pub text: Box<str>,
    /// Its token ids (all of them).
    pub tokens: Box<[u32]>,
    /// The keys of the full blocks of `tokens` (up to the router's `max_prompt_tokens`).
    pub keys: Box<[BlockKey]>,
    /// Where tokenization can resume, in text order.
    pub resumes: Box<[Resume]>,
    /// The key parameters (see [`params`]).
    pub params: u64,
}

impl Memo {
    fn bytes(&self) -> usize {
        self.text.len()
            + self.tokens.len() * 4
            + self.keys.len() * 8
            + self.resumes.len() * 8
            + ENTRY_OVERHEAD
    }
}

struct Shard {
    current: HashMap<u64, Arc<Memo>>,
    previous: HashMap<u64, Arc<Memo>>,
    current_bytes: usize,
}

/// The memo of one tokenizer (shared by the routes that use it).
pub struct PromptMemo {
    shards: Vec<Mutex<Shard>>,
    bytes_per_shard: usize,
    found: AtomicU64,
}

fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The parameters block keys depend on besides the tokens, as one value.
pub fn params(block_size: u32, lora: Option<&str>, salt: Option<&str>) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(&block_size.to_le_bytes());
    for v in [lora, salt] {
        match v {
            Some(v) => {
                h.update(&[1]);
                h.update(&(v.len() as u64).to_le_bytes());
                h.update(v.as_bytes());
            }
            None => {
                h.update(&[0]);
            }
        }
    }
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

/// The probe key of `text[..len]` under `params`.
fn probe_key(text: &[u8], len: usize, params: u64) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(&params.to_le_bytes());
    h.update(&(len as u64).to_le_bytes());
    let mut at = 0;
    while at + 32 <= len {
        h.update(&text[at..at + 32]);
        at += 512;
    }
    h.update(&text[len.saturating_sub(64)..len]);
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

fn pow2_floor(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - n.leading_zeros())
    }
}

/// The length of the common prefix of `a` and `b`, in bytes.
pub fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 256 <= n && a[i..i + 256] == b[i..i + 256] {
        i += 256;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl PromptMemo {
    /// A memo of at most about `max_bytes` (0: nothing is kept).
    pub fn new(max_bytes: usize) -> PromptMemo {
        PromptMemo {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        current: HashMap::new(),
                        previous: HashMap::new(),
                        current_bytes: 0,
                    })
                })
                .collect(),
            bytes_per_shard: max_bytes / 2 / SHARDS,
            found: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: u64) -> MutexGuard<'_, Shard> {
        lock(&self.shards[(key >> 32) as usize % SHARDS])
    }

    /// The memo of an earlier prompt that may share a long prefix with `text` under `params`
    /// (the caller compares the texts).
    pub fn find(&self, text: &str, params: u64) -> Option<Arc<Memo>> {
        if self.bytes_per_shard == 0 || text.len() < MIN_MEMO_BYTES {
            return None;
        }
        let mut len = pow2_floor(text.len());
        for _ in 0..PROBES {
            if len < MIN_MEMO_BYTES / 2 {
                break;
            }
            let key = probe_key(text.as_bytes(), len, params);
            let mut s = self.shard(key);
            if let Some(m) = s.current.get(&key) {
                self.found.fetch_add(1, Relaxed);
                return Some(m.clone());
            }
            if let Some(m) = s.previous.remove(&key) {
                s.current_bytes += m.bytes();
                s.current.insert(key, m.clone());
                self.found.fetch_add(1, Relaxed);
                return Some(m);
            }
            len /= 2;
        }
        None
    }

    /// Files `memo` (replacing the one filed under the same probe key). Texts under
    /// [`MIN_MEMO_BYTES`] and entries larger than a generation are not kept.
    pub fn put(&self, memo: Memo) {
        let size = memo.bytes();
        if memo.text.len() < MIN_MEMO_BYTES || size > self.bytes_per_shard {
            return;
        }
        let upto = memo
            .resumes
            .last()
            .map_or(memo.text.len(), |r| r.byte as usize);
        let len = pow2_floor(upto);
        if len < MIN_MEMO_BYTES / 2 {
            return;
        }
        let key = probe_key(memo.text.as_bytes(), len, memo.params);
        let mut s = self.shard(key);
        if s.current_bytes + size > self.bytes_per_shard {
            s.previous = std::mem::take(&mut s.current);
            s.current_bytes = 0;
        }
        s.current_bytes += size;
        if let Some(old) = s.current.insert(key, Arc::new(memo)) {
            s.current_bytes -= old.bytes();
        }
    }

    /// Prompts for which a memo was found so far.
    pub fn found(&self) -> u64 {
        self.found.load(Relaxed)
    }

    /// Bytes held (both generations, as counted for the bound).
    pub fn bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = lock(s);
                s.current
                    .values()
                    .chain(s.previous.values())
                    .map(|m| m.bytes())
                    .sum::<usize>()
            })
            .sum()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = lock(s);
                s.current.len() + s.previous.len()
            })
            .sum()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memo(text: String, params: u64) -> Memo {
        let resumes = vec![Resume {
            byte: (text.len() - 10) as u32,
            tokens: 3,
        }];
        Memo {
            text: text.into_boxed_str(),
            tokens: vec![1, 2, 3, 4].into(),
            keys: Vec::new().into(),
            resumes: resumes.into(),
            params,
        }
    }

    #[test]
    fn a_longer_text_finds_its_prefix_and_other_params_do_not() {
        let m = PromptMemo::new(1 << 20);
        let base: String = (0..6000).map(|i| (b'a' + (i % 23) as u8) as char).collect();
        m.put(memo(base.clone(), 7));
        let longer = format!("{base} and a new turn of the conversation");
        let found = m.find(&longer, 7).expect("found");
        assert_eq!(&*found.text, base.as_str());
        assert!(m.find(&longer, 8).is_none());
        let other: String = base.chars().rev().collect();
        assert!(m.find(&other, 7).is_none());
        assert_eq!(
            common_prefix(found.text.as_bytes(), longer.as_bytes()),
            base.len()
        );
    }

    #[test]
    fn the_bound_holds() {
        let max = 256 * 1024;
        let m = PromptMemo::new(max);
        for i in 0..2000 {
            let text = format!("{i:08} {}", "x".repeat(5000));
            m.put(memo(text, 1));
            assert!(m.bytes() <= max, "{} > {max}", m.bytes());
        }
        assert!(!m.is_empty());
        let none = PromptMemo::new(0);
        none.put(memo("y".repeat(5000), 1));
        assert!(none.is_empty());
    }

    #[test]
    fn common_prefix_is_exact() {
        let a = vec![5u8; 1000];
        let mut b = a.clone();
        assert_eq!(common_prefix(&a, &b), 1000);
        b[700] = 6;
        assert_eq!(common_prefix(&a, &b), 700);
        assert_eq!(common_prefix(&a[..10], &b), 10);
        b[0] = 0;
        assert_eq!(common_prefix(&a, &b), 0);
    }
}
