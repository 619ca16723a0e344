//! [`TransferError`]: the crate's one error type.

use crate::ids::{BackendKind, BatchId, RegionId, SegmentId};

/// What went wrong in a transfer or its handshake. Every variant names what it refers to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The backend's Cargo feature is off in this build.
    #[error("the {backend} transfer backend is not compiled in (enable the `{backend}` feature of the transfer crate)")]
    NotCompiled {
        /// The backend asked for.
        backend: BackendKind,
    },
    /// A block names a region this engine (or the peer's segment) never registered.
    #[error("unknown {side} region {region}")]
    UnknownRegion {
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// The region id given.
        region: RegionId,
    },
    /// A block reaches outside its region.
    #[error("{side} region {region}: bytes {offset}..{end} are outside its {len} bytes")]
    OutOfBounds {
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// The region.
        region: RegionId,
        /// First byte of the block.
        offset: u64,
        /// One past its last byte.
        end: u64,
        /// The region's length.
        len: u64,
    },
    /// A segment id that is not open (never opened, or closed).
    #[error("segment {0:?} is not open")]
    UnknownSegment(SegmentId),
    /// A batch id this engine does not know (never submitted, or already reaped).
    #[error("unknown batch {0:?}")]
    UnknownBatch(BatchId),
    /// A segment descriptor of another backend, or one this backend cannot use.
    #[error("bad segment descriptor: {0}")]
    BadSegment(String),
    /// Memory a backend cannot register (null, empty, overlapping, or not shared where it must be).
    #[error("cannot register memory: {0}")]
    BadRegion(String),
    /// A frame arrived with a checksum that does not match its bytes.
    #[error("corrupted frame: checksum mismatch at destination region {region} offset {offset}")]
    Corrupted {
        /// The destination region of the frame.
        region: RegionId,
        /// Its destination offset.
        offset: u64,
    },
    /// The peer went away or could not be reached.
    #[error("peer {peer}: {reason}")]
    PeerUnreachable {
        /// The peer's address.
        peer: String,
        /// What failed.
        reason: String,
    },
    /// An operation outlived its deadline.
    #[error("timed out after {seconds} s: {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The deadline.
        seconds: u64,
    },
    /// A backend's own library refused or failed an operation (NIXL's status, its text kept).
    #[error("{backend} backend: {what}: {message}")]
    Backend {
        /// The backend whose library failed.
        backend: BackendKind,
        /// What was being done (`"create agent"`, `"post transfer request"`, …).
        what: String,
        /// The library's error text.
        message: String,
    },
    /// An I/O or system-call failure (mapping, socket) with its context.
    #[error("{context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS's message.
        message: String,
    },
}

impl TransferError {
    /// An [`TransferError::Io`] from a `std::io::Error` and what was being done.
    pub fn io(context: impl Into<String>, e: &std::io::Error) -> Self {
        TransferError::Io {
            context: context.into(),
            message: e.to_string(),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = TransferError> = std::result::Result<T, E>;

impl BackendKind {
    /// [`TransferError::NotCompiled`] for this backend.
    pub fn not_compiled(self) -> TransferError {
        TransferError::NotCompiled { backend: self }
    }
}
