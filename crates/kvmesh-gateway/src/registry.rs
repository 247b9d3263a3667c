//! The engines this router knows, and the routing snapshot built from them.
//!
//! Membership changes (start-up list, admin API, DNS, model discovery) go through
//! [`Registry`], which rebuilds an immutable [`Snapshot`] — per model: its engines and a
//! prepared policy — and swaps it in atomically. The request path only loads the current
//! snapshot (one atomic load, no lock) and reads per-engine counters.

use crate::clock::Clock;
use crate::engine::{Engine, LoadSignal, Source};
use crate::prefix::{PrefixState, RoutePrefix};
use arc_swap::ArcSwap;
use kvmesh_config::{EngineEntry, ServeConfig};
use kvmesh_policy::{
    EngineMember, EngineSet, EngineTracker, EngineView, Policy, PolicyConfig, stable_hash,
};
use kvmesh_policy::{Reason, RouterSlot, Totals};
use kvmesh_prefix::EngineId;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The engines of one model and its prepared policy.
pub struct ModelRoute {
    /// Model name.
    pub model: String,
    /// Engines serving it (indices of the policy's picks).
    pub engines: Vec<Arc<Engine>>,
    /// The prepared policy.
    pub policy: Policy,
    /// The policy's config (its name labels metrics; its hash settings pick the key).
    pub policy_cfg: PolicyConfig,
    /// Tokenizer, block size and slot map when the policy is cache-aware.
    pub prefix: Option<Arc<RoutePrefix>>,
    /// Its fleet totals, kept between decisions.
    pub totals: TotalsCache,
    /// Per engine, the context length (`max_model_len`) it lists for this model; 0 when
    /// unknown.
    pub context: Vec<u32>,
    /// Whether the known context lengths differ: only then does a decision need the
    /// request's length (see [`RouteView::need_tokens`]).
    pub context_differs: bool,
    /// The longest context of its engines when every one listed its own, else 0.
    pub context_max: u32,
    /// Its `kvmesh_routing_decisions_total` series, one per [`Reason`] (atomic handles taken
    /// at rebuild: counting a decision touches no lock).
    pub decisions: Vec<Counter>,
}

impl ModelRoute {
    /// Counts one decision.
    pub fn count_decision(&self, reason: Reason) {
        if let Some(c) = self.decisions.get(reason.index()) {
            c.inc();
        }
    }
}

/// Labels of `kvmesh_routing_decisions_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The model.
    pub model: String,
    /// The policy.
    pub policy: &'static str,
    /// Why the first candidate was chosen.
    pub reason: &'static str,
}

/// What a request reads: immutable, swapped whole.
pub struct Snapshot {
    /// Increases with every rebuild.
    pub version: u64,
    /// Every engine, in registry order.
    pub engines: Vec<Arc<Engine>>,
    /// Routes by model name.
    pub routes: BTreeMap<String, Arc<ModelRoute>>,
    /// Some route is cache-aware: request bodies are parsed whole once (model, user and the
    /// prompt), rather than peeked for the model and parsed again for the prompt.
    pub any_prefix_route: bool,
}

/// A route's engines as a policy reads them, at one instant.
pub struct RouteView<'a> {
    /// The engines.
    pub engines: &'a [Arc<Engine>],
    /// Now (µs).
    pub now_us: u64,
    /// The fleet's median latency (µs), 0 when unknown.
    pub fleet_latency_us: f64,
    /// The route's fleet totals, kept between decisions.
    pub totals: &'a TotalsCache,
    /// Per engine, its context length for the route's model (0: unknown).
    pub context: &'a [u32],
    /// The request's prompt plus completion tokens, as the engine counts them against its
    /// context length (0: not known). An engine whose known context is shorter is not
    /// eligible: it would refuse the request (vLLM's 400), where another engine of the model
    /// serves it. When none is long enough, the policy's rule for an all-ineligible fleet
    /// applies and an engine gives the real error.
    pub need_tokens: u32,
}

impl RouteView<'_> {
    /// Whether engine `i` is known too short for the request.
    fn too_short(&self, i: usize) -> bool {
        self.need_tokens > 0
            && self
                .context
                .get(i)
                .is_some_and(|&len| len != 0 && len < self.need_tokens)
    }
}

