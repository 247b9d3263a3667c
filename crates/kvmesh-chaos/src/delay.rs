//! Delay injection without netem: an iptables-nft rule in a router's namespace sends the UDP
//! packets of chosen peers to an NFQUEUE (`-j NFQUEUE --queue-num N --queue-bypass`, on the
//! input path, as the loss rules), and an [`Agent`] — a thread of the runner that entered that
//! namespace (`setns`) and bound the queue over a raw `NETLINK_NETFILTER` socket — holds each
//! packet for D ± J ms, then gives the kernel an ACCEPT verdict. Nothing is ever dropped:
//!
//! * release times never decrease (a packet leaves no earlier than the one queued before it):
//!   arrival order is kept across all held packets, hence per flow;
//! * more than [`HOLD_MAX`] packets held: the next one is accepted at once (counted);
//! * the queue is configured fail-open (`NFQA_CFG_F_FAIL_OPEN`): when the kernel's queue or
//!   the socket's buffer is full, the kernel accepts the packet instead of dropping it;
//! * `--queue-bypass`: with no reader bound (before the agent binds, after it stops), packets
//!   pass undelayed.
//!
//! The pure part — netlink messages built and parsed (every byte from the kernel treated as
//! hostile: bounded, no panic), the hold queue with its clock passed in — is unit tested; the
//! shell ([`Agent`]) is tested in `tests/lab.rs` with real namespaces.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Packets held at most; beyond, a packet is accepted at once (and counted as `overflow`).
pub const HOLD_MAX: usize = 4096;
/// The kernel's queue length: above [`HOLD_MAX`] so that our bound, not the kernel's, decides
/// (fail-open would accept anyway).
const KERNEL_QUEUE_MAXLEN: u32 = 8192;

// Netlink and nfnetlink_queue constants (linux/netlink.h, linux/netfilter/nfnetlink*.h).
const NETLINK_NETFILTER: i32 = 12;
const NLMSG_NOOP: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NFQA_CFG_F_FAIL_OPEN: u32 = 1;
const NF_ACCEPT: u32 = 1;
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLMSG_HDRLEN: usize = 16;
const NFGEN_HDRLEN: usize = 4;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// An nfnetlink_queue message to the kernel: netlink header, nfgenmsg (AF_UNSPEC, version 0,
/// the queue number big-endian), attributes.
pub fn message(msg: u16, flags: u16, seq: u32, queue: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut b = vec![0u8; NLMSG_HDRLEN];
    b.extend_from_slice(&[0, 0]);
    b.extend_from_slice(&queue.to_be_bytes());
    for (ty, data) in attrs {
        let len = 4 + data.len();
        b.extend_from_slice(&(len as u16).to_ne_bytes());
        b.extend_from_slice(&ty.to_ne_bytes());
        b.extend_from_slice(data);
        b.resize(align4(b.len()), 0);
    }
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b[4..6].copy_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | msg).to_ne_bytes());
    b[6..8].copy_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

/// The ACCEPT verdict of packet `id`.
pub fn accept(queue: u16, id: u32) -> Vec<u8> {
    let mut hdr = [0u8; 8];
    hdr[..4].copy_from_slice(&NF_ACCEPT.to_be_bytes());
    hdr[4..].copy_from_slice(&id.to_be_bytes());
    message(NFQNL_MSG_VERDICT, 0, 0, queue, &[(NFQA_VERDICT_HDR, &hdr)])
}

/// What a message from the kernel says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg {
    /// A queued packet, by id.
    Packet(u32),
    /// An acknowledgement (`0`) or an error (`-errno`) of request `seq`.
    Ack { seq: u32, errno: i32 },
    /// Anything else (another type, a packet without its header): ignored.
    Other,
    /// Not a well-formed netlink message: the rest of the datagram is skipped.
    Malformed,
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(i..i + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(i..i + 4)?.try_into().ok()?))
}

/// The messages of one datagram from the kernel, in order. Bounded by the datagram: lengths
/// are checked against what is there, a malformed message ends the walk.
pub fn parse(buf: &[u8]) -> Vec<Msg> {
    let mut out = Vec::new();
    let mut at = 0;
    while buf.len().saturating_sub(at) >= NLMSG_HDRLEN {
        let (Some(len), Some(ty), Some(seq)) =
            (u32_at(buf, at), u16_at(buf, at + 4), u32_at(buf, at + 8))
        else {
            break;
        };
        let len = len as usize;
        if len < NLMSG_HDRLEN || len > buf.len() - at {
            out.push(Msg::Malformed);
            break;
        }
        let body = &buf[at + NLMSG_HDRLEN..at + len];
        out.push(match ty {
            NLMSG_ERROR => match body.get(..4) {
                Some(e) => Msg::Ack {
                    seq,
                    errno: i32::from_ne_bytes([e[0], e[1], e[2], e[3]]),
                },
                None => Msg::Malformed,
            },
            NLMSG_NOOP | NLMSG_DONE => Msg::Other,
            t if t == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET => packet_id(body),
            _ => Msg::Other,
        });
        at += align4(len).min(buf.len() - at);
    }
    out
}

