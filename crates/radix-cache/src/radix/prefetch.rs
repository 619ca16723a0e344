//! L3 → host prefetch (SGLang's `HiRadixCache.prefetch_from_storage` and
//! `check_prefetch_progress`'s insertion): a request's page-aligned tokens beyond the device +
//! host match are looked up in storage by their chained page keys; the hit pages are copied
//! into freshly allocated host slots, then inserted as host-only nodes below the match. The
//! stop decision and the ack dispatch live in `acks`. Builds on `arena`, `index`,
//! `match_insert`, `lock` and `tier`.

use kv_pool::floor_to_page;
use kv_pool::tier::AckOutcome;
use kv_pool::{Allocator, Slot};

use crate::error::Result;
use crate::events::{chain_digests, namespace_seed};
use crate::policy::EvictionPolicy;
use crate::radix::arena::{RadixCache, NONE};
use crate::radix::host::{PendingOp, Prefetch, PrefetchStage};
use crate::radix::lock::LockDelta;
use crate::InsertOptions;

impl<P: EvictionPolicy> RadixCache<P> {
    /// See [`crate::PrefixCache::prefetch_from_storage`].
    pub(super) fn prefetch_from_storage_impl(
        &mut self,
        rid: u64,
        key: &[u32],
        extra_key: Option<&str>,
    ) -> Result<()> {
        let Some(tier) = self.tier.as_ref() else {
            return Ok(());
        };
        if !tier.storage || tier.prefetches.contains_key(&rid) {
            return Ok(());
        }
        let (threshold, share, host_total) = (
            tier.cfg.prefetch_threshold,
            tier.cfg.prefetch_max_host_share,
            tier.cfg.host_slots,
        );
        let reserved = tier.prefetch_reserved;
        let p = self.page_size as usize;
        let key = &key[..floor_to_page(key.len(), p)];
        let root = self.root_index(extra_key);
        let walk = self.walk(root, key);
        let rest = key.len() - walk.matched;
        if rest == 0 || rest < threshold || (reserved + rest) as f64 > share * host_total as f64 {
            return Ok(());
        }
        let keys =
            chain_digests(namespace_seed(extra_key).as_ref(), key, p)[walk.matched / p..].to_vec();
        self.tick();
        self.lock_path(walk.node, LockDelta::Inc);
        let anchor = self.id(walk.node);
        let tier = self.tier_mut();
        let op = tier.controller.query(&keys);
        tier.ops.insert(op, PendingOp::Query { rid });
        tier.prefetch_reserved += rest;
        tier.prefetches.insert(
            rid,
            Prefetch {
                anchor,
                tokens: key[walk.matched..].to_vec(),
                keys,
                reserved: rest,
                first_check_s: None,
                stage: PrefetchStage::Querying(op),
                released: false,
            },
        );
        Ok(())
    }

    /// A prefetch's existence query came back: fetch the leading hit pages into new host slots
    /// (host eviction allowed), or end the prefetch when too few hit or there is no room.
    pub(super) fn on_query_ack(&mut self, rid: u64, outcome: &AckOutcome) -> Result<()> {
        let p = self.page_size as usize;
        let tier = self.tier_mut();
        let Some(pf) = tier.prefetches.get(&rid) else {
            return Ok(());
        };
        let found = match outcome {
            AckOutcome::Found(n) => (*n).min(pf.keys.len()),
            _ => 0,
        };
        if found == 0 || found * p < tier.cfg.prefetch_threshold {
            return self.end_prefetch(rid);
        }
        let Some(host) = self.alloc_host(found * p)? else {
            return self.end_prefetch(rid);
        };
        let tier = self.tier_mut();
        let pf = tier
            .prefetches
            .get_mut(&rid)
            .expect("prefetch checked above");
        let op = tier.controller.prefetch(&pf.keys[..found], &host);
        tier.ops.insert(op, PendingOp::Prefetch { rid });
        tier.stats.prefetches_queued += 1;
        tier.prefetch_reserved -= pf.reserved - found * p;
        pf.reserved = found * p;
        pf.stage = PrefetchStage::Fetching {
            op,
            host,
            landed: None,
        };
        Ok(())
    }

    /// A prefetch's copy came back: record what landed; a released prefetch frees everything.
    pub(super) fn on_prefetch_ack(&mut self, rid: u64, outcome: &AckOutcome) -> Result<()> {
        let p = self.page_size as usize;
        let tier = self.tier_mut();
        tier.stats.prefetches_acked += 1;
        let Some(pf) = tier.prefetches.get_mut(&rid) else {
            return Ok(());
        };
        let PrefetchStage::Fetching { host, landed, .. } = &mut pf.stage else {
            return Ok(());
        };
        let n = match outcome {
            AckOutcome::Fetched(n) => *n,
            _ => 0,
        };
        *landed = Some(n.min(host.len() / p));
        if pf.released {
            let host = std::mem::take(host);
            tier.host.free(&host)?;
            tier.prefetches.remove(&rid);
        }
        Ok(())
    }