impl EngineSet for RouteView<'_> {
    fn len(&self) -> usize {
        self.engines.len()
    }

    fn view(&self, i: usize) -> EngineView {
        let mut v = self.engines[i].view(self.now_us, self.fleet_latency_us);
        if self.too_short(i) {
            v.eligible = false;
        }
        v
    }

    /// Exact for a small route (a scan of up to [`EXACT_TOTALS_UP_TO`] engines costs less than
    /// being wrong); beyond, the kept totals, refreshed by a scan at most once per
    /// [`TOTALS_REFRESH_US`] (by the decision that finds them older): a decision does not scan
    /// a large fleet.
    fn totals(&self) -> Totals {
        let scan = || {
            let mut t = Totals::default();
            for e in self.engines {
                let v = e.view(self.now_us, self.fleet_latency_us);
                if v.eligible {
                    t.eligible += 1;
                    t.load += u64::from(v.load());
                    t.weight += v.safe_weight();
                    t.base_weight += v.base_weight.max(1e-9);
                }
            }
            t
        };
        if self.engines.len() <= EXACT_TOTALS_UP_TO {
            scan()
        } else {
            self.totals.get(self.now_us, scan)
        }
    }
}

/// Routes of at most this many engines compute their totals exactly at each decision.
pub const EXACT_TOTALS_UP_TO: usize = 64;

/// How old the kept fleet totals may get before a decision rescans (µs).
pub const TOTALS_REFRESH_US: u64 = 1_000;

/// A route's fleet totals (eligible engines, Σ load, Σ weight) kept between decisions in
/// atomics: the load guard and bounded-load hashing read them without scanning the fleet; one
/// decision per [`TOTALS_REFRESH_US`] refreshes them (readers racing a refresh may mix a
/// field of each: they are a heuristic's mean, not an invariant).
#[derive(Debug, Default)]
pub struct TotalsCache {
    at_us: AtomicU64,
    eligible: AtomicU64,
    load: AtomicU64,
    weight_bits: AtomicU64,
    base_weight_bits: AtomicU64,
}

impl TotalsCache {
    /// The totals, refreshed with `scan` when older than [`TOTALS_REFRESH_US`] at `now_us`.
    pub fn get(&self, now_us: u64, scan: impl FnOnce() -> Totals) -> Totals {
        let at = self.at_us.load(Ordering::Acquire);
        let fresh = at != 0 && now_us.saturating_sub(at) < TOTALS_REFRESH_US;
        // One refresher at a time; the others use the kept values.
        if !fresh
            && self
                .at_us
                .compare_exchange(at, now_us.max(1), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            let t = scan();
            self.eligible.store(t.eligible as u64, Ordering::Relaxed);
            self.load.store(t.load, Ordering::Relaxed);
            self.base_weight_bits
                .store(t.base_weight.to_bits(), Ordering::Relaxed);
            self.weight_bits
                .store(t.weight.to_bits(), Ordering::Release);
            return t;
        }
        Totals {
            eligible: self.eligible.load(Ordering::Relaxed) as usize,
            load: self.load.load(Ordering::Relaxed),
            weight: f64::from_bits(self.weight_bits.load(Ordering::Acquire)),
            base_weight: f64::from_bits(self.base_weight_bits.load(Ordering::Relaxed)),
        }
    }
}

/// The engines in registration order, and by id.
#[derive(Default)]
struct Members {
    list: Vec<Arc<Engine>>,
    by_id: HashMap<EngineId, Arc<Engine>>,
    /// Removed engines, alive while requests to them run: one added again under the same id
    /// takes their count over ([`Engine::hand_count_to`]; it keeps the successor alive in turn).
    removed: HashMap<EngineId, std::sync::Weak<Engine>>,
}

/// The membership, the current snapshot, and what it is built from.
pub struct Registry {
    cfg: Arc<ServeConfig>,
    /// The prefix index and tokenizers (engine slots are allocated here).
    pub prefix: Arc<PrefixState>,
    clock: Clock,
    members: Mutex<Members>,
    snapshot: ArcSwap<Snapshot>,
    /// Serialises rebuilds: two concurrent ones (say, two engines' discoveries) could
    /// otherwise store their snapshots in the wrong order and leave a stale one in place.
    rebuilding: Mutex<()>,
    version: AtomicU64,
    /// Routing decisions by model, policy and reason (routes hold their series' handles).
    pub decisions: Family<DecisionLabels, Counter>,
    /// Median latency of the fleet (f64 bits), refreshed by the probe loop.
    fleet_latency_bits: AtomicU64,
    /// Where the engines tell that this router's in-flight count on them changed (the mesh).
    pub load_signal: Arc<LoadSignal>,
    /// The mesh's thread runs at real-time priority: peers' counts are not late, and an unset
    /// `least_request.own_bias` is 0 (see [`Registry::set_mesh_realtime`]).
    mesh_realtime: AtomicBool,
    /// This router's place among the mesh's live routers (see [`Registry::set_router_slot`]).
    router_slot: Mutex<RouterSlot>,
    /// The address the router's HTTP listener is bound to, once it is.
    listen: std::sync::OnceLock<std::net::SocketAddr>,
}

