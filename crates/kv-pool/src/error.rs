//! The crate's one error type. Every fallible operation validates its whole input before it
//! changes anything, so an `Err` always means "nothing happened".

use crate::{Page, ReqRow, Slot};

/// Errors of every kv-pool operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvPoolError {
    /// The allocator has too few free slots (an expected condition: evict or retract, then retry).
    #[error("out of KV memory: requested {requested_tokens} tokens, {available_tokens} available")]
    OutOfMemory {
        /// Tokens (slots) the call needed, counting whole pages.
        requested_tokens: usize,
        /// Tokens (slots) that were free.
        available_tokens: usize,
    },

    /// The request-to-token table has too few free rows.
    #[error("out of request rows: requested {requested}, {available} available")]
    OutOfRows {
        /// Rows the call needed.
        requested: usize,
        /// Rows that were free.
        available: usize,
    },

    /// A token count that must be a multiple of the page size is not.
    #[error("{n} tokens is not a multiple of the page size {page_size}")]
    NotPageAligned {
        /// The token count given (to `alloc`, or a pool size).
        n: usize,
        /// The allocator's page size.
        page_size: u32,
    },

    /// A slot lies outside the pool (or in the padding page, which is never allocated).
    #[error("{slot} is outside the allocatable range {first}..{end}")]
    SlotOutOfRange {
        /// The first slot of the call that lies outside `first..end`.
        slot: Slot,
        /// First allocatable slot.
        first: u32,
        /// One past the last allocatable slot.
        end: u32,
    },

    /// A page lies outside the pool (or is the padding page 0).
    #[error("{page} is outside the allocatable range 1..={last}")]
    PageOutOfRange {
        /// The page given: 0 (padding) or past `last`.
        page: Page,
        /// The last allocatable page (the pool's page count).
        last: u32,
    },

    /// A free of a page that is not allocated: a double free, or a free of a page never handed out.
    #[error(
        "{page} (from {slot}) is not allocated: double free or free of a page never handed out"
    )]
    PageNotAllocated {
        /// The page that is already free.
        page: Page,
        /// The slot given to `free` that maps to it.
        slot: Slot,
    },

    /// One request of an `alloc_extend` / `alloc_decode` batch is inconsistent.
    #[error("batch entry {index}: {reason}")]
    InvalidBatchEntry {
        /// Position of the entry in the batch.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },

    /// `free_group_begin` while a group is open, or `free_group_end` without one.
    #[error("free group misuse: {0}")]
    FreeGroup(&'static str),

    /// A backup was restored into an allocator of another shape.
    #[error("allocator state does not fit: {0}")]
    StateMismatch(String),

    /// An allocator name that names none of this crate's implementations.
    #[error("unknown allocator {name:?}; expected one of {expected}")]
    UnknownAllocator {
        /// The name given.
        name: String,
        /// The names accepted.
        expected: String,
    },

    /// A row index is outside the request-to-token table (or is the padding row 0).
    #[error("{row} is outside 1..={rows}")]
    RowOutOfRange {
        /// The row given: 0 (padding) or past `rows`.
        row: ReqRow,
        /// The last real row (the table's `max_running_requests`).
        rows: usize,
    },

    /// An operation on a row that is not allocated (includes a double free of a row).
    #[error("{row} is not allocated")]
    RowNotAllocated {
        /// The row given, which is free.
        row: ReqRow,
    },

    /// A range of positions does not fit in a row.
    #[error("positions {start}..{end} do not fit in a row of {width} positions")]
    RowRangeOutOfBounds {
        /// First position of the range (inclusive).
        start: usize,
        /// One past the last position (saturated on overflow).
        end: usize,
        /// Positions per row (`context_len + 4`).
        width: usize,
    },

    /// A configuration value is invalid (zero, inconsistent, or too large).
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The field or argument at fault.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },

    /// A size computation overflowed.
    #[error("size overflow computing {0}")]
    Overflow(&'static str),

    /// A layer index is out of range.
    #[error("layer {layer} is out of range (the layout has {layers} layers)")]
    LayerOutOfRange {
        /// The layer index given (layers count from 0).
        layer: usize,
        /// Layers in the layout.
        layers: usize,
    },

    /// A buffer passed to a store has the wrong length.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// The argument at fault, by its parameter name (`"k"`, `"v"`, `"dst"`, …).
        what: &'static str,
        /// Elements the layout and the slot count call for.
        expected: usize,
        /// Elements passed.
        got: usize,
    },

    /// The operation does not apply to this layout (e.g. labels on a plain MHA layout).
    #[error("unsupported for this layout: {0}")]
    Unsupported(String),

    /// The memory plan leaves no room for a KV pool.
    #[error("{0}")]
    PoolEmpty(String),

    /// A device store's backend failed (device lost, a buffer that could not be allocated or
    /// mapped, a driver error). Host stores never return it.
    #[error("device: {0}")]
    Device(String),

    /// Host memory for a store could not be reserved.
    #[error("could not allocate {bytes} bytes of host memory for the KV store")]
    HostOutOfMemory {
        /// Bytes the store needed for its whole layout.
        bytes: usize,
    },

    /// The host pool would leave less than the reserve of the host's available memory
    /// (SGLang's host pool sizing).
    #[error(
        "the host KV pool of {slots} slots needs {bytes} bytes, but only {mem_available_bytes} \
         bytes of host memory are available and {reserve_bytes} must stay free; lower \
         --hicache-ratio or --hicache-size"
    )]
    HostPoolTooLarge {
        /// Host slots asked for.
        slots: usize,
        /// Bytes they need.
        bytes: u64,
        /// Host memory available (`MemAvailable`).
        mem_available_bytes: u64,
        /// Memory that must stay free.
        reserve_bytes: u64,
    },

    /// Memory handed to [`HostKvStore::with_memory`](crate::HostKvStore::with_memory) is
    /// shorter than the layout's [`total_bytes`](crate::KvLayout::total_bytes).
    #[error("the KV store needs {needed} bytes of memory, the memory given has {got}")]
    MemoryTooSmall {
        /// `layout.total_bytes()`.
        needed: usize,
        /// The memory's length.
        got: usize,
    },
}

/// `Result` with [`KvPoolError`] as the default error: what every fallible kv-pool call returns.
pub type Result<T, E = KvPoolError> = std::result::Result<T, E>;
