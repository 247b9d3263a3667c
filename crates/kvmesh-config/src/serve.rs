//! `[serve]`: the router (`kvmesh serve`).

use crate::mesh::MeshConfig;
use crate::prefix::{ModelConfig, PrefixConfig};
use crate::{ConfigError, check};
use kvmesh_policy::{PolicyConfig, RoutingConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Configuration of one router node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// HTTP address of the OpenAI-compatible API and of `/metrics` and `/admin/*`.
    pub listen: String,
    /// Engines known at start-up: tables, or plain base URLs (`engines = ["http://10.0.0.5:8000"]`).
    /// May be empty (with no `dns` either) only when something can add engines later: the
    /// mesh (the cluster's registry) or the admin API (`admin_token`); until then requests get
    /// a 503.
    #[serde(deserialize_with = "urls_or_entries")]
    pub engines: Vec<EngineEntry>,
    /// DNS names that resolve to many engines, re-resolved periodically.
    pub dns: Vec<DnsEntry>,
    /// Default routing: the policy (for models without their own), health, retry budget.
    pub routing: RoutingConfig,
    /// Cache-aware routing: tokenizer, block size, index bounds, KV-event ingestion.
    pub prefix: PrefixConfig,
    /// Per-model overrides (policy, tokenizer, block size), keyed by model name.
    pub models: BTreeMap<String, ModelConfig>,
    /// The mesh of routers (off: this router runs alone).
    pub mesh: MeshConfig,
    /// The connections to the engines (HTTP/1.1 or HTTP/2).
    pub upstream: UpstreamConfig,
    /// Timeouts towards the engines.
    pub timeouts: TimeoutConfig,
    /// Retries on another engine.
    pub retry: RetryConfig,
    /// Largest request body accepted, in bytes (at least 1024); a larger one is refused
    /// with a 413.
    pub max_body_bytes: usize,
    /// Bearer token protecting `/admin/engines` (the engines' list and changes to it;
    /// `/admin/cluster` and the other read-only pages need none); empty = `/admin/engines`
    /// is disabled. The
    /// `KVMESH_ADMIN_TOKEN` environment variable sets it too (over the file; empty = unset).
    pub admin_token: String,
    /// Sent as `Authorization: Bearer KEY` with the router's own requests to the engines
    /// (model discovery, health checks, metrics): for engines started with `--api-key` (vLLM,
    /// SGLang), whose `/v1/models` refuses a request without it (so they serve no model).
    /// Clients' requests are passed on with their own `Authorization`, as they came. Empty =
    /// none. The `KVMESH_ENGINE_API_KEY` environment variable sets it too (over the file;
    /// empty = unset).
    pub engine_api_key: String,
    /// How long a shutdown waits for in-flight requests to finish, ms. A meshed router leaves
    /// the mesh after, so its peers count its requests until they end. An answer still
    /// streaming at the end (a little before: a tenth of it, at most 250 ms) is ended with an
    /// OpenAI error event (503) before its connection closes.
    pub drain_timeout_ms: u64,
    /// On SIGTERM (SIGHUP, Ctrl-C), how long the router keeps accepting and serving while
    /// `/health` answers 503, before it stops accepting and drains, ms: the time load
    /// balancers and Kubernetes need to take it out of rotation, so that no client meets a
    /// refused connection. A second signal cuts it short. 0 = stop accepting at once.
    pub shutdown_delay_ms: u64,
    /// How often each engine's `/v1/models` and `/metrics` are read, ms. This bounds how
    /// stale engine-reported load is and how long a restarted engine that receives no traffic
    /// (so publishes no KV event with a reset seq) keeps its old blocks in the index: its new
    /// `process_start_time_seconds` is seen at the next read.
    pub discovery_interval_ms: u64,
    /// Header carrying the request id (taken from the client or generated).
    pub request_id_header: String,
    /// Web pages of these origins (`https://app.example.com`, as a browser sends `Origin`;
    /// `*` = any) may call the router from a browser (CORS): a preflight (`OPTIONS`) is
    /// answered with what they ask for, and their answers name them in
    /// `Access-Control-Allow-Origin` (and expose the request id and `x-kvmesh-engine`
    /// headers). vLLM allows every origin by default (`--allowed-origins`); this router
    /// allows none unless told: empty = no CORS headers, and `OPTIONS` is answered with
    /// `Allow` only.
    pub cors_allowed_origins: Vec<String>,
    /// Client connections served at once; one more is answered with a 503 JSON error and
    /// closed. Each takes a file descriptor, and its request in flight one more to the engine:
    /// keep the process's `ulimit -n` above twice this (beyond it, accepts fail and new
    /// connections wait in the listen backlog). At most 1000000.
    pub max_connections: usize,
    /// Time a client has to send a request's headers (slowloris guard); also closes
    /// keep-alive client connections idle that long (hyper's default, 30 s).
    pub header_read_timeout_ms: u64,
    /// Time a client has to send a request's whole body, else 408 (a 32 MiB body at 1 MB/s
    /// fits in the default, 60 s).
    pub body_read_timeout_ms: u64,
    /// A client connection whose answer the router could not write any of for this long is
    /// closed (nginx's `send_timeout`, 60 s: between two successive writes, so a client that
    /// stopped reading, or reads so slowly that the socket's buffer does not drain in that
    /// time, is cut): its request ends as the client's doing, not the engine's, and stops
    /// counting as load (counted in `kvmesh_connections_closed_total{reason="send_timeout"}`).
    /// Without it a client that stops reading would hold its request for as long as it kept
    /// the connection open.
    pub send_timeout_ms: u64,
    /// The `x-kvmesh-engine` response header and the router's error answers name the engine
    /// by its cluster-stable id (16 hex digits) instead of its URL, so clients do not learn
    /// the engines' addresses. The operator's pages on the same port (`/`, `/status.json`,
    /// `/metrics`) still list engines by URL: keep them from clients at the ingress.
    pub hide_engine_urls: bool,
    /// Seed of the routing randomness (0 = from the clock).
    pub seed: u64,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: "127.0.0.1:8080".to_string(),
            engines: Vec::new(),
            dns: Vec::new(),
            routing: RoutingConfig::default(),
            prefix: PrefixConfig::default(),
            models: BTreeMap::new(),
            mesh: MeshConfig::default(),
            upstream: UpstreamConfig::default(),
            timeouts: TimeoutConfig::default(),
            retry: RetryConfig::default(),
            max_body_bytes: 32 * 1024 * 1024,
            admin_token: String::new(),
            engine_api_key: String::new(),
            cors_allowed_origins: Vec::new(),
            drain_timeout_ms: 30_000,
            shutdown_delay_ms: 0,
            discovery_interval_ms: 1_000,
            request_id_header: "x-request-id".to_string(),
            max_connections: 10_000,
            header_read_timeout_ms: 30_000,
            body_read_timeout_ms: 60_000,
            send_timeout_ms: 60_000,
            hide_engine_urls: false,
            seed: 0,
        }
    }
}

