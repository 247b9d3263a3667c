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
    BASE_URL_RULE, DnsEntry, EngineEntry, RetryConfig, ServeConfig, TimeoutConfig, UpstreamConfig,
    UpstreamProtocol, WEIGHT_RULE, canonical_base_url, is_listen_address, valid_base_url,
    valid_weight, weight_milli,
};
pub use sim::{
    EngineModelConfig, FaultConfig, KvEventsConfig, KvEventsFormat, SimConfig, TimingOverrides,
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
        self.sim.validate("sim")?;
        self.serve.validate("serve")
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
