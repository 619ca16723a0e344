//! The `nixl` backend (feature `nixl`).
//!
//! Without a NIXL library (CI builds `nixl-sys` with its stub API), the engine must refuse with
//! a typed error naming NIXL, never abort or panic. With one loaded — e.g. `pip install
//! nixl-cu12` and `LD_LIBRARY_PATH=<site-packages>/.nixl_cu12.mesonpy.libs` — two agents move
//! bytes through UCX, in this process and between this process and a child (this test binary
//! again); those tests print why they skip when NIXL is absent, and fail instead when
//! `KVSERVE_REQUIRE_NIXL=1`.
#![cfg(feature = "nixl")]

use std::time::{Duration, Instant};

use kv_pool::{KvBuffer, MemoryRegion};
use transfer::nixl::{self, NixlConfig, NixlTransferEngine};
use transfer::{
    BackendKind, BatchStatus, SegmentDesc, TransferBlock, TransferEngine, TransferError,
};

/// Whether a real NIXL is loaded; otherwise prints why the caller skips (or fails under
/// `KVSERVE_REQUIRE_NIXL=1`).
fn real_nixl(test: &str) -> bool {
    if nixl::available() {
        return true;
    }
    assert!(
        std::env::var("KVSERVE_REQUIRE_NIXL").as_deref() != Ok("1"),
        "{test}: KVSERVE_REQUIRE_NIXL=1 but no NIXL library is loaded (libnixl_capi.so is not \
         on LD_LIBRARY_PATH)"
    );
    eprintln!("{test}: skipped: no NIXL library loaded (libnixl_capi.so not on LD_LIBRARY_PATH)");
    false
}

#[test]
fn without_nixl_the_engine_is_a_typed_error() {
    if nixl::available() {
        eprintln!("a real NIXL is loaded: the stub refusal cannot be seen in this process");
        return;
    }
    let e = NixlTransferEngine::new(NixlConfig::new("kvserve-test")).unwrap_err();
    assert!(
        matches!(
            &e,
            TransferError::Backend {
                backend: BackendKind::Nixl,
                ..
            }
        ),
        "{e:?}"
    );
    insta::assert_snapshot!(e.to_string());
}

