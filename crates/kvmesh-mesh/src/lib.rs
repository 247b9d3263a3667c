//! The mesh's I/O shell. So far: the cluster's certificates ([`certs`]) and the mutual-TLS
//! QUIC transport ([`transport`]). Membership (foca) and the wiring of `kvmesh-state` come next.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod certs;
pub mod membership;
pub mod node;
pub mod transport;
