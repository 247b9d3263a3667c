//! SWIM membership, sans-IO: foca driven with time passed in (µs, any clock), inbound packets
//! passed in, and what it wants done (packets to send, members up or down) returned as
//! [`Effect`]s — on the model of foca's own `AccumulatingRuntime`. The tokio shell
//! ([`crate::node`]) feeds it QUIC datagrams and a timer; tests drive it in virtual time over a
//! simulated network.
//!
//! Identity: (node name, mesh address, bump). A node declared down renews its identity (its
//! bump plus one) and rejoins; a restarted node starts with a higher bump (its start time), which wins
//! the conflict with its old identity at the same address.

use bytes::Bytes;
use foca::{
    AccumulatingRuntime, Config, Foca, Identity, NoCustomBroadcast, OwnedNotification,
    PeriodicParams, PostcardCodec, Timer,
};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::{NonZeroU8, NonZeroU32, NonZeroUsize};
use std::time::Duration;

/// The largest SWIM packet (bytes): below a QUIC datagram's payload on a 1,280-byte path.
pub const MAX_PACKET: usize = 1_100;

/// How often members declared down are announced to, and to how many at a time.
const DOWN_ANNOUNCE_US: u64 = 250_000;
const DOWN_ANNOUNCE_TO: usize = 2;

/// A router node as the membership knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MeshId {
    /// Its configured name (stable).
    pub name: String,
    /// Its mesh address (UDP).
    pub addr: SocketAddr,
    /// Grows at each restart and each rejoin after being declared down.
    pub bump: u64,
}

impl Identity for MeshId {
    type Addr = SocketAddr;

    fn renew(&self) -> Option<Self> {
        Some(MeshId {
            bump: self.bump.wrapping_add(1),
            ..self.clone()
        })
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.bump > adversary.bump
    }
}

/// What the membership wants done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Send this packet to that address.
    Send(SocketAddr, Bytes),
    /// A member became active.
    Up(MeshId),
    /// A member was declared down (or left).
    Down(MeshId),
    /// A member rejoined under a renewed identity (a higher bump).
    Renamed(MeshId),
}

/// Foca with its runtime, timers and the live members.
pub struct Membership {
    foca: Foca<MeshId, PostcardCodec, StdRng, NoCustomBroadcast>,
    rt: AccumulatingRuntime<MeshId>,
    /// (due µs, order of submission, timer).
    timers: Vec<(u64, u64, Timer<MeshId>)>,
    submitted: u64,
    live: BTreeMap<SocketAddr, MeshId>,
    effects: Vec<Effect>,
    size_hint: u32,
    errors: u64,
    /// With no live member: when its down members are next announced to (see
    /// [`Membership::announce_down_when_alone`]).
    down_announce_at: Option<u64>,
    /// Where the next of those announces starts among the down members.
    down_turn: usize,
    /// Left the cluster: announces nothing more.
    left: bool,
}

fn config(n: u32) -> Config {
    let mut c = Config::new_lan(NonZeroU32::new(n.max(1)).unwrap_or(NonZeroU32::MIN));
    c.max_packet_size = NonZeroUsize::new(MAX_PACKET).unwrap_or(NonZeroUsize::MIN);
    // A healed partition is found by announcing to members declared down: every 250 ms to two
    // of them (foca's LAN default is 65 s; down members stay known for foca's 24 h). Eight
    // small datagrams a second while any member is down. Each announce that reaches the other
    // side starts a rejoin (TurnUndead, a renewed identity, an announce back): the whole
    // exchange takes a few of these periods, so the period is what a heal waits for
    // (cluster_sim, 32 nodes: membership agreed 1.6–3.0 s after the heal at 1 s, 0.7–1.05 s
    // at 250 ms).
    // foca does so only while it has a live member; alone, `announce_down_when_alone` does.
    c.periodic_announce_to_down_members = Some(PeriodicParams {
        frequency: Duration::from_micros(DOWN_ANNOUNCE_US),
        num_members: NonZeroUsize::new(DOWN_ANNOUNCE_TO).unwrap_or(NonZeroUsize::MIN),
    });
    c
}

impl Membership {
    /// The membership of `me`, expecting about `cluster_size` nodes (foca's timings scale with
    /// it; updated as members join), with a seeded random source.
    pub fn new(me: MeshId, cluster_size: u32, seed: u64) -> Membership {
        Membership {
            foca: Foca::new(
                me,
                config(cluster_size),
                StdRng::seed_from_u64(seed),
                PostcardCodec,
            ),
            rt: AccumulatingRuntime::new(),
            timers: Vec::new(),
            submitted: 0,
            live: BTreeMap::new(),
            effects: Vec::new(),
            size_hint: cluster_size.max(1),
            errors: 0,
            down_announce_at: None,
            down_turn: 0,
            left: false,
        }
    }

    /// This node's current identity.
    pub fn identity(&self) -> &MeshId {
        self.foca.identity()
    }

