//! The `tcp` backend: framed, checksummed writes over several TCP streams per peer (loopback or
//! network).
//!
//! - The receiving side listens on `host:0`; that address is its segment's `endpoint`
//!   (`recv`). Each connection's frames land straight in the registered destination (the
//!   receiver bounds-checks every frame against its own registration and never trusts the
//!   header), and each frame is acked or nacked (`wire`).
//! - `open_segment` opens `streams` connections (`send`); `submit` splits blocks into frames
//!   of at most 4 MiB (`wire::FRAME_MAX`) bytes and spreads them over the streams by bytes
//!   (`send`: small frames are staged and written many at a time, frames of 16-256 KiB up to 16
//!   per vectored write, larger ones straight from registered memory). A batch
//!   is `Done` when every frame is acked; a nack (`Corrupted`), an I/O error or a closed
//!   connection fails every batch with frames outstanding on that stream: never a hang.
//! - Registered memory is touched only under the engine's region lock after checking that the
//!   engine is alive, so no task reads or writes it once the engine has dropped.

mod recv;
mod send;
mod wire;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use kv_pool::MemoryRegion;
use tokio::task::AbortHandle;

use crate::batch::{BatchState, BatchTable};
use crate::config::TransferConfig;
use crate::engine::{
    BackendKind, BatchId, BatchStatus, RegionId, RemoteRegion, SegmentDesc, SegmentId,
    TransferBlock, TransferEngine,
};
use crate::error::{Result, TransferError};
use crate::region::{check_backend, check_blocks, RegionTable};
use crate::segments::SegmentTable;
use send::{Frame, Job, Stream};

/// The `tcp` engine (see the module docs). Dropping it stops its listener and every
/// connection; batches in flight fail.
#[derive(Debug)]
pub struct TcpEngine {
    inner: Arc<Inner>,
}

/// What the engine's tasks share.
#[derive(Debug)]
pub(crate) struct Inner {
    cfg: TransferConfig,
    endpoint: String,
    regions: RwLock<RegionTable>,
    segments: SegmentTable<Segment>,
    batches: BatchTable,
    /// Frames sent so far (the `corrupt_frame` hook counts them from 0).
    frames_sent: AtomicU64,
    /// Every task the engine started, aborted when it drops.
    tasks: Mutex<Vec<AbortHandle>>,
}

/// An opened peer segment.
#[derive(Debug)]
struct Segment {
    regions: Vec<RemoteRegion>,
    streams: Vec<Arc<Stream>>,
}

impl Inner {
    /// Spawns a task the engine aborts when it drops.
    fn spawn(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) -> AbortHandle {
        let handle = tokio::spawn(fut).abort_handle();
        let mut tasks = self.tasks.lock().unwrap();
        tasks.retain(|t| !t.is_finished());
        tasks.push(handle.clone());
        handle
    }
}

impl TcpEngine {
    /// Binds the receive listener on `cfg.host:0` and starts accepting. Must be called inside a
    /// tokio runtime.
    pub fn new(cfg: &TransferConfig) -> Result<Self> {
        let listener = std::net::TcpListener::bind((cfg.host.as_str(), 0))
            .map_err(|e| TransferError::io(format!("binding {}:0", cfg.host), &e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| TransferError::io("setting the listener non-blocking", &e))?;
        let endpoint = listener
            .local_addr()
            .map_err(|e| TransferError::io("reading the listener's address", &e))?
            .to_string();
        let _rt = tokio::runtime::Handle::try_current().map_err(|_| TransferError::Io {
            context: "starting the tcp transfer engine".into(),
            message: "must be called inside a tokio runtime".into(),
        })?;
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| TransferError::io("registering the listener with tokio", &e))?;
        let inner = Arc::new(Inner {
            cfg: cfg.clone(),
            endpoint,
            regions: RwLock::new(RegionTable::default()),
            segments: SegmentTable::default(),
            batches: BatchTable::default(),
            frames_sent: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
        });
        inner.spawn(recv::accept_loop(inner.clone(), listener));
        Ok(TcpEngine { inner })
    }

    /// The receive listener's `ip:port`.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }
}

