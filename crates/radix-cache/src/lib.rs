//! # radix-cache — prefix caches for LLM serving
//!
//! SGLang's RadixAttention cache, rebuilt to be faster, checked, and open to new eviction
//! policies without a fork:
//!
//! - [`PrefixCache`]: SGLang's operations (`match_prefix`, `insert`, `cache_unfinished_req`,
//!   `cache_finished_req`, `evict`, `inc_lock_ref` / `dec_lock_ref`, sizes, `reset`,
//!   `take_events`), implemented by [`RadixCache`] and [`ChunkCache`].
//! - [`RadixCache`]: a radix tree over token ids at page size 1 or `P`, generic over its
//!   eviction policy (called statically): keys floored to whole pages, children found by their
//!   first page, nodes split on partial matches, lock counts
//!   exactly as SGLang. Nodes live in an arena; token keys and slot values live in two parallel
//!   arenas, so a split copies nothing (they reserve address space for 1 Mi tokens on their
//!   first growth, so growing to that size never copies either). Beyond SGLang: evictable leaves are kept ordered by the
//!   policy's key and updated incrementally (`evict` is O(log n) per freed node, O(1) under
//!   LRU and FIFO, whose leaves arrive in key order and sit in a list); a leaf can be
//!   evicted partially (only the tail pages needed); time is a logical clock (one tick per
//!   operation), so runs and snapshots are reproducible; the scheduler ranks its waiting queue
//!   with [`PrefixCache::touch_prefix`], which refreshes access times as SGLang's
//!   `match_prefix` does but splits no node.
//! - A host tier (SGLang's `HiRadixCache`, HiCache): [`RadixCache::with_host_tier`] gives the
//!   same tree a host pool whose bytes a [`kv_pool::tier::CacheController`] moves. Nodes are on
//!   device, backed up to host, or host-only; [`tiers::WritePolicy`] decides when device pages
//!   are copied to host; eviction demotes backed-up nodes instead of deleting them;
//!   [`PrefixCache::init_load_back`] brings a matched host-only chain back; with an L3 store,
//!   written pages are backed up to it and [`PrefixCache::prefetch_from_storage`] fetches a
//!   request's pages ahead of admission. Without a tier none of it runs (one branch on an
//!   `Option`).
//! - [`policy`]: SGLang's seven eviction orderings, a cost-aware policy, a lineage-hold policy
//!   (issue #17's research), Belady's oracle, and the [`policy::EvictionPolicy`] trait for your
//!   own; a capability a policy needs from the tree (path hashes) is asked of the trait.
//! - [`events`]: `BlockStored` / `BlockRemoved` / `AllBlocksCleared` with SGLang's chained
//!   SHA-256 page hashes.
//! - `testing` (feature `testing`): the suites that check a prefix cache or an eviction policy
//!   of your own with one call (`check_prefix_cache`, `check_eviction_policy`); this crate's
//!   tests run them on its own caches and policies.
//!
//! ## Invariants
//! - The tree stores slot indices, never KV bytes, and frees slots only through
//!   [`kv_pool::Allocator`].
//! - Every node but a root holds a positive multiple of `P` tokens; keys of different namespaces
//!   (`extra_key`) never share nodes.
//! - `evictable_size + protected_size` = tokens held; a node's tokens count as protected iff its
//!   lock count is positive; lock counts never go negative; a locked node is never evicted.
//! - The evictable-leaf index holds exactly the unlocked childless non-root nodes (with a host
//!   tier: unlocked on-device nodes with no child on device; host-only nodes hold no device
//!   tokens and count in neither size).
//! - With a host tier: on-device nodes form a root-anchored subtree; a host-only node is backed
//!   up; under write-through, backed-up nodes form a root-anchored prefix; every host page is
//!   free, a backed-up node's, an in-flight prefetch's, or a dropped node's awaiting a copy's
//!   ack, exactly once ([`PrefixCache::check_invariants`] proves it with a second ownership
//!   check over the host allocator).
//! - [`PrefixCache::claim_ownership`] hands every tree slot to the kv-pool ownership checker,
//!   so tests prove that free pages, tree pages and request-private pages partition the pool.
//!
//! ## Where it sits
//! Above kv-pool (allocators, request table, ownership checker, the tier seam
//! `kv_pool::tier`); below the scheduler, which calls it through [`PrefixCache`] with a
//! [`ReqView`] of its requests (and, with a host tier, `check_hicache_events` once per step).
//! The engine builds the controller that moves the bytes (the `hicache` crate).

