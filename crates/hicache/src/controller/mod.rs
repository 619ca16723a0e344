//! The cache controller (SGLang's `HiCacheController`, `managers/cache_controller.py`):
//! [`HiCacheController`] moves KV pages between the device store, the host pool and an L3
//! store for radix-cache's tree, which calls it through [`kv_pool::CacheController`].
//!
//! - Device ↔ host on the IO thread (module `io`): writes queued between two polls merged into
//!   one batch; loads merged when the engine calls [`ControllerHandle::start_loads`] before a
//!   forward pass (or, if nobody did, at the next poll) and copied layer by layer, the pass
//!   waiting per layer on the returned [`LoadGate`]. Over a store in host memory (the CPU
//!   backend; [`HiCacheController::new`]) the copies are raw `copy_nonoverlapping`s between
//!   the store's memory regions and the [`kv_pool::HostKvPool`], one per run of slots
//!   consecutive on both sides; over any other store (wgpu;
//!   [`HiCacheController::with_device_rows`]) they go through the store's
//!   [`kv_pool::DeviceKvRows`] handle, one read or write per layer and buffer, ordered with
//!   the forward passes by the device's queue (module `copy`).
//! - Host ↔ L3 on the storage thread (module `storage_ops`): backups, queries and
//!   prefetches in batches of [`BATCH_PAGES`] pages, a prefetch's progress readable and
//!   cancellable while it runs.
//! - Acks (module `acks`): every operation is acknowledged exactly once by `poll_acks`; ops of
//!   one kind complete in queue order. Refused input (slots out of range, lengths that differ)
//!   is a `Failed` ack in its turn, never a panic.
//!
//! Dropping the controller finishes the queued copies, stops the storage thread (queued L3
//! operations are acked as failed or missed) and joins both threads.

mod acks;
mod copy;
mod gate;
mod io;
mod storage_ops;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use kv_pool::{
    Ack, AckOutcome, CacheController, DeviceKvRows, HostKvPool, KvLayout, KvPoolError, KvStore,
    OpId, Page, PageKey, Slot, TierOpKind,
};

pub use gate::{ControllerHandle, LoadGate};
pub use storage_ops::BATCH_PAGES;

use acks::AckSink;
use copy::{DeviceRegions, DeviceSide};
use io::{CopyOp, IoQueue};
use storage_ops::{PrefetchState, StorageQueue, StorageTask};

use crate::storage::HiCacheStorage;

