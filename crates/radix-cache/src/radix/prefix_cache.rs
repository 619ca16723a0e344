//! [`PrefixCache`] for [`RadixCache`]: SGLang's request-level operations
//! (`cache_unfinished_req`, `cache_finished_req`, see SGLang's `mem_cache/radix_cache.py`)
//! composed from matching, inserting, locking and eviction. The top of `radix/`: it uses every
//! other module and none uses it.

use kv_pool::{floor_to_page, Allocator, Owner, OwnershipCheck, ReqToTokenPool, Slot};

use crate::error::{RadixCacheError, Result};
use crate::events::KvEvent;
use crate::policy::EvictionPolicy;
use crate::radix::arena::{RadixCache, NONE};
use crate::radix::lock::LockDelta;
use crate::radix::match_insert::{Matched, Walk};
use crate::request::ReqView;
use crate::tiers::{LoadBack, TierStats};
use crate::{InsertOptions, InsertResult, MatchResult, NodeId, PrefixCache, PrefixPeek};

impl<P: EvictionPolicy> RadixCache<P> {
    /// Checks a request view against the tree: lengths, and a live, locked last node.
    fn check_view(&self, req: &ReqView<'_>) -> Result<()> {
        req.check_lengths(self.page_size)?;
        let last = self.resolve(req.state.last_node)?;
        if self.nodes[last as usize].parent != NONE && self.nodes[last as usize].lock_ref == 0 {
            return Err(RadixCacheError::LockUnderflow(req.state.last_node));
        }
        Ok(())
    }

    /// Inserts the request's page-aligned committed prefix (`slots`: its row through
    /// `committed_len`) and frees its duplicates of what was cached already: `[protected,
    /// prefix_len)` are the request's to free, `[prefix_len, aligned)` now belong to the tree.
    /// Returns the namespace's root and the node the inserted prefix ends at.
    fn insert_committed(
        &mut self,
        req: &ReqView<'_>,
        slots: &[Slot],
        chunked: bool,
        alloc: &mut dyn Allocator,
    ) -> Result<(u32, u32)> {
        let aligned = floor_to_page(req.committed_len, self.page_size as usize);
        let protected = req.state.cache_protected_len;
        let root = self.root_index(req.extra_key);
        let opts = InsertOptions {
            priority: req.priority,
            chunked,
        };
        let ins = self.insert_impl(root, &req.tokens[..aligned], &slots[..aligned], opts);
        if ins.prefix_len > protected {
            alloc.free(&slots[protected..ins.prefix_len])?;
        }
        let last = self.resolve(ins.last_node)?;
        if self.tier.is_some() {
            self.write_through_after_insert(last, chunked)?;
        }
        Ok((root, last))
    }
}

impl<P: EvictionPolicy> RadixCache<P> {
    /// A walk's on-device part, as `peek_prefix` reports it with a host tier: host-only nodes
    /// are not a prefix the request can use without a load-back.
    fn device_peek(&self, walk: Walk) -> PrefixPeek {
        match walk.partial {
            Some(partial) if self.nodes[partial.child as usize].on_device => PrefixPeek {
                len: walk.len(),
                deepest: Some(self.id(partial.child)),
            },
            _ => {
                let (node, len) = self.device_ancestor(walk.node);
                PrefixPeek {
                    len,
                    deepest: (len > 0).then(|| self.id(node)),
                }
            }
        }
    }
}

impl<P: EvictionPolicy> PrefixCache for RadixCache<P> {
    fn page_size(&self) -> u32 {
        self.page_size
    }

    fn reuses_prefixes(&self) -> bool {
        true
    }

    fn root(&mut self, extra_key: Option<&str>) -> NodeId {
        let r = self.root_index(extra_key);
        self.id(r)
    }

    fn match_prefix(
        &mut self,
        key: &[u32],
        extra_key: Option<&str>,
        out: &mut Vec<Slot>,
    ) -> MatchResult {
        let root = self.root_index(extra_key);
        let m = self.match_impl(root, key, Some(out));
        if let Some(tier) = self.tier.as_mut() {
            tier.stats.device_hit_tokens += m.device_len as u64;
        }
        MatchResult {
            len: m.device_len,
            last_node: self.id(m.device),
            host_hit_len: m.len - m.device_len,
            last_host_node: self.id(m.last),
        }
    }

