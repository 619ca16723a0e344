//! [`KvManager`]: one per server (SGLang's `KVManager`, `disaggregation/common/conn.py`). It owns
//! the rooms' state, the background tasks (prefill: bootstrap server, control listener, one task
//! per decode connection, one transfer worker per sending room; decode: one connection, reader
//! and heartbeat per prefill server) and the timeout reaper. Dropping the last clone (or
//! [`KvManager::shutdown`]) stops every task and fails every live room.
//!
//! Locking: one `std::sync::Mutex` over [`State`], never held across an `.await`; the engine
//! thread's calls (`poll`, `send`, …) only take it and push messages into channels.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_pool::{MemoryRegion, Page};
use tokio::sync::{mpsc, watch};

use crate::engine::{RegionId, RemoteRegion, SegmentId, TransferEngine};
use crate::pd::bootstrap::{self, BootstrapServer, RankRegistration};
use crate::pd::config::{PdConfig, PdRole, PdStats, ServerCompat, TransferAux};
use crate::pd::control::ControlMsg;
use crate::pd::error::PdError;
use crate::pd::kv_poll::{KvPoll, PollCell};
use crate::pd::receiver::KvReceiver;
use crate::pd::sender::{Job, KvSender};
use crate::pd::{decode, log, prefill};

/// One room (request) on this manager, either role.
#[derive(Debug)]
pub(crate) struct Room {
    /// Tells this room from a later one with the same id (a room id may be reused once its
    /// handle is dropped); a worker only updates the room it was started for.
    pub generation: u64,
    pub cell: PollCell,
    pub failure: Option<String>,
    pub created: Instant,
    /// When the room reached `WaitingForInput` (the waiting timeout counts from here).
    pub handshake_at: Option<Instant>,
    // prefill
    /// The decode connection that sent TransferInfo.
    pub conn: Option<u64>,
    pub dst_pages: Vec<Page>,
    pub decode_prefix_len: usize,
    pub sent_pages: usize,
    pub last_sent: bool,
    pub worker: Option<mpsc::UnboundedSender<Job>>,
    // decode
    /// `(bootstrap address, peer generation)`.
    pub peer: Option<(String, u64)>,
    pub metadata_sent: bool,
    pub aux: Option<TransferAux>,
    /// No prefill write into this room's pages can still be in flight.
    pub quiescent: bool,
    pub transfer_start: Option<Instant>,
}

impl Room {
    pub(crate) fn new() -> Self {
        Room {
            generation: 0,
            cell: PollCell::new(),
            failure: None,
            created: Instant::now(),
            handshake_at: None,
            conn: None,
            dst_pages: Vec::new(),
            decode_prefix_len: 0,
            sent_pages: 0,
            last_sent: false,
            worker: None,
            peer: None,
            metadata_sent: false,
            aux: None,
            quiescent: true,
            transfer_start: None,
        }
    }
}

/// Prefill: a TransferInfo for a room not created yet.
#[derive(Debug)]
pub(crate) struct PendingInfo {
    pub conn: u64,
    pub dst_pages: Vec<Page>,
    pub decode_prefix_len: usize,
    pub at: Instant,
}

/// Prefill: one decode connection.
#[derive(Debug)]
pub(crate) struct PrefillConn {
    pub tx: mpsc::UnboundedSender<ControlMsg>,
    pub segment: SegmentId,
    /// The decode's KV regions, paired by position with ours.
    pub dst: Arc<Vec<(RegionId, RemoteRegion, u64)>>,
    /// Closes the connection (a transfer found the destination unreachable): its rooms fail,
    /// and decode reconnects afresh for the next request instead of reusing a dead route.
    pub close: Arc<tokio::sync::Notify>,
}

/// Decode: one prefill server, by bootstrap address.
#[derive(Debug)]
pub(crate) struct Peer {
    pub generation: u64,
    /// `None` while connecting.
    pub tx: Option<mpsc::UnboundedSender<ControlMsg>>,
    pub tasks: Vec<tokio::task::AbortHandle>,
}

/// Everything behind the lock.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub rooms: HashMap<u64, Room>,
    pub pending: HashMap<u64, PendingInfo>,
    /// Prefill: rooms a decode aborted before this server created them (the router sends to
    /// both at once), with when and why: a room created later fails at once. Kept until the
    /// bootstrap timeout.
    pub aborted: HashMap<u64, (std::time::Instant, String)>,
    pub conns: HashMap<u64, PrefillConn>,
    pub peers: HashMap<String, Peer>,
    pub next_id: u64,
    pub success_total: u64,
    pub failed_total: u64,
    pub bytes: u64,
    pub transfer_seconds: f64,
}