/// The id in a packet message's `NFQA_PACKET_HDR` (`packet_id` big-endian, first field).
fn packet_id(body: &[u8]) -> Msg {
    let mut at = NFGEN_HDRLEN;
    while body.len().saturating_sub(at) >= 4 {
        let (Some(len), Some(ty)) = (u16_at(body, at), u16_at(body, at + 2)) else {
            break;
        };
        let len = len as usize;
        if len < 4 || len > body.len() - at {
            return Msg::Malformed;
        }
        if ty & NLA_TYPE_MASK == NFQA_PACKET_HDR {
            return match body.get(at + 4..at + 8) {
                Some(id) if len >= 8 => {
                    Msg::Packet(u32::from_be_bytes([id[0], id[1], id[2], id[3]]))
                }
                _ => Msg::Malformed,
            };
        }
        at += align4(len).min(body.len() - at);
    }
    Msg::Other
}

/// The packets held, oldest first, each with its release time. Release times never decrease.
#[derive(Debug)]
pub struct Hold {
    delay: Duration,
    jitter: Duration,
    rng: u64,
    held: VecDeque<(u32, Instant)>,
    last: Option<Instant>,
}

impl Hold {
    pub fn new(delay: Duration, jitter: Duration, seed: u64) -> Hold {
        Hold {
            delay,
            jitter,
            rng: seed | 1,
            held: VecDeque::new(),
            last: None,
        }
    }

    /// `delay` ± up to `jitter`, uniform (whole microseconds).
    fn sample(&mut self) -> Duration {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let j = self.jitter.as_micros() as u64;
        if j == 0 {
            return self.delay;
        }
        let off = z % (2 * j + 1);
        let us = self.delay.as_micros() as u64 + off;
        Duration::from_micros(us.saturating_sub(j))
    }

    /// A packet arrived at `now`: held (`true`), or the hold is full (`false`: accept it now).
    pub fn push(&mut self, id: u32, now: Instant) -> bool {
        if self.held.len() >= HOLD_MAX {
            return false;
        }
        let mut due = now + self.sample();
        if let Some(last) = self.last {
            due = due.max(last);
        }
        self.last = Some(due);
        self.held.push_back((id, due));
        true
    }

    /// The packets due at `now`, in arrival order.
    pub fn due(&mut self, now: Instant) -> Vec<u32> {
        let mut out = Vec::new();
        while let Some(&(id, t)) = self.held.front() {
            if t > now {
                break;
            }
            out.push(id);
            self.held.pop_front();
        }
        out
    }

    /// Every packet still held, in order (the agent stops: they go at once).
    pub fn drain(&mut self) -> Vec<u32> {
        self.held.drain(..).map(|(id, _)| id).collect()
    }

    pub fn next_due(&self) -> Option<Instant> {
        self.held.front().map(|&(_, t)| t)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// An agent's counters (read while it runs; final once it stopped).
#[derive(Debug, Default)]
pub struct Stats {
    /// Packets held and released after their delay.
    pub held: AtomicU64,
    /// ACCEPT verdicts sent (held ones and overflow).
    pub released: AtomicU64,
    /// Accepted at once: more than [`HOLD_MAX`] held.
    pub overflow: AtomicU64,
    /// The socket's buffer overflowed (ENOBUFS): the kernel accepted those packets itself
    /// (fail-open), undelayed.
    pub missed: AtomicU64,
    /// Verdicts the kernel refused, and malformed messages.
    pub errors: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub held: u64,
    pub released: u64,
    pub overflow: u64,
    pub missed: u64,
    pub errors: u64,
}

impl Stats {
    pub fn counts(&self) -> Counts {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counts {
            held: g(&self.held),
            released: g(&self.released),
            overflow: g(&self.overflow),
            missed: g(&self.missed),
            errors: g(&self.errors),
        }
    }
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} held, {} released, {} overflow, {} missed, {} errors",
            self.held, self.released, self.overflow, self.missed, self.errors
        )
    }
}

static RUNNING: AtomicUsize = AtomicUsize::new(0);

/// Agents running in this process (the lab checks that none is left after teardown).
pub fn running() -> usize {
    RUNNING.load(Ordering::SeqCst)
}