    fn peek_prefix(&self, key: &[u32], extra_key: Option<&str>) -> PrefixPeek {
        let Some(root) = self.find_root(extra_key) else {
            return PrefixPeek::default();
        };
        let key = &key[..floor_to_page(key.len(), self.page_size as usize)];
        let walk = self.walk(root, key);
        if self.tier.is_some() {
            return self.device_peek(walk);
        }
        // A node matched part-way counts as reached; nothing matched reaches no node.
        let deepest = match walk.partial {
            Some(partial) => Some(partial.child),
            None => (walk.matched > 0).then_some(walk.node),
        };
        PrefixPeek {
            len: walk.len(),
            deepest: deepest.map(|i| self.id(i)),
        }
    }

    fn touch_prefix(&mut self, key: &[u32], extra_key: Option<&str>) -> PrefixPeek {
        let Some(root) = self.find_root(extra_key) else {
            return PrefixPeek::default();
        };
        let key = &key[..floor_to_page(key.len(), self.page_size as usize)];
        self.tick();
        let walk = self.walk(root, key);
        // Refresh the whole path, a node matched part-way included (it is not split).
        let deepest = walk.partial.map_or(walk.node, |partial| partial.child);
        let mut i = deepest;
        while self.nodes[i as usize].parent != NONE {
            self.touch(i, false, None);
            i = self.nodes[i as usize].parent;
        }
        if self.tier.is_some() {
            return self.device_peek(walk);
        }
        PrefixPeek {
            len: walk.len(),
            deepest: (walk.len() > 0).then(|| self.id(deepest)),
        }
    }

    fn parent(&self, node: NodeId) -> Option<NodeId> {
        let i = self.resolve(node).ok()?;
        let parent = self.nodes[i as usize].parent;
        (parent != NONE && self.nodes[parent as usize].parent != NONE).then(|| self.id(parent))
    }

    fn insert(
        &mut self,
        key: &[u32],
        extra_key: Option<&str>,
        slots: &[Slot],
        opts: InsertOptions,
    ) -> Result<InsertResult> {
        crate::error::check_insert_lengths(key, slots)?;
        let root = self.root_index(extra_key);
        let r = self.insert_impl(root, key, slots, opts);
        if self.tier.is_some() {
            let last = self.resolve(r.last_node)?;
            self.write_through_after_insert(last, opts.chunked)?;
        }
        self.maybe_compact();
        Ok(r)
    }