impl Drop for TcpEngine {
    fn drop(&mut self) {
        // From here on no task touches registered memory (they check `closed` under the lock).
        self.inner.regions.write().unwrap().closed = true;
        for seg in self.inner.segments.drain() {
            for s in &seg.streams {
                s.kill(s.unreachable("the sending engine was dropped"));
            }
        }
        for t in self.inner.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

/// Splits `blocks` (with their source addresses) into frames and spreads them over `n`
/// streams, each frame to the stream with the fewest bytes so far.
fn frames_by_stream(blocks: &[TransferBlock], src: &[usize], n: usize) -> Vec<Vec<Frame>> {
    let mut out: Vec<Vec<Frame>> = (0..n).map(|_| Vec::new()).collect();
    let mut bytes = vec![0u64; n];
    for (b, &addr) in blocks.iter().zip(src) {
        let mut off = 0;
        while off < b.len {
            let len = (b.len - off).min(wire::FRAME_MAX);
            let i = (0..n).min_by_key(|&i| bytes[i]).unwrap_or(0);
            out[i].push(Frame {
                src: addr + off as usize,
                len,
                dst_region: b.dst_region,
                dst_offset: b.dst_offset + off,
            });
            bytes[i] += len;
            off += len;
        }
    }
    out
}

#[async_trait]
impl TransferEngine for TcpEngine {
    fn kind(&self) -> BackendKind {
        BackendKind::Tcp
    }

    unsafe fn register(&self, regions: &[MemoryRegion]) -> Result<Vec<RegionId>> {
        let mut table = self.inner.regions.write().unwrap();
        let new = table.check_new(regions)?;
        Ok(table.push(new))
    }

    fn segment(&self) -> SegmentDesc {
        let table = self.inner.regions.read().unwrap();
        SegmentDesc {
            backend: BackendKind::Tcp,
            endpoint: self.inner.endpoint.clone(),
            regions: table.remote(),
            metadata: Vec::new(),
        }
    }

    async fn open_segment(&self, desc: &SegmentDesc) -> Result<SegmentId> {
        check_backend(desc, BackendKind::Tcp)?;
        let mut streams = Vec::new();
        for _ in 0..self.inner.cfg.streams.max(1) {
            match Stream::connect(&self.inner, &desc.endpoint).await {
                Ok(s) => streams.push(s),
                Err(e) => {
                    for s in &streams {
                        s.kill(e.clone());
                    }
                    return Err(e);
                }
            }
        }
        Ok(self.inner.segments.insert(Segment {
            regions: desc.regions.clone(),
            streams,
        }))
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let seg = self.inner.segments.remove(segment)?;
        for s in &seg.streams {
            s.kill(s.unreachable("the segment was closed"));
        }
        Ok(())
    }

    async fn submit(&self, segment: SegmentId, blocks: Vec<TransferBlock>) -> Result<BatchId> {
        let seg = self.inner.segments.get(segment)?;
        let src = check_blocks(&self.inner.regions.read().unwrap(), &seg.regions, &blocks)?;
        let per_stream = frames_by_stream(&blocks, &src, seg.streams.len());
        let total: usize = per_stream.iter().map(Vec::len).sum();
        let state = BatchState::new(total as u64);
        let id = self.inner.batches.insert(state.clone());
        for (stream, frames) in seg.streams.iter().zip(per_stream) {
            if !frames.is_empty() {
                stream.enqueue(Job {
                    batch: id.0,
                    state: state.clone(),
                    frames,
                });
            }
        }
        Ok(id)
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
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::wire::{self, Ack, Header};
    use super::*;
    use kv_pool::KvBuffer;

    /// A fake receiver: reads two 4 KiB frames and answers with `ack`; the batch's outcome.
    async fn outcome_after(frames_acked: u32) -> Result<()> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let fake = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut flags = Vec::new();
            for _ in 0..2 {
                let mut h = [0u8; wire::HEADER_LEN];
                sock.read_exact(&mut h).await.unwrap();
                let h = Header::decode(&h).unwrap();
                let mut rest = vec![0u8; h.len as usize + wire::TRAILER_LEN];
                sock.read_exact(&mut rest).await.unwrap();
                flags.push(h.flags);
                if h.flags & wire::FLAG_ACK_NOW != 0 {
                    let ack = Ack {
                        batch: h.batch,
                        code: wire::ACK_OK,
                        dst_region: 0,
                        dst_offset: 0,
                        frames: frames_acked,
                    };
                    sock.write_all(&ack.encode()).await.unwrap();
                }
            }
            assert_eq!(
                flags,
                [0, wire::FLAG_ACK_NOW],
                "only the last frame asks for an ack"
            );
            tokio::time::sleep(Duration::from_secs(60)).await; // keeps the connection open
        });
        let src = vec![7u8; 8 << 10];
        let tx = TcpEngine::new(&TransferConfig {
            streams: 1,
            ..TransferConfig::default()
        })
        .unwrap();
        // SAFETY: `src` outlives `tx` (declared before it) and nothing else touches it.
        unsafe { tx.register(&[region(&src)]).unwrap() };
        let desc = SegmentDesc {
            backend: BackendKind::Tcp,
            endpoint: addr,
            regions: vec![RemoteRegion {
                len: 8 << 10,
                base: 0,
            }],
            metadata: Vec::new(),
        };
        let seg = tx.open_segment(&desc).await.unwrap();
        let block = |i: u64| TransferBlock {
            src_region: 0,
            src_offset: i * 4096,
            dst_region: 0,
            dst_offset: i * 4096,
            len: 4096,
        };
        let b = tx.submit(seg, vec![block(0), block(1)]).await.unwrap();
        let out = tokio::time::timeout(Duration::from_secs(30), tx.wait(b))
            .await
            .expect("a hang");
        fake.abort();
        out
    }

