//! Chat-template rendering and tokenization shared by the engine simulator and the router.
//!
//! Pure: no I/O besides reading tokenizer files when a [`Tokenizer`] is built, no async
//! runtime. Router block keys are hashes of token ids, so what this crate produces must be
//! byte-identical to what the engine (vLLM, or our simulator, which uses this crate) feeds its
//! model; the behaviour below is modelled on vLLM + transformers 5 and checked against Python
//! jinja2 and the Python `tokenizers` package by the golden tests.
//!
//! * [`Tokenizer`] loads any Hugging Face `tokenizer.json` (legacy `1.0` files are converted)
//!   and the files beside it, or the bundled Qwen3 tokenizer ([`Tokenizer::bundled_default`]).
//! * [`ChatTemplate::render`] renders `/v1/chat/completions` messages like transformers'
//!   `apply_chat_template` (Jinja via minijinja, with transformers' `tojson`,
//!   `raise_exception`, `strftime_now`, `trim_blocks`/`lstrip_blocks`, and Python's spelling of
//!   values and string methods).
//! * [`Tokenizer::encode_chat`] = render + encode with `add_special_tokens = false`, as vLLM
//!   builds chat prompts.
//! * [`StreamDecoder`] turns generated ids into SSE text deltas.
//!
//! ```no_run
//! use kvmesh_tokenize::{ChatRenderRequest, Tokenizer};
//! let tok = Tokenizer::bundled_default()?;
//! let messages = vec![serde_json::json!({"role": "user", "content": "Hi!"})];
//! let ids = tok.encode_chat(&ChatRenderRequest::new(&messages))?;
//! let mut stream = tok.stream_decoder(true);
//! for id in ids {
//!     if let Some(delta) = stream.push(id)? {
//!         print!("{delta}");
//!     }
//! }
//! # Ok::<(), kvmesh_tokenize::TokenizeError>(())
//! ```

#![forbid(unsafe_code)]
mod config;
mod error;
mod jinja_env;
mod messages;
mod pyfmt;
mod segments;
mod stream;
mod strftime;
mod template;
mod tokenizer;

pub use error::TokenizeError;
pub use segments::{Resume, SegmentCache};
pub use stream::StreamDecoder;
pub use template::{ChatRenderRequest, ChatTemplate};
pub use tokenizer::Tokenizer;
