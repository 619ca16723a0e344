//! The prefill side's background work (SGLang's `MooncakeKVManager` bootstrap thread and
//! transfer workers, `disaggregation/mooncake/conn.py`): the control listener, one task per
//! decode connection (registration, TransferInfo, ABORT), one transfer worker per sending room,
//! and the bootstrap-timeout reaper.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use kv_pool::Page;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::engine::{BatchId, BatchStatus, SegmentId};
use crate::error::TransferError;
use crate::pd::control::{read_msg, write_msg, ControlMsg, FrameError};
use crate::pd::error::PdError;
use crate::pd::kv_poll::KvPoll;
use crate::pd::log;
use crate::pd::state::{Job, PendingInfo, PrefillConn, Room, Shared, State};

/// Binds the control listener on the bootstrap host (any port) and starts accepting.
pub(crate) fn start_listener(shared: &Arc<Shared>) -> Result<SocketAddr, PdError> {
    let host = &shared.cfg.bootstrap_host;
    let std_listener = std::net::TcpListener::bind((host.as_str(), 0))
        .map_err(|e| PdError::Invalid(format!("control listener: cannot bind {host}: {e}")))?;
    let addr = std_listener
        .local_addr()
        .and_then(|a| std_listener.set_nonblocking(true).map(|_| a))
        .map_err(|e| PdError::Invalid(format!("control listener: {e}")))?;
    let listener = {
        let _guard = shared.rt.enter();
        TcpListener::from_std(std_listener)
            .map_err(|e| PdError::Invalid(format!("control listener: {e}")))?
    };
    let shared = shared.clone();
    shared.rt.clone().spawn(async move {
        let stop = Shared::stopped(shared.shutdown.clone());
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => return,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let s = shared.clone();
                        tokio::spawn(async move { serve_conn(s, stream, peer).await });
                    }
                    Err(e) => log(format_args!("control listener: accept: {e}")),
                },
            }
        }
    });
    Ok(addr)
}

