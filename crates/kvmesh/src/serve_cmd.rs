//! `kvmesh serve`: flags, their merge over the config file, and the run loop.

use clap::Args;
use kvmesh_config::{
    DnsEntry, EngineEntry, KvmeshConfig, PolicyKind, ServeConfig, UpstreamProtocol,
};
use std::path::PathBuf;

fn d() -> ServeConfig {
    ServeConfig::default()
}

fn policy_names() -> String {
    PolicyKind::ALL
        .iter()
        .map(|p| p.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    PolicyKind::ALL
        .iter()
        .copied()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| format!("unknown policy `{s}` (one of: {})", policy_names()))
}

/// Flags of `kvmesh serve`. Every flag overrides the same key of the config file; defaults
/// come from `kvmesh_config::ServeConfig`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML config file (section `[serve]`); flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[arg(long, value_name = "IP:PORT", help = format!("HTTP address of the router [default: {}]", d().listen))]
    pub listen: Option<String>,
    /// An engine: a base URL, or url=URL,kv_events=ENDPOINT,kv_replay=ENDPOINT,weight=N,models=a;b (repeatable;
    /// added to the file's engines).
    #[arg(long = "engine", value_name = "ENGINE", value_parser = EngineEntry::parse)]
    pub engines: Vec<EngineEntry>,
    /// A DNS name (host:port) resolving to many engines, re-resolved periodically (repeatable).
    #[arg(long = "dns", value_name = "HOST:PORT")]
    pub dns: Vec<String>,
    #[arg(long, value_name = "NAME", value_parser = parse_policy, help = format!("Default routing policy: {}; a model with its own ([serve.models.\"M\".policy]) keeps it [default: {}]", policy_names(), d().routing.policy.policy.as_str()))]
    pub policy: Option<PolicyKind>,
    /// Bearer token protecting /admin/engines (empty = /admin/engines disabled; /admin/cluster needs none).
    /// [env: KVMESH_ADMIN_TOKEN, over the file; empty = unset]
    #[arg(long, value_name = "TOKEN")]
    pub admin_token: Option<String>,
    /// Key the router sends (`Authorization: Bearer KEY`) on its own requests to engines started with --api-key: model discovery, health checks, metrics.
    /// [env: KVMESH_ENGINE_API_KEY, over the file; empty = unset]
    #[arg(long, value_name = "KEY")]
    pub engine_api_key: Option<String>,
    /// A web page origin that may call the router from a browser (CORS), as the browser sends `Origin` (`https://app.example.com`; `*` = any); repeatable, replaces the file's list.
    #[arg(long = "cors-allowed-origin", value_name = "ORIGIN")]
    pub cors_allowed_origins: Vec<String>,
    #[arg(long, value_name = "N", help = format!("Attempts per request including the first, each on another engine: at most the policy's `candidates` ({}) are made, so raise both [default: {}]", d().routing.policy.candidates, d().retry.max_attempts))]
    pub max_attempts: Option<u32>,
    #[arg(
        long = "routing-seed",
        value_name = "N",
        help = "Seed of the routing randomness; 0 = from the clock [default: 0]"
    )]
    pub seed: Option<u64>,
    /// Turn the circuit breakers off.
    #[arg(long)]
    pub no_breakers: bool,
    /// Speak HTTP/2 cleartext with prior knowledge (h2c) to the engines: one multiplexed
    /// connection per engine. Only for engines or sidecars that serve h2c; vLLM and SGLang
    /// serve HTTP/1.1 only (the default).
    #[arg(long)]
    pub upstream_http2: bool,
    /// Tokenizer of cache-aware routing: a tokenizer.json or its directory (empty = bundled
    /// Qwen3); it must be the engines' for precise routing.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<String>,
    #[arg(long, value_name = "N", help = format!("Tokens per KV block, the engines' block size [default: {}]", d().prefix.block_size))]
    pub block_size: Option<u32>,
    /// This router's name in the mesh (joins the mesh; needs --tls-dir).
    #[arg(long, value_name = "NAME")]
    pub node_id: Option<String>,
    #[arg(long, value_name = "IP:PORT", help = format!("UDP address of the mesh, an IP address and port (not a name) [default: {}]", d().mesh.listen))]
    pub mesh_listen: Option<String>,
    /// A seed: another router's mesh address (repeatable).
    #[arg(long = "seed", value_name = "HOST:PORT")]
    pub seeds: Vec<String>,
    /// A DNS name whose addresses are seeds (a headless Service), re-resolved.
    #[arg(long, value_name = "NAME:PORT")]
    pub seed_dns: Option<String>,
    #[arg(long, value_name = "ID", help = format!("Cluster id: routers of another never change this one's state [default: {}]", d().mesh.cluster_id))]
    pub cluster_id: Option<String>,
    /// Certificates as `kvmesh cert` writes them (ca.pem, <node>.pem, <node>.key).
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<String>,
    /// Run alone even if the config file enables the mesh.
    #[arg(long)]
    pub no_mesh: bool,
    #[arg(long, value_name = "N", help = format!("Routers reading each engine's KV events, 0 = all [default: {}]", d().mesh.ingest_replicas))]
    pub ingest_replicas: Option<u32>,
    /// Check the configuration these flags and the file make, and the files it names (the
    /// tokenizers; meshed, the certificates, as the router checks them at start), print it
    /// (TOML) and exit without serving (what a pod's args and its ConfigMap would run).
    #[arg(long)]
    pub check_config: bool,
}

