//! The `kv_events` policy's index of which worker holds which pages ([`KvIndex`]), rebuilt
//! from the workers' KV events — one `radix_cache::RadixCache`, not a tree of our own.
//!
//! The tree's "tokens" are block hashes: a page's SGLang block id (the chained SHA-256, as an
//! `i64`) is two `u32` symbols, so a tree page (page size 2) is one KV page, and a path from
//! the root is a chain of pages. Each worker is one namespace of the tree (`extra_key`
//! `worker-<id>`), so the longest cached prefix of a request on a worker is one
//! `peek_prefix_len` of its chained block ids in that worker's namespace.
//!
//! Lifetime of a page: `BlockStored` inserts it under its parent's path. Only a worker's held
//! leaves (pages with no held child) lock the node that ends at them (`inc_lock_ref`, which
//! also locks its ancestors, so every held page is protected by a leaf below it): a stored
//! chain locks its last page and unlocks its parent if that was a leaf; `BlockRemoved` unlocks
//! a removed leaf and locks its parent when that becomes a leaf; `AllBlocksCleared` unlocks
//! them all; everything no longer locked is evicted at once. So the tree holds exactly the
//! pages the workers reported and did not remove (a worker evicts leaves first, so a page's
//! ancestors outlive it), and an event costs one walk of its chain, not one per page (a
//! Mooncake prompt is hundreds of pages). Slots are meaningless here: they come from a pool
//! of [`INDEX_SLOTS`] and go back when the tree evicts; a full pool is [`KvIndexError::Full`].
//!
//! A `BlockStored` whose parent the index does not know (the router subscribed late, or
//! missed a batch) cannot be placed; its pages are counted in [`KvIndex::unplaced`] and left
//! out (routing then underestimates that worker's cache, never overestimates it).

use std::collections::HashMap;

use kv_pool::{Allocator, PagedAllocator, Slot};
use radix_cache::events::{chain_digests, digest_to_block_id};
use radix_cache::{BuiltinPolicy, InsertOptions, KvEvent, NodeId, PrefixCache, RadixCache};

use super::WorkerId;

/// Slots of the index's pool: two per indexed page (1 M pages, whatever the workers).
pub const INDEX_SLOTS: usize = 1 << 21;

/// What can go wrong while indexing events.
#[derive(Debug, thiserror::Error)]
pub enum KvIndexError {
    /// The index holds [`INDEX_SLOTS`] / 2 pages already.
    #[error("the KV index is full ({0} pages)")]
    Full(usize),
    /// A worker reports pages of another size than the first one did.
    #[error("worker {worker:?} reports pages of {got} tokens; the index has {want}")]
    BlockSize {
        /// The worker.
        worker: WorkerId,
        /// The size it reported.
        got: u32,
        /// The size the index keys on.
        want: u32,
    },
    /// The tree refused an operation (a bug: the index's own bookkeeping is wrong).
    #[error("the KV index's tree: {0}")]
    Tree(#[from] radix_cache::RadixCacheError),
}

/// A page a worker holds: its parent page, how many of its children the worker holds, and,
/// while it has none, the tree node ending at it that it locks.
#[derive(Debug, Clone, Copy)]
struct Held {
    parent: Option<i64>,
    children: u32,
    lock: Option<NodeId>,
}

/// Which worker holds which pages.
#[derive(Debug)]
pub struct KvIndex {
    tree: RadixCache,
    /// Made at the first page stored (a router that never indexes allocates nothing).
    pool: Option<PagedAllocator>,
    block_size: Option<u32>,
    held: HashMap<WorkerId, HashMap<i64, Held>>,
    unplaced: u64,
}

impl Default for KvIndex {
    fn default() -> Self {
        KvIndex {
            tree: RadixCache::new(2, BuiltinPolicy::Lru),
            pool: None,
            block_size: None,
            held: HashMap::new(),
            unplaced: 0,
        }
    }
}

fn namespace(w: WorkerId) -> String {
    format!("worker-{}", w.0)
}

/// Block ids as tree symbols: each id is two `u32`s, high half first.
fn key(ids: &[i64]) -> Vec<u32> {
    ids.iter()
        .flat_map(|&id| [(id as u64 >> 32) as u32, id as u32])
        .collect()
}

impl KvIndex {
    /// The workers' page size in tokens (`None` until the first `BlockStored`).
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// Pages `worker` holds.
    pub fn held_pages(&self, worker: WorkerId) -> usize {
        self.held.get(&worker).map_or(0, HashMap::len)
    }

