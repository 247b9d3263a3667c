//! The checks of `[serve]`: every bad value stops start-up with an error naming its key.

use super::*;

/// The longest duration a `_ms` key of `[serve]` takes: a day.
const MAX_DURATION_MS: u64 = 86_400_000;
/// The longest retry backoff: a minute (a request waits that long before its retry).
const MAX_BACKOFF_MS: u64 = 60_000;
/// The most client connections served at once (each holds a file descriptor and a task).
pub const MAX_CONNECTIONS: usize = 1_000_000;

const ADMIN_TOKEN_RULE: &str = "must not contain spaces or control characters (clients send it as `Authorization: Bearer TOKEN`)";
const ENGINE_API_KEY_RULE: &str =
    "must not contain spaces or control characters (sent as `Authorization: Bearer KEY`)";

/// The environment variables that set a key of `[serve]`: each over the file's value and under
/// the command line's flag (`--admin-token`, `--engine-api-key`).
pub const SERVE_ENV_VARS: [(&str, &str); 2] = [
    ("KVMESH_ADMIN_TOKEN", "admin_token"),
    ("KVMESH_ENGINE_API_KEY", "engine_api_key"),
];

/// The routing's durations (the policy crate checks their floors), each at most a day: a
/// larger one is a typo, and fed to a timer or added to a clock it overflows or never ends.
fn routing_durations(r: &RoutingConfig, at: &str) -> Result<(), ConfigError> {
    let h = &r.health;
    for (key, ms) in [
        ("unanswered.after_ms", h.unanswered.after_ms),
        ("breaker.window_ms", h.breaker.window_ms),
        ("breaker.open_ms", h.breaker.open_ms),
        ("breaker.open_max_ms", h.breaker.open_max_ms),
        ("breaker.backoff_reset_ms", h.breaker.backoff_reset_ms),
        ("active.interval_ms", h.active.interval_ms),
        ("active.timeout_ms", h.active.timeout_ms),
        ("slow_start.window_ms", h.slow_start.window_ms),
        ("auto_weight.error_decay_ms", h.auto_weight.error_decay_ms),
        (
            "auto_weight.reference_refresh_ms",
            h.auto_weight.reference_refresh_ms,
        ),
        ("latency.decay_ms", h.latency.decay_ms),
        ("latency.initial_ttft_ms", h.latency.initial_ttft_ms),
        ("latency.initial_e2e_ms", h.latency.initial_e2e_ms),
        ("latency.failure_penalty_ms", h.latency.failure_penalty_ms),
    ] {
        check(
            ms <= MAX_DURATION_MS,
            &format!("{at}.health.{key}"),
            "must be at most 86400000 (a day)",
        )?;
    }
    Ok(())
}

/// A token sent as `Authorization: Bearer TOKEN`: no spaces, no control characters.
fn bearer_ok(s: &str) -> bool {
    !s.chars().any(|c| c.is_whitespace() || c.is_control())
}

impl ServeConfig {
    /// Lays [`SERVE_ENV_VARS`] over the keys they set; `var` reads one (`std::env::var`). An
    /// empty variable counts as unset (QA: `KVMESH_ADMIN_TOKEN=` replaced the file's token
    /// with "", which disabled `/admin/engines`); a bad value is named by its variable, not
    /// by the file's key.
    pub fn apply_env(
        &mut self,
        var: impl Fn(&str) -> Result<String, std::env::VarError>,
    ) -> Result<(), ConfigError> {
        for (name, key) in SERVE_ENV_VARS {
            let (slot, rule) = match key {
                "admin_token" => (&mut self.admin_token, ADMIN_TOKEN_RULE),
                _ => (&mut self.engine_api_key, ENGINE_API_KEY_RULE),
            };
            let env_err = |message: &str| ConfigError::Env {
                var: name.to_string(),
                key: format!("serve.{key}"),
                message: message.to_string(),
            };
            match var(name) {
                Ok(v) if v.is_empty() => {}
                Ok(v) if !bearer_ok(&v) => return Err(env_err(rule)),
                Ok(v) => *slot = v,
                Err(std::env::VarError::NotPresent) => {}
                Err(std::env::VarError::NotUnicode(_)) => return Err(env_err("is not UTF-8")),
            }
        }
        Ok(())
    }

    /// Whether anything in this configuration gives the router engines, at start or later:
    /// engines, DNS names, the mesh (the cluster's registry) or the admin API
    /// (`admin_token`). `kvmesh serve` refuses to start without (flags and environment
    /// variables may add them to a file that names none).
    pub fn has_engine_source(&self) -> bool {
        !self.engines.is_empty()
            || !self.dns.is_empty()
            || self.mesh.enabled
            || !self.admin_token.is_empty()
    }