/// A delay agent: a thread bound to NFQUEUE `queue` inside a network namespace. Dropping it
/// stops it: every packet still held is accepted at once, then the socket is closed.
pub struct Agent {
    stop: Arc<AtomicBool>,
    stats: Arc<Stats>,
    thread: Option<JoinHandle<()>>,
}

impl Agent {
    /// Enters `/run/netns/<netns>` in a new thread, binds `queue` (fail-open, metadata only)
    /// and starts holding packets for `delay` ± `jitter`. Returns once bound, or the error.
    pub fn start(
        netns: &str,
        queue: u16,
        delay: Duration,
        jitter: Duration,
    ) -> Result<Agent, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Stats::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let path = format!("/run/netns/{netns}");
        let (s, st) = (stop.clone(), stats.clone());
        let seed = std::process::id() as u64 ^ u64::from(queue) << 32 ^ nanos();
        RUNNING.fetch_add(1, Ordering::SeqCst);
        let thread = std::thread::Builder::new()
            .name(format!("delay-{netns}"))
            .spawn(move || {
                match bind(&path, queue) {
                    Ok(fd) => {
                        let _ = tx.send(Ok(()));
                        serve(&fd, queue, Hold::new(delay, jitter, seed), &s, &st);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
                RUNNING.fetch_sub(1, Ordering::SeqCst);
            })
            .map_err(|e| {
                RUNNING.fetch_sub(1, Ordering::SeqCst);
                format!("delay agent thread: {e}")
            })?;
        let mut agent = Agent {
            stop,
            stats,
            thread: Some(thread),
        };
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => Ok(agent),
            Ok(Err(e)) => Err(format!("delay agent in {netns}: {e}")),
            Err(_) => {
                agent.stop();
                Err(format!("delay agent in {netns}: not bound after 5 s"))
            }
        }
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Stops the thread (held packets accepted) and waits for it.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}

fn nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn send(fd: &OwnedFd, msg: &[u8]) -> std::io::Result<()> {
    // SAFETY: a valid socket and a buffer of `msg.len()` bytes; the kernel is the destination
    // (a zeroed sockaddr_nl with family AF_NETLINK).
    let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    to.nl_family = libc::AF_NETLINK as u16;
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&raw const to).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if n < 0 { Err(errno()) } else { Ok(()) }
}

/// One datagram from the socket into `buf`; `Ok(0)`: none waiting (non-blocking).
fn recv(fd: &OwnedFd, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: a valid socket and a writable buffer of `buf.len()` bytes.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n >= 0 {
        return Ok((n as usize).min(buf.len()));
    }
    let e = errno();
    match e.kind() {
        std::io::ErrorKind::WouldBlock => Ok(0),
        _ => Err(e),
    }
}

/// Waits until `fd` is readable, at most `wait` (< 1 s; a signal or an error ends it early:
/// callers loop and read, which tells them).
fn wait_readable(fd: &OwnedFd, wait: Duration) {
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: wait.min(Duration::from_millis(999)).as_nanos() as _,
    };
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a valid timespec, no signal mask.
    unsafe { libc::ppoll(&raw mut p, 1, &raw const ts, std::ptr::null()) };
}

/// Sends a configuration request and waits (≤ 2 s) for its acknowledgement.
fn request(fd: &OwnedFd, seq: u32, queue: u16, attrs: &[(u16, &[u8])]) -> Result<(), String> {
    let msg = message(NFQNL_MSG_CONFIG, NLM_F_ACK, seq, queue, attrs);
    send(fd, &msg).map_err(|e| format!("netlink send: {e}"))?;
    let mut buf = vec![0u8; 8192];
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        let n = recv(fd, &mut buf).map_err(|e| format!("netlink recv: {e}"))?;
        if n == 0 {
            wait_readable(fd, Duration::from_millis(20));
            continue;
        }
        for m in parse(&buf[..n]) {
            match m {
                Msg::Ack { seq: s, errno: 0 } if s == seq => return Ok(()),
                Msg::Ack { seq: s, errno } if s == seq => {
                    return Err(format!(
                        "the kernel refused the NFQUEUE configuration: {}",
                        std::io::Error::from_raw_os_error(errno.wrapping_neg())
                    ));
                }
                _ => {}
            }
        }
    }
    Err("no answer from the kernel to an NFQUEUE configuration request".into())
}

