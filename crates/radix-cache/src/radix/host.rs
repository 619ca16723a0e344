//! The host tier's state, owned by a [`super::RadixCache`] that has one (SGLang's
//! `HiRadixCache` fields): the configuration, the cache controller that moves bytes, the host
//! page allocator, the host-evictable index, the operations awaiting their acknowledgement and
//! the L3 prefetches in flight. Data only: the behaviour lives in `tier`, `demote`,
//! `load_back` and `prefetch`. Uses nothing else in `radix/`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use kv_pool::tier::{CacheController, OpId, PageKey};
use kv_pool::{PagedAllocator, Slot};
use rustc_hash::FxHashMap;

use crate::policy::EvictionKey;
use crate::tiers::{HiCacheConfig, TierStats};
use crate::NodeId;

/// What the cache does when an operation is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PendingOp {
    /// A device → host copy of `node`'s pages (`len` tokens: if the node was split since,
    /// the copy covers it and the upper halves above it). The node's `host_ref` is pinned
    /// until the ack (then handed to the L3 backup, if storage is on); `unlock`: the node's
    /// path is locked until the ack (write-through; a write-back eviction waited for its copy
    /// instead).
    Write {
        node: NodeId,
        len: usize,
        unlock: bool,
    },
    /// A host → device load-back of the `len` tokens ending at `node`, whose path is locked
    /// until the ack. A failed copy is queued again (the host copy is intact; the device rows
    /// are not, and a pass reading them waits for the retry's layers).
    Load { node: NodeId, len: usize },
    /// A host → L3 backup of `node`'s pages; its `host_ref` is pinned until the ack.
    Backup { node: NodeId },
    /// The L3 existence query of request `rid`'s prefetch.
    Query { rid: u64 },
    /// The L3 → host copy of request `rid`'s prefetch.
    Prefetch { rid: u64 },
}

/// Where a prefetch stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PrefetchStage {
    /// The existence query is in flight.
    Querying(OpId),
    /// The copy of the hit pages into `host` is in flight (`landed`: `None`) or acknowledged
    /// (`Some(pages)`: the leading pages that landed).
    Fetching {
        op: OpId,
        host: Vec<Slot>,
        landed: Option<usize>,
    },
}

/// One request's L3 prefetch (SGLang's `ongoing_prefetch` entry).
#[derive(Debug, Clone)]
pub(super) struct Prefetch {
    /// The deepest node of the device + host match when it started, locked until it ends;
    /// fetched pages are inserted below it.
    pub(super) anchor: NodeId,
    /// The page-aligned tokens after the anchor's last token that were asked for.
    pub(super) tokens: Vec<u32>,
    /// One storage key per page of `tokens`.
    pub(super) keys: Vec<PageKey>,
    /// Host tokens this prefetch counts against `prefetch_max_host_share`.
    pub(super) reserved: usize,
    /// The `now_s` of the first progress check (the timeout runs from there).
    pub(super) first_check_s: Option<f64>,
    pub(super) stage: PrefetchStage,
    /// Aborted while its copy was in flight: everything is freed at the ack.
    pub(super) released: bool,
}

/// The host tier of a [`super::RadixCache`].
pub(super) struct HostTier {
    pub(super) cfg: HiCacheConfig,
    pub(super) controller: Box<dyn CacheController>,
    /// Whether the controller has an L3 store (asked once).
    pub(super) storage: bool,
    /// The host pool's page allocator (`cfg.host_slots` slots, page 0 reserved).
    pub(super) host: PagedAllocator,
    /// Host-evictable nodes (host-only, childless, unlocked, `host_ref == 0`) ordered by
    /// (policy key, node index), as the device index.
    pub(super) index: BTreeSet<(EvictionKey, u32)>,
    /// The key each host-indexed node sits under in `index` (kept here, not in the node, so
    /// a tree without a host tier carries no host fields it never uses).
    pub(super) keys: FxHashMap<u32, EvictionKey>,
    /// Operations awaiting their ack.
    pub(super) ops: FxHashMap<OpId, PendingOp>,
    /// Host slots of nodes dropped while a write or backup of them was in flight, freed at
    /// that operation's ack.
    pub(super) orphans: FxHashMap<OpId, Vec<Slot>>,
    /// Failed attempts of the copy of each node whose write-through or load-back is being
    /// retried (cleared when a copy of it lands); past `MAX_COPY_ATTEMPTS` the cache gives up
    /// with an error instead of retrying for ever.
    pub(super) copy_attempts: FxHashMap<NodeId, u32>,
    /// Prefetches by request id (ordered, so iteration is deterministic).
    pub(super) prefetches: BTreeMap<u64, Prefetch>,
    /// Host tokens reserved by prefetches that have not ended.
    pub(super) prefetch_reserved: usize,
    /// Counters (the occupancy fields are filled in by `tier_stats`).
    pub(super) stats: TierStats,
}

impl fmt::Debug for HostTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostTier")
            .field("cfg", &self.cfg)
            .field("storage", &self.storage)
            .field("host", &self.host)
            .field("host_index", &self.index.len())
            .field("ops_in_flight", &self.ops.len())
            .field("prefetches", &self.prefetches.len())
            .finish_non_exhaustive()
    }
}

impl HostTier {
    pub(super) fn new(
        cfg: HiCacheConfig,
        controller: Box<dyn CacheController>,
        host: PagedAllocator,
    ) -> Self {
        let storage = controller.storage_enabled();
        HostTier {
            cfg,
            controller,
            storage,
            host,
            index: BTreeSet::new(),
            keys: FxHashMap::default(),
            ops: FxHashMap::default(),
            orphans: FxHashMap::default(),
            copy_attempts: FxHashMap::default(),
            prefetches: BTreeMap::new(),
            prefetch_reserved: 0,
            stats: TierStats::default(),
        }
    }
}
