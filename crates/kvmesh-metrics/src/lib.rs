//! Prometheus text exposition (format 0.0.4) without a registry: lock-free histograms with
//! fixed buckets, and writers for `# HELP`/`# TYPE` families. Metric names live with the
//! component that owns them (the simulator's under vLLM's names, the router's under
//! `kvmesh_`); this crate only renders.

#![forbid(unsafe_code)]
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Buckets (seconds) for latencies from sub-millisecond to minutes.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// Buckets (seconds) for sub-millisecond work such as a routing decision.
pub const MICRO_BUCKETS: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3,
];

/// A histogram with fixed upper bounds, observed in microseconds, rendered in seconds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    /// An empty histogram over `bounds` (seconds, increasing).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    /// Records one observation of `us` microseconds.
    pub fn observe_us(&self, us: u64) {
        let secs = us as f64 / 1e6;
        if let Some(i) = self.bounds.iter().position(|b| secs <= *b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// Sum of observations, seconds.
    pub fn sum_secs(&self) -> f64 {
        self.sum_us.load(Relaxed) as f64 / 1e6
    }

    /// Cumulative bucket counts (same order as the bounds) and the total.
    pub fn cumulative(&self) -> (Vec<u64>, u64) {
        let mut cum = 0;
        let v = self
            .counts
            .iter()
            .map(|c| {
                cum += c.load(Relaxed);
                cum
            })
            .collect();
        (v, self.count())
    }

    /// The upper bound (seconds) of the bucket holding quantile `q` (0..=1), or None when
    /// empty; `+Inf` observations report the last bound.
    pub fn quantile_bound(&self, q: f64) -> Option<f64> {
        let (cum, total) = self.cumulative();
        if total == 0 {
            return None;
        }
        let rank = (q.clamp(0.0, 1.0) * total as f64).ceil().max(1.0) as u64;
        let i = cum.iter().position(|c| *c >= rank).unwrap_or(cum.len() - 1);
        self.bounds.get(i).copied()
    }

    /// Per-bucket (not cumulative) counts with their upper bounds, `+Inf` last: the shape
    /// `prometheus-client`'s encoder takes.
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        let mut v: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .zip(self.counts.iter())
            .map(|(b, c)| (*b, c.load(Relaxed)))
            .collect();
        let inside: u64 = v.iter().map(|x| x.1).sum();
        v.push((f64::INFINITY, self.count().saturating_sub(inside)));
        v
    }

    /// Adds `other`'s observations (a histogram over the same bounds: several sources as
    /// one). Buckets past `self`'s bounds count only in the total.
    pub fn merge_from(&self, other: &Histogram) {
        debug_assert_eq!(
            self.bounds, other.bounds,
            "merging histograms of other bounds"
        );
        for (c, o) in self.counts.iter().zip(other.counts.iter()) {
            c.fetch_add(o.load(Relaxed), Relaxed);
        }
        self.count.fetch_add(other.count(), Relaxed);
        self.sum_us.fetch_add(other.sum_us.load(Relaxed), Relaxed);
    }

    /// Forgets every observation (a rolling window starting anew).
    pub fn reset(&self) {
        for c in self.counts.iter() {
            c.store(0, Relaxed);
        }
        self.count.store(0, Relaxed);
        self.sum_us.store(0, Relaxed);
    }

    /// Writes the `_bucket`, `_count` and `_sum` series of one label set (no HELP/TYPE).
    pub fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let (cum, total) = self.cumulative();
        for (b, c) in self.bounds.iter().zip(cum) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {total}");
        sample(out, &format!("{name}_count"), labels, total);
        sample(out, &format!("{name}_sum"), labels, self.sum_secs());
    }

    /// Writes HELP, TYPE and one label set.
    pub fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        header(out, name, help, "histogram");
        self.render_series(out, name, labels);
    }
}

/// Writes `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Writes one sample line.
pub fn sample(out: &mut String, name: &str, labels: &str, value: impl std::fmt::Display) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {value}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// A whole single-sample family (HELP, TYPE, value).
pub fn family(
    out: &mut String,
    name: &str,
    help: &str,
    kind: &str,
    labels: &str,
    value: impl std::fmt::Display,
) {
    header(out, name, help, kind);
    sample(out, name, labels, value);
}

/// Escapes a label value (backslash, quote, newline).
pub fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe_us(50_000);
        h.observe_us(500_000);
        h.observe_us(5_000_000);
        let mut s = String::new();
        h.render(&mut s, "x", "help", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count{a=\"b\"} 3\n"), "{s}");
        assert!(s.contains("x_sum{a=\"b\"} 5.55\n"), "{s}");
        assert_eq!(h.quantile_bound(0.5), Some(1.0));
        assert_eq!(h.quantile_bound(0.3), Some(0.1));
        assert_eq!(Histogram::new(&[1.0]).quantile_bound(0.99), None);
        assert_eq!(h.buckets(), vec![(0.1, 1), (1.0, 1), (f64::INFINITY, 1)]);
        let all = Histogram::new(&[0.1, 1.0]);
        all.merge_from(&h);
        all.merge_from(&h);
        assert_eq!(all.buckets(), vec![(0.1, 2), (1.0, 2), (f64::INFINITY, 2)]);
        assert_eq!(all.sum_secs(), 2.0 * h.sum_secs());
        h.reset();
        assert_eq!(h.count(), 0);
        assert_eq!(h.quantile_bound(0.5), None);
        assert_eq!(escape_label("a\"b\\"), "a\\\"b\\\\");
    }
}
