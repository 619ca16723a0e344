//! `transfer-bench`: Mooncake's `transfer_engine_bench` as a library function. `threads`
//! tasks each submit batches of `batch_size` blocks of `block_size` bytes through a backend
//! (loopback: both engines in this process) and wait for each; in the same run, a baseline
//! moves the same blocks the plain way: raw loopback sockets with `write_all` / `read_exact`
//! (one connection per thread) for `tcp`, `memcpy` for `shm`. Engine and baseline alternate over
//! [`ROUNDS`] rounds (so that a noisy machine slows both alike); the report gives the median of
//! each.
//!
//! The comparison is kept fair, and the baseline is the ceiling, not a straw man:
//! - the same blocks: thread `t` moves bytes `t·B..(t+1)·B` (B = `block_size × batch_size`) of
//!   the same source buffer to the same offsets of the same destination buffer, block by block
//!   (the engine is handed the blocks one by one too: nothing merges adjacent blocks for it);
//! - the same concurrency: `threads` submitters and `threads` tcp streams against `threads`
//!   socket pairs (a writer and a reader thread each), or `threads` memcpy threads; the engine's
//!   tokio runtime gets as many worker threads as the socket baseline has OS threads;
//! - the same memory: for `shm` both buffers are shared memory (`SharedMemory`), the engine
//!   writing through the peer's mapping of it as a real sender does, memcpy through the owner's;
//!   for `tcp` both are heap memory;
//! - the baseline does only the data movement: no framing, checksums, acks or validation, which
//!   the engine must do (CRC32 of every byte on both sides, one ack per batch and stream).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_pool::{KvBuffer, MemoryRegion};
use serde::{Deserialize, Serialize};

use crate::backends::new_engine;
use crate::config::TransferConfig;
use crate::engine::{BackendKind, TransferBlock};
use crate::error::{Result, TransferError};

/// Rounds of engine and baseline, alternating.
pub const ROUNDS: usize = 3;

/// What to measure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BenchConfig {
    /// `tcp` or `shm` (the backends with a baseline).
    pub backend: BackendKind,
    /// Bytes per block.
    pub block_size: usize,
    /// Blocks per batch.
    pub batch_size: usize,
    /// Concurrent submitters (and tcp streams / shm copy threads, and baseline connections).
    pub threads: usize,
    /// Total measuring time, split over the rounds and between engine and baseline; in JSON a
    /// number of seconds, `duration_s`.
    #[serde(rename = "duration_s", with = "secs")]
    pub duration: Duration,
}

/// A [`Duration`] as a number of seconds in JSON (`6.0`, not `{"secs":6,"nanos":0}`).
mod secs {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(D::Error::custom)
    }
}

/// One round's throughputs, GB/s (10⁹ bytes per second).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BenchRound {
    /// The engine.
    pub gbps: f64,
    /// The baseline.
    pub baseline_gbps: f64,
}

/// The result: medians over the rounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// The configuration measured.
    pub config: BenchConfig,
    /// Median engine throughput, GB/s.
    pub gbps: f64,
    /// Median baseline throughput, GB/s (raw loopback sockets for tcp, memcpy for shm).
    pub baseline_gbps: f64,
    /// `gbps / baseline_gbps`.
    pub ratio: f64,
    /// Blocks the engine moved, all rounds.
    pub blocks: u64,
    /// Bytes the engine moved, all rounds.
    pub bytes: u64,
    /// Seconds the engine ran, all rounds.
    pub seconds: f64,
    /// Every round.
    pub rounds: Vec<BenchRound>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bad(what: &str) -> TransferError {
    TransferError::BadRegion(format!("transfer-bench: {what}"))
}