/// One engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineEntry {
    /// Base URL, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// The engine's KV-event ZMQ endpoint (for precise routing), or empty.
    pub kv_events: String,
    /// The engine's KV-event replay endpoint (vLLM's `replay_endpoint`, a ZMQ ROUTER), or
    /// empty: lost batches are then not recovered and the engine is routed approximately
    /// until its next resynchronisation point.
    pub kv_replay: String,
    /// Relative capacity (e.g. 2 for a GPU twice as fast).
    pub weight: f64,
    /// Models it serves; empty = discovered from its `/v1/models`.
    pub models: Vec<String>,
}

/// What an engine's base URL must be, said of one that is not ([`valid_base_url`]).
pub const BASE_URL_RULE: &str = "is not an http:// base URL such as http://127.0.0.1:8000 (a host, a port 1-65535 (80 when omitted), no path; an IPv4 address written as a.b.c.d, not 127.1, 127.0.0.01, 0x7f.0.0.1, [::ffff:127.0.0.1] or [::127.0.0.1])";

/// What an engine's weight must be.
pub const WEIGHT_RULE: &str = "must be a number from 0.001 to 1000000 (weights are kept to thousandths, as the mesh carries them)";

/// Whether `w` is a weight an engine may have ([`WEIGHT_RULE`]).
pub fn valid_weight(w: f64) -> bool {
    w.is_finite() && (0.001..=1e6).contains(&w)
}