// The embeddable crates document every public item; the engine, model and backends document
// where a name does not already say it.
#![warn(missing_docs)]

pub mod any;
pub mod chunk;
pub mod error;
pub mod events;
pub mod policy;
pub mod radix;
pub mod request;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tiers;

pub use any::AnyPrefixCache;
pub use chunk::ChunkCache;
pub use error::{RadixCacheError, Result};
pub use events::KvEvent;
pub use policy::{AnyEvictionPolicy, BuiltinPolicy, EvictionKey, EvictionPolicy, NodeStats};
pub use radix::RadixCache;
pub use request::{PrefixState, ReqView};
pub use tiers::{HiCacheConfig, LoadBack, PrefetchPolicy, TierStats, WritePolicy};

use std::fmt;

use kv_pool::{Allocator, OwnershipCheck, ReqToTokenPool, Slot};

/// A tree node handle (where SGLang holds a `TreeNode` reference): an arena index plus a
/// generation, so a handle to an evicted node is detected rather than aliased to a reused one.
#[doc(alias = "TreeNode")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    /// Index of the node's entry in the cache's node arena (entries are reused).
    pub index: u32,
    /// How many times the entry had been reused when the handle was made; a handle whose
    /// generation differs from the entry's is stale.
    pub generation: u32,
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.index)
    }
}

/// What a match found (SGLang's `MatchResult`: the device slots go to the caller's buffer
/// instead of a returned tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatchResult {
    /// Tokens matched on device (a multiple of the page size); that many slots were appended
    /// to `out`.
    pub len: usize,
    /// The deepest matched node on device (the namespace's root if nothing matched).
    pub last_node: NodeId,
    /// Tokens of host-only nodes at the end of the matched path, right after `len` (SGLang's
    /// `host_hit_length`); 0 without a host tier. [`PrefixCache::init_load_back`] brings them
    /// back to device.
    pub host_hit_len: usize,
    /// The deepest matched node, host-only or not (SGLang's `last_host_node`); `last_node`
    /// when `host_hit_len` is 0.
    pub last_host_node: NodeId,
}

/// What a match that splits nothing found ([`PrefixCache::peek_prefix`],
/// [`PrefixCache::touch_prefix`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixPeek {
    /// Tokens matched (a multiple of the page size).
    pub len: usize,
    /// The deepest node the match reaches, a node matched part-way included (it is not
    /// split); `None` when nothing matched.
    pub deepest: Option<NodeId>,
}

/// What an insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InsertResult {
    /// Tokens of the (page-floored) key that were already cached on device: the caller's slots
    /// for them are duplicates the caller still owns (and frees, beyond what it had protected).
    /// Host-only nodes the key covers are revived with the caller's slots instead (counted in
    /// `inserted`).
    pub prefix_len: usize,
    /// Tokens the cache took ownership of, right after `prefix_len`. The caller owns every slot
    /// it passed beyond `prefix_len + inserted` (the unaligned tail, or everything for a cache
    /// that stores nothing).
    pub inserted: usize,
    /// The node holding the key's last token (the namespace's root for an empty key).
    pub last_node: NodeId,
}

/// How an insert weighs the path it touches (for the eviction policy's statistics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InsertOptions {
    /// Request priority, max-propagated along the path.
    pub priority: i64,
    /// A chunked-prefill insert: does not bump hit counts (avoids self-inflation).
    pub chunked: bool,
}

/// SGLang's prefix-cache interface (`BasePrefixCache`). `Send`, so an engine can own its
/// cache on a scheduler thread.
///
/// [`AnyPrefixCache`] is the closed set of this crate's implementations, dispatched statically.
/// `testing::check_prefix_cache` (feature `testing`) checks an implementation of your own.
#[doc(alias = "BasePrefixCache")]
#[enum_dispatch::enum_dispatch]
pub trait PrefixCache: Send {
    /// Page size `P` in tokens: the cache stores whole pages only.
    fn page_size(&self) -> u32;
    /// Whether the cache shares KV between requests (a radix tree does; SGLang's `ChunkCache`,
    /// its cache with `--disable-radix-cache`, does not). Cache-aware schedule policies fall
    /// back to FCFS when it does not.
    fn reuses_prefixes(&self) -> bool;
    /// The root of a namespace (`None`: the default one); created on demand.
    fn root(&mut self, extra_key: Option<&str>) -> NodeId;

