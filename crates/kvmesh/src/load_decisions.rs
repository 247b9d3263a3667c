//! The benchmark's count of load decisions against the truth: at every `least_request`
//! decision of the routers it runs in this process, whether the engine chosen was the least
//! loaded by every router's own in-flight counts at that moment. A single router always has
//! that truth; a meshed router has its peers' counts as the mesh last told them; independent
//! replicas have none of them. The counts are read while the other routers go on (not one
//! atomic snapshot), so a change landing during the read can count either way.

use kvmesh_gateway::{DecisionObserver, Engine, Gateway, GatewayServer};
use kvmesh_policy::{Reason, load_score};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};

/// Counts `least_request` decisions and those that missed the least loaded engine.
#[derive(Default)]
pub struct LoadDecisions {
    routers: Vec<Weak<Gateway>>,
    decisions: AtomicU64,
    misplaced: AtomicU64,
}

impl LoadDecisions {
    /// Watches every decision of `routers` (`None` without routers, or when one is watched
    /// already).
    pub fn watch(routers: &[GatewayServer]) -> Option<Arc<LoadDecisions>> {
        let gws: Vec<&Arc<Gateway>> = routers.iter().map(|r| &r.gateway).collect();
        Self::watch_gateways(&gws)
    }

    fn watch_gateways(gws: &[&Arc<Gateway>]) -> Option<Arc<LoadDecisions>> {
        if gws.is_empty() || gws.iter().any(|g| g.decision_observer.get().is_some()) {
            return None;
        }
        let me = Arc::new(LoadDecisions {
            routers: gws.iter().map(|g| Arc::downgrade(g)).collect(),
            ..LoadDecisions::default()
        });
        for g in gws {
            g.decision_observer
                .set(me.clone() as Arc<dyn DecisionObserver>)
                .ok()?;
        }
        Some(me)
    }

    /// `(least_request decisions, of them not to the least loaded engine)`.
    pub fn counts(&self) -> (u64, u64) {
        (self.decisions.load(Relaxed), self.misplaced.load(Relaxed))
    }
}

impl DecisionObserver for LoadDecisions {
    fn decided(
        &self,
        engines: &[Arc<Engine>],
        chosen: usize,
        reason: Reason,
        now_us: u64,
        reserved: bool,
    ) {
        if reason != Reason::LeastLoad {
            return;
        }
        let gws: Vec<Arc<Gateway>> = self.routers.iter().filter_map(Weak::upgrade).collect();
        let mut least = f64::INFINITY;
        let mut picked = None;
        for (i, e) in engines.iter().enumerate() {
            // Eligibility and weight as the deciding router sees them; the load as it is (the
            // routers' counts, no engine report) per unit of weight. Not the policy's rank:
            // its `own_bias` is a way to reach this truth, not part of it.
            let mut v = e.view(now_us, 0.0);
            if !v.eligible {
                continue;
            }
            let n: u32 = gws
                .iter()
                .filter_map(|g| g.registry.get(e.id))
                .map(|x| x.in_flight.load(Relaxed))
                .sum();
            v.in_flight = n.saturating_sub(u32::from(i == chosen && reserved));
            v.engine_load = None;
            let score = load_score(&v);
            if i == chosen {
                picked = Some(score);
            }
            least = least.min(score);
        }
        self.decisions.fetch_add(1, Relaxed);
        if picked.is_some_and(|s| s > least * (1.0 + 1e-9)) {
            self.misplaced.fetch_add(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_config::{EngineEntry, ServeConfig};
    use kvmesh_gateway::{MockUpstream, Source};

    fn router(urls: &[&str]) -> Arc<Gateway> {
        let gw = Arc::new(Gateway::new(
            ServeConfig::default(),
            Some(MockUpstream::new()),
        ));
        for u in urls {
            let e = EngineEntry {
                url: (*u).into(),
                models: vec!["m".into()],
                ..EngineEntry::default()
            };
            gw.registry.add(&e, Source::Static, false).expect("add");
        }
        gw
    }

    fn engines(gw: &Gateway) -> Vec<Arc<Engine>> {
        let mut v = gw.registry.members();
        v.sort_by(|a, b| a.url.cmp(&b.url));
        v
    }

    #[test]
    fn a_decision_is_judged_by_every_routers_own_counts() {
        let urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"];
        let (a, b) = (router(&urls), router(&urls));
        let ld = LoadDecisions::watch_gateways(&[&a, &b]).expect("watched");
        assert!(
            LoadDecisions::watch_gateways(&[&a]).is_none(),
            "one observer per router"
        );
        let c = router(&urls);
        assert!(LoadDecisions::watch_gateways(&[&c, &a]).is_none());
        assert!(
            c.decision_observer.get().is_none(),
            "a refused watch sets nothing"
        );
        let (ea, eb) = (engines(&a), engines(&b));
        // Router a holds 2 on engine 0; router b holds 3 on engine 1: engine 0 is the least
        // loaded (2 against 3) although router b's own counts say the opposite.
        ea[0].in_flight.store(2, Relaxed);
        eb[1].in_flight.store(3, Relaxed);
        ld.decided(&eb, 0, Reason::LeastLoad, 0, false);
        assert_eq!(ld.counts(), (1, 0));
        ld.decided(&eb, 1, Reason::LeastLoad, 0, false);
        assert_eq!(ld.counts(), (2, 1));
        // The request just reserved on the chosen engine is not held against it.
        eb[1].in_flight.store(1, Relaxed);
        ea[0].in_flight.store(2, Relaxed);
        ld.decided(&eb, 1, Reason::LeastLoad, 0, true);
        assert_eq!(ld.counts(), (3, 1));
        // Other policies' decisions are not counted.
        ld.decided(&eb, 1, Reason::RoundRobin, 0, false);
        assert_eq!(ld.counts(), (3, 1));
    }
}