    fn region(mem: &[u8]) -> MemoryRegion {
        MemoryRegion {
            layer: 0,
            buffer: KvBuffer::Key,
            addr: mem.as_ptr() as usize,
            len_bytes: mem.len(),
            item_len: 1,
        }
    }

    /// Mid-sized frames go out several per vectored write (`send::write_gathered`), mixed with
    /// staged small ones and direct large ones: every byte lands where it belongs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gathered_staged_and_direct_frames_land_exactly() {
        const LEN: usize = 8 << 20;
        let src: Vec<u8> = (0..LEN).map(|i| (i * 13 % 251) as u8).collect();
        let dst = vec![0u8; LEN];
        let cfg = TransferConfig {
            streams: 2,
            ..TransferConfig::default()
        };
        let (tx, rx) = (TcpEngine::new(&cfg).unwrap(), TcpEngine::new(&cfg).unwrap());
        // SAFETY: `src` and `dst` outlive the engines (dropped below, before them); `dst` is
        // read only after the batches.
        unsafe {
            tx.register(&[region(&src)]).unwrap();
            rx.register(&[region(&dst)]).unwrap();
        }
        let seg = tx.open_segment(&rx.segment()).await.unwrap();
        let sizes = [
            20 << 10,
            64 << 10,
            1000,
            100 << 10,
            256 << 10,
            300 << 10,
            16 << 10,
        ];
        let (mut blocks, mut want, mut at) = (Vec::new(), vec![0u8; LEN], 0usize);
        for (i, &len) in sizes.iter().cycle().take(60).enumerate() {
            let d = LEN - at - len - i; // reversed, unaligned
            blocks.push(TransferBlock {
                src_region: 0,
                src_offset: at as u64,
                dst_region: 0,
                dst_offset: d as u64,
                len: len as u64,
            });
            want[d..d + len].copy_from_slice(&src[at..at + len]);
            at += len;
        }
        let b = tx.submit(seg, blocks).await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), tx.wait(b))
            .await
            .expect("a hang")
            .unwrap();
        drop((tx, rx));
        assert!(dst == want);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_ack_covers_the_frames_of_a_batch_and_an_over_ack_kills_the_stream() {
        assert_eq!(outcome_after(2).await, Ok(()));
        let over = outcome_after(3).await.unwrap_err();
        assert!(
            matches!(&over, TransferError::PeerUnreachable { reason, .. }
                if reason.contains("3 frames")),
            "{over:?}"
        );
    }
}
