//! What the mesh shows: `GET /admin/cluster` and the mesh's metric families.

use super::{Cluster, lock};
use kvmesh_mesh::transport::{CLASSES, Counters};
use kvmesh_metrics::Histogram;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

/// `GET /admin/cluster`: members with their lag, digests, counters, bytes by traffic class,
/// and per engine with KV events its owners and how this router follows it; `slot` is the
/// rank `least_request` splits ties by (the registry's copy, which the policies were built with);
/// `url_of` names an engine by its id.
pub(super) fn status(
    c: &Cluster,
    slot: kvmesh_policy::RouterSlot,
    url_of: &dyn Fn(u64) -> Option<String>,
) -> serde_json::Value {
    let members = c.members();
    let now = (c.now)();
    let t = c.transport.counters();
    let tls = c.transport.tls_summary();
    let mut core = lock(&c.core);
    let d = core.digest(now);
    let lags: Vec<serde_json::Value> = core
        .lags()
        .map(|(m, l)| {
            serde_json::json!({
                "name": m.name,
                "addr": m.addr.to_string(),
                "incarnation": m.bump,
                "last_envelope_ms_ago": (l.last_us > 0).then(|| now.saturating_sub(l.last_us) / 1_000),
                "delta_lag_ms": (l.last_us > 0).then_some(l.lag_us as f64 / 1_000.0),
            })
        })
        .collect();
    let down: Vec<serde_json::Value> = core
        .down_members()
        .map(|(m, at)| {
            serde_json::json!({
                "name": m.name,
                "addr": m.addr.to_string(),
                "incarnation": m.bump,
                "down_for_ms": now.saturating_sub(*at) / 1_000,
            })
        })
        .collect();
    let conflicts: Vec<serde_json::Value> = core
        .name_conflicts()
        .map(|(name, (addrs, since))| {
            serde_json::json!({
                "name": name,
                "addrs": addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
                "for_ms": now.saturating_sub(*since) / 1_000,
            })
        })
        .collect();
    let owned: std::collections::BTreeSet<u64> = core.owned().collect();
    let replicas = core.ingest_replicas();
    let suspects = core.suspects();
    let mut engines = Vec::new();
    for (engine, followed) in core.feeds_followed() {
        let owners: Vec<String> = core
            .owners(engine)
            .into_iter()
            .map(|n| c.name_of(n, &members))
            .collect();
        let f = core.feed_status(engine);
        engines.push(serde_json::json!({
            "engine": format!("{engine:016x}"),
            "url": url_of(engine),
            "owners": owners,
            "reads_here": owned.contains(&engine),
            "follows": followed.map(|f| c.name_of(f.source, &members)),
            "synced": f.is_some_and(|f| f.is_synced()),
            "stale": !core.feed_live(engine, &suspects),
            "source_suspect": followed.is_some_and(|f| suspects.contains(&f.source)),
            "applied": f.map(|f| f.applied()),
        }));
    }
    engines.sort_by(|a, b| a["engine"].as_str().cmp(&b["engine"].as_str()));
    let k = core.counters().clone();
    let (load, marks, registry, feed_blocks) = core.sizes();
    let orphan_engines = core.orphan_engines();
    drop(core);
    serde_json::json!({
        "node": c.name,
        "id": format!("{:016x}", c.me.0),
        "warm": c.is_warm(),
        "realtime": c.realtime,
        "rank": { "rank": slot.rank, "routers": slot.routers },
        "addr": c.addr().map(|a| a.to_string()),
        "members": lags,
        "down": down,
        "name_conflicts": conflicts,
        "digests": {
            "load": format!("{:016x}", d.load),
            "marks": format!("{:016x}", d.marks),
            "registry": format!("{:016x}", d.registry),
        },
        "entries": { "load": load, "marks": marks, "registry": registry, "feed_blocks": feed_blocks, "orphan_engines": orphan_engines },
        "envelopes": {
            "sent": k.envelopes_sent,
            "received": k.envelopes_received,
            "dropped": k.envelopes_dropped,
        },
        "anti_entropy_rounds": k.anti_entropy_rounds,
        "repairs": k.repairs,
        "ownership_moves": k.ownership_moves,
        "feed_batches": k.feed_batches,
        "feed_pulls": k.feed_pulls,
        "feed_bequests": k.feed_bequests,
        "bequests_taken": k.bequests_taken,
        "snapshot_parts": k.snapshot_parts,
        "marks_kept_local": k.marks_kept,
        "deltas_refused": k.deltas_refused,
        "orphan_entries_dropped": k.orphan_entries_dropped,
        "engines_seeded": k.engines_seeded,
        "seeds_superseded": k.seeds_superseded,
        "digests_ignored": k.digests_ignored,
        "parts_skipped": k.parts_skipped,
        "wire_version": c.wire_version,
        "dropped_marks": c.dropped_marks.load(Relaxed),
        "bytes": bytes_by_class(t)
            .map(|(class, dir, v)| (format!("{class}_{dir}"), serde_json::Value::from(v)))
            .collect::<serde_json::Map<_, _>>(),
        "dropped_datagrams": t.dropped_datagrams.load(Relaxed),
        "dropped_streams": t.dropped_streams.load(Relaxed),
        "udp_received": {
            "datagrams": t.udp.datagrams.load(Relaxed),
            "bytes": t.udp.bytes.load(Relaxed),
        },
        "handshake_failures": t.handshake_failures.load(Relaxed),
        "tls": {
            "cert_sha256": tls.cert_sha256,
            "cert_not_after": tls.cert_not_after,
            "cas_sha256": tls.cas_sha256,
            "reloads": t.tls_reloads.load(Relaxed),
            "reload_failures": t.tls_reload_failures.load(Relaxed),
        },
        "ingest": { "replicas": replicas, "owned": owned.len(), "engines": engines },
    })
}

