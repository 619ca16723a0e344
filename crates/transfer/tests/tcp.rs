//! tcp-specific failure behaviour: a corrupted frame fails its batch, a dead peer fails what is
//! in flight (never a hang).

use std::sync::Arc;
use std::time::Duration;

use transfer::testing::TestMemory;
use transfer::{
    new_engine, BackendKind, TransferBlock, TransferConfig, TransferEngine, TransferError,
};

fn engine(cfg: &TransferConfig) -> Arc<dyn TransferEngine> {
    new_engine(BackendKind::Tcp, cfg).unwrap()
}

async fn bounded<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("no answer within 30 s: a hang")
}

fn block(len: u64) -> TransferBlock {
    TransferBlock {
        src_region: 0,
        src_offset: 0,
        dst_region: 0,
        dst_offset: 0,
        len,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_frame_fails_its_batch_and_later_frames_land() {
    let (src, dst) = (TestMemory::new(1 << 20), TestMemory::new(1 << 20));
    src.write(0, &[7u8; 1 << 20]);
    let cfg = TransferConfig {
        corrupt_frame: Some(1),
        streams: 1,
        ..TransferConfig::default()
    };
    let (tx, rx) = (engine(&cfg), engine(&TransferConfig::default()));
    // SAFETY: the memory outlives the engines and is read only between batches.
    unsafe { tx.register(&[src.region()]).unwrap() };
    // SAFETY: as above.
    unsafe { rx.register(&[dst.region()]).unwrap() };
    let seg = bounded(tx.open_segment(&rx.segment())).await.unwrap();
    // Frame 0 is intact, frame 1 (small: staged) is flipped, frame 2 is intact again.
    let first = bounded(tx.submit(seg, vec![block(1000)])).await.unwrap();
    assert_eq!(bounded(tx.wait(first)).await, Ok(()));
    let bad = TransferBlock {
        dst_offset: 4096,
        ..block(1000)
    };
    let b = bounded(tx.submit(seg, vec![bad])).await.unwrap();
    assert_eq!(
        bounded(tx.wait(b)).await,
        Err(TransferError::Corrupted {
            region: 0,
            offset: 4096
        })
    );
    let next = bounded(tx.submit(seg, vec![block(1 << 20)])).await.unwrap();
    assert_eq!(
        bounded(tx.wait(next)).await,
        Ok(()),
        "the stream stays usable"
    );
    assert!(dst.to_vec().iter().all(|&b| b == 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_large_frame_is_detected_too() {
    let (src, dst) = (TestMemory::new(8 << 20), TestMemory::new(8 << 20));
    let cfg = TransferConfig {
        corrupt_frame: Some(0),
        ..TransferConfig::default()
    };
    let (tx, rx) = (engine(&cfg), engine(&TransferConfig::default()));
    // SAFETY: the memory outlives the engines.
    unsafe { tx.register(&[src.region()]).unwrap() };
    // SAFETY: as above.
    unsafe { rx.register(&[dst.region()]).unwrap() };
    let seg = bounded(tx.open_segment(&rx.segment())).await.unwrap();
    let b = bounded(tx.submit(seg, vec![block(8 << 20)])).await.unwrap();
    let r = bounded(tx.wait(b)).await;
    assert!(
        matches!(r, Err(TransferError::Corrupted { region: 0, .. })),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_dropped_mid_batch_fails_it_instead_of_hanging() {
    let len = 64 << 20;
    let (src, dst) = (TestMemory::new(len), TestMemory::new(len));
    let (tx, rx) = (
        engine(&TransferConfig::default()),
        engine(&TransferConfig::default()),
    );
    // SAFETY: the memory outlives the engines.
    unsafe { tx.register(&[src.region()]).unwrap() };
    // SAFETY: as above.
    unsafe { rx.register(&[dst.region()]).unwrap() };
    let seg = bounded(tx.open_segment(&rx.segment())).await.unwrap();
    let b = bounded(tx.submit(seg, vec![block(len as u64)]))
        .await
        .unwrap();
    drop(rx);
    let r = bounded(tx.wait(b)).await;
    assert!(
        matches!(r, Err(TransferError::PeerUnreachable { .. })),
        "{r:?}"
    );
    // The dead stream fails new batches at once.
    let b = bounded(tx.submit(seg, vec![block(4096)])).await.unwrap();
    let r = bounded(tx.wait(b)).await;
    assert!(
        matches!(r, Err(TransferError::PeerUnreachable { .. })),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_listener_is_unreachable() {
    let rx = engine(&TransferConfig::default());
    let desc = rx.segment();
    drop(rx);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let tx = engine(&TransferConfig::default());
    let r = bounded(tx.open_segment(&desc)).await;
    assert!(
        matches!(r, Err(TransferError::PeerUnreachable { .. })),
        "{r:?}"
    );
}
