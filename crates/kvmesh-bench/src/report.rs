//! The report of `kvmesh bench`: one row per contender and run, medians over repeats, ratios
//! against `round_robin` (min / median / max over repeats), the virtual-time evaluator's rows
//! (with the oracle), written as `report.json` (machines) and `report.md` (people).

use crate::eval::{EvalResult, spread};
use crate::load::EngineCounters;
use crate::replay::Record;
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// One contender's measurement (one run, or the medians over runs).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ContenderRow {
    /// Display name (e.g. `precise x3 mesh`).
    pub name: String,
    /// Routing policy (`round_robin`, `precise`, ..., `direct` without router, `oracle`).
    pub policy: String,
    /// Routers in front of the engines (0 = clients straight to the engines).
    pub routers: u32,
    /// Routers meshed.
    pub mesh: bool,
    /// Which repeat (0-based); `None` in the medians.
    pub repeat: Option<u32>,
    /// Requests answered.
    pub requests: u64,
    /// Requests failed.
    pub errors: u64,
    /// The first failed request's error, when any failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// Output tokens per wall second.
    pub output_tokens_per_s: f64,
    /// Requests per wall second.
    pub requests_per_s: f64,
    /// TTFT percentiles, wall ms.
    pub ttft_p50_ms: f64,
    /// See `ttft_p50_ms`.
    pub ttft_p90_ms: f64,
    /// See `ttft_p50_ms`.
    pub ttft_p99_ms: f64,
    /// Median of the requests' mean inter-token gaps, wall ms.
    pub itl_p50_ms: f64,
    /// End-to-end p99, wall ms.
    pub e2e_p99_ms: f64,
    /// Engine-reported hit rate: Δ`vllm:prefix_cache_hits_total` / Δ`queries_total` over all
    /// engines.
    pub hit_rate: f64,
    /// Client-side: Σ usage cached tokens / Σ prompt tokens.
    pub client_hit_rate: f64,
    /// The router's predicted cached tokens (`x-kvmesh-predicted-cached-tokens`) / Σ prompt
    /// tokens of the requests that carry a prediction; `None` without predictions.
    pub predicted_hit_rate: Option<f64>,
    /// Requests on the busiest engine / the mean over engines.
    pub load_spread: f64,
    /// In flight per engine, sampled every 20 ms through the run (summed over the routers):
    /// the mean over samples of max / mean, counting the samples under load (a mean of at
    /// least half the run's highest, and at least 1). `None` when
    /// nothing was sampled (external targets, no router, SMG, nginx).
    pub inflight_spread: Option<f64>,
    /// The same samples' 99th percentile of max / mean.
    pub inflight_spread_p99: Option<f64>,
    /// The same samples' mean in flight per engine.
    #[serde(default)]
    pub inflight_mean: Option<f64>,
    /// The same samples' mean of the busiest engine's count above the fewest possible for the
    /// number in flight (max − ⌈total / engines⌉): the spread with the number in flight taken
    /// out.
    #[serde(default)]
    pub inflight_excess: Option<f64>,
    /// The same excess over the steady part of the run only: the samples with at least 90% of
    /// the run's highest total in flight (the ramp and the drain left out, where the order
    /// requests finish in makes the excess, not the balancing).
    #[serde(default)]
    pub inflight_excess_steady: Option<f64>,
    /// `least_request` decisions of the routers run in this process, and how many of them
    /// did not go to the least loaded engine by every router's own in-flight counts at that
    /// moment; `None` without such decisions.
    #[serde(default)]
    pub least_load_decisions: Option<(u64, u64)>,
    /// Meshed routers run in this process: the age of the state envelopes they received
    /// during the run, all routers together, as the upper bounds (ms) of the histogram buckets
    /// holding its median and 99th percentile; `None` without a mesh.
    #[serde(default)]
    pub mesh_envelope_age_ms: Option<(f64, f64)>,
    /// Requests per engine (engine name → count).
    pub per_engine: Vec<(String, u64)>,
    /// Preemptions over all engines (Δ`vllm:num_preemptions_total`).
    pub preemptions: f64,
    /// Wall seconds of the run.
    pub elapsed_s: f64,
    /// Sorted TTFTs (ms) of the run, for the CDF plot (not serialised).
    #[serde(skip)]
    pub ttfts_ms: Vec<f64>,
    /// (seconds since start, client-side hit rate) per time bucket (not serialised).
    #[serde(skip)]
    pub timeline: Vec<(f64, f64)>,
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[(((p / 100.0) * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)]
}

