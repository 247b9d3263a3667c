//! A node declared down renews its identity and keeps probing under the new one, whatever
//! its peers still address. foca 2 leaves a renewed node disconnected (no probes, no periodic
//! announces) until a message addressed to its new identity arrives; when no peer can tell it
//! one (here: the peer that declared it down cannot reach it any more), it fell silent for
//! good. Two nodes over a lossless link, one direction of which is cut; virtual time, no
//! sockets; bounded loops.

use kvmesh_mesh::membership::{Effect, Membership, MeshId};
use std::net::SocketAddr;

fn addr(i: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1 + i as u8], 7946))
}

struct Two {
    now: u64,
    nodes: [Membership; 2],
    /// (due, to, payload)
    net: Vec<(u64, usize, Vec<u8>)>,
    /// `cut[from]`: what `from` sends is dropped.
    cut: [bool; 2],
}

impl Two {
    fn collect(&mut self, from: usize) {
        for e in self.nodes[from].take_effects() {
            if let Effect::Send(to, data) = e {
                let to = usize::from(to == addr(1));
                if !self.cut[from] {
                    self.net.push((self.now + 300, to, data.to_vec()));
                }
            }
        }
    }

    /// Runs `for_us` of virtual time in 1 ms steps.
    fn run(&mut self, for_us: u64) {
        let end = self.now + for_us;
        while self.now < end {
            self.now += 1_000;
            let now = self.now;
            let (due, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.net)
                .into_iter()
                .partition(|p| p.0 <= now);
            self.net = rest;
            for (_, to, data) in due {
                self.nodes[to].handle_data(&data, now);
                self.collect(to);
            }
            for i in 0..2 {
                self.nodes[i].advance(now);
                self.collect(i);
            }
        }
    }

    /// Node `i`'s live members.
    fn live(&self, i: usize) -> Vec<MeshId> {
        self.nodes[i].live().cloned().collect()
    }
}

#[test]
fn a_renewed_node_keeps_probing_under_its_new_identity() {
    for seed in 1..=8u64 {
        let id = |i: usize| MeshId {
            name: format!("r{i}"),
            addr: addr(i),
            bump: 1,
        };
        let mut s = Two {
            now: 0,
            nodes: [
                Membership::new(id(0), 2, seed * 10),
                Membership::new(id(1), 2, seed * 10 + 1),
            ],
            net: Vec::new(),
            cut: [false; 2],
        };
        s.nodes[1].announce(addr(0), 0);
        s.collect(1);
        s.run(5_000_000);
        assert_eq!(s.live(0), vec![id(1)], "seed {seed}: formed");
        // Node 1 can no longer be heard: node 0 declares it down and tells it so (foca's
        // courtesy TurnUndead), and node 1 renews its identity.
        s.cut[1] = true;
        let mut renewed = false;
        for _ in 0..600 {
            s.run(100_000);
            if s.nodes[1].identity().bump > 1 {
                renewed = true;
                break;
            }
        }
        assert!(renewed, "seed {seed}: node 1 never renewed");
        assert!(
            s.live(0).is_empty(),
            "seed {seed}: node 0 holds node 1 down"
        );
        // Now node 0 cannot be heard instead: only node 1's own probes, under its new
        // identity, can bring it back into node 0's view.
        s.cut = [true, false];
        let mut back = false;
        for _ in 0..100 {
            s.run(100_000);
            if s.live(0).iter().any(|m| m.addr == addr(1) && m.bump > 1) {
                back = true;
                break;
            }
        }
        assert!(
            back,
            "seed {seed}: node 1 (renewed to {:?}) fell silent: node 0 never heard its new identity",
            s.nodes[1].identity()
        );
    }
}
