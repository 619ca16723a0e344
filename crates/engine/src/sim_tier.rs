//! The hierarchical cache in the simulators (`kvserve cache-sim` and `kvserve sim`, with
//! `--enable-hierarchical-cache` and the same `--hicache-*` flags as `serve`): the tree gets a
//! real host tier (`RadixCache::with_host_tier`: host page allocator, write policy, demotion,
//! load-back, prefetch and its stop policy), but no bytes move. [`SimController`] stands in for
//! the cache controller: every copy completes at the next poll, and an L3 store behind it is
//! an unbounded in-memory map (whatever `--hicache-storage-backend` names; the backend only
//! picks the simulated storage bandwidth, see [`SimTier::storage_bw`]).
//!
//! Used by `crate::cache_sim` (per-tier hit rates of a replay) and `crate::sim` (the scheduler
//! with a tiered tree, charging the copies in its cost model).

use hicache::storage::{StorageConfig, StorageKind};
use kv_pool::host_pool::{HostLayout, HostPoolSize, HostPoolSizeInput};
use kv_pool::testing::ImmediateController;
use kv_pool::tier::{Ack, CacheController, OpId, PageKey};
use kv_pool::Slot;
use radix_cache::tiers::{PrefetchPolicy, WritePolicy};
use radix_cache::RadixCache;
use scheduler::CostModel;

use crate::error::{EngineError, Result};
use crate::setup::HiCacheSetup;

/// A bookkeeping [`CacheController`] for simulations: `kv_pool::testing::ImmediateController`
/// (every operation acknowledged at the next poll, in queue order; an in-memory L3 map when
/// storage is on), whose operation log is dropped at each poll so a long replay's memory stays
/// flat.
#[derive(Debug)]
pub struct SimController(ImmediateController);

impl SimController {
    /// A controller with an (unbounded, in-memory) L3 store when `storage` is set.
    pub fn new(storage: bool) -> Self {
        let c = ImmediateController::new();
        SimController(if storage { c.with_storage() } else { c })
    }
}

impl CacheController for SimController {
    fn write(&mut self, device: &[Slot], host: &[Slot]) -> OpId {
        self.0.write(device, host)
    }

    fn load(&mut self, host: &[Slot], device: &[Slot]) -> OpId {
        self.0.load(host, device)
    }

    fn wait(&mut self, op: OpId) {
        self.0.wait(op)
    }

    fn poll_acks(&mut self) -> Vec<Ack> {
        self.0.log.clear();
        self.0.poll_acks()
    }

    fn storage_enabled(&self) -> bool {
        self.0.storage_enabled()
    }

    fn backup(&mut self, host: &[Slot], keys: &[PageKey]) -> OpId {
        self.0.backup(host, keys)
    }

    fn query(&mut self, keys: &[PageKey]) -> OpId {
        self.0.query(keys)
    }

    fn prefetch(&mut self, keys: &[PageKey], host: &[Slot]) -> OpId {
        self.0.prefetch(keys, host)
    }

    fn prefetch_progress(&self, op: OpId) -> usize {
        self.0.prefetch_progress(op)
    }

    fn cancel_prefetch(&mut self, op: OpId) {
        self.0.cancel_prefetch(op)
    }
}

/// A simulated host tier (and L3 store) from the `--hicache-*` flags.
#[derive(Debug, Clone, PartialEq)]
pub struct SimTier {
    /// The validated flags.
    pub setup: HiCacheSetup,
}

impl SimTier {
    /// The flags' tier.
    pub fn new(setup: HiCacheSetup) -> Self {
        SimTier { setup }
    }

    /// A tier of `ratio` × the device pool with `write_policy`, an L3 store of `storage`'s
    /// kind if given, and the flags' defaults for the rest (`best_effort` prefetch, SGLang's
    /// prefetch thresholds): what the library's users and tests need without flags.
    pub fn with_policy(
        write_policy: WritePolicy,
        ratio: f64,
        storage: Option<StorageKind>,
    ) -> Self {
        SimTier::new(HiCacheSetup {
            write_policy,
            mem_layout: HostLayout::default(),
            ratio,
            size_gb: 0.0,
            storage,
            storage_config: StorageConfig::default(),
            prefetch_policy: PrefetchPolicy::BestEffort,
        })
    }