    /// Ends prefetch `rid` (anchor unlocked, reservation returned), freeing its host slots if
    /// it holds any; returns its record.
    pub(super) fn end_prefetch(&mut self, rid: u64) -> Result<()> {
        let Some(pf) = self.tier_mut().prefetches.remove(&rid) else {
            return Ok(());
        };
        if !pf.released {
            self.unlock_anchor(&pf)?;
        }
        let tier = self.tier_mut();
        match pf.stage {
            PrefetchStage::Querying(op) => {
                tier.ops.remove(&op);
            }
            PrefetchStage::Fetching { host, .. } => tier.host.free(&host)?,
        }
        Ok(())
    }

    fn unlock_anchor(&mut self, pf: &Prefetch) -> Result<()> {
        self.tier_mut().prefetch_reserved -= pf.reserved;
        let a = self.resolve(pf.anchor)?;
        if self.nodes[a as usize].parent != NONE {
            self.check_unlock(a)?;
            self.lock_path(a, LockDelta::Dec);
        }
        Ok(())
    }

    /// See [`crate::PrefixCache::release_prefetch`].
    pub(super) fn release_prefetch_impl(&mut self, rid: u64) -> Result<()> {
        let Some(pf) = self.tier.as_ref().and_then(|t| t.prefetches.get(&rid)) else {
            return Ok(());
        };
        match pf.stage {
            PrefetchStage::Fetching {
                op, landed: None, ..
            } => {
                if pf.released {
                    return Ok(());
                }
                let pf = pf.clone();
                self.unlock_anchor(&pf)?;
                let tier = self.tier_mut();
                tier.controller.cancel_prefetch(op);
                if let Some(pf) = tier.prefetches.get_mut(&rid) {
                    pf.released = true;
                }
                Ok(())
            }
            _ => self.end_prefetch(rid),
        }
    }

    /// Ends acknowledged prefetch `rid`: its landed pages become host-only nodes below its
    /// anchor (pages already in the tree are freed instead), the rest of its host slots are
    /// freed, the inserted tokens count as storage hits. Returns the tokens inserted.
    pub(super) fn finish_prefetch(&mut self, rid: u64) -> Result<usize> {
        let Some(pf) = self.tier_mut().prefetches.remove(&rid) else {
            return Ok(0);
        };
        let inserted = self.insert_fetched(&pf);
        // The anchor stays locked while the pages go in, so nothing above them moves.
        self.unlock_anchor(&pf)?;
        inserted
    }

    fn insert_fetched(&mut self, pf: &Prefetch) -> Result<usize> {
        let p = self.page_size as usize;
        let PrefetchStage::Fetching {
            host,
            landed: Some(pages),
            ..
        } = &pf.stage
        else {
            return Ok(0);
        };
        let pages = *pages;
        let landed = pages * p;
        self.tier_mut().host.free(&host[landed..])?;
        if landed == 0 {
            return Ok(0);
        }
        let anchor = self.resolve(pf.anchor)?;
        self.tick();
        let tokens = &pf.tokens[..landed];
        let m = self.walk_and_split(anchor, tokens);
        let mut kept = m.len;
        if kept < landed {
            let parent = m.last;
            let needs_prefix = self.tier_mut().cfg.write_policy.threshold().is_some()
                && self.nodes[parent as usize].parent != NONE;
            if needs_prefix && !self.nodes[parent as usize].backed_up {
                self.backup_path(parent)?;
            }
            if needs_prefix && !self.nodes[parent as usize].backed_up {
                // No host room to keep backed-up nodes a root-anchored prefix.
                kept = landed;
            } else {
                let padding = vec![Slot::PADDING; landed - m.len];
                let leaf = self.new_leaf(
                    parent,
                    &tokens[m.len..],
                    &padding,
                    InsertOptions::default(),
                    false,
                );
                let start = self.nodes[leaf as usize].start;
                self.host_slots[start..start + landed - m.len]
                    .copy_from_slice(&host[m.len..landed]);
                self.nodes[leaf as usize].backed_up = true;
                self.refresh(leaf);
                self.tier_mut().stats.storage_hit_tokens += (landed - m.len) as u64;
            }
        }
        // Pages the tree already held (or could not take): their fetched copies go.
        self.tier_mut().host.free(&host[..kept])?;
        self.maybe_compact();
        Ok(landed - kept.min(landed))
    }
}
