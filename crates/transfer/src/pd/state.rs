//! The state every PD task shares: the rooms, connections and peers behind one lock
//! ([`Shared::lock`]), and the jobs a room's transfer worker takes. The lowest layer of `pd`:
//! it depends on no protocol module, and the role modules (`prefill`, `decode`), the handles
//! (`sender`, `receiver`) and the manager build on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kv_pool::{MemoryRegion, Page};
use tokio::sync::{mpsc, watch};

use crate::engine::{RegionId, RemoteRegion, SegmentId, TransferBlock, TransferEngine};
use crate::pd::config::{PdConfig, ServerCompat, TransferAux};
use crate::pd::control::ControlMsg;
use crate::pd::kv_poll::{KvPoll, PollCell};
use crate::pd::log;

/// Work for a room's transfer worker.
#[derive(Debug)]
pub(crate) enum Job {
    /// One chunk's blocks; `aux` with the last chunk.
    Send {
        blocks: Vec<TransferBlock>,
        aux: Option<TransferAux>,
    },
    /// Stop: wait for the batches in flight, then answer decode (`ack`: ABORT_ACK for decode's
    /// abort, else a Failed status).
    Abort { ack: bool },
}

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
    /// Behind [`Shared::lock`]; built by the manager.
    pub(super) state: Mutex<State>,
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
