//! A toy prefix cache written against `radix_cache::PrefixCache` alone, designed like vLLM's
//! block table rather than a radix tree: every full page of a cached key is one node, found in
//! a `HashMap` by (parent node, the page's tokens). A match walks the key page by page; an
//! insert adds the missing pages; a lock counts along the path to the root; eviction removes
//! unlocked leaf pages least recently used first on a logical clock (one tick per operation).
//! Nothing is split (a node is always one page) and there is no eviction-policy type.

use std::collections::HashMap;

use kv_pool::{Allocator, Owner, OwnershipCheck, ReqToTokenPool, Slot};
use radix_cache::events::{digest_to_block_id, page_digest, PageDigest};
use radix_cache::{
    InsertOptions, InsertResult, KvEvent, MatchResult, NodeId, PrefixCache, PrefixPeek,
    RadixCacheError, ReqView, Result,
};

/// One page of a cached key, or a namespace's root (no tokens, no parent).
#[derive(Debug, Clone)]
struct PageNode {
    parent: Option<u32>,
    tokens: Vec<u32>,
    slots: Vec<Slot>,
    /// SGLang's chained page digest (the block hash of the KV events); unused on a root.
    digest: PageDigest,
    /// Live children (a node with none is a leaf).
    children: usize,
    /// Locks through this node (each lock counts on every node from its node to the root).
    lock_ref: usize,
    last_access: u64,
    /// Bumped when the entry is reused, so a handle to an evicted page is refused.
    generation: u32,
    live: bool,
}

/// The hashed-page cache. Page nodes sit in `nodes` (freed entries reused); `pages` maps
/// (parent, tokens) to a live page node; `roots` maps a namespace to its root node.
#[derive(Debug)]
pub struct HashedPages {
    page_size: u32,
    nodes: Vec<PageNode>,
    reusable: Vec<u32>,
    pages: HashMap<(u32, Vec<u32>), u32>,
    roots: HashMap<Option<String>, u32>,
    clock: u64,
    evictable: usize,
    protected: usize,
    events: Vec<KvEvent>,
    /// A deliberate bug for the negative test: evictions publish no `BlockRemoved`.
    silent_evictions: bool,
}

impl HashedPages {
    /// An empty cache of `page_size`-token pages (0 is taken as 1), KV events on.
    pub fn new(page_size: u32) -> Self {
        HashedPages {
            page_size: page_size.max(1),
            nodes: Vec::new(),
            reusable: Vec::new(),
            pages: HashMap::new(),
            roots: HashMap::new(),
            clock: 0,
            evictable: 0,
            protected: 0,
            events: Vec::new(),
            silent_evictions: false,
        }
    }

    /// The same cache with a bug the suite must catch: evicted pages are never reported.
    pub fn with_silent_evictions(mut self) -> Self {
        self.silent_evictions = true;
        self
    }

    fn p(&self) -> usize {
        self.page_size as usize
    }

    fn id(&self, i: u32) -> NodeId {
        NodeId {
            index: i,
            generation: self.nodes[i as usize].generation,
        }
    }

    fn resolve(&self, id: NodeId) -> Result<u32> {
        match self.nodes.get(id.index as usize) {
            Some(n) if n.live && n.generation == id.generation => Ok(id.index),
            _ => Err(RadixCacheError::StaleNode(id)),
        }
    }

    fn new_node(&mut self, parent: Option<u32>, tokens: &[u32], slots: &[Slot]) -> u32 {
        let digest = match parent {
            Some(p) if self.nodes[p as usize].parent.is_some() => {
                page_digest(Some(&self.nodes[p as usize].digest), tokens)
            }
            _ => page_digest(None, tokens),
        };
        let node = PageNode {
            parent,
            tokens: tokens.to_vec(),
            slots: slots.to_vec(),
            digest,
            children: 0,
            lock_ref: 0,
            last_access: self.clock,
            generation: 0,
            live: true,
        };
        match self.reusable.pop() {
            Some(i) => {
                let generation = self.nodes[i as usize].generation + 1;
                self.nodes[i as usize] = PageNode { generation, ..node };
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() as u32 - 1
            }
        }
    }

