//! The `shm` backend: two processes on one host map the same memory, and the sender copies
//! straight into the receiver's slots.
//!
//! - The receiver's KV store lives in a [`SharedMemory`] (`HostKvStore::with_memory`).
//!   `register` gives each region inside a live `SharedMemory` of this process
//!   `RemoteRegion { base: its offset in the mapping }` (the first mapping registered is the
//!   engine's; it advertises one); other regions (a sender's source memory, memory in another
//!   mapping) get `base: u64::MAX` and cannot be written by peers. The segment's endpoint is the
//!   mapping's path, kept valid by a descriptor the engine holds.
//! - `open_segment` maps the peer's path; `submit` copies (memcpy) each block from local
//!   memory into the mapping: batches up to 1 MiB inline; up to 16 MiB on the submitting
//!   thread in `block_in_place` on a multi-thread runtime (done when `submit` returns), else on
//!   a blocking thread; larger ones in 4 MiB pieces over up to `streams` blocking threads (one
//!   per 16 MiB of the batch).
//! - A peer that died leaves its mapping valid (the memory lives until the last unmap), so
//!   writes into it succeed harmlessly; the protocol layer notices the dead peer.

mod memory;

pub use memory::SharedMemory;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use kv_pool::MemoryRegion;

use crate::batch::{BatchState, BatchTable};
use crate::config::TransferConfig;
use crate::engine::{
    BackendKind, BatchId, BatchStatus, RegionId, RemoteRegion, SegmentDesc, SegmentId,
    TransferBlock, TransferEngine,
};
use crate::error::{Result, TransferError};
use crate::region::{check_backend, check_blocks, RegionTable};
use crate::segments::SegmentTable;
use memory::Mapping;

/// Batches up to this many bytes are copied inline in `submit`.
const INLINE_MAX: u64 = 1 << 20;
/// Bytes of a batch per copy thread.
const PER_THREAD: u64 = 16 << 20;
/// Large batches are copied in pieces of at most this many bytes.
const PIECE: u64 = 4 << 20;

/// The `shm` engine (see the module docs).
#[derive(Debug)]
pub struct ShmEngine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    copy_threads: usize,
    regions: RwLock<Registered>,
    segments: SegmentTable<Segment>,
    batches: BatchTable,
}

/// Registered memory and where it lies in the shared mapping.
#[derive(Debug, Default)]
struct Registered {
    table: RegionTable,
    /// Per region: its offset in the shared mapping, or `u64::MAX`.
    bases: Vec<u64>,
    /// The shared mapping's base address, the descriptor kept open for peers, and its path.
    shared: Option<(usize, OwnedFd, String)>,
}

/// An opened peer segment.
#[derive(Debug)]
struct Segment {
    map: Arc<Mapping>,
    regions: Vec<RemoteRegion>,
    /// Batches being copied on blocking threads, failed when the segment closes.
    inflight: Mutex<Vec<Arc<BatchState>>>,
}

/// One piece of a copy: `len` bytes from address `src` to byte `dst` of the mapping.
#[derive(Debug, Clone, Copy)]
struct Piece {
    src: usize,
    dst: usize,
    len: usize,
}

impl ShmEngine {
    /// A new engine with nothing registered.
    pub fn new(cfg: &TransferConfig) -> Self {
        ShmEngine {
            inner: Arc::new(Inner {
                copy_threads: cfg.streams.max(1),
                regions: RwLock::new(Registered::default()),
                segments: SegmentTable::default(),
                batches: BatchTable::default(),
            }),
        }
    }
}

impl Drop for ShmEngine {
    fn drop(&mut self) {
        // Waits for the piece being copied, if any; no copy starts after this.
        self.inner.regions.write().unwrap().table.closed = true;
        for seg in self.inner.segments.drain() {
            fail_all(&seg, "the sending engine was dropped");
        }
    }
}

fn fail_all(seg: &Segment, reason: &str) {
    for b in seg.inflight.lock().unwrap().drain(..) {
        b.fail(TransferError::PeerUnreachable {
            peer: "shared memory".into(),
            reason: reason.into(),
        });
    }
}

