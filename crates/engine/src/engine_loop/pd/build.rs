//! Building a prefill or decode server's PD half: the transfer engine over the KV store's
//! memory regions, the KV manager (bootstrap server, control channel, heartbeats) and the
//! runtime they run on.

use std::sync::Arc;

use kv_pool::{HostMemory, MemoryRegion};
use transfer::pd::{KvManager, PdConfig, PdRole, ServerCompat};
use transfer::TransferConfig;

use super::{DecodeSide, PdSide, PrefillSide};
use crate::disagg::{DisaggregationMode, KvHostMirror, LocalKv, PdOptions};
use crate::error::{EngineError, Result};
use crate::setup::components::ModelForward;
use crate::setup::ModelExecutor;

/// The PD half of a prefill or decode server (`None` in `null` mode): registers the KV store
/// with the transfer engine and starts the manager on its own runtime.
pub fn build_pd_side(
    opts: &PdOptions,
    local: LocalKv<'_>,
    exec: &mut ModelExecutor,
) -> Result<Option<PdSide>> {
    let role = match opts.mode {
        DisaggregationMode::Null => return Ok(None),
        DisaggregationMode::Prefill => PdRole::Prefill,
        DisaggregationMode::Decode => PdRole::Decode,
    };
    let regions = transfer_regions(opts, role, exec)?;
    let runner = exec.runner();
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
    // SAFETY: the regions are the KV store's buffers (or its host mirror's, which the executor
    // owns), which live as long as the executor, and
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

/// The host memory the transfer engine registers: the `cpu` store's buffers, or, for a store
/// on a device, a [`KvHostMirror`] of it that the executor keeps (in a shared mapping on an
/// `shm` decode server, where prefill servers on this host write into it).
fn transfer_regions(
    opts: &PdOptions,
    role: PdRole,
    exec: &mut ModelExecutor,
) -> Result<Vec<MemoryRegion>> {
    let runner = exec.runner();
    let regions = runner.kv_memory_regions();
    if !regions.is_empty() {
        return Ok(regions);
    }
    let Some(rows) = runner.device_kv_rows() else {
        return Err(EngineError::arg(
            "--disaggregation-mode",
            format!(
                "the {} backend gives no access to its KV store for a transfer",
                runner.backend_name()
            ),
        ));
    };
    let shared = opts.backend == transfer::BackendKind::Shm && role == PdRole::Decode;
    let memory: Option<Box<dyn HostMemory>> = if shared {
        let mem = transfer::shm::SharedMemory::create(rows.layout().total_bytes())
            .map_err(|e| EngineError::arg("--disaggregation-transfer-backend", e.to_string()))?;
        Some(Box::new(mem))
    } else {
        None
    };
    let mirror = KvHostMirror::new(rows, memory).map_err(|e| {
        EngineError::arg(
            "--disaggregation-mode",
            format!("the KV store's host mirror: {e}"),
        )
    })?;
    let regions = mirror.memory_regions();
    exec.set_kv_mirror(mirror);
    Ok(regions)
}