/// A weight in thousandths, as the mesh's registry carries it (every router then holds the
/// same): at least 1.
pub fn weight_milli(w: f64) -> u32 {
    (w * 1000.0).round().clamp(1.0, f64::from(u32::MAX)) as u32
}

/// `engines`: each a table, or a string (its base URL, as `--engine URL` takes it).
fn urls_or_entries<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<EngineEntry>, D::Error> {
    struct UrlOrEntry(EngineEntry);
    impl<'de> Deserialize<'de> for UrlOrEntry {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Form;
            impl<'de> serde::de::Visitor<'de> for Form {
                type Value = EngineEntry;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("an engine: its base URL, or a table with `url`")
                }
                fn visit_str<E: serde::de::Error>(self, url: &str) -> Result<EngineEntry, E> {
                    Ok(EngineEntry {
                        url: url.to_string(),
                        ..EngineEntry::default()
                    })
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    m: A,
                ) -> Result<EngineEntry, A::Error> {
                    EngineEntry::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                }
            }
            d.deserialize_any(Form).map(UrlOrEntry)
        }
    }
    let v: Vec<UrlOrEntry> = Vec::deserialize(d)?;
    Ok(v.into_iter().map(|e| e.0).collect())
}

impl Default for EngineEntry {
    fn default() -> Self {
        EngineEntry {
            url: String::new(),
            kv_events: String::new(),
            kv_replay: String::new(),
            weight: 1.0,
            models: Vec::new(),
        }
    }
}

impl EngineEntry {
    /// Parses the CLI form: a bare URL, or
    /// `url=URL,kv_events=ENDPOINT,kv_replay=ENDPOINT,weight=N,models=a;b`.
    pub fn parse(s: &str) -> Result<EngineEntry, String> {
        let mut e = EngineEntry::default();
        if !s.contains('=') {
            e.url = s.to_string();
        } else {
            for part in s.split(',') {
                let (k, v) = part
                    .split_once('=')
                    .ok_or_else(|| format!("`{part}` in `{s}` is not key=value"))?;
                match k.trim() {
                    "url" => e.url = v.trim().to_string(),
                    "kv_events" => e.kv_events = v.trim().to_string(),
                    "kv_replay" => e.kv_replay = v.trim().to_string(),
                    "weight" => {
                        e.weight = v
                            .trim()
                            .parse()
                            .map_err(|_| format!("weight `{v}` is not a number"))?
                    }
                    "models" => {
                        e.models = v
                            .split(';')
                            .map(str::trim)
                            .filter(|m| !m.is_empty())
                            .map(str::to_string)
                            .collect()
                    }
                    other => {
                        return Err(format!(
                            "unknown engine key `{other}` (url, kv_events, kv_replay, weight, models)"
                        ));
                    }
                }
            }
        }
        e.validate("engine").map_err(|e| e.to_string())?;
        Ok(e)
    }

