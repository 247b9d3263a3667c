//! The one configuration struct of kvmesh.
//!
//! Every default of every subcommand lives here, in the `Default` impls below, and nowhere
//! else: the TOML file is deserialised into these structs (missing keys take these defaults),
//! the CLI overrides single fields on top, and `--help` prints the defaults read from here.
//!
//! Unknown keys are rejected (`deny_unknown_fields`) and values are checked by
//! [`KvmeshConfig::validate`], so a typo or a bad value stops start-up with an error that names
//! the key.

#![forbid(unsafe_code)]
mod mesh;
mod prefix;
mod reference;
mod serve;
mod sim;

pub use kvmesh_policy::{PolicyConfig, PolicyKind, RoutingConfig};
pub use mesh::MeshConfig;
pub use prefix::{ModelConfig, PrefixConfig};
pub use reference::reference_markdown;
pub use serve::{
    BASE_URL_RULE, DnsEntry, EngineEntry, MAX_CONNECTIONS, RetryConfig, SERVE_ENV_VARS,
    ServeConfig, TimeoutConfig, UpstreamConfig, UpstreamProtocol, WEIGHT_RULE, canonical_base_url,
    is_listen_address, valid_base_url, valid_weight, weight_milli,
};
pub use sim::{
    EngineModelConfig, FaultConfig, KvEventsConfig, KvEventsFormat, MAX_NUM_BLOCKS, MAX_TIME_SCALE,
    MIN_TIME_SCALE, SimConfig, TimingOverrides,
};

use serde::{Deserialize, Serialize};
use std::path::Path;

/// The whole configuration file: one section per subcommand.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvmeshConfig {
    /// `kvmesh sim`: the engine simulator.
    pub sim: SimConfig,
    /// `kvmesh serve`: the router.
    pub serve: ServeConfig,
}

/// A configuration error that names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The path that failed.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has an unknown key or a value of the wrong type.
    #[error("config file {path}: {message}")]
    Parse {
        /// The path of the file.
        path: String,
        /// The parser's message, which names the key and line.
        message: String,
    },
    /// An environment variable that sets a key has a bad value.
    #[error("invalid value in environment variable {var} (it sets `{key}`): {message}")]
    Env {
        /// The variable, e.g. `KVMESH_ADMIN_TOKEN`.
        var: String,
        /// Dotted path of the key it sets, e.g. `serve.admin_token`.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// A value is out of its allowed range.
    #[error("invalid value for `{key}`: {message}")]
    Invalid {
        /// Dotted path of the key, e.g. `sim.engine.block_size`.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(key: &str, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.to_string(),
            message: message.into(),
        }
    }
}

impl KvmeshConfig {
    /// Parses a TOML document (the contents of a config file) and validates it.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let cfg = Self::parse_toml_str(text, origin)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses a TOML document without validating its values: for a caller that lays
    /// command-line flags over the file and validates the result once (a file may leave a
    /// value to a flag, as a Kubernetes ConfigMap leaves `node_id` to each pod).
    pub fn parse_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })
    }

    /// Reads, parses and validates a TOML config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let cfg = Self::read(path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a TOML config file without validating its values (see
    /// [`KvmeshConfig::parse_toml_str`]).
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse_toml_str(&text, &path.display().to_string())
    }

    /// Checks every value; the error names the first bad key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_sim()?;
        self.validate_serve()
    }

    /// Checks the `[serve]` section alone: what `kvmesh serve` runs on (a shared file's
    /// `[sim]` is another process's, and may be completed by that process's flags).
    pub fn validate_serve(&self) -> Result<(), ConfigError> {
        self.serve.validate("serve")
    }

    /// Checks the `[sim]` section alone: what `kvmesh sim` runs on.
    pub fn validate_sim(&self) -> Result<(), ConfigError> {
        self.sim.validate("sim")
    }

    /// The defaults rendered as a TOML document (for `kvmesh config defaults`).
    pub fn defaults_toml() -> String {
        KvmeshConfig::default().to_toml()
    }

    /// This configuration as a TOML document.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// Its `[serve]` section alone, as TOML (what `kvmesh serve --check-config` prints: the
    /// router's configuration, without a `[sim]` it never reads).
    pub fn serve_toml(&self) -> String {
        let Ok(mut t) = toml::Table::try_from(self) else {
            return String::new();
        };
        t.retain(|k, _| k == "serve");
        toml::to_string_pretty(&t).unwrap_or_default()
    }
}

