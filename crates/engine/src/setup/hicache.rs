//! The hierarchical cache's set-up (SGLang's `--enable-hierarchical-cache` and `--hicache-*`
//! flags): the host pool sized as SGLang sizes it, the cache controller over the runner's KV
//! store, the L3 store, and the tree's [`HiCacheConfig`].
//!
//! On the `cpu` backend the controller copies the store's host memory directly; on `wgpu`,
//! `cuda` and `rocm` it copies through the store's rows handle (`WgpuKvRows`, `CudaKvRows`:
//! kernels and read-backs on the device's queue or stream, ordered with the forward passes). A
//! backend not compiled in never gets here (building its runner failed first).

use std::sync::Arc;

use hicache::controller::HiCacheController;
use hicache::storage::{open_storage, StorageNamespace};
use kv_pool::host_pool::{HostKvPool, HostPoolSize, HostPoolSizeInput};
use kv_pool::{DeviceKvRows, KvLayout, KvStore};
use radix_cache::tiers::HiCacheConfig;

use super::components::AnyRunner;
use super::engine_setup::{EngineSetup, HiCacheSetup};
use crate::error::{EngineError, Result};

/// Host memory left to everything else: SGLang's 10 GiB, or a quarter of the machine's memory
/// where that is less (SGLang refuses any host pool on a machine with under 10 GiB free).
pub fn host_reserve_bytes(mem_total: u64) -> u64 {
    kv_pool::host_pool::HOST_MEMORY_RESERVE_BYTES.min(mem_total / 4)
}

/// What [`build_hicache`] made: the tree's configuration and the controller it will own.
pub struct HiCacheParts {
    /// For `RadixCache::with_host_tier`.
    pub config: HiCacheConfig,
    /// The controller (the tree owns it; the executor keeps its handle).
    pub controller: HiCacheController,
    /// The host pool's size, for the start-up line.
    pub size: HostPoolSize,
}

/// How the controller reaches the runner's KV store.
enum StoreAccess<'a> {
    /// The store's memory, in host addresses (the `cpu` backend).
    Memory(&'a dyn KvStore),
    /// A handle copying through the device's queue or stream (`wgpu`, `cuda`, `rocm`).
    Rows(Arc<dyn DeviceKvRows>),
}

impl<'a> StoreAccess<'a> {
    /// The access `runner`'s backend gives, or an error naming `--backend`.
    fn of(runner: &'a AnyRunner, setup: &EngineSetup) -> Result<Self> {
        if let Some(store) = runner.host_kv_store() {
            return Ok(StoreAccess::Memory(store));
        }
        runner
            .device_kv_rows()
            .map(StoreAccess::Rows)
            .ok_or_else(|| {
                EngineError::arg(
                    "--enable-hierarchical-cache",
                    format!(
                    "the host tier needs --backend cpu, wgpu, cuda or rocm, compiled in (got {})",
                    setup.backend
                ),
                )
            })
    }

    fn layout(&self) -> &KvLayout {
        match self {
            StoreAccess::Memory(store) => store.layout(),
            StoreAccess::Rows(rows) => rows.layout(),
        }
    }
}

/// Builds the host pool, the L3 store and the controller over `runner`'s KV store of
/// `device_slots` slots.
pub fn build_hicache(
    h: &HiCacheSetup,
    setup: &EngineSetup,
    runner: &AnyRunner,
    device_slots: usize,
) -> Result<HiCacheParts> {
    let access = StoreAccess::of(runner, setup)?;
    let layout = *access.layout();
    let p = layout.page_size;
    let (mem_total, mem_available) = super::pool::host_memory()?;
    let size = HostPoolSize::compute(HostPoolSizeInput {
        device_slots,
        page_size: p,
        bytes_per_token: layout.shape.slot_bytes(),
        hicache_ratio: h.ratio,
        hicache_size_gb: h.size_gb,
        mem_available_bytes: mem_available,
        reserve_bytes: host_reserve_bytes(mem_total),
    })
    .map_err(|e| {
        let flag = if h.size_gb > 0.0 {
            "--hicache-size"
        } else {
            "--hicache-ratio"
        };
        EngineError::arg(flag, e.to_string())
    })?;
    if size.warn_not_larger_than_device {
        eprintln!(
            "warning: the host KV pool ({} tokens) is not larger than the device pool ({device_slots}): it can hold little the device does not",
            size.slots
        );
    }
    let pool = HostKvPool::new(layout.shape, p, size.slots, h.mem_layout)
        .map_err(|e| EngineError::arg("--hicache-size", e.to_string()))?;
    let storage = match h.storage {
        None => None,
        Some(kind) => {
            let ns = StorageNamespace::new(&setup.model.name(), &layout.shape, p);
            let s = open_storage(kind, &h.storage_config, &ns, layout.page_bytes())
                .map_err(|e| EngineError::arg("--hicache-storage-backend", e.to_string()))?;
            Some(s)
        }
    };
    let controller = match access {
        // SAFETY: the CPU runner's store is a `HostKvStore` (host addresses) owned by the
        // runner, which the `ModelExecutor` owns; the executor stops the controller's IO thread
        // (`ControllerHandle::stop_io`) in its `Drop`, before the runner and its store go. The
        // scheduler keeps the contract on rows: the tree locks a written node until its write
        // ack and a loaded node until its load ack, and a forward pass reads a loaded layer
        // only after the pass's `LoadGate` released it, so no byte is read and written at once.
        // What this does not give is Rust's aliasing rule: the forward pass borrows a layer
        // buffer mutably as a whole while the IO thread touches other rows of it through the
        // raw addresses (as transfer's shm engine does); closing that needs the store to hand
        // out rows through raw pointers only.
        StoreAccess::Memory(store) => unsafe { HiCacheController::new(store, pool, storage) },
        StoreAccess::Rows(rows) => HiCacheController::with_device_rows(rows, pool, storage),
    }
    .map_err(|e| EngineError::arg("--enable-hierarchical-cache", e.to_string()))?;
    let config = h.tree_config(size.slots);
    Ok(HiCacheParts {
        config,
        controller,
        size,
    })
}