    /// Checks the entry; `at` is the key prefix.
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        if !valid_base_url(&canonical_base_url(&self.url)) {
            return Err(ConfigError::invalid(
                &format!("{at}.url"),
                format!("{:?} {BASE_URL_RULE}", self.url),
            ));
        }
        check(
            valid_weight(self.weight),
            &format!("{at}.weight"),
            WEIGHT_RULE,
        )?;
        let tcp = |s: &str| s.strip_prefix("tcp://").is_some_and(crate::mesh::host_port);
        check(
            self.kv_events.is_empty() || tcp(&self.kv_events),
            &format!("{at}.kv_events"),
            "must be empty or a tcp://HOST:PORT endpoint (port 1-65535)",
        )?;
        check(
            self.kv_replay.is_empty() || (tcp(&self.kv_replay) && !self.kv_events.is_empty()),
            &format!("{at}.kv_replay"),
            "must be empty or a tcp://HOST:PORT endpoint (port 1-65535), and needs kv_events",
        )?;
        let mut seen = std::collections::BTreeSet::new();
        for m in &self.models {
            check(
                !m.trim().is_empty() && !m.chars().any(char::is_control) && seen.insert(m.as_str()),
                &format!("{at}.models"),
                "lists each model once, none empty or with control characters",
            )?;
        }
        Ok(())
    }
}

/// The one spelling of an engine's base URL: trimmed, no trailing `/`, scheme and host in
/// lower case, the port as a plain number (`HTTP://LOCALHOST:09101/` →
/// `http://localhost:9101`). Every URL that names an engine goes through it before its id is
/// made from it, so that two spellings of one engine are one engine. Names are not resolved:
/// `localhost` and `127.0.0.1` are two engines to the registry (an engine's name may resolve
/// elsewhere on another router), so name each engine one way.
pub fn canonical_base_url(u: &str) -> String {
    let u = u.trim().trim_end_matches('/');
    let Some((scheme, rest)) = u.split_once("://") else {
        return u.to_string();
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (host, port) = match authority.rfind(':') {
        // `[v6]` alone has its colons inside the brackets.
        Some(i) if !authority[i..].contains(']') => (&authority[..i], Some(&authority[i + 1..])),
        _ => (authority, None),
    };
    let port = match port {
        Some(p) => match p.parse::<u16>() {
            Ok(n) if p.bytes().all(|b| b.is_ascii_digit()) => format!(":{n}"),
            _ => format!(":{p}"),
        },
        None => String::new(),
    };
    // An IPv6 address written as std writes it (RFC 5952: `[0:0::1]` is `[::1]`).
    let host = match host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .and_then(|h| h.parse::<std::net::Ipv6Addr>().ok())
    {
        Some(v6) => format!("[{v6}]"),
        None => host.to_ascii_lowercase(),
    };
    format!("{}://{host}{port}{path}", scheme.to_ascii_lowercase())
}

/// Whether a URL parser takes `host` for an IPv4 address (WHATWG URL's "ends in a number":
/// its last label, a final dot aside, is decimal digits or `0x` and hex digits), as resolvers
/// do (`0x7f.0.0.1`, `127.1` and `127.0.0.1.` all reach 127.0.0.1).
fn ends_in_number(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    let last = host.rsplit('.').next().unwrap_or("");
    let hex = last
        .strip_prefix("0x")
        .or_else(|| last.strip_prefix("0X"))
        .is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit()));
    !last.is_empty() && (hex || last.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether `u` is an `http://host[:port]` base URL (no path beyond `/`).
pub fn valid_base_url(u: &str) -> bool {
    let Some(rest) = u.strip_prefix("http://") else {
        return false;
    };
    let authority = rest.trim_end_matches('/');
    let port_ok =
        |p: &str| p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u16>().is_ok_and(|n| n > 0);
    if let Some(v6) = authority.strip_prefix('[') {
        // [IPv6] or [IPv6]:port
        let Some((host, after)) = v6.split_once(']') else {
            return false;
        };
        // An IPv4 address mapped into IPv6 is written as IPv4 (`[::ffff:127.0.0.1]` would be
        // another engine's id beside `127.0.0.1`); the deprecated IPv4-compatible form
        // (`[::127.0.0.1]`) reaches nothing.
        let v4_in_v6 = |a: std::net::Ipv6Addr| {
            a.to_ipv4_mapped().is_some()
                || (a.segments()[..6] == [0; 6]
                    && a != std::net::Ipv6Addr::LOCALHOST
                    && a != std::net::Ipv6Addr::UNSPECIFIED)
        };
        return host
            .parse::<std::net::Ipv6Addr>()
            .is_ok_and(|a| !v4_in_v6(a))
            && (after.is_empty() || after.strip_prefix(':').is_some_and(port_ok));
    }
    let (host, port) = match authority.split_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (authority, None),
    };
    // A host a resolver takes for a number is an IPv4 address, written the one way
    // (`127.0.0.01`, `127.1`, `0x7f.0.0.1` reach 127.0.0.1 but would be other engines' ids).
    let numeric = ends_in_number(host);
    !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        && (!numeric || host.parse::<std::net::Ipv4Addr>().is_ok())
        && port.is_none_or(port_ok)
}

