//! Eviction (SGLang's `evict`): the evictable leaf with the smallest policy key goes first,
//! whole or (with partial eviction, or page by page for a policy that needs path hashes) only
//! its tail pages. Builds on `arena` and `index`.

use kv_pool::Allocator;

use crate::error::Result;
use crate::events::{digest_to_block_id, KvEvent};
use crate::policy::{path_hash, EvictionPolicy};
use crate::radix::arena::{Children, RadixCache};

impl<P: EvictionPolicy> RadixCache<P> {
    /// Frees at least `num_tokens` tokens (rounded up to pages) from the evictable leaves in
    /// key order, or everything evictable if that is less; returns the tokens freed.
    pub(super) fn evict_tokens(
        &mut self,
        num_tokens: usize,
        alloc: &mut dyn Allocator,
    ) -> Result<usize> {
        let p = self.page_size as usize;
        let mut freed = 0;
        while freed < num_tokens {
            let Some((_, i)) = self.index.first() else {
                break;
            };
            self.tick();
            let need = (num_tokens - freed).div_ceil(p) * p;
            // Belady (path hashes) decides page by page: a leaf's next page to go may be
            // needed sooner than another leaf's.
            let take = if self.track_paths {
                p
            } else if self.partial_eviction {
                need
            } else {
                usize::MAX
            };
            freed += self.evict_from(i, take, alloc)?;
        }
        self.maybe_compact();
        Ok(freed)
    }

    /// Removes the last `n` tokens (whole pages) of evictable leaf `i`, or the whole leaf.
    pub(super) fn evict_from(
        &mut self,
        i: u32,
        n: usize,
        alloc: &mut dyn Allocator,
    ) -> Result<usize> {
        let len = self.nodes[i as usize].len;
        let n = n.min(len);
        let start = self.nodes[i as usize].start;
        alloc.free(&self.slots[start + len - n..start + len])?;
        let key = self.nodes[i as usize]
            .indexed
            .expect("evicting an indexed leaf");
        self.policy.on_evict(key);
        if self.events_enabled {
            let p = self.page_size as usize;
            let digests = &mut self.nodes[i as usize].digests;
            let removed: Vec<i64> = digests
                .drain(digests.len() - n / p..)
                .map(|d| digest_to_block_id(&d))
                .collect();
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: removed,
            });
        }
        self.evictable -= n;
        self.dead_tokens += n;
        if n < len {
            let p = self.page_size as usize;
            let node = &mut self.nodes[i as usize];
            node.len -= n;
            if self.track_paths {
                let tokens = &self.tokens[node.start..node.start + node.len];
                node.end_hash = tokens.chunks(p).fold(node.start_hash, path_hash);
            }
            self.refresh(i);
        } else {
            self.index.remove(key, i);
            self.nodes[i as usize].indexed = None;
            let parent = self.nodes[i as usize].parent;
            self.remove_child(parent, i);
            let node = &mut self.nodes[i as usize];
            node.live = false;
            node.children = Children::default();
            node.digests = Vec::new();
            self.free_nodes.push(i);
            self.refresh(parent);
        }
        Ok(n)
    }
}