/// Copies pieces under the region lock; `false` once the engine has dropped.
fn copy_pieces(inner: &Inner, map: &Mapping, pieces: &[Piece]) -> bool {
    let guard = inner.regions.read().unwrap();
    if guard.table.closed {
        return false;
    }
    for p in pieces {
        // SAFETY: `src..src + len` lies in a region this engine registered (checked at submit)
        // and `register`'s contract keeps it valid while the engine lives (checked above under
        // the lock `Drop` takes); `dst..dst + len` lies in the mapping (region bounds checked at
        // open and submit) which `map` keeps mapped. The two never overlap: `map` is a mapping
        // of its own (`Mapping::open`), no registered region lies in it.
        unsafe { std::ptr::copy_nonoverlapping(p.src as *const u8, map.ptr.add(p.dst), p.len) };
    }
    true
}

#[async_trait]
impl TransferEngine for ShmEngine {
    fn kind(&self) -> BackendKind {
        BackendKind::Shm
    }

    unsafe fn register(&self, regions: &[MemoryRegion]) -> Result<Vec<RegionId>> {
        let mut g = self.inner.regions.write().unwrap();
        let new = g.table.check_new(regions)?;
        let mut base = g.shared.as_ref().map(|s| s.0);
        let mut dup = None;
        let mut bases = Vec::with_capacity(new.len());
        for r in &new {
            match memory::containing(r.addr, r.len as usize) {
                Some((b, _)) if base.is_none_or(|seen| seen == b) => {
                    if base.is_none() {
                        dup = Some(memory::dup_of(b)?);
                        base = Some(b);
                    }
                    bases.push((r.addr - b) as u64);
                }
                _ => bases.push(u64::MAX),
            }
        }
        if let (Some((fd, path)), Some(b)) = (dup, base) {
            g.shared = Some((b, fd, path));
        }
        g.bases.extend(bases);
        Ok(g.table.push(new))
    }

    fn segment(&self) -> SegmentDesc {
        let g = self.inner.regions.read().unwrap();
        SegmentDesc {
            backend: BackendKind::Shm,
            endpoint: g.shared.as_ref().map(|s| s.2.clone()).unwrap_or_default(),
            regions: g
                .table
                .all()
                .iter()
                .zip(&g.bases)
                .map(|(r, &base)| RemoteRegion { len: r.len, base })
                .collect(),
            metadata: Vec::new(),
        }
    }

    async fn open_segment(&self, desc: &SegmentDesc) -> Result<SegmentId> {
        check_backend(desc, BackendKind::Shm)?;
        if desc.endpoint.is_empty() {
            return Err(TransferError::BadSegment(
                "the peer registered no shared memory (its endpoint is empty)".into(),
            ));
        }
        let map = Mapping::open(&desc.endpoint)?;
        for (i, r) in desc.regions.iter().enumerate() {
            if r.base != u64::MAX && r.base.checked_add(r.len).is_none_or(|e| e > map.len as u64) {
                return Err(TransferError::BadSegment(format!(
                    "region {i} ({} bytes at {}) is outside the {} bytes of {}",
                    r.len, r.base, map.len, desc.endpoint
                )));
            }
        }
        Ok(self.inner.segments.insert(Segment {
            map: Arc::new(map),
            regions: desc.regions.clone(),
            inflight: Mutex::new(Vec::new()),
        }))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let seg = self.inner.segments.remove(segment)?;
        fail_all(&seg, "the segment was closed");
        Ok(())
    }

