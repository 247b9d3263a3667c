//! Everything shipped in configs/ is checked against the binary: every TOML example parses
//! and validates (`KvmeshConfig::load`); the Kubernetes manifests are valid YAML whose names,
//! ports, probe paths, mounts and arguments agree with each other, with the TOML they embed
//! and with the config struct's defaults (read from it here, not re-typed), and whose probe
//! paths answer on a running router; every metric the Grafana dashboard queries is exported
//! by a running router (meshed, reading KV events) or a running engine.

use kvmesh_config::{KvmeshConfig, MeshConfig, PolicyKind, ServeConfig, SimConfig};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
}

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("configs dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    v.sort();
    v
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {addr}"))
}

#[test]
fn every_toml_example_parses_and_validates() {
    let tomls = files(&configs(), "toml");
    assert!(tomls.len() >= 6, "{tomls:?}");
    for f in &tomls {
        let c = KvmeshConfig::load(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        match name {
            "local-3-routers.toml" => {
                assert!(c.serve.mesh.enabled);
                assert_eq!(c.serve.engines.len(), 4);
                assert!(c.serve.engines.iter().all(|e| !e.kv_events.is_empty()));
            }
            "three-hosts.toml" => {
                assert!(c.serve.mesh.enabled && !c.serve.mesh.seed_dns.is_empty());
                assert_eq!(
                    port_of(&c.serve.mesh.seed_dns),
                    port_of(&MeshConfig::default().listen)
                );
            }
            "vllm.toml" => {
                assert_eq!(c.serve.routing.policy.policy, PolicyKind::Precise);
                assert!(c.serve.engines.iter().all(|e| !e.kv_replay.is_empty()));
            }
            "sglang.toml" => {
                assert_eq!(c.serve.routing.policy.policy, PolicyKind::CacheAware);
                assert!(c.serve.engines.iter().all(|e| e.kv_events.is_empty()));
            }
            _ => {}
        }
    }
}

/// Every document of every manifest.
fn manifests() -> Vec<Value> {
    let mut docs = Vec::new();
    for f in files(&configs().join("kubernetes"), "yaml") {
        let text = std::fs::read_to_string(&f).expect("read");
        for d in text.split("\n---\n") {
            let v: Value = serde_yaml::from_str(d)
                .unwrap_or_else(|e| panic!("{}: invalid YAML: {e}", f.display()));
            assert!(
                v["apiVersion"].is_string() && v["kind"].is_string(),
                "{}: {v}",
                f.display()
            );
            docs.push(v);
        }
    }
    docs
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn named_port(container: &Value, name: &str) -> (u64, String) {
    let p = container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no container port {name}"));
    (
        p["containerPort"].as_u64().expect("port"),
        p["protocol"].as_str().unwrap_or("TCP").to_string(),
    )
}

fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| labels[k] == *v))
}

/// The router manifests, checked against the embedded config and the struct's defaults.
struct Routers {
    cfg: KvmeshConfig,
    readiness: String,
    liveness: String,
}

