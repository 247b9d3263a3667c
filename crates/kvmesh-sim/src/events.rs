//! The KV-event side of the simulator: turns the engine's events into vLLM batches and hands
//! them to the ZMQ publisher (non-blocking: the engine thread never waits on the network).

use crate::SimError;
use crate::metrics::SimMetrics;
use kvmesh_config::{KvEventsConfig, KvEventsFormat};
use kvmesh_engine::EngineEvent;
use kvmesh_kvevents::{
    BlockHash, EventBatch, KvEvent, MsgValue, Publisher, PublisherConfig, WireEncoding,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Publishes one batch per engine step, as vLLM does.
pub struct EventSink {
    publisher: Publisher,
    encoding: WireEncoding,
    int_hashes: bool,
    drop_events: Arc<AtomicBool>,
    metrics: Arc<SimMetrics>,
}

impl EventSink {
    /// The bound PUB endpoint and replay endpoint (port 0 in the config = an OS-assigned one).
    pub fn endpoints(&self) -> (String, Option<String>) {
        (
            self.publisher.endpoint().to_string(),
            self.publisher.replay_endpoint().map(str::to_string),
        )
    }

    /// Binds the PUB socket (and the replay socket when configured).
    pub async fn start(
        cfg: &KvEventsConfig,
        drop_events: Arc<AtomicBool>,
        metrics: Arc<SimMetrics>,
    ) -> Result<EventSink, SimError> {
        let mut pc = PublisherConfig::new(cfg.endpoint.clone());
        pc.replay_endpoint = (!cfg.replay_endpoint.is_empty()).then(|| cfg.replay_endpoint.clone());
        pc.topic = cfg.topic.clone();
        pc.buffer_len = cfg.replay_buffer;
        let publisher = Publisher::start(pc)
            .await
            .map_err(|e| SimError::Events(e.to_string()))?;
        tracing::info!(endpoint = publisher.endpoint(), replay = ?publisher.replay_endpoint(), "KV events publisher bound");
        Ok(EventSink {
            publisher,
            encoding: match cfg.format {
                KvEventsFormat::Array => WireEncoding::Array,
                KvEventsFormat::Map => WireEncoding::Map,
            },
            int_hashes: cfg.int_block_hashes,
            drop_events,
            metrics,
        })
    }

    /// Publishes one step's events as one batch, stamped with the wall clock (Unix seconds)
    /// as vLLM stamps them.
    pub fn publish(&self, events: Vec<EngineEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let events = events
            .into_iter()
            .map(|e| to_kv_event(e, self.int_hashes))
            .collect();
        let batch = EventBatch {
            ts,
            events,
            data_parallel_rank: None,
        };
        let res = if self.drop_events.load(Ordering::Relaxed) {
            // The seq is consumed and the batch kept for replay, but never sent: subscribers
            // see a gap, as when a PUB socket drops messages.
            self.metrics.event_batch_dropped();
            self.publisher.publish_dropped(&batch, self.encoding)
        } else {
            self.publisher.publish(&batch, self.encoding)
        };
        if let Err(e) = res {
            // Accepted events are never lost silently: count and log.
            self.metrics.event_batch_dropped();
            tracing::warn!(error = %e, "KV-event batch not published");
        }
    }

    /// The engine restarted: seq back to 0, replay buffer cleared.
    pub fn restarted(&self) {
        if let Err(e) = self.publisher.reset_seq() {
            tracing::warn!(error = %e, "KV-event seq reset failed");
        }
    }
}

/// One engine event in vLLM's form, as the simulator publishes it: hashes as ints (vLLM's
/// default) or raw bytes, medium "GPU", the LoRA name, and a salted chain's root block carrying
/// `(salt,)` as its extra key (one `extra_keys` entry per block, as vLLM sends them).
pub fn to_kv_event(e: EngineEvent, int_hashes: bool) -> KvEvent {
    let hash = |h: u64| {
        if int_hashes {
            BlockHash::Int(h)
        } else {
            BlockHash::Bytes(h.to_be_bytes().to_vec())
        }
    };
    match e {
        EngineEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
            cache_salt,
        } => {
            let blocks = block_hashes.len();
            let parent_block_hash_is_none = parent_block_hash.is_none();
            let mut ev = KvEvent::stored(
                block_hashes.into_iter().map(hash).collect(),
                parent_block_hash.map(hash),
                token_ids,
                block_size,
            );
            if let KvEvent::BlockStored {
                lora_name: l,
                extra_keys,
                ..
            } = &mut ev
            {
                // vLLM's per-block extra keys: the LoRA name on every block, the cache salt
                // after it on a chain's first block.
                if lora_name.is_some() || cache_salt.is_some() {
                    let keys = (0..blocks)
                        .map(|j| {
                            let mut k: Vec<MsgValue> =
                                lora_name.iter().map(|n| MsgValue::str(n.clone())).collect();
                            if j == 0
                                && parent_block_hash_is_none
                                && let Some(salt) = &cache_salt
                            {
                                k.push(MsgValue::str(salt.clone()));
                            }
                            if k.is_empty() {
                                MsgValue::Nil
                            } else {
                                MsgValue::Array(k)
                            }
                        })
                        .collect();
                    *extra_keys = Some(keys);
                }
                *l = lora_name;
            }
            ev
        }
        EngineEvent::BlockRemoved { block_hashes } => {
            KvEvent::removed(block_hashes.into_iter().map(hash).collect())
        }
        EngineEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
    }
}
