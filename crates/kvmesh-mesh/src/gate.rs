//! The order in which a peer's state reaches the router: a peer's marks before the in-flight
//! counts that came with them or after them.
//!
//! Peers' counts take the short way (set on the router straight from the node's thread, see
//! [`crate::node::LoadLink`]); marks take the long one (the router's apply task, in order with
//! every other [`Apply`]). A router that saw the count of a peer's request for a new prompt
//! before that request's mark would take the engine for busier than it is, and send a
//! sibling of the prompt elsewhere. So while marks wait in the apply queue, [`MarkGate`] holds
//! the counts that arrive (the newest per engine) and lets them through once the router has
//! applied those marks ([`Applies::recv`] tells it: the router asks for the next change only
//! when it has applied the last one), or once they have waited [`MAX_HOLD`]: a router whose
//! apply queue never empties (marks arriving as fast as it applies them) still gets its
//! peers' counts, at most that late.

use crate::core::Apply;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The longest a peer's count is held behind marks (a sibling's mark is applied within
/// microseconds of its arrival on a router that keeps up; this bounds how stale the counts
/// get on one that does not).
pub const MAX_HOLD: Duration = Duration::from_millis(1);

/// Sets the other routers' total on an engine (the router's side of the short way).
pub type SetPeers = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// Holds peers' counts while marks that came before them wait to be applied.
pub struct MarkGate {
    set: SetPeers,
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    /// Marks queued for the router and not yet applied.
    pending: usize,
    /// Counts held meanwhile: (engine, others), one per engine, the newest.
    held: Vec<(u64, u64)>,
    /// Since when the oldest held count waits.
    since: Option<Instant>,
    /// The router stopped reading its changes: nothing is held any more.
    open: bool,
}