impl Registry {
    /// An empty registry.
    pub fn new(cfg: Arc<ServeConfig>, clock: Clock) -> Registry {
        Registry {
            prefix: Arc::new(PrefixState::new(&cfg)),
            cfg,
            clock,
            members: Mutex::new(Members::default()),
            snapshot: ArcSwap::from_pointee(Snapshot {
                version: 0,
                engines: Vec::new(),
                routes: BTreeMap::new(),
                any_prefix_route: false,
            }),
            rebuilding: Mutex::new(()),
            version: AtomicU64::new(0),
            decisions: Family::default(),
            fleet_latency_bits: AtomicU64::new(0f64.to_bits()),
            load_signal: Arc::default(),
            mesh_realtime: AtomicBool::new(false),
            router_slot: Mutex::new(RouterSlot::ALONE),
            listen: std::sync::OnceLock::new(),
        }
    }

    /// The router's HTTP listener is bound to `addr` (its port chosen by the system when the
    /// config's is 0).
    pub fn set_listen(&self, addr: std::net::SocketAddr) {
        let _ = self.listen.set(addr);
    }

    /// Refuses `url` (a canonical base URL) when it is this router's own address, wherever
    /// the engine comes from: requests would loop.
    pub fn refuse_own_address(&self, url: &str) -> Result<(), String> {
        let own = match self.listen.get() {
            Some(&addr) => kvmesh_config::is_listen_address(addr, url),
            None => self.cfg.is_own_address(url),
        };
        if own {
            return Err(format!(
                "{url} is this router's own listen address (requests would loop)"
            ));
        }
        Ok(())
    }

    /// The mesh started, its thread at real-time priority or not: the policies are rebuilt
    /// with the `own_bias` that follows when the config leaves it unset.
    pub fn set_mesh_realtime(&self, realtime: bool) {
        if self.mesh_realtime.swap(realtime, Ordering::Relaxed) != realtime {
            self.rebuild();
        }
    }

    /// The mesh's live routers changed: where this one stands among them. The policies are
    /// rebuilt with it, and `least_request` splits engines tied for least loaded between the
    /// routers by it ([`Policy::with_router_slot`]).
    pub fn set_router_slot(&self, slot: RouterSlot) {
        let changed = {
            let mut s = lock(&self.router_slot);
            std::mem::replace(&mut *s, slot) != slot
        };
        if changed {
            self.rebuild();
        }
    }

    /// Where this router stands among the mesh's live routers.
    pub fn router_slot(&self) -> RouterSlot {
        *lock(&self.router_slot)
    }

    /// The health configuration every tracker was built from.
    pub fn health_cfg(&self) -> &kvmesh_policy::HealthConfig {
        &self.cfg.routing.health
    }

    /// The current snapshot (lock-free).
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Adds an engine; `ramp` = slow start (engines added while running). Fails on a
    /// duplicate URL or a bad entry.
    pub fn add(
        &self,
        entry: &EngineEntry,
        source: Source,
        ramp: bool,
    ) -> Result<Arc<Engine>, String> {
        entry.validate("engine").map_err(|e| e.to_string())?;
        self.refuse_own_address(&kvmesh_config::canonical_base_url(&entry.url))?;
        let tracker = EngineTracker::new(&self.cfg.routing.health, self.clock.now_us(), ramp);
        // A refused engine drops its lease: the slot is retired and freed by the next sweep.
        let lease = PrefixState::lease(&self.prefix);
        let engine = Engine::new(
            entry,
            self.cfg.hide_engine_urls,
            source,
            tracker,
            lease,
            self.load_signal.clone(),
        )?;
        let engine = {
            let mut m = lock(&self.members);
            if m.by_id.contains_key(&engine.id) {
                // Dropping `engine` retires its slot.
                return Err(format!("engine {} is already registered", engine.url));
            }
            let engine = Arc::new(engine);
            if let Some(old) = m.removed.remove(&engine.id).and_then(|w| w.upgrade()) {
                old.hand_count_to(&engine);
            }
            m.by_id.insert(engine.id, engine.clone());
            m.list.push(engine.clone());
            engine
        };
        self.rebuild();
        Ok(engine)
    }

