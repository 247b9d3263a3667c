//! Step 2 of a request: the decision.

use kvmesh_policy::{
    EngineSet, MAX_CANDIDATES, Policy, PolicyKind, PrefixInput, PrefixMatch, Reason, RequestCtx,
};

/// What the prefix side knows of one request's prompt, per engine of the route.
pub trait PrefixProbe {
    /// Leading blocks of the request's prompt that engine `engine` (a route index) holds now,
    /// short matches included (the lookup may have skipped those).
    fn held_blocks(&self, engine: usize) -> u32;
    /// Whether the engine's KV events are live: its blocks are exactly known, so a mark for
    /// it only has to bridge the time until its events confirm the blocks.
    fn events_live(&self, engine: usize) -> bool;
}

/// How long a speculative mark lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlPlan {
    /// For an engine whose events are live, under `precise` and `scored` (µs).
    pub speculative_us: u64,
    /// Otherwise (`cache_aware`, or an engine whose events are not live): the router's own
    /// decisions are all it knows of that engine's cache (µs).
    pub approximate_us: u64,
}

impl TtlPlan {
    /// The life of a mark on an engine under a policy of `kind`: the short one when the
    /// policy reads KV events and the engine's are live (they soon confirm its blocks), else
    /// the approximate one.
    pub fn for_mark(&self, kind: PolicyKind, events_live: bool) -> u64 {
        let reads_events = matches!(kind, PolicyKind::Precise | PolicyKind::Scored);
        if reads_events && events_live {
            self.speculative_us
        } else {
            self.approximate_us
        }
    }
}

/// The prefix input of a cache-aware decision.
pub struct PrefixPlan<'a, P: ?Sized> {
    /// Blocks of the prompt an engine could serve from cache.
    pub total_blocks: u32,
    /// Engines holding a usable prefix (route indices), from the index lookup.
    pub matches: &'a [PrefixMatch],
    /// The key naming the prompt's leading blocks for a cold prompt's rendezvous home
    /// ([`PrefixInput::cold_key`]; 0 = none).
    pub cold_key: u64,
    /// Exact per-engine probe (predictions, event liveness).
    pub probe: &'a P,
    /// Mark lifetimes.
    pub ttl: TtlPlan,
}

/// A speculative entry to record: the chosen engine will hold the prompt's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// Route index of the engine.
    pub engine: usize,
    /// Until when (cluster time, µs).
    pub expiry_us: u64,
}

/// Everything one request's routing decided, before any byte is sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Route indices: the first choice, then fallbacks for retries (distinct).
    pub candidates: Vec<usize>,
    /// Why the first was chosen (a metric label).
    pub reason: Reason,
    /// Per candidate (same positions), the leading prompt blocks it is predicted to hold.
    pub predicted_blocks: [u32; MAX_CANDIDATES],
    /// The speculative mark for the first choice (cache-aware routes with a prompt).
    pub mark: Option<Mark>,
    /// The engine the request is counted in flight on from the decision until its first
    /// attempt starts (so that the next decision's load guard sees it).
    pub reserve: Option<usize>,
}

impl Decision {
    /// No engine can take the request.
    pub fn is_empty(&self) -> bool {
        self.candidates.is_empty() || self.reason == Reason::NoEngines
    }

    /// Every engine was ineligible and the policy ran over all of them: attempts ignore
    /// active health (the breakers still apply).
    pub fn panic_mode(&self) -> bool {
        self.reason == Reason::AllIneligible
    }

    /// Predicted leading blocks of the candidate at `pos`.
    pub fn predicted(&self, pos: usize) -> u32 {
        self.predicted_blocks.get(pos).copied().unwrap_or(0)
    }
}

