//! The mesh envelope decoder on arbitrary bytes: never panics; what decodes re-encodes and
//! decodes to the same envelope.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(env) = kvmesh_state::wire::decode(data, 0x6b76_6d65_7368) {
        let again = kvmesh_state::wire::encode(&kvmesh_state::wire::Envelope::V1(env.clone()))
            .expect("a decoded envelope encodes");
        let back = kvmesh_state::wire::decode(&again, 0x6b76_6d65_7368).expect("round trip");
        assert_eq!(back, env);
    }
});
