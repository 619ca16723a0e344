//! The prefill's public surfaces seen from outside: the bootstrap server's HTTP routes and the
//! control channel spoken by hand (registration refused, ABORT for an unknown room, malformed
//! and oversized frames).

mod common;

use std::time::Duration;

use common::*;
use kv_pool::KvStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use transfer::pd::{ControlMsg, PdRole, RankAddr, ServerInfo, MAX_FRAME};
use transfer::{BackendKind, TransferEngine};

const SECS: Duration = Duration::from_secs(10);

fn prefill() -> Side {
    let l = layout(4, 16);
    Side::start(
        fast_config(PdRole::Prefill),
        l,
        compat_of(&l, BackendKind::Fake),
    )
}

async fn get(addr: &str, path: &str) -> (u16, String) {
    let r = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn control_addr(bootstrap: &str) -> String {
    let t = std::time::Instant::now();
    loop {
        let (code, body) = get(bootstrap, "/route?engine_rank=0").await;
        if code == 200 {
            let r: RankAddr = serde_json::from_str(&body).unwrap();
            return format!("{}:{}", r.rank_ip, r.rank_port);
        }
        assert!(t.elapsed() < SECS, "rank 0 never registered");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn send(s: &mut TcpStream, msg: &ControlMsg) {
    let body = serde_json::to_vec(msg).unwrap();
    s.write_all(&(body.len() as u32).to_be_bytes())
        .await
        .unwrap();
    s.write_all(&body).await.unwrap();
}

async fn recv(s: &mut TcpStream) -> Option<ControlMsg> {
    let mut len = [0u8; 4];
    tokio::time::timeout(SECS, s.read_exact(&mut len))
        .await
        .expect("an answer or a close")
        .ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).await.ok()?;
    Some(serde_json::from_slice(&body).unwrap())
}

/// A registration from a real (memcpy) decode engine.
fn register(decode: &Side) -> ControlMsg {
    let l = *decode.store.layout();
    let regions = decode.store.memory_regions();
    ControlMsg::Register {
        compat: compat_of(&l, BackendKind::Fake),
        segment: decode.engine.segment(),
        kv_regions: (0..regions.len() as u32)
            .zip(&regions)
            .map(|(i, r)| (i, r.item_len as u64))
            .collect(),
    }
}

/// A prefill (page size 4), its control address, and a decode side with `page_size`.
async fn prefill_and_decode(page_size: u32) -> (Side, String, Side) {
    let p = prefill();
    let ctrl = control_addr(&p.bootstrap()).await;
    let l = layout(page_size, 16);
    let decode = Side::start(
        fast_config(PdRole::Decode),
        l,
        compat_of(&l, BackendKind::Fake),
    );
    (p, ctrl, decode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bootstrap_server_answers_sglangs_routes() {
    let p = prefill();
    let addr = p.bootstrap();
    assert_eq!(get(&addr, "/health").await, (200, "OK".to_string()));
    let ctrl = control_addr(&addr).await;
    assert!(ctrl.starts_with("127.0.0.1:"));
    let (code, body) = get(&addr, "/route").await;
    assert_eq!(code, 200);
    let info: ServerInfo = serde_json::from_str(&body).unwrap();
    assert_eq!((info.ranks, info.compat.page_size), (1, 4));
    assert_eq!(get(&addr, "/route?engine_rank=-1").await.0, 200);
    let (code, body) = get(&addr, "/route?engine_rank=3").await;
    assert_eq!((code, body.as_str()), (404, "rank 3 is not registered"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatched_registration_is_refused_naming_the_field() {
    let (_prefill, ctrl, decode) = prefill_and_decode(8).await;
    let mut s = TcpStream::connect(&ctrl).await.unwrap();
    send(&mut s, &register(&decode)).await;
    match recv(&mut s).await {
        Some(ControlMsg::RegisterError { error }) => {
            assert!(error.contains("page_size"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(recv(&mut s).await, None, "the connection closes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_rooms_are_acknowledged_and_bad_frames_close_only_their_connection() {
    let (p, ctrl, decode) = prefill_and_decode(4).await;
    // ABORT for a room the prefill never heard of: ignored (logged), acknowledged.
    let mut s = TcpStream::connect(&ctrl).await.unwrap();
    send(&mut s, &register(&decode)).await;
    send(
        &mut s,
        &ControlMsg::Abort {
            room: 999,
            reason: "test".into(),
        },
    )
    .await;
    assert_eq!(recv(&mut s).await, Some(ControlMsg::AbortAck { room: 999 }));
    // A malformed frame closes that connection.
    s.write_all(&3u32.to_be_bytes()).await.unwrap();
    s.write_all(b"{x}").await.unwrap();
    assert_eq!(recv(&mut s).await, None);
    // An oversized one too, before its body is read.
    let mut s = TcpStream::connect(&ctrl).await.unwrap();
    send(&mut s, &register(&decode)).await;
    s.write_all(&(MAX_FRAME as u32 + 1).to_be_bytes())
        .await
        .unwrap();
    assert_eq!(recv(&mut s).await, None);
    // A first message that is not a registration.
    let mut s = TcpStream::connect(&ctrl).await.unwrap();
    send(&mut s, &ControlMsg::AbortAck { room: 1 }).await;
    assert_eq!(recv(&mut s).await, None);
    // The prefill still serves a real decode.
    let rx = decode.mgr.create_receiver(5, &p.bootstrap()).unwrap();
    let tx = p.mgr.create_sender(5).unwrap();
    until("connected", SECS, || {
        rx.poll() == transfer::pd::KvPoll::WaitingForInput
    })
    .await;
    rx.send_metadata(pages([2]), 0).unwrap();
    until("handshake", SECS, || {
        tx.poll() == transfer::pd::KvPoll::WaitingForInput
    })
    .await;
    tx.send(
        &pages([3]),
        Some(transfer::pd::TransferAux {
            first_token_ids: vec![1],
            cached_tokens: 0,
            bootstrap_room: 5,
        }),
    )
    .unwrap();
    until("success", SECS, || {
        rx.poll() == transfer::pd::KvPoll::Success
    })
    .await;
}
