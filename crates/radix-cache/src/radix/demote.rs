//! Device eviction with a host tier (SGLang's `HiRadixCache.evict`): the evictable leaves (on
//! device, unlocked, no child on device) go in the policy's order, whole. A backed-up node is
//! demoted (its device slots freed, the node kept host-only); a node not backed up is deleted
//! under write-through, and under write-back copied to host first (waiting for the copy), or,
//! when the host has no room, dropped with its host-only subtree. Builds on `arena`, `index`,
//! `evict` and `tier`.

use kv_pool::{Allocator, Slot};

use crate::error::Result;
use crate::events::{digest_to_block_id, KvEvent};
use crate::policy::EvictionPolicy;
use crate::radix::arena::RadixCache;
use crate::tiers::WritePolicy;

impl<P: EvictionPolicy> RadixCache<P> {
    /// Frees at least `num_tokens` device tokens (whole nodes) by demotion, deletion or (under
    /// write-back) a synchronous backup then demotion; returns the device tokens freed.
    pub(super) fn evict_tiered(
        &mut self,
        num_tokens: usize,
        alloc: &mut dyn Allocator,
    ) -> Result<usize> {
        let write_back = self.tier_mut().cfg.write_policy == WritePolicy::WriteBack;
        let mut freed = 0;
        while freed < num_tokens {
            let Some((_, i)) = self.index.first() else {
                break;
            };
            self.tick();
            let n = &self.nodes[i as usize];
            if n.backed_up {
                freed += self.demote(i, alloc)?;
            } else if write_back {
                match self.backup_node(i, false)? {
                    Some(op) => {
                        self.tier_mut().controller.wait(op);
                        freed += self.demote(i, alloc)?;
                    }
                    None => freed += self.drop_subtree(i, alloc)?,
                }
            } else if n.children.is_empty() {
                freed += self.evict_from(i, usize::MAX, alloc)?;
            } else {
                freed += self.drop_subtree(i, alloc)?;
            }
        }
        self.maybe_compact();
        Ok(freed)
    }

    /// Takes evictable node `i` off the device: frees its device slots and the policy's key,
    /// publishes `BlockRemoved` for its pages, and counts it out of the device sizes.
    fn free_device(&mut self, i: u32, alloc: &mut dyn Allocator) -> Result<usize> {
        let len = self.nodes[i as usize].len;
        alloc.free(self.node_slots(i))?;
        if let Some(key) = self.nodes[i as usize].indexed.take() {
            self.index.remove(key, i);
            self.policy.on_evict(key);
        }
        if self.events_enabled {
            let removed = self.nodes[i as usize]
                .digests
                .iter()
                .map(digest_to_block_id)
                .collect();
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: removed,
            });
        }
        self.evictable -= len;
        Ok(len)
    }

    /// Demotes evictable backed-up node `i` to host-only; returns the device tokens freed.
    pub(super) fn demote(&mut self, i: u32, alloc: &mut dyn Allocator) -> Result<usize> {
        let len = self.free_device(i, alloc)?;
        let n = &mut self.nodes[i as usize];
        n.on_device = false;
        let (start, parent) = (n.start, n.parent);
        self.slots[start..start + len].fill(Slot::PADDING);
        self.nodes[parent as usize].device_children -= 1;
        self.refresh(i);
        self.refresh(parent);
        let p = self.page_size as usize;
        self.tier_mut().stats.pages_demoted += (len / p) as u64;
        Ok(len)
    }

    /// Drops evictable node `i` (on device, not backed up) and its host-only subtree from both
    /// tiers (SGLang's write-back eviction without host room); returns the device tokens freed.
    pub(super) fn drop_subtree(&mut self, i: u32, alloc: &mut dyn Allocator) -> Result<usize> {
        let mut order = vec![i];
        let mut k = 0;
        while k < order.len() {
            order.extend(self.nodes[order[k] as usize].children.iter());
            k += 1;
        }
        let mut pages = 0;
        let p = self.page_size as usize;
        // Children before their parents.
        for &j in order[1..].iter().rev() {
            pages += self.delete_host_only(j)? / p;
        }
        let len = self.free_device(i, alloc)?;
        self.nodes[i as usize].on_device = false;
        let parent = self.nodes[i as usize].parent;
        self.nodes[parent as usize].device_children -= 1;
        self.release_host_slots(i)?;
        self.unlink(i);
        pages += len / p;
        self.tier_mut().stats.pages_dropped += pages as u64;
        Ok(len)
    }
}
