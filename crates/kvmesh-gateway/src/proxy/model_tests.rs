//! Requests whose model no engine is known to serve (yet).

use super::*;

/// Adds engine B without models: it has not told them yet.
fn add_silent(gw: &Gateway) {
    let silent = EngineEntry {
        url: format!("http://{B}"),
        ..EngineEntry::default()
    };
    gw.registry.add(&silent, Source::Admin, false).expect("add");
}

/// A model no engine is known to serve is a 404 only once every engine has told its models;
/// before (an engine unreachable since the start, found by QA as a 404), a 503.
#[tokio::test(start_paused = true)]
async fn an_unknown_model_is_a_503_while_an_engine_has_not_told_its_models() {
    let mock = MockUpstream::new();
    let gw = gateway(cfg(), &mock, &[A]);
    let other = r#"{"model":"other","messages":[{"role":"user","content":"hi"}]}"#;
    let (status, _, body) = call_with(&gw, other).await;
    assert_eq!(status, 404, "{body}");
    add_silent(&gw);
    let (status, _, body) = call_with(&gw, other).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("1 engine(s) have not told their models") && body.contains("1 not answered"),
        "{body}"
    );
    // An engine that refused the router's key is said to, not to be unreachable (QA35).
    assert!(engine(&gw, B).set_untold(crate::engine::Untold::Refused, 1));
    let (status, _, body) = call_with(&gw, other).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("1 refused the router (401/403: set serve.engine_api_key"),
        "{body}"
    );
    assert!(mock.calls().is_empty(), "nothing was sent");
}

/// A discovery problem is warned of when it starts or changes, then at most once a minute
/// (QA35: an engine refusing the router's key was warned of every second).
#[tokio::test(start_paused = true)]
async fn a_discovery_problem_is_warned_of_once_a_minute() {
    let mock = MockUpstream::new();
    let gw = gateway(cfg(), &mock, &[A]);
    let e = engine(&gw, A);
    use crate::engine::Untold::*;
    let s = 1_000_000;
    assert!(e.set_untold(Refused, s), "the first time");
    assert!(!e.set_untold(Refused, s + 1_000_000), "a second later");
    assert!(!e.set_untold(Refused, s + 59_000_000));
    assert!(e.set_untold(Refused, s + 60_000_000), "a minute later");
    assert!(e.set_untold(NotAList, s + 61_000_000), "another problem");
    assert!(
        !e.set_untold(NoAnswer, s + 62_000_000),
        "no answer is not warned of here"
    );
    assert!(e.set_untold(Refused, s + 63_000_000), "back again");
    assert_eq!(e.untold(), Refused);
}

/// A request without `model` while no engine has told its models: the same 503, not "several
/// models" (QA27: said while /v1/models listed none).
#[tokio::test(start_paused = true)]
async fn a_request_without_a_model_is_a_503_while_no_engine_has_told_its_models() {
    let mock = MockUpstream::new();
    let gw = gateway(cfg(), &mock, &[]);
    add_silent(&gw);
    let no_model = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    let (status, _, body) = call_with(&gw, no_model).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("no engine is known to serve any model yet: 1 engine(s)"),
        "{body}"
    );
    assert!(mock.calls().is_empty(), "nothing was sent");
}
