//! The engine a retry served: the decision marked its first choice as about to hold the
//! prompt, but another engine computed it.

use crate::gateway::Gateway;
use crate::prefix::{self, ParsedRequest};
use crate::registry::ModelRoute;
use kvmesh_route::Decision;
use std::sync::Arc;

/// A request whose decision marked one engine but that another engine served (a retry):
/// that engine computes the prompt, so it is marked as the first was, with the life the
/// policy gives a mark on it. Off the request's path: the prompt is read again (its keys are
/// not kept past the decision), on the blocking pool when it is long. The first engine's mark
/// stays until it expires (a mark is never taken back).
pub(super) fn mark_served(
    gw: &Gateway,
    route: &Arc<ModelRoute>,
    decision: &Decision,
    served: usize,
    parsed: Option<ParsedRequest>,
    body_len: usize,
) {
    let (Some(m), Some(rp), Some(req)) = (decision.mark, route.prefix.clone(), parsed) else {
        return;
    };
    if m.engine == served {
        return;
    }
    let known = decision
        .candidates
        .iter()
        .position(|&c| c == served)
        .map_or(0, |pos| decision.predicted(pos) as usize);
    let (route, state, clock) = (route.clone(), gw.registry.prefix.clone(), gw.clock);
    tokio::spawn(async move {
        let (req, prepared) = prefix::prompt_keys_offloaded(&state, &rp, req, body_len).await;
        prefix::with_scratch(|s| {
            let read = match (prepared, req) {
                (Some(p), _) => {
                    s.keys = p.keys;
                    p.lookup.is_some()
                }
                (None, Some(req)) => prefix::prompt_keys(&state, &rp, &req, s).is_some(),
                (None, None) => false,
            };
            if !read {
                return;
            }
            let engine = &route.engines[served];
            let now = clock.now_us();
            let ttl = prefix::ttl_plan(state.config()).for_mark(rp.kind, engine.events_live());
            state.mark(
                engine.target(),
                &s.keys,
                known,
                now.saturating_add(ttl),
                now,
            );
        });
    });
}