/// The median of `v` (0 when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    pct(&s, 50.0)
}

impl ContenderRow {
    /// The row of one run: `records` from the client, `engines` each engine's counter deltas
    /// with its name (requests per engine come from them: `vllm:request_success_total`); with
    /// no engines known (external targets), from the endpoint that served each request.
    pub fn from_records(
        records: &[Record],
        elapsed_s: f64,
        engines: &[(String, EngineCounters)],
    ) -> ContenderRow {
        let ok: Vec<&Record> = records.iter().filter(|r| r.error.is_none()).collect();
        let mut ttfts: Vec<f64> = ok.iter().map(|r| r.ttft_s * 1e3).collect();
        ttfts.sort_by(|a, b| a.total_cmp(b));
        let mut e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s * 1e3).collect();
        e2e.sort_by(|a, b| a.total_cmp(b));
        let mut itl: Vec<f64> = ok.iter().filter_map(|r| r.itl_s).map(|x| x * 1e3).collect();
        itl.sort_by(|a, b| a.total_cmp(b));
        let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
        let out: u64 = ok.iter().map(|r| r.completion_tokens).sum();
        let with_pred: Vec<&&Record> = ok
            .iter()
            .filter(|r| r.predicted_cached_tokens.is_some())
            .collect();
        let predicted_hit_rate = (!with_pred.is_empty()).then(|| {
            let p: u64 = with_pred
                .iter()
                .filter_map(|r| r.predicted_cached_tokens)
                .sum();
            let t: u64 = with_pred.iter().map(|r| r.prompt_tokens).sum();
            if t == 0 { 0.0 } else { p as f64 / t as f64 }
        });
        let mut per: Vec<(String, u64)> = engines
            .iter()
            .map(|(n, c)| (n.clone(), c.requests.max(0.0) as u64))
            .collect();
        if engines.is_empty() {
            for r in &ok {
                match per.iter_mut().find(|(n, _)| *n == r.served_by) {
                    Some(e) => e.1 += 1,
                    None => per.push((r.served_by.clone(), 1)),
                }
            }
        }
        let total = engines
            .iter()
            .fold(EngineCounters::default(), |a, (_, c)| a + *c);
        let counts: Vec<u64> = per.iter().map(|(_, c)| *c).collect();
        let secs = elapsed_s.max(1e-9);
        ContenderRow {
            requests: ok.len() as u64,
            errors: (records.len() - ok.len()) as u64,
            first_error: records.iter().find_map(|r| r.error.clone()),
            output_tokens_per_s: out as f64 / secs,
            requests_per_s: ok.len() as f64 / secs,
            ttft_p50_ms: pct(&ttfts, 50.0),
            ttft_p90_ms: pct(&ttfts, 90.0),
            ttft_p99_ms: pct(&ttfts, 99.0),
            itl_p50_ms: pct(&itl, 50.0),
            e2e_p99_ms: pct(&e2e, 99.0),
            hit_rate: total.hit_rate(),
            client_hit_rate: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            predicted_hit_rate,
            load_spread: spread(&counts),
            per_engine: per,
            preemptions: total.preemptions,
            elapsed_s,
            timeline: timeline(&ok, elapsed_s),
            ttfts_ms: ttfts,
            ..ContenderRow::default()
        }
    }

    /// Field-wise medians of several runs of one contender (the series of the median run by
    /// output tokens/s are kept for the plots).
    pub fn median_of(runs: &[ContenderRow]) -> ContenderRow {
        let m = |f: fn(&ContenderRow) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
        let mut by_tput: Vec<&ContenderRow> = runs.iter().collect();
        by_tput.sort_by(|a, b| a.output_tokens_per_s.total_cmp(&b.output_tokens_per_s));
        let mid = by_tput[by_tput.len() / 2];
        let preds: Vec<f64> = runs.iter().filter_map(|r| r.predicted_hit_rate).collect();
        ContenderRow {
            name: mid.name.clone(),
            policy: mid.policy.clone(),
            routers: mid.routers,
            mesh: mid.mesh,
            repeat: None,
            requests: m(|r| r.requests as f64) as u64,
            errors: runs.iter().map(|r| r.errors).sum(),
            first_error: runs.iter().find_map(|r| r.first_error.clone()),
            output_tokens_per_s: m(|r| r.output_tokens_per_s),
            requests_per_s: m(|r| r.requests_per_s),
            ttft_p50_ms: m(|r| r.ttft_p50_ms),
            ttft_p90_ms: m(|r| r.ttft_p90_ms),
            ttft_p99_ms: m(|r| r.ttft_p99_ms),
            itl_p50_ms: m(|r| r.itl_p50_ms),
            e2e_p99_ms: m(|r| r.e2e_p99_ms),
            hit_rate: m(|r| r.hit_rate),
            client_hit_rate: m(|r| r.client_hit_rate),
            predicted_hit_rate: (!preds.is_empty()).then(|| median(&preds)),
            load_spread: m(|r| r.load_spread),
            inflight_spread: opt_median(runs, |r| r.inflight_spread),
            inflight_spread_p99: opt_median(runs, |r| r.inflight_spread_p99),
            inflight_mean: opt_median(runs, |r| r.inflight_mean),
            inflight_excess: opt_median(runs, |r| r.inflight_excess),
            inflight_excess_steady: opt_median(runs, |r| r.inflight_excess_steady),
            least_load_decisions: sum_pairs(runs.iter().map(|r| r.least_load_decisions)),
            mesh_envelope_age_ms: opt_median(runs, |r| r.mesh_envelope_age_ms.map(|a| a.0))
                .zip(opt_median(runs, |r| r.mesh_envelope_age_ms.map(|a| a.1))),
            per_engine: mid.per_engine.clone(),
            preemptions: m(|r| r.preemptions),
            elapsed_s: m(|r| r.elapsed_s),
            ttfts_ms: mid.ttfts_ms.clone(),
            timeline: mid.timeline.clone(),
        }
    }
}

