//! Warnings about a peer said at most once a period per address: a misbehaving peer (a
//! refused handshake, envelopes that do not decode) repeats every few hundred ms, and the
//! log should say it, not flood.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Addresses kept before those past their period are dropped.
const ADDRESSES: usize = 1024;

/// The period of every mesh warning about a peer.
const EVERY: Duration = Duration::from_secs(60);

/// When each address was last warned about: at most once a minute per address.
#[derive(Debug, Default)]
pub(crate) struct WarnEvery {
    last: HashMap<SocketAddr, Instant>,
}

impl WarnEvery {
    /// Whether to warn about `addr` now (and if so, the period starts again).
    pub(crate) fn due(&mut self, addr: SocketAddr, now: Instant) -> bool {
        if self.last.len() > ADDRESSES {
            self.last.retain(|_, t| now.duration_since(*t) < EVERY);
        }
        match self.last.get(&addr) {
            Some(t) if now.duration_since(*t) < EVERY => false,
            _ => {
                self.last.insert(addr, now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_a_period_per_address() {
        let mut w = WarnEvery::default();
        let (a, b): (SocketAddr, SocketAddr) = (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        let t0 = Instant::now();
        assert!(w.due(a, t0));
        assert!(!w.due(a, t0 + Duration::from_secs(59)));
        assert!(w.due(b, t0 + Duration::from_secs(1)));
        assert!(w.due(a, t0 + Duration::from_secs(60)));
    }
}
