//! A run's observations → figures per phase, the invariants' checks, the verdict table. Pure.

use crate::scenario::Invariants;
use std::collections::BTreeMap;
use std::fmt::Write;

/// How one client request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A complete 200 response.
    Served {
        router: usize,
        prompt_tokens: u64,
        cached_tokens: u64,
        attempts: u32,
    },
    /// A clear error before the deadline (an HTTP error answer, refused connections…): the
    /// last reason seen.
    Failed { reason: String },
    /// No answer of any kind before the deadline.
    Unanswered,
}

/// One client request.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Milliseconds since the workload started.
    pub start_ms: u64,
    pub end_ms: u64,
    pub outcome: Outcome,
    /// Some router process was running and an engine was alive when the request started: a
    /// request not served then is lost.
    pub servable: bool,
}

/// What the runner measured, besides the records.
#[derive(Debug, Clone)]
pub struct Observations {
    pub records: Vec<Record>,
    /// The fault window [from, to) in ms since the workload started: the first step's start to
    /// the last step's end plus the settle time. None without steps.
    pub during: Option<(u64, u64)>,
    /// Time from the last step's end until every live router's digests agreed and each listed
    /// every other live router as a member; None if not seen before the runner stopped waiting.
    pub convergence_ms: Option<u64>,
    /// How long the runner waited for convergence at most.
    pub convergence_waited_ms: u64,
    /// Time after the load until every in-flight counter read 0, or what was still non-zero.
    pub in_flight_zero: Result<u64, String>,
    /// Lines of the processes' logs that report a panic (`process: line`).
    pub panics: Vec<String>,
}

/// A scenario's figures for the report.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Figures {
    pub sent: u64,
    pub served: u64,
    /// Not served, by reason.
    pub failed: BTreeMap<String, u64>,
    pub lost: u64,
    pub unanswered: u64,
    /// Σ cached / Σ prompt tokens of the served requests started in each phase.
    pub hit_before: Option<f64>,
    pub hit_during: Option<f64>,
    pub hit_after: Option<f64>,
    pub convergence_ms: Option<u64>,
    /// Requests served by each router index.
    pub per_router: BTreeMap<usize, u64>,
}

/// One invariant's verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

fn hit_rate<'a>(rs: impl Iterator<Item = &'a Record>) -> Option<f64> {
    let (mut p, mut c) = (0u64, 0u64);
    for r in rs {
        if let Outcome::Served {
            prompt_tokens,
            cached_tokens,
            ..
        } = r.outcome
        {
            p += prompt_tokens;
            c += cached_tokens;
        }
    }
    (p > 0).then(|| c as f64 / p as f64)
}

/// The figures of a run.
pub fn figures(obs: &Observations) -> Figures {
    let mut f = Figures {
        sent: obs.records.len() as u64,
        convergence_ms: obs.convergence_ms,
        ..Figures::default()
    };
    for r in &obs.records {
        match &r.outcome {
            Outcome::Served { router, .. } => {
                f.served += 1;
                *f.per_router.entry(*router).or_default() += 1;
            }
            Outcome::Failed { reason } => {
                *f.failed.entry(reason.clone()).or_default() += 1;
                f.lost += u64::from(r.servable);
            }
            Outcome::Unanswered => {
                *f.failed
                    .entry("no answer before the deadline".into())
                    .or_default() += 1;
                f.unanswered += 1;
                f.lost += u64::from(r.servable);
            }
        }
    }
    let (from, to) = obs.during.unwrap_or((u64::MAX, u64::MAX));
    f.hit_before = hit_rate(obs.records.iter().filter(|r| r.start_ms < from));
    f.hit_during = hit_rate(
        obs.records
            .iter()
            .filter(|r| r.start_ms >= from && r.start_ms < to),
    );
    f.hit_after = hit_rate(obs.records.iter().filter(|r| r.start_ms >= to));
    f
}

fn pct(x: Option<f64>) -> String {
    x.map_or("–".into(), |v| format!("{:.1}%", v * 100.0))
}

