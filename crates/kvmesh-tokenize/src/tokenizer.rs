//! [`Tokenizer`]: loading, encoding, decoding.

use crate::config::HfConfig;
use crate::error::TokenizeError;
use crate::stream::StreamDecoder;
use crate::template::{ChatRenderRequest, ChatTemplate};
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use tokenizers::pipeline::{EncodeOptions, Override, PipelineToken, PipelineTokenizer};

/// The Qwen3 tokenizer shipped inside the crate (canonical `"version": "2.0"` JSON, gzipped).
static BUNDLED_TOKENIZER_GZ: &[u8] = include_bytes!("../assets/qwen3/tokenizer.json.gz");
/// Its `tokenizer_config.json`, unchanged from upstream.
static BUNDLED_CONFIG: &str = include_str!("../assets/qwen3/tokenizer_config.json");
/// Its stop ids, as Qwen3's `generation_config.json` publishes them.
static BUNDLED_GENERATION_CONFIG: &str = include_str!("../assets/qwen3/generation_config.json");
const BUNDLED_NAME: &str = "qwen3 (bundled)";

/// A loaded tokenizer plus what the files around it say: chat template, special tokens,
/// `model_max_length`.
///
/// Cheap to clone (one `Arc`), `Send + Sync`; share one per model across threads.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    pipeline: PipelineTokenizer,
    config: HfConfig,
    chat_template: Option<ChatTemplate>,
    eos_token_id: Option<u32>,
    bos_token_id: Option<u32>,
    stop_token_ids: Vec<u32>,
    vocab_size: usize,
    /// Size of the model's own (dense) id space, before added tokens.
    model_vocab_size: usize,
    /// token -> id for the model vocabulary, built on first use of `token_to_id`.
    vocab: OnceLock<HashMap<Box<str>, u32>>,
    opts_plain: EncodeOptions,
    opts_special: EncodeOptions,
    /// Added tokens that cut the input into independently tokenized pieces.
    splitters: crate::segments::Splitters,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("name", &self.inner.name)
            .field("vocab_size", &self.inner.vocab_size)
            .field("chat_template", &self.inner.chat_template)
            .finish_non_exhaustive()
    }
}

/// transformers ignores the `truncation`/`padding` stored in `tokenizer.json` unless asked, and
/// so do we.
fn encode_options(add_special_tokens: bool) -> EncodeOptions {
    EncodeOptions {
        add_special_tokens,
        encode_special_tokens: false,
        padding: Override::Off,
        truncation: Override::Off,
    }
}

impl Tokenizer {
    /// The Qwen3 tokenizer embedded in the binary (with its chat template). The first call
    /// decompresses and builds it (see the crate README for the cost); later calls return a
    /// clone of the same instance.
    pub fn bundled_default() -> Result<Tokenizer, TokenizeError> {
        static BUNDLED: OnceLock<Result<Tokenizer, String>> = OnceLock::new();
        BUNDLED
            .get_or_init(|| Self::load_bundled().map_err(|e| e.to_string()))
            .clone()
            .map_err(|reason| TokenizeError::load(BUNDLED_NAME, reason))
    }

    /// Build the bundled tokenizer from scratch, bypassing the process-wide cache of
    /// [`Tokenizer::bundled_default`] (for measuring the load time).
    pub fn load_bundled() -> Result<Tokenizer, TokenizeError> {
        let json =
            gunzip(BUNDLED_TOKENIZER_GZ).map_err(|e| TokenizeError::load(BUNDLED_NAME, e))?;
        let mut config = HfConfig::default();
        config
            .parse_tokenizer_config(BUNDLED_CONFIG)
            .map_err(|e| TokenizeError::load(BUNDLED_NAME, e))?;
        config
            .parse_generation_config(BUNDLED_GENERATION_CONFIG)
            .map_err(|e| TokenizeError::load(BUNDLED_NAME, e))?;
        Self::build(BUNDLED_NAME.to_owned(), &json, config)
    }

