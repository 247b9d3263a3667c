//! Run-time fault injection: the current faults, merged from partial JSON patches, and the
//! seeded dice that decide which requests fail.

use kvmesh_config::FaultConfig;
use kvmesh_openai::ApiError;
use serde::Deserialize;

/// A partial update of the faults (`POST /admin/faults`): absent fields keep their value.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultPatch {
    error_rate: Option<f64>,
    error_status: Option<u16>,
    added_latency_ms: Option<u64>,
    slowdown: Option<f64>,
    hang: Option<bool>,
    drop_events: Option<bool>,
}

/// The faults in force plus the dice.
pub struct Faults {
    cfg: FaultConfig,
    rng: u64,
}

impl Faults {
    /// Faults from the start-up config; `seed` makes the dice reproducible.
    pub fn new(cfg: FaultConfig, seed: u64) -> Self {
        Faults {
            cfg,
            rng: seed ^ 0x5DEE_CE66_D1CE_4E5B,
        }
    }

    /// The faults in force.
    pub fn current(&self) -> &FaultConfig {
        &self.cfg
    }

    /// Merges a patch; on an invalid result nothing changes and the error names the field.
    pub fn apply(&mut self, body: &[u8]) -> Result<FaultConfig, ApiError> {
        let patch: FaultPatch = kvmesh_openai::parse_body(body)?;
        let mut next = self.cfg.clone();
        if let Some(v) = patch.error_rate {
            next.error_rate = v;
        }
        if let Some(v) = patch.error_status {
            next.error_status = v;
        }
        if let Some(v) = patch.added_latency_ms {
            next.added_latency_ms = v;
        }
        if let Some(v) = patch.slowdown {
            next.slowdown = v;
        }
        if let Some(v) = patch.hang {
            next.hang = v;
        }
        if let Some(v) = patch.drop_events {
            next.drop_events = v;
        }
        next.validate("faults").map_err(refusal)?;
        self.cfg = next.clone();
        Ok(next)
    }

    /// Clears every fault.
    pub fn clear(&mut self) -> FaultConfig {
        self.cfg = FaultConfig::default();
        self.cfg.clone()
    }

    /// Rolls the error dice for one request: `Some(status)` when it must fail.
    pub fn roll_error(&mut self) -> Option<u16> {
        if self.cfg.error_rate <= 0.0 {
            return None;
        }
        // SplitMix64: tiny, seeded, reproducible.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64;
        (u < self.cfg.error_rate).then_some(self.cfg.error_status)
    }
}

/// A refused fault setting, with the field it names as `param`.
fn refusal(e: kvmesh_config::ConfigError) -> ApiError {
    const FIELDS: [&str; 6] = [
        "error_rate",
        "error_status",
        "added_latency_ms",
        "slowdown",
        "hang",
        "drop_events",
    ];
    let param = match &e {
        kvmesh_config::ConfigError::Invalid { key, .. } => FIELDS
            .into_iter()
            .find(|f| key.strip_prefix("faults.") == Some(f)),
        _ => None,
    };
    match param {
        Some(p) => ApiError::invalid_param(p, e.to_string()),
        None => ApiError::bad_request("invalid_value", e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_merges_and_bad_values_change_nothing() {
        let mut f = Faults::new(FaultConfig::default(), 1);
        f.apply(br#"{"error_rate":0.5,"error_status":429}"#)
            .expect("valid");
        f.apply(br#"{"slowdown":5.0}"#).expect("valid");
        assert_eq!(f.current().error_rate, 0.5);
        assert_eq!(f.current().error_status, 429);
        assert_eq!(f.current().slowdown, 5.0);
        let before = f.current().clone();
        assert!(f.apply(br#"{"error_rate":2.0}"#).is_err());
        assert!(f.apply(br#"{"eror_rate":0.1}"#).is_err());
        assert!(f.apply(b"not json").is_err());
        assert_eq!(f.current(), &before);
        f.clear();
        assert_eq!(f.current(), &FaultConfig::default());
    }

    #[test]
    fn dice_follow_the_rate() {
        let mut f = Faults::new(FaultConfig::default(), 7);
        assert!((0..1000).all(|_| f.roll_error().is_none()));
        f.apply(br#"{"error_rate":0.3}"#).expect("valid");
        let n = (0..10_000).filter(|_| f.roll_error().is_some()).count();
        assert!((2_700..3_300).contains(&n), "{n}");
    }
}