/// Decides one request: runs the policy over `engines` (read lazily), predicts what each
/// candidate holds of the prompt, and plans the speculative mark and the reservation.
///
/// `out` is reused as the candidate list (pass a `Vec` with capacity [`MAX_CANDIDATES`] to
/// avoid allocating). Pure: the same inputs and `ctx.seed` give the same decision.
pub fn decide<S, P>(
    policy: &Policy,
    engines: &S,
    ctx: RequestCtx<'_>,
    prefix: Option<PrefixPlan<'_, P>>,
    mut out: Vec<usize>,
) -> Decision
where
    S: EngineSet + ?Sized,
    P: PrefixProbe + ?Sized,
{
    let ctx = match &prefix {
        Some(p) => ctx.with_prefix(PrefixInput {
            total_blocks: p.total_blocks,
            matches: p.matches,
            cold_key: p.cold_key,
        }),
        None => ctx,
    };
    let reason = policy.pick(engines, &ctx, &mut out);
    let mut predicted_blocks = [0u32; MAX_CANDIDATES];
    let mut mark = None;
    if let Some(p) = &prefix
        && p.total_blocks > 0
    {
        for (slot, &c) in predicted_blocks.iter_mut().zip(&out) {
            *slot = p.probe.held_blocks(c).min(p.total_blocks);
        }
        if let Some(&first) = out.first() {
            let ttl = p.ttl.for_mark(policy.kind(), p.probe.events_live(first));
            mark = Some(Mark {
                engine: first,
                expiry_us: ctx.now_us.saturating_add(ttl),
            });
        }
    }
    let reserve = if reason == Reason::NoEngines {
        None
    } else {
        out.first().copied()
    };
    Decision {
        candidates: out,
        reason,
        predicted_blocks,
        mark,
        reserve,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_policy::{EngineMember, EngineView, PolicyConfig};

    struct Held(Vec<u32>, Vec<bool>);

    impl PrefixProbe for Held {
        fn held_blocks(&self, engine: usize) -> u32 {
            self.0[engine]
        }
        fn events_live(&self, engine: usize) -> bool {
            self.1[engine]
        }
    }

    fn policy(kind: PolicyKind, n: usize) -> Policy {
        let cfg = PolicyConfig {
            policy: kind,
            ..PolicyConfig::default()
        };
        let members: Vec<EngineMember> = (0..n as u64).map(EngineMember::new).collect();
        Policy::new(&cfg, &members, 7)
    }

    const TTL: TtlPlan = TtlPlan {
        speculative_us: 2_000_000,
        approximate_us: 120_000_000,
    };

    #[test]
    fn precise_goes_to_the_holder_predicts_and_marks_with_the_short_ttl_when_events_are_live() {
        let p = policy(PolicyKind::Precise, 4);
        let views = vec![EngineView::new(1.0); 4];
        let probe = Held(vec![0, 0, 10, 3], vec![true; 4]);
        let matches = [PrefixMatch {
            engine: 2,
            blocks: 10,
        }];
        let d = decide(
            &p,
            &views,
            RequestCtx::new(1, 1_000),
            Some(PrefixPlan {
                total_blocks: 10,
                matches: &matches,
                cold_key: 0,
                probe: &probe,
                ttl: TTL,
            }),
            Vec::new(),
        );
        assert_eq!(d.candidates[0], 2);
        assert_eq!(d.reason, Reason::PrefixMatch);
        assert_eq!(d.predicted(0), 10);
        for (pos, &c) in d.candidates.iter().enumerate() {
            assert_eq!(d.predicted(pos), probe.0[c]);
        }
        assert_eq!(
            d.mark,
            Some(Mark {
                engine: 2,
                expiry_us: 2_001_000
            })
        );
        assert_eq!(d.reserve, Some(2));
    }

    #[test]
    fn an_engine_without_live_events_and_cache_aware_get_the_approximate_ttl() {
        let views = vec![EngineView::new(1.0); 2];
        let probe = Held(vec![5, 0], vec![false, true]);
        let matches = [PrefixMatch {
            engine: 0,
            blocks: 5,
        }];
        for kind in [PolicyKind::Precise, PolicyKind::CacheAware] {
            let d = decide(
                &policy(kind, 2),
                &views,
                RequestCtx::new(3, 0),
                Some(PrefixPlan {
                    total_blocks: 5,
                    matches: &matches,
                    cold_key: 0,
                    probe: &probe,
                    ttl: TTL,
                }),
                Vec::new(),
            );
            assert_eq!(d.candidates[0], 0, "{kind:?}");
            assert_eq!(d.mark.map(|m| m.expiry_us), Some(120_000_000), "{kind:?}");
        }
    }

    #[test]
    fn without_prefix_no_mark_no_prediction_and_no_engines_reserves_nothing() {
        let views = vec![EngineView::new(1.0); 3];
        let d = decide::<_, Held>(
            &policy(PolicyKind::RoundRobin, 3),
            &views,
            RequestCtx::new(3, 0),
            None,
            Vec::new(),
        );
        assert_eq!(d.mark, None);
        assert_eq!(d.predicted_blocks, [0; MAX_CANDIDATES]);
        assert!(d.reserve.is_some());
        let empty: Vec<EngineView> = Vec::new();
        let d = decide::<_, Held>(
            &policy(PolicyKind::RoundRobin, 0),
            &empty,
            RequestCtx::new(3, 0),
            None,
            Vec::new(),
        );
        assert!(d.is_empty());
        assert_eq!(d.reserve, None);
    }

    #[test]
    fn panic_mode_when_every_engine_is_ineligible() {
        let mut v = EngineView::new(1.0);
        v.eligible = false;
        let views = vec![v; 3];
        let d = decide::<_, Held>(
            &policy(PolicyKind::LeastRequest, 3),
            &views,
            RequestCtx::new(3, 0),
            None,
            Vec::new(),
        );
        assert!(d.panic_mode());
        assert!(!d.is_empty());
    }
}
