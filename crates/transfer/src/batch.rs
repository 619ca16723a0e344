//! Batch bookkeeping shared by the backends: a batch's completion state, and the table of
//! submitted batches that `poll` and `wait` read and reap.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::engine::{BatchId, BatchStatus};
use crate::error::{Result, TransferError};

/// One batch's state: `remaining` units of work (frames, copy chunks) and the outcome, set once
/// (the first failure wins; `Ok` only when every unit completed).
#[derive(Debug)]
pub(crate) struct BatchState {
    remaining: AtomicU64,
    outcome: watch::Sender<Option<Result<()>>>,
}

impl BatchState {
    /// A batch of `units` units of work; with none it is done at once.
    pub fn new(units: u64) -> Arc<Self> {
        let state = Arc::new(BatchState {
            remaining: AtomicU64::new(units),
            outcome: watch::channel(None).0,
        });
        if units == 0 {
            state.settle(Ok(()));
        }
        state
    }

    /// Sets the outcome unless one is set; returns whether this call set it.
    fn settle(&self, outcome: Result<()>) -> bool {
        self.outcome.send_if_modified(|o| {
            if o.is_some() {
                return false;
            }
            *o = Some(outcome);
            true
        })
    }

    /// One unit landed intact; the last one makes the batch `Done` (unless it failed).
    pub fn complete(&self, units: u64) {
        if self.remaining.fetch_sub(units, Ordering::AcqRel) == units {
            self.settle(Ok(()));
        }
    }

    /// Fails the batch (no-op when it already has an outcome).
    pub fn fail(&self, e: TransferError) {
        self.settle(Err(e));
    }

    /// Whether the batch has an outcome (work for it can be skipped).
    pub fn is_settled(&self) -> bool {
        self.outcome.borrow().is_some()
    }

    /// The batch's status now.
    pub fn status(&self) -> BatchStatus {
        match &*self.outcome.borrow() {
            None => BatchStatus::Pending,
            Some(Ok(())) => BatchStatus::Done,
            Some(Err(e)) => BatchStatus::Failed(e.clone()),
        }
    }

    /// Waits for the outcome.
    pub async fn settled(&self) -> Result<()> {
        let mut rx = self.outcome.subscribe();
        let outcome = rx
            .wait_for(Option::is_some)
            .await
            .expect("the sender lives in self");
        outcome.clone().expect("waited for Some")
    }
}

/// The submitted batches of one engine, until reaped.
#[derive(Debug, Default)]
pub(crate) struct BatchTable {
    next: AtomicU64,
    live: Mutex<HashMap<u64, Arc<BatchState>>>,
}

impl BatchTable {
    /// Adds a batch; returns its id (ids start at 1 and are never reused).
    pub fn insert(&self, state: Arc<BatchState>) -> BatchId {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.live.lock().unwrap().insert(id, state);
        BatchId(id)
    }

    fn get(&self, id: BatchId) -> Result<Arc<BatchState>> {
        self.live
            .lock()
            .unwrap()
            .get(&id.0)
            .cloned()
            .ok_or(TransferError::UnknownBatch(id))
    }

    /// `TransferEngine::poll`: the status; a final one reaps the batch.
    pub fn poll(&self, id: BatchId) -> Result<BatchStatus> {
        let status = self.get(id)?.status();
        if status != BatchStatus::Pending {
            self.live.lock().unwrap().remove(&id.0);
        }
        Ok(status)
    }

    /// `TransferEngine::wait`: the outcome, then reaps the batch.
    pub async fn wait(&self, id: BatchId) -> Result<()> {
        let state = self.get(id)?;
        let outcome = state.settled().await;
        self.live.lock().unwrap().remove(&id.0);
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn first_outcome_wins_and_final_polls_reap() {
        let t = BatchTable::default();
        let s = BatchState::new(2);
        let id = t.insert(s.clone());
        assert_eq!(t.poll(id), Ok(BatchStatus::Pending));
        s.complete(1);
        s.fail(TransferError::BadSegment("x".into()));
        s.complete(1);
        assert!(matches!(t.poll(id), Ok(BatchStatus::Failed(_))));
        assert_eq!(t.poll(id), Err(TransferError::UnknownBatch(id)));
        let empty = t.insert(BatchState::new(0));
        assert_eq!(t.wait(empty).await, Ok(()));
        assert_eq!(t.wait(empty).await, Err(TransferError::UnknownBatch(empty)));
    }
}
