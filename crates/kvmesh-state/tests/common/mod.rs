//! What the property tests share: router ids and engine records.

use kvmesh_state::{EngineRecord, NodeId};

/// Router `i`'s id.
pub fn node(i: impl std::fmt::Display) -> NodeId {
    NodeId::from_name(&format!("router-{i}"))
}

/// Engine `e`'s record at weight `w` (thousandths).
pub fn record(e: u64, w: u32) -> EngineRecord {
    EngineRecord {
        url: format!("http://127.0.0.1:{}", 8100 + e),
        weight_milli: w,
        kv_events: String::new(),
        kv_replay: String::new(),
        models: vec!["m".into()],
    }
}