/// A DNS name resolving to many engines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DnsEntry {
    /// `host:port` to resolve.
    pub name: String,
    /// How often to re-resolve, ms.
    pub refresh_ms: u64,
    /// Weight of every engine found.
    pub weight: f64,
    /// Port of every engine's vLLM KV-event publisher (`tcp://ADDRESS:PORT`, its
    /// `--kv-events-config` endpoint); 0 = the engines publish none.
    pub kv_events_port: u16,
    /// Port of every engine's KV-event replay socket; 0 = none.
    pub kv_replay_port: u16,
}

impl Default for DnsEntry {
    fn default() -> Self {
        DnsEntry {
            name: String::new(),
            refresh_ms: 10_000,
            weight: 1.0,
            kv_events_port: 0,
            kv_replay_port: 0,
        }
    }
}

/// The connections to the engines.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamConfig {
    /// `"http1"`: pooled keep-alive HTTP/1.1 connections, one per request in flight (vLLM's
    /// and SGLang's servers speak HTTP/1.1 only). `"http2"`: HTTP/2 cleartext with prior
    /// knowledge (h2c, no upgrade), one multiplexed connection per engine shared by all its
    /// requests; only for engines or sidecars that serve h2c (vLLM's uvicorn does not).
    pub protocol: UpstreamProtocol,
}

/// The protocol spoken to the engines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamProtocol {
    /// HTTP/1.1 with keep-alive.
    #[default]
    Http1,
    /// HTTP/2 cleartext with prior knowledge (h2c).
    Http2,
}

/// Timeouts towards the engines, ms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutConfig {
    /// TCP connect.
    pub connect_ms: u64,
    /// From sending a streamed request (`"stream": true`) to the first byte of its answer:
    /// the response head, and for a success its body's first data (an engine queues and
    /// prefills before answering). Until then nothing has reached the client: a failure is
    /// retried on another engine. A request without `stream` is answered only once its whole
    /// generation is done, so `total_ms` bounds its wait instead, and it is not tried again
    /// once that has passed; but an engine silent this long meanwhile (and for at least 3
    /// `discovery_interval_ms`: nothing answered at this router, its work counters —
    /// `vllm:generation_tokens_total`, `prompt_tokens_total`, `prefix_cache_queries_total`,
    /// `iteration_tokens_total` — unchanged) is given up as hung and the request is retried
    /// on another engine (engines without such counters are waited for).
    pub first_byte_ms: u64,
    /// An answer that stops midway for this long (nothing more from the engine after its
    /// first data) is ended as a stall: an error event for a stream, a failure of the
    /// engine's. As long as `first_byte_ms` by default: an engine that preempts a sequence
    /// under memory pressure holds its stream while the sequence waits in its queue again.
    pub stream_idle_ms: u64,
    /// Whole request, including the streamed body (SGLang's gateway default: 1800 s). A
    /// stream it cuts counts as the engine's failure only when the engine had sent nothing
    /// for `stream_idle_ms` (a stall); a whole answer (no `stream`) it cuts, only when the
    /// engine's work counters (tokens, prompt tokens, prefix lookups, engine steps) did not
    /// change meanwhile (as its scrapes saw). Cut while the engine was working, the router's
    /// budget ran out, not the engine.
    pub total_ms: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig {
            connect_ms: 2_000,
            first_byte_ms: 120_000,
            stream_idle_ms: 120_000,
            total_ms: 1_800_000,
        }
    }
}

