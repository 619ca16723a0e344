//! The PD protocol end to end in one process: two `KvManager`s (prefill and decode) over the
//! `MemcpyEngine` test double (tests/common), on loopback.

mod common;

use std::time::Duration;

use common::*;
use kv_pool::{KvStore, Page};
use transfer::pd::{KvPoll, KvReceiver, KvSender, PdError, PdRole, TransferAux, TransferInfo};
use transfer::BackendKind;

const P: u32 = 4;
const SECS: Duration = Duration::from_secs(10);

fn pair() -> (Side, Side) {
    pair_with(fast_config(PdRole::Prefill), fast_config(PdRole::Decode))
}

fn pair_with(pc: transfer::pd::PdConfig, dc: transfer::pd::PdConfig) -> (Side, Side) {
    let l = layout(P, 32);
    let c = compat_of(&l, BackendKind::Fake);
    let prefill = Side::start(pc, l, c.clone());
    let decode = Side::start(dc, l, c);
    (prefill, decode)
}

fn aux(room: u64) -> TransferAux {
    TransferAux {
        first_token_ids: vec![42],
        cached_tokens: 3,
        bootstrap_room: room,
    }
}

async fn handshake(prefill: &Side, decode: &Side, room: u64) -> (KvSender, KvReceiver) {
    let rx = decode
        .mgr
        .create_receiver(room, &prefill.bootstrap())
        .unwrap();
    let tx = prefill.mgr.create_sender(room).unwrap();
    until("decode connected", SECS, || {
        rx.poll() == KvPoll::WaitingForInput
    })
    .await;
    (tx, rx)
}

