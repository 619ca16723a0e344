//! Acknowledgements (SGLang's `HiRadixCache.writing_check` / `loading_check` and the storage
//! ack queues), processed once per scheduler step by
//! [`crate::PrefixCache::check_hicache_events`]: written nodes are unlocked and (with storage)
//! handed to the L3 backup, loaded chains unlocked, backups unpin their host pages, prefetch
//! queries and copies advance their prefetch. Also the prefetch stop decision
//! (`check_prefetch_progress`), which may wait for a cancelled copy's ack. The top of the tier
//! modules: builds on `arena`, `index`, `lock`, `tier` and `prefetch`.

use kv_pool::tier::AckOutcome;
use kv_pool::Allocator;

use crate::error::Result;
use crate::policy::EvictionPolicy;
use crate::radix::arena::{RadixCache, NONE};
use crate::radix::host::{PendingOp, PrefetchStage};
use crate::radix::lock::LockDelta;
use crate::tiers::PrefetchPolicy;
use crate::NodeId;

/// Tries of one device ↔ host copy before the cache gives up (the first and three retries).
const MAX_COPY_ATTEMPTS: u32 = 4;

impl<P: EvictionPolicy> RadixCache<P> {
    /// See [`crate::PrefixCache::check_hicache_events`].
    pub(super) fn process_acks(&mut self) -> Result<()> {
        let Some(tier) = self.tier.as_mut() else {
            return Ok(());
        };
        let acks = tier.controller.poll_acks();
        for ack in acks {
            let tier = self.tier_mut();
            let Some(pending) = tier.ops.remove(&ack.op) else {
                // An op whose requester is gone (a prefetch query stopped early).
                continue;
            };
            let failed = matches!(ack.outcome, AckOutcome::Failed(_));
            let reason = match &ack.outcome {
                AckOutcome::Failed(r) => r.as_str(),
                _ => "",
            };
            if failed {
                tier.stats.ops_failed += 1;
            }
            match pending {
                PendingOp::Write { node, len, unlock } => {
                    tier.stats.writes_acked += 1;
                    if failed && unlock && !tier.orphans.contains_key(&ack.op) {
                        // A write-through copy: its device rows are intact (locked until the
                        // ack), its host rows undefined. Copy again, still locked and pinned.
                        self.retry_copy(node, len, true, reason)?;
                        continue;
                    }
                    tier.copy_attempts.remove(&node);
                    if unlock {
                        self.unlock_node(node)?;
                    }
                    if let Some(host) = self.tier_mut().orphans.remove(&ack.op) {
                        self.tier_mut().host.free(&host)?;
                        continue;
                    }
                    let i = self.resolve(node)?;
                    let storage = self.tier.as_ref().is_some_and(|t| t.storage);
                    if storage && !failed {
                        self.backup_written(i, len);
                    } else {
                        self.unpin(i);
                    }
                }
                PendingOp::Load { node, len } => {
                    tier.stats.loads_acked += 1;
                    if failed {
                        self.retry_copy(node, len, false, reason)?;
                    } else {
                        tier.copy_attempts.remove(&node);
                        self.unlock_node(node)?;
                    }
                }
                PendingOp::Backup { node } => {
                    tier.stats.backups_acked += 1;
                    if let Some(host) = tier.orphans.remove(&ack.op) {
                        tier.host.free(&host)?;
                        continue;
                    }
                    let i = self.resolve(node)?;
                    self.unpin(i);
                }
                PendingOp::Query { rid } => self.on_query_ack(rid, &ack.outcome)?,
                PendingOp::Prefetch { rid } => self.on_prefetch_ack(rid, &ack.outcome)?,
            }
        }
        Ok(())
    }

    /// Hands written node `i` to the L3 backup, with the upper halves of splits since the
    /// write (together `len` tokens ending at `i`): one backup per node, each pinning it (the
    /// write's pin on `i` moves to its backup).
    fn backup_written(&mut self, i: u32, len: usize) {
        let mut covered = 0;
        let mut j = i;
        while covered < len && self.nodes[j as usize].parent != NONE {
            let keys = self.node_page_keys(j);
            let host = self.node_host_slots(j).to_vec();
            if j != i {
                self.nodes[j as usize].host_ref += 1;
                self.refresh(j);
            }
            let node = self.id(j);
            let tier = self.tier_mut();
            let op = tier.controller.backup(&host, &keys);
            tier.ops.insert(op, PendingOp::Backup { node });
            tier.stats.backups_queued += 1;
            covered += self.nodes[j as usize].len;
            j = self.nodes[j as usize].parent;
        }
    }

