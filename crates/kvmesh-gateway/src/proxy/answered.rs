//! What an engine's answer says of the decision's mark: the decision marked its first choice
//! as about to hold the prompt, but a retry's engine computed it, or the engine refused it.

use crate::gateway::Gateway;
use crate::prefix::{self, Hold, ParsedRequest};
use crate::registry::ModelRoute;
use http::StatusCode;
use kvmesh_route::Decision;
use std::sync::Arc;

/// What the answer changes.
enum Settle {
    /// Another engine than the marked one served (a retry): it computed the prompt, so it is
    /// marked as the first was, with the life the policy gives a mark on it.
    MarkServed { known: usize },
    /// The marked engine refused the request (its own 4xx): it will not compute the prompt,
    /// so the decision's mark is taken back here, of the keys past the `known` leading ones
    /// the engine held before the decision (an earlier request's, which this decision only
    /// extended; not those another decision still awaiting its answer had marked: see
    /// [`Hold`]), with its exact expiry (a later decision's stays). Peers keep the copy the
    /// mesh carried until it expires: a mark is a grow-only, newest-expiry entry across the
    /// mesh.
    Unmark { expiry_us: u64, known: usize },
}

/// Settles the decision's mark after `engine` answered with `status`. Off the request's path:
/// the prompt is read again (its keys are not kept past the decision), on the blocking pool
/// when it is long; the mark's `hold` ends once it is settled.
#[allow(clippy::too_many_arguments)]
pub(super) fn settle_mark(
    gw: &Gateway,
    route: &Arc<ModelRoute>,
    decision: &Decision,
    hold: Option<Hold>,
    engine: usize,
    status: StatusCode,
    parsed: Option<ParsedRequest>,
    body_len: usize,
) {
    let (Some(m), Some(hold), Some(rp), Some(req)) =
        (decision.mark, hold, route.prefix.clone(), parsed)
    else {
        return;
    };
    let settle = if status.is_success() && m.engine != engine {
        let known = decision
            .candidates
            .iter()
            .position(|&c| c == engine)
            .map_or(0, |pos| decision.predicted(pos) as usize);
        Settle::MarkServed { known }
    } else if status.is_client_error() && m.engine == engine {
        Settle::Unmark {
            expiry_us: m.expiry_us,
            // The mark is of the first choice, with what it held before the decision.
            known: hold.settled(),
        }
    } else {
        return;
    };
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
            let e = &route.engines[engine];
            match settle {
                Settle::MarkServed { known } => {
                    let now = clock.now_us();
                    let ttl = prefix::ttl_plan(state.config()).for_mark(rp.kind, e.events_live());
                    state.mark(e.target(), &s.keys, known, now.saturating_add(ttl), now);
                }
                Settle::Unmark { expiry_us, known } => {
                    let new = s.keys.get(known..).unwrap_or_default();
                    state.unmark(e.target(), new, expiry_us);
                }
            }
        });
        // Settled: the next decision counts what it finds of this one's marks as held.
        drop(hold);
    });
}