/// Bytes by traffic class (`kvmesh_mesh::transport::CLASSES`) and direction.
fn bytes_by_class(t: &Counters) -> impl Iterator<Item = (&'static str, &'static str, u64)> + '_ {
    CLASSES.iter().enumerate().flat_map(move |(i, &class)| {
        [
            (class, "sent", t.bytes_sent[i].load(Relaxed)),
            (class, "received", t.bytes_received[i].load(Relaxed)),
        ]
    })
}

/// The mesh's counters at one instant, as metric families.
#[derive(Debug)]
struct MeshMetrics {
    members: i64,
    down: i64,
    owned: i64,
    max_lag_s: f64,
    /// The certificate's end of validity (seconds since the Unix epoch), when readable.
    cert_not_after: Option<i64>,
    age: Arc<Histogram>,
    counters: [(&'static str, &'static str, u64); 19],
    envelopes: [(&'static str, u64); 3],
    bytes: Vec<(&'static str, &'static str, u64)>,
}

pub(super) fn collector(c: &Cluster) -> Box<dyn prometheus_client::collector::Collector> {
    let t = c.transport.counters();
    let core = lock(&c.core);
    let k = core.counters().clone();
    let max_lag_s = core
        .lags()
        .map(|(_, l)| l.lag_us.max(0) as f64 / 1e6)
        .fold(0.0, f64::max);
    let owned = core.owned().count() as i64;
    let members = core.members().count() as i64;
    let down = core.down_members().count() as i64;
    drop(core);
    Box::new(MeshMetrics {
        members,
        down,
        owned,
        max_lag_s,
        cert_not_after: c.transport.tls_summary().cert_not_after,
        age: c.envelope_age().clone(),
        counters: [
            (
                "kvmesh_mesh_anti_entropy_rounds",
                "Digest exchanges started with a random member",
                k.anti_entropy_rounds,
            ),
            (
                "kvmesh_mesh_repairs",
                "State parts sent because a peer's digest differed",
                k.repairs,
            ),
            (
                "kvmesh_mesh_ownership_moves",
                "Engines this router started or stopped reading",
                k.ownership_moves,
            ),
            (
                "kvmesh_mesh_feed_batches",
                "KV-event batches this router sent as an engine's ingest owner",
                k.feed_batches,
            ),
            (
                "kvmesh_mesh_feed_pulls",
                "Feed batches or snapshots asked of an owner (a gap, a new source)",
                k.feed_pulls,
            ),
            (
                "kvmesh_mesh_feed_bequests",
                "Feeds this router handed, on leaving, to the routers that read their engines next",
                k.feed_bequests,
            ),
            (
                "kvmesh_mesh_bequests_taken",
                "Feeds this router took up from a leaving router instead of reading the engine afresh",
                k.bequests_taken,
            ),
            (
                "kvmesh_mesh_snapshot_parts",
                "Parts of feed snapshots too large for one envelope received",
                k.snapshot_parts,
            ),
            (
                "kvmesh_mesh_marks_kept_local",
                "Speculative marks not sent: their engine's KV events, in sync here, say the same",
                k.marks_kept,
            ),
            (
                "kvmesh_mesh_deltas_refused",
                "Well-formed deltas refused: marks expiring past the longest mark lifetime + 10 s (a peer's clock far ahead), feed parts not sent by the feed's source, counts and marks of engines this router does not have past 64 such engines",
                k.deltas_refused,
            ),
            (
                "kvmesh_mesh_orphan_entries_dropped",
                "Peers' counts and marks of engines this router does not have, dropped after ten anti-entropy periods (or at once past 64 such engines)",
                k.orphan_entries_dropped,
            ),
            (
                "kvmesh_mesh_digests_ignored",
                "Anti-entropy digests not answered: more than 8 from one peer within an anti-entropy period",
                k.digests_ignored,
            ),
            (
                "kvmesh_mesh_parts_skipped",
                "Parts of version 2 envelopes skipped: a kind of delta or control message this build does not know (a later build's), or bytes that are none",
                k.parts_skipped,
            ),
            (
                "kvmesh_mesh_handshake_failures",
                "Mesh handshakes refused by TLS (a certificate not from the cluster CA, another cluster id)",
                t.handshake_failures.load(Relaxed),
            ),
            (
                "kvmesh_mesh_dropped_datagrams",
                "Mesh datagrams dropped on an authenticated connection: empty or of no known traffic class (UDP packets that are not QUIC, or that fail to decrypt, are dropped by quinn: see kvmesh_mesh_udp_datagrams_received_total)",
                t.dropped_datagrams.load(Relaxed),
            ),
            (
                "kvmesh_mesh_udp_datagrams_received",
                "Every UDP datagram the mesh port received, QUIC's own packets, garbage and floods included (a flood shows here, not in the traffic classes' bytes)",
                t.udp.datagrams.load(Relaxed),
            ),
            (
                "kvmesh_mesh_dropped_streams",
                "Delta streams dropped on an authenticated connection: over the size bound, or broken before their end",
                t.dropped_streams.load(Relaxed),
            ),
            (
                "kvmesh_mesh_tls_reloads",
                "Mesh certificates taken while running (the files in tls_dir changed)",
                t.tls_reloads.load(Relaxed),
            ),
            (
                "kvmesh_mesh_tls_reload_failures",
                "Mesh certificate files that changed but did not load (the ones before were kept)",
                t.tls_reload_failures.load(Relaxed),
            ),
        ],
        envelopes: [
            ("sent", k.envelopes_sent),
            ("received", k.envelopes_received),
            ("dropped", k.envelopes_dropped),
        ],
        bytes: bytes_by_class(t).collect(),
    })
}

impl prometheus_client::collector::Collector for MeshMetrics {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::encoding::NoLabelSet;
        use prometheus_client::metrics::MetricType::{Counter, Gauge};
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_members",
            "Members of the mesh besides this router, by SWIM state",
            None,
            Gauge,
        )?;
        m.encode_family(&[("state", "alive")])?
            .encode_gauge(&self.members)?;
        m.encode_family(&[("state", "down")])?
            .encode_gauge(&self.down)?;
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_owned_engines",
            "Engines whose KV events this router reads (ingest ownership)",
            None,
            Gauge,
        )?;
        m.encode_gauge(&self.owned)?;
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_delta_lag_seconds",
            "Largest age of the last state envelope received from a member (includes clock skew)",
            None,
            Gauge,
        )?;
        m.encode_gauge(&self.max_lag_s)?;
        if let Some(t) = self.cert_not_after {
            let mut m = enc.encode_descriptor(
                "kvmesh_mesh_certificate_expiry_timestamp_seconds",
                "End of validity of the certificate this router presents to its peers (seconds \
                 since the Unix epoch): alert well before it, the pair must be renewed in tls_dir",
                None,
                Gauge,
            )?;
            m.encode_gauge(&t)?;
        }
        crate::metrics::histogram(
            &mut enc,
            "kvmesh_mesh_envelope_age_seconds",
            "Age of each state envelope received from a member, at its handling here (the \
             sender's clock at sending against this router's; includes clock skew)",
            &[(&[], &self.age)],
        )?;
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_envelopes",
            "State envelopes by direction (dropped: undecodable, oversized or of another cluster)",
            None,
            Counter,
        )?;
        for (dir, v) in &self.envelopes {
            m.encode_family(&[("direction", *dir)])?
                .encode_counter::<NoLabelSet, _, u64>(v, None)?;
        }
        let mut m = enc.encode_descriptor(
            "kvmesh_mesh_bytes",
            "Mesh bytes by traffic class and direction",
            None,
            Counter,
        )?;
        for (class, dir, v) in &self.bytes {
            m.encode_family(&[("class", *class), ("direction", *dir)])?
                .encode_counter::<NoLabelSet, _, u64>(v, None)?;
        }
        for (name, help, v) in &self.counters {
            let mut m = enc.encode_descriptor(name, help, None, Counter)?;
            m.encode_counter::<NoLabelSet, _, u64>(v, None)?;
        }
        Ok(())
    }
}