    /// Asks `seed` (an address; its identity is learnt from the answer) to let us in.
    pub fn announce(&mut self, seed: SocketAddr, now_us: u64) {
        let dst = MeshId {
            name: String::new(),
            addr: seed,
            bump: 0,
        };
        if self.foca.announce(dst, &mut self.rt).is_err() {
            self.errors += 1;
        }
        self.drain(now_us);
    }

    /// A packet from the network (hostile bytes are refused by the codec and counted).
    pub fn handle_data(&mut self, data: &[u8], now_us: u64) {
        if self.foca.handle_data(data, &mut self.rt).is_err() {
            self.errors += 1;
        }
        self.drain(now_us);
    }

    /// Fires every timer due at `now_us`, in order.
    pub fn advance(&mut self, now_us: u64) {
        loop {
            self.timers
                .sort_by(|a, b| (a.0, &a.2, a.1).cmp(&(b.0, &b.2, b.1)));
            match self.timers.first() {
                Some(t) if t.0 <= now_us => {
                    let (_, _, timer) = self.timers.remove(0);
                    if self.foca.handle_timer(timer, &mut self.rt).is_err() {
                        self.errors += 1;
                    }
                    self.drain(now_us);
                }
                _ => break,
            }
        }
        self.announce_down_when_alone(now_us);
    }

    /// When the next timer is due (µs), if any.
    pub fn next_due(&self) -> Option<u64> {
        let foca = self.timers.iter().map(|t| t.0).min();
        foca.into_iter().chain(self.down_announce_at).min()
    }

    /// foca announces to members declared down only while it has a live member: its
    /// periodic timer runs only while it is connected, and a node whose last live member
    /// goes down (or leaves) is disconnected, its timers cancelled (foca 2.0.0, lib.rs:
    /// `handle_timer`, `Timer::PeriodicAnnounceDown`; `adjust_connection_state` →
    /// `become_disconnected`). Then nothing found the others again: a router whose peers
    /// all left or died, one of them restarted with only a gone router as its seed, stayed
    /// alone — neither knew a live address of the other — until that seed came back. So
    /// while it has no live member, this node announces to its down members itself, at the
    /// same pace and in turn (the answer, a feed from the peer's new identity, makes it a
    /// member again and foca takes over).
    fn announce_down_when_alone(&mut self, now_us: u64) {
        if self.down_announce_at.is_none_or(|t| t > now_us) {
            return;
        }
        self.down_announce_at = Some(now_us.saturating_add(DOWN_ANNOUNCE_US));
        let down = self.down_members();
        for k in 0..DOWN_ANNOUNCE_TO.min(down.len()) {
            let to = down[(self.down_turn + k) % down.len()].clone();
            if self.foca.announce(to, &mut self.rt).is_err() {
                self.errors += 1;
            }
        }
        self.down_turn = self.down_turn.wrapping_add(DOWN_ANNOUNCE_TO);
        self.drain(now_us);
    }

    /// The members held down, this node's own address left out (a previous incarnation).
    fn down_members(&self) -> Vec<MeshId> {
        let me = self.foca.identity().addr;
        self.foca
            .iter_membership_state()
            .filter(|m| m.state() == foca::State::Down && m.id().addr != me)
            .map(|m| m.id().clone())
            .collect()
    }

    /// Arms [`Membership::announce_down_when_alone`] when this node has no live member and
    /// holds some down (disarms it otherwise).
    fn arm_down_announce(&mut self, now_us: u64) {
        if self.left || self.foca.num_members() > 0 || self.down_members().is_empty() {
            self.down_announce_at = None;
        } else if self.down_announce_at.is_none() {
            self.down_announce_at = Some(now_us.saturating_add(DOWN_ANNOUNCE_US));
        }
    }

    /// Leaves the cluster (tells the others) — on shutdown. The leave goes to every member at
    /// once (foca's gossip picks `num_indirect_probes` of them; the others would learn it from
    /// their next exchanges with those, or, missed by every copy, from their own probes
    /// seconds later).
    pub fn leave(&mut self, now_us: u64) {
        let mut c = config(self.size_hint);
        let members = self.live.len().max(1);
        c.num_indirect_probes = NonZeroUsize::new(members).unwrap_or(NonZeroUsize::MIN);
        // Each message carries an update at most `max_transmissions` times.
        let times = u8::try_from(members).unwrap_or(u8::MAX);
        c.max_transmissions = c
            .max_transmissions
            .max(NonZeroU8::new(times).unwrap_or(NonZeroU8::MIN));
        if self.foca.set_config(c).is_err() {
            self.errors += 1;
        }
        if self.foca.leave_cluster(&mut self.rt).is_err() {
            self.errors += 1;
        }
        self.left = true;
        self.drain(now_us);
    }

    /// The effects accumulated since the last call.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// The live members (not this node), by address.
    pub fn live(&self) -> impl Iterator<Item = &MeshId> {
        self.live.values()
    }