    /// Removes an engine by URL; its in-flight requests finish.
    pub fn remove(&self, url: &str) -> Option<Arc<Engine>> {
        let id = EngineId::from_url(url);
        let removed = {
            let mut m = lock(&self.members);
            let removed = m.by_id.remove(&id)?;
            m.list.retain(|e| e.id != id);
            m.removed.retain(|_, w| w.strong_count() > 0);
            m.removed.insert(id, Arc::downgrade(&removed));
            removed
        };
        removed.stop.cancel();
        self.rebuild();
        // Its slot is retired when the last reference (in-flight requests, its tasks) goes.
        Some(removed)
    }

    /// Sets an engine's configured weight and rebuilds the snapshot when it changed; the
    /// engine, or `None` if there is no such engine.
    pub fn set_weight(&self, id: EngineId, weight: f64) -> Option<Arc<Engine>> {
        let e = self.get(id)?;
        if e.set_base_weight(weight) {
            self.rebuild();
        }
        Some(e)
    }

    /// Every engine (the authoritative list).
    pub fn members(&self) -> Vec<Arc<Engine>> {
        lock(&self.members).list.clone()
    }

    /// Removed engines whose requests still run (they drain), by URL: not routed to, but
    /// shown with their in-flight counts so that a removal's drain can be watched (QA32).
    pub fn draining(&self) -> Vec<Arc<Engine>> {
        let mut d: Vec<Arc<Engine>> = {
            let m = lock(&self.members);
            m.removed
                .iter()
                .filter(|(id, _)| !m.by_id.contains_key(id))
                .filter_map(|(_, w)| w.upgrade())
                .collect()
        };
        d.retain(|e| e.in_flight.load(Ordering::Relaxed) > 0);
        d.sort_by(|a, b| a.url.cmp(&b.url));
        d
    }

    /// What the operator's views list: every engine, `"active"`, then the draining ones,
    /// `"draining"`.
    pub fn shown(&self) -> Vec<(Arc<Engine>, &'static str)> {
        let active = self.members().into_iter().map(|e| (e, "active"));
        active
            .chain(self.draining().into_iter().map(|e| (e, "draining")))
            .collect()
    }

    /// Number of engines.
    pub fn len(&self) -> usize {
        lock(&self.members).list.len()
    }

    /// Whether no engine is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The engine with this id.
    pub fn get(&self, id: EngineId) -> Option<Arc<Engine>> {
        lock(&self.members).by_id.get(&id).cloned()
    }

    /// Records discovered models and which of them are LoRA adapters; rebuilds when they
    /// changed.
    pub fn set_discovered_models(
        &self,
        engine: &Engine,
        mut models: Vec<String>,
        mut adapters: Vec<String>,
    ) -> bool {
        models.sort();
        models.dedup();
        adapters.sort();
        adapters.dedup();
        let changed = engine.set_discovered(models, adapters);
        if changed {
            self.rebuild();
        }
        changed
    }

