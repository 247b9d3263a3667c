//! SCRATCH: decision slots. Meshed routers take turns deciding: time is cut into cycles of
//! `routers` slots of `KVMESH_SLOT_US` µs; router of rank r decides only during the first
//! `KVMESH_SLOT_OPEN_US` µs of slot r (the rest is a guard for its placements to reach the
//! others). A request arriving outside waits for the next opening, released by one timer
//! thread.

use std::collections::BinaryHeap;
use std::cmp::Reverse;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

struct Entry(u64, Waker);
impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.cmp(&o.0)
    }
}

pub struct Gate {
    slot_ns: u64,
    open_ns: u64,
    min_ns: u64,
    heap: Mutex<BinaryHeap<Reverse<Entry>>>,
    cv: Condvar,
}

pub fn gate() -> Option<&'static Arc<Gate>> {
    static G: OnceLock<Option<Arc<Gate>>> = OnceLock::new();
    G.get_or_init(|| {
        let slot: u64 = std::env::var("KVMESH_SLOT_US").ok()?.parse().ok()?;
        let min: u64 = std::env::var("KVMESH_SLOT_MIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let open: u64 = std::env::var("KVMESH_SLOT_OPEN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(slot / 2);
        let g = Arc::new(Gate {
            slot_ns: slot * 1000,
            min_ns: min * 1000,
            open_ns: open.min(slot) * 1000,
            heap: Mutex::new(BinaryHeap::new()),
            cv: Condvar::new(),
        });
        let t = g.clone();
        std::thread::Builder::new()
            .name("kvmesh-slots".into())
            .spawn(move || {
                let _ = kvmesh_mesh::realtime::raise_current_thread(1);
                t.run()
            })
            .ok()?;
        Some(g)
    })
    .as_ref()
}

impl Gate {
    fn run(&self) {
        let mut h = self.heap.lock().unwrap();
        loop {
            let now = now_ns();
            while let Some(Reverse(Entry(at, _))) = h.peek() {
                if *at <= now {
                    let Reverse(Entry(_, w)) = h.pop().unwrap();
                    w.wake();
                } else {
                    break;
                }
            }
            h = match h.peek() {
                None => self.cv.wait(h).unwrap(),
                Some(Reverse(Entry(at, _))) => {
                    let d = Duration::from_nanos(at.saturating_sub(now));
                    self.cv.wait_timeout(h, d).unwrap().0
                }
            };
        }
    }

    /// When this router may decide next (`None`: now).
    fn open_at(&self, rank: u32, routers: u32) -> Option<u64> {
        let now = now_ns() + self.min_ns;
        if self.slot_ns == 0 {
            return (self.min_ns > 0).then_some(now);
        }
        let cycle = self.slot_ns * u64::from(routers);
        let start = u64::from(rank) * self.slot_ns;
        let pos = now % cycle;
        if pos >= start && pos < start + self.open_ns {
            return (self.min_ns > 0).then_some(now);
        }
        let base = now - pos;
        let next = if pos < start { base + start } else { base + cycle + start };
        Some(next)
    }

    /// SCRATCH stats: whether now is inside this router's open window; `late` ns past `at`.
    pub fn check(&self, rank: u32, routers: u32, at: Option<u64>) {
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        static N: AtomicU64 = AtomicU64::new(0);
        static OUT: AtomicU64 = AtomicU64::new(0);
        static WAITED: AtomicU64 = AtomicU64::new(0);
        static LATE_SUM: AtomicU64 = AtomicU64::new(0);
        static LATE_50: AtomicU64 = AtomicU64::new(0);
        if routers < 2 || self.slot_ns == 0 {
            return;
        }
        let now = now_ns();
        let cycle = self.slot_ns * u64::from(routers);
        let start = u64::from(rank) * self.slot_ns;
        let pos = now % cycle;
        let inside = pos >= start && pos < start + self.open_ns;
        let n = N.fetch_add(1, Relaxed) + 1;
        if !inside {
            OUT.fetch_add(1, Relaxed);
        }
        if let Some(at) = at {
            WAITED.fetch_add(1, Relaxed);
            let late = now.saturating_sub(at);
            LATE_SUM.fetch_add(late, Relaxed);
            if late > 50_000 {
                LATE_50.fetch_add(1, Relaxed);
            }
        }
        if n % 1000 == 0 {
            let w = WAITED.load(Relaxed).max(1);
            eprintln!(
                "slots: decisions {n}, outside window {}, waited {}, mean late {} us, late > 50 us {}",
                OUT.load(Relaxed),
                w,
                LATE_SUM.load(Relaxed) / w / 1000,
                LATE_50.load(Relaxed)
            );
        }
    }

    /// Waits for this router's next opening.
    pub fn wait(&'static self, rank: u32, routers: u32) -> Wait {
        Wait {
            gate: self,
            at: if routers > 1 { self.open_at(rank, routers) } else { None },
        }
    }
}

pub struct Wait {
    gate: &'static Gate,
    pub at: Option<u64>,
}

impl Future for Wait {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.at {
            None => Poll::Ready(()),
            Some(at) if now_ns() >= at => Poll::Ready(()),
            Some(at) => {
                let mut h = self.gate.heap.lock().unwrap();
                h.push(Reverse(Entry(at, cx.waker().clone())));
                drop(h);
                self.gate.cv.notify_one();
                Poll::Pending
            }
        }
    }
}