    /// Whether an L3 store sits behind the host tier.
    pub fn has_storage(&self) -> bool {
        self.setup.storage.is_some()
    }

    /// Host slots for a device pool of `device_slots` at page size `page_size`, as SGLang sizes
    /// the host pool (`--hicache-size` GB over `bytes_per_token`, else `--hicache-ratio` ×
    /// the device pool; whole pages). No host memory is taken, so none is checked.
    /// `bytes_per_token: None` (no model, as in `cache-sim`) refuses `--hicache-size`.
    pub fn host_slots(
        &self,
        device_slots: usize,
        page_size: u32,
        bytes_per_token: Option<usize>,
    ) -> Result<usize> {
        if self.setup.size_gb > 0.0 && bytes_per_token.is_none() {
            return Err(EngineError::arg(
                "--hicache-size",
                "cache-sim has no model to turn GB into tokens: size the host tier with \
                 --hicache-ratio",
            ));
        }
        let size = HostPoolSize::compute(HostPoolSizeInput {
            device_slots,
            page_size,
            bytes_per_token: bytes_per_token.unwrap_or(1),
            hicache_ratio: self.setup.ratio,
            hicache_size_gb: self.setup.size_gb,
            mem_available_bytes: u64::MAX,
            reserve_bytes: 0,
        })
        .map_err(|e| EngineError::arg("--hicache-ratio", e.to_string()))?;
        Ok(size.slots)
    }

    /// `tree` with this host tier of `host_slots` slots and a [`SimController`].
    pub fn attach(&self, tree: RadixCache, host_slots: usize) -> Result<RadixCache> {
        let controller = SimController::new(self.has_storage());
        tree.with_host_tier(self.setup.tree_config(host_slots), Box::new(controller))
            .map_err(|e| EngineError::arg("--enable-hierarchical-cache", e.to_string()))
    }

    /// The simulated L3 → host bandwidth in bytes/s: `explicit` (the `--storage-bandwidth`
    /// flag, GB/s) if given, else by backend — a local `file` store
    /// [`CostModel::FILE_STORAGE_BW`], a networked `redis` [`CostModel::REMOTE_STORAGE_BW`].
    pub fn storage_bw(&self, explicit_gb_s: Option<f64>) -> Result<f64> {
        match explicit_gb_s {
            Some(gb) if gb.is_finite() && gb > 0.0 => Ok(gb * 1e9),
            Some(gb) => Err(EngineError::arg(
                "--storage-bandwidth",
                format!("{gb} is not a positive number of GB/s"),
            )),
            None => Ok(match self.setup.storage {
                Some(StorageKind::File) | None => CostModel::FILE_STORAGE_BW,
                Some(StorageKind::Redis) => CostModel::REMOTE_STORAGE_BW,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::HiCacheArgs;

    fn tier(extra: &[&str]) -> Result<SimTier> {
        use clap::Parser;
        #[derive(Parser)]
        struct A {
            #[command(flatten)]
            h: HiCacheArgs,
        }
        let mut args = vec!["x", "--enable-hierarchical-cache"];
        args.extend(extra);
        let a = A::try_parse_from(args).expect("flags parse");
        Ok(SimTier::new(a.h.setup()?.expect("enabled")))
    }

    #[test]
    fn host_slots_follow_sglangs_sizing_and_bandwidth_follows_the_backend() {
        let t = tier(&["--hicache-ratio", "1.5"]).unwrap();
        // SGLang's rounding: `(size // P + 1) × P`.
        assert_eq!(t.host_slots(1000, 16, None).unwrap(), 1504);
        assert!(!t.has_storage());
        let t = tier(&["--hicache-size", "1"]).unwrap();
        assert!(t.host_slots(1000, 16, None).is_err(), "no model: no GB");
        assert_eq!(t.host_slots(1000, 16, Some(131072)).unwrap(), 7632);
        let t = tier(&["--hicache-storage-backend", "file"]).unwrap();
        assert!(t.has_storage());
        assert_eq!(t.storage_bw(None).unwrap(), CostModel::FILE_STORAGE_BW);
        assert_eq!(t.storage_bw(Some(3.0)).unwrap(), 3e9);
        assert!(t.storage_bw(Some(0.0)).is_err());
    }
}