pub(crate) fn check(ok: bool, key: &str, message: &str) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError::invalid(key, message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_round_trip_through_toml() {
        let cfg = KvmeshConfig::default();
        cfg.validate().expect("defaults are valid");
        let text = KvmeshConfig::defaults_toml();
        let back = KvmeshConfig::from_toml_str(&text, "defaults").expect("defaults parse");
        assert_eq!(back, cfg);
        let serve = cfg.serve_toml();
        assert!(
            serve.contains("[serve]") && !serve.contains("[sim"),
            "{serve}"
        );
        let back = KvmeshConfig::from_toml_str(&serve, "serve").expect("serve parses");
        assert_eq!(back.serve, cfg.serve);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = KvmeshConfig::from_toml_str("[sim.engine]\nblok_size = 16\n", "t.toml")
            .expect_err("unknown key must fail");
        let msg = err.to_string();
        assert!(msg.contains("blok_size"), "{msg}");
    }

    #[test]
    fn bad_value_is_named() {
        let err = KvmeshConfig::from_toml_str("[sim.engine]\nblock_size = 0\n", "t.toml")
            .expect_err("zero block size must fail");
        assert!(err.to_string().contains("sim.engine.block_size"), "{err}");
        let err = KvmeshConfig::from_toml_str("[sim]\ntime_scale = -1.0\n", "t.toml")
            .expect_err("negative time scale must fail");
        assert!(err.to_string().contains("sim.time_scale"), "{err}");
        let err = KvmeshConfig::from_toml_str("[sim.engine]\nblock_size = \"x\"\n", "t.toml")
            .expect_err("wrong type must fail");
        assert!(err.to_string().contains("block_size"), "{err}");
        let err = KvmeshConfig::from_toml_str("[serve.mesh]\nload_burst = 0\n", "t.toml")
            .expect_err("a burst of no envelope must fail");
        assert!(err.to_string().contains("serve.mesh.load_burst"), "{err}");
        let err = KvmeshConfig::from_toml_str(
            "[serve.routing.policy.least_request]\nown_bias = -1.0\n",
            "t.toml",
        )
        .expect_err("a negative bias must fail");
        assert!(err.to_string().contains("least_request.own_bias"), "{err}");
        let err = KvmeshConfig::from_toml_str("[serve.mesh]\nrealtime_priority = 100\n", "t.toml")
            .expect_err("a priority above 99 must fail");
        assert!(
            err.to_string().contains("serve.mesh.realtime_priority"),
            "{err}"
        );
        for (text, key) in [
            (
                "[serve.mesh]\nwire_version = 3\n",
                "serve.mesh.wire_version",
            ),
            (
                "[serve.mesh]\nwire_version = 0\n",
                "serve.mesh.wire_version",
            ),
            (
                "[serve.mesh]\ntls_reload_ms = 50\n",
                "serve.mesh.tls_reload_ms",
            ),
            // Found by QA, each accepted before.
            (
                "[serve.routing.policy.consistent_hash]\nheader = \"bad header\"\n",
                "consistent_hash.header",
            ),
            ("[serve.models.\"\"]\n", "serve.models"),
            ("[serve]\nadmin_token = \" \"\n", "serve.admin_token"),
            // Found by QA: it overflowed, and the drain ended after a second.
            (
                "[serve]\ndrain_timeout_ms = 18446744073709551615\n",
                "serve.drain_timeout_ms",
            ),
        ] {
            let err = KvmeshConfig::from_toml_str(text, "t.toml").expect_err(text);
            assert!(err.to_string().contains(key), "{text}: {err}");
        }
        for ok in [
            "[serve.mesh]\nwire_version = 2\n",
            "[serve.mesh]\ntls_reload_ms = 0\n",
        ] {
            KvmeshConfig::from_toml_str(ok, "t.toml").expect(ok);
        }
    }

    const U64_MAX: &str = "18446744073709551615";

    /// Each file is refused with an error naming its key; each of `ok` is accepted.
    fn refused_and_accepted(bad: &[(String, &str)], ok: &[&str]) {
        for (text, key) in bad {
            let err = KvmeshConfig::from_toml_str(text, "t.toml").expect_err(text);
            assert!(err.to_string().contains(key), "{text}: {err}");
        }
        for ok in ok {
            KvmeshConfig::from_toml_str(ok, "t.toml").expect(ok);
        }
    }

    /// QA: `max_connections = u64::MAX` was accepted, then tokio's `Semaphore::new`
    /// panicked in the accept loop; the other durations fed to timers had no bound either.
    #[test]
    fn max_connections_and_serve_durations_are_bounded() {
        let max = U64_MAX;
        let mut bad = vec![
            (
                format!("[serve]\nmax_connections = {max}\n"),
                "serve.max_connections",
            ),
            (
                "[serve]\nmax_connections = 1000001\n".into(),
                "serve.max_connections",
            ),
            (
                format!("[[serve.dns]]\nname = \"e:80\"\nrefresh_ms = {max}\n"),
                "serve.dns[0].refresh_ms",
            ),
        ];
        for key in ["connect_ms", "first_byte_ms", "stream_idle_ms", "total_ms"] {
            let text = format!("[serve.timeouts]\n{key} = {max}\n");
            bad.push((text, key));
        }
        for key in [
            "header_read_timeout_ms",
            "body_read_timeout_ms",
            "discovery_interval_ms",
        ] {
            bad.push((format!("[serve]\n{key} = {max}\n"), key));
        }
        // The routing's durations (the policy crate bounds their floors).
        for (table, key) in [
            ("health.breaker", "open_max_ms"),
            ("health.active", "interval_ms"),
            ("health.latency", "decay_ms"),
        ] {
            let text = format!("[serve.routing.{table}]\n{key} = {max}\n");
            bad.push((text, key));
        }
        // QA34: the replay's bound had no cap.
        bad.push((
            format!("[serve.prefix]\nreplay_timeout_ms = {max}\n"),
            "replay_timeout_ms",
        ));
        refused_and_accepted(
            &bad,
            &[
                "[serve]\nmax_connections = 1000000\n",
                "[serve.timeouts]\nfirst_byte_ms = 86400000\ntotal_ms = 86400000\n",
            ],
        );
    }

    /// QA: `backoff_base_ms` / `backoff_max_ms` took u64::MAX (a retry then never came).
    #[test]
    fn retry_backoff_is_bounded() {
        let max = U64_MAX;
        refused_and_accepted(
            &[
                (
                    format!("[serve.retry]\nbackoff_base_ms = {max}\nbackoff_max_ms = {max}\n"),
                    "serve.retry.backoff_base_ms",
                ),
                (
                    format!("[serve.retry]\nbackoff_max_ms = {max}\n"),
                    "serve.retry.backoff_max_ms",
                ),
                (
                    "[serve.retry]\nbackoff_max_ms = 60001\n".into(),
                    "serve.retry.backoff_max_ms",
                ),
            ],
            &["[serve.retry]\nbackoff_base_ms = 60000\nbackoff_max_ms = 60000\n"],
        );
    }

    /// QA: `kvmesh sim --kv-blocks 4294967295` panicked in the block pool, `--time-scale
    /// 1e30` in the engine's clock, and `step_base_ms = 1e308` was accepted.
    #[test]
    fn sim_extremes_are_refused() {
        refused_and_accepted(
            &[
                (
                    "[sim.engine]\nnum_blocks = 4294967295\n".into(),
                    "sim.engine.num_blocks",
                ),
                (
                    "[sim.engine]\nnum_blocks = 16777217\n".into(),
                    "sim.engine.num_blocks",
                ),
                ("[sim]\ntime_scale = 1e30\n".into(), "sim.time_scale"),
                ("[sim]\ntime_scale = 1e-30\n".into(), "sim.time_scale"),
                ("[sim]\ntime_scale = nan\n".into(), "sim.time_scale"),
                (
                    "[sim.engine.timing]\nstep_base_ms = 1e308\n".into(),
                    "sim.engine.timing.step_base_ms",
                ),
                (
                    "[sim.engine.timing]\ndecode_context_ns = 1000001.0\n".into(),
                    "sim.engine.timing.decode_context_ns",
                ),
            ],
            &[
                "[sim.engine]\nnum_blocks = 16777216\n",
                "[sim]\ntime_scale = 0.001\n",
                "[sim]\ntime_scale = 1000.0\n",
                "[sim.engine.timing]\nstep_base_ms = 1000000.0\n",
            ],
        );
    }

    /// QA: `KVMESH_ADMIN_TOKEN=` replaced the file's token with "" (the admin API went off),
    /// and a bad value in it was blamed on the file's key.
    #[test]
    fn empty_env_vars_are_unset_and_bad_ones_are_named() {
        use std::env::VarError;
        let file = "[serve]\nadmin_token = \"file-token\"\nengine_api_key = \"file-key\"\n";
        let mut c = KvmeshConfig::from_toml_str(file, "t.toml")
            .expect("valid")
            .serve;
        c.apply_env(|_| Ok(String::new())).expect("empty = unset");
        assert_eq!(
            (c.admin_token.as_str(), c.engine_api_key.as_str()),
            ("file-token", "file-key")
        );
        c.apply_env(|_| Err(VarError::NotPresent)).expect("unset");
        assert_eq!(c.admin_token, "file-token");
        c.apply_env(|n| Ok(format!("{n}-v"))).expect("set");
        assert_eq!(c.admin_token, "KVMESH_ADMIN_TOKEN-v");
        assert_eq!(c.engine_api_key, "KVMESH_ENGINE_API_KEY-v");
        for var in ["KVMESH_ADMIN_TOKEN", "KVMESH_ENGINE_API_KEY"] {
            let mut c = ServeConfig::default();
            let e = c
                .apply_env(|n| {
                    Ok(if n == var {
                        "a b".into()
                    } else {
                        String::new()
                    })
                })
                .expect_err(var)
                .to_string();
            assert!(e.contains(&format!("environment variable {var}")), "{e}");
        }
    }

    /// `kvmesh serve` refuses a configuration that gives it no engines and no way to get
    /// some; `kvmesh config check` says so of a file.
    #[test]
    fn engine_sources() {
        assert!(!ServeConfig::default().has_engine_source());
        for text in [
            "[serve]\nengines = [\"http://10.0.0.5:8000\"]\n",
            "[[serve.dns]]\nname = \"vllm:8000\"\n",
            "[serve]\nadmin_token = \"t\"\n",
        ] {
            let c = KvmeshConfig::from_toml_str(text, "t.toml").expect(text);
            assert!(c.serve.has_engine_source(), "{text}");
        }
    }

    #[test]
    fn partial_file_keeps_other_defaults() {
        let cfg = KvmeshConfig::from_toml_str("[sim]\nmodel = \"m\"\n", "t.toml").expect("valid");
        assert_eq!(cfg.sim.model, "m");
        assert_eq!(cfg.sim.engine, EngineModelConfig::default());
    }
}

