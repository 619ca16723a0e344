//! The `kv_events` policy's index of which worker holds which pages ([`KvIndex`]), rebuilt
//! from the workers' KV events — one `radix_cache::RadixCache`, not a tree of our own.
//!
//! The tree's "tokens" are block hashes: a page's SGLang block id (the chained SHA-256, as an
//! `i64`) is two `u32` symbols, so a tree page (page size 2) is one KV page, and a path from
//! the root is a chain of pages. Each worker is one namespace of the tree (`extra_key`
//! `worker-<id>`), so the longest cached prefix of a request on a worker is one
//! `peek_prefix_len` of its chained block ids in that worker's namespace.
//!
//! Lifetime of a page: `BlockStored` inserts it under its parent's path and locks the node
//! that ends at it (`inc_lock_ref`, which also locks its ancestors); `BlockRemoved` and
//! `AllBlocksCleared` unlock it, and everything no longer locked is evicted at once. So the
//! tree holds exactly the pages the workers reported and did not remove (a worker evicts
//! leaves first, so a page's ancestors outlive it). Slots are meaningless here: they come
//! from a pool of [`INDEX_SLOTS`] and go back when the tree evicts; a full pool is
//! [`KvIndexError::Full`].
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

/// A page a worker holds: its parent page and the tree node that ends at it.
#[derive(Debug, Clone, Copy)]
struct Held {
    parent: Option<i64>,
    node: NodeId,
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
                    for h in block_hashes {
                        if let Some(held) = self.held.get_mut(&worker).and_then(|m| m.remove(h)) {
                            self.tree.dec_lock_ref(held.node)?;
                            removed = true;
                        }
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
        for held in pages.values() {
            self.tree.dec_lock_ref(held.node)?;
        }
        Ok(!pages.is_empty())
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
        let mut scratch = Vec::new();
        for i in first..path.len() {
            let h = path[i];
            if self.held.get(&worker).is_some_and(|m| m.contains_key(&h)) {
                continue;
            }
            scratch.clear();
            let m = self
                .tree
                .match_prefix(&key[..2 * (i + 1)], Some(&ns), &mut scratch);
            self.tree.inc_lock_ref(m.last_node)?;
            let parent = i.checked_sub(1).map(|j| path[j]);
            self.held.entry(worker).or_default().insert(
                h,
                Held {
                    parent,
                    node: m.last_node,
                },
            );
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