/// The sums of the runs' pairs, or `None` when no run has one.
fn sum_pairs(pairs: impl Iterator<Item = Option<(u64, u64)>>) -> Option<(u64, u64)> {
    pairs.flatten().reduce(|a, b| (a.0 + b.0, a.1 + b.1))
}

/// The median of the runs that have the figure, or `None`.
fn opt_median(runs: &[ContenderRow], f: fn(&ContenderRow) -> Option<f64>) -> Option<f64> {
    let v: Vec<f64> = runs.iter().filter_map(f).collect();
    (!v.is_empty()).then(|| median(&v))
}

/// Client-side hit rate per tenth of the run (by send time).
fn timeline(ok: &[&Record], elapsed_s: f64) -> Vec<(f64, f64)> {
    const BUCKETS: usize = 10;
    let w = (elapsed_s / BUCKETS as f64).max(1e-9);
    let mut b = [(0u64, 0u64); BUCKETS];
    for r in ok {
        let i = ((r.sent_s / w) as usize).min(BUCKETS - 1);
        b[i].0 += r.cached_tokens;
        b[i].1 += r.prompt_tokens;
    }
    b.iter()
        .enumerate()
        .filter(|(_, (_, p))| *p > 0)
        .map(|(i, (c, p))| ((i as f64 + 0.5) * w, *c as f64 / *p as f64))
        .collect()
}

/// min / median / max of a ratio over repeats.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Spread3 {
    /// Smallest.
    pub min: f64,
    /// Median.
    pub median: f64,
    /// Largest.
    pub max: f64,
}

impl Spread3 {
    /// Of these values (zeros when empty).
    pub fn of(v: &[f64]) -> Spread3 {
        let mut s = v.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        Spread3 {
            min: s.first().copied().unwrap_or(0.0),
            median: pct(&s, 50.0),
            max: s.last().copied().unwrap_or(0.0),
        }
    }
}