    /// Pages left out because their parent was unknown.
    pub fn unplaced(&self) -> u64 {
        self.unplaced
    }

    /// The chained block ids of `tokens`' whole pages (empty before the page size is known).
    pub fn block_ids(&self, tokens: &[u32]) -> Vec<i64> {
        match self.block_size {
            Some(p) => chain_digests(None, tokens, p as usize)
                .iter()
                .map(digest_to_block_id)
                .collect(),
            None => Vec::new(),
        }
    }

    /// How many of `block_ids`' leading pages `worker` holds.
    pub fn matched_pages(&self, worker: WorkerId, block_ids: &[i64]) -> usize {
        self.tree
            .peek_prefix_len(&key(block_ids), Some(&namespace(worker)))
            / 2
    }

    /// The chain of block ids from the root to `page` on `worker` (`None`: not held, or a
    /// chain that loops, which only colliding hashes could make).
    fn path(&self, worker: WorkerId, page: i64) -> Option<Vec<i64>> {
        let held = self.held.get(&worker)?;
        let mut out = vec![page];
        let mut at = held.get(&page)?;
        while let Some(p) = at.parent {
            if out.len() > held.len() {
                return None;
            }
            out.push(p);
            at = held.get(&p)?;
        }
        out.reverse();
        Some(out)
    }

    /// Applies one worker's events, in order.
    pub fn apply(&mut self, worker: WorkerId, events: &[KvEvent]) -> Result<(), KvIndexError> {
        let mut removed = false;
        for ev in events {
            match ev {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    block_size,
                    ..
                } => {
                    match self.block_size {
                        None => self.block_size = Some(*block_size),
                        Some(want) if want != *block_size => {
                            return Err(KvIndexError::BlockSize {
                                worker,
                                got: *block_size,
                                want,
                            })
                        }
                        Some(_) => {}
                    }
                    self.store(worker, block_hashes, *parent_block_hash)?;
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    for &h in block_hashes {
                        removed |= self.remove(worker, h)?;
                    }
                }
                KvEvent::AllBlocksCleared => removed |= self.release(worker)?,
            }
        }
        if removed {
            self.evict_unheld()?;
        }
        Ok(())
    }

    /// Forgets everything `worker` holds (it left the router).
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<(), KvIndexError> {
        if self.release(worker)? {
            self.evict_unheld()?;
        }
        self.held.remove(&worker);
        Ok(())
    }

    /// Unlocks every page of `worker`; whether there was any.
    fn release(&mut self, worker: WorkerId) -> Result<bool, KvIndexError> {
        let pages = std::mem::take(self.held.entry(worker).or_default());
        for node in pages.values().filter_map(|h| h.lock) {
            self.tree.dec_lock_ref(node)?;
        }
        Ok(!pages.is_empty())
    }

