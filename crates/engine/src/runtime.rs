//! The multi-threaded tokio runtime that `serve`, `router` and `bench --url` run on, and the
//! listener `serve` and `router` bind.

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

/// Binds `host:port` (port 0: any free port); returns the listener and the address it got.
pub async fn bind(
    host: &str,
    port: u16,
) -> Result<(tokio::net::TcpListener, std::net::SocketAddr)> {
    let addr = format!("{host}:{port}");
    let io = |source| EngineError::Io {
        path: addr.clone(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(io)?;
    let local = listener.local_addr().map_err(io)?;
    Ok((listener, local))
}