    /// Queues a failed copy of the `len` tokens ending at `node` again, over the same host and
    /// device slots (nodes split since are walked by tokens), keeping what the first copy
    /// held (its lock, and for a write its pin). A failed load-back left device rows
    /// undefined while the tree holds the chain as on device: the retry is what a pass
    /// matching it waits for, layer by layer, so no match serves rows the failed copy left
    /// behind. A failed write-through left host rows undefined while the tree holds the
    /// node as backed up: the retry lands before anything may demote it (it is locked).
    /// After `MAX_COPY_ATTEMPTS` failures in a row it gives up with
    /// [`RadixCacheError::CopyFailed`](crate::RadixCacheError::CopyFailed).
    fn retry_copy(&mut self, node: NodeId, len: usize, write: bool, reason: &str) -> Result<()> {
        let attempts = self.tier_mut().copy_attempts.entry(node).or_insert(0);
        *attempts += 1;
        if *attempts >= MAX_COPY_ATTEMPTS {
            let attempts = *attempts;
            return Err(crate::RadixCacheError::CopyFailed {
                kind: if write { "write" } else { "load" },
                node,
                attempts,
                reason: reason.to_string(),
            });
        }
        let last = self.resolve(node)?;
        let mut chain = Vec::new();
        let (mut j, mut covered) = (last, 0);
        while covered < len && self.nodes[j as usize].parent != NONE {
            chain.push(j);
            covered += self.nodes[j as usize].len;
            j = self.nodes[j as usize].parent;
        }
        chain.reverse();
        let mut host = Vec::with_capacity(len);
        let mut device = Vec::with_capacity(len);
        for &c in &chain {
            host.extend_from_slice(self.node_host_slots(c));
            device.extend_from_slice(self.node_slots(c));
        }
        let tier = self.tier_mut();
        if write {
            let op = tier.controller.write(&device, &host);
            let unlock = true;
            tier.ops.insert(op, PendingOp::Write { node, len, unlock });
            tier.stats.writes_retried += 1;
        } else {
            let op = tier.controller.load(&host, &device);
            tier.ops.insert(op, PendingOp::Load { node, len });
            tier.stats.loads_retried += 1;
        }
        Ok(())
    }

    fn unlock_node(&mut self, node: NodeId) -> Result<()> {
        let i = self.resolve(node)?;
        self.check_unlock(i)?;
        self.lock_path(i, LockDelta::Dec);
        Ok(())
    }

    fn unpin(&mut self, i: u32) {
        let n = &mut self.nodes[i as usize];
        n.host_ref = n.host_ref.saturating_sub(1);
        self.refresh(i);
    }

    /// See [`crate::PrefixCache::check_prefetch_progress`].
    pub(super) fn check_prefetch_progress_impl(&mut self, rid: u64, now_s: f64) -> Result<bool> {
        let Some(tier) = self.tier.as_mut() else {
            return Ok(true);
        };
        let policy = tier.cfg.prefetch_policy;
        let Some(pf) = tier.prefetches.get_mut(&rid) else {
            return Ok(true);
        };
        if pf.released {
            return Ok(true);
        }
        let first = *pf.first_check_s.get_or_insert(now_s);
        let timed_out = now_s - first >= tier.cfg.prefetch_timeout_s(pf.tokens.len());
        let (op, acked) = match pf.stage {
            PrefetchStage::Querying(op) => (op, false),
            PrefetchStage::Fetching { op, landed, .. } => (op, landed.is_some()),
        };
        let stop = match policy {
            PrefetchPolicy::BestEffort => true,
            PrefetchPolicy::WaitComplete => acked,
            PrefetchPolicy::Timeout => acked || timed_out,
        };
        if !stop {
            return Ok(false);
        }
        if matches!(pf.stage, PrefetchStage::Querying(_)) {
            // Nothing was fetched yet: drop it (the query's ack is ignored).
            self.end_prefetch(rid)?;
            return Ok(true);
        }
        if !acked {
            // Stop the copy and take what landed at its ack, at a later step: waiting here would
            // hold the scheduler behind every storage operation queued before it.
            tier.controller.cancel_prefetch(op);
            return Ok(false);
        }
        self.finish_prefetch(rid)?;
        Ok(true)
    }
}
