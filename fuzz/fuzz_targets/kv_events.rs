//! The KV-event decoder on arbitrary bytes: a payload alone, and the bytes cut into the three
//! frames of a ZMQ message; never panics, never beyond the limits.
#![no_main]
use kvmesh_kvevents::{DecodeLimits, decode_batch, decode_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = DecodeLimits::default();
    if let Ok(b) = decode_batch(data, &limits) {
        assert!(b.batch.events.len() <= limits.max_events_per_batch);
    }
    if data.len() >= 2 {
        let (a, rest) = data.split_at((data[0] as usize).min(data.len() - 1));
        let (s, p) = rest.split_at(rest.len().min(8));
        let _ = decode_frame(&[a, s, p], &limits);
    }
});
