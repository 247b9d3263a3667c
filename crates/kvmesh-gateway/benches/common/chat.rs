//! Multi-turn chat bodies shared by `benches/prepare.rs` and `examples/prepare_cost.rs`, so
//! that the criterion timings and the callgrind instruction counts measure the same bodies.

use serde_json::{Value, json};

pub const PROSE: &str = "Large language model inference is dominated by the prefill of long prompts. \
A router that knows which engine already holds the KV cache for a prefix can send the request \
there and skip most of that work, but only if it computes exactly the same token ids as the \
engine does, block by block. ";

pub const CODE: &str = r#"
```rust
fn route(blocks: &[u64], engines: &[Engine]) -> Option<usize> {
    engines.iter().enumerate().max_by_key(|(_, e)| e.matched(blocks)).map(|(i, _)| i)
}
```
"#;

/// A multi-turn conversation of about `target` bytes of message text (user messages of up to
/// 2,500 bytes of prose and code, short assistant answers), ending with an assistant message.
pub fn conversation(target: usize) -> Vec<Value> {
    let mut messages =
        vec![json!({"role": "system", "content": "You are a senior Rust reviewer."})];
    let mut size = 40;
    let mut turn = 0;
    while size < target {
        let want = (target - size).clamp(200, 2500);
        let mut user = format!("Review {turn}: ");
        while user.len() < want {
            user.push_str(PROSE);
            user.push_str(CODE);
        }
        user.truncate(want);
        let assistant = format!("Turn {turn}: looks good, but consider {}", &PROSE[..80]);
        size += user.len() + assistant.len() + 60;
        messages.push(json!({"role": "user", "content": user}));
        messages.push(json!({"role": "assistant", "content": assistant}));
        turn += 1;
    }
    messages
}

/// A streamed chat request of `messages` and a last user message `last`.
pub fn body(messages: &[Value], last: &str) -> Vec<u8> {
    let mut m = messages.to_vec();
    m.push(json!({"role": "user", "content": last}));
    serde_json::to_vec(&json!({"model": "m", "messages": m, "stream": true})).expect("json")
}
