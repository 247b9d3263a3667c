//! Cluster-stable engine identities.
//!
//! Every router derives an engine's [`EngineId`] from the same input (its configured id, else
//! its normalised base URL), so ids mean the same thing on every node of the mesh: KV-event
//! ops, speculative marks and load entries on the wire name engines by it. Locally each
//! router maps ids to dense index [`Slot`](crate::Slot)s with a hash map.

use std::fmt;

/// A cluster-stable engine identity (64 bits of blake3 over a domain tag and the engine's
/// normalised URL or configured id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineId(pub u64);

impl EngineId {
    /// The id of the engine at `url` (`http://host:port`, trailing slashes and the scheme's
    /// case ignored) or with the configured id `url` when it is not a URL.
    pub fn from_url(url: &str) -> EngineId {
        let u = url.trim().trim_end_matches('/');
        let lower;
        let u = match u.find("://") {
            Some(i) => {
                lower = format!("{}{}", u[..i].to_ascii_lowercase(), &u[i..]);
                lower.as_str()
            }
            None => u,
        };
        let mut h = blake3::Hasher::new();
        h.update(b"kvmesh/engine-id/v1\0");
        h.update(u.as_bytes());
        let b = h.finalize();
        let mut x = [0u8; 8];
        x.copy_from_slice(&b.as_bytes()[..8]);
        EngineId(u64::from_le_bytes(x))
    }
}

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_url_same_id_and_golden() {
        let a = EngineId::from_url("http://127.0.0.1:8100");
        assert_eq!(a, EngineId::from_url("HTTP://127.0.0.1:8100/"));
        assert_ne!(a, EngineId::from_url("http://127.0.0.1:8101"));
        // Pinned: every router of every version must derive the same id.
        let h = blake3::hash(b"kvmesh/engine-id/v1\0http://127.0.0.1:8100");
        let mut x = [0u8; 8];
        x.copy_from_slice(&h.as_bytes()[..8]);
        assert_eq!(a.0, u64::from_le_bytes(x));
    }
}
