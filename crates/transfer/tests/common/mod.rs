//! Test fixtures for the PD protocol tests: [`MemcpyEngine`], an in-process `TransferEngine`
//! test double that memcpys between regions registered in this process, and helpers that build
//! a prefill and a decode side over it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kv_pool::{HostKvStore, KvDtype, KvLayout, KvShape, KvStore, MemoryRegion, Page};
use tokio::sync::watch;
use transfer::pd::{KvManager, PdConfig, PdRole, ServerCompat};
use transfer::{
    BackendKind, BatchId, BatchStatus, RegionId, RemoteRegion, Result, SegmentDesc, SegmentId,
    TransferBlock, TransferEngine, TransferError,
};

/// `(addr, len)` of each region an engine registered, by endpoint: how a `MemcpyEngine` finds
/// its peer's memory (both live in this process).
type Registry = Mutex<HashMap<String, Vec<(usize, u64)>>>;

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// TEST DOUBLE, not a backend: a `TransferEngine` that copies with `memcpy` between regions of
/// this process (it reports itself as [`BackendKind::Fake`]). Batches complete on a spawned task
/// after [`MemcpyEngine::set_delay`]; [`MemcpyEngine::fail_next`] makes the next batches fail
/// with `Corrupted` (nothing copied).
#[derive(Debug)]
pub struct MemcpyEngine {
    endpoint: String,
    regions: Mutex<Vec<(usize, u64)>>,
    segments: Mutex<HashMap<SegmentId, String>>,
    batches: Arc<Mutex<HashMap<BatchId, watch::Receiver<Option<BatchStatus>>>>>,
    next: AtomicU64,
    delay: Mutex<Duration>,
    fail_next: AtomicU32,
    unreachable: std::sync::atomic::AtomicBool,
    pub submitted_blocks: AtomicU64,
}

impl MemcpyEngine {
    pub fn new() -> Arc<Self> {
        static N: AtomicU64 = AtomicU64::new(0);
        Arc::new(MemcpyEngine {
            endpoint: format!("memcpy:{}", N.fetch_add(1, Ordering::Relaxed)),
            regions: Mutex::default(),
            segments: Mutex::default(),
            batches: Arc::default(),
            next: AtomicU64::new(1),
            delay: Mutex::new(Duration::ZERO),
            fail_next: AtomicU32::new(0),
            unreachable: Default::default(),
            submitted_blocks: AtomicU64::new(0),
        })
    }

    pub fn set_delay(&self, d: Duration) {
        *self.delay.lock().unwrap() = d;
    }

    pub fn fail_next(&self, n: u32) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// Failed batches fail with `PeerUnreachable` instead of `Corrupted`.
    pub fn fail_as_unreachable(&self, yes: bool) {
        self.unreachable.store(yes, Ordering::SeqCst);
    }
}

#[async_trait]
impl TransferEngine for MemcpyEngine {
    fn kind(&self) -> BackendKind {
        BackendKind::Fake
    }

    unsafe fn register(&self, regions: &[MemoryRegion]) -> Result<Vec<RegionId>> {
        let mut mine = self.regions.lock().unwrap();
        let first = mine.len() as u32;
        mine.extend(regions.iter().map(|r| (r.addr, r.len_bytes as u64)));
        registry()
            .lock()
            .unwrap()
            .insert(self.endpoint.clone(), mine.clone());
        Ok((first..first + regions.len() as u32).collect())
    }

    fn segment(&self) -> SegmentDesc {
        SegmentDesc {
            backend: BackendKind::Fake,
            endpoint: self.endpoint.clone(),
            regions: self
                .regions
                .lock()
                .unwrap()
                .iter()
                .map(|&(_, len)| RemoteRegion { len, base: 0 })
                .collect(),
            metadata: Vec::new(),
        }
    }

    async fn open_segment(&self, desc: &SegmentDesc) -> Result<SegmentId> {
        if !registry().lock().unwrap().contains_key(&desc.endpoint) {
            return Err(TransferError::BadSegment(desc.endpoint.clone()));
        }
        let id = SegmentId(self.next.fetch_add(1, Ordering::Relaxed));
        self.segments
            .lock()
            .unwrap()
            .insert(id, desc.endpoint.clone());
        Ok(id)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        self.segments
            .lock()
            .unwrap()
            .remove(&segment)
            .map(|_| ())
            .ok_or(TransferError::UnknownSegment(segment))
    }

