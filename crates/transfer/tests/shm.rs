//! shm across two real processes: this test binary runs itself as the sending child.

use std::process::Command;
use std::sync::Arc;

use transfer::shm::SharedMemory;
use transfer::testing::TestMemory;
use transfer::{
    new_engine, BackendKind, SegmentDesc, TransferBlock, TransferConfig, TransferEngine,
};

const CHILD: &str = "KVSERVE_SHM_TEST_CHILD";
const LEN: usize = 6 << 20;

fn engine() -> Arc<dyn TransferEngine> {
    new_engine(BackendKind::Shm, &TransferConfig::default()).unwrap()
}

fn pattern(i: usize) -> u8 {
    (i * 31 % 251) as u8
}

/// The child: maps the parent's segment, sends `LEN - 1` bytes of a pattern to offset 1.
#[test]
fn child_sender() {
    let Ok(desc) = std::env::var(CHILD) else {
        return; // only meaningful when spawned by the parent test
    };
    let desc: SegmentDesc = serde_json::from_str(&desc).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let tx = engine();
        let src = TestMemory::new(LEN);
        src.write(0, &(0..LEN).map(pattern).collect::<Vec<_>>());
        // SAFETY: the memory outlives the engine.
        unsafe { tx.register(&[src.region()]).unwrap() };
        let seg = tx.open_segment(&desc).await.unwrap();
        let b = tx
            .submit(
                seg,
                vec![TransferBlock {
                    src_region: 0,
                    src_offset: 0,
                    dst_region: 0,
                    dst_offset: 1,
                    len: (LEN - 1) as u64,
                }],
            )
            .await
            .unwrap();
        tx.wait(b).await.unwrap();
    });
}

#[tokio::test]
async fn bytes_written_by_another_process_land_in_our_shared_memory() {
    let mem = SharedMemory::create(LEN).unwrap();
    assert!(mem.path().starts_with("/proc/"));
    let rx = engine();
    let region = kv_pool::MemoryRegion {
        layer: 0,
        buffer: kv_pool::KvBuffer::Key,
        addr: mem.as_ptr() as usize,
        len_bytes: LEN,
        item_len: 1,
    };
    // SAFETY: `mem` outlives the engine; we read it only after the child exited.
    unsafe { rx.register(&[region]).unwrap() };
    let desc = rx.segment();
    assert_eq!(desc.regions[0].base, 0);
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_sender", "--nocapture", "--test-threads=1"])
        .env(CHILD, serde_json::to_string(&desc).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: the child has exited; nothing else writes the memory.
    let got = unsafe { std::slice::from_raw_parts(mem.as_ptr(), LEN) };
    assert_eq!(got[0], 0);
    assert!((1..LEN).all(|i| got[i] == pattern(i - 1)));
}

#[test]
fn a_store_lives_in_shared_memory() {
    use kv_pool::{HostKvStore, KvDtype, KvLayout, KvShape, KvStore};
    let layout = KvLayout::new(KvShape::mha(2, 8, 4, 2, KvDtype::F16).unwrap(), 4, 64).unwrap();
    let mem = SharedMemory::create(layout.total_bytes()).unwrap();
    let base = mem.as_ptr() as usize;
    let store = HostKvStore::with_memory(layout, Box::new(mem)).unwrap();
    let regions = store.memory_regions();
    assert!(regions.iter().all(|r| r.addr >= base));
    // Every region lies in the one mapping: a shm engine advertises them all.
    let rx = engine();
    // SAFETY: the store outlives the engine.
    unsafe { rx.register(&regions).unwrap() };
    assert!(rx.segment().regions.iter().all(|r| r.base != u64::MAX));
    assert!(SharedMemory::create(0).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_batch_is_copied_over_several_threads_exactly() {
    let len = 40 << 20; // three copy threads at 16 MiB each
    let (src, dst) = (TestMemory::new(len), SharedMemory::create(len).unwrap());
    src.write(0, &(0..len).map(pattern).collect::<Vec<_>>());
    let (tx, rx) = (engine(), engine());
    let region = kv_pool::MemoryRegion {
        layer: 0,
        buffer: kv_pool::KvBuffer::Key,
        addr: dst.as_ptr() as usize,
        len_bytes: len,
        item_len: 1,
    };
    // SAFETY: both memories outlive the engines; read only after the batch.
    unsafe {
        tx.register(&[src.region()]).unwrap();
        rx.register(&[region]).unwrap();
    }
    let seg = tx.open_segment(&rx.segment()).await.unwrap();
    let blocks = (0..len / (1 << 20))
        .map(|i| TransferBlock {
            src_region: 0,
            src_offset: (i << 20) as u64,
            dst_region: 0,
            dst_offset: (len - ((i + 1) << 20)) as u64, // reversed order
            len: 1 << 20,
        })
        .collect();
    let b = tx.submit(seg, blocks).await.unwrap();
    tx.wait(b).await.unwrap();
    // SAFETY: the batch is done; nothing writes `dst` now.
    let got = unsafe { std::slice::from_raw_parts(dst.as_ptr(), len) };
    for i in 0..len / (1 << 20) {
        let d = len - ((i + 1) << 20);
        assert!(
            (0..1 << 20).all(|j| got[d + j] == pattern((i << 20) + j)),
            "block {i}"
        );
    }
}
