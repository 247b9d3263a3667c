//! Every change to the prefix index goes through one sink: versioned op batches from an
//! engine's KV events, speculative marks from routing decisions, and clears of an engine
//! known to have restarted. The local index is one sink; the mesh's delta buffer will be
//! another, fed the same calls ([`Tee`]); [`RecordingSink`] is the mock beside the trait.

use crate::id::EngineId;
use crate::index::{IndexOp, OpVersion, PrefixIndex, Slot};
use crate::keys::BlockKey;

/// The engine a change is for: its local index slot and its cluster-stable id (the index
/// uses the slot, a delta buffer the id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Target {
    /// The engine's slot in this router's index.
    pub slot: Slot,
    /// The engine's cluster-stable id.
    pub engine: EngineId,
}

/// Where index changes go.
pub trait IndexSink {
    /// A versioned batch of the engine's ops (KV events). True when it was new (applied).
    fn apply_batch(&mut self, t: Target, version: OpVersion, ops: &[IndexOp]) -> bool;
    /// A speculative mark: the engine holds `keys` until `expiry_us` (join = max expiry).
    /// `known`: how many leading keys the caller already found the engine holding (what a
    /// replica of the index elsewhere knows too: only the rest is news for it).
    fn mark(&mut self, t: Target, keys: &[BlockKey], known: usize, expiry_us: u64, now_us: u64);
    /// Everything known of the engine is void (a restart seen outside its events).
    fn clear(&mut self, t: Target);
}

impl<T: IndexSink + ?Sized> IndexSink for &mut T {
    fn apply_batch(&mut self, t: Target, version: OpVersion, ops: &[IndexOp]) -> bool {
        (**self).apply_batch(t, version, ops)
    }

    fn mark(&mut self, t: Target, keys: &[BlockKey], known: usize, expiry_us: u64, now_us: u64) {
        (**self).mark(t, keys, known, expiry_us, now_us)
    }

    fn clear(&mut self, t: Target) {
        (**self).clear(t)
    }
}

impl IndexSink for PrefixIndex {
    fn apply_batch(&mut self, t: Target, version: OpVersion, ops: &[IndexOp]) -> bool {
        PrefixIndex::apply_batch(self, t.slot, version, ops)
    }

    fn mark(&mut self, t: Target, keys: &[BlockKey], _known: usize, expiry_us: u64, now_us: u64) {
        self.insert_speculative(t.slot, keys, expiry_us, now_us);
    }

    fn clear(&mut self, t: Target) {
        self.clear_engine(t.slot);
    }
}

/// One call a [`RecordingSink`] received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkCall {
    /// [`IndexSink::apply_batch`].
    Batch {
        /// The engine.
        target: Target,
        /// The batch's version.
        version: OpVersion,
        /// Its ops.
        ops: Vec<IndexOp>,
    },
    /// [`IndexSink::mark`].
    Mark {
        /// The engine.
        target: Target,
        /// The marked keys.
        keys: Vec<BlockKey>,
        /// Until when.
        expiry_us: u64,
    },
    /// [`IndexSink::clear`].
    Clear {
        /// The engine.
        target: Target,
    },
}

/// A sink that records every call (tests; the shape of what a delta buffer receives).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordingSink {
    /// The calls, in order.
    pub calls: Vec<SinkCall>,
}

impl IndexSink for RecordingSink {
    fn apply_batch(&mut self, target: Target, version: OpVersion, ops: &[IndexOp]) -> bool {
        self.calls.push(SinkCall::Batch {
            target,
            version,
            ops: ops.to_vec(),
        });
        true
    }

    fn mark(
        &mut self,
        target: Target,
        keys: &[BlockKey],
        _known: usize,
        expiry_us: u64,
        _now_us: u64,
    ) {
        self.calls.push(SinkCall::Mark {
            target,
            keys: keys.to_vec(),
            expiry_us,
        });
    }

    fn clear(&mut self, target: Target) {
        self.calls.push(SinkCall::Clear { target });
    }
}

/// Feeds both sinks the same calls (the local index and a delta buffer); a batch counts as
/// new when the first sink applied it.
#[derive(Debug, Clone, Default)]
pub struct Tee<A, B>(pub A, pub B);

impl<A: IndexSink, B: IndexSink> IndexSink for Tee<A, B> {
    fn apply_batch(&mut self, t: Target, version: OpVersion, ops: &[IndexOp]) -> bool {
        let new = self.0.apply_batch(t, version, ops);
        if new {
            self.1.apply_batch(t, version, ops);
        }
        new
    }

    fn mark(&mut self, t: Target, keys: &[BlockKey], known: usize, expiry_us: u64, now_us: u64) {
        self.0.mark(t, keys, known, expiry_us, now_us);
        self.1.mark(t, keys, known, expiry_us, now_us);
    }

    fn clear(&mut self, t: Target) {
        self.0.clear(t);
        self.1.clear(t);
    }
}