#[cfg(test)]
mod example_files {
    use super::*;

    #[test]
    fn shipped_example_configs_are_valid() {
        let text = include_str!("../../../configs/sim.toml");
        KvmeshConfig::from_toml_str(text, "configs/sim.toml").expect("configs/sim.toml is valid");
        let text = include_str!("../../../configs/single-node.toml");
        let c = KvmeshConfig::from_toml_str(text, "configs/single-node.toml")
            .expect("configs/single-node.toml is valid");
        assert_eq!(c.serve.engines.len(), 2);
        assert_eq!(
            c.serve.model_policy("Qwen/Qwen3-8B").policy,
            PolicyKind::Precise
        );
        assert_eq!(c.serve.model_policy("other").policy, PolicyKind::PowerOfTwo);
        assert_eq!(c.serve.engines[1].kv_replay, "tcp://127.0.0.1:5559");
    }

    #[test]
    fn per_model_prefix_settings_fall_back_to_serve_prefix() {
        let c = KvmeshConfig::from_toml_str(
            "[serve.prefix]\nblock_size = 32\ntokenizer = \"/t\"\n\
             [serve.models.a]\nblock_size = 64\n\
             [serve.models.b.policy]\npolicy = \"cache_aware\"\n",
            "t.toml",
        )
        .expect("valid");
        let s = &c.serve;
        assert_eq!(
            (s.model_block_size("a"), s.model_tokenizer("a")),
            (64, "/t")
        );
        assert_eq!(
            (s.model_block_size("b"), s.model_tokenizer("zz")),
            (32, "/t")
        );
        assert_eq!(s.model_policy("a").policy, PolicyKind::PowerOfTwo);
        assert_eq!(s.model_policy("b").policy, PolicyKind::CacheAware);
        let e = KvmeshConfig::from_toml_str("[serve.models.a]\nblock_size = 0\n", "t.toml")
            .expect_err("block size 0");
        assert!(e.to_string().contains("serve.models.a.block_size"), "{e}");
        let e = KvmeshConfig::from_toml_str("[serve.prefix]\nspeculative_ttl_ms = 1\n", "t.toml")
            .expect_err("ttl");
        assert!(
            e.to_string().contains("serve.prefix.speculative_ttl_ms"),
            "{e}"
        );
    }