/// A contender against `round_robin` of the same repeat.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RatioRow {
    /// Contender name.
    pub name: String,
    /// Output tokens/s ÷ round robin's.
    pub output_tokens_per_s: Spread3,
    /// TTFT p99 ÷ round robin's (below 1 is better).
    pub ttft_p99: Spread3,
    /// Hit rate − round robin's (points).
    pub hit_rate_gain: Spread3,
}

/// Ratios of every contender against the contender named `baseline` in the same repeat.
pub fn ratios(runs: &[ContenderRow], baseline: &str) -> Vec<RatioRow> {
    let mut names: Vec<String> = Vec::new();
    for r in runs {
        if !names.contains(&r.name) {
            names.push(r.name.clone());
        }
    }
    let base = |rep: Option<u32>| runs.iter().find(|r| r.name == baseline && r.repeat == rep);
    names
        .iter()
        .map(|n| {
            let (mut t, mut p, mut h) = (Vec::new(), Vec::new(), Vec::new());
            for r in runs.iter().filter(|r| &r.name == n) {
                if let Some(b) = base(r.repeat) {
                    if b.output_tokens_per_s > 0.0 {
                        t.push(r.output_tokens_per_s / b.output_tokens_per_s);
                    }
                    if b.ttft_p99_ms > 0.0 {
                        p.push(r.ttft_p99_ms / b.ttft_p99_ms);
                    }
                    h.push(r.hit_rate - b.hit_rate);
                }
            }
            RatioRow {
                name: n.clone(),
                output_tokens_per_s: Spread3::of(&t),
                ttft_p99: Spread3::of(&p),
                hit_rate_gain: Spread3::of(&h),
            }
        })
        .collect()
}

/// The whole report.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    /// The machine (`uname`, cores).
    pub machine: String,
    /// `git describe` of the tree the binary was built from (or `unknown`).
    pub commit: String,
    /// The seed of the workload and of the routers.
    pub seed: u64,
    /// The exact command line.
    pub command: String,
    /// UTC time of the start (seconds since the epoch).
    pub started_unix: u64,
    /// Workload name and shape.
    pub workload: serde_json::Value,
    /// Fleet: engines, KV blocks, time scale, or the external targets.
    pub fleet: serde_json::Value,
    /// Repeats of every contender.
    pub repeats: u32,
    /// Per contender, the medians over repeats (the first name is the baseline).
    pub contenders: Vec<ContenderRow>,
    /// Every run, interleaved order.
    pub runs: Vec<ContenderRow>,
    /// Contenders against round robin, per repeat.
    pub ratios: Vec<RatioRow>,
    /// The virtual-time evaluator over the same jobs: every policy and the oracle.
    pub evaluator: Vec<EvalResult>,
    /// Remarks (skipped contenders, approximations).
    pub notes: Vec<String>,
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:.1}%", v * 100.0))
}

