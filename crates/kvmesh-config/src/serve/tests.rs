//! Engine URLs and entries, their spelling, and the serve section's checks.

use super::validate::is_origin;
use super::*;

#[test]
fn engine_urls_need_a_host_and_a_real_port() {
    for ok in [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "http://vllm-0.vllm.default.svc:8000",
        "http://engine",
        "http://[::1]:8000",
        "http://[fe80::1]",
        "http://engine-0x1:8000",
        "http://a1.b2:8000",
    ] {
        assert!(valid_base_url(ok), "{ok}");
    }
    for bad in [
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "http://127.0.0.1:abc",
        "http://127.0.0.1:",
        "http://:8000",
        "http://",
        "http://a b:1",
        "http://user@host:1",
        "http://host:1/v1",
        "http://host:1?x=1",
        "http://host:1#f",
        "http://[::1:8000",
        "http://[nope]:8000",
        "http://[::1]8000",
        "https://host:1",
        // One address, one spelling (QA: `127.0.0.01` was another engine beside 127.0.0.1).
        "http://127.0.0.01:8000",
        "http://127.1:8000",
        "http://256.0.0.1:8000",
        "http://1234:8000",
        // The same through a resolver (QA): hex, a final dot, IPv4 mapped into IPv6.
        "http://0x7f.0.0.1:8000",
        "http://0x7F000001:8000",
        "http://127.0.0.1.:8000",
        "http://engine.0x1:8000",
        "http://[::ffff:127.0.0.1]:8000",
        "http://[::ffff:7f00:1]:8000",
        "http://[::127.0.0.1]:8000",
    ] {
        assert!(!valid_base_url(bad), "{bad}");
    }
}

#[test]
fn one_engine_has_one_spelling() {
    for (given, want) in [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        (" HTTP://LOCALHOST:09101/ ", "http://localhost:9101"),
        ("http://Vllm-0.Svc:8000//", "http://vllm-0.svc:8000"),
        ("http://[FE80::1]:0080", "http://[fe80::1]:80"),
        ("http://[::1]", "http://[::1]"),
        ("http://[0:0:0:0:0:0:0:1]:8000", "http://[::1]:8000"),
        ("http://[FE80:0::0:1]", "http://[fe80::1]"),
        ("http://engine", "http://engine"),
        // Not a port: left for validation to refuse.
        ("http://h:99999", "http://h:99999"),
        ("http://h:+1", "http://h:+1"),
        ("engine-a", "engine-a"),
    ] {
        assert_eq!(canonical_base_url(given), want, "{given}");
        assert_eq!(canonical_base_url(want), want, "{want} stays");
    }
    // A file listing one engine under two spellings is refused.
    let c = crate::KvmeshConfig::from_toml_str(
        "[serve]\nengines = [\"http://localhost:9101\", \"http://LOCALHOST:09101\"]\n",
        "t",
    );
    let e = c.expect_err("one engine twice").to_string();
    assert!(e.contains("engines[1].url"), "{e}");
}

#[test]
fn an_engine_is_a_url_or_a_table_and_a_tables_typo_is_named() {
    let parse = |t: &str| crate::KvmeshConfig::from_toml_str(t, "test");
    let c = parse(
        "[serve]\nengines = [\"http://127.0.0.1:8001\", \
         { url = \"http://127.0.0.1:8002\", weight = 2 }]\n",
    )
    .expect("a URL and a table");
    let e = &c.serve.engines;
    assert_eq!(e.len(), 2);
    assert_eq!(
        e[0],
        EngineEntry {
            url: "http://127.0.0.1:8001".into(),
            ..EngineEntry::default()
        }
    );
    assert_eq!(
        (e[1].url.as_str(), e[1].weight),
        ("http://127.0.0.1:8002", 2.0)
    );
    let typo = parse("[[serve.engines]]\nurl = \"http://127.0.0.1:8001\"\nweigth = 2\n")
        .expect_err("a typo");
    assert!(typo.to_string().contains("weigth"), "{typo}");
    let bad = parse("[serve]\nengines = [3]\n").expect_err("a number");
    assert!(bad.to_string().contains("base URL"), "{bad}");
    let bad_url = parse("[serve]\nengines = [\"http://127.0.0.1:0\"]\n").expect_err("port 0");
    assert!(bad_url.to_string().contains("127.0.0.1:0"), "{bad_url}");
}

#[test]
fn engines_listed_twice_or_at_the_routers_own_address_are_refused() {
    let parse = |t: &str| crate::KvmeshConfig::from_toml_str(t, "test");
    let two = |a: &str, b: &str, listen: &str| {
        format!(
            "[serve]\nlisten = \"{listen}\"\n[[serve.engines]]\nurl = \"{a}\"\n\
             [[serve.engines]]\nurl = \"{b}\"\n"
        )
    };
    parse(&two(
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002",
        "127.0.0.1:8080",
    ))
    .expect("two engines");
    let e = parse(&two(
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8001/",
        "127.0.0.1:8080",
    ))
    .expect_err("twice");
    assert!(e.to_string().contains("serve.engines[1].url"), "{e}");
    for (engine, listen) in [
        ("http://127.0.0.1:8080", "127.0.0.1:8080"),
        ("http://localhost:8080", "0.0.0.0:8080"),
        ("http://127.0.0.2:8080", "0.0.0.0:8080"),
        ("http://[::1]:8080", "[::]:8080"),
    ] {
        let e = parse(&two("http://127.0.0.1:8001", engine, listen)).expect_err(engine);
        assert!(e.to_string().contains("own listen address"), "{e}");
    }
    // Another port, or another host of the same port: another server.
    parse(&two(
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8081",
        "127.0.0.1:8080",
    ))
    .expect("another port");
    parse(&two(
        "http://127.0.0.1:8001",
        "http://10.0.0.5:8080",
        "127.0.0.1:8080",
    ))
    .expect("another host");
}

