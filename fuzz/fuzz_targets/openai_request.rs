//! The OpenAI request parser on arbitrary bytes: chat and completion bodies parse leniently
//! and validate strictly without panicking.
#![no_main]
use kvmesh_openai::{ChatCompletionRequest, CompletionRequest, parse_body};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = parse_body::<ChatCompletionRequest>(data) {
        let _ = r.validate();
    }
    if let Ok(r) = parse_body::<CompletionRequest>(data) {
        let _ = r.validate();
    }
});
