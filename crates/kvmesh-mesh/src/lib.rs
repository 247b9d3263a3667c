//! The mesh: the cluster's certificates ([`certs`]; [`tls_watch`] reads them again while
//! running), the mutual-TLS QUIC transport ([`transport`]), SWIM membership sans-IO
//! ([`membership`], foca), the whole node sans-IO ([`core`]: membership + replicated state +
//! ingest ownership + dissemination, time and randomness passed in) and its tokio shell
//! ([`node`]: its thread sets a peer's marks and in-flight counts on the router itself, in
//! the order the peer made them).

// Unsafe only in `realtime`: the one libc call that sets the thread's scheduling.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod certs;
pub mod core;
pub mod membership;
pub mod node;
pub mod realtime;
pub mod tls_watch;
pub mod transport;
pub mod udp_count;
mod warn_every;
