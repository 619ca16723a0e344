//! The IO thread: device ↔ host copies. Writes queued between two polls are merged into one
//! batch; loads are merged when the engine starts them before a forward pass
//! ([`IoQueue::start_loads`]) and copied layer by layer, advancing a [`LoadProgress`] the
//! forward waits on. Loads go before writes (a forward is waiting for them), also between the
//! layers of a long write.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use kv_pool::{Ack, AckOutcome, OpId, Slot, TierOpKind};

use super::copy::{copy_layer, segments, Direction};
use super::Shared;

/// One queued write or load: its slots, or why they were refused.
#[derive(Debug)]
pub(crate) struct CopyOp {
    pub(crate) op: OpId,
    pub(crate) device: Vec<Slot>,
    pub(crate) host: Vec<Slot>,
    /// Why the slots were refused (nothing is copied; the ack is `Failed`).
    pub(crate) invalid: Option<String>,
}

/// How far a started batch of loads has got: layers `0..done` are on the device (SGLang's
/// `LayerDoneCounter`).
#[derive(Debug)]
pub(crate) struct LoadProgress {
    state: Mutex<(usize, Option<String>)>,
    advanced: Condvar,
    /// Layers of the store (a wait for a layer past the last waits for the whole batch).
    layers: usize,
}

impl LoadProgress {
    fn new(layers: usize) -> Self {
        LoadProgress {
            state: Mutex::new((0, None)),
            advanced: Condvar::new(),
            layers,
        }
    }

    fn lock(&self) -> MutexGuard<'_, (usize, Option<String>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks layers `0..done` loaded.
    fn advance(&self, done: usize) {
        self.lock().0 = done;
        self.advanced.notify_all();
    }

    /// Marks the batch failed: every waiter gets `Err(reason)`.
    fn fail(&self, reason: String) {
        self.lock().1.get_or_insert(reason);
        self.advanced.notify_all();
    }