fn render(name: &str, h: &[KvPoll]) -> String {
    let names: Vec<&str> = h.iter().map(|s| s.name()).collect();
    format!("{name}: {}", names.join(" → "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_transfer_lands_every_page_and_the_aux() {
    let (mut prefill, decode) = pair();
    let src = pages([3, 4, 5, 9]);
    let dst = pages([7, 8, 2, 3]);
    prefill.fill(&src, 1);
    let (tx, rx) = handshake(&prefill, &decode, 7).await;
    assert_eq!(tx.poll(), KvPoll::Bootstrapping);
    assert_eq!(tx.transfer_info(), None);
    rx.send_metadata(dst.clone(), 0).unwrap();
    until("prefill handshake", SECS, || {
        tx.poll() == KvPoll::WaitingForInput
    })
    .await;
    assert_eq!(
        tx.transfer_info(),
        Some(TransferInfo {
            decode_prefix_len: 0,
            num_pages: 4
        })
    );
    tx.send(&src, Some(aux(7))).unwrap();
    until("decode success", SECS, || rx.poll() == KvPoll::Success).await;
    assert_eq!(tx.poll(), KvPoll::Success);
    assert_eq!(rx.aux(), Some(aux(7)));
    assert!(rx.quiescent());
    assert_eq!(decode.read(&dst), prefill.read(&src));
    // Runs (3,7)x2 (5,2)x1 (9,3)x1, over 4 regions (K, V of 2 layers): 12 blocks.
    assert_eq!(
        prefill
            .engine
            .submitted_blocks
            .load(std::sync::atomic::Ordering::Relaxed),
        12
    );
    let text = format!(
        "{}\n{}\n",
        render("prefill r7", &tx.history()),
        render("decode r7", &rx.history())
    );
    insta::assert_snapshot!(text, @r"
    prefill r7: Bootstrapping → WaitingForInput → Transferring → Success
    decode r7: Bootstrapping → WaitingForInput → Transferring → Success
    ");
    let (ps, ds) = (prefill.mgr.stats(), decode.mgr.stats());
    let bytes = 4 * prefill.store.layout().page_bytes() as u64;
    assert_eq!((ps.success_total, ps.bytes), (1, bytes));
    assert_eq!((ds.success_total, ds.bytes, ds.peers), (1, bytes, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_chunked_transfer_sends_only_the_missing_pages() {
    let (mut prefill, mut decode) = pair();
    // Decode holds the first 2 pages (8 tokens) already; the prompt has 5 pages.
    let held = pages([10, 11]);
    decode.fill(&held, 9);
    let before = decode.read(&held);
    let src = pages([1, 2, 3]);
    let dst = pages([20, 21, 22]);
    prefill.fill(&src, 2);
    // The router sends to both at once: metadata may reach prefill before its sender exists.
    let rx = decode
        .mgr
        .create_receiver(11, &prefill.bootstrap())
        .unwrap();
    until("decode connected", SECS, || {
        rx.poll() == KvPoll::WaitingForInput
    })
    .await;
    rx.send_metadata(dst.clone(), 2 * P as usize).unwrap();
    until("prefill keeps the early TransferInfo", SECS, || {
        prefill.mgr.stats().pending_infos == 1
    })
    .await;
    let tx = prefill.mgr.create_sender(11).unwrap();
    assert_eq!(tx.poll(), KvPoll::WaitingForInput);
    assert_eq!(tx.transfer_info().unwrap().decode_prefix_len, 8);
    tx.send(&src[..1], None).unwrap();
    tx.send(&src[1..2], None).unwrap();
    assert_eq!(tx.poll(), KvPoll::Transferring);
    tx.send(&src[2..], Some(aux(11))).unwrap();
    until("decode success", SECS, || rx.poll() == KvPoll::Success).await;
    assert_eq!(decode.read(&dst), prefill.read(&src));
    assert_eq!(
        decode.read(&held),
        before,
        "pages decode held are untouched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_rooms_at_once_all_succeed() {
    let (mut prefill, decode) = pair();
    let mut rooms = Vec::new();
    for i in 0..12u32 {
        let room = 1000 + i as u64;
        let src = pages([1 + i * 2, 2 + i * 2]);
        // Reversed and distinct per room: runs break on the destination side.
        let dst = pages([31 - 2 * i, 30 - 2 * i]);
        prefill.fill(&src, i as u8);
        let (tx, rx) = handshake(&prefill, &decode, room).await;
        rx.send_metadata(dst.clone(), 0).unwrap();
        rooms.push((room, src, dst, tx, rx));
    }
    for (room, src, _, tx, _) in &rooms {
        until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
        tx.send(src, Some(aux(*room))).unwrap();
    }
    for (room, src, dst, tx, rx) in &rooms {
        until("success", SECS, || rx.poll() == KvPoll::Success).await;
        assert_eq!(tx.poll(), KvPoll::Success);
        assert_eq!(rx.aux().unwrap().bootstrap_room, *room);
        assert_eq!(decode.read(dst), prefill.read(src));
    }
    assert_eq!(decode.mgr.stats().success_total, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_prefill_fails_decode_rooms_at_once() {
    let (prefill, decode) = pair();
    let (tx, rx) = handshake(&prefill, &decode, 1).await;
    rx.send_metadata(pages([1]), 0).unwrap();
    // The whole prefill server goes: its manager first (the sender handle outlives it).
    drop(prefill);
    until("decode fails", SECS, || rx.poll() == KvPoll::Failed).await;
    assert_eq!(tx.poll(), KvPoll::Failed);
    assert!(tx.failure().unwrap().contains("shut down"));
    let why = rx.failure().unwrap();
    assert!(why.contains("closed"), "{why}");
    assert!(rx.quiescent());
    assert_eq!(decode.mgr.stats().peers, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_prefill_fails_decode_rooms_within_the_heartbeat_window() {
    let (prefill, decode) = pair();
    let (_tx, rx) = handshake(&prefill, &decode, 2).await;
    rx.send_metadata(pages([1]), 0).unwrap();
    let t = std::time::Instant::now();
    prefill.mgr.stop_bootstrap_server();
    until("decode fails", SECS, || rx.poll() == KvPoll::Failed).await;
    let why = rx.failure().unwrap();
    assert!(why.contains("missed 2 heartbeats"), "{why}");
    // 2 misses at 100 ms, each bounded by a 100 ms request timeout, plus slack.
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // A new receiver for the same prefill reconnects (and fails: no bootstrap server).
    let rx2 = decode.mgr.create_receiver(3, &prefill.bootstrap()).unwrap();
    until("second receiver fails", SECS, || {
        rx2.poll() == KvPoll::Failed
    })
    .await;
    assert!(
        rx2.failure().unwrap().contains("bootstrap"),
        "{:?}",
        rx2.failure()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_decode_fails_its_prefill_senders() {
    let (prefill, decode) = pair();
    let (tx, rx) = handshake(&prefill, &decode, 4).await;
    rx.send_metadata(pages([1, 2]), 0).unwrap();
    until("prefill handshake", SECS, || {
        tx.poll() == KvPoll::WaitingForInput
    })
    .await;
    drop(rx);
    drop(decode);
    until("prefill fails", SECS, || tx.poll() == KvPoll::Failed).await;
    let why = tx.failure().unwrap();
    assert!(why.contains("decode"), "{why}");
    assert!(matches!(
        tx.send(&pages([1, 2]), Some(aux(4))),
        Err(PdError::WrongState { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_timeouts_fail_rooms_on_both_sides() {
    let mut pc = fast_config(PdRole::Prefill);
    pc.bootstrap_timeout = Duration::from_millis(150);
    let (prefill, decode) = pair_with(pc, fast_config(PdRole::Decode));
    // A sender whose decode never shows up.
    let lonely = prefill.mgr.create_sender(5).unwrap();
    until("bootstrap timeout", SECS, || {
        lonely.poll() == KvPoll::Failed
    })
    .await;
    assert!(lonely.failure().unwrap().contains("bootstrap timeout"));
    insta::assert_snapshot!(render("prefill r5", &lonely.history()), @"prefill r5: Bootstrapping → Failed");
    // A TransferInfo whose sender never comes: kept, then dropped with a Failed status.
    let rx = decode.mgr.create_receiver(6, &prefill.bootstrap()).unwrap();
    until("connected", SECS, || rx.poll() == KvPoll::WaitingForInput).await;
    rx.send_metadata(pages([1]), 0).unwrap();
    until("decode fails", SECS, || rx.poll() == KvPoll::Failed).await;
    assert!(
        rx.failure().unwrap().contains("never created room 6"),
        "{:?}",
        rx.failure()
    );
    assert_eq!(prefill.mgr.stats().pending_infos, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiting_timeout_fails_decode_and_aborts_prefill() {
    let mut dc = fast_config(PdRole::Decode);
    dc.waiting_timeout = Duration::from_millis(150);
    let (prefill, decode) = pair_with(fast_config(PdRole::Prefill), dc);
    let (tx, rx) = handshake(&prefill, &decode, 8).await;
    rx.send_metadata(pages([1]), 0).unwrap();
    // The prefill never sends.
    until("decode times out", SECS, || rx.poll() == KvPoll::Failed).await;
    assert!(rx.failure().unwrap().contains("waiting timeout"));
    until("prefill aborted", SECS, || tx.poll() == KvPoll::Failed).await;
    assert!(tx.failure().unwrap().contains("aborted by decode"));
    until("abort acknowledged", SECS, || rx.quiescent()).await;
    insta::assert_snapshot!(render("decode r8", &rx.history()), @"decode r8: Bootstrapping → WaitingForInput → Transferring → Failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incompatible_servers_are_refused_naming_the_field() {
    for (field, page_size, dtype) in [
        ("page_size", 8, kv_pool::KvDtype::F16),
        ("kv_dtype", P, kv_pool::KvDtype::Bf16),
    ] {
        let l = layout(P, 16);
        let prefill = Side::start(
            fast_config(PdRole::Prefill),
            l,
            compat_of(&l, BackendKind::Fake),
        );
        let shape = kv_pool::KvShape::mha(2, 4, 4, 2, dtype).unwrap();
        let dl = kv_pool::KvLayout::new(shape, page_size, 16 * page_size as usize).unwrap();
        let decode = Side::start(
            fast_config(PdRole::Decode),
            dl,
            compat_of(&dl, BackendKind::Fake),
        );
        let rx = decode.mgr.create_receiver(1, &prefill.bootstrap()).unwrap();
        until("refused", SECS, || rx.poll() == KvPoll::Failed).await;
        let why = rx.failure().unwrap();
        assert!(
            why.contains(&format!("incompatible prefill server: {field}")),
            "{why}"
        );
        assert!(rx.send_metadata(pages([1]), 0).is_err());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_travels_both_ways() {
    let (prefill, decode) = pair();
    // Decode aborts a room in flight: the prefill's writes settle before the ack.
    prefill.engine.set_delay(Duration::from_millis(100));
    let (tx, rx) = handshake(&prefill, &decode, 21).await;
    rx.send_metadata(pages([1, 2]), 0).unwrap();
    until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
    tx.send(&pages([3]), None).unwrap();
    rx.abort("client disconnected");
    assert_eq!(rx.poll(), KvPoll::Failed);
    assert!(!rx.quiescent());
    until("prefill fails", SECS, || tx.poll() == KvPoll::Failed).await;
    assert_eq!(
        tx.failure().unwrap(),
        "aborted by decode: aborted by decode: client disconnected"
    );
    until("ack after the batch settled", SECS, || rx.quiescent()).await;
    // Prefill aborts: decode's room fails with the reason.
    prefill.engine.set_delay(Duration::ZERO);
    let (tx, rx) = handshake(&prefill, &decode, 22).await;
    rx.send_metadata(pages([1]), 0).unwrap();
    until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
    tx.abort("out of memory");
    until("decode fails", SECS, || rx.poll() == KvPoll::Failed).await;
    assert!(
        rx.failure()
            .unwrap()
            .contains("aborted by prefill: out of memory"),
        "{:?}",
        rx.failure()
    );
    assert!(rx.quiescent());
}

/// The router sends to both servers at once: a decode may abort a room before the prefill has
/// created it. The prefill remembers, and the room fails as soon as it is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_before_the_prefill_created_the_room_fails_it_at_creation() {
    let (prefill, decode) = pair();
    // Connect decode to the prefill with another room first.
    let (_tx, _rx) = handshake(&prefill, &decode, 30).await;
    let rx = decode
        .mgr
        .create_receiver(31, &prefill.bootstrap())
        .unwrap();
    until("decode ready", SECS, || {
        rx.poll() == KvPoll::WaitingForInput
    })
    .await;
    rx.abort("client disconnected");
    assert!(rx.quiescent(), "no metadata went out: nothing can land");
    // Give the ABORT time to arrive, then the prefill sees the request.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let tx = prefill.mgr.create_sender(31).unwrap();
    assert_eq!(tx.poll(), KvPoll::Failed);
    assert!(
        tx.failure().unwrap().contains("client disconnected"),
        "{:?}",
        tx.failure()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_fails_the_room_on_both_sides() {
    let (prefill, decode) = pair();
    prefill.engine.fail_next(1);
    let (tx, rx) = handshake(&prefill, &decode, 31).await;
    rx.send_metadata(pages([1, 2]), 0).unwrap();
    until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
    tx.send(&pages([5]), None).unwrap();
    tx.send(&pages([6]), Some(aux(31))).unwrap();
    until("decode fails", SECS, || rx.poll() == KvPoll::Failed).await;
    assert_eq!(tx.poll(), KvPoll::Failed);
    assert!(
        rx.failure().unwrap().contains("corrupted frame"),
        "{:?}",
        rx.failure()
    );
    assert!(rx.quiescent());
    // The connection is still good for the next room.
    let (tx, rx) = handshake(&prefill, &decode, 32).await;
    rx.send_metadata(pages([1]), 0).unwrap();
    until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
    tx.send(&pages([5]), Some(aux(32))).unwrap();
    until("success", SECS, || rx.poll() == KvPoll::Success).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_are_typed_errors_that_change_nothing() {
    let (prefill, decode) = pair();
    let (tx, rx) = handshake(&prefill, &decode, 41).await;
    // Duplicate live rooms.
    assert_eq!(
        prefill.mgr.create_sender(41).unwrap_err(),
        PdError::DuplicateRoom { room: 41 }
    );
    assert_eq!(
        decode
            .mgr
            .create_receiver(41, &prefill.bootstrap())
            .unwrap_err(),
        PdError::DuplicateRoom { room: 41 }
    );
    // Wrong role, bad address.
    assert!(matches!(
        prefill.mgr.create_receiver(1, "x:1"),
        Err(PdError::WrongRole { .. })
    ));
    assert!(matches!(
        decode.mgr.create_sender(1),
        Err(PdError::WrongRole { .. })
    ));
    assert!(matches!(
        decode.mgr.create_receiver(2, "nohost"),
        Err(PdError::Invalid(_))
    ));
    // Send before the handshake.
    assert!(matches!(
        tx.send(&pages([1]), None),
        Err(PdError::WrongState {
            state: KvPoll::Bootstrapping,
            ..
        })
    ));
    rx.send_metadata(pages([1, 2]), 0).unwrap();
    assert!(matches!(
        rx.send_metadata(pages([1, 2]), 0),
        Err(PdError::WrongState {
            state: KvPoll::Transferring,
            ..
        })
    ));
    until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
    // More pages than decode gave; a last chunk short of them.
    assert!(matches!(
        tx.send(&pages([1, 2, 3]), None),
        Err(PdError::PageCountMismatch { .. })
    ));
    assert!(matches!(
        tx.send(&pages([1]), Some(aux(41))),
        Err(PdError::PageCountMismatch { .. })
    ));
    assert_eq!(tx.poll(), KvPoll::WaitingForInput, "nothing changed");
    assert_eq!(tx.history().len(), 2);
    tx.send(&pages([1, 2]), Some(aux(41))).unwrap();
    until("success", SECS, || rx.poll() == KvPoll::Success).await;
    // After the end.
    assert!(matches!(
        tx.send(&pages([1]), None),
        Err(PdError::WrongState {
            state: KvPoll::Success,
            ..
        })
    ));
    // Abort after success is a no-op.
    rx.abort("late");
    tx.abort("late");
    assert_eq!((tx.poll(), rx.poll()), (KvPoll::Success, KvPoll::Success));
    // A forgotten room can be reused.
    drop((tx, rx));
    let (tx, _rx) = handshake(&prefill, &decode, 41).await;
    assert_eq!(tx.poll(), KvPoll::Bootstrapping);
    let _ = Page(0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_sender_mid_transfer_fails_the_decode_room_once_writes_settled() {
    let (prefill, decode) = pair();
    prefill.engine.set_delay(Duration::from_millis(50));
    let (tx, rx) = handshake(&prefill, &decode, 51).await;
    rx.send_metadata(pages([1]), 0).unwrap();
    until("handshake", SECS, || tx.poll() == KvPoll::WaitingForInput).await;
    tx.send(&pages([2]), Some(aux(51))).unwrap();
    drop(tx);
    until("decode fails", SECS, || rx.poll() == KvPoll::Failed).await;
    assert!(rx.quiescent());
    assert!(
        rx.failure().unwrap().contains("dropped"),
        "{:?}",
        rx.failure()
    );
    // The room id is free again on the prefill.
    let tx = prefill.mgr.create_sender(51).unwrap();
    assert_eq!(tx.poll(), KvPoll::Bootstrapping);
}

#[test]
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<transfer::pd::KvManager>();
    send_sync::<KvSender>();
    send_sync::<KvReceiver>();
}

/// The engine's thread is no tokio worker: it starts the managers with a runtime handle and
/// calls the synchronous API between steps.
#[test]
fn the_sync_api_works_from_a_plain_thread() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let l = layout(P, 8);
    let c = compat_of(&l, BackendKind::Fake);
    let start = |role| {
        let engine = MemcpyEngine::new();
        let store = Box::new(kv_pool::HostKvStore::new(l).unwrap());
        let regions = store.memory_regions();
        // SAFETY: the store is boxed and outlives the manager (both dropped at the end).
        let ids = unsafe { transfer::TransferEngine::register(&*engine, &regions) }.unwrap();
        let local = ids.into_iter().zip(regions).collect();
        let mgr = transfer::pd::KvManager::start(
            fast_config(role),
            c.clone(),
            engine,
            local,
            rt.handle().clone(),
        )
        .unwrap();
        (store, mgr)
    };
    let (_ps, prefill) = start(PdRole::Prefill);
    let (_ds, decode) = start(PdRole::Decode);
    let wait = |what: &str, f: &dyn Fn() -> bool| {
        let t = std::time::Instant::now();
        while !f() {
            assert!(t.elapsed() < SECS, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let boot = prefill.bootstrap_addr().unwrap().to_string();
    let rx = decode.create_receiver(3, &boot).unwrap();
    let tx = prefill.create_sender(3).unwrap();
    wait("connected", &|| rx.poll() == KvPoll::WaitingForInput);
    rx.send_metadata(pages([1]), 0).unwrap();
    wait("handshake", &|| tx.poll() == KvPoll::WaitingForInput);
    tx.send(&pages([2]), Some(aux(3))).unwrap();
    wait("success", &|| rx.poll() == KvPoll::Success);
    drop((tx, rx, prefill, decode));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_destination_is_not_reused_decode_reconnects() {
    let (prefill, decode) = pair();
    let (tx, rx) = handshake(&prefill, &decode, 61).await;
    let (tx2, rx2) = handshake(&prefill, &decode, 62).await;
    rx.send_metadata(pages([1]), 0).unwrap();
    rx2.send_metadata(pages([2]), 0).unwrap();
    until("handshakes", SECS, || {
        tx.poll() == KvPoll::WaitingForInput && tx2.poll() == KvPoll::WaitingForInput
    })
    .await;
    prefill.engine.fail_as_unreachable(true);
    prefill.engine.fail_next(1);
    tx.send(&pages([3]), Some(aux(61))).unwrap();
    until("decode fails", SECS, || rx.poll() == KvPoll::Failed).await;
    // The whole route is dropped: the other room on it fails too, with the reason.
    until("the other room fails", SECS, || {
        rx2.poll() == KvPoll::Failed
    })
    .await;
    assert_eq!(tx2.poll(), KvPoll::Failed);
    assert!(
        rx.failure()
            .unwrap()
            .contains("KV transfer failed: peer memcpy"),
        "{:?}",
        rx.failure()
    );
    assert!(
        rx2.failure().unwrap().contains("closed"),
        "{:?}",
        rx2.failure()
    );
    // The next request re-handshakes on a fresh connection and succeeds.
    let (tx3, rx3) = handshake(&prefill, &decode, 63).await;
    rx3.send_metadata(pages([4]), 0).unwrap();
    until("handshake", SECS, || tx3.poll() == KvPoll::WaitingForInput).await;
    tx3.send(&pages([5]), Some(aux(63))).unwrap();
    until("success", SECS, || rx3.poll() == KvPoll::Success).await;
}

/// Random aborts and drops at random points, on both sides, with batches in flight: every room
/// ends (no hang), every decode room becomes quiescent, a decode `Success` implies a prefill
/// `Success` and the right bytes, and the managers forget every room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_aborts_end_every_room_cleanly() {
    let (mut prefill, decode) = pair();
    prefill.engine.set_delay(Duration::from_millis(3));
    let mut rng = kv_pool::SplitMix64::new(7);
    let mut live = Vec::new();
    for k in 0..16u32 {
        let room = 500 + k as u64;
        let src = pages([1 + k, 17 + k]);
        let dst = pages([1 + 2 * k, 2 + 2 * k]);
        prefill.fill(&src, k as u8);
        let (tx, rx) = handshake(&prefill, &decode, room).await;
        // 0: normal, 1: decode aborts before metadata, 2: decode aborts after, 3: prefill
        // aborts mid-transfer, 4: prefill drops its sender mid-transfer.
        let plan = rng.below(5);
        if plan == 1 {
            rx.abort("random");
        } else {
            rx.send_metadata(dst.clone(), 0).unwrap();
            until("handshake", SECS, || tx.poll() != KvPoll::Bootstrapping).await;
            if plan == 2 {
                rx.abort("random");
            }
            let _ = tx.send(&src[..1], None);
            match plan {
                3 => tx.abort("random"),
                4 => {
                    live.push((room, src, dst, None, rx));
                    continue;
                }
                _ => {
                    let _ = tx.send(&src[1..], Some(aux(room)));
                }
            }
        }
        live.push((room, src, dst, Some(tx), rx));
    }
    for (room, src, dst, tx, rx) in &live {
        until("terminal", SECS, || {
            rx.poll() == KvPoll::Failed || rx.poll() == KvPoll::Success
        })
        .await;
        until("quiescent", SECS, || rx.quiescent()).await;
        if let Some(tx) = tx {
            until("prefill terminal", SECS, || {
                tx.poll() != KvPoll::Transferring
            })
            .await;
            if rx.poll() == KvPoll::Success {
                assert_eq!(tx.poll(), KvPoll::Success, "room {room}");
            }
        }
        if rx.poll() == KvPoll::Success {
            assert_eq!(decode.read(dst), prefill.read(src), "room {room}");
        }
    }
    drop(live);
    let (ps, ds) = (prefill.mgr.stats(), decode.mgr.stats());
    assert_eq!(ps.bootstrapping + ps.waiting_for_input + ps.transferring, 0);
    assert_eq!(ds.bootstrapping + ds.waiting_for_input + ds.transferring, 0);
    assert_eq!(ps.success_total + ps.failed_total, 16);
    assert_eq!(ds.success_total + ds.failed_total, 16);
}