    /// Rebuilds the snapshot from the members and swaps it in.
    pub fn rebuild(&self) {
        // Read the state and store the snapshot under one lock, so that the snapshot stored
        // last was built from the latest members and models.
        let _rebuilding = lock(&self.rebuilding);
        let members = self.members();
        let mut by_model: BTreeMap<String, Vec<Arc<Engine>>> = BTreeMap::new();
        for e in &members {
            for m in e.models() {
                by_model.entry(m).or_default().push(e.clone());
            }
        }
        let version = self.version.fetch_add(1, Ordering::Relaxed) + 1;
        let slot = self.router_slot();
        let routes = by_model
            .into_iter()
            .map(|(model, engines)| {
                let mut policy_cfg = self.cfg.model_policy(&model).clone();
                // Meshed routers must agree on a new prefix's engine without talking (their
                // marks reach each other tens of ms later): rendezvous for cold prompts.
                policy_cfg.prefix.cold_prefix_rendezvous |= self.cfg.mesh.enabled;
                // Peers' counts arrive at once from a real-time mesh thread: the bias that
                // offsets their delay would only cost (see `LeastRequestConfig::own_bias`).
                if self.mesh_realtime.load(Ordering::Relaxed) {
                    policy_cfg.least_request.own_bias.get_or_insert(0.0);
                }
                let members: Vec<EngineMember> = engines
                    .iter()
                    .map(|e| {
                        let mut m = EngineMember::new(e.id.0);
                        m.base_weight = e.base_weight();
                        m
                    })
                    .collect();
                let seed = self.cfg.seed ^ stable_hash(model.as_bytes()) ^ version;
                let policy = Policy::new(&policy_cfg, &members, seed).with_router_slot(slot);
                // A LoRA adapter's blocks carry its name (as vLLM hashes them): from the
                // config, else from the engines' /v1/models (`parent`).
                let lora = self
                    .cfg
                    .models
                    .get(&model)
                    .and_then(|m| m.lora)
                    .unwrap_or_else(|| engines.iter().any(|e| e.is_adapter(&model)));
                let slots: Vec<u32> = engines.iter().map(|e| e.slot).collect();
                let prefix =
                    RoutePrefix::build(&self.prefix, &self.cfg, &model, &policy_cfg, lora, &slots)
                        .map(Arc::new);
                let decisions = Reason::ALL
                    .iter()
                    .map(|r| {
                        self.decisions.get_or_create_owned(&DecisionLabels {
                            model: model.clone(),
                            policy: policy_cfg.policy.as_str(),
                            reason: r.as_str(),
                        })
                    })
                    .collect();
                let context: Vec<u32> = engines.iter().map(|e| e.context_len(&model)).collect();
                let known = context.iter().filter(|&&l| l != 0);
                let context_differs = known.clone().min() != known.max();
                let context_max = if context.contains(&0) {
                    0
                } else {
                    context.iter().copied().max().unwrap_or(0)
                };
                let route = ModelRoute {
                    model: model.clone(),
                    engines,
                    policy,
                    policy_cfg,
                    prefix,
                    totals: TotalsCache::default(),
                    context,
                    context_differs,
                    context_max,
                    decisions,
                };
                (model, Arc::new(route))
            })
            .collect();
        let routes: BTreeMap<String, Arc<ModelRoute>> = routes;
        let any_prefix_route = routes.values().any(|r| r.prefix.is_some());
        let before = self.snapshot.swap(Arc::new(Snapshot {
            version,
            engines: members,
            routes,
            any_prefix_route,
        }));
        // A model no engine serves any more (or a route whose policy changed) leaves no
        // series behind: engines listing ever new models would grow /metrics without bound.
        let now = self.snapshot();
        for (model, old) in &before.routes {
            let policy = old.policy_cfg.policy;
            if now
                .routes
                .get(model)
                .is_some_and(|r| r.policy_cfg.policy == policy)
            {
                continue;
            }
            for r in Reason::ALL {
                self.decisions.remove(&DecisionLabels {
                    model: model.clone(),
                    policy: policy.as_str(),
                    reason: r.as_str(),
                });
            }
        }
    }

    /// Models served by at least one engine.
    pub fn models(&self) -> BTreeSet<String> {
        self.snapshot().routes.keys().cloned().collect()
    }

    /// The fleet's median latency (µs), 0 when unknown.
    pub fn fleet_latency_us(&self) -> f64 {
        f64::from_bits(self.fleet_latency_bits.load(Ordering::Relaxed))
    }

    /// Recomputes the fleet's median latency (off the request path): of the engines that
    /// have latency samples (an engine without is weighed as this median).
    pub fn refresh_fleet_latency(&self) {
        let mut lat: Vec<f64> = self
            .members()
            .iter()
            .filter_map(|e| e.tracker().latency().sampled_us())
            .collect();
        let v = kvmesh_policy::fleet_reference_latency(&mut lat);
        self.fleet_latency_bits
            .store(v.to_bits(), Ordering::Relaxed);
    }

