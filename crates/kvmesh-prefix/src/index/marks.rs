//! Taking speculative marks back: an engine's all (it restarted), or one decision's (the
//! engine refused the request).

use super::{NIL, PrefixIndex, Slot};
use crate::keys::BlockKey;

impl PrefixIndex {
    /// Drops every speculative mark of `engine` and keeps its confirmed copies (what its KV
    /// events said): the engine restarted, and what routing decisions expected of the old
    /// process is void, while its events (or the feed of them) carry the restart themselves.
    pub fn clear_marks(&mut self, engine: Slot) {
        let Some(mut i) = self.slot(engine).map(|s| s.head) else {
            return;
        };
        while i != NIL {
            let next = self.entries[i as usize].next;
            self.drop_mark(i);
            i = next;
        }
    }

    /// Takes back one decision's mark: of `keys` on `engine`, the marks expiring at exactly
    /// `expiry_us` (the decision's; a later decision's mark expires later and stays). The
    /// engine refused the request, so it will not compute the blocks. An earlier mark of one
    /// of `keys` that this one extended goes with it: the caller passes the keys the decision
    /// did not find the engine holding.
    pub fn unmark(&mut self, engine: Slot, keys: &[BlockKey], expiry_us: u64) {
        if expiry_us == 0 || self.slot(engine).is_none() {
            return;
        }
        for key in keys {
            if let Some(i) = self.find(engine, key.0)
                && self.entries[i as usize].expiry == expiry_us
            {
                self.drop_mark(i);
            }
        }
    }

    /// Entry `i` loses its speculative mark; without a confirmed copy it goes.
    fn drop_mark(&mut self, i: u32) {
        let e = self.entries[i as usize];
        if e.expiry == 0 {
            return;
        }
        if e.count == 0 {
            self.free_entry(i);
        } else {
            self.entries[i as usize].expiry = 0;
            self.n_speculative -= 1;
            self.engines[e.engine as usize].speculative -= 1;
        }
    }
}