impl ServeArgs {
    /// The effective configuration: defaults ← file ← environment variables ← flags,
    /// validated.
    pub fn resolve(&self) -> Result<ServeConfig, String> {
        self.resolve_with(|name| std::env::var(name))
    }

    /// [`ServeArgs::resolve`] with the environment variables read by `var`.
    fn resolve_with(
        &self,
        var: impl Fn(&str) -> Result<String, std::env::VarError>,
    ) -> Result<ServeConfig, String> {
        let mut file = match &self.config {
            Some(p) => KvmeshConfig::read(p).map_err(|e| e.to_string())?,
            None => KvmeshConfig::default(),
        };
        let c = &mut file.serve;
        c.apply_env(var).map_err(|e| e.to_string())?;
        if let Some(v) = &self.listen {
            c.listen = v.clone();
        }
        c.engines.extend(self.engines.iter().cloned());
        for name in &self.dns {
            c.dns.push(DnsEntry {
                name: name.clone(),
                ..DnsEntry::default()
            });
        }
        if let Some(p) = self.policy {
            c.routing.policy.policy = p;
        }
        if let Some(t) = &self.admin_token {
            c.admin_token = t.clone();
        }
        if let Some(k) = &self.engine_api_key {
            c.engine_api_key = k.clone();
        }
        if !self.cors_allowed_origins.is_empty() {
            c.cors_allowed_origins = self.cors_allowed_origins.clone();
        }
        if let Some(n) = self.max_attempts {
            c.retry.max_attempts = n;
        }
        if let Some(s) = self.seed {
            c.seed = s;
        }
        if self.no_breakers {
            c.routing.health.breaker.enabled = false;
        }
        if self.upstream_http2 {
            c.upstream.protocol = UpstreamProtocol::Http2;
        }
        if let Some(t) = &self.tokenizer {
            c.prefix.tokenizer = t.clone();
        }
        if let Some(b) = self.block_size {
            c.prefix.block_size = b;
        }
        let m = &mut c.mesh;
        if let Some(v) = &self.node_id {
            m.node_id = v.clone();
            m.enabled = true;
        }
        if let Some(v) = &self.mesh_listen {
            m.listen = v.clone();
        }
        m.seeds.extend(self.seeds.iter().cloned());
        if let Some(v) = &self.seed_dns {
            m.seed_dns = v.clone();
        }
        if let Some(v) = &self.cluster_id {
            m.cluster_id = v.clone();
        }
        if let Some(v) = &self.tls_dir {
            m.tls_dir = v.clone();
        }
        if let Some(v) = self.ingest_replicas {
            m.ingest_replicas = v;
        }
        if self.no_mesh {
            m.enabled = false;
        }
        // A mesh flag on a router that will not join a mesh is a mistake, not a no-op.
        let mesh_flags = [
            ("--mesh-listen", self.mesh_listen.is_some()),
            ("--seed", !self.seeds.is_empty()),
            ("--seed-dns", self.seed_dns.is_some()),
            ("--cluster-id", self.cluster_id.is_some()),
            ("--tls-dir", self.tls_dir.is_some()),
            ("--ingest-replicas", self.ingest_replicas.is_some()),
        ];
        if !m.enabled
            && !self.no_mesh
            && let Some((flag, _)) = mesh_flags.iter().find(|(_, given)| *given)
        {
            return Err(format!(
                "{flag} configures the mesh, which is off: give --node-id NAME (or set [serve.mesh] enabled and node_id in --config)"
            ));
        }
        // --no-mesh turns the mesh off on purpose (a wrapper that always passes the mesh's
        // flags); the flags it overrides are named, not dropped without a word.
        if self.no_mesh {
            let ignored: Vec<&str> = [("--node-id", self.node_id.is_some())]
                .iter()
                .chain(&mesh_flags)
                .filter(|(_, given)| *given)
                .map(|(flag, _)| *flag)
                .collect();
            if !ignored.is_empty() {
                eprintln!(
                    "kvmesh: note: --no-mesh: the router runs alone; {} ignored",
                    ignored.join(", ")
                );
            }
        }
        // Its own section only (QA33: a shared file's [sim] stopped the router).
        file.validate_serve().map_err(|e| e.to_string())?;
        // A router may start without engines when something can give it some: its mesh (the
        // cluster's registry) or its admin API.
        if !file.serve.has_engine_source() {
            return Err(format!("no engines: {NO_ENGINES}"));
        }
        Ok(file.serve)
    }
}