/// QA33: two `[[serve.dns]]` entries of one name were accepted; their loops fought over its
/// engines, warning at every refresh.
#[test]
fn a_dns_name_listed_twice_is_refused() {
    let parse = |t: &str| crate::KvmeshConfig::from_toml_str(t, "test");
    let two = |a: &str, b: &str| {
        format!("[[serve.dns]]\nname = \"{a}\"\n[[serve.dns]]\nname = \"{b}\"\n")
    };
    parse(&two("vllm:8000", "vllm:8001")).expect("two names");
    let e = parse(&two("vllm:8000", "VLLM:8000")).expect_err("twice");
    assert!(e.to_string().contains("serve.dns[1].name"), "{e}");
}

#[test]
fn tokenizer_paths_must_exist() {
    let mut c = ServeConfig::default();
    c.check_files().expect("the bundled tokenizer");
    c.prefix.tokenizer = env!("CARGO_MANIFEST_DIR").into();
    c.check_files().expect("an existing path");
    c.prefix.tokenizer = "/no/such/tokenizer.json".into();
    let e = c.check_files().expect_err("missing");
    assert!(e.to_string().contains("serve.prefix.tokenizer"), "{e}");
    c.prefix.tokenizer = String::new();
    c.models.insert(
        "m".into(),
        crate::ModelConfig {
            tokenizer: Some("/no/such/dir".into()),
            ..Default::default()
        },
    );
    let e = c.check_files().expect_err("missing");
    assert!(e.to_string().contains("serve.models.m.tokenizer"), "{e}");
}

#[test]
fn engine_cli_forms() {
    let e = EngineEntry::parse("http://127.0.0.1:8000").expect("bare");
    assert_eq!((e.url.as_str(), e.weight), ("http://127.0.0.1:8000", 1.0));
    let e = EngineEntry::parse(
        "url=http://127.0.0.1:8001,kv_events=tcp://127.0.0.1:5557,weight=2,models=a;b",
    )
    .expect("long form");
    assert_eq!(e.weight, 2.0);
    assert_eq!(e.kv_events, "tcp://127.0.0.1:5557");
    assert_eq!(e.models, vec!["a".to_string(), "b".to_string()]);
    let e = EngineEntry::parse(
        "url=http://127.0.0.1:8001,kv_events=tcp://127.0.0.1:5557,kv_replay=tcp://127.0.0.1:5558",
    )
    .expect("with replay");
    assert_eq!(e.kv_replay, "tcp://127.0.0.1:5558");
    assert!(EngineEntry::parse("url=http://x:1,kv_replay=tcp://127.0.0.1:1").is_err());
    assert!(EngineEntry::parse("url=http://x:1,wieght=2").is_err());
    assert!(EngineEntry::parse("ftp://x").is_err());
    assert!(EngineEntry::parse("url=http://x:1,weight=-1").is_err());
    assert!(EngineEntry::parse("http://x:1/v1").is_err());
}

#[test]
fn upstream_protocol_from_toml() {
    let parse = |t: &str| crate::KvmeshConfig::from_toml_str(t, "test");
    let c = parse("").expect("defaults");
    assert_eq!(c.serve.upstream.protocol, UpstreamProtocol::Http1);
    let c = parse("[serve.upstream]\nprotocol = \"http2\"\n").expect("http2");
    assert_eq!(c.serve.upstream.protocol, UpstreamProtocol::Http2);
    let e = parse("[serve.upstream]\nprotocol = \"h2\"\n").expect_err("unknown protocol");
    assert!(e.to_string().contains("protocol"), "{e}");
}

#[test]
fn cors_origins_are_origins_as_browsers_send_them() {
    for ok in [
        "*",
        "https://app.example.com",
        "http://localhost:3000",
        "http://[::1]:5173",
        "https://[fe80::1]",
    ] {
        assert!(is_origin(ok), "{ok}");
    }
    for bad in [
        "",
        "app.example.com",
        "https://app.example.com/",
        "https://app.example.com/chat",
        "https://",
        "https://app.example.com:0",
        "https://app.example.com:99999",
        "ftp://app.example.com",
        "https://*.example.com",
        "http://[::1",
    ] {
        assert!(!is_origin(bad), "{bad}");
    }
    let e = crate::KvmeshConfig::from_toml_str(
        "[serve]\ncors_allowed_origins = [\"https://app.example.com/\"]\n",
        "test",
    )
    .expect_err("a path is refused");
    assert!(e.to_string().contains("cors_allowed_origins"), "{e}");
}
