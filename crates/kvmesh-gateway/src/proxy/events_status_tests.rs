//! What the operator's pages say of an engine's KV events (QA): a reader's subscription to a
//! dead engine is not "connected" (the ZMQ socket reconnects silently); a router that stops
//! reading an engine drops its reader's figures; a router that follows the feed through the
//! mesh says stale when that feed is.

use super::*;
use std::sync::atomic::Ordering::Relaxed;

#[tokio::test(start_paused = true)]
async fn the_events_status_follows_the_engine_s_health_and_who_reads_it() {
    let mock = MockUpstream::new();
    let mut c = cfg();
    c.routing.health.active.enabled = true;
    let gw = gateway(c, &mock, &[A]);
    let e = engine(&gw, A);
    // Read here, not subscribed yet (or never: a wrong address): routed approximately, so
    // stale (QA35: shown not stale).
    e.ingest.has_applier.store(true, Relaxed);
    assert_eq!(e.events_status(true), (false, true));
    assert_eq!(e.events_status(false), (false, true));
    // Connected, synced.
    e.ingest.connected.store(true, Relaxed);
    e.ingest.tracked_blocks.store(40, Relaxed);
    assert_eq!(e.events_status(true), (true, false));
    // The engine stops answering its health checks: not connected, whatever the socket says.
    let now = gw.clock.now_us();
    for _ in 0..10 {
        e.tracker().on_health_check(now, false);
    }
    assert_eq!(e.events_status(true), (false, false));
    // Another router takes over the reading: this one's figures go with its reader.
    e.ingest.stale.store(true, Relaxed);
    crate::ingest::stop(&e);
    assert_eq!(e.ingest.tracked_blocks.load(Relaxed), 0);
    // Followed through the mesh: stale until the feed followed here is synced.
    e.ingest.mesh_live.store(false, Relaxed);
    assert_eq!(e.events_status(true), (false, true));
    e.ingest.mesh_live.store(true, Relaxed);
    assert_eq!(e.events_status(true), (false, false));
}