    fn cache_unfinished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &mut ReqToTokenPool,
        alloc: &mut dyn Allocator,
        chunked: bool,
    ) -> Result<()> {
        self.check_view(&req)?;
        let p = self.page_size as usize;
        let committed = req.committed_len;
        let aligned = floor_to_page(committed, p);
        let protected = req.state.cache_protected_len;
        let slots = rows.read(req.row, committed)?.to_vec();
        let (root, last) = self.insert_committed(&req, &slots, chunked, alloc)?;
        // Re-match for the tree's canonical slots and the new last node. Without a host tier
        // the insert left the prefix ending exactly at `last`: the match's effects (a tick, the
        // path's access times, its slots) without walking the key again.
        let mut canonical = Vec::with_capacity(committed);
        let m = if self.tier.is_none() {
            debug_assert_eq!(
                self.walk(root, &req.tokens[..aligned]),
                Walk {
                    node: last,
                    matched: aligned,
                    partial: None
                },
                "the insert ends the prefix at its last node"
            );
            self.tick();
            let end = Matched { last, len: aligned };
            self.matched_path(end, Some(&mut canonical))
        } else {
            self.match_impl(root, &req.tokens[..aligned], Some(&mut canonical))
        };
        debug_assert_eq!(m.device_len, aligned);
        rows.write(req.row, protected, &canonical[protected..aligned])?;
        self.lock_path(m.device, LockDelta::Inc);
        let old = self.resolve(req.state.last_node)?;
        self.lock_path(old, LockDelta::Dec);
        canonical.extend_from_slice(&slots[aligned..committed]);
        req.state.cache_protected_len = aligned;
        req.state.last_node = self.id(m.device);
        req.state.prefix_slots = canonical;
        self.maybe_compact();
        Ok(())
    }

    fn cache_finished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &ReqToTokenPool,
        alloc: &mut dyn Allocator,
        insert: bool,
    ) -> Result<()> {
        self.check_view(&req)?;
        let p = self.page_size as usize;
        let committed = req.committed_len;
        let aligned = floor_to_page(committed, p);
        let protected = req.state.cache_protected_len;
        let slots = rows.read(req.row, committed)?;
        let last = self.resolve(req.state.last_node)?;
        let owned_from = if insert {
            self.insert_committed(&req, slots, false, alloc)?;
            aligned
        } else {
            protected
        };
        if committed > owned_from {
            alloc.free(&slots[owned_from..committed])?;
        }
        self.lock_path(last, LockDelta::Dec);
        let root = self.root_index(req.extra_key);
        req.state.cache_protected_len = 0;
        req.state.last_node = self.id(root);
        req.state.prefix_slots.clear();
        self.maybe_compact();
        Ok(())
    }

    fn evict(&mut self, num_tokens: usize, alloc: &mut dyn Allocator) -> Result<usize> {
        if self.tier.is_some() {
            return self.evict_tiered(num_tokens, alloc);
        }
        self.evict_tokens(num_tokens, alloc)
    }

    fn inc_lock_ref(&mut self, node: NodeId) -> Result<usize> {
        let i = self.resolve(node)?;
        self.tick();
        Ok(self.lock_path(i, LockDelta::Inc))
    }

    fn dec_lock_ref(&mut self, node: NodeId) -> Result<usize> {
        let i = self.resolve(node)?;
        // Validate the whole path first, so an underflow changes nothing.
        self.check_unlock(i)?;
        self.tick();
        Ok(self.lock_path(i, LockDelta::Dec))
    }

    fn evictable_size(&self) -> usize {
        self.evictable
    }

    fn protected_size(&self) -> usize {
        self.protected
    }

    fn reset(&mut self, alloc: &mut dyn Allocator) -> Result<()> {
        if self.protected > 0 {
            return Err(RadixCacheError::InvalidRequest(format!(
                "reset while requests lock {} cached tokens",
                self.protected
            )));
        }
        if let Some(tier) = self.tier.as_ref() {
            if !tier.ops.is_empty() || !tier.prefetches.is_empty() {
                return Err(RadixCacheError::InvalidRequest(format!(
                    "reset while {} tier operations and {} prefetches are in flight",
                    tier.ops.len(),
                    tier.prefetches.len()
                )));
            }
        }
        let mut all = Vec::with_capacity(self.evictable);
        let mut host = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && n.parent != NONE {
                if n.on_device {
                    all.extend_from_slice(self.node_slots(i as u32));
                }
                if n.backed_up {
                    host.extend_from_slice(self.node_host_slots(i as u32));
                }
            }
        }
        alloc.free(&all)?;
        if let Some(tier) = self.tier.as_mut() {
            tier.host.free(&host)?;
        }
        // The policy, the options, the clock and pending events survive a reset.
        self.clear_tree();
        if self.events_enabled {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        Ok(())
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn claim_ownership(&self, check: &mut OwnershipCheck) {
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && n.parent != NONE && n.on_device {
                check.claim(Owner::TreeNode(i as u64), self.node_slots(i as u32));
            }
        }
    }

    fn check_invariants(&self) -> std::result::Result<(), String> {
        RadixCache::check_invariants(self)
    }

    fn check_hicache_events(&mut self) -> Result<()> {
        self.process_acks()
    }

    fn init_load_back(
        &mut self,
        last_host_node: NodeId,
        out: &mut Vec<Slot>,
        alloc: &mut dyn Allocator,
        mem_quota: usize,
    ) -> Result<LoadBack> {
        self.init_load_back_impl(last_host_node, out, alloc, mem_quota)
    }

    fn write_back_path(&mut self, node: NodeId) -> Result<usize> {
        self.write_back_path_impl(node)
    }

    fn pin_host(&mut self, node: NodeId) -> Result<bool> {
        self.pin_host_impl(node, true)
    }

    fn unpin_host(&mut self, node: NodeId) -> Result<()> {
        self.pin_host_impl(node, false).map(|_| ())
    }

    fn prefetch_from_storage(
        &mut self,
        rid: u64,
        key: &[u32],
        extra_key: Option<&str>,
    ) -> Result<()> {
        self.prefetch_from_storage_impl(rid, key, extra_key)
    }

    fn check_prefetch_progress(&mut self, rid: u64, now_s: f64) -> Result<bool> {
        self.check_prefetch_progress_impl(rid, now_s)
    }

    fn release_prefetch(&mut self, rid: u64) -> Result<()> {
        self.release_prefetch_impl(rid)
    }

    fn tier_ops_in_flight(&self) -> usize {
        self.tier
            .as_ref()
            .map_or(0, |t| t.ops.len() + t.prefetches.len())
    }

    fn tier_stats(&self) -> Option<TierStats> {
        self.tier_stats_impl()
    }
}