const NO_ENGINES: &str = "give --engine URL (repeatable), --dns HOST:PORT, or [serve] engines in --config (or start it empty with --admin-token, to add them through /admin/engines, or --node-id, to take a mesh's)";

/// What the checks say of retry attempts the policies' `candidates` cap: each attempt goes
/// to another engine of the decision's list, so a larger `max_attempts` is never reached
/// (QA35: passed without a word).
pub fn attempts_note(cfg: &ServeConfig) -> Option<String> {
    let want = cfg.retry.max_attempts as usize;
    let mut capped: Vec<String> = Vec::new();
    if cfg.routing.policy.candidates < want {
        capped.push(format!(
            "serve.routing.policy.candidates = {}",
            cfg.routing.policy.candidates
        ));
    }
    for (name, m) in &cfg.models {
        if let Some(p) = &m.policy
            && p.candidates < want
        {
            capped.push(format!(
                "serve.models.\"{name}\".policy.candidates = {}",
                p.candidates
            ));
        }
    }
    (!capped.is_empty()).then(|| {
        format!(
            "serve.retry.max_attempts = {want}, but each attempt goes to another of the decision's candidates, so fewer are made where {}: raise both",
            capped.join(", ")
        )
    })
}

/// What `kvmesh config check` says of a file whose `[serve]` gives the router no engines:
/// `kvmesh serve` refuses it unless its flags or environment give some (a file for `sim`
/// alone, or one completed by each router's flags, is not wrong).
pub fn no_engines_note(cfg: &ServeConfig) -> Option<String> {
    (!cfg.has_engine_source()).then(|| {
        format!(
            "[serve] gives the router no engines: `kvmesh serve --config FILE` alone refuses to start (no engines); {NO_ENGINES}, or set KVMESH_ADMIN_TOKEN"
        )
    })
}

