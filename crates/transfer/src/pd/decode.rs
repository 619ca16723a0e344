//! The decode side's background work (SGLang's `CommonKVReceiver` bootstrap and the decode
//! manager's ZMQ thread and heartbeat checker, `disaggregation/common/conn.py`): one peer per
//! prefill bootstrap address (server info fetched and checked once, one control connection, a
//! reader and a heartbeat), and the waiting-timeout reaper.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::pd::bootstrap;
use crate::pd::control::{read_msg, write_msg, ControlMsg, FrameError};
use crate::pd::error::PdError;
use crate::pd::kv_poll::KvPoll;
use crate::pd::log;
use crate::pd::state::{Peer, Room, Shared, State};

/// Creates a room bound to the prefill at `bootstrap`, starting that peer's connection when
/// there is none.
pub(crate) fn create_room(shared: &Arc<Shared>, room: u64, bootstrap: &str) -> Result<(), PdError> {
    let valid = bootstrap
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0));
    if !valid {
        return Err(PdError::Invalid(format!(
            "bootstrap address {bootstrap:?} is not host:port"
        )));
    }
    let mut st = shared.lock();
    if st.rooms.contains_key(&room) {
        return Err(PdError::DuplicateRoom { room });
    }
    let (generation, ready) = match st.peers.get(bootstrap) {
        Some(p) => (p.generation, p.tx.is_some()),
        None => {
            let generation = st.next_id();
            st.peers.insert(
                bootstrap.to_string(),
                Peer {
                    generation,
                    tx: None,
                    tasks: Vec::new(),
                },
            );
            let task = shared
                .rt
                .spawn(connect(shared.clone(), bootstrap.to_string(), generation));
            st.peers
                .get_mut(bootstrap)
                .expect("inserted")
                .tasks
                .push(task.abort_handle());
            (generation, false)
        }
    };
    let mut r = Room::new();
    r.peer = Some((bootstrap.to_string(), generation));
    st.rooms.insert(room, r);
    if ready {
        st.transition(room, KvPoll::WaitingForInput, None);
    }
    Ok(())
}

/// The peer's `tx` when `(addr, generation)` is still the live, connected peer.
pub(crate) fn peer_tx(
    st: &State,
    addr: &str,
    generation: u64,
) -> Option<mpsc::UnboundedSender<ControlMsg>> {
    st.peers
        .get(addr)
        .filter(|p| p.generation == generation)
        .and_then(|p| p.tx.clone())
}

fn rooms_of(st: &State, addr: &str, generation: u64) -> Vec<u64> {
    st.rooms
        .iter()
        .filter(|(_, r)| {
            r.peer
                .as_ref()
                .is_some_and(|(a, g)| a == addr && *g == generation)
        })
        .map(|(&k, _)| k)
        .collect()
}

/// Fails every live room of the peer and forgets it (the next receiver reconnects).
fn peer_dead(shared: &Shared, addr: &str, generation: u64, why: &str) {
    let mut st = shared.lock();
    if st
        .peers
        .get(addr)
        .is_none_or(|p| p.generation != generation)
    {
        return;
    }
    log(format_args!("prefill {addr}: {why}"));
    let peer = st.peers.remove(addr).expect("checked");
    for room in rooms_of(&st, addr, generation) {
        st.transition(room, KvPoll::Failed, Some(why.to_string()));
        if let Some(r) = st.rooms.get_mut(&room) {
            r.quiescent = true;
        }
    }
    drop(st);
    for t in peer.tasks {
        t.abort();
    }
}

