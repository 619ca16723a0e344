//! The seam between a hierarchical prefix cache, which decides what lives on which tier, and
//! the cache controller that moves the bytes (SGLang's `HiCacheController`).
//!
//! The cache (radix-cache's tree with a host tier) only keeps metadata: which device slots and
//! which host slots hold a node's pages. Whenever bytes must move it calls a
//! [`CacheController`]: device → host backups ([`write`](CacheController::write)), host → device
//! load-backs ([`load`](CacheController::load)), and, when an L3 store is attached, host → L3
//! backups ([`backup`](CacheController::backup)), L3 existence queries
//! ([`query`](CacheController::query)) and L3 → host prefetches
//! ([`prefetch`](CacheController::prefetch)). Every call only queues: the controller does the
//! work off the scheduler thread and reports completions through
//! [`poll_acks`](CacheController::poll_acks), which the cache calls once per scheduler step.
//!
//! Slots on both sides are whole pages (`P` consecutive slots starting at a multiple of `P`,
//! in the same order on both sides); host slots index the host pool, which has its own page
//! allocator (a [`crate::PagedAllocator`] over the host pool's pages). A controller never
//! allocates or frees: the cache owns both allocators and keeps the pages an operation names
//! allocated (and their nodes locked) until its acknowledgement.
//!
//! The engine's controller copies on an IO thread; tests use a controller that completes every
//! operation at the next poll (`kv_pool::testing::ImmediateController`, feature `testing`).
//!
//! The model's forward waits per layer for queued load-backs through [`LayerWait`], so layer
//! `i + 1` loads while layer `i` computes (SGLang's `LayerDoneCounter`).
//!
//! A controller reaches the device store in one of two ways: through its memory regions, when
//! they are host addresses (the CPU backend's `HostKvStore`), or through a [`DeviceKvRows`]
//! handle, which a store whose memory the host cannot address (wgpu's buffers) hands out so
//! another thread can copy rows while the store's owner runs forward passes.

use std::fmt;

use crate::error::Result;
use crate::ids::Slot;
use crate::layout::{KvBuffer, KvLayout};

/// A storage (L3) page key: the chained SHA-256 digest of the page's tokens after every page
/// before it (SGLang's page hash chain, seeded by the namespace), as radix-cache computes it.
/// The storage backend adds the model and layout to it, so two models never share a key.
pub type PageKey = [u8; 32];

/// An operation queued on a [`CacheController`]: unique for the controller's life, increasing
/// in queue order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op {}", self.0)
    }
}

/// The kind of a queued operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierOpKind {
    /// Device → host (write-through, write-back eviction, retraction to host).
    Write,
    /// Host → device (load-back).
    Load,
    /// Host → L3 storage.
    Backup,
    /// Which leading keys the L3 store holds.
    Query,
    /// L3 → host.
    Prefetch,
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckOutcome {
    /// Every byte moved (write, load, backup).
    Done,
    /// A query: the number of leading keys the store holds (0 when it is unreachable).
    Found(usize),
    /// A prefetch: the number of leading pages that landed in host memory (the rest did not,
    /// e.g. the store failed half-way or the prefetch was cancelled).
    Fetched(usize),
    /// The operation failed; nothing may be assumed about the destination. For L3 operations
    /// this is a miss, never a failed request; for device ↔ host copies it is a bug report.
    Failed(String),
}

/// One completed operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    /// The operation.
    pub op: OpId,
    /// Its kind.
    pub kind: TierOpKind,
    /// How it ended.
    pub outcome: AckOutcome,
}