    async fn submit(&self, segment: SegmentId, blocks: Vec<TransferBlock>) -> Result<BatchId> {
        let seg = self.inner.segments.get(segment)?;
        let src = check_blocks(
            &self.inner.regions.read().unwrap().table,
            &seg.regions,
            &blocks,
        )?;
        let mut pieces = Vec::new();
        let mut total = 0;
        for (b, &addr) in blocks.iter().zip(&src) {
            let base = seg.regions[b.dst_region as usize].base;
            if base == u64::MAX {
                return Err(TransferError::BadSegment(format!(
                    "destination region {} is not in the peer's shared memory",
                    b.dst_region
                )));
            }
            let mut off = 0;
            while off < b.len {
                let len = (b.len - off).min(PIECE);
                pieces.push(Piece {
                    src: addr + off as usize,
                    dst: (base + b.dst_offset + off) as usize,
                    len: len as usize,
                });
                off += len;
            }
            total += b.len;
        }
        let dropped = || TransferError::PeerUnreachable {
            peer: "shared memory".into(),
            reason: "the sending engine was dropped".into(),
        };
        // One thread per 16 MiB, up to `streams`: smaller batches gain less from threads than
        // starting them costs (and concurrent submitters already spread the work).
        let workers = self
            .inner
            .copy_threads
            .min(pieces.len())
            .min(total.div_ceil(PER_THREAD) as usize);
        // A one-thread copy runs on the submitting thread: inline when small, else in
        // `block_in_place` (the worker's other tasks move to another thread) where the runtime
        // allows it, which saves a hand-off to a blocking thread and the wake-up back.
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if total <= INLINE_MAX || (workers == 1 && multi_thread) {
            let state = BatchState::new(1);
            let copy = || copy_pieces(&self.inner, &seg.map, &pieces);
            let copied = if total <= INLINE_MAX {
                copy()
            } else {
                tokio::task::block_in_place(copy)
            };
            if copied {
                state.complete(1);
            } else {
                state.fail(dropped());
            }
            return Ok(self.inner.batches.insert(state));
        }
        let state = BatchState::new(workers as u64);
        {
            let mut inflight = seg.inflight.lock().unwrap();
            inflight.retain(|b| !b.is_settled());
            inflight.push(state.clone());
        }
        let pieces = Arc::new(pieces);
        let next = Arc::new(AtomicUsize::new(0));
        for _ in 0..workers {
            let (inner, map, pieces, next, state) = (
                self.inner.clone(),
                seg.map.clone(),
                pieces.clone(),
                next.clone(),
                state.clone(),
            );
            tokio::task::spawn_blocking(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= pieces.len() {
                    state.complete(1);
                    return;
                }
                if state.is_settled() {
                    return;
                }
                if !copy_pieces(&inner, &map, &pieces[i..i + 1]) {
                    state.fail(dropped());
                    return;
                }
            });
        }
        Ok(self.inner.batches.insert(state))
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.batches.poll(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        self.inner.batches.wait(batch).await
    }
}

#[cfg(test)]
mod tests {
    use kv_pool::KvBuffer;

    use super::*;

    fn region(addr: *const u8, len: usize) -> MemoryRegion {
        MemoryRegion {
            layer: 0,
            buffer: KvBuffer::Key,
            addr: addr as usize,
            len_bytes: len,
            item_len: 1,
        }
    }

    /// A 4 MiB batch (one copy thread) lands exactly, on both runtime flavors: in
    /// `block_in_place` on a multi-thread runtime's worker (done when `submit` returns), on a
    /// blocking thread on a current-thread runtime.
    #[test]
    fn a_one_thread_batch_lands_on_both_runtime_flavors() {
        const LEN: usize = 4 << 20;
        let src: Vec<u8> = (0..LEN).map(|i| (i * 7 % 251) as u8).collect();
        for multi in [true, false] {
            let dst = SharedMemory::create(LEN).unwrap();
            let rt = if multi {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .build()
            } else {
                tokio::runtime::Builder::new_current_thread().build()
            }
            .unwrap();
            let (tx, rx) = (
                ShmEngine::new(&TransferConfig::default()),
                ShmEngine::new(&TransferConfig::default()),
            );
            // SAFETY: `src` and `dst` outlive the engines; `dst` is read only after the batch.
            unsafe {
                tx.register(&[region(src.as_ptr(), LEN)]).unwrap();
                rx.register(&[region(dst.as_ptr(), LEN)]).unwrap();
            }
            let desc = rx.segment();
            let tx = Arc::new(tx);
            let t = tx.clone();
            let status = rt.block_on(async move {
                tokio::spawn(async move {
                    let seg = t.open_segment(&desc).await.unwrap();
                    let block = TransferBlock {
                        src_region: 0,
                        src_offset: 0,
                        dst_region: 0,
                        dst_offset: 0,
                        len: LEN as u64,
                    };
                    let b = t.submit(seg, vec![block]).await.unwrap();
                    let status = t.poll(b).unwrap();
                    if status == BatchStatus::Pending {
                        t.wait(b).await.unwrap();
                    }
                    status
                })
                .await
                .unwrap()
            });
            if multi {
                assert_eq!(status, BatchStatus::Done);
            }
            // SAFETY: the batch is done; nothing writes `dst` now.
            let got = unsafe { std::slice::from_raw_parts(dst.as_ptr(), LEN) };
            assert!(got == &src[..], "multi_thread: {multi}");
            drop((tx, rx));
        }
    }
}