    fn root_index(&mut self, extra_key: Option<&str>) -> u32 {
        if let Some(&r) = self.roots.get(&extra_key.map(str::to_owned)) {
            return r;
        }
        let r = self.new_node(None, &[], &[]);
        self.roots.insert(extra_key.map(str::to_owned), r);
        r
    }

    /// The page nodes matching `key`'s full pages from `root`, in order.
    fn walk(&self, root: u32, key: &[u32]) -> Vec<u32> {
        let mut path = Vec::new();
        let mut at = root;
        for page in key.chunks_exact(self.p()) {
            let Some(&child) = self.pages.get(&(at, page.to_vec())) else {
                break;
            };
            path.push(child);
            at = child;
        }
        path
    }

    fn touch(&mut self, path: &[u32]) {
        for &i in path {
            self.nodes[i as usize].last_access = self.clock;
        }
    }

    fn insert_at(&mut self, root: u32, key: &[u32], slots: &[Slot]) -> InsertResult {
        self.clock += 1;
        let p = self.p();
        let path = self.walk(root, key);
        self.touch(&path);
        let prefix_len = path.len() * p;
        let mut at = child_or(&path, root);
        let (mut hashes, mut tokens) = (Vec::new(), Vec::new());
        for (page, page_slots) in key[prefix_len..]
            .chunks_exact(p)
            .zip(slots[prefix_len..].chunks_exact(p))
        {
            let child = self.new_node(Some(at), page, page_slots);
            self.pages.insert((at, page.to_vec()), child);
            self.nodes[at as usize].children += 1;
            hashes.push(digest_to_block_id(&self.nodes[child as usize].digest));
            tokens.extend_from_slice(page);
            at = child;
        }
        self.evictable += tokens.len();
        if !hashes.is_empty() {
            let parent = path
                .last()
                .map(|&i| digest_to_block_id(&self.nodes[i as usize].digest));
            self.events.push(KvEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: parent,
                token_ids: tokens.clone(),
                block_size: self.page_size,
            });
        }
        InsertResult {
            prefix_len,
            inserted: tokens.len(),
            last_node: self.id(at),
        }
    }

    /// Adds `delta` (±1) to the lock count of every node from `node` to its root, moving
    /// pages between evictable and protected as counts leave or reach zero.
    fn lock_path(&mut self, node: u32, delta: isize) -> usize {
        let (p, mut changed, mut at) = (self.p(), 0, node);
        while let Some(parent) = self.nodes[at as usize].parent {
            let n = &mut self.nodes[at as usize];
            let was = n.lock_ref;
            n.lock_ref = was.checked_add_signed(delta).expect("checked before");
            if (was == 0) != (n.lock_ref == 0) {
                changed += p;
            }
            at = parent;
        }
        let (from, to) = if delta > 0 {
            (&mut self.evictable, &mut self.protected)
        } else {
            (&mut self.protected, &mut self.evictable)
        };
        *from -= changed;
        *to += changed;
        changed
    }

    /// Removes one page node (an unlocked leaf) and returns its slots.
    fn remove_leaf(&mut self, i: u32) -> Vec<Slot> {
        let parent = self.nodes[i as usize].parent.expect("a page, not a root");
        let n = &mut self.nodes[i as usize];
        n.live = false;
        let tokens = std::mem::take(&mut n.tokens);
        let slots = std::mem::take(&mut n.slots);
        self.pages.remove(&(parent, tokens));
        self.nodes[parent as usize].children -= 1;
        self.reusable.push(i);
        self.evictable -= slots.len();
        slots
    }

    /// Refuses to unlock a page node whose count is zero. Its ancestors may still be locked
    /// (by deeper paths), but no lock is held through it, so the whole path is checked by it.
    fn check_locked(&self, i: u32) -> Result<()> {
        let n = &self.nodes[i as usize];
        if n.parent.is_some() && n.lock_ref == 0 {
            return Err(RadixCacheError::LockUnderflow(self.id(i)));
        }
        Ok(())
    }

    /// Checks a request view: lengths, and a live last node the request holds a lock on.
    fn check_view(&self, req: &ReqView<'_>) -> Result<u32> {
        req.check_lengths(self.page_size)?;
        let last = self.resolve(req.state.last_node)?;
        self.check_locked(last)?;
        Ok(last)
    }

    /// Inserts the request's committed full pages and frees its own copies of the pages that
    /// were cached already beyond its protected prefix; returns the namespace's root.
    fn insert_committed(
        &mut self,
        req: &ReqView<'_>,
        slots: &[Slot],
        alloc: &mut dyn Allocator,
    ) -> Result<u32> {
        let aligned = req.committed_len / self.p() * self.p();
        let root = self.root_index(req.extra_key);
        let ins = self.insert_at(root, &req.tokens[..aligned], &slots[..aligned]);
        let protected = req.state.cache_protected_len;
        if ins.prefix_len > protected {
            alloc.free(&slots[protected..ins.prefix_len])?;
        }
        Ok(root)
    }
}

