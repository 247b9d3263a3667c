//! Tokenization that reuses work across the turns of a conversation.
//!
//! A Hugging Face tokenizer first cuts the input at its *added tokens* (`<|im_start|>`,
//! `<|im_end|>`, …) and then tokenizes every piece between them on its own. So the ids of a
//! rendered chat are exactly the concatenation of the ids of its pieces, and the pieces repeat
//! from turn to turn: every message of turn N was already a piece of turn N−1. The
//! [`SegmentCache`] remembers the ids of pieces (keyed by a 64-bit blake3 hash of their text),
//! so a new turn only tokenizes its new message.
//!
//! Exactness: only added tokens that match literally (not `normalized`, no `lstrip`/`rstrip`,
//! not `single_word`) cut pieces; others stay inside pieces and are handled by the pipeline as
//! usual. A test compares [`Tokenizer::encode_cached`] with [`Tokenizer::encode`] over random
//! conversations and texts with embedded special tokens.

use crate::{TokenizeError, Tokenizer};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const SHARDS: usize = 16;
/// What a cached piece costs besides its ids, counted in ids (48 bytes: the map slot, the
/// `Arc` header, the allocation's rounding), so that many tiny pieces cannot outgrow the bound.
const PIECE_OVERHEAD_IDS: usize = 12;

struct Shard {
    /// Two generations: lookups check both and promote; when `current` holds its share of
    /// the token budget, it becomes `previous` and the old `previous` is dropped. An LRU
    /// approximation with O(1) work and bounded memory.
    current: HashMap<u64, Arc<[u32]>>,
    previous: HashMap<u64, Arc<[u32]>>,
    current_tokens: usize,
}

/// A bounded, thread-safe cache of piece → token ids, shared by every request of a model.
pub struct SegmentCache {
    shards: Vec<Mutex<Shard>>,
    tokens_per_shard: usize,
    hits: std::sync::atomic::AtomicU64,
    misses: std::sync::atomic::AtomicU64,
}

impl SegmentCache {
    /// A cache holding about `max_tokens` token ids in all (×2 at most, for the previous
    /// generation): 4 bytes each, each piece counted [`PIECE_OVERHEAD_IDS`] ids more for
    /// its overhead.
    pub fn new(max_tokens: usize) -> SegmentCache {
        SegmentCache {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        current: HashMap::new(),
                        previous: HashMap::new(),
                        current_tokens: 0,
                    })
                })
                .collect(),
            tokens_per_shard: (max_tokens / SHARDS).max(1),
            hits: Default::default(),
            misses: Default::default(),
        }
    }

    /// (hits, misses) of cacheable pieces so far.
    pub fn stats(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.hits.load(Relaxed), self.misses.load(Relaxed))
    }

    fn get(&self, key: u64) -> Option<Arc<[u32]>> {
        let mut s = lock(&self.shards[(key as usize) % SHARDS]);
        if let Some(v) = s.current.get(&key) {
            return Some(v.clone());
        }
        let v = s.previous.remove(&key)?;
        s.current_tokens += v.len() + PIECE_OVERHEAD_IDS;
        s.current.insert(key, v.clone());
        Some(v)
    }

    fn put(&self, key: u64, ids: Arc<[u32]>) {
        let cost = ids.len() + PIECE_OVERHEAD_IDS;
        if cost > self.tokens_per_shard {
            return;
        }
        let mut s = lock(&self.shards[(key as usize) % SHARDS]);
        if s.current_tokens + cost > self.tokens_per_shard {
            let full = std::mem::take(&mut s.current);
            s.previous = full;
            s.current_tokens = 0;
        }
        s.current_tokens += cost;
        if let Some(old) = s.current.insert(key, ids) {
            s.current_tokens -= old.len() + PIECE_OVERHEAD_IDS;
        }
    }

    /// What the cache holds, in ids (pieces' overhead included): at most twice `max_tokens`.
    pub fn held_tokens(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = lock(s);
                s.current
                    .values()
                    .chain(s.previous.values())
                    .map(|v| v.len() + PIECE_OVERHEAD_IDS)
                    .sum::<usize>()
            })
            .sum()
    }
}

fn lock(m: &Mutex<Shard>) -> std::sync::MutexGuard<'_, Shard> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The added tokens that cut pieces, longest first, with a first-byte filter.
#[derive(Clone)]
pub(crate) struct Splitters {
    tokens: Vec<(Box<str>, u32)>,
    first: [bool; 256],
    /// The one first byte of every splitter, when they share it and it is ASCII (`<` for
    /// most chat tokenizers): candidates are then found with a fast byte search.
    only_first: Option<char>,
}

impl Splitters {
    /// From the `added_tokens` array of a `tokenizer.json` (flags read from it) and the ids
    /// the pipeline assigned.
    pub(crate) fn from_tokenizer_json(
        json: &str,
        id_of: impl Fn(&str) -> Option<u32>,
    ) -> Splitters {
        #[derive(serde::Deserialize)]
        struct Added {
            content: String,
            #[serde(default)]
            single_word: bool,
            #[serde(default)]
            lstrip: bool,
            #[serde(default)]
            rstrip: bool,
            #[serde(default = "yes")]
            normalized: bool,
        }
        fn yes() -> bool {
            true
        }
        #[derive(serde::Deserialize)]
        struct Doc {
            #[serde(default)]
            added_tokens: Vec<Added>,
        }
        let doc: Doc = serde_json::from_str(json).unwrap_or(Doc {
            added_tokens: Vec::new(),
        });
        let mut tokens: Vec<(Box<str>, u32)> = doc
            .added_tokens
            .into_iter()
            .filter(|a| !a.single_word && !a.lstrip && !a.rstrip && !a.normalized)
            .filter(|a| !a.content.is_empty())
            .filter_map(|a| id_of(&a.content).map(|id| (a.content.into_boxed_str(), id)))
            .collect();
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        let mut first = [false; 256];
        for (t, _) in &tokens {
            first[t.as_bytes()[0] as usize] = true;
        }
        let firsts: Vec<usize> = (0..256).filter(|&b| first[b]).collect();
        let only_first = match firsts.as_slice() {
            [b] if *b < 0x80 => Some(*b as u8 as char),
            _ => None,
        };
        Splitters {
            tokens,
            first,
            only_first,
        }
    }