/// In the calling thread: enters the namespace, opens the netlink socket there, binds `queue`.
fn bind(netns_path: &str, queue: u16) -> Result<OwnedFd, String> {
    let ns = std::fs::File::open(netns_path).map_err(|e| format!("{netns_path}: {e}"))?;
    // SAFETY: setns on an open namespace file, for this thread only (CLONE_NEWNET is allowed
    // in a multi-threaded process); socket() returns a new descriptor we own.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("setns {netns_path}: {}", errno()));
    }
    // SAFETY: plain socket(2); the descriptor is checked and owned just below.
    let raw = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW, NETLINK_NETFILTER) };
    if raw < 0 {
        return Err(format!("netlink socket: {}", errno()));
    }
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let size: libc::c_int = 4 << 20;
    // SAFETY: a valid socket and an int option. A larger buffer is only an optimisation
    // (an overflow is fail-open), so its result is not checked.
    unsafe {
        libc::setsockopt(
            raw,
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&raw const size).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        );
    }
    let mut me: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    me.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: binding a valid socket to a zeroed sockaddr_nl (the kernel picks the port id).
    let r = unsafe {
        libc::bind(
            raw,
            (&raw const me).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if r != 0 {
        return Err(format!("netlink bind: {}", errno()));
    }
    let cmd = [NFQNL_CFG_CMD_BIND, 0, 0, libc::AF_INET as u8];
    request(&fd, 1, queue, &[(NFQA_CFG_CMD, &cmd)]).map_err(|e| {
        format!("{e} (binding queue {queue}: the kernel needs CONFIG_NETFILTER_NETLINK_QUEUE)")
    })?;
    let mut params = [0u8; 5];
    params[4] = NFQNL_COPY_META;
    let flags = NFQA_CFG_F_FAIL_OPEN.to_be_bytes();
    request(
        &fd,
        2,
        queue,
        &[
            (NFQA_CFG_PARAMS, &params),
            (NFQA_CFG_QUEUE_MAXLEN, &KERNEL_QUEUE_MAXLEN.to_be_bytes()),
            (NFQA_CFG_FLAGS, &flags),
            (NFQA_CFG_MASK, &flags),
        ],
    )?;
    Ok(fd)
}

fn release(fd: &OwnedFd, queue: u16, ids: &[u32], stats: &Stats) {
    for &id in ids {
        match send(fd, &accept(queue, id)) {
            Ok(()) => stats.released.fetch_add(1, Ordering::Relaxed),
            Err(_) => stats.errors.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// The agent's loop: read every waiting packet notice, release what is due, sleep in
/// `ppoll` until the next release or a notice (≤ 20 ms, to see `stop`).
fn serve(fd: &OwnedFd, queue: u16, mut hold: Hold, stop: &AtomicBool, stats: &Stats) {
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::SeqCst) {
        // At most 256 datagrams before the releases: a flood cannot starve them.
        for _ in 0..256 {
            match recv(fd, &mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let now = Instant::now();
                    for m in parse(&buf[..n]) {
                        match m {
                            Msg::Packet(id) => {
                                if hold.push(id, now) {
                                    stats.held.fetch_add(1, Ordering::Relaxed);
                                } else {
                                    stats.overflow.fetch_add(1, Ordering::Relaxed);
                                    release(fd, queue, &[id], stats);
                                }
                            }
                            Msg::Ack { errno, .. } if errno != 0 => {
                                stats.errors.fetch_add(1, Ordering::Relaxed);
                            }
                            Msg::Malformed => {
                                stats.errors.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {}
                        }
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    stats.missed.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    stats.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
        let now = Instant::now();
        release(fd, queue, &hold.due(now), stats);
        let wait = hold
            .next_due()
            .map_or(Duration::from_millis(20), |t| {
                t.saturating_duration_since(now)
            })
            .min(Duration::from_millis(20));
        wait_readable(fd, wait);
    }
    let rest = hold.drain();
    release(fd, queue, &rest, stats);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_is_laid_out_as_the_kernel_reads_it() {
        let v = accept(7946, 0x0102_0304);
        assert_eq!(v.len(), 16 + 4 + 12);
        assert_eq!(u32_at(&v, 0), Some(32));
        assert_eq!(u16_at(&v, 4), Some(0x0301));
        assert_eq!(u16_at(&v, 6), Some(NLM_F_REQUEST));
        assert_eq!(&v[16..20], &[0, 0, 0x1f, 0x0a]); // AF_UNSPEC, v0, queue 7946 BE
        assert_eq!(u16_at(&v, 20), Some(12));
        assert_eq!(u16_at(&v, 22), Some(NFQA_VERDICT_HDR));
        assert_eq!(&v[24..32], &[0, 0, 0, 1, 1, 2, 3, 4]);
        // An attribute of 5 bytes is padded to 8; the header's length covers the padding.
        let c = message(NFQNL_MSG_CONFIG, NLM_F_ACK, 9, 1, &[(2, &[0, 0, 0, 0, 1])]);
        assert_eq!(c.len(), 16 + 4 + 12);
        assert_eq!(u16_at(&c, 6), Some(NLM_F_REQUEST | NLM_F_ACK));
        assert_eq!(u32_at(&c, 8), Some(9));
        assert_eq!(u16_at(&c, 20), Some(9));
    }

    /// A packet message as the kernel sends it: nfgenmsg, a mark attribute, the packet header.
    fn packet(id: u32) -> Vec<u8> {
        let mut hdr = id.to_be_bytes().to_vec();
        hdr.extend_from_slice(&[0x08, 0x00, 1]);
        message(
            NFQNL_MSG_PACKET,
            0,
            0,
            5,
            &[(3, &[0, 0, 0, 7]), (NFQA_PACKET_HDR, &hdr)],
        )
    }

    #[test]
    fn packets_and_acks_parse_and_malformed_lengths_stop_the_walk() {
        let mut d = packet(41);
        d.extend(packet(42));
        let mut ack = vec![0u8; 36];
        ack[..4].copy_from_slice(&36u32.to_ne_bytes());
        ack[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        ack[8..12].copy_from_slice(&3u32.to_ne_bytes());
        ack[16..20].copy_from_slice(&(-1i32).to_ne_bytes());
        d.extend(&ack);
        assert_eq!(
            parse(&d),
            vec![
                Msg::Packet(41),
                Msg::Packet(42),
                Msg::Ack { seq: 3, errno: -1 }
            ]
        );
        let mut bad = packet(1);
        bad[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert_eq!(parse(&bad), vec![Msg::Malformed]);
        let mut short_attr = packet(1);
        short_attr[20..22].copy_from_slice(&2u16.to_ne_bytes());
        assert_eq!(parse(&short_attr), vec![Msg::Malformed]);
        assert!(parse(&[]).is_empty());
        assert!(parse(&[1, 2, 3]).is_empty());
    }

    #[test]
    fn hostile_bytes_never_panic_and_stay_bounded() {
        let mut rng = 0x5EEDu64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let seed = packet(7);
        for i in 0..50_000 {
            let mut b = if i % 2 == 0 {
                seed.clone()
            } else {
                (0..(next() % 200)).map(|_| next() as u8).collect()
            };
            for _ in 0..(next() % 6) {
                if !b.is_empty() {
                    let k = (next() as usize) % b.len();
                    b[k] = next() as u8;
                }
            }
            if next() % 4 == 0 {
                b.truncate((next() as usize) % (b.len() + 1));
            }
            let msgs = parse(&b);
            assert!(msgs.len() <= b.len() / NLMSG_HDRLEN + 1);
        }
    }

    #[test]
    fn the_hold_keeps_arrival_order_releases_on_time_and_is_bounded() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut h = Hold::new(ms(50), ms(10), 3);
        for id in 0..100 {
            assert!(h.push(id, t0 + ms(id as u64)));
        }
        assert!(h.due(t0 + ms(39)).is_empty());
        let mut out = h.due(t0 + ms(60));
        assert!(!out.is_empty() && out.len() <= 21, "{}", out.len());
        out.extend(h.due(t0 + ms(1000)));
        assert_eq!(out, (0..100).collect::<Vec<_>>());
        assert!(h.is_empty());
        // Without jitter: exactly the delay.
        let mut h = Hold::new(ms(50), Duration::ZERO, 1);
        h.push(1, t0);
        assert_eq!(h.next_due(), Some(t0 + ms(50)));
        // Full: refused (the caller accepts at once), nothing lost from the hold.
        let mut h = Hold::new(ms(50), Duration::ZERO, 1);
        assert!((0..HOLD_MAX as u32).all(|id| h.push(id, t0)));
        assert!(!h.push(u32::MAX, t0));
        assert_eq!(h.drain(), (0..HOLD_MAX as u32).collect::<Vec<_>>());
        assert!(h.push(1, t0));
    }

    #[test]
    fn jitter_stays_within_its_bounds_and_varies() {
        let mut h = Hold::new(Duration::from_millis(50), Duration::from_millis(10), 99);
        let s: Vec<Duration> = (0..2000).map(|_| h.sample()).collect();
        let (lo, hi) = (s.iter().min().unwrap(), s.iter().max().unwrap());
        assert!(*lo >= Duration::from_millis(40) && *hi <= Duration::from_millis(60));
        assert!(*hi - *lo > Duration::from_millis(15), "{lo:?}..{hi:?}");
    }
}
