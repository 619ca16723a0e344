//! The crate's error type. Every operation validates before it mutates: `Err` changes nothing.

use kv_pool::KvPoolError;

use crate::NodeId;

/// Why a prefix-cache operation was refused; the cache is unchanged (bad input is an error,
/// never a panic).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RadixCacheError {
    /// A node id that is not (or no longer) in the tree.
    #[error("{0} is not in the tree (evicted, or never existed)")]
    StaleNode(NodeId),
    /// `dec_lock_ref` on a path whose lock count is already zero.
    #[error("lock underflow: {0} is not locked")]
    LockUnderflow(NodeId),
    /// Keys and slots of different lengths, or a request view that does not add up.
    #[error("{what}: expected {expected}, got {got}")]
    LengthMismatch {
        /// What was being checked.
        what: &'static str,
        /// The length the other input implies.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// An eviction policy name that is not known.
    #[error("unknown eviction policy {name:?}; known: {known}")]
    UnknownPolicy {
        /// The name given.
        name: String,
        /// The names accepted.
        known: String,
    },
    /// A configuration name that is not known (a HiCache write or prefetch policy).
    #[error("unknown {what} {name:?}; known: {known}")]
    UnknownOption {
        /// What was being parsed.
        what: &'static str,
        /// The name given.
        name: String,
        /// The names accepted.
        known: String,
    },
    /// A device ↔ host copy failed every time it was tried (a device that keeps failing):
    /// the node's rows on one tier are undefined, so the cache stops instead of serving them.
    #[error("the {kind} copy of {node} failed {attempts} times, last: {reason}")]
    CopyFailed {
        /// `write` (device → host) or `load` (host → device).
        kind: &'static str,
        /// The node the copy ends at.
        node: NodeId,
        /// Attempts made.
        attempts: u32,
        /// The controller's last reason.
        reason: String,
    },
    /// A host-tier operation that does not fit the cache's state (e.g. adding a host tier to a
    /// cache that already holds nodes).
    #[error("host tier: {0}")]
    Tier(String),
    /// The request's state does not fit the operation (e.g. protected length past its tokens).
    #[error("invalid request state: {0}")]
    InvalidRequest(String),
    /// An allocator or request-table error underneath (freeing slots, reading rows).
    #[error(transparent)]
    KvPool(#[from] KvPoolError),
}

/// `Result` with [`RadixCacheError`] as the error, as every fallible call here returns.
pub type Result<T, E = RadixCacheError> = std::result::Result<T, E>;

/// Refuses an insert whose slots are not one per key token.
pub(crate) fn check_insert_lengths(key: &[u32], slots: &[kv_pool::Slot]) -> Result<()> {
    if slots.len() != key.len() {
        return Err(RadixCacheError::LengthMismatch {
            what: "insert slots",
            expected: key.len(),
            got: slots.len(),
        });
    }
    Ok(())
}