async fn connect(shared: Arc<Shared>, addr: String, generation: u64) {
    match handshake(&shared, &addr).await {
        Ok(stream) => {
            let (mut rd, mut wr) = stream.into_split();
            let (tx, mut rx) = mpsc::unbounded_channel::<ControlMsg>();
            let writer = shared.rt.spawn(async move {
                while let Some(msg) = rx.recv().await {
                    if write_msg(&mut wr, &msg).await.is_err() {
                        return;
                    }
                }
            });
            let s = shared.clone();
            let a = addr.clone();
            let reader = shared.rt.spawn(async move {
                let why = loop {
                    match read_msg(&mut rd).await {
                        Ok(msg) => on_message(&s, &a, generation, msg),
                        Err(FrameError::Closed) => {
                            break format!("the control connection to prefill {a} closed")
                        }
                        Err(e) => {
                            break format!("the control connection to prefill {a} failed: {e}")
                        }
                    }
                };
                peer_dead(&s, &a, generation, &why);
            });
            let heartbeat = shared
                .rt
                .spawn(heartbeat(shared.clone(), addr.clone(), generation));
            let mut st = shared.lock();
            let Some(peer) = st
                .peers
                .get_mut(&addr)
                .filter(|p| p.generation == generation)
            else {
                writer.abort();
                reader.abort();
                heartbeat.abort();
                return;
            };
            peer.tx = Some(tx);
            peer.tasks.extend([
                writer.abort_handle(),
                reader.abort_handle(),
                heartbeat.abort_handle(),
            ]);
            for room in rooms_of(&st, &addr, generation) {
                st.transition(room, KvPoll::WaitingForInput, None);
            }
        }
        Err(e) => peer_dead(&shared, &addr, generation, &e.to_string()),
    }
}

/// Server info, compatibility, rank address, connection, registration.
async fn handshake(shared: &Shared, addr: &str) -> Result<TcpStream, PdError> {
    // 503 means the prefill's ranks have not registered yet (both servers starting): retry
    // until the bootstrap timeout, 10 ms doubling to 1 s.
    let deadline = tokio::time::Instant::now() + shared.cfg.bootstrap_timeout;
    let mut delay = Duration::from_millis(10);
    let info = loop {
        match bootstrap::fetch_server_info(&shared.http, addr).await {
            Err(e) if e.to_string().contains("503") && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            other => break other?,
        }
    };
    shared.compat.check(&info.compat)?;
    let ctrl = bootstrap::fetch_rank(&shared.http, addr, 0).await?;
    let limit = shared.cfg.bootstrap_timeout;
    let stream = tokio::time::timeout(limit, TcpStream::connect(&ctrl))
        .await
        .map_err(|_| PdError::Bootstrap {
            addr: addr.into(),
            reason: format!("connecting to the control channel {ctrl} timed out"),
        })?
        .map_err(|e| PdError::Bootstrap {
            addr: addr.into(),
            reason: format!("connecting to the control channel {ctrl}: {e}"),
        })?;
    let _ = stream.set_nodelay(true);
    let mut stream = stream;
    let register = ControlMsg::Register {
        compat: shared.compat.clone(),
        segment: shared.engine.segment(),
        kv_regions: shared
            .local
            .iter()
            .map(|(id, r)| (*id, r.item_len as u64))
            .collect(),
    };
    write_msg(&mut stream, &register)
        .await
        .map_err(|e| PdError::Bootstrap {
            addr: addr.into(),
            reason: format!("registering on the control channel: {e}"),
        })?;
    Ok(stream)
}