/// Runs the router until Ctrl-C / SIGTERM, then drains.
pub async fn run(cfg: ServeConfig) -> Result<(), String> {
    // A signal during start-up (the first discovery waits up to 3 s for engines) stops it
    // too, said (QA33: it ended the process with 143 and no word).
    let stop = crate::wait_for_signal();
    tokio::pin!(stop);
    let server = tokio::select! {
        s = kvmesh_gateway::start(cfg.clone()) => s.map_err(|e| e.to_string())?,
        () = &mut stop => {
            eprintln!("kvmesh serve: stopped during start-up");
            return Ok(());
        }
    };
    // Models with a policy of their own say so (QA33: `--policy` sets the default, and the
    // banner named it alone while a model's own policy from the file routed).
    let own: Vec<String> = cfg
        .models
        .iter()
        .filter_map(|(m, c)| Some(format!("{m}: {}", c.policy.as_ref()?.policy.as_str())))
        .collect();
    let own = if own.is_empty() {
        String::new()
    } else {
        format!(" ({})", own.join(", "))
    };
    eprintln!(
        "kvmesh serve: {} with {} engine(s), policy {}{own}, models {:?}",
        server.base_url(),
        server.gateway.registry.members().len(),
        cfg.routing.policy.policy.as_str(),
        server.gateway.registry.models()
    );
    if let Some(note) = attempts_note(&cfg) {
        eprintln!("kvmesh serve: note: {note}");
    }
    stop.await;
    if cfg.shutdown_delay_ms > 0 {
        eprintln!(
            "kvmesh serve: stopping: /health answers 503, serving {} ms more (a second signal stops now), then draining",
            cfg.shutdown_delay_ms
        );
    } else {
        eprintln!("kvmesh serve: shutting down, draining in-flight requests");
    }
    server.stop(crate::wait_for_signal()).await;
    Ok(())
}

