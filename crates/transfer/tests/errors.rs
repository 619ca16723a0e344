//! What a user reads for each bad input: the errors' messages, one line per case.

use std::fmt::Write as _;

use transfer::testing::TestMemory;
use transfer::{new_engine, BackendKind, BatchId, SegmentId, TransferBlock, TransferConfig};

#[tokio::test]
async fn error_messages_snapshot() {
    let cfg = TransferConfig::default();
    let (tx, rx) = (
        new_engine(BackendKind::Tcp, &cfg).unwrap(),
        new_engine(BackendKind::Tcp, &cfg).unwrap(),
    );
    let (src, dst) = (TestMemory::new(4096), TestMemory::new(4096));
    // SAFETY: the memory outlives the engines.
    unsafe { tx.register(&[src.region()]).unwrap() };
    // SAFETY: as above.
    unsafe { rx.register(&[dst.region()]).unwrap() };
    let mut desc = rx.segment();
    let seg = tx.open_segment(&desc).await.unwrap();
    let ok = TransferBlock {
        src_region: 0,
        src_offset: 0,
        dst_region: 0,
        dst_offset: 0,
        len: 16,
    };
    let mut out = String::new();
    let cases = [
        (
            "unknown source region",
            TransferBlock {
                src_region: 3,
                ..ok
            },
        ),
        (
            "unknown destination region",
            TransferBlock {
                dst_region: 3,
                ..ok
            },
        ),
        (
            "source out of bounds",
            TransferBlock {
                src_offset: 4090,
                ..ok
            },
        ),
        (
            "destination overflow",
            TransferBlock {
                dst_offset: u64::MAX,
                ..ok
            },
        ),
    ];
    for (what, b) in cases {
        let e = tx.submit(seg, vec![b]).await.unwrap_err();
        writeln!(out, "{what}: {e}").unwrap();
    }
    let e = tx.submit(SegmentId(99), vec![ok]).await.unwrap_err();
    writeln!(out, "unknown segment: {e}").unwrap();
    writeln!(out, "unknown batch: {}", tx.poll(BatchId(99)).unwrap_err()).unwrap();
    // SAFETY: refused: nothing is registered.
    let e = unsafe { rx.register(&[dst.region()]) }.unwrap_err();
    let e = e.to_string();
    let e = e.split(" (").next().unwrap(); // addresses vary per run
    writeln!(out, "overlapping registration: {e}").unwrap();
    desc.backend = BackendKind::Shm;
    let e = tx.open_segment(&desc).await.unwrap_err();
    writeln!(out, "another backend's descriptor: {e}").unwrap();
    let e = new_engine(BackendKind::Nixl, &cfg).unwrap_err();
    writeln!(out, "backend not compiled: {e}").unwrap();
    insta::assert_snapshot!(out);
}