/// One decode connection: registration first, then TransferInfo / ABORT until it closes.
async fn serve_conn(shared: Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let stop = Shared::stopped(shared.shutdown.clone());
    tokio::pin!(stop);
    let first = tokio::select! {
        _ = &mut stop => return,
        m = read_msg(&mut rd) => m,
    };
    let (segment, dst) = match first {
        Ok(ControlMsg::Register {
            compat,
            segment,
            kv_regions,
        }) => {
            let checked = shared.compat.check(&compat).map_err(|e| e.to_string());
            let dst = checked.and_then(|_| {
                kv_regions
                    .iter()
                    .map(|&(id, item_len)| match segment.regions.get(id as usize) {
                        Some(r) => Ok((id, *r, item_len)),
                        None => Err(format!("region {id} is not in the decode's segment")),
                    })
                    .collect::<Result<Vec<_>, String>>()
            });
            let opened = match dst {
                Ok(dst) => match shared.engine.open_segment(&segment).await {
                    Ok(seg) => Ok((seg, dst)),
                    Err(e) => Err(format!("cannot open the decode's segment: {e}")),
                },
                Err(e) => Err(e),
            };
            match opened {
                Ok(v) => v,
                Err(error) => {
                    log(format_args!("decode {peer}: registration refused: {error}"));
                    let _ = write_msg(&mut wr, &ControlMsg::RegisterError { error }).await;
                    return;
                }
            }
        }
        Ok(other) => {
            log(format_args!(
                "decode {peer}: expected Register first, got {other:?}; closing"
            ));
            return;
        }
        Err(FrameError::Closed) => return,
        Err(e) => {
            log(format_args!("decode {peer}: {e}; closing"));
            return;
        }
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<ControlMsg>();
    let close = Arc::new(tokio::sync::Notify::new());
    let id = {
        let mut st = shared.lock();
        let id = st.next_id();
        st.conns.insert(
            id,
            PrefillConn {
                tx,
                segment,
                dst: Arc::new(dst),
                close: close.clone(),
            },
        );
        id
    };
    let writer = tokio::spawn(async move {
        while let Some(msg) = rx.recv().await {
            if let Err(e) = write_msg(&mut wr, &msg).await {
                log(format_args!("decode {peer}: write: {e}"));
                return;
            }
        }
    });
    let why = loop {
        let msg = tokio::select! {
            _ = &mut stop => break "the prefill server shut down".to_string(),
            _ = close.notified() => {
                break format!("the destination of decode {peer} failed; connection closed")
            }
            m = read_msg(&mut rd) => m,
        };
        match msg {
            Ok(ControlMsg::TransferInfo {
                room,
                dst_pages,
                decode_prefix_len,
            }) => {
                let pages = dst_pages.into_iter().map(Page).collect();
                transfer_info(&shared, id, room, pages, decode_prefix_len);
            }
            Ok(ControlMsg::Abort { room, reason }) => decode_abort(&shared, id, room, &reason),
            Ok(other) => log(format_args!("decode {peer}: unexpected {other:?}; ignored")),
            Err(FrameError::Closed) => {
                break format!("the control connection from decode {peer} closed")
            }
            Err(e) => {
                log(format_args!("decode {peer}: {e}; closing the connection"));
                break format!("the control connection from decode {peer} failed: {e}");
            }
        }
    };
    // Forgetting the connection drops its sender: the writer flushes what was queued (a room's
    // final status) and ends; a peer that stops reading gets a second, then the socket closes.
    close_conn(&shared, id, &why).await;
    let mut writer = writer;
    if tokio::time::timeout(std::time::Duration::from_secs(1), &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
}

/// Forgets a connection: its rooms that have not succeeded fail, its pending infos go, its
/// segment closes (pending batches into it fail).
async fn close_conn(shared: &Arc<Shared>, id: u64, why: &str) {
    let segment = {
        let mut st = shared.lock();
        let Some(conn) = st.conns.remove(&id) else {
            return;
        };
        st.pending.retain(|_, p| p.conn != id);
        let rooms: Vec<u64> = st
            .rooms
            .iter()
            .filter(|(_, r)| r.conn == Some(id))
            .map(|(&k, _)| k)
            .collect();
        for room in rooms {
            st.transition(room, KvPoll::Failed, Some(why.to_string()));
        }
        conn.segment
    };
    let _ = shared.engine.close_segment(segment).await;
}

/// Creates a room (duplicate live rooms refused) and applies a TransferInfo that came first.
pub(crate) fn create_room(shared: &Shared, room: u64) -> Result<(), PdError> {
    let mut st = shared.lock();
    if st.rooms.contains_key(&room) {
        return Err(PdError::DuplicateRoom { room });
    }
    let mut r = Room::new();
    r.generation = st.next_id();
    st.rooms.insert(room, r);
    if let Some((_, reason)) = st.aborted.remove(&room) {
        st.transition(
            room,
            KvPoll::Failed,
            Some(format!("aborted by decode: {reason}")),
        );
        return Ok(());
    }
    if let Some(p) = st.pending.remove(&room) {
        apply_info(&mut st, room, p.conn, p.dst_pages, p.decode_prefix_len);
    }
    Ok(())
}

fn send_to(st: &State, conn: u64, msg: ControlMsg) {
    if let Some(c) = st.conns.get(&conn) {
        let _ = c.tx.send(msg);
    }
}

/// A `Status` failure message for `room`.
pub(crate) fn failed_status(room: u64, error: String) -> ControlMsg {
    ControlMsg::Status {
        room,
        success: false,
        aux: None,
        error: Some(error),
        bytes: 0,
    }
}

fn transfer_info(shared: &Shared, conn: u64, room: u64, pages: Vec<Page>, prefix: usize) {
    let mut st = shared.lock();
    if st.rooms.contains_key(&room) {
        apply_info(&mut st, room, conn, pages, prefix);
    } else {
        let replaced = st.pending.insert(
            room,
            PendingInfo {
                conn,
                dst_pages: pages,
                decode_prefix_len: prefix,
                at: Instant::now(),
            },
        );
        if replaced.is_some() {
            log(format_args!(
                "room {room}: a second TransferInfo replaced the first"
            ));
        }
    }
}

fn apply_info(st: &mut State, room: u64, conn: u64, pages: Vec<Page>, prefix: usize) {
    let r = st.rooms.get_mut(&room).expect("caller checked");
    if r.conn.is_some() {
        log(format_args!("room {room}: duplicate TransferInfo ignored"));
        return;
    }
    if r.cell.get() == KvPoll::Failed {
        let why = r.failure.clone().unwrap_or_default();
        send_to(st, conn, failed_status(room, why));
        return;
    }
    r.conn = Some(conn);
    r.dst_pages = pages;
    r.decode_prefix_len = prefix;
    st.transition(room, KvPoll::WaitingForInput, None);
}

fn decode_abort(shared: &Shared, conn: u64, room: u64, reason: &str) {
    let mut st = shared.lock();
    if st.pending.remove(&room).is_some() {
        send_to(&st, conn, ControlMsg::AbortAck { room });
        return;
    }
    let worker = match st.rooms.get(&room) {
        Some(r) if r.conn == Some(conn) => r.worker.clone(),
        // A room still bootstrapping (no decode has claimed it): it fails, nothing was sent.
        Some(r) if r.conn.is_none() => {
            st.transition(
                room,
                KvPoll::Failed,
                Some(format!("aborted by decode: {reason}")),
            );
            send_to(&st, conn, ControlMsg::AbortAck { room });
            return;
        }
        _ => {
            // Not created yet (or gone): remembered, so a room created later fails at once
            // instead of waiting out the bootstrap timeout.
            st.aborted
                .insert(room, (std::time::Instant::now(), reason.to_string()));
            send_to(&st, conn, ControlMsg::AbortAck { room });
            return;
        }
    };
    st.transition(
        room,
        KvPoll::Failed,
        Some(format!("aborted by decode: {reason}")),
    );
    let queued = worker.is_some_and(|w| w.send(Job::Abort { ack: true }).is_ok());
    if !queued {
        send_to(&st, conn, ControlMsg::AbortAck { room });
    }
}

/// Bootstrap timeouts: rooms that never got a TransferInfo, TransferInfos whose room never came.
pub(crate) fn reap(shared: &Shared) {
    let limit = shared.cfg.bootstrap_timeout;
    let mut st = shared.lock();
    let late: Vec<u64> = st
        .rooms
        .iter()
        .filter(|(_, r)| r.cell.get() == KvPoll::Bootstrapping && r.created.elapsed() > limit)
        .map(|(&k, _)| k)
        .collect();
    for room in late {
        let why = format!(
            "bootstrap timeout: no TransferInfo from decode within {} s",
            limit.as_secs_f64()
        );
        st.transition(room, KvPoll::Failed, Some(why));
    }
    st.aborted.retain(|_, (at, _)| at.elapsed() <= limit);
    let stale: Vec<u64> = st
        .pending
        .iter()
        .filter(|(_, p)| p.at.elapsed() > limit)
        .map(|(&k, _)| k)
        .collect();
    for room in stale {
        let p = st.pending.remove(&room).expect("listed");
        let why = format!(
            "bootstrap timeout: the prefill server never created room {room} within {} s",
            limit.as_secs_f64()
        );
        log(format_args!("{why}"));
        send_to(&st, p.conn, failed_status(room, why));
    }
}

/// Where a room's worker sends: the room (and its generation), the decode connection and the
/// segment opened for it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub room: u64,
    pub generation: u64,
    pub conn: u64,
    pub segment: SegmentId,
}

/// A sending room's worker: submits each chunk's batch as it comes, checks earlier batches
/// without waiting, and after the last chunk waits for every batch, then reports `Success`
/// (with the aux) or `Failed` to decode. An abort waits for the batches in flight (so no write
/// can land after the decode side frees its pages), then answers.
pub(crate) async fn run_worker(
    shared: Arc<Shared>,
    target: Target,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    let Target {
        room,
        conn,
        segment,
        ..
    } = target;
    let mut batches: Vec<BatchId> = Vec::new();
    let mut bytes = 0u64;
    let mut started: Option<Instant> = None;
    let mut failure: Option<TransferError> = None;
    while let Some(job) = jobs.recv().await {
        match job {
            Job::Send { blocks, aux } => {
                if failure.is_none() && !blocks.is_empty() {
                    started.get_or_insert_with(Instant::now);
                    bytes += blocks.iter().map(|b| b.len).sum::<u64>();
                    match shared.engine.submit(segment, blocks).await {
                        Ok(b) => batches.push(b),
                        Err(e) => failure = Some(e),
                    }
                }
                if failure.is_none() {
                    failure = check_done(&shared, &mut batches);
                }
                if failure.is_none() && aux.is_none() {
                    continue;
                }
                let settled = settle(&shared, &mut batches).await;
                let failure = failure.or(settled);
                finish(&shared, target, failure, aux, bytes, started);
                return;
            }
            Job::Abort { ack } => {
                let _ = settle(&shared, &mut batches).await;
                let st = shared.lock();
                let msg = if ack {
                    ControlMsg::AbortAck { room }
                } else {
                    let why = st
                        .rooms
                        .get(&room)
                        .and_then(|r| r.failure.clone())
                        .unwrap_or_else(|| "aborted by prefill".into());
                    failed_status(room, why)
                };
                send_to(&st, conn, msg);
                return;
            }
        }
    }
    // The sender was dropped without a last chunk: wait out what is in flight.
    let _ = settle(&shared, &mut batches).await;
}

/// Reaps finished batches without waiting; the first failure.
fn check_done(shared: &Shared, batches: &mut Vec<BatchId>) -> Option<TransferError> {
    let mut failure = None;
    batches.retain(|&b| match shared.engine.poll(b) {
        Ok(BatchStatus::Pending) => true,
        Ok(BatchStatus::Done) => false,
        Ok(BatchStatus::Failed(e)) | Err(e) => {
            failure.get_or_insert(e);
            false
        }
    });
    failure
}

/// Waits for every batch; the first failure.
async fn settle(shared: &Shared, batches: &mut Vec<BatchId>) -> Option<TransferError> {
    let mut failure = None;
    for b in batches.drain(..) {
        if let Err(e) = shared.engine.wait(b).await {
            failure.get_or_insert(e);
        }
    }
    failure
}

fn finish(
    shared: &Shared,
    target: Target,
    failure: Option<TransferError>,
    aux: Option<crate::pd::config::TransferAux>,
    bytes: u64,
    started: Option<Instant>,
) {
    let Target { room, conn, .. } = target;
    let mut st = shared.lock();
    if st.rooms.get(&room).map(|r| r.generation) != Some(target.generation) {
        // The sender was dropped meanwhile (its abort is queued behind this job, which ends
        // the worker): decode must still hear.
        let why = "the prefill dropped the room before its transfer ended".to_string();
        send_to(&st, conn, failed_status(room, why));
        return;
    }
    match failure {
        Some(e) => {
            let why = format!("KV transfer failed: {e}");
            if matches!(e, TransferError::PeerUnreachable { .. }) {
                // Not retried blindly: this connection ends, decode re-handshakes next time.
                if let Some(c) = st.conns.get(&conn) {
                    c.close.notify_one();
                }
            }
            st.transition(room, KvPoll::Failed, Some(why.clone()));
            send_to(&st, conn, failed_status(room, why));
        }
        None => {
            let aux = aux.expect("finish without failure comes with the last chunk");
            if st.transition(room, KvPoll::Success, None) {
                st.bytes += bytes;
                st.transfer_seconds += started.map_or(0.0, |t| t.elapsed().as_secs_f64());
                send_to(
                    &st,
                    conn,
                    ControlMsg::Status {
                        room,
                        success: true,
                        aux: Some(aux),
                        error: None,
                        bytes,
                    },
                );
            } else {
                // Failed meanwhile (aborted, connection closed): tell decode so.
                let why = st
                    .rooms
                    .get(&room)
                    .and_then(|r| r.failure.clone())
                    .unwrap_or_else(|| "aborted".into());
                send_to(&st, conn, failed_status(room, why));
            }
        }
    }
}
