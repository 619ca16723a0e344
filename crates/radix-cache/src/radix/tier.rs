//! The host tier's building blocks (SGLang's `HiRadixCache`): adding the tier, host page
//! allocation with host eviction (SGLang's `evict_host`), backing nodes up to host memory
//! (`write_backup`), storage page keys, and the tier's statistics. Builds on `arena`, `index`,
//! `lock` and `host`; the policies that use these blocks live in `demote`, `load_back`,
//! `prefetch` and `acks`.

use kv_pool::tier::{CacheController, OpId, PageKey};
use kv_pool::{Allocator, PagedAllocator, Slot};

use crate::error::{RadixCacheError, Result};
use crate::events::chain_digests;
use crate::policy::EvictionPolicy;
use crate::radix::arena::{Children, RadixCache, NONE};
use crate::radix::host::{HostTier, PendingOp};
use crate::radix::lock::LockDelta;
use crate::tiers::{HiCacheConfig, TierStats};

impl<P: EvictionPolicy> RadixCache<P> {
    /// Gives an empty cache a host tier of `cfg.host_slots` host slots (a positive multiple of
    /// the page size) whose bytes `controller` moves: the tree becomes SGLang's
    /// `HiRadixCache`. Partial eviction is turned off (nodes move between tiers whole).
    ///
    /// Refused (typed error) on a cache that holds nodes or already has a tier, or with a host
    /// size that is not a positive multiple of the page size.
    ///
    /// ```
    /// use kv_pool::testing::ImmediateController;
    /// use radix_cache::tiers::HiCacheConfig;
    /// use radix_cache::{BuiltinPolicy, PrefixCache, RadixCache};
    ///
    /// let cfg = HiCacheConfig { host_slots: 64, ..HiCacheConfig::default() };
    /// let cache = RadixCache::new(4, BuiltinPolicy::Lru)
    ///     .with_host_tier(cfg, Box::new(ImmediateController::new()))
    ///     .unwrap();
    /// assert_eq!(cache.tier_stats().unwrap().host_slots_total, 64);
    /// ```
    pub fn with_host_tier(
        mut self,
        cfg: HiCacheConfig,
        controller: Box<dyn CacheController>,
    ) -> Result<Self> {
        if self.tier.is_some() || self.node_count() > 0 {
            return Err(RadixCacheError::Tier(
                "a host tier is added to an empty cache that has none".into(),
            ));
        }
        let p = self.page_size as usize;
        if cfg.host_slots == 0 || cfg.host_slots % p != 0 {
            return Err(RadixCacheError::Tier(format!(
                "host_slots {} is not a positive multiple of the page size {p}",
                cfg.host_slots
            )));
        }
        let host = PagedAllocator::new(cfg.host_slots, self.page_size)?;
        self.partial_eviction = false;
        self.host_slots = vec![Slot::PADDING; self.tokens.len()];
        self.tier = Some(Box::new(HostTier::new(cfg, controller, host)));
        Ok(self)
    }

    /// Whether the cache has a host tier.
    pub fn has_host_tier(&self) -> bool {
        self.tier.is_some()
    }

    /// The host tier's configuration, if it has one.
    pub fn hicache_config(&self) -> Option<&HiCacheConfig> {
        self.tier.as_ref().map(|t| &t.cfg)
    }

    /// The tier, for code that only runs with one.
    pub(super) fn tier_mut(&mut self) -> &mut HostTier {
        self.tier.as_mut().expect("a host tier")
    }

    /// `n` host slots (whole pages), evicting host leaves if too few are free; `None` if there
    /// is still no room (or no tier).
    pub(super) fn alloc_host(&mut self, n: usize) -> Result<Option<Vec<Slot>>> {
        let Some(tier) = self.tier.as_ref() else {
            return Ok(None);
        };
        let avail = tier.host.available_size();
        if avail < n {
            self.evict_host(n - avail)?;
        }
        let tier = self.tier_mut();
        let mut out = Vec::with_capacity(n);
        Ok(tier.host.alloc(n, &mut out).ok().map(|()| out))
    }