    async fn submit(&self, segment: SegmentId, blocks: Vec<TransferBlock>) -> Result<BatchId> {
        let endpoint = self
            .segments
            .lock()
            .unwrap()
            .get(&segment)
            .cloned()
            .ok_or(TransferError::UnknownSegment(segment))?;
        let dst = registry().lock().unwrap()[&endpoint].clone();
        let src = self.regions.lock().unwrap().clone();
        let mut copies = Vec::new();
        for b in &blocks {
            let check = |side, regions: &[(usize, u64)], region: u32, offset: u64| {
                let &(addr, len) = regions
                    .get(region as usize)
                    .ok_or(TransferError::UnknownRegion { side, region })?;
                let end = offset + b.len;
                if end > len {
                    return Err(TransferError::OutOfBounds {
                        side,
                        region,
                        offset,
                        end,
                        len,
                    });
                }
                Ok(addr + offset as usize)
            };
            let s = check("source", &src, b.src_region, b.src_offset)?;
            let d = check("destination", &dst, b.dst_region, b.dst_offset)?;
            copies.push((s, d, b.len as usize));
        }
        self.submitted_blocks
            .fetch_add(blocks.len() as u64, Ordering::Relaxed);
        let id = BatchId(self.next.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = watch::channel(None);
        self.batches.lock().unwrap().insert(id, rx);
        let fail = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let delay = *self.delay.lock().unwrap();
        let unreachable = self.unreachable.load(Ordering::SeqCst);
        tokio::spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let status = if fail && unreachable {
                BatchStatus::Failed(TransferError::PeerUnreachable {
                    peer: "memcpy".into(),
                    reason: "test".into(),
                })
            } else if fail {
                BatchStatus::Failed(TransferError::Corrupted {
                    region: 0,
                    offset: 0,
                })
            } else {
                for (s, d, len) in copies {
                    // SAFETY: both ranges were bounds-checked against regions registered in this
                    // process, whose owners promised (register's contract) that they stay valid
                    // and untouched while the batch is in flight.
                    unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len) };
                }
                BatchStatus::Done
            };
            let _ = tx.send(Some(status));
        });
        Ok(id)
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        let mut map = self.batches.lock().unwrap();
        let rx = map.get(&batch).ok_or(TransferError::UnknownBatch(batch))?;
        let status = rx.borrow().clone();
        match status {
            None => Ok(BatchStatus::Pending),
            Some(s) => {
                map.remove(&batch);
                Ok(s)
            }
        }
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        let mut rx = self
            .batches
            .lock()
            .unwrap()
            .get(&batch)
            .cloned()
            .ok_or(TransferError::UnknownBatch(batch))?;
        let status = rx
            .wait_for(|s| s.is_some())
            .await
            .map(|s| s.clone().unwrap())
            .unwrap_or(BatchStatus::Failed(TransferError::UnknownBatch(batch)));
        self.batches.lock().unwrap().remove(&batch);
        match status {
            BatchStatus::Failed(e) => Err(e),
            _ => Ok(()),
        }
    }
}

/// A small MHA layout: 2 layers, 2 KV heads of 4 f16 dims, `pages` pages of `page_size`.
pub fn layout(page_size: u32, pages: usize) -> KvLayout {
    let shape = KvShape::mha(2, 4, 4, 2, KvDtype::F16).unwrap();
    KvLayout::new(shape, page_size, pages * page_size as usize).unwrap()
}

pub fn compat_of(layout: &KvLayout, kind: BackendKind) -> ServerCompat {
    ServerCompat {
        model: "tiny".into(),
        page_size: layout.page_size,
        kv_dtype: layout.shape.dtype.name().into(),
        page_bytes: layout.page_bytes() as u64,
        regions: layout.shape.buffers().len() as u32 * layout.shape.layers,
        transfer_backend: kind,
    }
}

/// Short timeouts so failure tests finish fast.
pub fn fast_config(role: PdRole) -> PdConfig {
    PdConfig {
        bootstrap_port: 0,
        bootstrap_timeout: Duration::from_secs(5),
        waiting_timeout: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_max_failures: 2,
        ..PdConfig::new(role)
    }
}

/// One server's side: its KV store (registered), its engine and its manager.
pub struct Side {
    pub store: Box<HostKvStore>,
    pub engine: Arc<MemcpyEngine>,
    pub mgr: KvManager,
}

impl Side {
    pub fn start(cfg: PdConfig, layout: KvLayout, compat: ServerCompat) -> Side {
        let store = Box::new(HostKvStore::new(layout).unwrap());
        let engine = MemcpyEngine::new();
        let regions = store.memory_regions();
        // SAFETY: the store's buffers live (boxed, never reallocated) as long as the Side, and
        // the tests read them only once the transfers touching them ended.
        let ids = unsafe { engine.register(&regions) }.unwrap();
        let local = ids.into_iter().zip(regions).collect();
        let mgr = KvManager::start(
            cfg,
            compat,
            engine.clone(),
            local,
            tokio::runtime::Handle::current(),
        )
        .unwrap();
        Side { store, engine, mgr }
    }

    /// Fills `pages` with bytes derived from `(seed, page, offset)`.
    pub fn fill(&mut self, pages: &[Page], seed: u8) {
        let pb = self.store.layout().page_bytes();
        let data: Vec<u8> = pages
            .iter()
            .flat_map(|p| (0..pb).map(move |i| (p.0 as u8).wrapping_mul(31) ^ (i as u8) ^ seed))
            .collect();
        self.store.write_pages(pages, &data).unwrap();
    }

    pub fn read(&self, pages: &[Page]) -> Vec<u8> {
        let mut out = vec![0u8; pages.len() * self.store.layout().page_bytes()];
        self.store.read_pages(pages, &mut out).unwrap();
        out
    }

    pub fn bootstrap(&self) -> String {
        self.mgr.bootstrap_addr().unwrap().to_string()
    }
}

pub fn pages(v: impl IntoIterator<Item = u32>) -> Vec<Page> {
    v.into_iter().map(Page).collect()
}

/// Polls `f` every 2 ms until it holds; panics after `limit`.
pub async fn until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