impl State {
    /// A fresh id (connections, peer generations).
    pub(crate) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Applies `to` to `room` under [`PollCell`]'s rule, recording `failure` and the totals.
    /// Returns whether the status changed.
    pub(crate) fn transition(&mut self, room: u64, to: KvPoll, failure: Option<String>) -> bool {
        let Some(r) = self.rooms.get_mut(&room) else {
            return false;
        };
        if !r.cell.set(to) {
            return false;
        }
        match to {
            KvPoll::Failed => {
                let why = failure.unwrap_or_else(|| "failed".into());
                log(format_args!("room {room} failed: {why}"));
                r.failure = Some(why);
                self.failed_total += 1;
            }
            KvPoll::Success => self.success_total += 1,
            KvPoll::WaitingForInput => r.handshake_at = Some(Instant::now()),
            _ => {}
        }
        true
    }
}

/// What every task shares (no task holds the shutdown sender, so dropping the manager ends
/// them).
#[derive(Debug)]
pub(crate) struct Shared {
    pub cfg: PdConfig,
    pub compat: ServerCompat,
    pub engine: Arc<dyn TransferEngine>,
    pub local: Vec<(RegionId, MemoryRegion)>,
    pub rt: tokio::runtime::Handle,
    /// For bootstrap fetches (timeout: the bootstrap timeout, at most 30 s).
    pub http: reqwest::Client,
    /// For heartbeats (timeout: the heartbeat interval).
    pub heartbeat_http: reqwest::Client,
    pub shutdown: watch::Receiver<bool>,
    state: Mutex<State>,
}

impl Shared {
    /// The state, recovering from a poisoned lock (a panicking task must not wedge the engine).
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves when the manager shuts down.
    pub(crate) async fn stopped(mut rx: watch::Receiver<bool>) {
        while !*rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }
}

#[derive(Debug)]
struct Handle {
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    bootstrap: Option<BootstrapServer>,
}

