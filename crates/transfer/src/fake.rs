//! The `fake` backend: validates everything as a real backend does, then completes every batch
//! `Done` without moving a byte (SGLang's `FakeKVSender` / `FakeKVReceiver`, used to warm up a
//! server without a peer).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use async_trait::async_trait;
use kv_pool::MemoryRegion;

use crate::batch::{BatchState, BatchTable};
use crate::engine::{
    BackendKind, BatchId, BatchStatus, RegionId, RemoteRegion, SegmentDesc, SegmentId,
    TransferBlock, TransferEngine,
};
use crate::error::{Result, TransferError};
use crate::region::{check_backend, check_blocks, RegionTable};

/// The `fake` engine. Its segment's endpoint is `"fake"`; regions have `base: 0`.
#[derive(Debug, Default)]
pub struct FakeEngine {
    regions: RwLock<RegionTable>,
    segments: Mutex<HashMap<u64, Vec<RemoteRegion>>>,
    next_segment: AtomicU64,
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
            regions: table
                .all()
                .iter()
                .map(|r| RemoteRegion {
                    len: r.len,
                    base: 0,
                })
                .collect(),
            metadata: Vec::new(),
        }
    }

    async fn open_segment(&self, desc: &SegmentDesc) -> Result<SegmentId> {
        check_backend(desc, BackendKind::Fake)?;
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed) + 1;
        self.segments
            .lock()
            .unwrap()
            .insert(id, desc.regions.clone());
        Ok(SegmentId(id))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        match self.segments.lock().unwrap().remove(&segment.0) {
            Some(_) => Ok(()),
            None => Err(TransferError::UnknownSegment(segment)),
        }
    }

    async fn submit(&self, segment: SegmentId, blocks: Vec<TransferBlock>) -> Result<BatchId> {
        let remote = self
            .segments
            .lock()
            .unwrap()
            .get(&segment.0)
            .cloned()
            .ok_or(TransferError::UnknownSegment(segment))?;
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