    /// The members suspected of being down (SWIM's suspect state: a probe went unanswered,
    /// not yet declared down). Still members, and still owners of their engines.
    pub fn suspects(&self) -> impl Iterator<Item = &MeshId> {
        self.foca
            .iter_membership_state()
            .filter(|m| m.state() == foca::State::Suspect)
            .map(|m| m.id())
    }

    /// What foca holds of the member at `addr`: its identity, SWIM incarnation and state
    /// (`"alive"`, `"suspect"`, `"down"`), down members included (a diagnostic: the
    /// simulation's `explain`).
    pub fn state_of(&self, addr: SocketAddr) -> Option<(MeshId, u16, &'static str)> {
        self.foca
            .iter_membership_state()
            .find(|m| m.id().addr == addr)
            .map(|m| {
                let state = match m.state() {
                    foca::State::Alive => "alive",
                    foca::State::Suspect => "suspect",
                    foca::State::Down => "down",
                };
                (m.id().clone(), m.incarnation(), state)
            })
    }

    /// Packets or timers foca refused (malformed input, mostly).
    pub fn errors(&self) -> u64 {
        self.errors
    }

    fn drain(&mut self, now_us: u64) {
        // foca 2 renews a node's identity (declared down, it rejoins) by `change_identity`,
        // which leaves it disconnected, its probe and periodic timers cancelled, until a
        // message addressed to the new identity arrives (its members are kept). Peers that
        // never heard of the renewal address the old identity, whose messages foca drops, so
        // a router renewed after a heal stopped probing and announcing to the members it held
        // down until its old identity's suspicion expired: at 128 routers, 10.7 s after a
        // heal (`mesh_scale`, seed 3: two routers, each holding the other's old identity).
        // Applying no update runs foca's own check, which reconnects a node that has active
        // members: its timers restart, and its probes carry its new identity.
        if self
            .foca
            .apply_many(std::iter::empty(), true, &mut self.rt)
            .is_err()
        {
            self.errors += 1;
        }
        let me = self.foca.identity().addr;
        while let Some((to, data)) = self.rt.to_send() {
            // A member held down at this node's own address (its previous incarnation, after
            // a restart) is announced to like any down member: the packet would come back to
            // us as "data from ourselves". Not sent.
            if to.addr == me {
                continue;
            }
            self.effects.push(Effect::Send(to.addr, data));
        }
        while let Some((after, timer)) = self.rt.to_schedule() {
            self.submitted += 1;
            let due = now_us.saturating_add(after.as_micros() as u64);
            self.timers.push((due, self.submitted, timer));
        }
        while let Some(n) = self.rt.to_notify() {
            match n {
                OwnedNotification::MemberUp(m) => {
                    self.live.insert(m.addr, m.clone());
                    self.effects.push(Effect::Up(m));
                }
                OwnedNotification::MemberDown(m) => {
                    if self.live.get(&m.addr) == Some(&m) {
                        self.live.remove(&m.addr);
                    }
                    self.effects.push(Effect::Down(m));
                }
                OwnedNotification::Rename(old, new) if self.live.remove(&old.addr).is_some() => {
                    self.live.insert(new.addr, new.clone());
                    self.effects.push(Effect::Renamed(new));
                }
                _ => {}
            }
        }
        // foca's timings follow the cluster's size.
        let n = self.live.len() as u32 + 1;
        if n > self.size_hint {
            self.size_hint = n.next_power_of_two();
            if self.foca.set_config(config(self.size_hint)).is_err() {
                self.errors += 1;
            }
        }
        self.arm_down_announce(now_us);
    }
}

/// This node's place among the live routers, as every router computes it alike: `(rank,
/// routers)`, its rank (0-based) when the distinct names of `me` and `live` are sorted, and
/// how many there are. Routers use it to split engines tied for least loaded between them.
pub fn rank_among<'a>(me: &str, live: impl IntoIterator<Item = &'a MeshId>) -> (u32, u32) {
    let mut names: Vec<&str> = live.into_iter().map(|m| m.name.as_str()).collect();
    names.push(me);
    names.sort_unstable();
    names.dedup();
    let rank = names.partition_point(|n| *n < me);
    (
        u32::try_from(rank).unwrap_or(u32::MAX),
        u32::try_from(names.len()).unwrap_or(u32::MAX),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str, port: u16, bump: u64) -> MeshId {
        MeshId {
            name: name.into(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            bump,
        }
    }

    #[test]
    fn every_router_computes_a_distinct_rank() {
        let all = [id("c", 1, 0), id("a", 2, 0), id("b", 3, 0)];
        let mut ranks: Vec<(u32, u32)> = all
            .iter()
            .map(|me| rank_among(&me.name, all.iter().filter(|m| m.name != me.name)))
            .collect();
        ranks.sort_unstable();
        assert_eq!(ranks, [(0, 3), (1, 3), (2, 3)]);
        assert_eq!(rank_among("b", &[]), (0, 1));
        // A restarted peer briefly known under two addresses counts once.
        assert_eq!(rank_among("b", &[id("a", 2, 0), id("a", 4, 1)]), (1, 2));
    }
}