    /// Blocks until `layer` is loaded (`Ok`) or the batch failed (`Err`).
    pub(crate) fn wait_layer(&self, layer: usize) -> Result<(), String> {
        let layer = layer.min(self.layers.saturating_sub(1));
        let mut s = self.lock();
        loop {
            if let Some(reason) = &s.1 {
                return Err(reason.clone());
            }
            if s.0 > layer {
                return Ok(());
            }
            s = self.advanced.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[derive(Debug, Default)]
struct IoState {
    /// Writes queued since the last flush (merged into one batch by `flush_writes`).
    pending_writes: Vec<CopyOp>,
    /// Loads queued since the last `start_loads`.
    pending_loads: Vec<CopyOp>,
    writes: VecDeque<Vec<CopyOp>>,
    loads: VecDeque<(Vec<CopyOp>, Arc<LoadProgress>)>,
    /// The last load batch started and not finished: a forward pass waits on it (batches run
    /// in order, so it finishing layer `i` means every earlier batch finished).
    latest_load: Option<Arc<LoadProgress>>,
    shutdown: bool,
    /// The thread has returned: it touches device memory no more.
    stopped: bool,
}

/// The IO thread's queues, shared by the controller, the engine's handle and the thread.
#[derive(Debug, Default)]
pub(crate) struct IoQueue {
    state: Mutex<IoState>,
    work: Condvar,
}

impl IoQueue {
    fn lock(&self) -> MutexGuard<'_, IoState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a write; after shutdown (no thread would run it) hands it back.
    pub(crate) fn push_write(&self, op: CopyOp) -> Result<(), CopyOp> {
        let mut s = self.lock();
        if s.shutdown {
            return Err(op);
        }
        s.pending_writes.push(op);
        Ok(())
    }

    /// Queues a load; after shutdown (no thread would run it) hands it back.
    pub(crate) fn push_load(&self, op: CopyOp) -> Result<(), CopyOp> {
        let mut s = self.lock();
        if s.shutdown {
            return Err(op);
        }
        s.pending_loads.push(op);
        Ok(())
    }

    /// Hands the writes queued since the last flush to the thread as one batch.
    pub(crate) fn flush_writes(&self) {
        let mut s = self.lock();
        if !s.pending_writes.is_empty() {
            let batch = std::mem::take(&mut s.pending_writes);
            s.writes.push_back(batch);
            drop(s);
            self.work.notify_one();
        }
    }

    /// Hands the loads queued since the last call to the thread as one batch; returns the
    /// progress of the last unfinished batch (this one, or an earlier one still copying).
    pub(crate) fn start_loads(&self, layers: usize) -> Option<Arc<LoadProgress>> {
        let mut s = self.lock();
        // After shutdown no thread would run a new batch (and no controller queues one).
        if !s.pending_loads.is_empty() && !s.shutdown {
            let batch = std::mem::take(&mut s.pending_loads);
            let progress = Arc::new(LoadProgress::new(layers));
            s.loads.push_back((batch, progress.clone()));
            s.latest_load = Some(progress);
            self.work.notify_one();
        }
        s.latest_load.clone()
    }

    /// Asks the thread to finish the queued batches and stop.
    pub(crate) fn shut_down(&self) {
        self.lock().shutdown = true;
        self.work.notify_all();
    }

    /// Shuts the thread down and blocks until it has returned (after the queued batches), so
    /// the device memory may be freed. Operations queued later are never run.
    pub(crate) fn stop_and_wait(&self) {
        let mut s = self.lock();
        s.shutdown = true;
        self.work.notify_all();
        while !s.stopped {
            s = self.work.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn pop_load(&self) -> Option<(Vec<CopyOp>, Arc<LoadProgress>)> {
        self.lock().loads.pop_front()
    }
}

/// The IO thread's body: runs load batches first, then write batches, until shut down and
/// drained.
pub(crate) fn run(shared: &Shared) {
    loop {
        let mut s = shared.io.lock();
        loop {
            if let Some(load) = s.loads.pop_front() {
                drop(s);
                run_loads(shared, load.0, &load.1);
                break;
            }
            if let Some(writes) = s.writes.pop_front() {
                drop(s);
                run_writes(shared, writes);
                break;
            }
            if s.shutdown {
                s.stopped = true;
                drop(s);
                shared.io.work.notify_all();
                return;
            }
            s = shared.io.work.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The valid ops' slots, concatenated.
fn concat(ops: &[CopyOp]) -> (Vec<Slot>, Vec<Slot>) {
    let valid = ops.iter().filter(|o| o.invalid.is_none());
    let device = valid
        .clone()
        .flat_map(|o| o.device.iter().copied())
        .collect();
    let host = valid.flat_map(|o| o.host.iter().copied()).collect();
    (device, host)
}

/// Acks every op of a batch in queue order: `Done`, or `Failed` for an op refused at queue
/// time or, when the copy failed (`failure`), for every op.
fn ack_all(shared: &Shared, ops: Vec<CopyOp>, kind: TierOpKind, failure: Option<&str>) {
    for o in ops {
        let outcome = match (o.invalid, failure) {
            (Some(reason), _) => AckOutcome::Failed(reason),
            (None, Some(reason)) => AckOutcome::Failed(reason.to_string()),
            (None, None) => AckOutcome::Done,
        };
        shared.acks.complete(Ack {
            op: o.op,
            kind,
            outcome,
        });
    }
}

/// Copies every layer of a batch's valid ops in `dir`, calling `before(layer)` before each
/// layer and `after(layer)` after it. Stops at the first layer whose copy failed (a device
/// error through a `DeviceKvRows` handle) and returns why.
fn copy_batch(
    shared: &Shared,
    ops: &[CopyOp],
    dir: Direction,
    mut before: impl FnMut(usize),
    mut after: impl FnMut(usize),
) -> Result<(), String> {
    let (device, host) = concat(ops);
    let segs = segments(&shared.pool, &device, &host);
    for layer in 0..shared.layers {
        before(layer);
        // A panic in a copy (a bug) fails the batch like a device error instead of killing the
        // thread, which would leave every waiter on its acks and layers blocked for good.
        let copied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `Shared::device` is the store's live memory (`HiCacheController::new`'s
            // contract) or a handle, and the slots were validated at queue time. The cache
            // keeps a load's device slots unread until this layer's progress and its host
            // slots unwritten until its ack; a write's device slots unwritten and its host
            // slots unread until its ack.
            unsafe { copy_layer(&shared.device, &shared.pool, layer, &segs, dir) }
        }));
        copied
            .unwrap_or_else(|panic| Err(format!("the copy panicked: {}", panic_text(&*panic))))?;
        after(layer);
    }
    Ok(())
}

/// A panic's message, when it has one.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

fn run_loads(shared: &Shared, ops: Vec<CopyOp>, progress: &Arc<LoadProgress>) {
    if let Some(bad) = ops.iter().find_map(|o| o.invalid.as_ref()) {
        // The pass that depends on this batch cannot use it; the valid loads still land.
        progress.fail(format!("a load-back of this pass was refused: {bad}"));
    }
    let result = copy_batch(
        shared,
        &ops,
        Direction::ToDevice,
        |_| {},
        |layer| progress.advance(layer + 1),
    );
    {
        let mut s = shared.io.lock();
        if s.latest_load
            .as_ref()
            .is_some_and(|l| Arc::ptr_eq(l, progress))
        {
            s.latest_load = None;
        }
    }
    let failure = result.err();
    // The acks go before the pass hears of a failure, so the scheduler's next poll takes
    // them (and the cache takes the failed chain off the device) before any later admission.
    ack_all(shared, ops, TierOpKind::Load, failure.as_deref());
    if let Some(reason) = failure {
        progress.fail(format!("a load-back of this pass failed: {reason}"));
    }
}

fn run_writes(shared: &Shared, ops: Vec<CopyOp>) {
    // A forward pass may be waiting for loads: they go first, even between the layers of a
    // write (the two never share slots).
    let loads_first = |_| {
        while let Some((batch, progress)) = shared.io.pop_load() {
            run_loads(shared, batch, &progress);
        }
    };
    let result = copy_batch(shared, &ops, Direction::ToHost, loads_first, |_| {});
    ack_all(shared, ops, TierOpKind::Write, result.err().as_deref());
}
