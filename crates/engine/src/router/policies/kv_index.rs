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
//! its removed leaves and then locks each parent left a leaf, once per event; `AllBlocksCleared` unlocks
//! them all; everything no longer locked is evicted at once. So the tree holds exactly the
//! pages the workers reported and did not remove (a worker evicts leaves first, so a page's
//! ancestors outlive it), and an event costs one walk of its chain, not one per page (a
//! Mooncake prompt is hundreds of pages). Slots are meaningless here: they come from a pool
//! that starts at [`INDEX_SLOTS_START`] and doubles as the workers hold more pages (slots name
//! no memory, so growing costs only the pool's free list: 4 bytes a page), up to
//! [`INDEX_SLOTS_MAX`] (a billion pages); beyond it is [`KvIndexError::Full`]. They go back when
//! the tree evicts.
//!
//! A `BlockStored` whose parent the index does not know (the router subscribed late, or
//! missed a batch) cannot be placed; its pages are counted in [`KvIndex::unplaced`] and left
//! out (routing then underestimates that worker's cache, never overestimates it).

use std::collections::HashMap;

use kv_pool::{Allocator, PagedAllocator, Slot};
use radix_cache::events::{chain_digests, digest_to_block_id};
use radix_cache::{BuiltinPolicy, InsertOptions, KvEvent, NodeId, PrefixCache, RadixCache};

use super::WorkerId;

/// Slots of the index's pool when it is made: two per indexed page (32 Ki pages).
pub const INDEX_SLOTS_START: usize = 1 << 16;

/// The most slots the index's pool grows to (slot ids are `u32`): 2^30 pages.
pub const INDEX_SLOTS_MAX: usize = 1 << 31;

/// What can go wrong while indexing events.
#[derive(Debug, thiserror::Error)]
pub enum KvIndexError {
    /// The index would hold more than [`INDEX_SLOTS_MAX`] / 2 pages.
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
    /// Per worker, the path (root first) of the last chain it stored, cut where a page of it
    /// was removed: every page in it is held, so a page's path is a prefix of it whenever the
    /// page is in it (the common case: a request's pages extend the chain its prompt stored),
    /// found by a scan instead of a walk of the held map.
    tails: HashMap<WorkerId, Vec<i64>>,
    unplaced: u64,
}

impl Default for KvIndex {
    fn default() -> Self {
        KvIndex {
            tree: RadixCache::new(2, BuiltinPolicy::Lru),
            pool: None,
            block_size: None,
            held: HashMap::new(),
            tails: HashMap::new(),
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
        if let Some(i) = self
            .tails
            .get(&worker)
            .and_then(|t| t.iter().rposition(|&h| h == page))
        {
            return Some(self.tails[&worker][..=i].to_vec());
        }
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
                    removed |= self.remove(worker, block_hashes)?;
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
        self.tails.remove(&worker);
        let pages = std::mem::take(self.held.entry(worker).or_default());
        for node in pages.values().filter_map(|h| h.lock) {
            self.tree.dec_lock_ref(node)?;
        }
        Ok(!pages.is_empty())
    }

    /// Forgets the pages `hashes` of `worker` (one `BlockRemoved`): unlocks each removed leaf,
    /// then locks each parent left a leaf, once, after the whole event (a worker evicts a chain
    /// leaf first, so locking each parent page by page would walk the chain once per page);
    /// whether the worker held any of them.
    fn remove(&mut self, worker: WorkerId, hashes: &[i64]) -> Result<bool, KvIndexError> {
        let Some(held) = self.held.get_mut(&worker) else {
            return Ok(false);
        };
        let mut any = false;
        let mut bare = Vec::new();
        for h in hashes {
            let Some(page) = held.remove(h) else {
                continue;
            };
            any = true;
            if let Some(node) = page.lock {
                self.tree.dec_lock_ref(node)?;
            }
            if let Some(parent) = page.parent.and_then(|p| held.get_mut(&p)) {
                parent.children = parent.children.saturating_sub(1);
                if parent.children == 0 {
                    bare.push(page.parent);
                }
            }
        }
        if any {
            if let Some(tail) = self.tails.get_mut(&worker) {
                let gone: std::collections::HashSet<i64> = hashes.iter().copied().collect();
                if let Some(i) = tail.iter().position(|h| gone.contains(h)) {
                    tail.truncate(i);
                }
            }
        }
        for p in bare.into_iter().flatten() {
            self.lock_leaf(worker, p)?;
        }
        Ok(any)
    }

    /// Locks the tree node ending at `worker`'s page `p` if `p` is held, has no held child and
    /// is not locked yet (a leaf of the worker's pages).
    fn lock_leaf(&mut self, worker: WorkerId, p: i64) -> Result<(), KvIndexError> {
        let leaf = self
            .held
            .get(&worker)
            .and_then(|m| m.get(&p))
            .is_some_and(|h| h.children == 0 && h.lock.is_none());
        if !leaf {
            return Ok(());
        }
        if let Some(path) = self.path(worker, p) {
            let mut scratch = Vec::new();
            let m = self
                .tree
                .match_prefix(&key(&path), Some(&namespace(worker)), &mut scratch);
            self.tree.inc_lock_ref(m.last_node)?;
            if let Some(page) = self.held.get_mut(&worker).and_then(|m| m.get_mut(&p)) {
                page.lock = Some(m.last_node);
            }
            // A leaf-first eviction goes on with `p` and its parent: their paths are prefixes.
            self.tails.insert(worker, path);
        }
        Ok(())
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
                PagedAllocator::new(INDEX_SLOTS_START, 2)
                    .map_err(radix_cache::RadixCacheError::from)?,
            ),
        };
        if pool.available_size() < key.len() {
            let want = pool.size() - pool.available_size() + key.len();
            let size = want.next_power_of_two().max(2 * pool.size());
            if want > INDEX_SLOTS_MAX {
                return Err(KvIndexError::Full(INDEX_SLOTS_MAX / 2));
            }
            pool.grow(size.min(INDEX_SLOTS_MAX))
                .map_err(radix_cache::RadixCacheError::from)?;
        }
        let mut slots: Vec<Slot> = Vec::new();
        pool.alloc(key.len(), &mut slots)
            .map_err(|_| KvIndexError::Full(INDEX_SLOTS_MAX / 2))?;
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
        self.tails.insert(worker, path);
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

