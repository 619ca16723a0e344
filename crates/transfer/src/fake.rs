//! The `fake` backend: validates everything as a real backend does, then completes every batch
//! `Done` without moving a byte (SGLang's `FakeKVSender` / `FakeKVReceiver`, used to warm up a
//! server without a peer).

use std::sync::RwLock;

use async_trait::async_trait;
use kv_pool::MemoryRegion;

use crate::batch::{BatchState, BatchTable};
use crate::engine::{
    BackendKind, BatchId, BatchStatus, RegionId, RemoteRegion, SegmentDesc, SegmentId,
    TransferBlock, TransferEngine,
};
use crate::error::Result;
use crate::region::{check_backend, check_blocks, RegionTable};
use crate::segments::SegmentTable;

/// The `fake` engine. Its segment's endpoint is `"fake"`; regions have `base: 0`.
#[derive(Debug, Default)]
pub struct FakeEngine {
    regions: RwLock<RegionTable>,
    segments: SegmentTable<Vec<RemoteRegion>>,
    batches: BatchTable,
}

impl FakeEngine {
    /// A new engine with nothing registered.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl TransferEngine for FakeEngine {
    fn kind(&self) -> BackendKind {
        BackendKind::Fake
    }

    unsafe fn register(&self, regions: &[MemoryRegion]) -> Result<Vec<RegionId>> {
        let mut table = self.regions.write().unwrap();
        let new = table.check_new(regions)?;
        Ok(table.push(new))
    }

    fn segment(&self) -> SegmentDesc {
        let table = self.regions.read().unwrap();
        SegmentDesc {
            backend: BackendKind::Fake,
            endpoint: "fake".into(),
            regions: table.remote(),
            metadata: Vec::new(),
        }
    }

    async fn open_segment(&self, desc: &SegmentDesc) -> Result<SegmentId> {
        check_backend(desc, BackendKind::Fake)?;
        Ok(self.segments.insert(desc.regions.clone()))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.segments.remove(segment).map(drop)
    }

    async fn submit(&self, segment: SegmentId, blocks: Vec<TransferBlock>) -> Result<BatchId> {
        let remote = self.segments.get(segment)?;
        check_blocks(&self.regions.read().unwrap(), &remote, &blocks)?;
        Ok(self.batches.insert(BatchState::new(0)))
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        self.batches.poll(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        self.batches.wait(batch).await
    }
}
