//! The real-time driver of the engine model: one OS thread owns the [`Engine`], steps it, and
//! sleeps each step's simulated duration × `time_scale`.
//!
//! A thread (not a tokio task) because its sleeps are often below the tokio timer's 1 ms
//! granularity (a 6 ms decode step at `time_scale = 0.1` is 600 µs), and because the model's
//! CPU work must not stall the HTTP runtime.
//!
//! Virtual time: while the engine is busy, its clock advances by exactly each step's duration
//! (the model's own time); when it is idle and a request arrives, the clock catches up with
//! the wall clock divided by the time scale, at the moment the request was sent. A request's arrival is stamped with the wall-derived
//! virtual time at which the HTTP handler sent it, clamped into the step during which it
//! arrived, so TTFT includes the wait for the current step to end, as in vLLM.

use crate::events::EventSink;
use crate::metrics::SimMetrics;
use kvmesh_engine::{
    AdmitError, Engine, EngineParams, FinishedRequest, Micros, RequestId, RequestSpec,
};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// What a request's handler receives from the engine.
#[derive(Debug)]
pub enum ReqEvent {
    /// One generated token.
    Token {
        /// Token id.
        token: u32,
    },
    /// The request finished; the last event.
    Done(FinishedRequest),
    /// The engine dropped the request (restart); the last event.
    Failed(String),
}

/// Commands to the engine thread.
pub enum Command {
    /// Admit a request; `admitted` answers at once, then events flow on `events`.
    Add {
        spec: RequestSpec,
        sent_at: Instant,
        events: mpsc::UnboundedSender<ReqEvent>,
        admitted: oneshot::Sender<Result<(), AdmitError>>,
    },
    /// The client went away.
    Abort(RequestId),
    /// `POST /reset_prefix_cache`.
    ResetPrefixCache(oneshot::Sender<bool>),
    /// Simulated restart: new engine (empty cache, new hash seed), live requests fail, KV-event
    /// seq back to 0.
    Restart(oneshot::Sender<()>),
    /// Fault: step durations × factor.
    SetSlowdown(f64),
    /// Fault: stop stepping (requests hang) or resume.
    SetHang(bool),
    /// The cache content (for `/admin/kv_cache`).
    DumpCache(oneshot::Sender<Vec<kvmesh_engine::CachedBlock>>),
    /// Stop the thread.
    Shutdown,
}

struct Live {
    events: mpsc::UnboundedSender<ReqEvent>,
}

/// The engine thread's state.
pub struct EngineThread {
    params: EngineParams,
    engine: Engine,
    restarts: u64,
    live: std::collections::HashMap<RequestId, Live>,
    rx: Receiver<Command>,
    events: Option<EventSink>,
    metrics: Arc<SimMetrics>,
    stats: Arc<Mutex<kvmesh_engine::EngineStats>>,
    time_scale: f64,
    t0: Instant,
    /// Virtual now (µs).
    v: Micros,
    /// Virtual start of the step in progress (arrival clamp).
    step_start: Micros,
    slowdown: f64,
    hang: bool,
    /// Whether the last loop iteration stepped: the clock is then the model's own time.
    busy: bool,
}

/// Handle used by the HTTP side.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    stats: Arc<Mutex<kvmesh_engine::EngineStats>>,
}

impl EngineHandle {
    /// Sends a command; false when the engine thread is gone.
    pub fn send(&self, cmd: Command) -> bool {
        self.tx.send(cmd).is_ok()
    }

    /// The engine's counters after its last step.
    pub fn stats(&self) -> kvmesh_engine::EngineStats {
        match self.stats.lock() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
}

/// Starts the engine thread.
pub fn spawn(
    params: EngineParams,
    time_scale: f64,
    slowdown: f64,
    hang: bool,
    events: Option<EventSink>,
    metrics: Arc<SimMetrics>,
) -> std::io::Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut engine = Engine::new(params.clone());
    engine.set_slowdown(slowdown);
    let stats = Arc::new(Mutex::new(engine.stats()));
    let mut th = EngineThread {
        params,
        engine,
        restarts: 0,
        live: Default::default(),
        rx,
        events,
        metrics,
        stats: stats.clone(),
        time_scale,
        t0: Instant::now(),
        v: 0,
        step_start: 0,
        slowdown,
        hang,
        busy: false,
    };
    let join = std::thread::Builder::new()
        .name("kvmesh-engine".into())
        .spawn(move || th.run())?;
    Ok((EngineHandle { tx, stats }, join))
}