    /// A removal that is not leaf-first (an inner page of the last stored chain, its
    /// descendants still held) cuts the remembered chain there: the descendants' paths are
    /// unknown from then on, so a store under them is unplaced rather than put under a path
    /// the worker no longer holds; a store on the remaining prefix is placed.
    #[test]
    fn an_inner_removal_cuts_the_remembered_chain() {
        let w = WorkerId(0);
        let a: Vec<u32> = (0..40).collect();
        let ia = block_ids(&a, P);
        let mut ix = KvIndex::default();
        ix.apply(w, &[stored_pages(&a, 0, 6, P)]).unwrap();
        ix.apply(w, &[removed(&ia[2..3])]).unwrap();
        assert_eq!(ix.held_pages(w), 5);
        // Page 6 would hang under page 5, whose chain passes through the removed page 2.
        ix.apply(w, &[stored_pages(&a, 6, 7, P)]).unwrap();
        assert_eq!((ix.unplaced(), ix.held_pages(w)), (1, 5));
        // Page 2 again, under page 1 (still held): placed, and the chain is whole again.
        ix.apply(w, &[stored_pages(&a, 2, 3, P)]).unwrap();
        assert_eq!((ix.unplaced(), ix.held_pages(w)), (1, 6));
        ix.check().unwrap();
        assert_eq!(ix.matched_pages(w, &ia), 6);
    }

    /// The pool grows past its first size (32 Ki pages) as a worker holds more pages — 40
    /// chains of 1,000 pages — and every chain stays matched in full.
    #[test]
    fn the_pool_grows_with_the_pages_held() {
        let w = WorkerId(3);
        let mut ix = KvIndex::default();
        let chains: Vec<Vec<u32>> = (0..40u32)
            .map(|c| (0..4000).map(|t| c * 1_000_000 + t).collect())
            .collect();
        for toks in &chains {
            for from in (0..1000).step_by(250) {
                ix.apply(w, &[stored_pages(toks, from, from + 250, P)])
                    .unwrap();
            }
        }
        assert_eq!(ix.held_pages(w), 40_000);
        assert_eq!(ix.tree.total_size(), 80_000);
        for toks in &chains {
            assert_eq!(ix.matched_pages(w, &block_ids(toks, P)), 1000);
        }
        assert!(ix.pool.as_ref().unwrap().size() >= 80_000);
        ix.apply(w, &[KvEvent::AllBlocksCleared]).unwrap();
        assert_eq!(ix.tree.total_size(), 0);
        ix.tree.check_invariants().unwrap();
    }
}