    pub(crate) fn validate(&self, at: &str) -> Result<(), ConfigError> {
        check(
            self.listen.parse::<std::net::SocketAddr>().is_ok(),
            &format!("{at}.listen"),
            "must be an IP:port address such as 127.0.0.1:8080",
        )?;
        let mut seen = std::collections::BTreeSet::new();
        for (i, e) in self.engines.iter().enumerate() {
            let at = format!("{at}.engines[{i}]");
            e.validate(&at)?;
            let url = canonical_base_url(&e.url);
            check(
                seen.insert(url.clone()),
                &format!("{at}.url"),
                "names an engine listed before it",
            )?;
            check(
                !self.is_own_address(&url),
                &format!("{at}.url"),
                "is this router's own listen address (requests would loop)",
            )?;
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, d) in self.dns.iter().enumerate() {
            check(
                d.name
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()),
                &format!("{at}.dns[{i}].name"),
                "must be host:port",
            )?;
            // Two loops would own the same engines (QA33: accepted, and each warned of the
            // other's engines at every refresh).
            check(
                names.insert(d.name.to_ascii_lowercase()),
                &format!("{at}.dns[{i}].name"),
                "names a DNS name listed before it",
            )?;
            check(
                (100..=MAX_DURATION_MS).contains(&d.refresh_ms),
                &format!("{at}.dns[{i}].refresh_ms"),
                "must be from 100 to 86400000 (a day)",
            )?;
            check(
                valid_weight(d.weight),
                &format!("{at}.dns[{i}].weight"),
                WEIGHT_RULE,
            )?;
        }
        self.routing
            .validate(&format!("{at}.routing"))
            .map_err(|e| ConfigError::invalid(&e.key, e.message))?;
        routing_durations(&self.routing, &format!("{at}.routing"))?;
        self.prefix.validate(&format!("{at}.prefix"))?;
        self.mesh.validate(&format!("{at}.mesh"))?;
        for (m, c) in &self.models {
            check(
                !m.trim().is_empty(),
                &format!("{at}.models"),
                "a model's section needs its name ([serve.models.\"NAME\"])",
            )?;
            c.validate(&format!("{at}.models.{m}"))?;
        }
        for (key, value, rule) in [
            ("admin_token", &self.admin_token, ADMIN_TOKEN_RULE),
            ("engine_api_key", &self.engine_api_key, ENGINE_API_KEY_RULE),
        ] {
            check(bearer_ok(value), &format!("{at}.{key}"), rule)?;
        }
        for o in &self.cors_allowed_origins {
            check(
                is_origin(o),
                &format!("{at}.cors_allowed_origins"),
                &format!(
                    "{o:?} is not an origin: `*`, or `http://` or `https://` and a host with an optional port, nothing after (as a browser sends `Origin`)"
                ),
            )?;
        }
        // Durations: at least a floor, at most a day (a larger one is a typo, and fed to a
        // timer or added to an instant it overflows or never ends).
        let t = &self.timeouts;
        for (key, v, min) in [
            ("timeouts.connect_ms", t.connect_ms, 1),
            ("timeouts.first_byte_ms", t.first_byte_ms, 1),
            ("timeouts.stream_idle_ms", t.stream_idle_ms, 1),
            ("timeouts.total_ms", t.total_ms, 1),
            ("discovery_interval_ms", self.discovery_interval_ms, 100),
            ("header_read_timeout_ms", self.header_read_timeout_ms, 100),
            ("body_read_timeout_ms", self.body_read_timeout_ms, 100),
        ] {
            check(
                (min..=MAX_DURATION_MS).contains(&v),
                &format!("{at}.{key}"),
                &format!("must be from {min} to {MAX_DURATION_MS} (a day)"),
            )?;
        }
        check(
            t.total_ms >= t.first_byte_ms,
            &format!("{at}.timeouts.total_ms"),
            "must be at least first_byte_ms",
        )?;
        let r = &self.retry;
        check(
            (1..=8).contains(&r.max_attempts),
            &format!("{at}.retry.max_attempts"),
            "must be between 1 and 8",
        )?;
        for (key, v) in [
            ("backoff_base_ms", r.backoff_base_ms),
            ("backoff_max_ms", r.backoff_max_ms),
        ] {
            check(
                v <= MAX_BACKOFF_MS,
                &format!("{at}.retry.{key}"),
                &format!("must be at most {MAX_BACKOFF_MS} (a minute)"),
            )?;
        }
        check(
            r.backoff_max_ms >= r.backoff_base_ms,
            &format!("{at}.retry.backoff_max_ms"),
            "must be at least backoff_base_ms",
        )?;
        check(
            (0.0..=1.0).contains(&r.jitter),
            &format!("{at}.retry.jitter"),
            "must be between 0 and 1",
        )?;
        check(
            self.max_body_bytes >= 1024,
            &format!("{at}.max_body_bytes"),
            "must be at least 1024",
        )?;
        check(
            (1..=MAX_CONNECTIONS).contains(&self.max_connections),
            &format!("{at}.max_connections"),
            &format!("must be from 1 to {MAX_CONNECTIONS}"),
        )?;
        check(
            self.drain_timeout_ms <= MAX_DURATION_MS,
            &format!("{at}.drain_timeout_ms"),
            "must be at most 86400000 (a day)",
        )?;
        check(
            self.shutdown_delay_ms <= 600_000,
            &format!("{at}.shutdown_delay_ms"),
            "must be at most 600000 (10 minutes)",
        )?;
        check(
            (100..=MAX_DURATION_MS).contains(&self.send_timeout_ms),
            &format!("{at}.send_timeout_ms"),
            "must be from 100 to 86400000 (a day)",
        )?;
        check(
            !self.request_id_header.is_empty() && http_header_name_ok(&self.request_id_header),
            &format!("{at}.request_id_header"),
            "must be a valid header name",
        )
    }
}

/// `*`, or an origin as a browser sends it in `Origin`: `http://` or `https://`, a host
/// (letters, digits, `.`, `-`, or a bracketed IPv6 address) and an optional port, nothing
/// after.
pub(super) fn is_origin(o: &str) -> bool {
    if o == "*" {
        return true;
    }
    let Some(rest) = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"))
    else {
        return false;
    };
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) if !h.starts_with('[') || h.ends_with(']') => (h, Some(p)),
        _ => (rest, None),
    };
    let host_ok = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        v6.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
    };
    host_ok && port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0))
}

fn http_header_name_ok(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}
