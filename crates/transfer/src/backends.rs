//! [`new_engine`]: the backend factory.

use std::sync::Arc;

use crate::config::TransferConfig;
use crate::engine::{BackendKind, TransferEngine};
use crate::error::Result;

/// Builds a backend (SGLang's `--disaggregation-transfer-backend`). Must be called inside a
/// tokio runtime (the `tcp` backend starts its listener). A backend whose Cargo feature is off
/// is [`TransferError::NotCompiled`](crate::TransferError::NotCompiled); `nixl` without a real
/// NIXL library loaded is a typed error naming NIXL.
pub fn new_engine(kind: BackendKind, cfg: &TransferConfig) -> Result<Arc<dyn TransferEngine>> {
    let _ = cfg;
    match kind {
        #[cfg(feature = "tcp")]
        BackendKind::Tcp => Ok(Arc::new(crate::tcp::TcpEngine::new(cfg)?)),
        #[cfg(all(feature = "shm", target_os = "linux"))]
        BackendKind::Shm => Ok(Arc::new(crate::shm::ShmEngine::new(cfg))),
        #[cfg(feature = "fake")]
        BackendKind::Fake => Ok(Arc::new(crate::fake::FakeEngine::new())),
        #[cfg(feature = "nixl")]
        BackendKind::Nixl => Ok(Arc::new(crate::nixl::NixlTransferEngine::new(
            crate::nixl::NixlConfig::unique(&cfg.host),
        )?)),
        // Reached only by backends whose feature is off (none, with every feature on).
        #[allow(unreachable_patterns)]
        other => Err(other.not_compiled()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TransferError;

    #[tokio::test]
    async fn every_default_backend_builds_and_nixl_refuses_without_nixl() {
        let cfg = TransferConfig::default();
        for kind in [BackendKind::Tcp, BackendKind::Shm, BackendKind::Fake] {
            assert_eq!(new_engine(kind, &cfg).unwrap().kind(), kind);
        }
        let nixl = new_engine(BackendKind::Nixl, &cfg).unwrap_err();
        if cfg!(feature = "nixl") {
            assert!(nixl.to_string().contains("NIXL"), "{nixl}");
        } else {
            assert_eq!(
                nixl,
                TransferError::NotCompiled {
                    backend: BackendKind::Nixl
                }
            );
        }
    }

    #[test]
    fn tcp_outside_a_runtime_is_an_error_not_a_panic() {
        let err = new_engine(BackendKind::Tcp, &TransferConfig::default()).unwrap_err();
        assert!(err.to_string().contains("tokio runtime"), "{err}");
    }
}
