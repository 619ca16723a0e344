//! The crate's error type.

use kv_pool::KvPoolError;
use radix_cache::RadixCacheError;

use crate::disagg::ReqStage;
use crate::ReqId;

/// Errors of scheduler operations. Bad input and configuration are refused with these before
/// anything changes; `Cache` and `Pool` after a step started mean a bug.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// A request that cannot be served as given (empty, too long, bad limits).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The waiting queue is at `max_queued_requests`.
    #[error("the waiting queue is full ({limit} requests)")]
    QueueFull {
        /// The configured limit (`--max-queued-requests`).
        limit: usize,
    },
    /// An id that is not (or no longer) known.
    #[error("unknown request {0}")]
    UnknownRequest(ReqId),
    /// A known request asked to do what its stage does not allow (PD: commit a request that
    /// is not transferring, release one that holds no KV).
    #[error("request {id} is {found}, not {expected}")]
    WrongStage {
        /// The request.
        id: ReqId,
        /// The stage the operation needs.
        expected: ReqStage,
        /// The stage it is in.
        found: ReqStage,
    },
    /// A configuration value out of range.
    #[error("invalid configuration {field}: {reason}")]
    InvalidConfig {
        /// The flag (SGLang's name, e.g. `--page-size`) or field.
        field: &'static str,
        /// What the value must be.
        reason: String,
    },
    /// The executor failed.
    #[error("executor: {0}")]
    Executor(String),
    /// A strict-mode check found the pool partition or accounting broken (a bug).
    #[error("invariant violated after step {step}: {message}")]
    Invariant {
        /// The step after which the check failed (from 1).
        step: u64,
        /// The violated invariant, with the numbers.
        message: String,
    },
    /// The prefix cache refused an operation.
    #[error(transparent)]
    Cache(#[from] RadixCacheError),
    /// The memory pools refused an operation.
    #[error(transparent)]
    Pool(#[from] KvPoolError),
}

/// `Result` with [`SchedulerError`] as the default error.
pub type Result<T, E = SchedulerError> = std::result::Result<T, E>;
