//! Scenario files: parsing, validation, flap expansion, quick mode, and the packets each
//! network step drops or holds.

use super::*;

const BASE: &str = r#"
name = "t"
about = "a test"
[topology]
routers = 3
late_routers = 1
engines = 2
[workload]
duration_s = 20
concurrency = 2
max_requests = 100
groups = 4
max_tokens = 2
deadline_s = 10
attempt_timeout_s = 5
settle_s = 0
pause_ms = 10
[quick]
duration_s = 12
"#;

fn plan(steps: &str, quick: bool) -> Result<Plan, String> {
    Scenario::parse(&format!("{BASE}{steps}"), "t.toml")?.plan(quick)
}

#[test]
fn flap_expands_into_isolate_and_heal_in_time_order() {
    let p = plan(
        "[[step]]\nat_s = 9\ndo = \"kill_engine\"\nengine = 1\n\
         [[step]]\nat_s = 2\ndo = \"flap\"\nrouter = 0\ntimes = 3\ndown_s = 1\nup_s = 2\n",
        false,
    )
    .unwrap();
    let got: Vec<(f64, String)> = p.steps.iter().map(|s| (s.at_s, s.action.label())).collect();
    assert_eq!(
        got,
        vec![
            (2.0, "isolate r0".into()),
            (3.0, "heal".into()),
            (5.0, "isolate r0".into()),
            (6.0, "heal".into()),
            (8.0, "isolate r0".into()),
            // Equal times keep the file's order.
            (9.0, "kill -9 e1".into()),
            (9.0, "heal".into()),
        ]
    );
}

#[test]
fn quick_mode_overrides_the_workload_and_steps_must_fit_in_it() {
    let ok = plan("[[step]]\nat_s = 10\ndo = \"heal\"\n", true).unwrap();
    assert_eq!(ok.workload.duration_s, 12.0);
    assert_eq!(plan("", false).unwrap().workload.duration_s, 20.0);
    let late = plan("[[step]]\nat_s = 15\ndo = \"heal\"\n", true).unwrap_err();
    assert!(late.contains("outside the workload"), "{late}");
    let flap = plan(
        "[[step]]\nat_s = 8\ndo = \"flap\"\nrouter = 0\ntimes = 3\ndown_s = 1\nup_s = 1\n",
        true,
    )
    .unwrap_err();
    assert!(flap.contains("timeline ends"), "{flap}");
}

#[test]
fn bad_indices_and_shapes_are_refused_with_the_step_named() {
    for (steps, want) in [
        (
            "[[step]]\nat_s = 1\ndo = \"isolate\"\nrouter = 4\n",
            "no router r4",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"kill_engine\"\nengine = 2\n",
            "no engine e2",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"partition\"\ngroups = [[0, 1], [1, 2]]\n",
            "two groups",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"partition\"\ngroups = [[0, 1, 2]]\n",
            "at least two",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"loss\"\npercent = 0\n",
            "1..=100",
        ),
        ("[[step]]\nat_s = 1\ndo = \"delay\"\nms = 0\n", "1..=2000"),
        (
            "[[step]]\nat_s = 1\ndo = \"delay\"\nms = 2001\n",
            "1..=2000",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"delay\"\nms = 50\njitter_ms = 60\n",
            "jitter_ms ≤ ms",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"delay\"\nms = 50\nbetween = [[0, 4]]\n",
            "no router r4",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"delay\"\nms = 50\nbetween = [[1, 1]]\n",
            "pair of one router",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"delay\"\nms = 50\nbetween = []\n",
            "lists pairs",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"delay\"\nms = 50\nbetween = [[0, 1, 2]]\n",
            "invalid length",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"delay\"\nms = 50\npercent = 3\n",
            "unknown field",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"restart_router\"\nrouter = 0\nskew_ms = 90000\n",
            "±60 000",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"engine_faults\"\nengine = 0\n",
            "either",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"restart_router\"\nrouter = 3\n",
            "not running",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"kill_router\"\nrouter = 0\n\
             [[step]]\nat_s = 2\ndo = \"kill_router\"\nrouter = 1\n\
             [[step]]\nat_s = 3\ndo = \"kill_router\"\nrouter = 2\n",
            "no router is running",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"resume_router\"\nrouter = 0\n",
            "not paused",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"pause_router\"\nrouter = 0\n\
             [[step]]\nat_s = 2\ndo = \"pause_router\"\nrouter = 0\n",
            "pause r0 at 2 s: not running",
        ),
        (
            "[[step]]\nat_s = 1\ndo = \"pause_router\"\nrouter = 0\n\
             [[step]]\nat_s = 2\ndo = \"pause_router\"\nrouter = 1\n\
             [[step]]\nat_s = 3\ndo = \"kill_router\"\nrouter = 2\n",
            "no router is running",
        ),
        ("[[step]]\nat_s = 1\ndo = \"explode\"\n", "unknown variant"),
    ] {
        let e = plan(steps, false).unwrap_err();
        assert!(e.contains(want), "{steps}: {e}");
    }
    let e = Scenario::parse("name = 1", "x.toml").unwrap_err();
    assert!(e.starts_with("x.toml"), "{e}");
}

