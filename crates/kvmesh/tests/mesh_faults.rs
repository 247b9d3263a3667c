//! Ingest ownership and a hard kill across real processes: three `kvmesh serve` routers
//! (`--policy precise --ingest-replicas 2`) in front of four simulated engines publishing KV
//! events. Each engine's events are read by exactly two routers (counted), and a follow-up
//! through a router that does not read the engine still finds its prefix from the owner's
//! feed. Then one router is killed with SIGKILL under load: the others mark it down, every
//! engine has a live reader again, the survivors' digests agree, its load leaves their view,
//! and a client that retries on another router loses nothing. And an engine restarted: a
//! router that follows its owners' feed keeps the new process's blocks when it sees the new
//! process start time (it used to clear them for good). Bounded waits and loops.

mod common;

use common::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

fn cluster(base: &str) -> serde_json::Value {
    http(
        "GET",
        &format!("{base}/admin/cluster"),
        &[],
        "",
        Duration::from_secs(5),
    )
    .and_then(|r| serde_json::from_str(&r.body).ok())
    .unwrap_or(serde_json::Value::Null)
}

fn wait(what: &str, within: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

/// Engines (by id) this router reads.
fn reads(base: &str) -> Vec<String> {
    cluster(base)["ingest"]["engines"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter(|e| e["reads_here"] == true)
                .filter_map(|e| e["engine"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Σ of `kvmesh_kv_events_batches_total` over the engines: batches this router decoded.
fn decoded(base: &str) -> f64 {
    http(
        "GET",
        &format!("{base}/metrics"),
        &[],
        "",
        Duration::from_secs(5),
    )
    .map(|r| {
        r.body
            .lines()
            .filter(|l| l.starts_with("kvmesh_kv_events_batches_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    })
    .unwrap_or(0.0)
}

fn chat(system: &str, i: usize) -> String {
    serde_json::json!({
        "model": "m",
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": format!("question {i}")}],
        "max_tokens": 2,
    })
    .to_string()
}

/// The first turns of `n` conversations on `system`, spread over the routers: the engine
/// each went to.
fn first_turns(bases: &[String], system: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let r = http(
                "POST",
                &format!("{}/v1/chat/completions", bases[i % bases.len()]),
                &[],
                &chat(&format!("{i} {system}"), i),
                Duration::from_secs(30),
            )
            .expect("first");
            assert_eq!(r.status, 200, "{}", r.body);
            r.header("x-kvmesh-engine").unwrap_or_default().to_string()
        })
        .collect()
}

/// Three routers (`precise`, `--ingest-replicas 2`, meshed) in front of `engines` simulated
/// engines publishing KV events with replay, once the mesh has formed.
struct Cluster {
    dir: std::path::PathBuf,
    sims: Vec<Proc>,
    routers: Vec<Option<Proc>>,
    bases: Vec<String>,
}

impl Cluster {
    fn start(tag: &str, engines: usize) -> Cluster {
        Cluster::start_with(tag, engines, &[])
    }

    /// [`Cluster::start`], with `extra` arguments for the routers.
    fn start_with(tag: &str, engines: usize, extra: &[&str]) -> Cluster {
        let dir = certs_abc(tag);
        // Engines publishing KV events (with replay); their entries name the endpoints.
        let mut sims = Vec::new();
        let mut entries = Vec::new();
        for i in 0..engines {
            let ev = format!("tcp://127.0.0.1:{}", free_port());
            let rp = format!("tcp://127.0.0.1:{}", free_port());
            let seed = (i + 1).to_string();
            let p = Proc::start(&[
                "--model",
                "m",
                "--time-scale",
                "0.02",
                "--seed",
                &seed,
                "--kv-events",
                &ev,
                "--kv-events-replay",
                &rp,
            ]);
            entries.push(format!("url={},kv_events={ev},kv_replay={rp}", p.base()));
            sims.push(p);
        }
        let mut args: Vec<&str> = Vec::new();
        for e in &entries {
            args.extend(["--engine", e.as_str()]);
        }
        args.extend(["--policy", "precise", "--ingest-replicas", "2"]);
        args.extend(extra);
        let routers: Vec<Option<Proc>> =
            meshed_abc(&dir, tag, &args).into_iter().map(Some).collect();
        let bases: Vec<String> = routers.iter().flatten().map(Proc::base).collect();
        for b in &bases {
            wait("the mesh forms", Duration::from_secs(30), || {
                cluster(b)["members"].as_array().map(Vec::len) == Some(2)
            });
        }
        Cluster {
            dir,
            sims,
            routers,
            bases,
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.routers.clear();
        self.sims.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn owners_read_each_engine_and_a_killed_router_is_replaced_without_loss() {
    let mut c = Cluster::start("mesh-faults", 4);
    let bases = c.bases.clone();
    // Every engine read by exactly two routers.
    wait("ownership settles", Duration::from_secs(10), || {
        let all: Vec<Vec<String>> = bases.iter().map(|b| reads(b)).collect();
        let mut count = std::collections::BTreeMap::<String, usize>::new();
        for r in &all {
            for e in r {
                *count.entry(e.clone()).or_default() += 1;
            }
        }
        count.len() == 4 && count.values().all(|&n| n == 2)
    });

    // Traffic: 24 distinct conversations through the three routers, then each follow-up
    // through another router lands where its first turn did.
    let system = "You answer questions about one shared operations handbook. ".repeat(60);
    let t = Duration::from_secs(30);
    let firsts = first_turns(&bases, &system, 24);
    // The first turns' marks have reached every router when their digests agree.
    wait(
        "the first turns' state reaches every router",
        Duration::from_secs(10),
        || {
            let d: Vec<serde_json::Value> = bases
                .iter()
                .map(|b| cluster(b)["digests"].clone())
                .collect();
            !d[0].is_null() && d.iter().all(|x| *x == d[0])
        },
    );
    let mut same = 0;
    for i in 0..24 {
        let r = http(
            "POST",
            &format!("{}/v1/chat/completions", bases[(i + 1) % 3]),
            &[],
            &chat(&format!("{i} {system}"), i),
            t,
        )
        .expect("again");
        assert_eq!(r.status, 200, "{}", r.body);
        same += usize::from(r.header("x-kvmesh-engine") == Some(firsts[i].as_str()));
    }
    assert!(
        same >= 22,
        "{same} of 24 follow-ups through another router on the first turn's engine"
    );
    let counts: Vec<f64> = bases.iter().map(|b| decoded(b)).collect();
    let total: f64 = counts.iter().sum();
    println!(
        "batches decoded per router {counts:?}: shares {:?} (each engine read by 2 of 3)",
        counts
            .iter()
            .map(|c| format!("{:.2}", c / total * 2.0))
            .collect::<Vec<_>>()
    );
    // Every router reads 2 or 3 of the 4 engines (8 ownerships over 3 routers: rendezvous
    // hashing with bounded loads; rendezvous alone could give one router all 4 or none), and
    // decodes their batches.
    assert!(total > 0.0);
    for (b, c) in bases.iter().zip(&counts) {
        let r = reads(b);
        assert!((2..=3).contains(&r.len()), "{b} reads {r:?}");
        assert!(*c > 0.0, "{b}: decoded {c}, reads {r:?}");
    }

    // SIGKILL router c under load from a client that retries on another router.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, lost) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, ok, lost, bases, system) = (
            stop.clone(),
            ok.clone(),
            lost.clone(),
            bases.clone(),
            system.clone(),
        );
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut i = 0usize;
            while !stop.load(Relaxed) && Instant::now() < deadline && i < 2_000 {
                let body = chat(&format!("{} {system}", i % 24), i);
                let served = (0..3).any(|k| {
                    http(
                        "POST",
                        &format!("{}/v1/chat/completions", bases[(i + k) % 3]),
                        &[],
                        &body,
                        Duration::from_secs(20),
                    )
                    .is_some_and(|r| r.status == 200)
                });
                if served {
                    ok.fetch_add(1, Relaxed);
                } else {
                    lost.fetch_add(1, Relaxed);
                }
                i += 1;
            }
        })
    };
    wait("the client is under way", Duration::from_secs(20), || {
        ok.load(Relaxed) >= 20
    });
    let killed = c.routers[2].take().expect("c");
    drop(killed); // SIGKILL
    let t0 = Instant::now();
    for b in &bases[..2] {
        wait("c declared down", Duration::from_secs(30), || {
            cluster(b)["members"].as_array().map(Vec::len) == Some(1)
        });
    }
    let detected = t0.elapsed();
    let covered = wait(
        "every engine read by a survivor",
        Duration::from_secs(5),
        || {
            let mut all: Vec<String> = bases[..2].iter().flat_map(|b| reads(b)).collect();
            all.sort();
            all.dedup();
            all.len() == 4
        },
    );
    // The client goes on past the failover before it stops.
    let served = ok.load(Relaxed);
    wait(
        "the client is served after the failover",
        Duration::from_secs(30),
        || ok.load(Relaxed) >= served + 50 || load.is_finished(),
    );
    stop.store(true, Relaxed);
    load.join().expect("load");
    let agree = wait("survivors' digests agree", Duration::from_secs(10), || {
        let d: Vec<serde_json::Value> = bases[..2]
            .iter()
            .map(|b| cluster(b)["digests"].clone())
            .collect();
        d[0] == d[1] && !d[0].is_null()
    });
    // No load entry of c's is left: after the client stopped, no engine shows peer load.
    wait("c's load entries gone", Duration::from_secs(10), || {
        bases[..2].iter().all(|b| {
            cluster(b)["entries"]["load"]
                .as_u64()
                .is_some_and(|n| n <= 8)
        })
    });
    println!(
        "kill -9: c declared down in {detected:?}, every engine read again {covered:?} later, digests agree {agree:?} after; client: {} served, {} lost",
        ok.load(Relaxed),
        lost.load(Relaxed)
    );
    assert_eq!(
        lost.load(Relaxed),
        0,
        "a client retrying on another router loses nothing"
    );
    assert!(ok.load(Relaxed) > 0);
}

/// The cached tokens the router predicted for an answer (`x-kvmesh-predicted-cached-tokens`).
fn predicted_tokens(r: &Http) -> u64 {
    r.header("x-kvmesh-predicted-cached-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// `GET URL` as JSON (`Null` when it fails).
fn get_json(url: &str) -> serde_json::Value {
    http("GET", url, &[], "", Duration::from_secs(5))
        .and_then(|r| serde_json::from_str(&r.body).ok())
        .unwrap_or(serde_json::Value::Null)
}

#[test]
fn a_router_that_follows_a_restarted_engine_keeps_the_new_process_s_blocks() {
    let c = Cluster::start("mesh-restart", 2);
    wait("ownership settles", Duration::from_secs(10), || {
        c.bases.iter().map(|b| reads(b).len()).sum::<usize>() == 4
    });
    let t = Duration::from_secs(30);
    let system = "You answer questions about one shared operations handbook. ".repeat(40);
    let body = chat(&system, 0);
    let r = http(
        "POST",
        &format!("{}/v1/chat/completions", c.bases[0]),
        &[],
        &body,
        t,
    )
    .expect("first");
    assert_eq!(r.status, 200, "{}", r.body);
    let url = r.header("x-kvmesh-engine").expect("engine").to_string();
    let id = get_json(&format!("{}/status.json", c.bases[0]))["engines"]
        .as_array()
        .and_then(|v| v.iter().find(|e| e["url"] == url.as_str()))
        .and_then(|e| e["id"].as_str().map(str::to_string))
        .expect("the engine's id");
    // The router that does not read that engine: its blocks come from the owners' feed.
    let readers: Vec<bool> = c.bases.iter().map(|b| reads(b).contains(&id)).collect();
    assert_eq!(readers.iter().filter(|r| **r).count(), 2, "{readers:?}");
    let follower = &c.bases[readers.iter().position(|r| !r).expect("a follower")];

    // The engine restarts (empty cache, a new process start time) and, at once, computes the
    // prompt again for a client of its own: its owners read that from its events and feed it
    // to the follower, whose probe sees the new start time up to a second later.
    let restarted = http("POST", &format!("{url}/admin/restart"), &[], "", t).expect("restart");
    assert_eq!(restarted.status, 200, "{}", restarted.body);
    let direct =
        http("POST", &format!("{url}/v1/chat/completions"), &[], &body, t).expect("direct");
    assert_eq!(direct.status, 200, "{}", direct.body);
    let cached = get_json(&format!("{url}/admin/kv_cache"))["blocks"]
        .as_array()
        .map_or(0, Vec::len);
    assert!(cached > 0);
    // Past the follower's next reads of the engine's page (one a second).
    std::thread::sleep(Duration::from_millis(2_500));
    let r = http(
        "POST",
        &format!("{follower}/v1/chat/completions"),
        &[],
        &body,
        t,
    )
    .expect("through the follower");
    assert_eq!(r.status, 200, "{}", r.body);
    let predicted = predicted_tokens(&r);
    assert_eq!(
        r.header("x-kvmesh-engine"),
        Some(url.as_str()),
        "to the engine holding it"
    );
    assert!(
        predicted > 0,
        "the follower predicts the blocks the engine holds ({cached} blocks): it predicted {predicted} tokens"
    );
}

/// Sends SIGTERM to every process at once and waits for each to exit (a graceful stop).
fn terminate(procs: &mut [Proc]) {
    let pids: Vec<String> = procs.iter().map(|p| p.child.id().to_string()).collect();
    let sent = std::process::Command::new("kill")
        .arg("-TERM")
        .args(&pids)
        .status()
        .expect("kill");
    assert!(sent.success());
    for p in procs {
        let deadline = Instant::now() + Duration::from_secs(20);
        while p.child.try_wait().expect("wait").is_none() {
            assert!(
                Instant::now() < deadline,
                "a router did not stop on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// QA: both readers of an engine stopped together (a rolling restart two at a time, a
/// scale-down) left the router that came to read it nobody to take the engine's feed from:
/// it read the engine afresh, its blocks gone from every router's index until the engine's
/// next cache reset. A router that stops hands its feeds to the routers that read their
/// engines next.
#[test]
fn routers_that_stop_together_hand_their_engines_to_the_one_that_stays() {
    // Engines that have run for long: a router reading one afresh replays only its last two
    // batches (`replay_max_batches`; 1,000 by default, far fewer than such an engine gave).
    let conf = std::env::temp_dir().join(format!("kvmesh-bequest-{}.toml", std::process::id()));
    std::fs::write(&conf, "[serve.prefix]\nreplay_max_batches = 2\n").expect("config");
    let conf_arg = conf.to_str().expect("utf8").to_string();
    let mut c = Cluster::start_with("mesh-bequest", 4, &["--config", &conf_arg]);
    let _ = std::fs::remove_file(&conf);
    let bases = c.bases.clone();
    wait("ownership settles", Duration::from_secs(10), || {
        bases.iter().map(|b| reads(b).len()).sum::<usize>() == 8
    });
    let system = "You answer questions about one shared operations handbook. ".repeat(40);
    let t = Duration::from_secs(30);
    let firsts = first_turns(&bases, &system, 16);
    // The engines c does not read: a and b read them both.
    let ids: std::collections::BTreeMap<String, String> =
        get_json(&format!("{}/status.json", bases[2]))["engines"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter_map(|e| Some((e["url"].as_str()?.into(), e["id"].as_str()?.into())))
                    .collect()
            })
            .unwrap_or_default();
    let c_read = reads(&bases[2]);
    let handed: Vec<&String> = ids.values().filter(|id| !c_read.contains(id)).collect();
    assert!(!handed.is_empty(), "c reads {c_read:?} of {ids:?}");
    // Every engine's blocks reach c before a and b stop.
    wait("c holds every feed", Duration::from_secs(10), || {
        cluster(&bases[2])["ingest"]["engines"]
            .as_array()
            .is_some_and(|v| v.len() == 4 && v.iter().all(|e| e["synced"] == true))
    });
    // `/admin/cluster` names each engine by its URL beside its id.
    for e in cluster(&bases[2])["ingest"]["engines"]
        .as_array()
        .expect("engines")
    {
        let url = e["url"].as_str().expect("an engine's url");
        assert_eq!(
            ids.get(url).map(String::as_str),
            e["engine"].as_str(),
            "{e}"
        );
    }
    std::thread::sleep(Duration::from_millis(500));

    let mut ab: Vec<Proc> = c.routers[..2].iter_mut().filter_map(Option::take).collect();
    terminate(&mut ab);
    wait("c reads every engine", Duration::from_secs(10), || {
        reads(&bases[2]).len() == 4
    });
    let status = cluster(&bases[2]);
    let taken = status["bequests_taken"].as_u64().unwrap_or(0);
    assert!(
        taken >= handed.len() as u64,
        "c took {taken} bequest(s); a and b alone read {} engine(s)",
        handed.len()
    );
    // The follow-ups through c find their first turns' blocks where they are.
    let mut found = 0;
    let mut on_handed = 0;
    for (i, first) in firsts.iter().enumerate() {
        if !handed.contains(&&ids[first]) {
            continue;
        }
        on_handed += 1;
        let r = http(
            "POST",
            &format!("{}/v1/chat/completions", bases[2]),
            &[],
            &chat(&format!("{i} {system}"), i),
            t,
        )
        .expect("again");
        assert_eq!(r.status, 200, "{}", r.body);
        let predicted = predicted_tokens(&r);
        found += usize::from(r.header("x-kvmesh-engine") == Some(first.as_str()) && predicted > 0);
    }
    println!("{found} of {on_handed} follow-ups on the handed-over engines found their blocks");
    assert_eq!(found, on_handed);
}