    /// How many engines breakers currently eject (for the ejection guard).
    pub fn ejected_count(&self) -> usize {
        self.members()
            .iter()
            .filter(|e| e.tracker().breaker().is_ejected())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_prefix::BlockKey;

    fn entry(port: u16) -> EngineEntry {
        EngineEntry {
            url: format!("http://127.0.0.1:{port}"),
            models: vec!["m".into()],
            ..EngineEntry::default()
        }
    }

    #[test]
    fn a_removed_engines_slot_is_reused_only_after_its_last_reference_and_a_sweep() {
        let reg = Registry::new(Arc::new(ServeConfig::default()), Clock::default());
        let a = reg.add(&entry(1), Source::Static, false).expect("add a");
        assert_eq!(a.slot, 0);
        let key = [BlockKey(0x10)];
        reg.prefix.mark(a.target(), &key, 0, 10_000, 1);
        // Removed while a request still holds it: its slot stays taken, entries too.
        let held = reg.remove(&a.url).expect("remove a");
        drop(a);
        let b = reg.add(&entry(2), Source::Static, false).expect("add b");
        assert_eq!(
            b.slot, 1,
            "the removed engine's slot is not reused while referenced"
        );
        reg.prefix.sweep(2);
        assert!(reg.prefix.index().holds(held.slot, key[0], 2));
        // Last reference gone: retired, freed (with its entries) by the next sweep.
        drop(held);
        reg.prefix.sweep(3);
        assert!(!reg.prefix.index().has_engine(0));
        let c = reg.add(&entry(3), Source::Static, false).expect("add c");
        assert_eq!(c.slot, 0);
        assert!(!reg.prefix.index().holds(c.slot, key[0], 3));
        // A duplicate URL is refused and its slot comes back after a sweep.
        assert!(reg.add(&entry(3), Source::Static, false).is_err());
        reg.prefix.sweep(4);
        let d = reg.add(&entry(4), Source::Static, false).expect("add d");
        assert_eq!(d.slot, 2);
    }

    /// What least request picks of two engines: `a` with 5 in flight, all this router's;
    /// `b` with 6, all its peers'.
    fn least_request_pick(reg: &Registry) -> usize {
        let snap = reg.snapshot();
        let route = snap.routes.get("m").expect("route");
        let views: Vec<EngineView> = [(5, 5), (6, 0)]
            .iter()
            .map(|&(load, own)| {
                let mut v = EngineView::new(1.0);
                v.in_flight = load;
                v.own_in_flight = own;
                v
            })
            .collect();
        let mut out = Vec::new();
        route
            .policy
            .pick(&views, &kvmesh_policy::RequestCtx::new(1, 0), &mut out);
        out[0]
    }

    #[test]
    fn an_unset_own_bias_is_zero_once_the_mesh_thread_is_realtime() {
        let mut cfg = ServeConfig::default();
        cfg.routing.policy.policy = kvmesh_policy::PolicyKind::LeastRequest;
        let reg = Registry::new(Arc::new(cfg.clone()), Clock::default());
        reg.add(&entry(1), Source::Static, false).expect("add");
        reg.add(&entry(2), Source::Static, false).expect("add");
        // Peers' counts may be late: own requests count 4 more, so `b` (peers' 6) wins.
        assert_eq!(least_request_pick(&reg), 1);
        reg.set_mesh_realtime(true);
        let snap = reg.snapshot();
        assert_eq!(
            snap.routes["m"].policy_cfg.least_request.own_bias,
            Some(0.0)
        );
        // Counts are not late: the least loaded by the sum, `a`.
        assert_eq!(least_request_pick(&reg), 0);
        reg.set_mesh_realtime(false);
        assert_eq!(least_request_pick(&reg), 1);
        // A configured bias is kept either way.
        cfg.routing.policy.least_request.own_bias = Some(4.0);
        let reg = Registry::new(Arc::new(cfg), Clock::default());
        reg.add(&entry(1), Source::Static, false).expect("add");
        reg.add(&entry(2), Source::Static, false).expect("add");
        reg.set_mesh_realtime(true);
        assert_eq!(least_request_pick(&reg), 1);
    }

    #[test]
    fn fleet_totals_are_rescanned_at_most_once_per_refresh_interval() {
        let cache = TotalsCache::default();
        let scans = std::cell::Cell::new(0);
        let scan = |load| {
            scans.set(scans.get() + 1);
            Totals {
                eligible: 4,
                load,
                weight: 4.0,
                base_weight: 4.0,
            }
        };
        assert_eq!(cache.get(1_000, || scan(10)).load, 10);
        // Within the interval: the kept totals, no scan.
        for t in 1_000..1_000 + TOTALS_REFRESH_US {
            assert_eq!(cache.get(t, || scan(99)).load, 10);
        }
        assert_eq!(scans.get(), 1);
        // Past it: one rescan.
        let t = cache.get(1_000 + TOTALS_REFRESH_US, || scan(12));
        assert_eq!((t.eligible, t.load, t.weight), (4, 12, 4.0));
        assert_eq!(scans.get(), 2);
    }
}