    /// Forgets page `h` of `worker`: unlocks it if it is a leaf, and locks its parent when that
    /// becomes one; whether the worker held it.
    fn remove(&mut self, worker: WorkerId, h: i64) -> Result<bool, KvIndexError> {
        let Some(held) = self.held.get_mut(&worker).and_then(|m| m.remove(&h)) else {
            return Ok(false);
        };
        if let Some(node) = held.lock {
            self.tree.dec_lock_ref(node)?;
        }
        let Some(p) = held.parent else {
            return Ok(true);
        };
        let became_leaf = match self.held.get_mut(&worker).and_then(|m| m.get_mut(&p)) {
            Some(parent) => {
                parent.children = parent.children.saturating_sub(1);
                parent.children == 0 && parent.lock.is_none()
            }
            None => false,
        };
        if became_leaf {
            if let Some(path) = self.path(worker, p) {
                let mut scratch = Vec::new();
                let m = self
                    .tree
                    .match_prefix(&key(&path), Some(&namespace(worker)), &mut scratch);
                self.tree.inc_lock_ref(m.last_node)?;
                if let Some(parent) = self.held.get_mut(&worker).and_then(|m| m.get_mut(&p)) {
                    parent.lock = Some(m.last_node);
                }
            }
        }
        Ok(true)
    }

    /// Evicts every page no worker holds.
    fn evict_unheld(&mut self) -> Result<(), KvIndexError> {
        let n = self.tree.evictable_size();
        if let (true, Some(pool)) = (n > 0, self.pool.as_mut()) {
            self.tree.evict(n, pool)?;
        }
        Ok(())
    }

    /// Inserts the chain `hashes` after `parent` for `worker` and locks each new page.
    fn store(
        &mut self,
        worker: WorkerId,
        hashes: &[i64],
        parent: Option<i64>,
    ) -> Result<(), KvIndexError> {
        let mut path = match parent {
            None => Vec::new(),
            Some(p) => match self.path(worker, p) {
                Some(path) => path,
                None => {
                    self.unplaced += hashes.len() as u64;
                    return Ok(());
                }
            },
        };
        let first = path.len();
        path.extend_from_slice(hashes);
        let key = key(&path);
        let ns = namespace(worker);
        let pool = match &mut self.pool {
            Some(p) => p,
            None => self.pool.insert(
                PagedAllocator::new(INDEX_SLOTS, 2).map_err(radix_cache::RadixCacheError::from)?,
            ),
        };
        let mut slots: Vec<Slot> = Vec::new();
        pool.alloc(key.len(), &mut slots)
            .map_err(|_| KvIndexError::Full(INDEX_SLOTS / 2))?;
        let r = self
            .tree
            .insert(&key, Some(&ns), &slots, InsertOptions::default())?;
        let kept = r.prefix_len..r.prefix_len + r.inserted;
        let spare: Vec<Slot> = slots[..kept.start]
            .iter()
            .chain(&slots[kept.end..])
            .copied()
            .collect();
        pool.free(&spare)
            .map_err(radix_cache::RadixCacheError::from)?;
        let held = self.held.entry(worker).or_default();
        let mut leaf = None;
        for i in first..path.len() {
            let h = path[i];
            if held.contains_key(&h) {
                continue;
            }
            let parent = i.checked_sub(1).map(|j| path[j]);
            held.insert(
                h,
                Held {
                    parent,
                    children: 0,
                    lock: None,
                },
            );
            if let Some(p) = parent.and_then(|p| held.get_mut(&p)) {
                p.children += 1;
                if let Some(node) = p.lock.take() {
                    // The new page's lock (below) protects it from now on.
                    self.tree.dec_lock_ref(node)?;
                }
            }
            leaf = Some(i);
        }
        // The chain's last new page is its only new leaf: it locks the node ending at it (for
        // the key's last page, the node `insert` returned).
        if let Some(i) = leaf {
            let node = if i + 1 == path.len() {
                r.last_node
            } else {
                let mut scratch = Vec::new();
                self.tree
                    .match_prefix(&key[..2 * (i + 1)], Some(&ns), &mut scratch)
                    .last_node
            };
            if let Some(page) = held.get_mut(&path[i]).filter(|p| p.children == 0) {
                self.tree.inc_lock_ref(node)?;
                page.lock = Some(node);
            }
        }
        Ok(())
    }

