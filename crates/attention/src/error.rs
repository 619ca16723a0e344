//! The crate's one error type.

use kv_pool::{KvPoolError, Slot};

/// Everything the attention crate refuses. Bad input is always an error, never a panic.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttentionError {
    /// The KV store refused an operation (layer out of range, slot out of range, …).
    #[error("kv store: {0}")]
    KvPool(#[from] KvPoolError),
    /// A tensor or slice does not have the shape the operation needs.
    #[error("{what}: expected shape {expected:?}, got {got:?}")]
    ShapeMismatch {
        /// Which argument.
        what: &'static str,
        /// The shape required.
        expected: Vec<usize>,
        /// The shape given.
        got: Vec<usize>,
    },
    /// A host slice has the wrong length.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// Which argument.
        what: &'static str,
        /// Elements required.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// Query heads must be a positive multiple of KV heads (GQA/MQA grouping).
    #[error("q_heads {q_heads} is not a positive multiple of kv_heads {kv_heads}")]
    HeadsNotMultiple {
        /// Query heads.
        q_heads: usize,
        /// KV heads.
        kv_heads: usize,
    },
    /// A request's slot breaks the paging rule: position `p` must sit at offset `p mod P` of the
    /// page that holds the request's page index `p / P`.
    #[error(
        "request {request}: position {position} is at slot {slot}, which breaks the page rule \
         for page size {page_size} ({reason})"
    )]
    PageRule {
        /// Index of the request in the batch.
        request: usize,
        /// Token position within the request.
        position: usize,
        /// The offending slot.
        slot: Slot,
        /// Page size of the batch.
        page_size: u32,
        /// Which part of the rule fails.
        reason: &'static str,
    },
    /// A request's lengths are inconsistent (e.g. more new tokens than KV positions).
    #[error("request {request}: {reason}")]
    InvalidRequest {
        /// Index of the request in the batch.
        request: usize,
        /// What is wrong.
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// The operation is not supported for this layout, dtype or backend.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The batch plan was built for a different page size than the store's.
    #[error("batch plan has page size {plan}, the KV store has {store}")]
    PageSizeMismatch {
        /// Page size of the plan.
        plan: u32,
        /// Page size of the store.
        store: u32,
    },
    /// The device failed: no adapter, a lost device, a buffer that could not be allocated or
    /// mapped, a driver error (device backends only; the CPU backend never returns it).
    #[error("device: {0}")]
    Device(String),
    /// Host memory could not be reserved.
    #[error("host out of memory reserving {bytes} bytes")]
    HostOutOfMemory {
        /// Bytes asked for.
        bytes: usize,
    },
}

/// The crate's result type.
pub type Result<T, E = AttentionError> = std::result::Result<T, E>;