/// Runs the benchmark (builds its own tokio runtime: call it outside async code).
pub fn run_bench(cfg: &BenchConfig) -> Result<BenchReport> {
    if cfg.block_size == 0 || cfg.batch_size == 0 || cfg.threads == 0 {
        return Err(bad("block size, batch size and threads must be > 0"));
    }
    if !matches!(cfg.backend, BackendKind::Tcp | BackendKind::Shm) {
        return Err(bad("only tcp and shm have a baseline"));
    }
    if !cfg.backend.compiled() {
        return Err(cfg.backend.not_compiled());
    }
    let per_thread = cfg.block_size * cfg.batch_size;
    let total = per_thread * cfg.threads;
    let src = Buffer::new(total, cfg.backend)?;
    let dst = Buffer::new(total, cfg.backend)?;
    src.fill();
    let rt = tokio::runtime::Builder::new_multi_thread()
        // As many OS threads as the socket baseline (a writer and a reader per thread), so that
        // on a shared machine both get the same share of the cores.
        .worker_threads((2 * cfg.threads).clamp(2, 16))
        .enable_all()
        .build()
        .map_err(|e| TransferError::io("building the bench runtime", &e))?;
    let slice = cfg.duration / (2 * ROUNDS as u32);
    let tcfg = TransferConfig {
        streams: cfg.threads,
        ..TransferConfig::default()
    };
    let (tx, rx) = rt.block_on(async {
        Ok::<_, TransferError>((
            new_engine(cfg.backend, &tcfg)?,
            new_engine(cfg.backend, &tcfg)?,
        ))
    })?;
    // SAFETY: both buffers outlive the engines (dropped at the end of this function, after
    // them), and the bench never touches them while batches run.
    unsafe {
        tx.register(&[src.region()])?;
        rx.register(&[dst.region()])?;
    }
    let seg = rt.block_on(tx.open_segment(&rx.segment()))?;
    let (mut rounds, mut blocks, mut bytes, mut seconds) = (Vec::new(), 0, 0, 0.0);
    for _ in 0..ROUNDS {
        let (n, secs) = rt.block_on(engine_round(&tx, seg, cfg, slice))?;
        let baseline = match cfg.backend {
            BackendKind::Tcp => raw_socket_round(&src, &dst, cfg, slice)?,
            _ => memcpy_round(&src, &dst, cfg, slice),
        };
        blocks += n;
        bytes += n * cfg.block_size as u64;
        seconds += secs;
        rounds.push(BenchRound {
            gbps: (n * cfg.block_size as u64) as f64 / secs / 1e9,
            baseline_gbps: baseline,
        });
    }
    drop((tx, rx));
    let gbps = median(rounds.iter().map(|r| r.gbps).collect());
    let baseline_gbps = median(rounds.iter().map(|r| r.baseline_gbps).collect());
    Ok(BenchReport {
        config: cfg.clone(),
        gbps,
        baseline_gbps,
        ratio: gbps / baseline_gbps,
        blocks,
        bytes,
        seconds,
        rounds,
    })
}

/// `threads` tasks submit and wait for batches until `slice` is over: (blocks moved, seconds).
async fn engine_round(
    tx: &Arc<dyn crate::TransferEngine>,
    seg: crate::SegmentId,
    cfg: &BenchConfig,
    slice: Duration,
) -> Result<(u64, f64)> {
    let start = Instant::now();
    let deadline = start + slice;
    let mut tasks = Vec::new();
    for t in 0..cfg.threads {
        let tx = tx.clone();
        let (bs, n) = (cfg.block_size as u64, cfg.batch_size as u64);
        tasks.push(tokio::spawn(async move {
            let base = t as u64 * bs * n;
            let blocks: Vec<TransferBlock> = (0..n)
                .map(|i| TransferBlock {
                    src_region: 0,
                    src_offset: base + i * bs,
                    dst_region: 0,
                    dst_offset: base + i * bs,
                    len: bs,
                })
                .collect();
            let mut moved = 0u64;
            while Instant::now() < deadline {
                let b = tx.submit(seg, blocks.clone()).await?;
                tx.wait(b).await?;
                moved += n;
            }
            Ok::<u64, TransferError>(moved)
        }));
    }
    let mut moved = 0;
    for t in tasks {
        moved += t.await.expect("bench task panicked")?;
    }
    Ok((moved, start.elapsed().as_secs_f64()))
}

/// Raw loopback sockets, one per thread, moving the same blocks with `write_all` /
/// `read_exact`: GB/s.
fn raw_socket_round(src: &Buffer, dst: &Buffer, cfg: &BenchConfig, slice: Duration) -> Result<f64> {
    let io = |e: std::io::Error| TransferError::io("bench baseline socket", &e);
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let per_thread = cfg.block_size * cfg.batch_size;
    let start = Instant::now();
    let deadline = start + slice;
    let moved = std::thread::scope(|s| -> Result<u64> {
        let mut readers = Vec::new();
        for t in 0..cfg.threads {
            let mut w = TcpStream::connect(addr).map_err(io)?;
            let (mut r, _) = listener.accept().map_err(io)?;
            let _ = w.set_nodelay(true);
            let src = &src.bytes()[t * per_thread..(t + 1) * per_thread];
            let dst_ptr = dst.ptr() as usize + t * per_thread;
            let bs = cfg.block_size;
            s.spawn(move || {
                'out: while Instant::now() < deadline {
                    for block in src.chunks(bs) {
                        if w.write_all(block).is_err() {
                            break 'out;
                        }
                    }
                }
            });
            readers.push(s.spawn(move || {
                // SAFETY: thread `t`'s slice of `dst`, written by this thread only.
                let dst = unsafe { std::slice::from_raw_parts_mut(dst_ptr as *mut u8, per_thread) };
                let mut n = 0u64;
                'out: loop {
                    for block in dst.chunks_mut(bs) {
                        if r.read_exact(block).is_err() {
                            break 'out;
                        }
                        n += 1;
                    }
                }
                n
            }));
        }
        Ok(readers.into_iter().map(|h| h.join().unwrap()).sum())
    })?;
    Ok((moved * cfg.block_size as u64) as f64 / start.elapsed().as_secs_f64() / 1e9)
}

