//! vLLM KV-cache event wire format and ZMQ transport.
//!
//! * Pure layer (no I/O, no tokio): [`types`], [`encode_batch`],
//!   [`decode_batch`], [`decode_frame`], [`json`].
//! * Transport layer (tokio + the pure-Rust `zeromq` crate): [`Publisher`],
//!   [`Subscriber`], [`replay`].
//!
//! See the crate README for the wire format and the vLLM sources it follows.

#![forbid(unsafe_code)]
pub mod decode;
pub mod encode;
pub mod json;
mod msgpack;
pub mod types;

pub use decode::{
    DecodeError, DecodeLimits, FrameError, KvFrame, decode_batch, decode_frame, parse_seq,
};
pub use encode::{encode_batch, encode_event_bytes, encode_value};
pub use types::{
    BlockHash, DecodedBatch, EventBatch, KvEvent, MEDIUM_CPU, MEDIUM_GPU, MsgValue,
    ParseWireEncodingError, WireEncoding,
};

pub mod publisher;
pub mod subscriber;

pub use publisher::{
    AttachMode, DEFAULT_BUFFER_LEN, DEFAULT_QUEUE_LEN, END_SEQ, PublishError, Publisher,
    PublisherConfig, ReplayFraming, TransportError,
};
pub use subscriber::{RecvError, ReplayedBatch, Subscriber, replay, replay_at_most};
