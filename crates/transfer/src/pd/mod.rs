//! The PD protocol on top of [`TransferEngine`](crate::TransferEngine): SGLang's
//! `disaggregation/base/conn.py` (the API) and `common/conn.py` + `mooncake/conn.py` (the
//! bootstrap server, the handshake, the transfer workers, timeouts and heartbeats).
//!
//! ```text
//! prefill: KvManager ── bootstrap HTTP (PUT/GET /route, /health) ── control listener (TCP)
//!            └ KvSender per room: Bootstrapping → WaitingForInput (decode's TransferInfo)
//!                                 → Transferring (send) → Success (last batch done, aux sent)
//! decode:  KvManager ── per prefill: GET /route (compat check), control connection, heartbeat
//!            └ KvReceiver per room: Bootstrapping → WaitingForInput (connected)
//!                                   → Transferring (send_metadata) → Success (prefill's status)
//! ```
//!
//! Invariants:
//! - A room's status follows [`PollCell`]: it only rises, `Failed` overrides, a terminal status
//!   never changes (a forgotten room is never resurrected: later messages for it are ignored).
//! - Calls are synchronous and non-blocking (the engine thread calls them between scheduler
//!   steps); the work runs on the tokio runtime handle given to [`KvManager::start`].
//! - Nothing waits forever: bootstrap and waiting timeouts, heartbeats, and a closed control
//!   connection fail the rooms concerned; a malformed or oversized control frame closes its
//!   connection with a logged error.
//! - A prefill reports a room's end (Success, Failed or ABORT_ACK) only after every batch it
//!   submitted for the room settled, so a decode room whose prefill answered holds no write in
//!   flight ([`KvReceiver::quiescent`]).

mod bootstrap;
mod config;
mod control;
mod decode;
mod error;
mod kv_poll;
mod manager;
mod prefill;
mod receiver;
mod sender;
mod state;

pub use bootstrap::{RankAddr, RankRegistration, ServerInfo};
pub use config::{PdConfig, PdRole, PdStats, ServerCompat, TransferAux, TransferInfo};
pub use control::{ControlMsg, MAX_FRAME};
pub use error::PdError;
pub use kv_poll::{KvPoll, PollCell};
pub use manager::KvManager;
pub use receiver::KvReceiver;
pub use sender::KvSender;

/// The protocol's log line (the workspace logs to stderr).
pub(crate) fn log(args: std::fmt::Arguments<'_>) {
    eprintln!("kvserve pd: {args}");
}
