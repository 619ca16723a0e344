//! The evictable-leaf index: which nodes are in it, under which policy key, and the statistics
//! a policy sees. Every change to a node that can move it in or out of the index, or change its
//! key, ends in [`RadixCache::refresh`] (SGLang rebuilds a heap over every leaf per `evict`
//! instead). Builds on `arena` only.

use crate::policy::{EvictionPolicy, NodeStats};
use crate::radix::arena::{RadixCache, NONE};

impl<P: EvictionPolicy> RadixCache<P> {
    /// What the policy sees of node `i`.
    pub(super) fn stats(&self, i: u32) -> NodeStats {
        let n = &self.nodes[i as usize];
        // The path through the node's last page: what partial eviction removes first.
        let path = if self.track_paths { n.end_hash } else { 0 };
        NodeStats {
            last_access: n.last_access,
            creation: n.creation,
            hit_count: n.hit_count,
            priority: n.priority,
            depth: n.depth,
            lineage: n.lineage,
            len: n.len,
            path_hash: path,
        }
    }

    /// Unlocked, on device, with no child on device, and not a root: what the index must hold
    /// (without a host tier every node is on device, so: unlocked and childless).
    pub(super) fn is_evictable_leaf(&self, i: u32) -> bool {
        let n = &self.nodes[i as usize];
        n.live && n.parent != NONE && n.lock_ref == 0 && n.device_children == 0 && n.on_device
    }

    /// Host-only, backed up, childless, unlocked, unpinned and not a root: what the host index
    /// must hold (never true without a host tier).
    pub(super) fn is_host_leaf(&self, i: u32) -> bool {
        let n = &self.nodes[i as usize];
        n.live
            && n.parent != NONE
            && !n.on_device
            && n.backed_up
            && n.lock_ref == 0
            && n.host_ref == 0
            && n.children.is_empty()
    }

    /// Re-derives `i`'s place in the evictable index after any change to it.
    /// A node whose key did not change keeps its place (no index work).
    pub(super) fn refresh(&mut self, i: u32) {
        let old = self.nodes[i as usize].indexed;
        if self.is_evictable_leaf(i) {
            let stats = self.stats(i);
            let key = self.policy.key(&stats);
            if old != Some(key) {
                match old {
                    Some(old) => self.index.rekey(old, key, i),
                    None => self.index.insert(key, i),
                }
                self.nodes[i as usize].indexed = Some(key);
            }
        } else if let Some(old) = old {
            self.index.remove(old, i);
            self.nodes[i as usize].indexed = None;
        }
        if self.tier.is_some() {
            self.refresh_host(i);
        }
    }

    /// Re-derives `i`'s place in the host-evictable index (a cache with a host tier only).
    fn refresh_host(&mut self, i: u32) {
        let should = self.is_host_leaf(i);
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        if let Some(old) = tier.keys.remove(&i) {
            tier.index.remove(&(old, i));
        }
        if should {
            let stats = self.stats(i);
            let key = self.policy.key(&stats);
            if let Some(tier) = self.tier.as_mut() {
                tier.index.insert((key, i));
                tier.keys.insert(i, key);
            }
        }
    }

    /// Records an access to node `i` at the current tick: a hit if `hit`, and `priority`
    /// max-propagated if given. Roots keep no statistics.
    pub(super) fn touch(&mut self, i: u32, hit: bool, priority: Option<i64>) {
        let now = self.clock;
        let n = &mut self.nodes[i as usize];
        if n.parent == NONE {
            return;
        }
        n.last_access = now;
        if hit {
            n.hit_count = n.hit_count.saturating_add(1);
        }
        if let Some(p) = priority {
            n.priority = n.priority.max(p);
        }
        if n.indexed.is_some() || !n.on_device {
            self.refresh(i);
        }
    }

    /// Advances the logical clock; returns the new tick.
    pub(super) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }
}