    /// Appends the slots of the longest cached page-aligned prefix of `key` to `out`. Splits a
    /// node matched part-way and updates access times, as SGLang.
    fn match_prefix(
        &mut self,
        key: &[u32],
        extra_key: Option<&str>,
        out: &mut Vec<Slot>,
    ) -> MatchResult;
    /// The length of that prefix, without changing anything (for ranking, e.g. LPM).
    fn peek_prefix_len(&self, key: &[u32], extra_key: Option<&str>) -> usize {
        self.peek_prefix(key, extra_key).len
    }
    /// The length of that prefix and the deepest node it reaches, without changing anything.
    fn peek_prefix(&self, key: &[u32], extra_key: Option<&str>) -> PrefixPeek;
    /// [`peek_prefix`](Self::peek_prefix), and the matched nodes' access times refreshed as
    /// [`match_prefix`](Self::match_prefix) refreshes them, but without splitting a node matched
    /// part-way (it is refreshed whole). For ranking a waiting queue: SGLang's cache-aware
    /// policies match every waiting request, so the prefixes they will use stay recent under
    /// LRU. The default refreshes nothing (right for a cache without access times).
    fn touch_prefix(&mut self, key: &[u32], extra_key: Option<&str>) -> PrefixPeek {
        self.peek_prefix(key, extra_key)
    }
    /// The parent of a node (`None` for a root or an unknown node), for policies that weigh
    /// subtrees (DFS-weight).
    fn parent(&self, _node: NodeId) -> Option<NodeId> {
        None
    }
    /// Inserts `key` (floored to whole pages) with its `slots` (one per key token).
    fn insert(
        &mut self,
        key: &[u32],
        extra_key: Option<&str>,
        slots: &[Slot],
        opts: InsertOptions,
    ) -> Result<InsertResult>;