    /// Load a `tokenizer.json` file (plain or `.gz`), or a directory holding one.
    ///
    /// Next to it, these are read when present: `tokenizer_config.json` (chat template,
    /// `bos_token`/`eos_token`/..., `model_max_length`), `chat_template.jinja` (overrides the
    /// config's template, as in transformers), `special_tokens_map.json` (fills unset special
    /// tokens) and `generation_config.json` (extra stop ids). Files in the legacy
    /// `"version": "1.0"` format are converted on the fly.
    pub fn from_path(path: &Path) -> Result<Tokenizer, TokenizeError> {
        let name = path.display().to_string();
        let (file, dir) = if path.is_dir() {
            (path.join("tokenizer.json"), path.to_path_buf())
        } else {
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            (path.to_path_buf(), dir)
        };
        let bytes = std::fs::read(&file).map_err(|e| {
            // The file read is named when it is not the path given (a directory's file).
            let reason = if file == path {
                e.to_string()
            } else {
                format!("{}: {e}", file.display())
            };
            TokenizeError::load(&name, reason)
        })?;
        let json = if bytes.starts_with(&[0x1f, 0x8b]) {
            gunzip(&bytes).map_err(|e| TokenizeError::load(&name, e))?
        } else {
            String::from_utf8(bytes)
                .map_err(|_| TokenizeError::load(&name, "tokenizer.json is not UTF-8"))?
        };

        let mut config = HfConfig::default();
        let read_optional = |file: &str| -> Result<Option<String>, TokenizeError> {
            let p = dir.join(file);
            match std::fs::read_to_string(&p) {
                Ok(text) => Ok(Some(text)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(TokenizeError::load(&name, format!("{}: {e}", p.display()))),
            }
        };
        let load_err = |e: String| TokenizeError::load(&name, e);
        if let Some(text) = read_optional("tokenizer_config.json")? {
            config.parse_tokenizer_config(&text).map_err(load_err)?;
        }
        if let Some(text) = read_optional("chat_template.jinja")? {
            config.chat_templates = vec![("default".to_owned(), text)];
        }
        if let Some(text) = read_optional("special_tokens_map.json")? {
            config.parse_special_tokens_map(&text).map_err(load_err)?;
        }
        if let Some(text) = read_optional("generation_config.json")? {
            config.parse_generation_config(&text).map_err(load_err)?;
        }
        Self::build(name, &json, config)
    }

    /// Build from in-memory `tokenizer.json` text and optional `tokenizer_config.json` text.
    /// `name` is what [`Tokenizer::name`] reports.
    pub fn from_json_str(
        name: &str,
        tokenizer_json: &str,
        tokenizer_config_json: Option<&str>,
    ) -> Result<Tokenizer, TokenizeError> {
        let mut config = HfConfig::default();
        if let Some(text) = tokenizer_config_json {
            config
                .parse_tokenizer_config(text)
                .map_err(|e| TokenizeError::load(name, e))?;
        }
        Self::build(name.to_owned(), tokenizer_json, config)
    }

    /// This tokenizer with its chat template replaced by `source` (like vLLM's
    /// `--chat-template`), special tokens still bound.
    pub fn with_chat_template(&self, source: &str) -> Result<Tokenizer, TokenizeError> {
        let template = ChatTemplate::compile(
            vec![("default".to_owned(), source.to_owned())],
            &self.inner.config.special_tokens,
        )?;
        let inner = &*self.inner;
        let mut config = inner.config.clone();
        config.chat_templates = vec![("default".to_owned(), source.to_owned())];
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                name: inner.name.clone(),
                pipeline: inner.pipeline.clone(),
                config,
                chat_template: Some(template),
                eos_token_id: inner.eos_token_id,
                bos_token_id: inner.bos_token_id,
                stop_token_ids: inner.stop_token_ids.clone(),
                vocab_size: inner.vocab_size,
                model_vocab_size: inner.model_vocab_size,
                vocab: OnceLock::new(),
                opts_plain: encode_options(false),
                opts_special: encode_options(true),
                splitters: inner.splitters.clone(),
            }),
        })
    }

    fn build(name: String, json: &str, config: HfConfig) -> Result<Tokenizer, TokenizeError> {
        let pipeline = read_pipeline(json).map_err(|e| TokenizeError::load(&name, e))?;
        let chat_template = if config.chat_templates.is_empty() {
            None
        } else {
            Some(
                ChatTemplate::compile(config.chat_templates.clone(), &config.special_tokens)
                    .map_err(|e| TokenizeError::load(&name, e))?,
            )
        };
        let model_vocab_size = probe_model_vocab_size(&pipeline);
        let added = pipeline.get_added_vocabulary().get_vocab();
        let extra_added = added
            .values()
            .filter(|&&id| id as usize >= model_vocab_size)
            .count();
        let vocab_size = model_vocab_size + extra_added;
        let added_id = |name: &str| {
            let token = config
                .special_token(name)
                .or_else(|| pipeline.get_token_for_role(name))?;
            added.get(token).copied()
        };
        let splitters =
            crate::segments::Splitters::from_tokenizer_json(json, |t| added.get(t).copied());
        let eos_token_id = added_id("eos_token");
        let bos_token_id = added_id("bos_token");
        let mut stop_token_ids: Vec<u32> = eos_token_id.into_iter().collect();
        for id in &config.generation_eos_ids {
            if !stop_token_ids.contains(id) {
                stop_token_ids.push(*id);
            }
        }
        let tokenizer = Tokenizer {
            inner: Arc::new(Inner {
                name,
                pipeline,
                config,
                chat_template,
                eos_token_id,
                bos_token_id,
                stop_token_ids,
                vocab_size,
                model_vocab_size,
                vocab: OnceLock::new(),
                opts_plain: encode_options(false),
                opts_special: encode_options(true),
                splitters,
            }),
        };
        Ok(tokenizer)
    }

    /// `"qwen3 (bundled)"`, or the path it was loaded from.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Encode `text` to ids. `add_special_tokens` runs the tokenizer's post-processor (e.g. a
    /// BOS for Llama; nothing for Qwen3). Special tokens written in the text (`<|im_start|>`)
    /// always map to their ids, as in transformers.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, add_special_tokens, &mut out)?;
        Ok(out)
    }

    /// Like [`Tokenizer::encode`], appending to `out`. Allocation-free once `out` has enough
    /// capacity (when the post-processor adds nothing, which is always the case for
    /// `add_special_tokens = false`). On error `out` is left as it was.
    pub fn encode_into(
        &self,
        text: &str,
        add_special_tokens: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let opts = if add_special_tokens {
            &self.inner.opts_special
        } else {
            &self.inner.opts_plain
        };
        // The pipeline writes `PipelineToken`s into this thread's buffer; they are copied out as
        // ids with the crate's safe slice cast (a memcpy: measured as fast as reusing the
        // caller's buffer in place, which took `unsafe`).
        TOKENS.with(|t| {
            let mut tokens = t.borrow_mut();
            tokens.clear();
            let result = self.inner.pipeline.encode_into(text, opts, &mut tokens);
            match result {
                Ok(()) => {
                    out.extend_from_slice(PipelineToken::cast_slice(&tokens));
                    Ok(())
                }
                Err(e) => Err(TokenizeError::Encode(e.to_string())),
            }
        })
    }

    /// Decode ids to text. Unknown ids are skipped (as in Hugging Face tokenizers); bytes that
    /// do not form valid UTF-8 come out as U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizeError> {
        self.inner
            .pipeline
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizeError::Decode(e.to_string()))
    }

    /// An incremental decoder for streaming (owns a handle to this tokenizer).
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self.inner.pipeline.clone(), skip_special_tokens)
    }

    /// The chat template from `tokenizer_config.json` / `chat_template.jinja`, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.inner.chat_template.as_ref()
    }

    /// Render a chat request with this tokenizer's template
    /// ([`TokenizeError::NoChatTemplate`] when it has none).
    pub fn render_chat(&self, req: &ChatRenderRequest<'_>) -> Result<String, TokenizeError> {
        self.chat_template()
            .ok_or_else(|| TokenizeError::NoChatTemplate {
                tokenizer: self.inner.name.clone(),
            })?
            .render(req)
    }

    /// Render and tokenize a chat request the way vLLM builds a chat prompt: the rendered text
    /// is encoded with `add_special_tokens = false` (the template already wrote them).
    pub fn encode_chat(&self, req: &ChatRenderRequest<'_>) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(req)?;
        self.encode(&text, false)
    }

    /// [`Tokenizer::encode_chat`] appending to `out`; returns the rendered prompt text.
    pub fn encode_chat_into(
        &self,
        req: &ChatRenderRequest<'_>,
        out: &mut Vec<u32>,
    ) -> Result<String, TokenizeError> {
        let text = self.render_chat(req)?;
        self.encode_into(&text, false, out)?;
        Ok(text)
    }

    /// Id of `eos_token` from `tokenizer_config.json` (`<|im_end|>` = 151645 for Qwen3).
    pub fn eos_token_id(&self) -> Option<u32> {
        self.inner.eos_token_id
    }

    /// Id of `bos_token`, if the config names one (Qwen3 does not).
    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_token_id
    }

    /// Ids that end generation: the EOS token, then any other `eos_token_id` of
    /// `generation_config.json` (vLLM stops on all of them). Qwen3: `[151645, 151643]`.
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.inner.stop_token_ids
    }

    /// A named special token's text from the config: `"eos_token"`, `"pad_token"`, ...
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.inner.config.special_token(name)
    }

    /// `model_max_length` from `tokenizer_config.json` (131072 for Qwen3); `None` when absent
    /// or set to transformers' "unlimited" sentinel.
    pub fn model_max_length(&self) -> Option<usize> {
        self.inner.config.model_max_length
    }

    /// The id of a token, in the vocabulary's spelling (byte-level `"Ġhello"`, or an added
    /// token such as `"<|im_end|>"`). The first lookup of a non-added token builds an index
    /// of the vocabulary (~50 ms for Qwen3, once).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        let inner = &*self.inner;
        if let Some(id) = inner.pipeline.get_added_vocabulary().token_to_id(token) {
            return Some(id);
        }
        inner
            .vocab
            .get_or_init(|| {
                let model = inner.pipeline.get_model();
                let mut map = HashMap::with_capacity(inner.model_vocab_size);
                for id in 0..inner.model_vocab_size as u32 {
                    if let Some(tok) = model.id_to_token(id) {
                        map.entry(tok.into_boxed_str()).or_insert(id);
                    }
                }
                map
            })
            .get(token)
            .copied()
    }

    /// The token string of an id (vocabulary spelling), or `None` if out of range.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner
            .pipeline
            .decode_tokens(&[id], false)
            .into_iter()
            .next()
    }

    /// Number of ids, added tokens included (`len(tokenizer)` in transformers; 151669 for
    /// Qwen3, whose model embedding table is padded to 151936).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    pub(crate) fn splitters(&self) -> &crate::segments::Splitters {
        &self.inner.splitters
    }

    /// The underlying Hugging Face pipeline, for anything this wrapper does not expose.
    pub fn pipeline(&self) -> &PipelineTokenizer {
        &self.inner.pipeline
    }
}