/// Retries on another engine (only before any byte reached the client).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// Attempts per request including the first, 1 to 8. Each goes to another engine of the
    /// decision's list, so at most the policy's `candidates` (default 3) are made: raise both.
    pub max_attempts: u32,
    /// First backoff, ms (doubles each retry); at most 60000 (a minute).
    pub backoff_base_ms: u64,
    /// Backoff cap, ms; at most 60000 (a minute).
    pub backoff_max_ms: u64,
    /// Random ± fraction applied to each backoff.
    pub jitter: f64,
    /// Retry 429 answers (the engine is overloaded, another may not be).
    pub on_429: bool,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 3,
            backoff_base_ms: 10,
            backoff_max_ms: 500,
            jitter: 0.2,
            on_429: true,
        }
    }
}

impl ServeConfig {
    /// The policy of `model`: its own, else `[serve.routing.policy]`.
    pub fn model_policy(&self, model: &str) -> &PolicyConfig {
        self.models
            .get(model)
            .and_then(|m| m.policy.as_ref())
            .unwrap_or(&self.routing.policy)
    }

    /// The tokenizer path of `model` (empty = bundled): its own, else `serve.prefix.tokenizer`.
    pub fn model_tokenizer(&self, model: &str) -> &str {
        self.models
            .get(model)
            .and_then(|m| m.tokenizer.as_deref())
            .unwrap_or(&self.prefix.tokenizer)
    }

    /// The block size of `model`: its own, else `serve.prefix.block_size`.
    pub fn model_block_size(&self, model: &str) -> u32 {
        self.models
            .get(model)
            .and_then(|m| m.block_size)
            .unwrap_or(self.prefix.block_size)
    }

    /// Whether `url` (a canonical base URL, `http://host:port`) is this router's own listen
    /// address: requests sent there would come back to it.
    pub fn is_own_address(&self, url: &str) -> bool {
        self.listen
            .parse()
            .is_ok_and(|listen| is_listen_address(listen, url))
    }

    /// Checks what the configuration names on disk: each tokenizer path given (the default,
    /// empty, is the bundled one) exists.
    pub fn check_files(&self) -> Result<(), ConfigError> {
        let mut paths = vec![("serve.prefix.tokenizer".to_string(), &self.prefix.tokenizer)];
        for (name, m) in &self.models {
            if let Some(t) = &m.tokenizer {
                paths.push((format!("serve.models.{name}.tokenizer"), t));
            }
        }
        for (key, path) in paths {
            check(
                path.is_empty() || std::path::Path::new(path).exists(),
                &key,
                &format!("names {path}, which does not exist"),
            )?;
        }
        Ok(())
    }
}

/// Whether `url` (a canonical base URL, `http://host:port`) names the address `listen`: the
/// same IP and port, or a loopback one (`localhost` too) when `listen` is unspecified, or an
/// unspecified one (`0.0.0.0`, `[::]`: this host) when `listen` is unspecified or loopback.
pub fn is_listen_address(listen: std::net::SocketAddr, url: &str) -> bool {
    let Some((host, port)) = url
        .strip_prefix("http://")
        .and_then(|hp| hp.rsplit_once(':'))
    else {
        return false;
    };
    if port.parse::<u16>() != Ok(listen.port()) {
        return false;
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<std::net::IpAddr>() {
        // 0.0.0.0 / [::] as a destination is this host (QA: accepted as an engine).
        Ok(ip) => {
            ip == listen.ip()
                || (listen.ip().is_unspecified() && ip.is_loopback())
                || (ip.is_unspecified()
                    && (listen.ip().is_unspecified() || listen.ip().is_loopback()))
        }
        Err(_) => {
            host == "localhost" && (listen.ip().is_unspecified() || listen.ip().is_loopback())
        }
    }
}

mod validate;
pub use validate::{MAX_CONNECTIONS, SERVE_ENV_VARS};

#[cfg(test)]
mod tests;