impl MarkGate {
    /// A gate in front of `set`.
    pub fn new(set: SetPeers) -> MarkGate {
        MarkGate {
            set,
            state: Mutex::new(GateState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A peer count: set now when no mark waits (or the held ones waited [`MAX_HOLD`]), else
    /// held (replacing an older one of the engine).
    pub fn count(&self, engine: u64, others: u64) {
        let mut g = self.lock();
        if g.pending == 0 || g.open || g.since.is_some_and(|t| t.elapsed() >= MAX_HOLD) {
            self.release(&mut g);
            (self.set)(engine, others);
        } else if let Some(h) = g.held.iter_mut().find(|h| h.0 == engine) {
            h.1 = others;
        } else {
            g.held.push((engine, others));
            g.since.get_or_insert_with(Instant::now);
        }
    }

    /// A mark goes into the router's queue.
    pub fn mark_queued(&self) {
        self.lock().pending += 1;
    }

    /// A queued mark was applied (or dropped): the held counts go once none waits.
    pub fn mark_done(&self) {
        let mut g = self.lock();
        g.pending = g.pending.saturating_sub(1);
        if g.pending == 0 || g.since.is_some_and(|t| t.elapsed() >= MAX_HOLD) {
            self.release(&mut g);
        }
    }

    /// Nothing is held from now on (the router no longer applies changes).
    fn open(&self) {
        let mut g = self.lock();
        g.open = true;
        self.release(&mut g);
    }

    fn release(&self, g: &mut GateState) {
        g.since = None;
        // In the order they first arrived; under the lock, so no newer count overtakes.
        for (engine, others) in g.held.drain(..) {
            (self.set)(engine, others);
        }
    }

    /// Counts held now.
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }
}

/// The changes the router applies, in order. Read them one at a time: asking for the next
/// one says the last one is applied (a mark's held counts are released then).
pub struct Applies {
    rx: mpsc::Receiver<Apply>,
    gate: Option<Arc<MarkGate>>,
    /// The last change handed out was a mark the gate counts.
    holding: bool,
}

impl Applies {
    pub(crate) fn new(rx: mpsc::Receiver<Apply>, gate: Option<Arc<MarkGate>>) -> Applies {
        Applies {
            rx,
            gate,
            holding: false,
        }
    }

    fn done(&mut self) {
        if std::mem::take(&mut self.holding)
            && let Some(g) = &self.gate
        {
            g.mark_done();
        }
    }

    fn took(&mut self, a: &Apply) {
        self.holding = self.gate.is_some() && matches!(a, Apply::Mark(_));
    }

    /// The next change (the last one is applied); `None` once the node has stopped.
    pub async fn recv(&mut self) -> Option<Apply> {
        self.done();
        let a = self.rx.recv().await?;
        self.took(&a);
        Some(a)
    }

    /// The next change if one waits (the last one is applied).
    pub fn try_recv(&mut self) -> Result<Apply, mpsc::error::TryRecvError> {
        self.done();
        let a = self.rx.try_recv()?;
        self.took(&a);
        Ok(a)
    }
}

impl Drop for Applies {
    fn drop(&mut self) {
        if let Some(g) = &self.gate {
            g.open();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_state::MarkDelta;

    type Seen = Arc<Mutex<Vec<(u64, u64)>>>;

    fn recorder() -> (SetPeers, Seen) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        (
            Arc::new(move |e, o| s.lock().expect("seen").push((e, o))),
            seen,
        )
    }

    fn mark() -> Apply {
        Apply::Mark(MarkDelta {
            engine: 7,
            keys: vec![1],
            expiry_us: 10,
        })
    }

    #[test]
    fn counts_pass_at_once_without_a_waiting_mark() {
        let (set, seen) = recorder();
        let g = MarkGate::new(set);
        g.count(7, 3);
        assert_eq!(*seen.lock().expect("seen"), [(7, 3)]);
    }

    #[tokio::test]
    async fn counts_wait_until_the_router_has_applied_the_marks_before_them() {
        let (set, seen) = recorder();
        let g = Arc::new(MarkGate::new(set));
        let (tx, rx) = mpsc::channel(8);
        let mut applies = Applies::new(rx, Some(g.clone()));
        // Two marks queued, then counts: held, the newest per engine, first-arrival order.
        for _ in 0..2 {
            g.mark_queued();
            tx.send(mark()).await.expect("send");
        }
        g.count(7, 1);
        g.count(9, 4);
        g.count(7, 2);
        assert!(seen.lock().expect("seen").is_empty());
        assert_eq!(g.held(), 2);
        // The router takes the first mark: not applied yet, nothing moves.
        assert!(matches!(applies.recv().await, Some(Apply::Mark(_))));
        assert!(seen.lock().expect("seen").is_empty());
        // It asks for the next: the first is applied, the second still waits.
        assert!(matches!(applies.try_recv(), Ok(Apply::Mark(_))));
        assert!(seen.lock().expect("seen").is_empty());
        // Asking again: both applied, the counts go.
        assert!(applies.try_recv().is_err());
        assert_eq!(*seen.lock().expect("seen"), [(7, 2), (9, 4)]);
        g.count(7, 0);
        assert_eq!(seen.lock().expect("seen").last(), Some(&(7, 0)));
    }

    #[test]
    fn a_count_waits_no_longer_than_the_bound_when_marks_keep_coming() {
        let (set, seen) = recorder();
        let g = MarkGate::new(set);
        g.mark_queued();
        g.count(7, 1);
        assert!(seen.lock().expect("seen").is_empty());
        // Marks keep the queue from ever emptying; past the bound the next count (or the
        // next mark applied) lets every held one through.
        std::thread::sleep(MAX_HOLD);
        g.mark_queued();
        g.count(9, 2);
        assert_eq!(*seen.lock().expect("seen"), [(7, 1), (9, 2)]);
        g.count(7, 3);
        assert_eq!(
            seen.lock().expect("seen").len(),
            2,
            "held again: a mark still waits"
        );
        std::thread::sleep(MAX_HOLD);
        g.mark_done();
        assert_eq!(seen.lock().expect("seen").last(), Some(&(7, 3)));
    }

    #[test]
    fn a_router_that_stops_reading_holds_nothing() {
        let (set, seen) = recorder();
        let g = Arc::new(MarkGate::new(set));
        let (_tx, rx) = mpsc::channel(8);
        let applies = Applies::new(rx, Some(g.clone()));
        g.mark_queued();
        g.count(7, 1);
        assert!(seen.lock().expect("seen").is_empty());
        drop(applies);
        assert_eq!(*seen.lock().expect("seen"), [(7, 1)]);
        g.count(7, 2);
        assert_eq!(seen.lock().expect("seen").len(), 2);
    }
}
