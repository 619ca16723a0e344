//! The plain values the transfer crate names things by: [`BackendKind`] and the ids of
//! regions, segments and batches. They depend on nothing else in the crate, so the engine
//! trait and the errors can both use them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A region's id: its position in the registering engine's registration order (across calls).
pub type RegionId = u32;

/// Which backend moves the bytes (SGLang's `--disaggregation-transfer-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Framed, checksummed TCP streams (loopback or network).
    Tcp,
    /// Shared memory between two processes on one host.
    Shm,
    /// NVIDIA NIXL (RDMA / UCX).
    Nixl,
    /// Moves nothing and succeeds (warm-up).
    Fake,
}

impl BackendKind {
    /// Every backend, compiled or not.
    pub const ALL: [BackendKind; 4] = [
        BackendKind::Tcp,
        BackendKind::Shm,
        BackendKind::Nixl,
        BackendKind::Fake,
    ];

    /// The flag value and feature name.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Tcp => "tcp",
            BackendKind::Shm => "shm",
            BackendKind::Nixl => "nixl",
            BackendKind::Fake => "fake",
        }
    }

    /// Parses a flag value.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Whether this build has the backend's feature.
    pub fn compiled(self) -> bool {
        match self {
            BackendKind::Tcp => cfg!(feature = "tcp"),
            BackendKind::Shm => cfg!(feature = "shm"),
            BackendKind::Nixl => cfg!(feature = "nixl"),
            BackendKind::Fake => cfg!(feature = "fake"),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An opened peer segment, on the engine that opened it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SegmentId(pub u64);

/// A submitted batch, on the engine that submitted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BatchId(pub u64);