    /// The next position ≥ `from` where a splitter may start. A token's first byte is the
    /// first byte of a UTF-8 character, so every hit is a character boundary.
    fn next_candidate(&self, text: &str, from: usize) -> Option<usize> {
        let rest = text.get(from..)?;
        match self.only_first {
            Some(c) => rest.find(c).map(|p| from + p),
            None => rest
                .bytes()
                .position(|b| self.first[b as usize])
                .map(|p| from + p),
        }
    }

    /// The byte length of the longest splitter (0 when none).
    pub(crate) fn max_len(&self) -> usize {
        self.tokens.first().map_or(0, |(t, _)| t.len())
    }

    /// The longest splitter starting at byte `i` of `text`.
    fn at(&self, text: &str, i: usize) -> Option<(usize, u32)> {
        let rest = &text.as_bytes()[i..];
        if !self.first[rest[0] as usize] {
            return None;
        }
        self.tokens
            .iter()
            .find(|(t, _)| rest.starts_with(t.as_bytes()))
            .map(|(t, id)| (t.len(), *id))
    }
}

fn piece_key(piece: &str) -> u64 {
    let h = blake3::hash(piece.as_bytes());
    let b = h.as_bytes();
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// A point of a rendered prompt where the tokenization can be resumed: right after an added
/// token that cut pieces, at byte `byte` of the text, after `tokens` token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// Byte offset in the text (just past the added token).
    pub byte: u32,
    /// Token ids of the text before `byte`.
    pub tokens: u32,
}

impl Tokenizer {
    /// Like [`Tokenizer::encode_into`] with `add_special_tokens = false` (how chat prompts are
    /// tokenized), reusing the ids of pieces between added tokens from `cache`. Same ids as
    /// `encode`, less work when pieces repeat (the turns of a conversation).
    pub fn encode_cached(
        &self,
        text: &str,
        cache: &SegmentCache,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        self.encode_cached_from(text, 0, cache, out, None)
    }

    /// The longest byte length of an added token that cuts pieces (how far past a position the
    /// cutting looks).
    pub fn splitter_max_len(&self) -> usize {
        self.splitters().max_len()
    }

    /// How many of `resumes` (in text order, as [`Tokenizer::encode_cached_from`] recorded
    /// them for a text `old`) a text `new` sharing its first `common` bytes with `old` can
    /// resume at: up to the last of them, `new` is cut and tokenized exactly as `old` was
    /// (every cut depends on the text up to it plus the longest added token).
    pub fn resumable(&self, resumes: &[Resume], common: usize) -> usize {
        let reach = self.splitter_max_len();
        resumes.partition_point(|r| r.byte as usize + reach <= common)
    }

    /// [`Tokenizer::encode_cached`] resumed at byte `start` of `text`: `out` already holds the
    /// ids of `text[..start]` (from an earlier text sharing that prefix, see
    /// [`Tokenizer::resumable`]; `start` 0 = from the beginning). The points where a later
    /// text could resume are appended to `resumes` when given (token counts include what
    /// `out` held). On error `out` is left as it was.
    pub fn encode_cached_from(
        &self,
        text: &str,
        start: usize,
        cache: &SegmentCache,
        out: &mut Vec<u32>,
        mut resumes: Option<&mut Vec<Resume>>,
    ) -> Result<(), TokenizeError> {
        let sp = self.splitters();
        let start_len = out.len();
        let mut piece_start = start;
        let mut i = start;
        let flush = |from: usize, to: usize, out: &mut Vec<u32>| -> Result<(), TokenizeError> {
            if from >= to {
                return Ok(());
            }
            // Every piece goes through the cache, short ones too: a pipeline call has a fixed
            // cost of several µs, far above a hash and a lookup.
            let piece = &text[from..to];
            let key = piece_key(piece);
            if let Some(ids) = cache.get(key) {
                cache
                    .hits
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                out.extend_from_slice(&ids);
                return Ok(());
            }
            cache
                .misses
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let before = out.len();
            self.encode_into(piece, false, out)?;
            cache.put(key, Arc::from(&out[before..]));
            Ok(())
        };
        let result = (|| {
            while let Some(at) = sp.next_candidate(text, i) {
                match sp.at(text, at) {
                    Some((len, id)) => {
                        flush(piece_start, at, out)?;
                        out.push(id);
                        i = at + len;
                        piece_start = i;
                        if let Some(r) = resumes.as_deref_mut() {
                            r.push(Resume {
                                byte: i as u32,
                                tokens: out.len() as u32,
                            });
                        }
                    }
                    None => i = at + 1,
                }
            }
            flush(piece_start, text.len(), out)
        })();
        if result.is_err() {
            out.truncate(start_len);
        }
        result
    }
}