fn hit_check(name: &'static str, phase: Option<f64>, before: Option<f64>, min: f64) -> Check {
    match (phase, before) {
        (None, _) => Check {
            name,
            ok: true,
            detail: "no request served in this phase".into(),
        },
        (Some(p), None) => Check {
            name,
            ok: min == 0.0,
            detail: format!("{} with no fault-free figure before", pct(Some(p))),
        },
        (Some(p), Some(b)) => Check {
            name,
            ok: p >= min * b,
            detail: format!(
                "{} vs {} before (≥ {:.0}% of it required)",
                pct(Some(p)),
                pct(Some(b)),
                min * 100.0
            ),
        },
    }
}

/// The invariants' checks of a run.
pub fn checks(obs: &Observations, f: &Figures, inv: &Invariants) -> Vec<Check> {
    let mut out = Vec::new();
    out.push(Check {
        name: "accounted",
        ok: f.unanswered == 0 && f.served + f.failed.values().sum::<u64>() == f.sent,
        detail: format!(
            "{} sent = {} served + {} with a clear error + {} unanswered",
            f.sent,
            f.served,
            f.failed.values().sum::<u64>() - f.unanswered,
            f.unanswered
        ),
    });
    out.push(Check {
        name: "none lost",
        ok: f.lost == 0 && f.sent > 0,
        detail: if f.sent == 0 {
            "no request was sent".into()
        } else {
            format!("{} lost while a router was running", f.lost)
        },
    });
    out.push(Check {
        name: "in flight → 0",
        ok: obs.in_flight_zero.is_ok(),
        detail: match &obs.in_flight_zero {
            Ok(ms) => format!("all zero {ms} ms after the load"),
            Err(e) => e.clone(),
        },
    });
    out.push(Check {
        name: "digests agree",
        ok: obs
            .convergence_ms
            .is_some_and(|ms| ms <= inv.convergence_ms),
        detail: match obs.convergence_ms {
            Some(ms) => format!(
                "{ms} ms after the last step (bound {} ms)",
                inv.convergence_ms
            ),
            None => format!(
                "not within {} ms of the last step (bound {} ms)",
                obs.convergence_waited_ms, inv.convergence_ms
            ),
        },
    });
    out.push(hit_check(
        "hit rate during",
        f.hit_during,
        f.hit_before,
        inv.hit_rate_during_min,
    ));
    out.push(hit_check(
        "hit rate after",
        f.hit_after,
        f.hit_before,
        inv.hit_rate_after_min,
    ));
    out.push(Check {
        name: "no panic",
        ok: obs.panics.is_empty(),
        detail: obs
            .panics
            .first()
            .cloned()
            .map_or("none in any log".into(), |p| {
                format!("{} panic line(s), first: {p}", obs.panics.len())
            }),
    });
    out
}

/// A scenario's row of the report.
#[derive(Debug, Clone)]
pub struct Row {
    pub scenario: String,
    pub figures: Figures,
    pub checks: Vec<Check>,
}

impl Row {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.ok)
    }
}