impl Handle {
    fn stop(&self) {
        self.shutdown.send_replace(true);
        if let Some(b) = &self.bootstrap {
            b.stop();
        }
        let mut st = self.shared.lock();
        let live: Vec<u64> = st.rooms.keys().copied().collect();
        for room in live {
            st.transition(
                room,
                KvPoll::Failed,
                Some("the PD manager shut down".into()),
            );
        }
        for (_, peer) in st.peers.drain() {
            for t in peer.tasks {
                t.abort();
            }
        }
        st.conns.clear();
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One server's PD transfer manager (SGLang's `KVManager`); cheap to clone.
#[doc(alias = "KVManager")]
#[derive(Debug, Clone)]
pub struct KvManager {
    handle: Arc<Handle>,
}

impl KvManager {
    /// Starts the manager on `rt`: a prefill binds its bootstrap server on
    /// `cfg.bootstrap_host:cfg.bootstrap_port` and a control listener on the same host (any
    /// port), and registers itself (5 attempts, backoff 1 s → 30 s); a decode starts idle and
    /// connects to prefill servers as receivers name them. `local` are this server's KV regions
    /// as registered with `engine` (ids from `register`), in layer/buffer order (both sides'
    /// orders agree when their [`ServerCompat`] does). `compat.regions` must be `local.len()`.
    pub fn start(
        cfg: PdConfig,
        compat: ServerCompat,
        engine: Arc<dyn TransferEngine>,
        local: Vec<(RegionId, MemoryRegion)>,
        rt: tokio::runtime::Handle,
    ) -> Result<KvManager, PdError> {
        if compat.regions as usize != local.len() {
            return Err(PdError::Invalid(format!(
                "ServerCompat.regions is {} but {} regions were given",
                compat.regions,
                local.len()
            )));
        }
        if compat.transfer_backend != engine.kind() {
            return Err(PdError::Invalid(format!(
                "ServerCompat.transfer_backend is {} but the engine is {}",
                compat.transfer_backend,
                engine.kind()
            )));
        }
        let (tx, rx) = watch::channel(false);
        let http = bootstrap::http_client(cfg.bootstrap_timeout.min(Duration::from_secs(30)))?;
        let heartbeat_http =
            bootstrap::http_client(cfg.heartbeat_interval.max(Duration::from_millis(20)))?;
        let shared = Arc::new(Shared {
            cfg,
            compat,
            engine,
            local,
            rt: rt.clone(),
            http,
            heartbeat_http,
            shutdown: rx,
            state: Mutex::new(State::default()),
        });
        let mut bootstrap_server = None;
        if shared.cfg.role == PdRole::Prefill {
            let server =
                BootstrapServer::start(&shared.cfg.bootstrap_host, shared.cfg.bootstrap_port, &rt)?;
            let control = prefill::start_listener(&shared)?;
            let reg = RankRegistration {
                role: "Prefill".into(),
                rank_ip: bootstrap::advertised(&shared.cfg.bootstrap_host),
                rank_port: control.port(),
                engine_rank: 0,
                compat: shared.compat.clone(),
            };
            let addr = server.addr();
            let addr = SocketAddr::new(
                bootstrap::advertised(&addr.ip().to_string())
                    .parse()
                    .unwrap_or(addr.ip()),
                addr.port(),
            );
            rt.spawn(async move {
                if let Err(e) =
                    bootstrap::register_rank(addr, &reg, 5, Duration::from_secs(1)).await
                {
                    log(format_args!("prefill registration failed: {e}"));
                }
            });
            bootstrap_server = Some(server);
        }
        let reaper = shared.clone();
        rt.spawn(async move {
            let every = reaper.cfg.reap_interval();
            let stop = Shared::stopped(reaper.shutdown.clone());
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(every) => {}
                }
                match reaper.cfg.role {
                    PdRole::Prefill => prefill::reap(&reaper),
                    PdRole::Decode => decode::reap(&reaper),
                }
            }
        });
        Ok(KvManager {
            handle: Arc::new(Handle {
                shared,
                shutdown: tx,
                bootstrap: bootstrap_server,
            }),
        })
    }

    /// Prefill: where the bootstrap server listens (`None` on decode).
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.handle.bootstrap.as_ref().map(|b| b.addr())
    }

    /// This manager's role.
    pub fn role(&self) -> PdRole {
        self.handle.shared.cfg.role
    }

    /// Prefill: a sender for `room` (`Bootstrapping` until decode's TransferInfo arrives; one
    /// that arrived earlier is used at once). A room that is still live is
    /// [`PdError::DuplicateRoom`].
    pub fn create_sender(&self, room: u64) -> Result<KvSender, PdError> {
        let shared = &self.handle.shared;
        if shared.cfg.role != PdRole::Prefill {
            return Err(PdError::WrongRole {
                call: "create_sender",
                role: "prefill",
            });
        }
        prefill::create_room(shared, room)?;
        Ok(KvSender::new(room, shared.clone()))
    }

    /// Decode: a receiver for `room`, whose KV the prefill server bootstrapped at `bootstrap`
    /// (`host:port`) computes. The first receiver for an address fetches its server info,
    /// checks [`ServerCompat`] and connects; later ones reuse the connection.
    pub fn create_receiver(&self, room: u64, bootstrap: &str) -> Result<KvReceiver, PdError> {
        let shared = &self.handle.shared;
        if shared.cfg.role != PdRole::Decode {
            return Err(PdError::WrongRole {
                call: "create_receiver",
                role: "decode",
            });
        }
        decode::create_room(shared, room, bootstrap)?;
        Ok(KvReceiver::new(room, shared.clone()))
    }

    /// Per-state counts of live rooms and the totals.
    pub fn stats(&self) -> PdStats {
        let st = self.handle.shared.lock();
        let mut s = PdStats {
            success_total: st.success_total,
            failed_total: st.failed_total,
            bytes: st.bytes,
            transfer_seconds: st.transfer_seconds,
            pending_infos: st.pending.len(),
            peers: st.peers.values().filter(|p| p.tx.is_some()).count(),
            ..PdStats::default()
        };
        for r in st.rooms.values() {
            match r.cell.get() {
                KvPoll::Bootstrapping => s.bootstrapping += 1,
                KvPoll::WaitingForInput => s.waiting_for_input += 1,
                KvPoll::Transferring => s.transferring += 1,
                _ => {}
            }
        }
        s
    }

    /// Prefill: stops the bootstrap server only (it stops answering `/route` and `/health`);
    /// live transfers go on. For graceful shutdown and tests of decode's heartbeats.
    pub fn stop_bootstrap_server(&self) {
        if let Some(b) = &self.handle.bootstrap {
            b.stop();
        }
    }

    /// Stops every task now and fails every live room (as dropping the last clone does).
    pub fn shutdown(&self) {
        self.handle.stop();
    }
}