/// Moves KV pages between the device store, the host pool and an L3 store on behalf of a
/// hierarchical cache (SGLang's `HiCacheController`). See the [module docs](self).
///
/// Contract: every queued operation is acknowledged exactly once by
/// [`poll_acks`](Self::poll_acks) (after [`wait`](Self::wait), at the next poll at the latest);
/// operations of one kind complete in the order they were queued. The caller keeps every slot
/// an operation names allocated, and does not write the source slots, until its ack.
pub trait CacheController: Send {
    /// Queues a device → host copy: `host[i]` gets `device[i]`'s row in every layer.
    /// Writes queued between two polls are merged into one copy.
    fn write(&mut self, device: &[Slot], host: &[Slot]) -> OpId;
    /// Queues a host → device copy: `device[i]` gets `host[i]`'s row in every layer. The copy
    /// starts with the next forward pass, layer by layer ([`LayerWait`]).
    fn load(&mut self, host: &[Slot], device: &[Slot]) -> OpId;
    /// Blocks until `op` has completed (write-back eviction waits for its copy before the
    /// device slots are freed). Its ack is still delivered by the next poll.
    fn wait(&mut self, op: OpId);
    /// The operations completed since the last call, each exactly once.
    fn poll_acks(&mut self) -> Vec<Ack>;
    /// Whether an L3 store is attached (otherwise the L3 calls are never made).
    fn storage_enabled(&self) -> bool {
        false
    }
    /// Queues a host → L3 copy of the pages at `host` (one key per page, `host.len() / P`
    /// keys). The host pages stay allocated until the ack.
    fn backup(&mut self, host: &[Slot], keys: &[PageKey]) -> OpId;
    /// Queues an existence query: the ack is [`AckOutcome::Found`] with the number of leading
    /// `keys` the store holds.
    fn query(&mut self, keys: &[PageKey]) -> OpId;
    /// Queues an L3 → host copy of the pages `keys` into `host` (one page per key); the ack is
    /// [`AckOutcome::Fetched`] with the number of leading pages that landed.
    fn prefetch(&mut self, keys: &[PageKey], host: &[Slot]) -> OpId;
    /// Leading pages of a prefetch that have landed so far (SGLang's completed-token counter).
    fn prefetch_progress(&self, op: OpId) -> usize;
    /// Asks a prefetch to stop early; its ack then reports what landed.
    fn cancel_prefetch(&mut self, op: OpId);
}

/// What a forward pass waits on, layer by layer, while queued load-backs land (SGLang's
/// `LayerDoneCounter`): the model calls [`wait_layer`](Self::wait_layer)`(i)` before it reads
/// layer `i` of the KV store.
pub trait LayerWait: Sync {
    /// Blocks until every load-back this pass depends on has written layer `layer`. `Err`
    /// (a failed copy) fails the pass.
    fn wait_layer(&self, layer: usize) -> std::result::Result<(), String>;
}

/// A device KV store's rows as a cache controller's IO thread copies them, concurrently with
/// the store's owner (the model runner). A store whose memory the host cannot address (wgpu's
/// buffers) hands one out; the copies go through the device's own queue, so they are ordered
/// with the owner's work: a read sees every write the owner submitted before it, and a row
/// written here is seen by every pass the owner submits after the call returned.
///
/// Rows are raw bytes in the store's row format (`layout().shape.row_bytes(buffer)` bytes each),
/// as [`crate::KvStore::read_raw`] / [`crate::KvStore::write_raw`] move them. The caller keeps
/// the rules a [`CacheController`] keeps: nobody writes the rows a read names, or reads the
/// rows a write names, until the copy is acknowledged.
pub trait DeviceKvRows: Send + Sync {
    /// The store's layout.
    fn layout(&self) -> &KvLayout;
    /// Copies the rows of `slots` in `layer`'s `buffer` into `out` (row `i` for `slots[i]`).
    /// Validated as `read_raw` (layer, buffer, slots in range, `out`'s length); blocks until
    /// the bytes are on the host.
    fn read_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> Result<()>;
    /// Writes `bytes` (row `i` for `slots[i]`) into `layer`'s `buffer`. Validated as
    /// `write_raw`; returns once the copy is queued on the device ahead of any later work.
    fn write_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()>;
}
