//! The storage thread: host → L3 backups, L3 existence queries and L3 → host prefetches, in
//! queue order, in batches of [`BATCH_PAGES`] pages per storage call (SGLang's
//! `storage_batch_size`). A prefetch advances a progress counter after each batch and stops
//! at a miss, a failure or a cancel. A store that fails is a miss, never an error upward.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use kv_pool::{Ack, AckOutcome, OpId, Page, PageKey, TierOpKind};

use super::Shared;
use crate::storage::HiCacheStorage;

/// Pages per storage call (SGLang's `storage_batch_size`, 128).
pub const BATCH_PAGES: usize = 128;

/// A prefetch's shared state: pages landed so far, and the cancel flag.
#[derive(Debug, Default)]
pub(crate) struct PrefetchState {
    pub(crate) landed: AtomicUsize,
    pub(crate) cancel: AtomicBool,
}

/// One queued L3 operation.
#[derive(Debug)]
pub(crate) enum StorageTask {
    /// Host pages → L3 under `keys`.
    Backup {
        op: OpId,
        pages: Vec<Page>,
        keys: Vec<PageKey>,
    },
    /// How many leading `keys` L3 holds.
    Query { op: OpId, keys: Vec<PageKey> },
    /// L3 pages `keys` → host `pages`.
    Prefetch {
        op: OpId,
        keys: Vec<PageKey>,
        pages: Vec<Page>,
        state: Arc<PrefetchState>,
    },
    /// Refused at queue time (acked `Failed` in its turn).
    Refused {
        op: OpId,
        kind: TierOpKind,
        reason: String,
    },
}

#[derive(Debug, Default)]
struct QueueState {
    tasks: VecDeque<StorageTask>,
    shutdown: bool,
}

/// The storage thread's queue.
#[derive(Debug, Default)]
pub(crate) struct StorageQueue {
    state: Mutex<QueueState>,
    work: Condvar,
}

impl StorageQueue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn push(&self, task: StorageTask) {
        self.lock().tasks.push_back(task);
        self.work.notify_one();
    }

    /// Asks the thread to stop: queued tasks are acked `Failed` without touching the store,
    /// a running prefetch stops after its batch.
    pub(crate) fn shut_down(&self) {
        self.lock().shutdown = true;
        self.work.notify_all();
    }

    fn is_shut_down(&self) -> bool {
        self.lock().shutdown
    }
}

/// The storage thread's body.
pub(crate) fn run(shared: &Shared, storage: &dyn HiCacheStorage) {
    let pb = shared.pool.layout().page_bytes();
    let mut staging: Vec<u8> = Vec::new();
    loop {
        let task = {
            let mut s = shared.storage.lock();
            loop {
                if let Some(t) = s.tasks.pop_front() {
                    break (t, s.shutdown);
                }
                if s.shutdown {
                    return;
                }
                s = shared
                    .storage
                    .work
                    .wait(s)
                    .unwrap_or_else(|e| e.into_inner());
            }
        };
        let ack = match task {
            (t, true) => refuse(t, "the cache controller was dropped"),
            (StorageTask::Backup { op, pages, keys }, false) => Ack {
                op,
                kind: TierOpKind::Backup,
                outcome: backup(shared, storage, &pages, &keys, pb, &mut staging),
            },
            (StorageTask::Query { op, keys }, false) => Ack {
                op,
                kind: TierOpKind::Query,
                outcome: AckOutcome::Found(query(storage, &keys)),
            },
            (
                StorageTask::Prefetch {
                    op,
                    keys,
                    pages,
                    state,
                },
                false,
            ) => {
                prefetch(shared, storage, &keys, &pages, &state, pb, &mut staging);
                Ack {
                    op,
                    kind: TierOpKind::Prefetch,
                    outcome: AckOutcome::Fetched(state.landed.load(Ordering::Acquire)),
                }
            }
            (StorageTask::Refused { op, kind, reason }, false) => Ack {
                op,
                kind,
                outcome: AckOutcome::Failed(reason),
            },
        };
        shared.acks.complete(ack);
    }
}

/// The ack of a task that will not run.
fn refuse(task: StorageTask, reason: &str) -> Ack {
    let (op, kind) = match task {
        StorageTask::Backup { op, .. } => (op, TierOpKind::Backup),
        StorageTask::Query { op, .. } => (op, TierOpKind::Query),
        StorageTask::Prefetch { op, .. } => (op, TierOpKind::Prefetch),
        StorageTask::Refused { op, kind, .. } => (op, kind),
    };
    let outcome = match kind {
        TierOpKind::Query => AckOutcome::Found(0),
        TierOpKind::Prefetch => AckOutcome::Fetched(0),
        _ => AckOutcome::Failed(reason.to_string()),
    };
    Ack { op, kind, outcome }
}

/// `staging` resized to `n` bytes (kept between calls).
fn stage(staging: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if staging.len() < n {
        staging.resize(n, 0);
    }
    &mut staging[..n]
}

fn backup(
    shared: &Shared,
    storage: &dyn HiCacheStorage,
    pages: &[Page],
    keys: &[PageKey],
    pb: usize,
    staging: &mut Vec<u8>,
) -> AckOutcome {
    for (pages, keys) in pages.chunks(BATCH_PAGES).zip(keys.chunks(BATCH_PAGES)) {
        let buf = stage(staging, pages.len() * pb);
        // The cache keeps these host pages allocated and unwritten until the ack.
        if let Err(e) = shared.pool.read_pages(pages, buf) {
            return AckOutcome::Failed(e.to_string());
        }
        if let Err(e) = storage.batch_set(keys, buf) {
            return AckOutcome::Failed(e.to_string());
        }
    }
    AckOutcome::Done
}

fn query(storage: &dyn HiCacheStorage, keys: &[PageKey]) -> usize {
    let mut found = 0;
    for chunk in keys.chunks(BATCH_PAGES) {
        let n = storage.batch_exists(chunk).min(chunk.len());
        found += n;
        if n < chunk.len() {
            break;
        }
    }
    found
}

fn prefetch(
    shared: &Shared,
    storage: &dyn HiCacheStorage,
    keys: &[PageKey],
    pages: &[Page],
    state: &PrefetchState,
    pb: usize,
    staging: &mut Vec<u8>,
) {
    for (keys, pages) in keys.chunks(BATCH_PAGES).zip(pages.chunks(BATCH_PAGES)) {
        if state.cancel.load(Ordering::Acquire) || shared.storage.is_shut_down() {
            return;
        }
        let buf = stage(staging, keys.len() * pb);
        let n = storage.batch_get(keys, buf).unwrap_or(0).min(keys.len());
        if n > 0 {
            // SAFETY: the prefetch's host pages were allocated for it by the cache, which
            // neither reads nor writes them until the ack; no other operation names them.
            let landed = unsafe { shared.pool.write_pages_shared(&pages[..n], &buf[..n * pb]) };
            if landed.is_err() {
                return;
            }
            state.landed.fetch_add(n, Ordering::AcqRel);
        }
        if n < keys.len() {
            return;
        }
    }
}