fn on_message(shared: &Shared, addr: &str, generation: u64, msg: ControlMsg) {
    let mut st = shared.lock();
    let mine = |st: &State, room: u64| {
        st.rooms.get(&room).is_some_and(|r| {
            r.peer
                .as_ref()
                .is_some_and(|(a, g)| a == addr && *g == generation)
        })
    };
    match msg {
        ControlMsg::Status {
            room,
            success,
            aux,
            error,
            bytes,
        } => {
            if !mine(&st, room) {
                log(format_args!(
                    "prefill {addr}: status for unknown room {room} ignored"
                ));
                return;
            }
            let r = st.rooms.get_mut(&room).expect("checked");
            r.quiescent = true;
            match (success, aux) {
                (true, Some(aux)) if aux.bootstrap_room == room => {
                    let started = r.transfer_start;
                    r.aux = Some(aux);
                    if st.transition(room, KvPoll::Success, None) {
                        st.bytes += bytes;
                        st.transfer_seconds += started.map_or(0.0, |t| t.elapsed().as_secs_f64());
                    }
                }
                (true, aux) => {
                    let why = format!(
                        "metadata corruption: the aux names room {:?}, not {room}",
                        aux.map(|a| a.bootstrap_room)
                    );
                    st.transition(room, KvPoll::Failed, Some(why));
                }
                (false, _) => {
                    let why = error.unwrap_or_else(|| "the prefill reported a failure".into());
                    st.transition(room, KvPoll::Failed, Some(format!("prefill {addr}: {why}")));
                }
            }
        }
        ControlMsg::AbortAck { room } => {
            if let Some(r) = st.rooms.get_mut(&room) {
                r.quiescent = true;
            }
        }
        ControlMsg::RegisterError { error } => {
            drop(st);
            peer_dead(
                shared,
                addr,
                generation,
                &format!("prefill {addr} refused registration: {error}"),
            );
        }
        other => log(format_args!(
            "prefill {addr}: unexpected {other:?}; ignored"
        )),
    }
}

async fn heartbeat(shared: Arc<Shared>, addr: String, generation: u64) {
    let every = shared.cfg.heartbeat_interval.max(Duration::from_millis(1));
    let mut missed = 0u32;
    loop {
        tokio::time::sleep(every).await;
        if bootstrap::health(&shared.heartbeat_http, &addr).await {
            missed = 0;
            continue;
        }
        missed += 1;
        if missed >= shared.cfg.heartbeat_max_failures {
            let why = format!("prefill {addr} missed {missed} heartbeats (/health)");
            peer_dead(&shared, &addr, generation, &why);
            return;
        }
    }
}

/// Timeouts: `Bootstrapping` past the bootstrap timeout; `WaitingForInput` / `Transferring`
/// past the waiting timeout since the handshake (then ABORT goes to the prefill).
pub(crate) fn reap(shared: &Shared) {
    let cfg = &shared.cfg;
    let mut st = shared.lock();
    let mut late = Vec::new();
    for (&room, r) in &st.rooms {
        match r.cell.get() {
            KvPoll::Bootstrapping if r.created.elapsed() > cfg.bootstrap_timeout => late.push((
                room,
                format!(
                    "bootstrap timeout: no handshake with the prefill within {} s",
                    cfg.bootstrap_timeout.as_secs_f64()
                ),
            )),
            KvPoll::WaitingForInput | KvPoll::Transferring
                if r.handshake_at
                    .is_some_and(|t| t.elapsed() > cfg.waiting_timeout) =>
            {
                late.push((
                    room,
                    format!(
                        "waiting timeout: the KV did not arrive within {} s",
                        cfg.waiting_timeout.as_secs_f64()
                    ),
                ))
            }
            _ => {}
        }
    }
    for (room, why) in late {
        abort_room(&mut st, room, why);
    }
}

/// Fails a room and, when the prefill may be writing into it, sends ABORT.
pub(crate) fn abort_room(st: &mut State, room: u64, why: String) -> bool {
    if !st.transition(room, KvPoll::Failed, Some(why.clone())) {
        return false;
    }
    let r = st.rooms.get(&room).expect("transitioned");
    let metadata_sent = r.metadata_sent;
    // The prefill hears of the abort whenever a connection to it exists, also before the
    // metadata went out (its request then stops waiting for this room at once).
    let tx = r.peer.as_ref().and_then(|(addr, g)| peer_tx(st, addr, *g));
    let sent = tx.is_some_and(|tx| tx.send(ControlMsg::Abort { room, reason: why }).is_ok());
    // Before the metadata, the prefill knows none of this room's pages: nothing can land.
    st.rooms.get_mut(&room).expect("transitioned").quiescent = !(sent && metadata_sent);
    true
}