/// Why a controller could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The host pool or the store refused something.
    #[error("kv pool: {0}")]
    Pool(#[from] KvPoolError),
    /// The store, the host pool and the storage do not fit together (shape, page size, page
    /// bytes, memory regions).
    #[error("cache controller: {0}")]
    Mismatch(String),
    /// A thread could not be started.
    #[error("could not start the cache controller's {thread} thread: {source}")]
    Thread {
        /// `io` or `storage`.
        thread: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Why a copy queued after `ControllerHandle::stop_io` fails (no thread would run it, and a
/// `wait` for it must not block).
const IO_STOPPED: &str = "the cache controller's IO thread has stopped (the KV store is gone)";

/// What the controller's threads share.
pub(crate) struct Shared {
    pub(crate) pool: HostKvPool,
    pub(crate) device: DeviceSide,
    pub(crate) layers: usize,
    pub(crate) acks: AckSink,
    pub(crate) io: IoQueue,
    pub(crate) storage: StorageQueue,
}

/// SGLang's `HiCacheController`: over a device store whose memory the host addresses (the CPU
/// backend's `HostKvStore`, [`new`](Self::new)) or one reached through a
/// [`DeviceKvRows`] handle (wgpu, [`with_device_rows`](Self::with_device_rows)). See the
/// [module docs](self).
pub struct HiCacheController {
    shared: Arc<Shared>,
    storage: Option<Arc<dyn HiCacheStorage>>,
    next: u64,
    /// Prefetches not yet acknowledged by a poll.
    prefetches: HashMap<OpId, Arc<PrefetchState>>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for HiCacheController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiCacheController")
            .field("host_pool", &self.shared.pool)
            .field("storage", &self.storage.as_ref().map(|s| s.name()))
            .field("next_op", &self.next)
            .finish_non_exhaustive()
    }
}

impl HiCacheController {
    /// A controller copying between `store`'s memory and `pool`, and between `pool` and
    /// `storage` when given; starts its IO thread (and storage thread). The pool must hold the
    /// store's shape at its page size, and the storage's `page_bytes` must be the layout's
    /// ([`ControllerError::Mismatch`]).
    ///
    /// # Safety
    /// The same registration contract as a transfer engine's: `store.memory_regions()` must be
    /// host addresses (a `HostKvStore`'s, the CPU backend) that stay valid for reads and writes
    /// for the controller's whole life (until its `Drop` returns), and the store's owner must
    /// not touch the rows an operation names while it is in flight: a write's device rows are
    /// not written until its ack, a load's device rows are neither read nor written before
    /// the pass's [`LoadGate`] released their layer (or the load's ack).
    pub unsafe fn new(
        store: &dyn KvStore,
        pool: HostKvPool,
        storage: Option<Arc<dyn HiCacheStorage>>,
    ) -> Result<Self, ControllerError> {
        let layout = *store.layout();
        Self::check_fit(&layout, &pool, storage.as_deref())?;
        let device = DeviceSide::Regions(DeviceRegions::new(store)?);
        Self::start(device, &layout, pool, storage)
    }

    /// A controller copying between the store behind `rows` and `pool` (and between `pool` and
    /// `storage` when given), for a store whose memory the host cannot address (wgpu's
    /// [`DeviceKvRows`] handle, whose copies are ordered with the store owner's forward passes
    /// by the device's queue); starts its IO thread (and storage thread). The same fit rules
    /// as [`new`](Self::new). The store's owner keeps the operation contract on rows (a
    /// write's device rows unwritten until its ack; a load's device rows not read before the
    /// pass's [`LoadGate`] released their layer); nothing here can break memory safety.
    pub fn with_device_rows(
        rows: Arc<dyn DeviceKvRows>,
        pool: HostKvPool,
        storage: Option<Arc<dyn HiCacheStorage>>,
    ) -> Result<Self, ControllerError> {
        let layout = *rows.layout();
        Self::check_fit(&layout, &pool, storage.as_deref())?;
        Self::start(DeviceSide::Rows(rows), &layout, pool, storage)
    }

    /// The pool must hold the store's shape at its page size; the storage's `page_bytes` must
    /// be the layout's.
    fn check_fit(
        d: &KvLayout,
        pool: &HostKvPool,
        storage: Option<&dyn HiCacheStorage>,
    ) -> Result<(), ControllerError> {
        let h = pool.layout();
        if d.shape != h.shape || d.page_size != h.page_size {
            return Err(ControllerError::Mismatch(format!(
                "the device store holds {} at page size {}, the host pool {} at page size {}",
                d.shape, d.page_size, h.shape, h.page_size
            )));
        }
        if let Some(s) = storage {
            if s.page_bytes() != h.page_bytes() {
                return Err(ControllerError::Mismatch(format!(
                    "the {} storage moves pages of {} bytes, the KV layout's pages are {} bytes",
                    s.name(),
                    s.page_bytes(),
                    h.page_bytes()
                )));
            }
        }
        Ok(())
    }

    /// Shares `device` and `pool` with a new IO thread (and a storage thread).
    fn start(
        device: DeviceSide,
        d: &KvLayout,
        pool: HostKvPool,
        storage: Option<Arc<dyn HiCacheStorage>>,
    ) -> Result<Self, ControllerError> {
        let shared = Arc::new(Shared {
            layers: d.shape.layers as usize,
            device,
            pool,
            acks: AckSink::default(),
            io: IoQueue::default(),
            storage: StorageQueue::default(),
        });
        let mut me = HiCacheController {
            shared: shared.clone(),
            storage: storage.clone(),
            next: 0,
            prefetches: HashMap::new(),
            threads: Vec::new(),
        };
        let io = std::thread::Builder::new()
            .name("hicache-io".into())
            .spawn({
                let shared = shared.clone();
                move || io::run(&shared)
            })
            .map_err(|source| ControllerError::Thread {
                thread: "io",
                source,
            })?;
        me.threads.push(io);
        if let Some(storage) = storage {
            let th = std::thread::Builder::new()
                .name("hicache-storage".into())
                .spawn(move || storage_ops::run(&shared, storage.as_ref()))
                .map_err(|source| ControllerError::Thread {
                    thread: "storage",
                    source,
                })?;
            me.threads.push(th);
        }
        Ok(me)
    }

    /// The handle the engine keeps to start load-backs before each forward pass.
    pub fn handle(&self) -> ControllerHandle {
        ControllerHandle {
            shared: self.shared.clone(),
        }
    }

    /// The host pool. Its rows are only meaningful once the acks of the operations that write
    /// them were polled (or waited for).
    pub fn host_pool(&self) -> &HostKvPool {
        &self.shared.pool
    }

    /// Operations queued and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.shared.acks.outstanding()
    }

    fn next_op(&mut self) -> OpId {
        let op = OpId(self.next);
        self.next += 1;
        self.shared.acks.register(op);
        op
    }

    /// Checks a write's or load's slots: equal lengths, in range on both sides.
    fn check_copy(&self, device: &[Slot], host: &[Slot]) -> Option<String> {
        if device.len() != host.len() {
            return Some(format!(
                "{} device slots for {} host slots",
                device.len(),
                host.len()
            ));
        }
        let rows = self.shared.device.rows();
        if let Some(s) = device.iter().find(|s| s.index() >= rows) {
            return Some(format!("device {s} is outside the store's {rows} rows"));
        }
        let rows = self.shared.pool.layout().rows();
        if let Some(s) = host.iter().find(|s| s.index() >= rows) {
            return Some(format!("host {s} is outside the host pool's {rows} rows"));
        }
        None
    }

    fn copy_op(&mut self, device: &[Slot], host: &[Slot]) -> CopyOp {
        let invalid = self.check_copy(device, host);
        CopyOp {
            op: self.next_op(),
            device: device.to_vec(),
            host: host.to_vec(),
            invalid,
        }
    }

    /// `host` as whole pages, one per key (`host.len() == keys.len() × P`, each page `P`
    /// consecutive slots from a multiple of `P`, within the pool).
    fn pages_of(&self, host: &[Slot], keys: usize) -> Result<Vec<Page>, String> {
        let layout = self.shared.pool.layout();
        let p = layout.page_size as usize;
        if host.len() != keys * p {
            return Err(format!(
                "{} host slots for {keys} pages of {p} slots",
                host.len()
            ));
        }
        let mut pages = Vec::with_capacity(keys);
        for chunk in host.chunks(p) {
            let first = chunk[0];
            let page = first.index() / p;
            let whole = first.index() % p == 0
                && chunk
                    .iter()
                    .enumerate()
                    .all(|(i, s)| s.index() == first.index() + i);
            if !whole || page == 0 || page > layout.pages() {
                return Err(format!(
                    "host slots from {first} are not one allocatable page of {p} slots"
                ));
            }
            pages.push(Page(page as u32));
        }
        Ok(pages)
    }

    /// Completes an L3 operation at once (no storage attached).
    fn complete_now(&self, op: OpId, kind: TierOpKind, outcome: AckOutcome) -> OpId {
        self.shared.acks.complete(Ack { op, kind, outcome });
        op
    }
}

impl CacheController for HiCacheController {
    fn write(&mut self, device: &[Slot], host: &[Slot]) -> OpId {
        let op = self.copy_op(device, host);
        let id = op.op;
        if self.shared.io.push_write(op).is_err() {
            self.complete_now(id, TierOpKind::Write, AckOutcome::Failed(IO_STOPPED.into()));
        }
        id
    }

    fn load(&mut self, host: &[Slot], device: &[Slot]) -> OpId {
        let op = self.copy_op(device, host);
        let id = op.op;
        if self.shared.io.push_load(op).is_err() {
            self.complete_now(id, TierOpKind::Load, AckOutcome::Failed(IO_STOPPED.into()));
        }
        id
    }

    fn wait(&mut self, op: OpId) {
        self.shared.io.flush_writes();
        self.shared.io.start_loads(self.shared.layers);
        self.shared.acks.wait(op);
    }

    fn poll_acks(&mut self) -> Vec<Ack> {
        self.shared.io.flush_writes();
        self.shared.io.start_loads(self.shared.layers);
        let acks = self.shared.acks.drain();
        for a in &acks {
            if a.kind == TierOpKind::Prefetch {
                self.prefetches.remove(&a.op);
            }
        }
        acks
    }

    fn storage_enabled(&self) -> bool {
        self.storage.is_some()
    }

    fn backup(&mut self, host: &[Slot], keys: &[PageKey]) -> OpId {
        let op = self.next_op();
        if self.storage.is_none() {
            let reason = "no L3 storage is attached".to_string();
            return self.complete_now(op, TierOpKind::Backup, AckOutcome::Failed(reason));
        }
        let task = match self.pages_of(host, keys.len()) {
            Ok(pages) => StorageTask::Backup {
                op,
                pages,
                keys: keys.to_vec(),
            },
            Err(reason) => StorageTask::Refused {
                op,
                kind: TierOpKind::Backup,
                reason,
            },
        };
        self.shared.storage.push(task);
        op
    }

    fn query(&mut self, keys: &[PageKey]) -> OpId {
        let op = self.next_op();
        if self.storage.is_none() {
            return self.complete_now(op, TierOpKind::Query, AckOutcome::Found(0));
        }
        self.shared.storage.push(StorageTask::Query {
            op,
            keys: keys.to_vec(),
        });
        op
    }

    fn prefetch(&mut self, keys: &[PageKey], host: &[Slot]) -> OpId {
        let op = self.next_op();
        if self.storage.is_none() {
            return self.complete_now(op, TierOpKind::Prefetch, AckOutcome::Fetched(0));
        }
        let task = match self.pages_of(host, keys.len()) {
            Ok(pages) => {
                let state = Arc::new(PrefetchState::default());
                self.prefetches.insert(op, state.clone());
                StorageTask::Prefetch {
                    op,
                    keys: keys.to_vec(),
                    pages,
                    state,
                }
            }
            Err(reason) => StorageTask::Refused {
                op,
                kind: TierOpKind::Prefetch,
                reason,
            },
        };
        self.shared.storage.push(task);
        op
    }

    fn prefetch_progress(&self, op: OpId) -> usize {
        self.prefetches
            .get(&op)
            .map_or(0, |s| s.landed.load(Ordering::Acquire))
    }

    fn cancel_prefetch(&mut self, op: OpId) {
        if let Some(s) = self.prefetches.get(&op) {
            s.cancel.store(true, Ordering::Release);
        }
    }
}

impl Drop for HiCacheController {
    fn drop(&mut self) {
        // Loads nobody started still land (their pages are the cache's until the ack).
        self.shared.io.flush_writes();
        self.shared.io.start_loads(self.shared.layers);
        self.shared.io.shut_down();
        self.shared.storage.shut_down();
        for t in self.threads.drain(..) {
            // A thread that panicked has nothing left to clean up.
            let _ = t.join();
        }
    }
}
