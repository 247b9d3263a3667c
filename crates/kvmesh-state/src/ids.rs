//! Router identities and versions.

use serde::{Deserialize, Serialize};

/// A router node, stable across restarts: 64 bits of blake3 over its configured name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u64);

impl NodeId {
    /// The id of the node named `name`.
    pub fn from_name(name: &str) -> NodeId {
        let mut h = blake3::Hasher::new();
        h.update(b"kvmesh/node-id/v1\0");
        h.update(name.as_bytes());
        let mut x = [0u8; 8];
        x.copy_from_slice(&h.finalize().as_bytes()[..8]);
        NodeId(u64::from_le_bytes(x))
    }
}

/// A single writer's version: its incarnation (grows with each start of the node, e.g. its
/// start time) first, then a counter within the incarnation. A restarted node's entries thus
/// supersede everything its previous incarnation wrote.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
pub struct Version {
    /// The writer's incarnation.
    pub incarnation: u64,
    /// Its counter within the incarnation.
    pub counter: u64,
}
