//! Host → device load-back (SGLang's `HiRadixCache.init_load_back` / `load_back`) and
//! retraction's write-back of a path (`write_back_path`). Builds on `arena`, `index`, `lock`,
//! `tier` and `demote`.

use kv_pool::{Allocator, Slot};

use crate::error::Result;
use crate::policy::EvictionPolicy;
use crate::radix::arena::{RadixCache, NONE};
use crate::radix::host::PendingOp;
use crate::radix::lock::LockDelta;
use crate::tiers::LoadBack;
use crate::NodeId;

impl<P: EvictionPolicy> RadixCache<P> {
    /// See [`crate::PrefixCache::init_load_back`].
    pub(super) fn init_load_back_impl(
        &mut self,
        last_host_node: NodeId,
        out: &mut Vec<Slot>,
        alloc: &mut dyn Allocator,
        mem_quota: usize,
    ) -> Result<LoadBack> {
        let last = self.resolve(last_host_node)?;
        let (ancestor, _) = self.device_ancestor(last);
        let nothing = LoadBack {
            loaded: 0,
            last_node: self.id(ancestor),
        };
        let Some(tier) = self.tier.as_ref() else {
            return Ok(nothing);
        };
        let threshold = tier.cfg.load_back_threshold;
        // The host-only chain, bottom-up.
        let mut chain = Vec::new();
        let mut i = last;
        while i != ancestor {
            chain.push(i);
            i = self.nodes[i as usize].parent;
        }
        let total: usize = chain.iter().map(|&c| self.nodes[c as usize].len).sum();
        if total == 0 || total < threshold {
            return Ok(nothing);
        }
        // Lock the chain and its device ancestor while making room (host eviction must not
        // take the chain, device eviction not the ancestor); the lock stays until the load's
        // ack. The quota counts evictable tokens as room, so the ancestors' tokens this lock
        // protects are added back to it (as SGLang's `mem_quota + delta`).
        self.tick();
        let delta = self.lock_path(last, LockDelta::Inc);
        if total > mem_quota.saturating_add(delta) {
            self.lock_path(last, LockDelta::Dec);
            return Ok(nothing);
        }
        let avail = alloc.available_size();
        if avail < total {
            self.evict_tiered(total - avail, alloc)?;
        }
        let mut device = Vec::with_capacity(total);
        if alloc.alloc(total, &mut device).is_err() {
            self.lock_path(last, LockDelta::Dec);
            return Ok(nothing);
        }
        chain.reverse();
        let mut host = Vec::with_capacity(total);
        for &c in &chain {
            host.extend_from_slice(self.node_host_slots(c));
        }
        let mut at = 0;
        for &c in &chain {
            let n = &self.nodes[c as usize];
            let (start, len) = (n.start, n.len);
            self.slots[start..start + len].copy_from_slice(&device[at..at + len]);
            at += len;
            self.attach_device(c);
        }
        let node = self.id(last);
        let tier = self.tier_mut();
        let op = tier.controller.load(&host, &device);
        tier.ops.insert(op, PendingOp::Load { node, len: total });
        tier.stats.loads_queued += 1;
        tier.stats.host_hit_tokens += total as u64;
        out.extend_from_slice(&device);
        Ok(LoadBack {
            loaded: total,
            last_node: node,
        })
    }

    /// See [`crate::PrefixCache::pin_host`] (`pin`) and [`crate::PrefixCache::unpin_host`].
    pub(super) fn pin_host_impl(&mut self, node: NodeId, pin: bool) -> Result<bool> {
        if self.tier.is_none() {
            return Ok(false);
        }
        let i = self.resolve(node)?;
        let n = &mut self.nodes[i as usize];
        if pin && !n.backed_up {
            return Ok(false);
        }
        if pin {
            n.host_ref += 1;
        } else if n.host_ref == 0 {
            return Err(crate::RadixCacheError::InvalidRequest(format!(
                "unpin_host of {node}, which holds no pin"
            )));
        } else {
            n.host_ref -= 1;
        }
        self.refresh(i);
        Ok(true)
    }

    /// See [`crate::PrefixCache::write_back_path`].
    pub(super) fn write_back_path_impl(&mut self, node: NodeId) -> Result<usize> {
        let i = self.resolve(node)?;
        if self.tier.is_none() || !self.nodes[i as usize].on_device {
            return Ok(0);
        }
        self.tick();
        // Synchronous, as write-back eviction: retraction frees memory now, so the copies must
        // have landed before eviction may demote the nodes (which are therefore not locked).
        let (queued, ops) = self.backup_path_with(i, false)?;
        // The insert that preceded this call may have queued write-through copies of the same
        // path, which lock their nodes until their acks: wait for those too and take their
        // acks now, or the retracted KV could not be evicted until the next step.
        let mut path = Vec::new();
        let mut j = i;
        while self.nodes[j as usize].parent != NONE {
            path.push(self.id(j));
            j = self.nodes[j as usize].parent;
        }
        let tier = self.tier_mut();
        let locked: Vec<_> = tier
            .ops
            .iter()
            .filter_map(|(&op, p)| match p {
                PendingOp::Write {
                    node, unlock: true, ..
                } if path.contains(node) => Some(op),
                _ => None,
            })
            .collect();
        for &op in ops.iter().chain(&locked) {
            tier.controller.wait(op);
        }
        if !locked.is_empty() {
            self.process_acks()?;
        }
        Ok(queued)
    }
}