/// The last node of `path`, or `root` when the path is empty.
fn child_or(path: &[u32], root: u32) -> u32 {
    path.last().copied().unwrap_or(root)
}

impl PrefixCache for HashedPages {
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
        self.clock += 1;
        let root = self.root_index(extra_key);
        let path = self.walk(root, key);
        self.touch(&path);
        for &i in &path {
            out.extend_from_slice(&self.nodes[i as usize].slots);
        }
        let last_node = self.id(child_or(&path, root));
        // No host tier: everything matched is on device.
        MatchResult {
            len: path.len() * self.p(),
            last_node,
            host_hit_len: 0,
            last_host_node: last_node,
        }
    }

    fn peek_prefix(&self, key: &[u32], extra_key: Option<&str>) -> PrefixPeek {
        let Some(&root) = self.roots.get(&extra_key.map(str::to_owned)) else {
            return PrefixPeek::default();
        };
        let path = self.walk(root, key);
        PrefixPeek {
            len: path.len() * self.p(),
            deepest: path.last().map(|&i| self.id(i)),
        }
    }

    fn parent(&self, node: NodeId) -> Option<NodeId> {
        let parent = self.nodes[self.resolve(node).ok()? as usize].parent?;
        self.nodes[parent as usize]
            .parent
            .is_some()
            .then(|| self.id(parent))
    }

    fn insert(
        &mut self,
        key: &[u32],
        extra_key: Option<&str>,
        slots: &[Slot],
        _opts: InsertOptions,
    ) -> Result<InsertResult> {
        if slots.len() != key.len() {
            return Err(RadixCacheError::LengthMismatch {
                what: "insert slots",
                expected: key.len(),
                got: slots.len(),
            });
        }
        let root = self.root_index(extra_key);
        let aligned = key.len() / self.p() * self.p();
        Ok(self.insert_at(root, &key[..aligned], &slots[..aligned]))
    }

    fn cache_unfinished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &mut ReqToTokenPool,
        alloc: &mut dyn Allocator,
        _chunked: bool,
    ) -> Result<()> {
        let old = self.check_view(&req)?;
        let (committed, protected) = (req.committed_len, req.state.cache_protected_len);
        let aligned = committed / self.p() * self.p();
        let slots = rows.read(req.row, committed)?.to_vec();
        let root = self.insert_committed(&req, &slots, alloc)?;
        // The cache's own slots for the whole aligned prefix replace the request's copies.
        let path = self.walk(root, &req.tokens[..aligned]);
        let mut canonical: Vec<Slot> = path
            .iter()
            .flat_map(|&i| self.nodes[i as usize].slots.iter().copied())
            .collect();
        rows.write(req.row, protected, &canonical[protected..aligned])?;
        let last = child_or(&path, root);
        self.lock_path(last, 1);
        self.lock_path(old, -1);
        canonical.extend_from_slice(&slots[aligned..committed]);
        req.state.cache_protected_len = aligned;
        req.state.last_node = self.id(last);
        req.state.prefix_slots = canonical;
        Ok(())
    }

    fn cache_finished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &ReqToTokenPool,
        alloc: &mut dyn Allocator,
        insert: bool,
    ) -> Result<()> {
        let old = self.check_view(&req)?;
        let committed = req.committed_len;
        let slots = rows.read(req.row, committed)?.to_vec();
        let owned_from = if insert {
            self.insert_committed(&req, &slots, alloc)?;
            committed / self.p() * self.p()
        } else {
            req.state.cache_protected_len
        };
        if committed > owned_from {
            alloc.free(&slots[owned_from..committed])?;
        }
        self.lock_path(old, -1);
        let root = self.root_index(req.extra_key);
        req.state.cache_protected_len = 0;
        req.state.last_node = self.id(root);
        req.state.prefix_slots.clear();
        Ok(())
    }

    fn evict(&mut self, num_tokens: usize, alloc: &mut dyn Allocator) -> Result<usize> {
        let (mut freed, mut slots, mut removed) = (0, Vec::new(), Vec::new());
        while freed < num_tokens {
            // The least recently used unlocked leaf page (ties: lowest index).
            let victim = (0..self.nodes.len() as u32)
                .filter(|&i| {
                    let n = &self.nodes[i as usize];
                    n.live && n.parent.is_some() && n.children == 0 && n.lock_ref == 0
                })
                .min_by_key(|&i| (self.nodes[i as usize].last_access, i));
            let Some(victim) = victim else { break };
            removed.push(digest_to_block_id(&self.nodes[victim as usize].digest));
            slots.extend(self.remove_leaf(victim));
            freed += self.p();
        }
        alloc.free(&slots)?;
        if !removed.is_empty() && !self.silent_evictions {
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: removed,
            });
        }
        Ok(freed)
    }

    fn inc_lock_ref(&mut self, node: NodeId) -> Result<usize> {
        let i = self.resolve(node)?;
        Ok(self.lock_path(i, 1))
    }

    fn dec_lock_ref(&mut self, node: NodeId) -> Result<usize> {
        let i = self.resolve(node)?;
        self.check_locked(i)?;
        Ok(self.lock_path(i, -1))
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
        let slots: Vec<Slot> = self
            .nodes
            .iter()
            .filter(|n| n.live && n.parent.is_some())
            .flat_map(|n| n.slots.iter().copied())
            .collect();
        alloc.free(&slots)?;
        for i in 0..self.nodes.len() as u32 {
            let n = &self.nodes[i as usize];
            if n.live && n.parent.is_some() {
                self.remove_leaf(i);
            }
        }
        self.events.push(KvEvent::AllBlocksCleared);
        Ok(())
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn claim_ownership(&self, check: &mut OwnershipCheck) {
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && n.parent.is_some() {
                check.claim(Owner::TreeNode(i as u64), &n.slots);
            }
        }
    }

    fn check_invariants(&self) -> std::result::Result<(), String> {
        let (mut evictable, mut protected) = (0, 0);
        let mut children = vec![0; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            let Some(parent) = n.parent.filter(|_| n.live) else {
                continue;
            };
            children[parent as usize] += 1;
            if n.slots.len() != self.p() || n.tokens.len() != self.p() {
                return Err(format!("page node {i} holds {} tokens", n.tokens.len()));
            }
            if self.pages.get(&(parent, n.tokens.clone())) != Some(&(i as u32)) {
                return Err(format!("page node {i} is not in the page map"));
            }
            if n.lock_ref > self.nodes[parent as usize].lock_ref
                && self.nodes[parent as usize].parent.is_some()
            {
                return Err(format!("page node {i} has more locks than its parent"));
            }
            *if n.lock_ref > 0 {
                &mut protected
            } else {
                &mut evictable
            } += self.p();
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && n.children != children[i] {
                return Err(format!(
                    "node {i} counts {} children, has {}",
                    n.children, children[i]
                ));
            }
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return Err(format!(
                "sizes: evictable {} protected {}, the nodes say {evictable} and {protected}",
                self.evictable, self.protected
            ));
        }
        if self.pages.len() * self.p() != evictable + protected {
            return Err("the page map holds a dead node".into());
        }
        Ok(())
    }
}
