//! [`AttentionError`], the one error every backend returns, so a caller handles the CPU and
//! device backends alike (device failures are the [`AttentionError::Device`] variant).

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
        /// The argument's name in the op's signature (`"q"`, `"weight"`, …).
        what: &'static str,
        /// The shape the op derived from its other arguments, outermost dimension first.
        expected: Vec<usize>,
        /// The argument's actual shape.
        got: Vec<usize>,
    },
    /// A host slice has the wrong length.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// The argument's name in the op's signature (`"data"`, `"positions"`, …).
        what: &'static str,
        /// Elements the shape implies.
        expected: usize,
        /// Elements the slice has.
        got: usize,
    },
    /// Query heads must be a positive multiple of KV heads (GQA/MQA grouping).
    #[error("q_heads {q_heads} is not a positive multiple of kv_heads {kv_heads}")]
    HeadsNotMultiple {
        /// Heads of the query tensor.
        q_heads: usize,
        /// Heads of the K/V tensors or the store (`0` is refused too).
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
        /// The slot the batch gave for that position.
        slot: Slot,
        /// `P`, the batch's page size in tokens.
        page_size: u32,
        /// Which part of the rule fails.
        reason: &'static str,
    },
    /// A request's lengths are inconsistent (e.g. more new tokens than KV positions).
    #[error("request {request}: {reason}")]
    InvalidRequest {
        /// Index of the request in the batch.
        request: usize,
        /// The inconsistency, with the numbers involved.
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The field's name as the configuration type spells it (`"rotary_dim"`, `"top_k"`).
        field: &'static str,
        /// The value given and the range it must be in.
        reason: String,
    },
    /// The operation is not supported for this layout, dtype or backend.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The batch plan was built for a different page size than the store's.
    #[error("batch plan has page size {plan}, the KV store has {store}")]
    PageSizeMismatch {
        /// `P` of the [`BatchMetadata`](crate::BatchMetadata) the plan was built from.
        plan: u32,
        /// `P` of the store's [`kv_pool::KvLayout`].
        store: u32,
    },
    /// The device failed: no adapter, a lost device, a buffer that could not be allocated or
    /// mapped, a driver error (device backends only; the CPU backend never returns it).
    #[error("device: {0}")]
    Device(String),
    /// Host memory could not be reserved.
    #[error("host out of memory reserving {bytes} bytes")]
    HostOutOfMemory {
        /// The size of the reservation that failed, in bytes.
        bytes: usize,
    },
}

/// `Result` with [`AttentionError`] as the default error.
pub type Result<T, E = AttentionError> = std::result::Result<T, E>;