    /// Caches a request's computed prefix mid-flight (after a prefill chunk, or after prefill
    /// for a request that goes on decoding): inserts the page-aligned committed prefix, frees
    /// the request's duplicate slots, re-points its row at the tree's slots, and moves its lock
    /// to the new last node (as SGLang's `RadixCache.cache_unfinished_req`).
    fn cache_unfinished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &mut ReqToTokenPool,
        alloc: &mut dyn Allocator,
        chunked: bool,
    ) -> Result<()>;
    /// Caches (if `insert`) a finished request's committed tokens, frees its duplicates and its
    /// unaligned tail, and drops its lock. The caller then frees over-allocation and the row.
    fn cache_finished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &ReqToTokenPool,
        alloc: &mut dyn Allocator,
        insert: bool,
    ) -> Result<()>;

    /// Frees at least `num_tokens` tokens of unlocked cached KV if possible; returns how many
    /// were freed (possibly fewer, if not enough is evictable).
    fn evict(&mut self, num_tokens: usize, alloc: &mut dyn Allocator) -> Result<usize>;
    /// Locks the path from `node` to its root; returns the tokens that became protected.
    fn inc_lock_ref(&mut self, node: NodeId) -> Result<usize>;
    /// Unlocks the path from `node` to its root; returns the tokens that became evictable.
    fn dec_lock_ref(&mut self, node: NodeId) -> Result<usize>;
    /// Tokens held by unlocked nodes.
    fn evictable_size(&self) -> usize;
    /// Tokens held by locked nodes.
    fn protected_size(&self) -> usize;
    /// Tokens held.
    fn total_size(&self) -> usize {
        self.evictable_size() + self.protected_size()
    }
    /// Frees every cached slot and empties the cache; refused while anything is locked.
    fn reset(&mut self, alloc: &mut dyn Allocator) -> Result<()>;
    /// The KV events since the last call (empty unless events are enabled).
    fn take_events(&mut self) -> Vec<KvEvent>;
    /// Claims every slot the cache holds, node by node, in an ownership check.
    fn claim_ownership(&self, check: &mut OwnershipCheck);
    /// Checks the cache's internal invariants; returns a description of the first violation.
    /// Default: nothing to check. The `testing` suites call it after every step.
    fn check_invariants(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    // ---- The host tier (HiCache). Every default is right for a cache without one. ----

    /// Processes the cache controller's acknowledgements (SGLang's `writing_check`,
    /// `loading_check` and the storage ack checks); the scheduler calls it once per step,
    /// before scheduling. Written nodes are unlocked (and handed to the L3 backup), loaded
    /// chains unlocked, backed-up pages unpinned, prefetches advanced. Default: nothing.
    fn check_hicache_events(&mut self) -> Result<()> {
        Ok(())
    }
    /// Loads the host-only chain ending at `last_host_node` (a match's
    /// [`MatchResult::last_host_node`]) back to device (SGLang's `init_load_back`): if it holds
    /// at least `load_back_threshold` tokens and at most `mem_quota` (tokens the caller may
    /// still use, evictable ones included; plus what locking the path takes out of the
    /// evictable ones, as SGLang), allocates device slots
    /// through `alloc` (evicting device nodes if needed), queues the host → device copy,
    /// appends the new slots to `out` (after the match's device slots) and locks the chain
    /// until the load's ack. Nothing is loaded when it is too short, too long or there is no
    /// room. Default: nothing loaded.
    fn init_load_back(
        &mut self,
        last_host_node: NodeId,
        _out: &mut Vec<Slot>,
        _alloc: &mut dyn Allocator,
        _mem_quota: usize,
    ) -> Result<LoadBack> {
        Ok(LoadBack {
            loaded: 0,
            last_node: last_host_node,
        })
    }
    /// Backs up every node of the path root → `node` not yet on host, whatever its hit count,
    /// and waits for the copies (retraction to host: insert the retracted request's committed
    /// pages, then call this, so eviction demotes them at once instead of deleting them; the
    /// nodes are not locked). Returns the tokens copied. Default: 0.
    fn write_back_path(&mut self, _node: NodeId) -> Result<usize> {
        Ok(0)
    }
    /// Keeps `node`'s host pages from host eviction until [`unpin_host`](Self::unpin_host)
    /// (a retracted request's KV, backed up by [`write_back_path`](Self::write_back_path),
    /// stays in host memory until the request resumes; host eviction only takes childless
    /// nodes, so pinning the deepest node keeps the whole path). Returns whether it pinned:
    /// a node not backed up (the host pool was full) is not. Default: false.
    fn pin_host(&mut self, _node: NodeId) -> Result<bool> {
        Ok(false)
    }
    /// Drops a pin [`pin_host`](Self::pin_host) took (a node without one is an error).
    fn unpin_host(&mut self, _node: NodeId) -> Result<()> {
        Ok(())
    }
    /// Starts request `rid`'s L3 prefetch at its arrival (SGLang's `prefetch_from_storage`):
    /// the page-aligned tokens of `key` beyond the device + host match are looked up in
    /// storage, and the leading hits are copied to host memory. Skipped when storage is off,
    /// when fewer than `prefetch_threshold` tokens would be asked for, or when in-flight
    /// prefetches would reserve more than `prefetch_max_host_share` of the host pool.
    /// Default: nothing.
    fn prefetch_from_storage(
        &mut self,
        _rid: u64,
        _key: &[u32],
        _extra_key: Option<&str>,
    ) -> Result<()> {
        Ok(())
    }
    /// Whether request `rid` may stop waiting for its prefetch and be scheduled, at time `now_s`
    /// (seconds, any fixed origin; the timeout runs from the first call). The prefetch policy
    /// decides; when it stops, the landed pages are inserted as host-only nodes (a following
    /// `match_prefix` reports them as a host hit) and the rest freed. A request without a
    /// prefetch proceeds at once. Default: `true`.
    fn check_prefetch_progress(&mut self, _rid: u64, _now_s: f64) -> Result<bool> {
        Ok(true)
    }
    /// Forgets request `rid`'s prefetch (the request was aborted): frees what it holds (after
    /// its copy's ack, if one is in flight). Default: nothing.
    fn release_prefetch(&mut self, _rid: u64) -> Result<()> {
        Ok(())
    }
    /// Operations queued on the cache controller and not yet acknowledged, plus prefetches
    /// not yet stopped ([`TierStats::ops_in_flight`], in O(1)): while any is, nodes stay
    /// locked or pinned. Default: 0.
    fn tier_ops_in_flight(&self) -> usize {
        0
    }
    /// The host tier's counters and occupancy (`None`: no host tier).
    fn tier_stats(&self) -> Option<TierStats> {
        None
    }
}