/// Heap bytes handed to NIXL by address (so NIXL's writes never alias a Rust reference).
struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    fn new(len: usize, fill: impl Fn(usize) -> u8) -> Self {
        let bytes: Box<[u8]> = (0..len).map(fill).collect();
        let ptr = Box::into_raw(bytes).cast::<u8>();
        Self { ptr, len }
    }

    fn region(&self, layer: usize) -> MemoryRegion {
        MemoryRegion {
            layer,
            buffer: KvBuffer::Key,
            addr: self.ptr as usize,
            len_bytes: self.len,
            item_len: 64,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        // SAFETY: `ptr..ptr + len` is the live allocation made in `new`; no batch is in flight
        // when tests read it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` come from `Box::into_raw` of a `Box<[u8]>` of that length, freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

fn engine(name: &str) -> NixlTransferEngine {
    NixlTransferEngine::new(NixlConfig::unique(name)).expect("a NIXL engine")
}

fn block(src: u32, src_offset: u64, dst: u32, dst_offset: u64, len: u64) -> TransferBlock {
    TransferBlock {
        src_region: src,
        src_offset,
        dst_region: dst,
        dst_offset,
        len,
    }
}

/// The conformance suite every backend passes, on two NIXL agents.
#[test]
fn nixl_passes_the_transfer_engine_conformance_suite() {
    if !real_nixl("nixl_passes_the_transfer_engine_conformance_suite") {
        return;
    }
    transfer::testing::check_transfer_engine(
        || {
            std::sync::Arc::new(
                NixlTransferEngine::new(NixlConfig::unique("127.0.0.1")).expect("a NIXL agent"),
            )
        },
        true,
    );
}

/// What the suite does not cover: NIXL's notifications (one per batch, from the sender's
/// agent), a batch polled to completion, and the descriptor's agent name and bases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_moves_bytes_between_two_agents() {
    if !real_nixl("nixl_moves_bytes_between_two_agents") {
        return;
    }
    // Buffers first, so they outlive the engines (dropped in reverse order).
    let src = [
        Buf::new(4096, |i| (i % 251) as u8),
        Buf::new(1024, |i| (i % 13) as u8 + 100),
    ];
    let dst = [Buf::new(4096, |_| 0), Buf::new(2048, |_| 0)];
    let (sender, receiver) = (engine("send"), engine("recv"));
    // SAFETY: the buffers outlive both engines and are read only when no batch is in flight.
    let ids = unsafe { sender.register(&[src[0].region(0), src[1].region(1)]) }.unwrap();
    assert_eq!(ids, vec![0, 1]);
    // SAFETY: as above.
    let ids = unsafe { receiver.register(&[dst[0].region(0), dst[1].region(1)]) }.unwrap();
    assert_eq!(ids, vec![0, 1]);

    let desc = receiver.segment();
    assert_eq!(desc.backend, BackendKind::Nixl);
    assert_eq!(desc.endpoint, receiver.agent_name());
    assert_eq!(desc.regions.len(), 2);
    assert_eq!(desc.regions[1].base, dst[1].ptr as u64);
    assert_eq!(desc.regions[1].len, 2048);
    let seg = sender.open_segment(&desc).await.unwrap();

    // Two regions, an empty block, both directions of region pairing; awaited.
    let blocks = vec![
        block(0, 0, 0, 64, 256),
        block(1, 10, 1, 2000, 48),
        block(0, 100, 1, 0, 0),
        block(0, 4000, 0, 0, 64),
    ];
    let batch = sender.submit(seg, blocks.clone()).await.unwrap();
    sender.wait(batch).await.unwrap();
    assert_eq!(sender.poll(batch), Err(TransferError::UnknownBatch(batch)));
    let mut want = [vec![0u8; 4096], vec![0u8; 2048]];
    let have_src = [src[0].bytes(), src[1].bytes()];
    for b in &blocks {
        let (s, d) = (b.src_offset as usize, b.dst_offset as usize);
        let n = b.len as usize;
        want[b.dst_region as usize][d..d + n]
            .copy_from_slice(&have_src[b.src_region as usize][s..s + n]);
    }
    assert_eq!(dst[0].bytes(), want[0]);
    assert_eq!(dst[1].bytes(), want[1]);

    // Polled to completion instead of awaited.
    let batch = sender
        .submit(seg, vec![block(0, 512, 0, 1024, 1024)])
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match sender.poll(batch).unwrap() {
            BatchStatus::Done => break,
            BatchStatus::Pending => assert!(Instant::now() < deadline, "batch never finished"),
            BatchStatus::Failed(e) => panic!("batch failed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(&dst[0].bytes()[1024..2048], &src[0].bytes()[512..1536]);

    // An empty batch is done at once.
    let batch = sender.submit(seg, Vec::new()).await.unwrap();
    assert_eq!(sender.poll(batch), Ok(BatchStatus::Done));

    // Each write is announced to the receiver.
    let deadline = Instant::now() + Duration::from_secs(10);
    while receiver.notifications_received() < 2 {
        assert!(Instant::now() < deadline, "no notification arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let notes = receiver.take_notifications().unwrap();
    assert!(
        notes.iter().all(|n| n.from == sender.agent_name()),
        "{notes:?}"
    );
    let mut messages: Vec<_> = notes.iter().map(|n| n.message.as_str()).collect();
    messages.sort_unstable();
    assert_eq!(messages, ["kvserve batch 0", "kvserve batch 1"]);

    sender.close_segment(seg).await.unwrap();
    assert_eq!(
        sender.submit(seg, vec![block(0, 0, 0, 0, 8)]).await,
        Err(TransferError::UnknownSegment(seg))
    );
    assert_eq!(
        sender.close_segment(seg).await,
        Err(TransferError::UnknownSegment(seg))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_refuses_bad_input_before_moving_bytes() {
    if !real_nixl("nixl_refuses_bad_input_before_moving_bytes") {
        return;
    }
    let src = Buf::new(256, |i| i as u8);
    let dst = Buf::new(256, |_| 0);
    let (sender, receiver) = (engine("send"), engine("recv"));
    // SAFETY: the buffers outlive both engines and are read only when no batch is in flight.
    unsafe { sender.register(&[src.region(0)]) }.unwrap();
    // SAFETY: as above.
    unsafe { receiver.register(&[dst.region(0)]) }.unwrap();

    // Registration: overlap and null refused whole, the segment unchanged.
    let overlapping = MemoryRegion {
        addr: src.ptr as usize + 8,
        len_bytes: 8,
        ..src.region(1)
    };
    // SAFETY: refused before anything is registered.
    let e = unsafe { sender.register(&[overlapping]) }.unwrap_err();
    assert!(matches!(e, TransferError::BadRegion(_)), "{e}");
    assert_eq!(sender.segment().regions.len(), 1);

    // Descriptors NIXL must not be handed.
    let good = receiver.segment();
    let tcp = SegmentDesc {
        backend: BackendKind::Tcp,
        ..good.clone()
    };
    assert!(matches!(
        sender.open_segment(&tcp).await,
        Err(TransferError::BadSegment(_))
    ));
    let garbage = SegmentDesc {
        metadata: vec![7; 64],
        ..good.clone()
    };
    let e = sender.open_segment(&garbage).await.unwrap_err();
    assert!(matches!(e, TransferError::Backend { .. }), "{e}");
    let renamed = SegmentDesc {
        endpoint: "someone-else".to_string(),
        ..good.clone()
    };
    let e = sender.open_segment(&renamed).await.unwrap_err();
    assert!(matches!(e, TransferError::BadSegment(_)), "{e}");

    // A batch with one bad block moves nothing.
    let seg = sender.open_segment(&good).await.unwrap();
    let e = sender
        .submit(seg, vec![block(0, 0, 0, 0, 16), block(0, 0, 0, 250, 16)])
        .await
        .unwrap_err();
    assert_eq!(
        e,
        TransferError::OutOfBounds {
            side: "destination",
            region: 0,
            offset: 250,
            end: 266,
            len: 256
        }
    );
    let e = sender
        .submit(seg, vec![block(0, 0, 3, 0, 16)])
        .await
        .unwrap_err();
    assert_eq!(
        e,
        TransferError::UnknownRegion {
            side: "destination",
            region: 3
        }
    );
    assert_eq!(dst.bytes(), vec![0; 256]);
    // The segment still works after the refusals.
    let batch = sender
        .submit(seg, vec![block(0, 0, 0, 0, 256)])
        .await
        .unwrap();
    sender.wait(batch).await.unwrap();
    assert_eq!(dst.bytes(), src.bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_fails_batches_of_a_closed_segment_or_a_dead_peer() {
    if !real_nixl("nixl_fails_batches_of_a_closed_segment_or_a_dead_peer") {
        return;
    }
    let src = Buf::new(1 << 20, |i| (i % 253) as u8);
    let dst = Buf::new(1 << 20, |_| 0);
    let mut cfg = NixlConfig::unique("send");
    cfg.wait_timeout = Duration::from_secs(10);
    let sender = NixlTransferEngine::new(cfg).unwrap();
    let receiver = engine("recv");
    // SAFETY: the buffers outlive both engines and are read only when no batch is in flight.
    unsafe { sender.register(&[src.region(0)]) }.unwrap();
    // SAFETY: as above.
    unsafe { receiver.register(&[dst.region(0)]) }.unwrap();
    let pages: Vec<_> = (0..256)
        .map(|i| block(0, i * 4096, 0, i * 4096, 4096))
        .collect();

    // Closed while pending: the batch fails (unless NIXL finished it within the post).
    let seg = sender.open_segment(&receiver.segment()).await.unwrap();
    let batch = sender.submit(seg, pages.clone()).await.unwrap();
    sender.close_segment(seg).await.unwrap();
    let status = sender.poll(batch).unwrap();
    assert!(
        status == BatchStatus::Done
            || status == BatchStatus::Failed(TransferError::UnknownSegment(seg)),
        "{status:?}"
    );
    assert_eq!(sender.poll(batch), Err(TransferError::UnknownBatch(batch)));

    // The peer went away: the write fails (at the post or in the wait), it never ends Done.
    let seg = sender.open_segment(&receiver.segment()).await.unwrap();
    drop(receiver);
    let outcome = match sender.submit(seg, pages).await {
        Ok(batch) => sender.wait(batch).await,
        Err(e) => Err(e),
    };
    let e = outcome.expect_err("a write to a dropped agent succeeded");
    assert!(matches!(e, TransferError::Backend { .. }), "{e}");
}

/// The receiving side of [`nixl_moves_bytes_between_two_processes`], run in a child process
/// (this test binary again, with `KVSERVE_NIXL_CHILD=1`); a no-op in a plain test run.
#[test]
fn nixl_child_receiver() {
    if std::env::var("KVSERVE_NIXL_CHILD").as_deref() != Ok("1") {
        return;
    }
    // Never outlive a parent that stopped talking: its reads then end instead of hanging.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(3);
    });
    let dst = Buf::new(CROSS_BYTES, |_| 0);
    let receiver = engine("child");
    // SAFETY: `dst` outlives the engine and is read only after the parent's batch is done.
    unsafe { receiver.register(&[dst.region(0)]) }.unwrap();
    println!(
        "SEGMENT {}",
        serde_json::to_string(&receiver.segment()).unwrap()
    );
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "DONE");
    println!("BYTES {}", fnv(&dst.bytes()));
}

const CROSS_BYTES: usize = 1 << 20;

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Kills the child if the test fails before it exits.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_moves_bytes_between_two_processes() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};

    if !real_nixl("nixl_moves_bytes_between_two_processes") {
        return;
    }
    let src = Buf::new(CROSS_BYTES, |i| (i * 7 % 251) as u8);
    let sender = engine("parent");
    // SAFETY: `src` outlives the engine.
    unsafe { sender.register(&[src.region(0)]) }.unwrap();

    let mut child = Child(
        Command::new(std::env::current_exe().unwrap())
            .args(["nixl_child_receiver", "--exact", "--nocapture"])
            .env("KVSERVE_NIXL_CHILD", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| -> String {
        for line in lines.by_ref() {
            if let Some(rest) = line.unwrap().strip_prefix(prefix) {
                return rest.to_string();
            }
        }
        panic!("the child exited before printing {prefix:?}");
    };
    let desc: SegmentDesc = serde_json::from_str(&next("SEGMENT ")).unwrap();
    let seg = sender.open_segment(&desc).await.unwrap();
    // Every other 4 KiB page, into the same place on the other side.
    let blocks: Vec<_> = (0..CROSS_BYTES as u64 / 8192)
        .map(|i| block(0, i * 8192, 0, i * 8192, 4096))
        .collect();
    let batch = sender.submit(seg, blocks).await.unwrap();
    sender.wait(batch).await.unwrap();
    writeln!(child.0.stdin.as_mut().unwrap(), "DONE").unwrap();

    let mut want = vec![0u8; CROSS_BYTES];
    for (i, (w, s)) in want.iter_mut().zip(src.bytes()).enumerate() {
        if i % 8192 < 4096 {
            *w = s;
        }
    }
    assert_eq!(next("BYTES "), fnv(&want).to_string());
    assert!(child.0.wait().unwrap().success());
}