impl Report {
    /// The markdown report.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# kvmesh bench: {}\n",
            self.workload["name"].as_str().unwrap_or("?")
        );
        let _ = writeln!(s, "- command: `{}`", self.command);
        let _ = writeln!(s, "- commit: `{}`", self.commit);
        let _ = writeln!(s, "- machine: {}", self.machine);
        let _ = writeln!(s, "- seed: {}, repeats: {}", self.seed, self.repeats);
        let _ = writeln!(s, "- workload: `{}`", self.workload);
        let _ = writeln!(s, "- fleet: `{}`\n", self.fleet);
        // External targets: the engines behind them are not read.
        let hit = if self.fleet.get("targets").is_some() {
            "client-side (usage cached tokens / prompt tokens)"
        } else {
            "engine-reported Δhits/Δqueries"
        };
        let _ = writeln!(
            s,
            "Real-time runs, contenders interleaved on the same fleet (engine caches reset between \
             runs), medians over repeats. Latencies in wall ms (÷ the time scale = simulated ms). \
             `hit` = {hit}; `pred` = the router's predicted cached tokens \
             / prompt tokens; `spread` = requests on the busiest engine / mean; `in flight` = in flight \
             per engine sampled every 20 ms, max / mean under load (samples of at least half the \
             run's peak mean): mean over samples and p99.\n"
        );
        let _ = writeln!(
            s,
            "| contender | requests | errors | out tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | hit | pred | spread | in flight |"
        );
        let _ = writeln!(
            s,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.contenders {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1}% | {} | {:.2} | {} |",
                r.name,
                r.requests,
                r.errors,
                r.output_tokens_per_s,
                r.requests_per_s,
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.itl_p50_ms,
                r.hit_rate * 100.0,
                opt(r.predicted_hit_rate),
                r.load_spread,
                match (r.inflight_spread, r.inflight_spread_p99) {
                    (Some(m), Some(p)) => format!("{m:.2} / {p:.2}"),
                    _ => "–".into(),
                }
            );
        }
        let judged: Vec<String> = self
            .contenders
            .iter()
            .filter_map(|r| {
                let (n, missed) = r.least_load_decisions?;
                Some(format!(
                    "{} {:.1}% of {n}",
                    r.name,
                    missed as f64 * 100.0 / n.max(1) as f64
                ))
            })
            .collect();
        if !judged.is_empty() {
            let _ = writeln!(
                s,
                "\n`least_request` decisions that did not go to the least loaded engine by every \
                 router's own in-flight counts at that moment (all repeats): {}.",
                judged.join("; ")
            );
        }
        let shapes: Vec<String> = self
            .contenders
            .iter()
            .filter_map(|r| {
                let steady = r
                    .inflight_excess_steady
                    .map_or(String::new(), |x| format!(" (steady +{x:.3})"));
                Some(format!(
                    "{} {:.2} / +{:.3}{steady}",
                    r.name, r.inflight_mean?, r.inflight_excess?
                ))
            })
            .collect();
        if !shapes.is_empty() {
            let _ = writeln!(
                s,
                "\nIn flight per engine under load (the same samples as max / mean; medians of the \
                 repeats): the mean, and the busiest engine's count above the fewest possible for \
                 the number in flight (steady: over the samples with at least 90% of the run's \
                 highest total in flight): {}.",
                shapes.join("; ")
            );
        }
        let ages: Vec<String> = self
            .contenders
            .iter()
            .filter_map(|r| {
                let (p50, p99) = r.mesh_envelope_age_ms?;
                Some(format!("{} ≤ {p50} / ≤ {p99} ms", r.name))
            })
            .collect();
        if !ages.is_empty() {
            let _ = writeln!(
                s,
                "\nAge of the mesh's state envelopes at the router receiving them (the buckets \
                 holding the median / the 99th percentile, all routers, medians over repeats): {}.",
                ages.join("; ")
            );
        }
        if !self.ratios.is_empty() {
            let _ = writeln!(
                s,
                "\nAgainst `{}` in the same repeat (min / median / max over {} repeats):\n",
                self.contenders.first().map_or("", |c| c.name.as_str()),
                self.repeats
            );
            let _ = writeln!(
                s,
                "| contender | out tok/s ratio | TTFT p99 ratio | hit rate gain (points) |"
            );
            let _ = writeln!(s, "|---|---|---|---|");
            for r in &self.ratios {
                let f = |x: Spread3, k: f64| {
                    format!("{:.2} / {:.2} / {:.2}", x.min * k, x.median * k, x.max * k)
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} |",
                    r.name,
                    f(r.output_tokens_per_s, 1.0),
                    f(r.ttft_p99, 1.0),
                    f(r.hit_rate_gain, 100.0)
                );
            }
        }
        if !self.evaluator.is_empty() {
            let _ = writeln!(
                s,
                "\nVirtual-time evaluator (engine model + policies in one loop, one router, same \
                 jobs; times in simulated ms). The oracle knows every engine's cache and queue \
                 exactly: the ceiling of the hit rate.\n"
            );
            let _ = writeln!(
                s,
                "| policy | requests | hit | pred | TTFT p50 | TTFT p99 | out tok/s | spread | preempt |"
            );
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
            for e in &self.evaluator {
                let _ = writeln!(
                    s,
                    "| {} | {} | {:.1}% | {:.1}% | {:.1} | {:.1} | {:.0} | {:.2} | {} |",
                    e.name,
                    e.requests,
                    e.hit_rate * 100.0,
                    e.predicted_hit_rate * 100.0,
                    e.ttft_p50_ms,
                    e.ttft_p99_ms,
                    e.output_tokens_per_s,
                    e.load_spread,
                    e.preemptions
                );
            }
            if let Some(o) = self.evaluator.iter().find(|e| e.name == "oracle")
                && o.hit_rate > 0.0
            {
                let _ = writeln!(s, "\nReal-time hit rate as a share of the oracle's:\n");
                for r in &self.contenders {
                    let _ = writeln!(
                        s,
                        "- {}: {:.1}% of {:.1}%",
                        r.name,
                        100.0 * r.hit_rate / o.hit_rate,
                        o.hit_rate * 100.0
                    );
                }
            }
        }
        let _ = writeln!(
            s,
            "\nPlots: `ttft_cdf.svg`, `throughput.svg`, `hit_rate.svg`, `hit_rate_over_time.svg`, `load_spread.svg`."
        );
        for n in &self.notes {
            let _ = writeln!(s, "\n> {n}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(job: u64, engine: &str, ttft: f64, cached: u64) -> Record {
        Record {
            job,
            served_by: engine.into(),
            ttft_s: ttft,
            e2e_s: ttft * 2.0,
            prompt_tokens: 100,
            cached_tokens: cached,
            completion_tokens: 10,
            ..Record::default()
        }
    }

    #[test]
    fn rows_medians_and_ratios() {
        let recs = vec![
            rec(0, "a", 0.1, 0),
            rec(1, "a", 0.2, 50),
            rec(2, "a", 0.3, 100),
        ];
        let c = |hits, queries, requests| EngineCounters {
            hits,
            queries,
            requests,
            preemptions: 0.0,
        };
        let engines = [
            ("a".to_string(), c(150.0, 200.0, 3.0)),
            ("b".to_string(), c(0.0, 100.0, 0.0)),
        ];
        let mut r = ContenderRow::from_records(&recs, 2.0, &engines);
        assert_eq!((r.requests, r.errors), (3, 0));
        assert_eq!(r.output_tokens_per_s, 15.0);
        assert_eq!(r.hit_rate, 0.5);
        assert_eq!(r.load_spread, 2.0);
        assert_eq!(r.per_engine[1], ("b".to_string(), 0));
        assert!((r.ttft_p50_ms - 200.0).abs() < 1e-9);
        r.name = "x".into();
        r.repeat = Some(0);
        // Without engine counters: requests per serving endpoint.
        let ext = ContenderRow::from_records(&recs, 2.0, &[]);
        assert_eq!(ext.per_engine, vec![("a".to_string(), 3)]);
        let mut base = r.clone();
        base.name = "rr".into();
        base.output_tokens_per_s = 5.0;
        let rat = ratios(&[base, r.clone()], "rr");
        assert_eq!(rat[1].output_tokens_per_s.median, 3.0);
        let mut judged = r.clone();
        judged.least_load_decisions = Some((150, 6));
        let mut other = r.clone();
        other.least_load_decisions = Some((50, 2));
        let m = ContenderRow::median_of(&[judged, r.clone(), other]);
        assert_eq!(
            m.least_load_decisions,
            Some((200, 8)),
            "summed over repeats"
        );
        let report = Report {
            contenders: vec![m],
            ..Report::default()
        };
        assert!(
            report.markdown().contains("x 4.0% of 200"),
            "{}",
            report.markdown()
        );
        let m = ContenderRow::median_of(&[r.clone(), r]);
        assert_eq!(m.least_load_decisions, None);
        assert!(
            !Report {
                contenders: vec![m.clone()],
                ..Report::default()
            }
            .markdown()
            .contains("least loaded engine")
        );
        assert_eq!(m.output_tokens_per_s, 15.0);
        assert_eq!(
            Spread3::of(&[3.0, 1.0, 2.0]),
            Spread3 {
                min: 1.0,
                median: 2.0,
                max: 3.0
            }
        );
    }
}