/// The verdict table (markdown) and, under it, every failed check with its detail.
pub fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| scenario | sent | served | failed (reason) | lost | convergence | hit before | during | after | verdict |\n\
         |---|---:|---:|---|---:|---:|---:|---:|---:|---|\n",
    );
    for r in rows {
        let f = &r.figures;
        let failed = if f.failed.is_empty() {
            "0".to_string()
        } else {
            f.failed
                .iter()
                .map(|(k, v)| format!("{v} ({k})"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let bad: Vec<&str> = r.checks.iter().filter(|c| !c.ok).map(|c| c.name).collect();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.scenario,
            f.sent,
            f.served,
            failed,
            f.lost,
            f.convergence_ms.map_or("–".into(), |ms| format!("{ms} ms")),
            pct(f.hit_before),
            pct(f.hit_during),
            pct(f.hit_after),
            if bad.is_empty() {
                "PASS".to_string()
            } else {
                format!("FAIL: {}", bad.join(", "))
            }
        );
    }
    for r in rows {
        for c in r.checks.iter().filter(|c| !c.ok) {
            let _ = writeln!(s, "\n{}: {} failed: {}", r.scenario, c.name, c.detail);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(start_ms: u64, prompt: u64, cached: u64) -> Record {
        Record {
            start_ms,
            end_ms: start_ms + 10,
            outcome: Outcome::Served {
                router: (start_ms % 2) as usize,
                prompt_tokens: prompt,
                cached_tokens: cached,
                attempts: 1,
            },
            servable: true,
        }
    }

    fn obs(records: Vec<Record>) -> Observations {
        Observations {
            records,
            during: Some((1_000, 2_000)),
            convergence_ms: Some(400),
            convergence_waited_ms: 10_000,
            in_flight_zero: Ok(20),
            panics: vec![],
        }
    }

    fn failed(cs: &[Check]) -> Vec<&'static str> {
        cs.iter().filter(|c| !c.ok).map(|c| c.name).collect()
    }

    #[test]
    fn phases_split_by_start_time_and_a_clean_run_passes() {
        let o = obs(vec![
            served(0, 100, 0),
            served(500, 100, 80),
            served(1_000, 100, 50),
            served(1_999, 100, 70),
            served(2_000, 100, 90),
        ]);
        let f = figures(&o);
        assert_eq!((f.sent, f.served, f.lost), (5, 5, 0));
        assert_eq!(f.hit_before, Some(0.4));
        assert_eq!(f.hit_during, Some(0.6));
        assert_eq!(f.hit_after, Some(0.9));
        assert_eq!(f.per_router.values().sum::<u64>(), 5);
        let c = checks(&o, &f, &Invariants::default());
        assert!(failed(&c).is_empty(), "{c:?}");
        assert!(
            table(&[Row {
                scenario: "x".into(),
                figures: f,
                checks: c
            }])
            .contains("| x | 5 | 5 | 0 | 0 | 400 ms | 40.0% | 60.0% | 90.0% | PASS |")
        );
    }

    #[test]
    fn each_broken_invariant_fails_its_own_check() {
        let mut o = obs(vec![served(0, 100, 50), served(1_500, 100, 10)]);
        o.records.push(Record {
            start_ms: 1_200,
            end_ms: 1_300,
            outcome: Outcome::Failed {
                reason: "502 from every router".into(),
            },
            servable: true,
        });
        o.records.push(Record {
            start_ms: 1_300,
            end_ms: 31_300,
            outcome: Outcome::Unanswered,
            servable: false,
        });
        o.convergence_ms = Some(1_500);
        o.in_flight_zero = Err("r1: kvmesh_in_flight 2".into());
        o.panics = vec!["r0: thread 'x' panicked at src/a.rs:1".into()];
        let f = figures(&o);
        // The unanswered request started while no router ran: failed, not lost.
        assert_eq!((f.lost, f.unanswered), (1, 1));
        let c = checks(&o, &f, &Invariants::default());
        assert_eq!(
            failed(&c),
            vec![
                "accounted",
                "none lost",
                "in flight → 0",
                "digests agree",
                "hit rate during",
                "no panic"
            ]
        );
        let t = table(&[Row {
            scenario: "y".into(),
            figures: f,
            checks: c,
        }]);
        assert!(t.contains("1 (502 from every router)"), "{t}");
        assert!(t.contains("y: digests agree failed: 1500 ms"), "{t}");
    }

    #[test]
    fn a_failure_while_no_router_ran_is_failed_not_lost_and_no_convergence_fails() {
        let mut o = obs(vec![served(0, 100, 0)]);
        o.records.push(Record {
            start_ms: 1_100,
            end_ms: 1_101,
            outcome: Outcome::Failed {
                reason: "connection refused by every router".into(),
            },
            servable: false,
        });
        o.convergence_ms = None;
        let f = figures(&o);
        assert_eq!((f.lost, f.failed.values().sum::<u64>()), (0, 1));
        let c = checks(&o, &f, &Invariants::default());
        assert_eq!(failed(&c), vec!["digests agree"]);
        // No fault-free figure: the hit-rate check passes only when no fraction is required.
        let o2 = Observations {
            during: Some((0, 10)),
            ..obs(vec![served(5, 100, 0)])
        };
        let f2 = figures(&o2);
        assert_eq!(f2.hit_before, None);
        assert_eq!(
            failed(&checks(&o2, &f2, &Invariants::default())),
            vec!["hit rate during"]
        );
    }
}
