//! The config structs: defaults valid, TOML round trip, unknown keys and bad values named.

use kvmesh_policy::{PolicyKind, RoutingConfig};

#[test]
fn defaults_validate_and_round_trip_through_toml() {
    let cfg = RoutingConfig::default();
    cfg.validate("routing").expect("defaults are valid");
    let text = toml::to_string_pretty(&cfg).expect("serialises");
    let back: RoutingConfig = toml::from_str(&text).expect("parses");
    assert_eq!(back, cfg);
}

#[test]
fn partial_config_keeps_other_defaults() {
    let cfg: RoutingConfig = toml::from_str(
        "[policy]\npolicy = \"consistent_hash\"\n[policy.consistent_hash]\nheader = \"x-user\"\n\
         [health.breaker]\nenabled = false\n",
    )
    .expect("parses");
    assert_eq!(cfg.policy.policy, PolicyKind::ConsistentHash);
    assert_eq!(cfg.policy.consistent_hash.header, "x-user");
    assert_eq!(cfg.policy.consistent_hash.virtual_nodes, 128);
    assert!(!cfg.health.breaker.enabled);
    assert_eq!(cfg.health.breaker.consecutive_failures, 5);
    assert_eq!(cfg.retry_budget.ratio, 0.2);
    cfg.validate("routing").expect("valid");
}

#[test]
fn prefix_and_scored_defaults_and_partial_tables() {
    let cfg = RoutingConfig::default();
    let px = cfg.policy.prefix;
    assert_eq!(px.balance_abs_threshold, 16);
    assert_eq!(px.balance_rel_threshold, 1.5);
    assert_eq!(px.min_match_ratio, 0.3);
    assert_eq!(px.min_match_blocks, 1);
    let sc = cfg.policy.scored;
    assert_eq!(
        (sc.prefix, sc.queue, sc.kv_usage, sc.in_flight, sc.latency),
        (3.0, 2.0, 2.0, 1.0, 1.0)
    );
    let cfg: RoutingConfig = toml::from_str(
        "[policy]\npolicy = \"scored\"\n[policy.prefix]\nbalance_abs_threshold = 32\n\
         [policy.scored]\nlatency = 0.0\n",
    )
    .expect("parses");
    assert_eq!(cfg.policy.policy, PolicyKind::Scored);
    assert!(cfg.policy.policy.uses_prefix());
    assert_eq!(cfg.policy.prefix.balance_abs_threshold, 32);
    assert_eq!(cfg.policy.prefix.min_match_ratio, 0.3);
    assert_eq!(cfg.policy.scored.latency, 0.0);
    assert_eq!(cfg.policy.scored.prefix, 3.0);
    cfg.validate("routing").expect("valid");
    let err = toml::from_str::<RoutingConfig>("[policy.prefix]\nmin_match_ration = 0.5\n")
        .expect_err("typo must fail");
    assert!(err.to_string().contains("min_match_ration"), "{err}");
}

#[test]
fn every_policy_name_parses() {
    for kind in PolicyKind::ALL {
        let cfg: RoutingConfig =
            toml::from_str(&format!("[policy]\npolicy = \"{}\"\n", kind.as_str())).unwrap();
        assert_eq!(cfg.policy.policy, kind);
    }
}

#[test]
fn unknown_keys_and_bad_values_are_named() {
    let err = toml::from_str::<RoutingConfig>("[health.breaker]\nconsecutive_failure = 3\n")
        .expect_err("typo must fail");
    assert!(err.to_string().contains("consecutive_failure"), "{err}");
    let err = toml::from_str::<RoutingConfig>("[policy]\npolicy = \"least_loaded\"\n")
        .expect_err("unknown policy must fail");
    assert!(err.to_string().contains("least_loaded"), "{err}");

    let cases = [
        ("[policy]\ncandidates = 0\n", "routing.policy.candidates"),
        (
            "[policy.consistent_hash]\nbalance_factor = -1.0\n",
            "routing.policy.consistent_hash.balance_factor",
        ),
        (
            "[health.breaker]\nfailure_ratio = 1.5\n",
            "routing.health.breaker.failure_ratio",
        ),
        (
            "[health.breaker]\nopen_ms = 10000\nopen_max_ms = 5000\n",
            "routing.health.breaker.open_max_ms",
        ),
        (
            "[health.active]\ntimeout_ms = 9000\ninterval_ms = 5000\n",
            "routing.health.active.timeout_ms",
        ),
        (
            "[health.slow_start]\nmin_weight_percent = 0\n",
            "routing.health.slow_start.min_weight_percent",
        ),
        (
            "[health.auto_weight]\nerror_rate_zero = 0.0\n",
            "routing.health.auto_weight.error_rate_zero",
        ),
        (
            "[retry_budget]\nratio = -0.1\n",
            "routing.retry_budget.ratio",
        ),
        (
            "[policy.prefix]\nbalance_rel_threshold = 0.9\n",
            "routing.policy.prefix.balance_rel_threshold",
        ),
        (
            "[policy.prefix]\nmin_match_ratio = 1.5\n",
            "routing.policy.prefix.min_match_ratio",
        ),
        (
            "[policy.prefix]\nmin_match_blocks = 0\n",
            "routing.policy.prefix.min_match_blocks",
        ),
        (
            "[policy.scored]\nqueue = -1.0\n",
            "routing.policy.scored.queue",
        ),
        (
            "[policy.scored]\nlatency = nan\n",
            "routing.policy.scored.latency",
        ),
        (
            "[policy.scored]\nprefix = 0.0\nqueue = 0.0\nkv_usage = 0.0\nin_flight = 0.0\nlatency = 0.0\n",
            "routing.policy.scored",
        ),
    ];
    for (text, key) in cases {
        let cfg: RoutingConfig = toml::from_str(text).expect(text);
        let err = cfg.validate("routing").expect_err(text);
        assert_eq!(err.key, key, "{text}");
        assert!(err.to_string().contains(key));
    }
}
