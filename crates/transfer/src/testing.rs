//! The [`TransferEngine`] conformance suite (feature `testing`): every backend runs it
//! (`tcp`, `shm` and `fake` in this crate's tests; `nixl` where NIXL exists).
//!
//! [`check_transfer_engine`] builds its own multi-threaded tokio runtime and calls `make` inside
//! it (backends may need one), so call it from a plain `#[test]`, not from async code. It
//! panics naming the property that failed. Memory is a [`SharedMemory`](crate::shm::SharedMemory)
//! where `shm` is compiled (any backend can send from and receive into it), else the heap.

use std::sync::Arc;
use std::time::Duration;

use kv_pool::{KvBuffer, MemoryRegion, SplitMix64};

use crate::engine::{BackendKind, BatchStatus, SegmentId, TransferBlock, TransferEngine};
use crate::error::TransferError;

/// How long any single step may take before the suite calls it a hang.
const STEP: Duration = Duration::from_secs(60);

/// Test memory: zeroed, fixed address, freed on drop.
pub struct TestMemory {
    #[cfg(all(feature = "shm", target_os = "linux"))]
    mem: crate::shm::SharedMemory,
    #[cfg(not(all(feature = "shm", target_os = "linux")))]
    mem: Box<[std::cell::UnsafeCell<u8>]>,
}

impl TestMemory {
    /// `len` zeroed bytes.
    pub fn new(len: usize) -> Self {
        #[cfg(all(feature = "shm", target_os = "linux"))]
        let mem = crate::shm::SharedMemory::create(len).expect("shared memory for the suite");
        #[cfg(not(all(feature = "shm", target_os = "linux")))]
        let mem = (0..len).map(|_| std::cell::UnsafeCell::new(0)).collect();
        TestMemory { mem }
    }

    #[cfg(all(feature = "shm", target_os = "linux"))]
    fn ptr(&self) -> *mut u8 {
        self.mem.as_ptr()
    }

    #[cfg(not(all(feature = "shm", target_os = "linux")))]
    fn ptr(&self) -> *mut u8 {
        self.mem.as_ptr() as *mut u8
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Never true for memory from [`TestMemory::new`] with a non-zero length.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the bytes (call it only while no batch writes them).
    pub fn to_vec(&self) -> Vec<u8> {
        // SAFETY: `ptr..ptr + len` is this value's live memory; the caller keeps writers away.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }.to_vec()
    }

    /// Overwrites bytes from `offset` (call it only while no batch reads or writes them).
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.len());
        // SAFETY: in bounds (checked above) of this value's live memory.
        unsafe { std::ptr::copy(bytes.as_ptr(), self.ptr().add(offset), bytes.len()) };
    }

    /// The memory as one kv-pool region (layer 0, key buffer, item length 1).
    pub fn region(&self) -> MemoryRegion {
        self.region_at(0, self.len())
    }

    /// Bytes `offset..offset + len` as a kv-pool region (may reach outside: for bad inputs).
    pub fn region_at(&self, offset: usize, len: usize) -> MemoryRegion {
        MemoryRegion {
            layer: 0,
            buffer: KvBuffer::Key,
            addr: self.ptr() as usize + offset,
            len_bytes: len,
            item_len: 1,
        }
    }
}

fn random_bytes(n: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(n);
    v
}

async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(STEP, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {STEP:?} (a hang)"))
}

/// Runs the conformance suite on engines from `make` (called several times, inside the suite's
/// runtime). `moves_data`: whether the backend moves bytes (`false` for `fake`, whose
/// destination must then stay untouched).
///
/// Checks: register / segment / open (ids, lengths, the backend named); bytes land exactly
/// (random blocks in many concurrent batches, a zero-length block, a block spanning several
/// 4 MiB frames); every bad input is a typed error and moves nothing (unknown region on either
/// side, out of bounds, an overflowing offset, unknown segment, unknown batch, null, empty and
/// overlapping registrations, another backend's descriptor); the poll lifecycle (Pending or
/// Done, then the reaped id is `UnknownBatch`); `close_segment` settles pending batches, and
/// the closed id is `UnknownSegment`.
pub fn check_transfer_engine(make: impl Fn() -> Arc<dyn TransferEngine>, moves_data: bool) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("the suite's runtime");
    rt.block_on(suite(&make, moves_data));
}

