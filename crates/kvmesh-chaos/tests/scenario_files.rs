//! Every scenario file in chaos/ parses and plans in both modes, and the suite holds every
//! scenario the chaos issue asks for.

use kvmesh_chaos::scenario::Scenario;
use std::path::PathBuf;

#[test]
fn every_scenario_file_plans_and_the_required_ones_exist() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../chaos");
    let mut names = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "toml") {
            let text = std::fs::read_to_string(&p).unwrap();
            let s = Scenario::parse(&text, &p.display().to_string()).unwrap();
            for quick in [false, true] {
                let plan = s.plan(quick).unwrap_or_else(|e| panic!("{e}"));
                assert!(!plan.steps.is_empty(), "{}: no step", s.name);
            }
            assert_eq!(
                p.file_stem().and_then(|x| x.to_str()),
                Some(s.name.as_str()),
                "file name = scenario name"
            );
            names.push(s.name);
        }
    }
    for want in [
        "partition-halves",
        "isolate-router",
        "flapping-link",
        "kill-router",
        "restart-router",
        "rolling-restart",
        "kill-engine",
        "gray-engine",
        "engine-cache-reset",
        "event-seq-gap",
        "engine-errors",
        "engine-hang",
        "router-join",
        "loss-20",
        "delay-50",
        "mesh-flood",
        "clock-skew",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from chaos/"
        );
    }
}
