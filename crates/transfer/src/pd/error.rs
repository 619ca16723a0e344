//! [`PdError`]: what the PD protocol's calls refuse, typed. A call that returns `Err` changed
//! nothing.

use crate::coalesce::CoalesceError;
use crate::error::TransferError;
use crate::pd::kv_poll::KvPoll;

/// Why a PD call was refused or a room failed to start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PdError {
    /// A room that is still live on this manager.
    #[error("bootstrap room {room} is already in use on this server")]
    DuplicateRoom {
        /// The room.
        room: u64,
    },
    /// A call that needs another state (e.g. `send` before `WaitingForInput`).
    #[error("room {room}: {call} needs {needs}, but the room is {state}")]
    WrongState {
        /// The room.
        room: u64,
        /// The call.
        call: &'static str,
        /// What it needs.
        needs: &'static str,
        /// Where the room stands.
        state: KvPoll,
    },
    /// A call for the other role (`create_sender` on a decode manager …).
    #[error("{call} is a {role} call")]
    WrongRole {
        /// The call.
        call: &'static str,
        /// The role it belongs to.
        role: &'static str,
    },
    /// The pages sent do not match the destination pages decode gave.
    #[error("room {room}: {detail}")]
    PageCountMismatch {
        /// The room.
        room: u64,
        /// What does not add up.
        detail: String,
    },
    /// The two servers cannot exchange pages.
    #[error("incompatible prefill server: {field} is {theirs} there but {ours} here")]
    Incompatible {
        /// The first field that differs (a [`ServerCompat`](crate::pd::ServerCompat) field).
        field: &'static str,
        /// This server's value.
        ours: String,
        /// The peer's value.
        theirs: String,
    },
    /// The bootstrap server could not be reached or answered nonsense.
    #[error("bootstrap {addr}: {reason}")]
    Bootstrap {
        /// `host:port`.
        addr: String,
        /// What failed.
        reason: String,
    },
    /// A bad argument (an unparsable address, a bind that failed …).
    #[error("{0}")]
    Invalid(String),
    /// The regions or pages cannot be paired.
    #[error(transparent)]
    Coalesce(#[from] CoalesceError),
    /// The transfer engine refused.
    #[error(transparent)]
    Transfer(#[from] TransferError),
}