/// `memcpy` of the same blocks, one thread per submitter: GB/s.
fn memcpy_round(src: &Buffer, dst: &Buffer, cfg: &BenchConfig, slice: Duration) -> f64 {
    let per_thread = cfg.block_size * cfg.batch_size;
    let start = Instant::now();
    let deadline = start + slice;
    let moved: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cfg.threads)
            .map(|t| {
                let src = &src.bytes()[t * per_thread..(t + 1) * per_thread];
                let dst_ptr = dst.ptr() as usize + t * per_thread;
                let bs = cfg.block_size;
                s.spawn(move || {
                    // SAFETY: thread `t`'s slice of `dst`, written by this thread only.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(dst_ptr as *mut u8, per_thread) };
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        for (d, s) in dst.chunks_mut(bs).zip(src.chunks(bs)) {
                            d.copy_from_slice(s);
                            n += 1;
                        }
                        std::hint::black_box(&dst);
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    (moved * cfg.block_size as u64) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Bench memory: shared memory for `shm` (the receiver must advertise it), the heap otherwise.
enum Buffer {
    #[cfg(all(feature = "shm", target_os = "linux"))]
    Shared(crate::shm::SharedMemory),
    Heap(Box<[std::cell::UnsafeCell<u8>]>),
}

impl Buffer {
    fn new(len: usize, backend: BackendKind) -> Result<Self> {
        #[cfg(all(feature = "shm", target_os = "linux"))]
        if backend == BackendKind::Shm {
            return Ok(Buffer::Shared(crate::shm::SharedMemory::create(len)?));
        }
        let _ = backend;
        Ok(Buffer::Heap(
            (0..len).map(|_| std::cell::UnsafeCell::new(0)).collect(),
        ))
    }

    fn ptr(&self) -> *mut u8 {
        match self {
            #[cfg(all(feature = "shm", target_os = "linux"))]
            Buffer::Shared(m) => m.as_ptr(),
            Buffer::Heap(b) => b.as_ptr() as *mut u8,
        }
    }

    fn len(&self) -> usize {
        match self {
            #[cfg(all(feature = "shm", target_os = "linux"))]
            Buffer::Shared(m) => m.len(),
            Buffer::Heap(b) => b.len(),
        }
    }

    /// The bytes, for reading (only while nothing writes them).
    fn bytes(&self) -> &[u8] {
        // SAFETY: the buffer's live memory; the bench writes a buffer only through its own
        // disjoint per-thread slices or through an engine, never while reading it this way.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }

    fn fill(&self) {
        // SAFETY: as in `bytes`; nothing else touches the buffer yet.
        let b = unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len()) };
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 131 % 251) as u8;
        }
    }

    fn region(&self) -> MemoryRegion {
        MemoryRegion {
            layer: 0,
            buffer: KvBuffer::Key,
            addr: self.ptr() as usize,
            len_bytes: self.len(),
            item_len: 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_report_gives_the_duration_in_seconds() {
        let r = BenchReport {
            config: BenchConfig {
                backend: BackendKind::Tcp,
                block_size: 65536,
                batch_size: 128,
                threads: 4,
                duration: Duration::from_millis(6500),
            },
            gbps: 2.5,
            baseline_gbps: 5.0,
            ratio: 0.5,
            blocks: 10,
            bytes: 655360,
            seconds: 3.25,
            rounds: vec![BenchRound {
                gbps: 2.5,
                baseline_gbps: 5.0,
            }],
        };
        let json = serde_json::to_string_pretty(&r).unwrap();
        insta::assert_snapshot!(json);
        let back: BenchReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
        let neg = json.replace("6.5", "-1.0");
        assert!(serde_json::from_str::<BenchReport>(&neg).is_err());
    }

    #[test]
    fn a_short_run_reports_both_throughputs() {
        for backend in [BackendKind::Tcp, BackendKind::Shm] {
            let r = run_bench(&BenchConfig {
                backend,
                block_size: 64 << 10,
                batch_size: 4,
                threads: 2,
                duration: Duration::from_millis(120),
            })
            .unwrap();
            assert!(r.gbps > 0.0 && r.baseline_gbps > 0.0, "{r:?}");
            assert_eq!(r.rounds.len(), ROUNDS);
            assert_eq!(r.bytes, r.blocks * (64 << 10));
        }
        let bad = BenchConfig {
            backend: BackendKind::Fake,
            block_size: 1,
            batch_size: 1,
            threads: 1,
            duration: Duration::from_millis(1),
        };
        assert!(run_bench(&bad).is_err());
    }
}
