//! SWIM membership in virtual time over a simulated network (no sockets): 16 nodes join
//! through one seed over links that lose, delay, duplicate and reorder packets; a killed node
//! is declared down by every other; it restarts with a higher bump and is up again everywhere;
//! a partition splits the views and its heal reunites them. Seeded; every loop is bounded.

use kvmesh_mesh::membership::{Effect, Membership, MeshId};
use std::collections::BTreeSet;
use std::net::SocketAddr;

const N: usize = 16;
const STEP_US: u64 = 2_000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn addr(i: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1 + i as u8], 7946))
}

struct Sim {
    now: u64,
    rng: Rng,
    nodes: Vec<Option<Membership>>,
    /// (due, to, payload)
    net: Vec<(u64, usize, Vec<u8>)>,
    loss: u64,
    /// Group of each node; packets between groups are dropped.
    group: Vec<u8>,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let nodes = (0..N)
            .map(|i| {
                let id = MeshId {
                    name: format!("r{i}"),
                    addr: addr(i),
                    bump: 1,
                };
                Some(Membership::new(id, N as u32, seed * 100 + i as u64))
            })
            .collect();
        Sim {
            now: 0,
            rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            nodes,
            net: Vec::new(),
            loss: 10,
            group: vec![0; N],
        }
    }

    fn index(a: SocketAddr) -> usize {
        match a.ip() {
            std::net::IpAddr::V4(v) => v.octets()[3] as usize - 1,
            std::net::IpAddr::V6(_) => unreachable!("v4 only"),
        }
    }

    fn collect(&mut self, from: usize) {
        let Some(m) = self.nodes[from].as_mut() else {
            return;
        };
        for e in m.take_effects() {
            if let Effect::Send(to, data) = e {
                let to = Sim::index(to);
                if self.group[from] != self.group[to] || self.rng.below(100) < self.loss {
                    continue;
                }
                let delay = 500 + self.rng.below(8_000);
                self.net.push((self.now + delay, to, data.to_vec()));
                if self.rng.below(50) == 0 {
                    let d2 = self.now + self.rng.below(20_000);
                    self.net.push((d2, to, data.to_vec()));
                }
            }
        }
    }

    fn run(&mut self, for_us: u64) {
        let end = self.now + for_us;
        while self.now < end {
            self.now += STEP_US;
            let now = self.now;
            let (mut due, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.net)
                .into_iter()
                .partition(|p| p.0 <= now);
            self.net = rest;
            for i in (1..due.len()).rev() {
                due.swap(i, self.rng.below(i as u64 + 1) as usize);
            }
            for (_, to, data) in due {
                if let Some(m) = self.nodes[to].as_mut() {
                    m.handle_data(&data, now);
                    self.collect(to);
                }
            }
            for i in 0..N {
                if let Some(m) = self.nodes[i].as_mut() {
                    m.advance(now);
                    // A node that knows nobody asks the seed again every second (the shell
                    // does the same with its configured seeds).
                    if i != 0 && m.live().next().is_none() && now.is_multiple_of(1_000_000) {
                        m.announce(addr(0), now);
                    }
                    self.collect(i);
                }
            }
        }
    }

    fn view(&self, i: usize) -> BTreeSet<usize> {
        self.nodes[i]
            .as_ref()
            .map(|m| m.live().map(|id| Sim::index(id.addr)).collect())
            .unwrap_or_default()
    }

    fn alive(&self) -> Vec<usize> {
        (0..N).filter(|&i| self.nodes[i].is_some()).collect()
    }

    /// Runs until `ok` holds (checked every 100 ms of virtual time), at most `max_us`;
    /// returns how long it took.
    fn until(&mut self, max_us: u64, ok: impl Fn(&Sim) -> bool) -> Option<u64> {
        let start = self.now;
        while self.now - start < max_us {
            if ok(self) {
                return Some(self.now - start);
            }
            self.run(100_000);
        }
        ok(self).then(|| self.now - start)
    }
}

fn everyone_sees_everyone(s: &Sim) -> bool {
    let alive = s.alive();
    alive.iter().all(|&i| {
        let want: BTreeSet<usize> = alive.iter().copied().filter(|&j| j != i).collect();
        s.view(i) == want
    })
}

#[test]
fn join_failure_detection_rejoin_and_partition_heal() {
    for seed in 1..=3u64 {
        let mut s = Sim::new(seed);
        // Everyone announces to node 0.
        for i in 1..N {
            let now = s.now;
            if let Some(m) = s.nodes[i].as_mut() {
                m.announce(addr(0), now);
            }
            s.collect(i);
        }
        let joined = s
            .until(60_000_000, everyone_sees_everyone)
            .unwrap_or_else(|| panic!("seed {seed}: the cluster never formed"));
        // Kill node 5: every other declares it down.
        s.nodes[5] = None;
        let detected = s
            .until(60_000_000, |s| {
                s.alive().iter().all(|&i| !s.view(i).contains(&5))
            })
            .unwrap_or_else(|| panic!("seed {seed}: node 5 never declared down"));
        // It restarts (higher bump: its new start) and announces to node 0.
        let id = MeshId {
            name: "r5".into(),
            addr: addr(5),
            bump: 1_000,
        };
        let mut m = Membership::new(id, N as u32, seed * 977);
        m.announce(addr(0), s.now);
        s.nodes[5] = Some(m);
        s.collect(5);
        let rejoined = s
            .until(60_000_000, everyone_sees_everyone)
            .unwrap_or_else(|| panic!("seed {seed}: node 5 never rejoined"));
        // Partition into halves: views split within 60 s (a node declared down by its own
        // half under this loss renews its identity, which restarts its suspicions: one that
        // renews late expires its last suspects a probe round and a suspicion time after).
        for i in 0..N {
            s.group[i] = u8::from(i >= N / 2);
        }
        let split = s.until(60_000_000, |s| {
            s.alive()
                .into_iter()
                .all(|i| s.view(i).iter().all(|&j| s.group[j] == s.group[i]))
        });
        for i in s.alive() {
            assert!(
                split.is_some() && s.view(i).iter().all(|&j| s.group[j] == s.group[i]),
                "seed {seed}: node {i} still sees across the partition: {:?}",
                s.view(i)
            );
        }
        // Heal: everyone sees everyone again.
        s.group = vec![0; N];
        let healed = s
            .until(120_000_000, everyone_sees_everyone)
            .unwrap_or_else(|| panic!("seed {seed}: the partition never healed"));
        println!(
            "seed {seed}: formed in {:.1} s, node down detected in {:.1} s, rejoined in {:.1} s, split in {:.1} s, healed in {:.1} s (virtual; 10% loss)",
            joined as f64 / 1e6,
            detected as f64 / 1e6,
            rejoined as f64 / 1e6,
            split.unwrap_or_default() as f64 / 1e6,
            healed as f64 / 1e6
        );
        for i in s.alive() {
            assert_eq!(s.nodes[i].as_ref().map(|m| m.errors()), Some(0), "node {i}");
        }
    }
}

#[test]
fn hostile_packets_are_refused_without_panic() {
    let mut m = Membership::new(
        MeshId {
            name: "a".into(),
            addr: addr(0),
            bump: 1,
        },
        4,
        1,
    );
    let mut rng = Rng(7);
    for len in 0..400usize {
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        m.handle_data(&bytes, 1_000);
    }
    assert!(m.errors() > 0);
    assert_eq!(m.live().count(), 0);
}
