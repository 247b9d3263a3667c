//! Three mesh nodes on loopback form a cluster through a seed, share a router's load, see a
//! graceful leave at once and detect a crash; a node of another CA never joins.

use kvmesh_mesh::certs::{NodeTls, generate};
use kvmesh_mesh::core::{Apply, CoreConfig};
use kvmesh_mesh::node::{Input, MeshNode, NowFn, Seeds};
use std::sync::Arc;
use std::time::Duration;

fn cfg(first: bool) -> CoreConfig {
    CoreConfig {
        cluster_id: 1,
        flush_us: 20_000,
        load_flush_us: 100,
        anti_entropy_us: 1_000_000,
        ingest_replicas: 2,
        mark_capacity: 1_024,
        feed_capacity: 1_024,
        mark_ttls_us: vec![2_000_000],
        expected_size: 4,
        warm_bound_us: 5_000_000,
        first,
    }
}

fn clock() -> NowFn {
    Arc::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
    })
}

fn names(n: &[&str]) -> Vec<String> {
    n.iter().map(|s| s.to_string()).collect()
}

async fn wait_for(node: &MeshNode, want: usize, within: Duration) -> bool {
    let mut rx = node.members.clone();
    tokio::time::timeout(within, async {
        loop {
            if rx.borrow_and_update().len() == want {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    })
    .await
    .is_ok()
        && node.members.borrow().len() == want
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_join_share_a_delta_and_see_leave_and_crash() {
    let certs = generate(&names(&["a", "b", "c", "d"])).expect("certs");
    let tls = |n: &str| NodeTls::from_cluster(&certs, n).expect("tls");
    let any = "127.0.0.1:0".parse().expect("addr");
    let (a, _da) = MeshNode::start("a", any, &tls("a"), Seeds::default(), cfg(true), clock())
        .await
        .expect("a");
    let seed = Seeds {
        addrs: vec![a.id.addr.to_string()],
        dns: None,
    };
    let (b, mut db) = MeshNode::start("b", any, &tls("b"), seed.clone(), cfg(false), clock())
        .await
        .expect("b");
    let (c, _dc) = MeshNode::start("c", any, &tls("c"), seed.clone(), cfg(false), clock())
        .await
        .expect("c");
    for (n, node) in [("a", &a), ("b", &b), ("c", &c)] {
        assert!(
            wait_for(node, 2, Duration::from_secs(20)).await,
            "{n} sees the two others"
        );
    }
    a.input
        .send(Input::Load {
            engine: 42,
            in_flight: 7,
        })
        .await
        .expect("input");
    let got = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(x) = db.recv().await {
            if let Apply::PeerLoad { engine: 42, others } = x {
                return others;
            }
        }
        0
    })
    .await
    .expect("within the bound");
    assert_eq!(got, 7, "b sees a's load");
    // Graceful leave: the others see it down quickly.
    c.leave().await;
    assert!(
        wait_for(&a, 1, Duration::from_secs(10)).await,
        "a saw c leave"
    );
    assert!(
        wait_for(&b, 1, Duration::from_secs(10)).await,
        "b saw c leave"
    );
    // Crash: detected by failure detection.
    let t = tokio::time::Instant::now();
    b.kill();
    assert!(
        wait_for(&a, 0, Duration::from_secs(30)).await,
        "a detected b's crash"
    );
    println!("crash detected in {:?} on loopback", t.elapsed());
    // A node with another CA's certificate never joins.
    let other = generate(&names(&["x"])).expect("other");
    let (x, _dx) = MeshNode::start(
        "x",
        any,
        &NodeTls::from_cluster(&other, "x").expect("x"),
        seed,
        cfg(false),
        clock(),
    )
    .await
    .expect("x");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        a.members.borrow().is_empty(),
        "x is not a member of a's cluster"
    );
    assert!(x.members.borrow().is_empty());
    x.leave().await;
    a.leave().await;
}