/// Read `tokenizer.json` text, converting the legacy `"version": "1.0"` format when needed.
fn read_pipeline(json: &str) -> Result<PipelineTokenizer, String> {
    let head = &json.as_bytes()[..json.len().min(512)];
    let looks_canonical = head.windows(5).any(|w| w == b"\"2.0\"");
    if looks_canonical && let Ok(p) = tokenizers::from_json(json) {
        return Ok(p);
    }
    let canonical = tokenizers::canonicalize_str(json).map_err(|e| e.to_string())?;
    tokenizers::from_json(&canonical).map_err(|e| e.to_string())
}

/// The model's id space, assuming dense ids (true of Hugging Face vocabularies): gallop to a
/// missing id, then binary-search the boundary.
fn probe_model_vocab_size(pipeline: &PipelineTokenizer) -> usize {
    let model = pipeline.get_model();
    let exists = |id: u64| {
        u32::try_from(id)
            .ok()
            .and_then(|id| model.id_to_token(id))
            .is_some()
    };
    if !exists(0) {
        return 0;
    }
    let (mut lo, mut hi) = (0u64, 1u64);
    while exists(hi) {
        lo = hi;
        hi *= 2;
        if hi > u64::from(u32::MAX) {
            return u32::MAX as usize;
        }
    }
    // Invariant: exists(lo), !exists(hi).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if exists(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi as usize
}

fn gunzip(bytes: &[u8]) -> Result<String, String> {
    // The gzip trailer holds the uncompressed size (mod 2^32): size the buffer once.
    let hint = bytes
        .len()
        .checked_sub(4)
        .and_then(|at| bytes.get(at..))
        .and_then(|t| <[u8; 4]>::try_from(t).ok())
        .map_or(0, |t| u32::from_le_bytes(t) as usize);
    let mut out = String::with_capacity(hint.min(1 << 30));
    flate2::read::GzDecoder::new(bytes)
        .read_to_string(&mut out)
        .map_err(|e| format!("cannot decompress tokenizer.json: {e}"))?;
    Ok(out)
}

thread_local! {
    /// The pipeline's output buffer of this thread (no allocation per call once warm).
    static TOKENS: std::cell::RefCell<Vec<PipelineToken>> = const { std::cell::RefCell::new(Vec::new()) };
}