/// A meshed router's certificate pair and trusted CAs, loaded and checked as the router
/// checks them at start (the key is the certificate's, which the router's own CAs sign).
pub fn check_mesh_certificates(cfg: &ServeConfig) -> Result<(), String> {
    let m = &cfg.mesh;
    if !m.enabled {
        return Ok(());
    }
    let pair = if m.cert_name.is_empty() {
        &m.node_id
    } else {
        &m.cert_name
    };
    let dir = std::path::Path::new(&m.tls_dir);
    kvmesh_mesh::tls_watch::TlsWatch::new(dir, pair, &m.node_id)
        .1
        .map(|_| ())
        .map_err(|e| format!("serve.mesh.tls_dir {}: {e}", m.tls_dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    /// A config file `text` in this process's temporary folder, named after `name`.
    fn config_file(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kvmesh-serve-cmd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join(format!("{name}.toml"));
        std::fs::write(&file, text).expect("write");
        file
    }

    /// QA: `KVMESH_ADMIN_TOKEN=` (empty) replaced the file's token with "" and disabled
    /// `/admin/engines`; a bad value was blamed on `serve.admin_token`.
    #[test]
    fn empty_env_vars_keep_the_files_tokens_and_bad_ones_are_named() {
        let file = config_file(
            "env",
            "[serve]\nengines = [\"http://127.0.0.1:9\"]\nadmin_token = \"from-file\"\nengine_api_key = \"key\"\n",
        );
        let args = Cli::parse_from(["t", "--config", file.to_str().expect("utf-8")]).serve;
        let c = args
            .resolve_with(|_| Ok(String::new()))
            .expect("empty = unset");
        assert_eq!(
            (c.admin_token.as_str(), c.engine_api_key.as_str()),
            ("from-file", "key")
        );
        let c = args
            .resolve_with(|n| {
                Ok(if n == "KVMESH_ADMIN_TOKEN" {
                    "env".into()
                } else {
                    String::new()
                })
            })
            .expect("set");
        assert_eq!(c.admin_token, "env");
        let e = args
            .resolve_with(|n| {
                Ok(if n == "KVMESH_ADMIN_TOKEN" {
                    "a b".into()
                } else {
                    String::new()
                })
            })
            .expect_err("a space");
        assert!(e.contains("environment variable KVMESH_ADMIN_TOKEN"), "{e}");
        // The flag is over the environment variable.
        let args = Cli::parse_from([
            "t",
            "--config",
            file.to_str().expect("utf-8"),
            "--admin-token",
            "flag",
        ])
        .serve;
        let c = args.resolve_with(|_| Ok("env".into())).expect("flag");
        assert_eq!(c.admin_token, "flag");
        let _ = std::fs::remove_file(&file);
    }

    /// QA: `--mesh-listen` said HOST:PORT and refused a name (`must be IP:PORT`).
    #[test]
    fn mesh_listen_says_ip_port() {
        use clap::CommandFactory;
        let cmd = Cli::command();
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == "mesh_listen")
            .expect("--mesh-listen");
        let names: Vec<_> = arg.get_value_names().expect("a value name").to_vec();
        assert_eq!(names, ["IP:PORT"]);
    }

    /// QA: `kvmesh config check` passed an empty file that `kvmesh serve --config FILE
    /// --check-config` refuses (no engines); the check says so now.
    #[test]
    fn config_check_notes_a_serve_without_engines() {
        let empty = ServeConfig::default();
        let note = no_engines_note(&empty).expect("a note");
        assert!(note.contains("no engines"), "{note}");
        let args = Cli::parse_from(["t"]).serve;
        let e = args
            .resolve_with(|_| Ok(String::new()))
            .expect_err("no engines");
        assert!(e.contains("no engines"), "{e}");
        let with = ServeConfig {
            admin_token: "t".into(),
            ..ServeConfig::default()
        };
        assert_eq!(no_engines_note(&with), None);
    }

    /// QA35: `--max-attempts` above the policy's `candidates` passed the checks silently.
    #[test]
    fn attempts_above_the_candidates_are_noted() {
        let mut c = ServeConfig::default();
        assert_eq!(attempts_note(&c), None, "3 and 3");
        c.retry.max_attempts = 5;
        let note = attempts_note(&c).expect("a note");
        assert!(
            note.contains("max_attempts = 5") && note.contains("policy.candidates = 3"),
            "{note}"
        );
        c.routing.policy.candidates = 5;
        assert_eq!(attempts_note(&c), None);
        let own = kvmesh_policy::PolicyConfig {
            candidates: 2,
            ..Default::default()
        };
        c.models.insert(
            "m".into(),
            kvmesh_config::ModelConfig {
                policy: Some(own),
                ..Default::default()
            },
        );
        let note = attempts_note(&c).expect("a note");
        assert!(
            note.contains("serve.models.\"m\".policy.candidates = 2"),
            "{note}"
        );
    }

    /// QA33: a file shared by `serve` and `sim` stopped the router over its `[sim]` section
    /// (and the simulator over its `[serve]`): each command checks its own section.
    #[test]
    fn a_shared_file_s_other_section_is_not_the_router_s() {
        let file = config_file(
            "shared",
            "[serve]\nengines = [\"http://127.0.0.1:9\"]\n[serve.mesh]\nenabled = true\ntls_dir = \"certs\"\n[sim]\ntime_scale = 0.0\n",
        );
        let path = file.to_str().expect("utf-8");
        // The router's own section is checked: node_id is missing without --node-id.
        let args = Cli::parse_from(["t", "--config", path]).serve;
        let e = args
            .resolve_with(|_| Ok(String::new()))
            .expect_err("node_id");
        assert!(e.contains("serve.mesh.node_id"), "{e}");
        let args = Cli::parse_from(["t", "--config", path, "--node-id", "a"]).serve;
        args.resolve_with(|_| Ok(String::new()))
            .expect("the [sim] section is the simulator's");
        #[derive(Parser)]
        struct SimCli {
            #[command(flatten)]
            sim: crate::sim_cmd::SimArgs,
        }
        let sim = SimCli::parse_from(["t", "--config", path]).sim;
        let e = sim.resolve().expect_err("its own time_scale");
        assert!(e.contains("sim.time_scale"), "{e}");
        let sim = SimCli::parse_from(["t", "--config", path, "--time-scale", "1"]).sim;
        sim.resolve().expect("the [serve] section is the router's");
        let _ = std::fs::remove_file(&file);
    }
}