#[test]
fn engine_fault_patches_keep_their_table() {
    let p = plan(
        "[[step]]\nat_s = 1\ndo = \"engine_faults\"\nengine = 1\nset = { slowdown = 5.0 }\n\
         [[step]]\nat_s = 4\ndo = \"engine_faults\"\nengine = 1\nclear = true\n",
        false,
    )
    .unwrap();
    match &p.steps[0].action {
        Action::EngineFaults {
            set: Some(t),
            clear: false,
            ..
        } => assert_eq!(t["slowdown"].as_float(), Some(5.0)),
        a => panic!("{a:?}"),
    }
    assert_eq!(p.steps[1].action.label(), "e1 faults cleared");
}

#[test]
fn delay_steps_parse_with_defaults_and_their_pairs() {
    let p = plan(
        "[[step]]\nat_s = 1\ndo = \"delay\"\nms = 50\njitter_ms = 10\n\
         [[step]]\nat_s = 2\ndo = \"delay\"\nms = 2000\nbetween = [[2, 0], [0, 2], [1, 3]]\n\
         [[step]]\nat_s = 3\ndo = \"heal\"\n",
        false,
    )
    .unwrap();
    assert_eq!(
        p.steps[0].action,
        Action::Delay {
            ms: 50,
            jitter_ms: 10,
            between: None
        }
    );
    assert_eq!(
        p.steps[0].action.label(),
        "delay 50 ± 10 ms between all routers"
    );
    assert_eq!(
        p.steps[1].action.label(),
        "delay 2000 ms between r2–r0, r0–r2, r1–r3"
    );
    assert_eq!(delayed_pairs(None, 3), vec![(0, 1), (0, 2), (1, 2)]);
    assert_eq!(
        delayed_pairs(Some(&[[2, 0], [0, 2], [1, 3]]), 4),
        vec![(0, 2), (1, 3)]
    );
}

#[test]
fn blocked_pairs_of_partitions_and_isolation() {
    let halves = Action::Partition {
        groups: vec![vec![0, 1], vec![2, 3]],
    };
    assert_eq!(
        blocked_pairs(&halves, 4),
        vec![
            (0, 2),
            (0, 3),
            (1, 2),
            (1, 3),
            (2, 0),
            (2, 1),
            (3, 0),
            (3, 1)
        ]
    );
    assert_eq!(
        blocked_pairs(&Action::Isolate { router: 1 }, 3),
        vec![(0, 1), (1, 0), (1, 2), (2, 1)]
    );
    let cut = Action::Cut {
        from: vec![0],
        to: vec![1, 2],
    };
    assert_eq!(blocked_pairs(&cut, 3), vec![(0, 1), (0, 2)]);
    assert_eq!(cut.label(), "cut r0 → r1 r2 (one way)");
    assert!(check_indices(&cut, 3, 1).is_ok());
    for bad in [
        Action::Cut {
            from: vec![0],
            to: vec![0, 1],
        },
        Action::Cut {
            from: vec![],
            to: vec![1],
        },
        Action::Cut {
            from: vec![3],
            to: vec![1],
        },
    ] {
        assert!(check_indices(&bad, 3, 1).is_err(), "{bad:?}");
    }
    assert!(blocked_pairs(&Action::Heal, 3).is_empty());
}

#[test]
fn the_ca_is_rotated_once_and_never_past_a_paused_router() {
    let rotate = |at: u32| format!("[[step]]\nat_s = {at}\ndo = \"rotate_ca\"\n");
    let ok = plan(&rotate(3), false).unwrap();
    assert_eq!(ok.steps[0].action, Action::RotateCa);
    let twice = plan(&format!("{}{}", rotate(3), rotate(6)), false).unwrap_err();
    assert!(twice.contains("rotated once"), "{twice}");
    let paused = format!(
        "[[step]]\nat_s = 2\ndo = \"pause_router\"\nrouter = 1\n{}",
        rotate(3)
    );
    let e = plan(&paused, false).unwrap_err();
    assert!(e.contains("r1 is paused"), "{e}");
    let resumed = format!("{paused}[[step]]\nat_s = 1\ndo = \"resume_router\"\nrouter = 1\n");
    assert!(
        plan(&resumed, false).is_err(),
        "resumed before it was paused"
    );
    let after = format!(
        "[[step]]\nat_s = 2\ndo = \"pause_router\"\nrouter = 1\n\
         [[step]]\nat_s = 3\ndo = \"resume_router\"\nrouter = 1\n{}",
        rotate(4)
    );
    assert!(plan(&after, false).is_ok());
}
