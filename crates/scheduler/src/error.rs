//! The crate's error type.

use kv_pool::KvPoolError;
use radix_cache::RadixCacheError;

use crate::ReqId;

/// Errors of scheduler operations.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// A request that cannot be served as given (empty, too long, bad limits).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The waiting queue is at `max_queued_requests`.
    #[error("the waiting queue is full ({limit} requests)")]
    QueueFull {
        /// The configured limit.
        limit: usize,
    },
    /// An id that is not (or no longer) known.
    #[error("unknown request {0}")]
    UnknownRequest(ReqId),
    /// A configuration value out of range.
    #[error("invalid configuration {field}: {reason}")]
    InvalidConfig {
        /// The flag or field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The executor failed.
    #[error("executor: {0}")]
    Executor(String),
    /// A strict-mode check found the pool partition or accounting broken (a bug).
    #[error("invariant violated after step {step}: {message}")]
    Invariant {
        /// Scheduler step.
        step: u64,
        /// What failed.
        message: String,
    },
    /// The prefix cache refused an operation.
    #[error(transparent)]
    Cache(#[from] RadixCacheError),
    /// The memory pools refused an operation.
    #[error(transparent)]
    Pool(#[from] KvPoolError),
}

/// Result alias for this crate.
pub type Result<T, E = SchedulerError> = std::result::Result<T, E>;
