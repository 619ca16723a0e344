//! [`TransferConfig`]: what the backends are built from.

/// How to build a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferConfig {
    /// Address the `tcp` receive listener binds and advertises (default `"127.0.0.1"`).
    pub host: String,
    /// `tcp`: connections per opened peer segment; `shm`: copy threads for large batches
    /// (default 4; 0 counts as 1).
    pub streams: usize,
    /// Test hook (`tcp`): flip one payload byte of the frame with this index, counting the
    /// frames this engine sends from 0, after its checksum was taken. The receiver detects it
    /// and the batch fails with `TransferError::Corrupted`. `None` in production.
    pub corrupt_frame: Option<u64>,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            host: "127.0.0.1".into(),
            streams: 4,
            corrupt_frame: None,
        }
    }
}
