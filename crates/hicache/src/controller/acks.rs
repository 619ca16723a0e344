//! [`AckSink`]: where the controller's threads put completed operations until the cache polls
//! them, and what `wait` blocks on.

use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex, MutexGuard};

use kv_pool::{Ack, OpId};

/// Operations queued and not yet completed, and completed acks not yet polled.
#[derive(Debug, Default)]
struct AckState {
    /// Completed, in completion order (per kind: queue order), not yet polled.
    ready: Vec<Ack>,
    /// Queued and not yet completed.
    outstanding: BTreeSet<OpId>,
}

/// Completed operations, each delivered exactly once by [`drain`](Self::drain).
#[derive(Debug, Default)]
pub(crate) struct AckSink {
    state: Mutex<AckState>,
    done: Condvar,
}

impl AckSink {
    fn lock(&self) -> MutexGuard<'_, AckState> {
        // A poisoned lock means a controller thread panicked mid-update of plain lists; the
        // lists themselves are still consistent (each update is one push or remove).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a newly queued operation.
    pub(crate) fn register(&self, op: OpId) {
        self.lock().outstanding.insert(op);
    }

    /// Records a completed operation and wakes `wait`ers.
    pub(crate) fn complete(&self, ack: Ack) {
        let mut s = self.lock();
        s.outstanding.remove(&ack.op);
        s.ready.push(ack);
        drop(s);
        self.done.notify_all();
    }

    /// Every ack completed since the last call.
    pub(crate) fn drain(&self) -> Vec<Ack> {
        std::mem::take(&mut self.lock().ready)
    }

    /// Blocks until `op` is not outstanding (completed, or never queued).
    pub(crate) fn wait(&self, op: OpId) {
        let mut s = self.lock();
        while s.outstanding.contains(&op) {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Operations queued and not completed.
    pub(crate) fn outstanding(&self) -> usize {
        self.lock().outstanding.len()
    }
}