async fn suite(make: &dyn Fn() -> Arc<dyn TransferEngine>, moves_data: bool) {
    let mut rng = SplitMix64::new(0x7ea5);
    let (tx, rx) = (make(), make());
    let kind = tx.kind();
    assert_eq!(rx.kind(), kind, "both engines from `make` are one backend");
    // Sources: a small region and one spanning several frames; destinations the same sizes.
    let small = 256 << 10;
    let big = 10 << 20;
    // One memory per side, two regions in it (a gap between them), as a KV store's buffers.
    let gap = 4096;
    let at = [0, small + gap];
    let (src_mem, dst_mem) = (TestMemory::new(at[1] + big), TestMemory::new(at[1] + big));
    src_mem.write(0, &random_bytes(src_mem.len(), &mut rng));
    let region = |m: &TestMemory, i: usize| m.region_at(at[i], [small, big][i]);
    let bytes = |m: &TestMemory, i: usize| m.to_vec()[at[i]..at[i] + [small, big][i]].to_vec();
    // SAFETY: the memory outlives both engines (dropped at the end of this function, after
    // the engines), and the suite touches it only between batches.
    let ids = unsafe { tx.register(&[region(&src_mem, 0), region(&src_mem, 1)]) }.unwrap();
    assert_eq!(
        ids,
        [0, 1],
        "register: ids are positions in registration order"
    );
    // SAFETY: as above.
    let ids = unsafe { rx.register(&[region(&dst_mem, 0), region(&dst_mem, 1)]) }.unwrap();
    assert_eq!(ids, [0, 1]);
    let desc = rx.segment();
    assert_eq!(desc.backend, kind, "segment(): names its backend");
    let lens: Vec<u64> = desc.regions.iter().map(|r| r.len).collect();
    assert_eq!(
        lens,
        [small as u64, big as u64],
        "segment(): region lengths"
    );

    // Bad registrations: nothing is registered.
    let mut overlap = region(&dst_mem, 0);
    overlap.addr += 16;
    overlap.len_bytes = 16;
    let mut null = region(&dst_mem, 0);
    null.addr = 0;
    let mut empty = TestMemory::new(64).region();
    empty.len_bytes = 0;
    let fresh = TestMemory::new(64);
    for (what, bad) in [
        ("overlapping registered memory", vec![overlap.clone()]),
        ("a null address", vec![null]),
        ("an empty region", vec![empty]),
        (
            "a good region then an overlapping one",
            vec![fresh.region(), fresh.region()],
        ),
    ] {
        // SAFETY: refused registrations register nothing.
        let r = unsafe { rx.register(&bad) };
        assert!(
            matches!(r, Err(TransferError::BadRegion(_))),
            "register {what}: {r:?}"
        );
        assert_eq!(
            rx.segment().regions.len(),
            2,
            "register {what}: registered something"
        );
    }

    // Opening.
    let seg = bounded("open_segment", tx.open_segment(&desc))
        .await
        .unwrap();
    let seg2 = bounded("open_segment again", tx.open_segment(&desc))
        .await
        .unwrap();
    assert_ne!(seg, seg2, "opening a descriptor twice gives two ids");
    for other in BackendKind::ALL.into_iter().filter(|&k| k != kind) {
        let mut d = desc.clone();
        d.backend = other;
        let r = bounded("open_segment", tx.open_segment(&d)).await;
        assert!(
            matches!(r, Err(TransferError::BadSegment(_))),
            "a {other} descriptor: {r:?}"
        );
    }

    // Bad batches: typed errors, nothing moves.
    let ok = TransferBlock {
        src_region: 0,
        src_offset: 0,
        dst_region: 0,
        dst_offset: 0,
        len: 64,
    };
    let bad_cases: Vec<(&str, TransferBlock, TransferError)> = vec![
        (
            "unknown source region",
            TransferBlock {
                src_region: 9,
                ..ok
            },
            TransferError::UnknownRegion {
                side: "source",
                region: 9,
            },
        ),
        (
            "unknown destination region",
            TransferBlock {
                dst_region: 7,
                ..ok
            },
            TransferError::UnknownRegion {
                side: "destination",
                region: 7,
            },
        ),
        (
            "source out of bounds",
            TransferBlock {
                src_offset: small as u64 - 8,
                ..ok
            },
            TransferError::OutOfBounds {
                side: "source",
                region: 0,
                offset: small as u64 - 8,
                end: small as u64 + 56,
                len: small as u64,
            },
        ),
        (
            "destination out of bounds",
            TransferBlock {
                dst_region: 1,
                dst_offset: big as u64,
                len: 1,
                ..ok
            },
            TransferError::OutOfBounds {
                side: "destination",
                region: 1,
                offset: big as u64,
                end: big as u64 + 1,
                len: big as u64,
            },
        ),
        (
            "an overflowing offset",
            TransferBlock {
                dst_offset: u64::MAX,
                ..ok
            },
            TransferError::OutOfBounds {
                side: "destination",
                region: 0,
                offset: u64::MAX,
                end: u64::MAX,
                len: small as u64,
            },
        ),
    ];
    for (what, block, want) in bad_cases {
        // A good block first: the batch is refused whole.
        let r = bounded("submit", tx.submit(seg, vec![ok, block])).await;
        assert_eq!(r, Err(want), "submit with {what}");
    }
    let unknown = SegmentId(u64::MAX);
    assert_eq!(
        bounded("submit", tx.submit(unknown, vec![ok])).await,
        Err(TransferError::UnknownSegment(unknown)),
        "submit to an unknown segment"
    );
    assert_eq!(
        bounded("close", tx.close_segment(unknown)).await,
        Err(TransferError::UnknownSegment(unknown))
    );
    let never = crate::BatchId(u64::MAX);
    assert_eq!(tx.poll(never), Err(TransferError::UnknownBatch(never)));
    assert_eq!(
        bounded("wait", tx.wait(never)).await,
        Err(TransferError::UnknownBatch(never))
    );
    assert!(
        dst_mem.to_vec().iter().all(|&b| b == 0),
        "refused batches moved bytes"
    );

    // Data: 16 concurrent batches of random blocks into disjoint 4 KiB slots of the small
    // region, a zero-length block, and one block spanning several frames, unaligned.
    let mut want = [bytes(&dst_mem, 0), bytes(&dst_mem, 1)];
    let src_bytes = [bytes(&src_mem, 0), bytes(&src_mem, 1)];
    let mut slots: Vec<usize> = (0..small / 4096).collect();
    rng.shuffle(&mut slots);
    let mut batches = Vec::new();
    for chunk in slots.chunks(4) {
        let mut blocks = Vec::new();
        for &s in chunk {
            let len = 1 + rng.below(4096);
            let (sr, soff) = if rng.below(2) == 0 {
                (0, rng.below(small - len))
            } else {
                (1, rng.below(big - len))
            };
            let doff = s * 4096 + rng.below(4096 - len + 1);
            blocks.push(TransferBlock {
                src_region: sr,
                src_offset: soff as u64,
                dst_region: 0,
                dst_offset: doff as u64,
                len: len as u64,
            });
            want[0][doff..doff + len].copy_from_slice(&src_bytes[sr as usize][soff..soff + len]);
        }
        blocks.push(TransferBlock { len: 0, ..ok });
        batches.push(bounded("submit", tx.submit(seg, blocks)).await.unwrap());
    }
    let span = big - 3;
    batches.push(
        bounded(
            "submit",
            tx.submit(
                seg2,
                vec![TransferBlock {
                    src_region: 1,
                    src_offset: 2,
                    dst_region: 1,
                    dst_offset: 1,
                    len: span as u64,
                }],
            ),
        )
        .await
        .unwrap(),
    );
    want[1][1..1 + span].copy_from_slice(&src_bytes[1][2..2 + span]);
    let zero = bounded(
        "submit",
        tx.submit(seg, vec![TransferBlock { len: 0, ..ok }]),
    )
    .await
    .unwrap();
    batches.push(zero);
    for b in batches {
        assert_eq!(bounded("wait", tx.wait(b)).await, Ok(()), "batch {b:?}");
        assert_eq!(
            tx.poll(b),
            Err(TransferError::UnknownBatch(b)),
            "a reaped batch"
        );
    }
    if moves_data {
        assert!(
            bytes(&dst_mem, 0) == want[0],
            "bytes landed wrong in the small region"
        );
        assert!(
            bytes(&dst_mem, 1) == want[1],
            "bytes landed wrong in the frame-spanning block"
        );
        assert!(
            dst_mem.to_vec()[small..at[1]].iter().all(|&b| b == 0),
            "bytes landed between the regions"
        );
    } else {
        assert!(
            dst_mem.to_vec().iter().all(|&b| b == 0),
            "a backend that moves no data wrote the destination"
        );
    }

    // Poll lifecycle.
    let b = bounded("submit", tx.submit(seg, vec![ok])).await.unwrap();
    let status = bounded("poll until done", async {
        loop {
            match tx.poll(b).unwrap() {
                BatchStatus::Pending => tokio::time::sleep(Duration::from_millis(1)).await,
                other => break other,
            }
        }
    })
    .await;
    assert_eq!(status, BatchStatus::Done, "poll");
    assert_eq!(
        tx.poll(b),
        Err(TransferError::UnknownBatch(b)),
        "poll after Done"
    );
    assert_eq!(
        bounded("wait", tx.wait(b)).await,
        Err(TransferError::UnknownBatch(b))
    );

    // close_segment: a large batch in flight settles (Done if it won the race, else Failed).
    let big_block = TransferBlock {
        src_region: 1,
        src_offset: 0,
        dst_region: 1,
        dst_offset: 0,
        len: big as u64,
    };
    let b = bounded("submit", tx.submit(seg2, vec![big_block]))
        .await
        .unwrap();
    bounded("close", tx.close_segment(seg2)).await.unwrap();
    let _ = bounded("wait after close", tx.wait(b)).await;
    assert_eq!(
        bounded("submit", tx.submit(seg2, vec![ok])).await,
        Err(TransferError::UnknownSegment(seg2)),
        "submit to a closed segment"
    );
    assert_eq!(
        bounded("close", tx.close_segment(seg2)).await,
        Err(TransferError::UnknownSegment(seg2)),
        "closing twice"
    );
    bounded("close", tx.close_segment(seg)).await.unwrap();
    drop((tx, rx));
}