    #[test]
    fn mesh_seeds_must_be_host_and_port() {
        for ok in [
            "seeds = [\"10.0.0.2:7946\", \"router-0.kvmesh:7946\", \"[::1]:7946\"]",
            "seed_dns = \"kvmesh-mesh.default.svc.cluster.local:7946\"",
        ] {
            let toml = format!("[serve.mesh]\n{ok}\n");
            KvmeshConfig::from_toml_str(&toml, "t.toml").expect(ok);
        }
        for (bad, key) in [
            ("seeds = [\"router-0\"]", "serve.mesh.seeds"),
            ("seeds = [\":7946\"]", "serve.mesh.seeds"),
            ("seeds = [\"h:0\"]", "serve.mesh.seeds"),
            ("seeds = [\"h:70000\"]", "serve.mesh.seeds"),
            ("seed_dns = \"kvmesh-mesh\"", "serve.mesh.seed_dns"),
            // URLs (QA: accepted, never resolved, the router ran alone).
            ("seeds = [\"http://127.0.0.1:9600\"]", "serve.mesh.seeds"),
            ("seeds = [\"127.0.0.1:9600/\"]", "serve.mesh.seeds"),
            ("seeds = [\"[not-v6]:7946\"]", "serve.mesh.seeds"),
            (
                "seed_dns = \"http://kvmesh-mesh:7946\"",
                "serve.mesh.seed_dns",
            ),
        ] {
            let toml = format!("[serve.mesh]\n{bad}\n");
            let e = KvmeshConfig::from_toml_str(&toml, "t.toml").expect_err(bad);
            assert!(e.to_string().contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn preparation_bounds_have_defaults_and_limits() {
        let c = KvmeshConfig::from_toml_str(
            "[serve.prefix]
prompt_memo_bytes = 0
offload_prepare_bytes = 4096
",
            "t.toml",
        )
        .expect("valid");
        let p = &c.serve.prefix;
        assert_eq!((p.prompt_memo_bytes, p.offload_prepare_bytes), (0, 4096));
        assert_eq!(p.offload_prepare_threads, 2);
        assert_eq!(p.tokenizer_cache_tokens, 2_000_000);
        for bad in [
            "offload_prepare_threads = 0",
            "prompt_memo_bytes = 20000000000",
            "tokenizer_cache_tokens = 2000000000",
        ] {
            let e = KvmeshConfig::from_toml_str(&format!("[serve.prefix]\n{bad}\n"), "t.toml")
                .expect_err(bad);
            let key = bad.split(' ').next().expect("key");
            assert!(
                e.to_string().contains(&format!("serve.prefix.{key}")),
                "{e}"
            );
        }
    }
}
