//! The age of state envelopes when they arrive (their sender's clock at sending against the
//! receiver's at handling, on the routers' shared time base): how late peers' counts and
//! marks are, as a histogram a router exports and the bench reads.

/// Upper bounds (µs) of the buckets; a last bucket holds the rest.
pub const AGE_BOUNDS_US: [u64; 15] = [
    25, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000,
    1_000_000,
];

/// Envelope ages: per-bucket (not cumulative) counts, the last beyond every bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgeHistogram {
    /// Counts per bucket of [`AGE_BOUNDS_US`], then the rest.
    pub counts: [u64; AGE_BOUNDS_US.len() + 1],
    /// Sum of the ages, µs.
    pub sum_us: u64,
}

impl AgeHistogram {
    /// Counts one envelope `age_us` old (a negative age, from clock skew, counts as 0).
    pub fn observe(&mut self, age_us: i64) {
        let age = u64::try_from(age_us).unwrap_or(0);
        let i = AGE_BOUNDS_US.partition_point(|&b| b < age);
        self.counts[i] += 1;
        self.sum_us = self.sum_us.saturating_add(age);
    }

    /// Envelopes counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// What was counted since `before` (an earlier copy of the same histogram).
    pub fn since(&self, before: &AgeHistogram) -> AgeHistogram {
        let mut d = AgeHistogram {
            sum_us: self.sum_us.saturating_sub(before.sum_us),
            ..AgeHistogram::default()
        };
        for (i, c) in d.counts.iter_mut().enumerate() {
            *c = self.counts[i].saturating_sub(before.counts[i]);
        }
        d
    }

    /// Adds `other`'s counts (several routers' histograms as one).
    pub fn add(&mut self, other: &AgeHistogram) {
        for (c, o) in self.counts.iter_mut().zip(other.counts.iter()) {
            *c += o;
        }
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
    }

    /// The upper bound (µs) of the bucket holding quantile `q` (0..=1), `None` past the last
    /// bound or without counts.
    pub fn quantile_bound_us(&self, q: f64) -> Option<u64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return AGE_BOUNDS_US.get(i).copied();
            }
        }
        None
    }

    /// Per-bucket counts with their upper bounds in seconds, `+Inf` last (the shape
    /// `prometheus-client` encodes).
    pub fn buckets_secs(&self) -> Vec<(f64, u64)> {
        AGE_BOUNDS_US
            .iter()
            .map(|&b| b as f64 / 1e6)
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().copied())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_land_in_their_bucket_and_quantiles_name_its_bound() {
        let mut h = AgeHistogram::default();
        for age in [10, 25, 26, 90, 3_000, -5] {
            h.observe(age);
        }
        h.observe(5_000_000);
        assert_eq!(h.count(), 7);
        assert_eq!(h.counts[0], 3, "10, 25 and a skewed -5 (as 0)");
        assert_eq!(h.counts[1], 1);
        assert_eq!(h.counts[2], 1);
        assert_eq!(h.counts[7], 1, "3 ms is under 5 ms");
        assert_eq!(h.counts[AGE_BOUNDS_US.len()], 1, "past every bound");
        assert_eq!(h.quantile_bound_us(0.5), Some(50));
        assert_eq!(h.quantile_bound_us(0.8), Some(5_000));
        assert_eq!(
            h.quantile_bound_us(1.0),
            None,
            "the largest is past the last bound"
        );
        assert_eq!(AgeHistogram::default().quantile_bound_us(0.5), None);
        let before = h.clone();
        h.observe(150);
        let d = h.since(&before);
        assert_eq!((d.count(), d.counts[3], d.sum_us), (1, 1, 150));
        let mut two = d.clone();
        two.add(&d);
        assert_eq!(two.count(), 2);
        assert_eq!(h.buckets_secs().len(), AGE_BOUNDS_US.len() + 1);
    }
}
