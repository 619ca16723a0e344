//! The [`TransferEngine`] trait and the values it speaks in.
//!
//! The flow (Mooncake's transfer engine, SGLang's `KVManager` underneath):
//!
//! 1. Both sides [`register`](TransferEngine::register) their KV store's
//!    [`MemoryRegion`]s; region ids are positions in the engine's registration order.
//! 2. The receiving side hands its [`segment`](TransferEngine::segment) descriptor to the sender
//!    (in the PD handshake); the sender [`open_segment`](TransferEngine::open_segment)s it.
//! 3. The sender [`submit`](TransferEngine::submit)s batches of [`TransferBlock`]s (all layers
//!    of a chunk in one batch) and [`poll`](TransferEngine::poll)s or
//!    [`wait`](TransferEngine::wait)s for each.

use std::fmt;

use async_trait::async_trait;
use kv_pool::MemoryRegion;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TransferError};
pub use crate::ids::{BackendKind, BatchId, RegionId, SegmentId};

/// One registered region as a peer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Bytes in the region.
    pub len: u64,
    /// Backend-defined base: the region's offset in the shared mapping (`shm`), its address in
    /// the peer (`nixl`), 0 where unused (`tcp`, `fake`). `u64::MAX`: not writable by peers.
    pub base: u64,
}

/// What a peer needs to write into an engine's registered memory. It travels in the PD
/// handshake (JSON), so it is plain data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDesc {
    /// The backend that wrote it; another backend refuses it with [`TransferError::BadSegment`].
    pub backend: BackendKind,
    /// Where to reach it: `ip:port` of the receive listener (`tcp`), the path of the shared
    /// mapping (`shm`), the agent name (`nixl`).
    pub endpoint: String,
    /// The registered regions, by [`RegionId`].
    pub regions: Vec<RemoteRegion>,
    /// Backend metadata (NIXL's agent metadata), empty where unused.
    #[serde(default)]
    pub metadata: Vec<u8>,
}

/// One write: `len` bytes from a local region to a region of the destination segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TransferBlock {
    /// A region this engine registered.
    pub src_region: RegionId,
    /// Byte offset in it.
    pub src_offset: u64,
    /// A region of the destination segment.
    pub dst_region: RegionId,
    /// Byte offset in it.
    pub dst_offset: u64,
    /// Bytes to move (0 is allowed and moves nothing).
    pub len: u64,
}

/// Where a batch stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchStatus {
    /// Still moving.
    Pending,
    /// Every byte landed intact.
    Done,
    /// It failed; some bytes may have landed, none may be used.
    Failed(TransferError),
}

/// Moves bytes from this process's registered memory into a peer's (SGLang's `KVManager`
/// transfer layer, Mooncake's `TransferEngine`). Object safe: the engine holds an
/// `Arc<dyn TransferEngine>`.
#[async_trait]
pub trait TransferEngine: Send + Sync + fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// Registers local memory, to send from and to receive into; returns the new regions' ids
    /// (consecutive, after those registered before). Validated whole: a null address, a zero
    /// length or an overlap is [`TransferError::BadRegion`] and nothing is registered.
    ///
    /// # Safety
    /// Each region's `addr..addr + len_bytes` must be valid for reads and writes for as long as
    /// this engine lives, and its owner must not read or write the bytes a batch names while
    /// that batch is in flight (on either side).
    unsafe fn register(&self, regions: &[MemoryRegion]) -> Result<Vec<RegionId>>;

    /// This engine's own descriptor, for peers to open (its registered regions so far).
    fn segment(&self) -> SegmentDesc;

    /// Opens a peer's segment for writing (connects, maps). Opening the same descriptor twice
    /// gives two independent ids.
    async fn open_segment(&self, desc: &SegmentDesc) -> Result<SegmentId>;

    /// Closes a segment; its pending batches fail. Unknown ids are
    /// [`TransferError::UnknownSegment`].
    async fn close_segment(&self, segment: SegmentId) -> Result<()>;

    /// Submits a batch of writes into `segment`. Validated whole before any byte moves (regions
    /// known, blocks in bounds); returns at once, the bytes move in the background.
    async fn submit(&self, segment: SegmentId, blocks: Vec<TransferBlock>) -> Result<BatchId>;

    /// A batch's status, without waiting. A batch stays known until it is reaped by a `poll`
    /// or `wait` that returns `Done` or `Failed`; after that its id is unknown.
    fn poll(&self, batch: BatchId) -> Result<BatchStatus>;

    /// Waits until the batch is `Done` (`Ok`) or `Failed` (its error), and reaps it.
    async fn wait(&self, batch: BatchId) -> Result<()>;
}