fn check_kubernetes() -> Routers {
    let docs = manifests();
    let cm = find(&docs, "ConfigMap", "kvmesh-config");
    let toml = cm["data"]["kvmesh.toml"].as_str().expect("kvmesh.toml");
    let dep = find(&docs, "Deployment", "kvmesh-router");
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg"))
        .collect();
    let arg = |flag: &str| {
        let i = args
            .iter()
            .position(|a| *a == flag)
            .unwrap_or_else(|| panic!("no {flag}"));
        args[i + 1]
    };
    // The file as the container's args complete it (--node-id, --mesh-listen override those
    // keys), with the values Kubernetes substitutes.
    assert!(toml.contains("\n[serve.mesh]\n"));
    let completed = toml.replacen(
        "\n[serve.mesh]\n",
        &format!(
            "\n[serve.mesh]\nnode_id = \"{}\"\nlisten = \"{}\"\n",
            arg("--node-id").replace("$(POD_NAME)", "kvmesh-router-7d9f8c6b5-x2x4q"),
            arg("--mesh-listen").replace("$(POD_IP)", "10.244.1.17")
        ),
        1,
    );
    let cfg =
        KvmeshConfig::from_toml_str(&completed, "ConfigMap kvmesh-config + args").expect("valid");
    // The file alone leaves node_id to the args: `kvmesh serve` with the container's args
    // (their values substituted) takes it, and checks the whole once the flags are laid over.
    // Two tests read the manifests at once: a file each.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!(
        "kvmesh-configmap-{}-{call}.toml",
        std::process::id()
    ));
    // The Secret's pair as `kvmesh cert` writes it, where the pod mounts it: here, a temporary
    // directory in place of its mount path (--check-config loads the certificates).
    let tls = std::env::temp_dir().join(format!("kvmesh-secret-{}-{call}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tls);
    let cert = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["cert", "--out"])
        .arg(&tls)
        .args(["--nodes", &cfg.serve.mesh.cert_name])
        .output()
        .expect("kvmesh cert");
    assert!(
        cert.status.success(),
        "{}",
        String::from_utf8_lossy(&cert.stderr)
    );
    let mounted = format!("tls_dir = {:?}", cfg.serve.mesh.tls_dir);
    assert!(toml.contains(&mounted), "the ConfigMap names its tls_dir");
    let toml = toml.replace(
        &mounted,
        &format!("tls_dir = {:?}", tls.display().to_string()),
    );
    std::fs::write(&file, toml).expect("write the ConfigMap's file");
    let substituted: Vec<String> = args
        .iter()
        .map(|a| {
            if *a == "/etc/kvmesh/config/kvmesh.toml" {
                file.display().to_string()
            } else {
                a.replace("$(POD_NAME)", "kvmesh-router-7d9f8c6b5-x2x4q")
                    .replace("$(POD_IP)", "10.244.1.17")
            }
        })
        .collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(&substituted)
        .arg("--check-config")
        .output()
        .expect("kvmesh serve --check-config");
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_dir_all(&tls);
    assert!(
        out.status.success(),
        "the Deployment's args with its ConfigMap: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The router's configuration alone (QA: a `[sim]` section it never reads came with it).
    assert!(!String::from_utf8_lossy(&out.stdout).contains("[sim"));
    let mut effective =
        KvmeshConfig::from_toml_str(&String::from_utf8_lossy(&out.stdout), "printed")
            .expect("the printed configuration is valid");
    effective.serve.mesh.tls_dir = cfg.serve.mesh.tls_dir.clone();
    assert_eq!(
        effective.serve, cfg.serve,
        "the args complete the file as the test does"
    );
    let s = &cfg.serve;
    let defaults = ServeConfig::default();

    let pod = &dep["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    assert!(selects(&dep["spec"]["selector"]["matchLabels"], labels));
    assert_eq!(args[0], "serve");
    // Ports: HTTP from the config's listen, the mesh from the default mesh port.
    let (http, proto) = named_port(c, "http");
    assert_eq!(
        (http, proto.as_str()),
        (u64::from(port_of(&s.listen)), "TCP")
    );
    assert_eq!(
        port_of(&s.listen),
        port_of(&defaults.listen),
        "the default port"
    );
    let mesh_port = u64::from(port_of(&MeshConfig::default().listen));
    let (mesh, proto) = named_port(c, "mesh");
    assert_eq!((mesh, proto.as_str()), (mesh_port, "UDP"));
    assert_eq!(arg("--mesh-listen"), format!("$(POD_IP):{mesh_port}"));
    assert_eq!(arg("--node-id"), "$(POD_NAME)");
    let env: BTreeSet<&str> = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(
        env.contains("POD_NAME") && env.contains("POD_IP"),
        "{env:?}"
    );
    // The config file and the certificates are where the args and the config say.
    let mounts = c["volumeMounts"].as_array().expect("mounts");
    let mount_of = |vol: &str| {
        mounts
            .iter()
            .find(|m| m["name"] == vol)
            .and_then(|m| m["mountPath"].as_str())
            .unwrap_or_else(|| panic!("no mount of {vol}"))
    };
    let volumes = pod["spec"]["volumes"].as_array().expect("volumes");
    let volume = |name: &str| {
        volumes
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
    };
    let config_vol = mounts
        .iter()
        .find(|m| arg("--config").starts_with(m["mountPath"].as_str().unwrap_or("-")))
        .and_then(|m| m["name"].as_str())
        .expect("--config under a mount");
    assert_eq!(
        volume(config_vol)["configMap"]["name"],
        "kvmesh-config",
        "the config mount"
    );
    assert_eq!(
        arg("--config"),
        format!("{}/kvmesh.toml", mount_of(config_vol))
    );
    assert!(s.mesh.enabled);
    assert_eq!(mount_of("tls"), s.mesh.tls_dir);
    let pair = if s.mesh.cert_name.is_empty() {
        panic!("a Deployment's replicas share a pair: set cert_name")
    } else {
        &s.mesh.cert_name
    };
    let secret = &volume("tls")["secret"];
    let keys: BTreeSet<&str> = secret["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|i| i["path"].as_str())
        .collect();
    let want: BTreeSet<String> = [
        "ca.pem".to_string(),
        format!("{pair}.pem"),
        format!("{pair}.key"),
    ]
    .into();
    assert_eq!(
        keys,
        want.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    let drain_s = (s.shutdown_delay_ms + s.drain_timeout_ms) / 1000;
    assert!(
        s.shutdown_delay_ms >= 2 * 2_000,
        "readiness fails (2 probes, 2 s apart) before the router stops accepting"
    );
    assert!(
        pod["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .is_some_and(|g| g > drain_s),
        "the grace period must outlast the delay and the drain ({drain_s} s)"
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "http");
    let readiness = c["readinessProbe"]["httpGet"]["path"]
        .as_str()
        .expect("readiness path")
        .to_string();
    let liveness = c["livenessProbe"]["httpGet"]["path"]
        .as_str()
        .expect("liveness path")
        .to_string();

    // The mesh's seeds: a headless Service of the router pods, not-ready ones included.
    let ns = "default";
    let seeds = find(&docs, "Service", "kvmesh-mesh");
    assert_eq!(seeds["spec"]["clusterIP"], "None");
    assert_eq!(seeds["spec"]["publishNotReadyAddresses"], true);
    assert!(selects(&seeds["spec"]["selector"], labels));
    assert_eq!(seeds["spec"]["ports"][0]["port"].as_u64(), Some(mesh_port));
    assert_eq!(seeds["spec"]["ports"][0]["protocol"], "UDP");
    assert_eq!(
        s.mesh.seed_dns,
        format!("kvmesh-mesh.{ns}.svc.cluster.local:{mesh_port}")
    );
    // Clients: a ClusterIP Service on the routers' HTTP port.
    let clients = find(&docs, "Service", "kvmesh");
    assert_eq!(clients["spec"]["type"], "ClusterIP");
    assert!(selects(&clients["spec"]["selector"], labels));
    assert_eq!(clients["spec"]["ports"][0]["targetPort"], "http");
    let pdb = find(&docs, "PodDisruptionBudget", "kvmesh-router");
    assert!(selects(&pdb["spec"]["selector"]["matchLabels"], labels));
    assert!(
        pdb["spec"]["minAvailable"].as_u64() < dep["spec"]["replicas"].as_u64(),
        "a PDB as large as the Deployment blocks every drain"
    );

    // The engines: the DNS entry names the vLLM headless Service and its ports.
    let svc = find(&docs, "Service", "vllm-engines");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    let vllm = find(&docs, "Deployment", "vllm");
    let vpod = &vllm["spec"]["template"];
    assert!(selects(
        &svc["spec"]["selector"],
        &vpod["metadata"]["labels"]
    ));
    let vc = &vpod["spec"]["containers"][0];
    let svc_port = |name: &str| {
        svc["spec"]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == name)
            .and_then(|p| p["port"].as_u64())
            .unwrap_or_else(|| panic!("no service port {name}"))
    };
    assert_eq!(s.dns.len(), 1);
    let d = &s.dns[0];
    assert_eq!(
        d.name,
        format!("vllm-engines.{ns}.svc.cluster.local:{}", svc_port("http"))
    );
    assert_eq!(named_port(vc, "http").0, svc_port("http"));
    assert_eq!(u64::from(d.kv_events_port), named_port(vc, "kv-events").0);
    assert_eq!(u64::from(d.kv_replay_port), named_port(vc, "kv-replay").0);
    let vargs: Vec<&str> = vc["args"]
        .as_array()
        .expect("vllm args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let varg = |flag: &str| {
        let i = vargs
            .iter()
            .position(|a| *a == flag)
            .unwrap_or_else(|| panic!("no {flag}"));
        vargs[i + 1]
    };
    assert_eq!(varg("--block-size"), s.prefix.block_size.to_string());
    assert_eq!(varg("--port"), svc_port("http").to_string());
    let ev: Value = serde_json::from_str(varg("--kv-events-config")).expect("kv events JSON");
    assert_eq!(ev["enable_kv_cache_events"], true);
    assert_eq!(ev["publisher"], "zmq");
    assert_eq!(ev["endpoint"], format!("tcp://*:{}", d.kv_events_port));
    assert_eq!(
        ev["replay_endpoint"],
        format!("tcp://*:{}", d.kv_replay_port)
    );
    assert_eq!(ev["topic"], s.prefix.kv_events_topic);
    assert_eq!(
        s.routing.policy.policy,
        PolicyKind::Precise,
        "engines publish events: precise"
    );
    Routers {
        cfg,
        readiness,
        liveness,
    }
}

#[test]
fn kubernetes_manifests_agree_with_each_other_and_the_binary() {
    check_kubernetes();
}

/// Metric names a PromQL expression reads (`kvmesh_*`, `vllm:*`).
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for ch in expr.chars().chain(std::iter::once(' ')) {
        if ch.is_ascii_alphanumeric() || ch == '_' || ch == ':' {
            cur.push(ch);
        } else {
            if cur.starts_with("kvmesh_") || cur.starts_with("vllm:") {
                out.push(cur.clone());
            }
            cur.clear();
        }
    }
    out
}

fn exported(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Two meshed routers (policy precise) in front of one engine publishing KV events, one
/// request through them: every metric the dashboard queries is in a router's or the engine's
/// `/metrics`, and the manifests' probe paths answer 200 on a ready router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_queries_only_exported_metrics_and_the_probes_answer() {
    let k8s = check_kubernetes();
    let text = std::fs::read_to_string(configs().join("grafana/kvmesh-dashboard.json"))
        .expect("dashboard");
    let dash: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut queried = BTreeSet::new();
    for p in dash["panels"].as_array().expect("panels") {
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}", p["title"]);
        for t in targets {
            let names = metric_names(t["expr"].as_str().expect("expr"));
            assert!(!names.is_empty(), "{}: {}", p["title"], t["expr"]);
            queried.extend(names);
        }
    }
    for want in [
        "kvmesh_engine_predicted_cached_tokens_total",
        "vllm:prefix_cache_hits_total",
        "kvmesh_engine_ttft_seconds_bucket",
        "kvmesh_engine_in_flight",
        "kvmesh_mesh_delta_lag_seconds",
        "kvmesh_mesh_envelope_age_seconds_bucket",
        "kvmesh_mesh_bytes_total",
        "kvmesh_mesh_members",
        "kvmesh_engine_breaker_state",
    ] {
        assert!(queried.contains(want), "the dashboard lacks {want}");
    }

    let sims = kvmesh_sim::start_fleet(1, true, |i| SimConfig {
        time_scale: 0.05,
        seed: i as u64,
        ..SimConfig::default()
    })
    .await
    .expect("engine");
    let dir = std::env::temp_dir().join(format!("kvmesh-configs-test-{}", std::process::id()));
    let certs = kvmesh_mesh::certs::generate(&["a".into(), "b".into()]).expect("certs");
    kvmesh_mesh::certs::write_dir(&dir, &certs).expect("write");
    let cfg = |name: &str, seeds: Vec<String>| {
        let mut c = ServeConfig {
            listen: "127.0.0.1:0".into(),
            engines: sims.entries.clone(),
            ..ServeConfig::default()
        };
        c.routing.policy.policy = PolicyKind::Precise;
        c.mesh = MeshConfig {
            enabled: true,
            node_id: name.into(),
            listen: "127.0.0.1:0".into(),
            seeds,
            tls_dir: dir.display().to_string(),
            expected_routers: 2,
            ..k8s.cfg.serve.mesh.clone()
        };
        c.mesh.cert_name = String::new();
        c.mesh.seed_dns = String::new();
        c
    };
    let a = kvmesh_gateway::start(cfg("a", vec![]))
        .await
        .expect("router a");
    let seed = a
        .cluster
        .as_ref()
        .and_then(|c| c.addr())
        .expect("mesh addr");
    let b = kvmesh_gateway::start(cfg("b", vec![seed.to_string()]))
        .await
        .expect("router b");
    let get =
        |url: String| async move { kvmesh_bench::fetch_text(&url, Duration::from_secs(5)).await };
    // Ready (the readiness probe's path) within a bound; the liveness path answers too.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for r in [&a, &b] {
        while get(format!("{}{}", r.base_url(), k8s.readiness))
            .await
            .is_err()
        {
            assert!(tokio::time::Instant::now() < deadline, "router never ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        get(format!("{}{}", r.base_url(), k8s.liveness))
            .await
            .expect("liveness path answers");
    }
    let wl = kvmesh_bench::SharedPrefixWorkload {
        groups: 1,
        users: 1,
        turns: 2,
        system_words: 200,
        question_words: 10,
        max_tokens: 4,
        seed: 1,
    };
    let report = kvmesh_bench::run_shared_prefix(
        &wl,
        kvmesh_bench::Targets::RoundRobin(vec![a.base_url(), b.base_url()]),
        kvmesh_bench::LoadOptions {
            model: SimConfig::default().model,
            concurrency: 1,
            request_timeout: Duration::from_secs(30),
            deadline: Duration::from_secs(60),
        },
    )
    .await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    // Some series appear only once there is something to say (the prediction ratio after a
    // discovery scrape that saw cache hits): scrape until all are there, within a bound.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut have = BTreeSet::new();
        for url in [
            format!("{}/metrics", a.base_url()),
            format!("{}/metrics", b.base_url()),
            format!("{}/metrics", sims.urls()[0]),
        ] {
            have.extend(exported(&get(url).await.expect("scrape")));
        }
        let missing: Vec<&String> = queried.iter().filter(|m| !have.contains(*m)).collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "queried but not exported: {missing:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    a.shutdown().await;
    b.shutdown().await;
    sims.shutdown(Duration::from_secs(5)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mesh_flags_on_a_router_without_a_mesh_are_refused() {
    let serve = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(["serve", "--engine", "http://127.0.0.1:9", "--check-config"])
            .args(extra)
            .output()
            .expect("kvmesh serve --check-config")
    };
    for flag in [
        &["--seed", "127.0.0.1:7946"][..],
        &["--mesh-listen", "127.0.0.1:7946"],
        &["--cluster-id", "prod"],
        &["--tls-dir", "certs"],
    ] {
        let out = serve(flag);
        assert!(!out.status.success(), "{flag:?} without --node-id");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag[0]) && err.contains("--node-id"), "{err}");
    }
    let out = serve(&["--admin-token", "s3cret-token"]);
    assert!(out.status.success(), "no mesh flag: a router alone");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains("admin_token = \"<redacted>\"") && !printed.contains("s3cret-token"),
        "the admin token is masked: {printed}"
    );
    // Meshed, the certificates are loaded and checked as at start (found by QA: a directory
    // that does not exist passed the check).
    let missing = std::env::temp_dir().join(format!("kvmesh-no-certs-{}", std::process::id()));
    let out = serve(&[
        "--node-id",
        "a",
        "--tls-dir",
        &missing.display().to_string(),
    ]);
    assert!(!out.status.success(), "no certificates");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("serve.mesh.tls_dir") && err.contains("ca.pem"),
        "{err}"
    );
    // The mesh address is the router's address in the membership (QA: 0.0.0.0 passed).
    let out = serve(&["--node-id", "a", "--mesh-listen", "0.0.0.0:7946"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("serve.mesh.listen") && err.contains("0.0.0.0"),
        "{err}"
    );
    let out = serve(&["--no-mesh", "--node-id", "a", "--seed", "127.0.0.1:7946"]);
    assert!(
        out.status.success(),
        "--no-mesh says the mesh is off on purpose"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--node-id, --seed ignored"),
        "the flags --no-mesh overrides are named (QA): {err}"
    );
}

/// `kvmesh config check` refuses what `serve` and `sim` would refuse at start (a `[sim]`
/// profile or tokenizer that does not exist), and accepts a file that leaves each router's
/// name to its flags, as the Kubernetes ConfigMap does, saying so.
#[test]
fn config_check_refuses_what_the_programs_refuse_and_accepts_the_configmap() {
    let dir = std::env::temp_dir().join(format!("kvmesh-config-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let check = |name: &str, text: &str| {
        let f = dir.join(name);
        std::fs::write(&f, text).expect("write");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(["config", "check"])
            .arg(&f)
            .output()
            .expect("kvmesh config check");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), err)
    };
    let docs = manifests();
    let cm = find(&docs, "ConfigMap", "kvmesh-config");
    let toml = cm["data"]["kvmesh.toml"].as_str().expect("kvmesh.toml");
    let (ok, err) = check("configmap.toml", toml);
    assert!(ok, "{err}");
    assert!(err.contains("serve.mesh.node_id is not set here"), "{err}");
    // A simulator's file is no router's: nothing is said of a router's engines (QA35).
    let (ok, err) = check("sim-only.toml", "[sim]\nseed = 3\n");
    assert!(ok && !err.contains("no engines"), "{err}");
    let (ok, err) = check("serve-empty.toml", "[serve]\nlisten = \"127.0.0.1:8080\"\n");
    assert!(ok && err.contains("gives the router no engines"), "{err}");
    let (ok, err) = check("profile.toml", "[sim.engine]\nprofile = \"nosuch\"\n");
    assert!(!ok && err.contains("nosuch"), "{err}");
    let (ok, err) = check("tok.toml", "[sim]\ntokenizer = \"/nonexistent-kvmesh\"\n");
    assert!(!ok && err.contains("sim.tokenizer"), "{err}");
    // A tokenizer that exists but does not load is refused as at start (QA34: only `serve
    // --check-config` loaded them).
    let not_one = dir.join("not-a-tokenizer.json");
    std::fs::write(&not_one, "{}").expect("write");
    let not_one = not_one.display();
    let (ok, err) = check(
        "tok-serve.toml",
        &format!(
            "[serve.routing.policy]\npolicy = \"cache_aware\"\n[serve.prefix]\ntokenizer = \"{not_one}\"\n"
        ),
    );
    assert!(!ok && err.contains("serve.prefix.tokenizer"), "{err}");
    let (ok, err) = check(
        "tok-sim.toml",
        &format!("[sim]\ntokenizer = \"{not_one}\"\n"),
    );
    assert!(!ok && err.contains("sim.tokenizer"), "{err}");
    // Only the name is left to the flags: the rest of the mesh section is still checked.
    let (ok, err) = check(
        "mesh.toml",
        "[serve.mesh]\nenabled = true\nnode_id = \"a b\"\ntls_dir = \"/x\"\n",
    );
    assert!(!ok && err.contains("node_id"), "{err}");
    // A router named here: its certificates are loaded as at its start (QA: a file naming a
    // directory that did not exist passed the check).
    let (ok, err) = check(
        "certs.toml",
        "[serve.mesh]\nenabled = true\nnode_id = \"a\"\ntls_dir = \"/nonexistent-kvmesh\"\n",
    );
    assert!(!ok && err.contains("serve.mesh.tls_dir"), "{err}");
    let tls = dir.join("tls");
    let made = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["cert", "--out"])
        .arg(&tls)
        .args(["--nodes", "a"])
        .output()
        .expect("kvmesh cert");
    assert!(made.status.success());
    let good = format!(
        "[serve.mesh]\nenabled = true\nnode_id = \"a\"\ntls_dir = \"{}\"\n",
        tls.display()
    );
    let (ok, err) = check("certs-ok.toml", &good);
    assert!(ok, "{err}");
    let (ok, err) = check("certs-other.toml", &good.replace("\"a\"", "\"b\""));
    assert!(!ok && err.contains("serve.mesh.tls_dir"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kvmesh chaos run` checks every scenario file before it runs any, and names each refused
/// file once (QA: a bad file was found only after the ones before it had run, and its path
/// was said twice).
#[test]
fn chaos_run_refuses_bad_scenario_files_before_running_any() {
    let dir = std::env::temp_dir().join(format!("kvmesh-chaos-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let garbage = dir.join("garbage.toml");
    std::fs::write(&garbage, "steps = [\n").expect("write");
    let missing = dir.join("missing.toml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["chaos", "run", "--quick", "--out"])
        .arg(dir.join("out"))
        .arg(&garbage)
        .arg(&missing)
        .output()
        .expect("kvmesh chaos run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("2 of 2 scenario file(s) refused; nothing was run"),
        "{err}"
    );
    for f in [&garbage, &missing] {
        assert_eq!(err.matches(&f.display().to_string()).count(), 1, "{err}");
    }
    assert!(!dir.join("out").exists(), "nothing ran");
    let _ = std::fs::remove_dir_all(&dir);
}