    /// Frees at least `num_tokens` host tokens (whole nodes) from the host-evictable nodes
    /// (host-only, childless, unlocked, not pinned by a copy) in the eviction policy's order,
    /// deleting them (SGLang's `evict_host`); returns the tokens freed (fewer if not enough is
    /// host-evictable; 0 without a host tier).
    pub fn evict_host(&mut self, num_tokens: usize) -> Result<usize> {
        let p = self.page_size as usize;
        let mut freed = 0;
        while freed < num_tokens {
            let Some(&(_, i)) = self.tier.as_ref().and_then(|t| t.index.first()) else {
                break;
            };
            self.tick();
            let len = self.delete_host_only(i)?;
            self.tier_mut().stats.pages_host_evicted += (len / p) as u64;
            freed += len;
        }
        self.maybe_compact();
        Ok(freed)
    }

    /// Deletes host-only node `i` (childless): frees its host slots (or, while a copy pins
    /// them, hands them to that copy's ack), unlinks it; returns its length.
    pub(super) fn delete_host_only(&mut self, i: u32) -> Result<usize> {
        debug_assert!(!self.nodes[i as usize].on_device);
        debug_assert!(self.nodes[i as usize].children.is_empty());
        self.release_host_slots(i)?;
        let len = self.nodes[i as usize].len;
        self.unlink(i);
        Ok(len)
    }

    /// Frees node `i`'s host slots if it is backed up (to the ack of the copy pinning them, if
    /// one does) and marks it not backed up.
    pub(super) fn release_host_slots(&mut self, i: u32) -> Result<()> {
        if !self.nodes[i as usize].backed_up {
            return Ok(());
        }
        let id = self.id(i);
        let host = self.node_host_slots(i).to_vec();
        let pinned = self.nodes[i as usize].host_ref > 0;
        let tier = self.tier_mut();
        if pinned {
            let op = tier.ops.iter().find_map(|(&op, pending)| match *pending {
                PendingOp::Write { node, .. } | PendingOp::Backup { node } if node == id => {
                    Some(op)
                }
                _ => None,
            });
            match op {
                Some(op) => {
                    tier.orphans.entry(op).or_default().extend(host);
                }
                None => tier.host.free(&host)?,
            }
        } else {
            tier.host.free(&host)?;
        }
        let n = &mut self.nodes[i as usize];
        n.backed_up = false;
        n.host_ref = 0;
        Ok(())
    }

    /// Removes node `i` (childless, out of both indexes' concerns) from the tree: unlinks it
    /// from its parent, retires its arena range and entry, refreshes the parent.
    pub(super) fn unlink(&mut self, i: u32) {
        let tier = self.tier_mut();
        if let Some(key) = tier.keys.remove(&i) {
            tier.index.remove(&(key, i));
        }
        if let Some(key) = self.nodes[i as usize].indexed.take() {
            self.index.remove(key, i);
        }
        let parent = self.nodes[i as usize].parent;
        self.remove_child(parent, i);
        let node = &mut self.nodes[i as usize];
        self.dead_tokens += node.len;
        node.live = false;
        node.children = Children::default();
        node.digests = Vec::new();
        self.free_nodes.push(i);
        self.refresh(parent);
    }

    /// Backs node `i` (on device, not backed up) up to host memory (SGLang's `write_backup`):
    /// allocates host slots (host eviction allowed), queues the device → host copy, records
    /// the host slots at once and pins them until the ack; with `lock`, the node's path is
    /// locked until the ack too (write-through: its device slots must not be freed before the
    /// copy). Returns the copy's op, or `None` when there was no host room.
    pub(super) fn backup_node(&mut self, i: u32, lock: bool) -> Result<Option<OpId>> {
        debug_assert!(self.nodes[i as usize].on_device && !self.nodes[i as usize].backed_up);
        let len = self.nodes[i as usize].len;
        let Some(host) = self.alloc_host(len)? else {
            return Ok(None);
        };
        let start = self.nodes[i as usize].start;
        self.host_slots[start..start + len].copy_from_slice(&host);
        let device = self.node_slots(i).to_vec();
        let node = self.id(i);
        let tier = self.tier_mut();
        let op = tier.controller.write(&device, &host);
        tier.ops.insert(
            op,
            PendingOp::Write {
                node,
                len,
                unlock: lock,
            },
        );
        tier.stats.writes_queued += 1;
        let n = &mut self.nodes[i as usize];
        n.backed_up = true;
        n.host_ref += 1;
        if lock {
            self.lock_path(i, LockDelta::Inc);
        }
        Ok(Some(op))
    }