    /// Checks that the tree holds exactly the held pages: every held page's path matches in
    /// full, and the tree holds no more tokens than that (for tests).
    pub fn check(&self) -> Result<(), String> {
        let mut pages = 0;
        for (&w, held) in &self.held {
            for &h in held.keys() {
                let path = self.path(w, h).ok_or(format!("{h} of {w:?} has no path"))?;
                if self.matched_pages(w, &path) != path.len() {
                    return Err(format!("{h} of {w:?} is not in the tree"));
                }
            }
            pages += held.len();
        }
        let tokens = self.tree.total_size();
        if tokens != 2 * pages {
            return Err(format!("the tree holds {tokens} symbols for {pages} pages"));
        }
        self.tree.check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{block_ids, stored_pages};
    use super::*;

    const P: usize = 4;

    fn removed(ids: &[i64]) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: ids.to_vec(),
        }
    }

    /// Leaves lock, inner pages do not: stores, branch points, leaf-first removals (each
    /// making the parent a leaf) and a clear leave the tree holding exactly the held pages.
    #[test]
    fn only_held_leaves_lock_and_the_tree_follows_stores_and_removals() {
        let (w0, w1) = (WorkerId(0), WorkerId(1));
        let a: Vec<u32> = (0..32).collect();
        let mut b = a[..20].to_vec();
        b.extend(100..112);
        let (ia, ib) = (block_ids(&a, P), block_ids(&b, P));
        let mut ix = KvIndex::default();
        // A long chain in two events: the second extends the first's leaf.
        ix.apply(w0, &[stored_pages(&a, 0, 5, P), stored_pages(&a, 5, 8, P)])
            .unwrap();
        ix.check().unwrap();
        assert_eq!(ix.matched_pages(w0, &ia), 8);
        let locks = |ix: &KvIndex, w| ix.held[&w].values().filter(|h| h.lock.is_some()).count();
        assert_eq!(locks(&ix, w0), 1, "one leaf, one lock");
        // A branch after page 5 of A: two leaves.
        ix.apply(w0, &[stored_pages(&b, 5, 8, P)]).unwrap();
        ix.check().unwrap();
        assert_eq!((ix.matched_pages(w0, &ib), locks(&ix, w0)), (8, 2));
        // Another worker's copy of A's first pages is its own.
        ix.apply(w1, &[stored_pages(&a, 0, 3, P)]).unwrap();
        ix.check().unwrap();
        assert_eq!(ix.matched_pages(w1, &ia), 3);
        // Leaf-first removals: B's tail, then A's last three pages, page by page.
        ix.apply(w0, &[removed(&ib[5..8])]).unwrap();
        ix.check().unwrap();
        assert_eq!(
            (ix.matched_pages(w0, &ib), ix.matched_pages(w0, &ia)),
            (5, 8)
        );
        for i in (5..8).rev() {
            ix.apply(w0, &[removed(&ia[i..i + 1])]).unwrap();
            ix.check().unwrap();
            assert_eq!(ix.matched_pages(w0, &ia), i);
            assert_eq!(locks(&ix, w0), 1, "the parent became the leaf");
        }
        // A removal of a page the worker does not hold changes nothing.
        ix.apply(w0, &[removed(&ib[6..7])]).unwrap();
        ix.check().unwrap();
        // Store again on the shortened chain, then clear the worker.
        ix.apply(w0, &[stored_pages(&b, 5, 8, P)]).unwrap();
        ix.check().unwrap();
        assert_eq!(ix.matched_pages(w0, &ib), 8);
        ix.apply(w0, &[KvEvent::AllBlocksCleared]).unwrap();
        ix.check().unwrap();
        assert_eq!((ix.held_pages(w0), ix.matched_pages(w0, &ia)), (0, 0));
        assert_eq!(ix.matched_pages(w1, &ia), 3);
        ix.remove_worker(w1).unwrap();
        ix.check().unwrap();
        assert_eq!(ix.tree.total_size(), 0);
    }
}
