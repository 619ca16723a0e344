//! The PD protocol over the real backends (`tcp`, `shm`): the decode's KV store lives where the
//! backend can write it (a `SharedMemory` mapping for shm), and pages land byte for byte.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{compat_of, fast_config, layout, pages, until};
use kv_pool::{HostKvStore, KvLayout, KvStore, Page};
use transfer::pd::{KvManager, KvPoll, PdRole, TransferAux};
use transfer::{new_engine, BackendKind, TransferConfig, TransferEngine};

const SECS: Duration = Duration::from_secs(20);

struct Server {
    store: HostKvStore,
    _engine: Arc<dyn TransferEngine>,
    mgr: KvManager,
}

fn server(role: PdRole, kind: BackendKind, l: KvLayout, cfg: &TransferConfig) -> Server {
    let engine = new_engine(kind, cfg).unwrap();
    let store = if kind == BackendKind::Shm && role == PdRole::Decode {
        let mem = transfer::shm::SharedMemory::create(l.total_bytes()).unwrap();
        HostKvStore::with_memory(l, Box::new(mem)).unwrap()
    } else {
        HostKvStore::new(l).unwrap()
    };
    let regions = store.memory_regions();
    // SAFETY: the store lives in the Server beside the engine and the manager, and its buffers
    // never move (heap or shared mapping); the test reads them only after transfers ended.
    let ids = unsafe { engine.register(&regions) }.unwrap();
    let mgr = KvManager::start(
        fast_config(role),
        compat_of(&l, kind),
        engine.clone(),
        ids.into_iter().zip(regions).collect(),
        tokio::runtime::Handle::current(),
    )
    .unwrap();
    Server {
        store,
        _engine: engine,
        mgr,
    }
}

fn fill(s: &mut Server, p: &[Page], seed: u8) {
    let pb = s.store.layout().page_bytes();
    let data: Vec<u8> = (0..p.len() * pb)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect();
    s.store.write_pages(p, &data).unwrap();
}

fn read(s: &Server, p: &[Page]) -> Vec<u8> {
    let mut out = vec![0; p.len() * s.store.layout().page_bytes()];
    s.store.read_pages(p, &mut out).unwrap();
    out
}

fn aux(room: u64) -> Option<TransferAux> {
    Some(TransferAux {
        first_token_ids: vec![7],
        cached_tokens: 0,
        bootstrap_room: room,
    })
}

async fn chunked_incremental_transfer(kind: BackendKind) {
    let l = layout(4, 64);
    let cfg = TransferConfig::default();
    let mut prefill = server(PdRole::Prefill, kind, l, &cfg);
    let decode = server(PdRole::Decode, kind, l, &cfg);
    let boot = prefill.mgr.bootstrap_addr().unwrap().to_string();
    for (room, prefix) in [(1u64, 0usize), (2, 8)] {
        let src = pages([10, 11, 12, 20, 21]);
        let dst = pages([40, 41, 3, 4, 5]);
        fill(&mut prefill, &src, room as u8);
        let rx = decode.mgr.create_receiver(room, &boot).unwrap();
        let tx = prefill.mgr.create_sender(room).unwrap();
        until("connected", SECS, || rx.poll() == KvPoll::WaitingForInput).await;
        rx.send_metadata(dst.clone(), prefix).unwrap();
        until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
        assert_eq!(tx.transfer_info().unwrap().decode_prefix_len, prefix);
        tx.send(&src[..2], None).unwrap();
        tx.send(&src[2..], aux(room)).unwrap();
        until("success", SECS, || rx.poll() == KvPoll::Success).await;
        assert_eq!(tx.poll(), KvPoll::Success);
        assert_eq!(
            read(&decode, &dst),
            read(&prefill, &src),
            "{kind} room {room}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_land_over_tcp() {
    chunked_incremental_transfer(BackendKind::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_land_over_shm() {
    chunked_incremental_transfer(BackendKind::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_tcp_frame_fails_the_room_on_both_sides() {
    let l = layout(4, 16);
    let bad = TransferConfig {
        corrupt_frame: Some(0),
        ..TransferConfig::default()
    };
    let prefill = server(PdRole::Prefill, BackendKind::Tcp, l, &bad);
    let decode = server(
        PdRole::Decode,
        BackendKind::Tcp,
        l,
        &TransferConfig::default(),
    );
    let boot = prefill.mgr.bootstrap_addr().unwrap().to_string();
    let rx = decode.mgr.create_receiver(9, &boot).unwrap();
    let tx = prefill.mgr.create_sender(9).unwrap();
    until("connected", SECS, || rx.poll() == KvPoll::WaitingForInput).await;
    rx.send_metadata(pages([1, 2]), 0).unwrap();
    until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
    tx.send(&pages([3, 4]), aux(9)).unwrap();
    until("decode fails", SECS, || rx.poll() == KvPoll::Failed).await;
    assert_eq!(tx.poll(), KvPoll::Failed);
    let why = rx.failure().unwrap();
    assert!(why.contains("corrupted"), "{why}");
    assert!(rx.quiescent());
}