    /// Backs up every not-backed-up node of the path root → `i`, top-down, so backed-up nodes
    /// stay a root-anchored prefix; stops at the first node without host room. Returns the
    /// tokens queued.
    pub(super) fn backup_path(&mut self, i: u32) -> Result<usize> {
        self.backup_path_with(i, true).map(|(queued, _)| queued)
    }

    /// [`backup_path`](Self::backup_path), locking each node until its write ack (`lock`) or
    /// not (the caller waits for the returned ops before anything may demote the nodes).
    pub(super) fn backup_path_with(&mut self, i: u32, lock: bool) -> Result<(usize, Vec<OpId>)> {
        let mut chain = Vec::new();
        let mut j = i;
        while self.nodes[j as usize].parent != NONE {
            if !self.nodes[j as usize].backed_up {
                chain.push(j);
            }
            j = self.nodes[j as usize].parent;
        }
        let mut queued = 0;
        let mut ops = Vec::new();
        for &j in chain.iter().rev() {
            let Some(op) = self.backup_node(j, lock)? else {
                break;
            };
            ops.push(op);
            queued += self.nodes[j as usize].len;
        }
        Ok((queued, ops))
    }

    /// After an insert ending at `last`: write-through backs up the deepest node of the path
    /// whose hit count reached the policy's threshold (and everything above it not yet backed
    /// up). Chunked inserts count no hit and back up nothing.
    pub(super) fn write_through_after_insert(&mut self, last: u32, chunked: bool) -> Result<()> {
        let Some(threshold) = self
            .tier
            .as_ref()
            .and_then(|t| t.cfg.write_policy.threshold())
        else {
            return Ok(());
        };
        if chunked {
            return Ok(());
        }
        let mut i = last;
        while self.nodes[i as usize].parent != NONE {
            let n = &self.nodes[i as usize];
            if !n.backed_up && n.on_device && n.hit_count >= threshold {
                self.backup_path(i)?;
                return Ok(());
            }
            i = n.parent;
        }
        Ok(())
    }

    /// The key-chain seed of node `i`'s namespace (kept on its root).
    fn seed_of(&self, mut i: u32) -> Option<PageKey> {
        while self.nodes[i as usize].parent != NONE {
            i = self.nodes[i as usize].parent;
        }
        self.nodes[i as usize].digests.first().copied()
    }

    /// The storage keys of node `i`'s pages (the key chain through the whole path).
    pub(super) fn node_page_keys(&self, i: u32) -> Vec<PageKey> {
        let p = self.page_size as usize;
        // Kept on the node (events on, or storage on): the same chain, already computed.
        let n = &self.nodes[i as usize];
        if n.digests.len() * p == n.len {
            return n.digests.clone();
        }
        let mut path = Vec::new();
        let mut j = i;
        while self.nodes[j as usize].parent != NONE {
            path.push(j);
            j = self.nodes[j as usize].parent;
        }
        let mut tokens =
            Vec::with_capacity(self.nodes[i as usize].depth + self.nodes[i as usize].len);
        for &j in path.iter().rev() {
            tokens.extend_from_slice(self.node_tokens(j));
        }
        let keys = chain_digests(self.seed_of(i).as_ref(), &tokens, p);
        keys[keys.len() - self.nodes[i as usize].len / p..].to_vec()
    }

    /// The tier's counters and host occupancy (`None` without a host tier).
    pub(super) fn tier_stats_impl(&self) -> Option<TierStats> {
        let tier = self.tier.as_ref()?;
        let mut s = tier.stats;
        s.host_slots_total = tier.cfg.host_slots;
        s.host_slots_used = tier.cfg.host_slots - tier.host.available_size();
        s.host_slots_evictable = tier
            .index
            .iter()
            .map(|&(_, i)| self.nodes[i as usize].len)
            .sum();
        s.host_slots_protected = s.host_slots_used - s.host_slots_evictable;
        s.ops_in_flight = tier.ops.len() + tier.prefetches.len();
        Some(s)
    }
}