impl EngineThread {
    fn wall_v(&self, at: Instant) -> Micros {
        let real = at.saturating_duration_since(self.t0).as_secs_f64();
        (real * 1e6 / self.time_scale) as Micros
    }

    fn deadline(&self) -> Instant {
        self.t0 + Duration::from_secs_f64(self.v as f64 * self.time_scale / 1e6)
    }

    fn run(&mut self) {
        loop {
            // Take every pending command without blocking.
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                }
            }
            if self.engine.has_work() && !self.hang {
                self.step();
                self.busy = true;
                continue;
            }
            self.busy = false;
            // Idle (or hung): block for the next command. When hung with work pending, wake
            // regularly so that clearing the fault resumes promptly.
            let wait = if self.hang {
                Duration::from_millis(20)
            } else {
                Duration::from_secs(3600)
            };
            match self.rx.recv_timeout(wait) {
                Ok(cmd) => {
                    if !self.handle(cmd) {
                        return;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn step(&mut self) {
        self.step_start = self.v;
        let out = self.engine.step(self.v);
        self.v += out.duration_us;
        let deadline = self.deadline();
        let now = Instant::now();
        if deadline > now {
            std::thread::sleep(deadline - now);
        }
        self.metrics.observe_step(&out);
        for t in out.tokens {
            if let Some(l) = self.live.get(&t.id)
                && l.events.send(ReqEvent::Token { token: t.token }).is_err()
            {
                // The handler is gone: the client disconnected. Free the engine's work.
                self.live.remove(&t.id);
                self.engine.abort(t.id);
                self.metrics.aborted();
            }
        }
        for f in out.finished {
            self.metrics.observe_finished(&f);
            if let Some(l) = self.live.remove(&f.id) {
                let _ = l.events.send(ReqEvent::Done(f));
            }
        }
        if let Some(sink) = &self.events {
            sink.publish(out.events);
        }
        self.publish_stats();
    }

    fn publish_stats(&self) {
        let s = self.engine.stats();
        self.metrics.set_engine_stats(&s);
        match self.stats.lock() {
            Ok(mut g) => *g = s,
            Err(p) => *p.into_inner() = s,
        }
    }

    /// Handles one command; false = shut down.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add {
                spec,
                sent_at,
                events,
                admitted,
            } => {
                let id = spec.id;
                // Stamp the arrival inside the step during which it was sent.
                let arrival = if self.busy {
                    self.wall_v(sent_at).clamp(self.step_start, self.v)
                } else {
                    // An idle engine wakes up at the arrival: the clock catches up here, so
                    // the time the command spent in transit is not counted as model time.
                    self.v = self.v.max(self.wall_v(sent_at));
                    self.v
                };
                let res = self.engine.add_request(spec, arrival);
                if res.is_ok() {
                    self.live.insert(id, Live { events });
                }
                let _ = admitted.send(res);
                self.publish_stats();
            }
            Command::Abort(id) => {
                if self.live.remove(&id).is_some() && self.engine.abort(id) {
                    self.metrics.aborted();
                    self.publish_stats();
                }
            }
            Command::ResetPrefixCache(reply) => {
                let ok = self.engine.reset_prefix_cache();
                if ok {
                    self.flush_events();
                }
                self.publish_stats();
                let _ = reply.send(ok);
            }
            Command::Restart(reply) => {
                self.restarts += 1;
                let mut params = self.params.clone();
                params.seed = params
                    .seed
                    .wrapping_add(self.restarts.wrapping_mul(0x9E37_79B9));
                self.engine = Engine::new(params);
                self.engine.set_slowdown(self.slowdown);
                for (_, l) in self.live.drain() {
                    let _ = l
                        .events
                        .send(ReqEvent::Failed("the engine restarted".to_string()));
                }
                if let Some(sink) = &self.events {
                    sink.restarted();
                }
                self.metrics.restarted();
                self.publish_stats();
                let _ = reply.send(());
            }
            Command::SetSlowdown(f) => {
                self.slowdown = f;
                self.engine.set_slowdown(f);
            }
            Command::SetHang(h) => self.hang = h,
            Command::DumpCache(reply) => {
                let _ = reply.send(self.engine.cached_blocks());
            }
            Command::Shutdown => return false,
        }
        true
    }

    /// Events produced outside a step (cache reset) go out at once as their own batch.
    fn flush_events(&mut self) {
        let events = self.engine.take_events();
        if let Some(sink) = &self.events {
            sink.publish(events);
        }
    }
}
