//! The multi-threaded tokio runtime that `serve` and `bench --url` run on.

use crate::error::{EngineError, Result};

/// A multi-threaded tokio runtime with I/O and timers enabled.
pub fn async_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| EngineError::Io {
            path: "the async runtime".into(),
            source,
        })
}
