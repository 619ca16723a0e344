//! [`PdOptions`]: a server's PD settings from `serve`'s flags, validated; [`LocalKv`]: what
//! both servers of a pair must agree on.

use std::time::Duration;

use transfer::BackendKind as TransferBackend;

use super::DisaggregationMode;
use crate::cli::DisaggregationArgs;
use crate::error::{EngineError, Result};

/// The PD settings of a server, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct PdOptions {
    pub mode: DisaggregationMode,
    pub backend: TransferBackend,
    /// The address the bootstrap server and the transfer listener bind (the server's `--host`).
    pub host: String,
    pub bootstrap_port: u16,
    pub bootstrap_timeout: Duration,
    pub waiting_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub heartbeat_max_failures: u32,
    /// Test hook (`--disaggregation-test-corrupt-frame N`): the tcp backend corrupts its N-th
    /// frame after checksumming it, so tests can see a corrupted transfer fail cleanly.
    pub corrupt_frame: Option<u64>,
}

impl PdOptions {
    /// Reads `serve`'s flags.
    pub fn from_args(a: &DisaggregationArgs, host: &str) -> Result<Self> {
        let mode = DisaggregationMode::parse(&a.disaggregation_mode)?;
        let backend =
            TransferBackend::parse(&a.disaggregation_transfer_backend).ok_or_else(|| {
                EngineError::arg(
                    "--disaggregation-transfer-backend",
                    format!(
                        "`{}` is not one of tcp, shm, nixl, fake",
                        a.disaggregation_transfer_backend
                    ),
                )
            })?;
        if !backend.compiled() {
            return Err(EngineError::arg(
                "--disaggregation-transfer-backend",
                backend.not_compiled().to_string(),
            ));
        }
        let secs = |flag: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 && v < 1e9 {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(EngineError::arg(
                    flag,
                    format!("must be a positive number of seconds, got {v}"),
                ))
            }
        };
        if a.disaggregation_heartbeat_max_failures == 0 {
            return Err(EngineError::arg(
                "--disaggregation-heartbeat-max-failures",
                "must be at least 1",
            ));
        }
        Ok(PdOptions {
            mode,
            backend,
            host: host.to_string(),
            bootstrap_port: a.disaggregation_bootstrap_port,
            bootstrap_timeout: secs(
                "--disaggregation-bootstrap-timeout",
                a.disaggregation_bootstrap_timeout,
            )?,
            waiting_timeout: secs(
                "--disaggregation-waiting-timeout",
                a.disaggregation_waiting_timeout,
            )?,
            heartbeat_interval: secs(
                "--disaggregation-heartbeat-interval",
                a.disaggregation_heartbeat_interval,
            )?,
            heartbeat_max_failures: a.disaggregation_heartbeat_max_failures,
            corrupt_frame: a.disaggregation_test_corrupt_frame,
        })
    }
}

/// What both sides of a pair must agree on, from this server's model and pool.
pub struct LocalKv<'a> {
    pub model: &'a str,
    pub page_size: u32,
    pub kv_dtype: &'a str,
}
