//! Building a prefill or decode server's PD half: the transfer engine over the KV store's
//! memory regions, the KV manager (bootstrap server, control channel, heartbeats) and the
//! runtime they run on.

use std::sync::Arc;
use std::time::Duration;

use transfer::pd::{KvManager, PdConfig, PdRole, ServerCompat};
use transfer::{BackendKind as TransferBackend, TransferConfig};

use super::{DecodeSide, DisaggregationMode, PdSide, PrefillSide};
use crate::cli::DisaggregationArgs;
use crate::error::{EngineError, Result};
use crate::setup::components::ModelForward;
use crate::setup::ModelExecutor;

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

/// The PD half of a prefill or decode server (`None` in `null` mode): registers the KV store
/// with the transfer engine and starts the manager on its own runtime.
pub fn build_pd_side(
    opts: &PdOptions,
    local: LocalKv<'_>,
    exec: &ModelExecutor,
) -> Result<Option<PdSide>> {
    let role = match opts.mode {
        DisaggregationMode::Null => return Ok(None),
        DisaggregationMode::Prefill => PdRole::Prefill,
        DisaggregationMode::Decode => PdRole::Decode,
    };
    let runner = exec.runner();
    let regions = runner.kv_memory_regions();
    if regions.is_empty() {
        return Err(EngineError::arg(
            "--disaggregation-mode",
            format!(
                "PD disaggregation moves KV from host memory; the {} backend keeps it on the device (use --backend cpu)",
                runner.backend_name()
            ),
        ));
    }
    let pd_err =
        |e: transfer::TransferError| EngineError::arg("--disaggregation-mode", e.to_string());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvserve-transfer")
        .enable_all()
        .build()
        .map_err(|source| EngineError::Io {
            path: "the transfer runtime".into(),
            source,
        })?;
    let cfg = TransferConfig {
        host: opts.host.clone(),
        corrupt_frame: opts.corrupt_frame,
        ..TransferConfig::default()
    };
    let engine = {
        let _guard = runtime.enter();
        transfer::new_engine(opts.backend, &cfg).map_err(pd_err)?
    };
    // SAFETY: the regions are the KV store's buffers, which live as long as the executor, and
    // the executor outlives the PD side (both are owned by the engine loop, which drops the PD
    // side first). The scheduler keeps `register`'s promise: a request's pages belong to it
    // until its transfer ends (held on prefill, preallocated on decode), so the engine thread
    // touches no byte a batch names while it is in flight.
    let ids = unsafe { engine.register(&regions) }.map_err(pd_err)?;
    let compat = ServerCompat {
        model: local.model.to_string(),
        page_size: local.page_size,
        kv_dtype: local.kv_dtype.to_string(),
        page_bytes: runner.kv_page_bytes() as u64,
        regions: regions.len() as u32,
        transfer_backend: opts.backend,
    };
    let cfg = PdConfig {
        role,
        bootstrap_host: opts.host.clone(),
        bootstrap_port: opts.bootstrap_port,
        bootstrap_timeout: opts.bootstrap_timeout,
        waiting_timeout: opts.waiting_timeout,
        heartbeat_interval: opts.heartbeat_interval,
        heartbeat_max_failures: opts.heartbeat_max_failures,
    };
    let local_regions = ids.into_iter().zip(regions).collect();
    let manager = KvManager::start(
        cfg,
        compat,
        Arc::clone(&engine),
        local_regions,
        runtime.handle().clone(),
    )
    .map_err(|e| EngineError::arg("--disaggregation-mode", e.to_string()))?;
    Ok(Some(match role {
        PdRole::Prefill => PdSide::Prefill(PrefillSide::new(
            manager,
            local.page_size,
            runner.kv_page_bytes(),
            runtime,
        )),
        PdRole::Decode => PdSide::Decode(DecodeSide::new(manager, runtime)),
    }))
}
