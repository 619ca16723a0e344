//! [`RadixCache`]: SGLang's radix tree (`mem_cache/radix_cache.py`) at page size 1 or `P`.
//!
//! Layout: nodes in an arena (`Vec<Node>`, freed entries reused, handles carry a generation);
//! every node's key tokens and slot values are ranges of two parallel arenas (`tokens`,
//! `slots`), so a split only divides a range and a partial eviction only shortens one. Dead
//! ranges are reclaimed by compaction once they outweigh the live ones. A node's children are a
//! hash map from its first page (the token itself at `P = 1`, a hash of the page otherwise,
//! verified on lookup; colliding pages go to a short overflow list). Each namespace has its own
//! root, so namespaces never share nodes. The evictable leaves sit in a `BTreeSet` ordered by
//! (policy key, node index).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::hash::Hasher;

use kv_pool::{floor_to_page, Allocator, Owner, OwnershipCheck, ReqToTokenPool, Slot};
use rustc_hash::{FxHashMap, FxHasher};

use crate::error::{RadixCacheError, Result};
use crate::events::{digest_to_block_id, page_digest, KvEvent, PageDigest};
use crate::policy::{path_hash, EvictionKey, EvictionPolicy, NodeStats, PATH_HASH_SEED};
use crate::request::ReqView;
use crate::{InsertOptions, InsertResult, MatchResult, NodeId, PrefixCache};

const NONE: u32 = u32::MAX;

#[derive(Debug, Default, Clone)]
struct Children {
    by_first_page: FxHashMap<u64, u32>,
    /// Children whose first-page hash collides with another child's (practically never).
    overflow: Vec<u32>,
}

impl Children {
    fn is_empty(&self) -> bool {
        self.by_first_page.is_empty() && self.overflow.is_empty()
    }
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_first_page
            .values()
            .copied()
            .chain(self.overflow.iter().copied())
    }
}

#[derive(Debug, Clone)]
struct Node {
    generation: u32,
    live: bool,
    parent: u32,
    /// Offset of the node's tokens and slots in the arenas.
    start: usize,
    len: usize,
    children: Children,
    lock_ref: u32,
    last_access: u64,
    creation: u64,
    hit_count: u32,
    priority: i64,
    /// Tokens between the root and the node's first token.
    depth: usize,
    /// Path hash of everything before the node, and through its last token (only when the
    /// policy wants path hashes).
    start_hash: u64,
    end_hash: u64,
    /// SGLang block digests of the node's pages (only when events are enabled).
    digests: Vec<PageDigest>,
    /// The node's key in the evictable index, if it is in it.
    indexed: Option<EvictionKey>,
}

impl Node {
    fn root(generation: u32) -> Node {
        Node {
            generation,
            live: true,
            parent: NONE,
            start: 0,
            len: 0,
            children: Children::default(),
            lock_ref: 1,
            last_access: 0,
            creation: 0,
            hit_count: 0,
            priority: 0,
            depth: 0,
            start_hash: PATH_HASH_SEED,
            end_hash: PATH_HASH_SEED,
            digests: Vec::new(),
            indexed: None,
        }
    }
}

/// SGLang's radix prefix cache, with an incremental eviction index and partial eviction.
#[derive(Debug)]
pub struct RadixCache {
    page_size: u32,
    policy: Box<dyn EvictionPolicy>,
    track_paths: bool,
    events_enabled: bool,
    partial_eviction: bool,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// Namespace name → root node index; the default namespace is `None`.
    roots: FxHashMap<Option<String>, u32>,
    tokens: Vec<u32>,
    slots: Vec<Slot>,
    dead_tokens: usize,
    index: BTreeSet<(EvictionKey, u32)>,
    evictable: usize,
    protected: usize,
    clock: u64,
    events: Vec<KvEvent>,
}

impl RadixCache {
    /// An empty cache with page size `page_size` (0 is taken as 1) and eviction `policy`.
    /// Partial eviction is on; events are off.
    pub fn new(page_size: u32, policy: Box<dyn EvictionPolicy>) -> Self {
        let track_paths = policy.name() == crate::policy::Belady::NAME;
        let mut cache = RadixCache {
            page_size: page_size.max(1),
            policy,
            track_paths,
            events_enabled: false,
            partial_eviction: true,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: FxHashMap::default(),
            tokens: Vec::new(),
            slots: Vec::new(),
            dead_tokens: 0,
            index: BTreeSet::new(),
            evictable: 0,
            protected: 0,
            clock: 0,
            events: Vec::new(),
        };
        cache.root_index(None);
        cache
    }

    /// Turns KV events on or off (SGLang's `--kv-events-config`).
    pub fn with_events(mut self, on: bool) -> Self {
        self.events_enabled = on;
        self
    }

    /// Whole-node eviction as SGLang (`false`) or partial eviction of a leaf's tail (`true`,
    /// the default).
    pub fn with_partial_eviction(mut self, on: bool) -> Self {
        self.partial_eviction = on;
        self
    }

    /// Computes path hashes for the policy even if it is not Belady (for custom policies that
    /// read [`NodeStats::path_hash`]).
    pub fn with_path_hashes(mut self, on: bool) -> Self {
        self.track_paths = on;
        self
    }

    /// The eviction policy's name.
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// The eviction policy (e.g. to advance [`crate::policy::Belady::set_now`]).
    pub fn policy_mut(&mut self) -> &mut dyn EvictionPolicy {
        &mut *self.policy
    }

    /// The logical clock (ticks once per match, insert, lock change and eviction).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Live nodes, roots excluded.
    pub fn node_count(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.live && n.parent != NONE)
            .count()
    }

    /// Evictable leaves currently indexed.
    pub fn evictable_leaves(&self) -> usize {
        self.index.len()
    }

    // ----- node arena ------------------------------------------------------------------------

    fn id(&self, index: u32) -> NodeId {
        NodeId {
            index,
            generation: self.nodes[index as usize].generation,
        }
    }

    fn resolve(&self, id: NodeId) -> Result<u32> {
        match self.nodes.get(id.index as usize) {
            Some(n) if n.live && n.generation == id.generation => Ok(id.index),
            _ => Err(RadixCacheError::StaleNode(id)),
        }
    }

    fn root_index(&mut self, extra_key: Option<&str>) -> u32 {
        if let Some(&r) = self.roots.get(&extra_key.map(str::to_string)) {
            return r;
        }
        let r = self.alloc_node(Node::root(0));
        self.roots.insert(extra_key.map(str::to_string), r);
        r
    }

    fn find_root(&self, extra_key: Option<&str>) -> Option<u32> {
        match extra_key {
            None => self.roots.get(&None).copied(),
            Some(k) => self.roots.get(&Some(k.to_string())).copied(),
        }
    }

    fn alloc_node(&mut self, mut node: Node) -> u32 {
        if let Some(i) = self.free_nodes.pop() {
            node.generation = self.nodes[i as usize].generation.wrapping_add(1);
            self.nodes[i as usize] = node;
            i
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    fn node_tokens(&self, i: u32) -> &[u32] {
        let n = &self.nodes[i as usize];
        &self.tokens[n.start..n.start + n.len]
    }

    fn node_slots(&self, i: u32) -> &[Slot] {
        let n = &self.nodes[i as usize];
        &self.slots[n.start..n.start + n.len]
    }

    fn page_key(&self, page: &[u32]) -> u64 {
        if self.page_size == 1 {
            return page[0] as u64;
        }
        let mut h = FxHasher::default();
        for &t in page {
            h.write_u32(t);
        }
        h.finish()
    }

    fn find_child(&self, parent: u32, page: &[u32]) -> Option<u32> {
        let p = self.page_size as usize;
        let children = &self.nodes[parent as usize].children;
        let matches = |c: u32| self.node_tokens(c)[..p] == *page;
        if let Some(&c) = children.by_first_page.get(&self.page_key(page)) {
            if matches(c) {
                return Some(c);
            }
        }
        children.overflow.iter().copied().find(|&c| matches(c))
    }

    fn add_child(&mut self, parent: u32, child: u32) {
        let p = self.page_size as usize;
        let key = self.page_key(&self.node_tokens(child)[..p]);
        let children = &mut self.nodes[parent as usize].children;
        if let std::collections::hash_map::Entry::Vacant(e) = children.by_first_page.entry(key) {
            e.insert(child);
        } else {
            children.overflow.push(child);
        }
    }

    fn remove_child(&mut self, parent: u32, child: u32) {
        let p = self.page_size as usize;
        let key = self.page_key(&self.node_tokens(child)[..p]);
        let children = &mut self.nodes[parent as usize].children;
        if children.by_first_page.get(&key) == Some(&child) {
            children.by_first_page.remove(&key);
            // Promote a colliding child into the map slot.
            if let Some(pos) = children.overflow.iter().position(|_| true) {
                let other = children.overflow.swap_remove(pos);
                self.add_child(parent, other);
            }
        } else {
            children.overflow.retain(|&c| c != child);
        }
    }

    /// Replaces `old` by `new` among `parent`'s children (same first page).
    fn replace_child(&mut self, parent: u32, old: u32, new: u32) {
        let children = &mut self.nodes[parent as usize].children;
        for c in children
            .by_first_page
            .values_mut()
            .chain(children.overflow.iter_mut())
        {
            if *c == old {
                *c = new;
                return;
            }
        }
        debug_assert!(false, "node {old} is not a child of {parent}");
    }

    // ----- statistics and the evictable index ------------------------------------------------

    fn stats(&self, i: u32) -> NodeStats {
        let n = &self.nodes[i as usize];
        // The path through the node's last page: what partial eviction removes first.
        let path = if self.track_paths { n.end_hash } else { 0 };
        NodeStats {
            last_access: n.last_access,
            creation: n.creation,
            hit_count: n.hit_count,
            priority: n.priority,
            depth: n.depth,
            len: n.len,
            path_hash: path,
        }
    }

    fn is_evictable_leaf(&self, i: u32) -> bool {
        let n = &self.nodes[i as usize];
        n.live && n.parent != NONE && n.lock_ref == 0 && n.children.is_empty()
    }

    /// Re-derives `i`'s place in the evictable index after any change to it.
    fn refresh(&mut self, i: u32) {
        if let Some(old) = self.nodes[i as usize].indexed.take() {
            self.index.remove(&(old, i));
        }
        if self.is_evictable_leaf(i) {
            let stats = self.stats(i);
            let key = self.policy.key(&stats);
            self.index.insert((key, i));
            self.nodes[i as usize].indexed = Some(key);
        }
    }

    fn touch(&mut self, i: u32, hit: bool, priority: Option<i64>) {
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
        if n.indexed.is_some() {
            self.refresh(i);
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    // ----- matching, splitting, inserting ----------------------------------------------------

    /// Longest common prefix of two token slices, compared 32 tokens at a time.
    fn lcp(a: &[u32], b: &[u32]) -> usize {
        const CHUNK: usize = 32;
        let n = a.len().min(b.len());
        let mut i = 0;
        while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
            i += CHUNK;
        }
        while i < n && a[i] == b[i] {
            i += 1;
        }
        i
    }

    /// Splits `child` after its first `at` tokens (`0 < at < len`, a multiple of `P`); returns
    /// the new upper node, which takes the child's place under its parent.
    fn split(&mut self, child: u32, at: usize) -> u32 {
        let p = self.page_size as usize;
        debug_assert!(at > 0 && at < self.nodes[child as usize].len && at % p == 0);
        let c = self.nodes[child as usize].clone();
        let upper_end_hash = if self.track_paths {
            self.node_tokens(child)[..at]
                .chunks(p)
                .fold(c.start_hash, path_hash)
        } else {
            0
        };
        let mut upper = Node {
            generation: 0,
            live: true,
            parent: c.parent,
            start: c.start,
            len: at,
            children: Children::default(),
            lock_ref: c.lock_ref,
            last_access: c.last_access,
            creation: c.creation,
            hit_count: c.hit_count,
            priority: c.priority,
            depth: c.depth,
            start_hash: c.start_hash,
            end_hash: upper_end_hash,
            digests: Vec::new(),
            indexed: None,
        };
        if !c.digests.is_empty() {
            upper.digests = c.digests[..at / p].to_vec();
        }
        let u = self.alloc_node(upper);
        self.replace_child(c.parent, child, u);
        {
            let lower = &mut self.nodes[child as usize];
            lower.parent = u;
            lower.start += at;
            lower.len -= at;
            lower.depth += at;
            lower.start_hash = upper_end_hash;
            if !lower.digests.is_empty() {
                lower.digests.drain(..at / p);
            }
        }
        self.add_child(u, child);
        // The lower half keeps its place in the index, but its length and depth changed.
        if self.nodes[child as usize].indexed.is_some() {
            self.refresh(child);
        }
        u
    }

    /// Walks `key` (already page-floored) from `root` without changing anything: the deepest
    /// fully matched node, the tokens matched through it, and a partially matched child with
    /// its page-floored match length, if any.
    fn walk(&self, root: u32, key: &[u32]) -> (u32, usize, Option<(u32, usize)>) {
        let p = self.page_size as usize;
        let (mut node, mut pos) = (root, 0);
        while pos < key.len() {
            let Some(c) = self.find_child(node, &key[pos..pos + p]) else {
                break;
            };
            let len = self.nodes[c as usize].len;
            let common = floor_to_page(Self::lcp(self.node_tokens(c), &key[pos..]), p);
            if common < len {
                return (node, pos, (common > 0).then_some((c, common)));
            }
            node = c;
            pos += len;
        }
        (node, pos, None)
    }

    fn match_impl(&mut self, root: u32, key: &[u32], out: Option<&mut Vec<Slot>>) -> (u32, usize) {
        let p = self.page_size as usize;
        let key = &key[..floor_to_page(key.len(), p)];
        self.tick();
        let (node, pos, partial) = self.walk(root, key);
        let (last, len) = match partial {
            Some((c, common)) => (self.split(c, common), pos + common),
            None => (node, pos),
        };
        // Visit the matched path bottom-up: access times, and the slots (collected in reverse).
        if let Some(out) = out {
            let base = out.len();
            out.resize(base + len, Slot::PADDING);
            let mut end = base + len;
            let mut i = last;
            while self.nodes[i as usize].parent != NONE {
                let n = self.nodes[i as usize].len;
                out[end - n..end].copy_from_slice(self.node_slots(i));
                end -= n;
                i = self.nodes[i as usize].parent;
            }
        }
        let mut i = last;
        while self.nodes[i as usize].parent != NONE {
            self.touch(i, false, None);
            i = self.nodes[i as usize].parent;
        }
        (last, len)
    }

    fn insert_impl(
        &mut self,
        root: u32,
        key: &[u32],
        slots: &[Slot],
        opts: InsertOptions,
    ) -> InsertResult {
        let p = self.page_size as usize;
        let key = &key[..floor_to_page(key.len(), p)];
        self.tick();
        let (node, pos, partial) = self.walk(root, key);
        let (node, pos) = match partial {
            Some((c, common)) => (self.split(c, common), pos + common),
            None => (node, pos),
        };
        // Matched path: hits (unless chunked), access, priority.
        let mut i = node;
        while self.nodes[i as usize].parent != NONE {
            self.touch(i, !opts.chunked, Some(opts.priority));
            i = self.nodes[i as usize].parent;
        }
        if pos == key.len() {
            return InsertResult {
                prefix_len: pos,
                inserted: 0,
                last_node: self.id(node),
            };
        }
        let leaf = self.new_leaf(node, &key[pos..], &slots[pos..key.len()], opts);
        InsertResult {
            prefix_len: pos,
            inserted: key.len() - pos,
            last_node: self.id(leaf),
        }
    }

    fn new_leaf(&mut self, parent: u32, key: &[u32], slots: &[Slot], opts: InsertOptions) -> u32 {
        let p = self.page_size as usize;
        let start = self.tokens.len();
        self.tokens.extend_from_slice(key);
        self.slots.extend_from_slice(slots);
        let par = &self.nodes[parent as usize];
        let start_hash = par.end_hash;
        let depth = par.depth + par.len;
        let end_hash = if self.track_paths {
            key.chunks(p).fold(start_hash, path_hash)
        } else {
            0
        };
        let digests = if self.events_enabled {
            let mut prev = par
                .digests
                .last()
                .copied()
                .or_else(|| self.last_digest_above(parent));
            let parent_block = prev.as_ref().map(digest_to_block_id);
            let mut d = Vec::with_capacity(key.len() / p);
            for page in key.chunks(p) {
                let digest = page_digest(prev.as_ref(), page);
                d.push(digest);
                prev = Some(digest);
            }
            self.events.push(KvEvent::BlockStored {
                block_hashes: d.iter().map(digest_to_block_id).collect(),
                parent_block_hash: parent_block,
                token_ids: key.to_vec(),
                block_size: self.page_size,
            });
            d
        } else {
            Vec::new()
        };
        let now = self.clock;
        let leaf = self.alloc_node(Node {
            generation: 0,
            live: true,
            parent,
            start,
            len: key.len(),
            children: Children::default(),
            lock_ref: 0,
            last_access: now,
            creation: now,
            hit_count: u32::from(!opts.chunked),
            priority: opts.priority,
            depth,
            start_hash,
            end_hash,
            digests,
            indexed: None,
        });
        self.add_child(parent, leaf);
        self.evictable += key.len();
        // The parent may have been an evictable leaf.
        if self.nodes[parent as usize].indexed.is_some() {
            self.refresh(parent);
        }
        self.refresh(leaf);
        leaf
    }

    fn last_digest_above(&self, mut i: u32) -> Option<PageDigest> {
        while i != NONE {
            if let Some(d) = self.nodes[i as usize].digests.last() {
                return Some(*d);
            }
            i = self.nodes[i as usize].parent;
        }
        None
    }

    // ----- eviction ----------------------------------------------------------------------------

    /// Removes the last `n` tokens (whole pages) of evictable leaf `i`, or the whole leaf.
    fn evict_from(&mut self, i: u32, n: usize, alloc: &mut dyn Allocator) -> Result<usize> {
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
            self.index.remove(&(key, i));
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

    /// Rebuilds the token and slot arenas from the live nodes when dead ranges dominate.
    fn maybe_compact(&mut self) {
        let live = self.tokens.len() - self.dead_tokens;
        if self.dead_tokens < (1 << 16) || self.dead_tokens < live {
            return;
        }
        // In place: live ranges never overlap, so packing them in start order only moves data
        // down. The arenas keep their capacity, so no fresh memory is touched.
        let mut order: Vec<(usize, u32)> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.live && n.len > 0)
            .map(|(i, n)| (n.start, i as u32))
            .collect();
        order.sort_unstable();
        let mut w = 0;
        for (start, i) in order {
            let len = self.nodes[i as usize].len;
            self.tokens.copy_within(start..start + len, w);
            self.slots.copy_within(start..start + len, w);
            self.nodes[i as usize].start = w;
            w += len;
        }
        self.tokens.truncate(w);
        self.slots.truncate(w);
        self.dead_tokens = 0;
    }

    // ----- locks -------------------------------------------------------------------------------

    fn lock_path(&mut self, mut i: u32, delta: i32) -> usize {
        let mut moved = 0;
        while self.nodes[i as usize].parent != NONE {
            let n = &mut self.nodes[i as usize];
            let len = n.len;
            if delta > 0 {
                n.lock_ref += 1;
                if n.lock_ref == 1 {
                    self.evictable -= len;
                    self.protected += len;
                    moved += len;
                    self.refresh(i);
                }
            } else {
                n.lock_ref -= 1;
                if n.lock_ref == 0 {
                    self.protected -= len;
                    self.evictable += len;
                    moved += len;
                    self.refresh(i);
                }
            }
            i = self.nodes[i as usize].parent;
        }
        moved
    }

    // ----- rendering ---------------------------------------------------------------------------

    /// A readable rendering of the whole tree, children ordered by their first token; tokens
    /// formatted by `token` (e.g. letters in tests). Long keys are abbreviated.
    pub fn render_with(&self, token: &dyn Fn(u32) -> String) -> String {
        let mut out = format!(
            "radix P={} policy={} evictable={} protected={} nodes={} leaves_indexed={}\n",
            self.page_size,
            self.policy.name(),
            self.evictable,
            self.protected,
            self.node_count(),
            self.index.len()
        );
        let mut roots: Vec<_> = self.roots.iter().collect();
        roots.sort();
        for (ns, &r) in roots {
            let _ = writeln!(
                out,
                "[root{}]",
                ns.as_ref().map_or(String::new(), |k| format!(" {k:?}"))
            );
            self.render_children(r, "", token, &mut out);
        }
        out
    }

    fn render_children(
        &self,
        i: u32,
        indent: &str,
        token: &dyn Fn(u32) -> String,
        out: &mut String,
    ) {
        let mut kids: Vec<u32> = self.nodes[i as usize].children.iter().collect();
        kids.sort_by(|&a, &b| self.node_tokens(a).cmp(self.node_tokens(b)));
        for (k, &c) in kids.iter().enumerate() {
            let last = k + 1 == kids.len();
            let n = &self.nodes[c as usize];
            let abbreviate = |v: Vec<String>| {
                if v.len() > 12 {
                    format!(
                        "{} … {} ({} tokens)",
                        v[..8].join(" "),
                        v[v.len() - 2..].join(" "),
                        v.len()
                    )
                } else {
                    v.join(" ")
                }
            };
            let toks = abbreviate(self.node_tokens(c).iter().map(|&t| token(t)).collect());
            let slots = abbreviate(self.node_slots(c).iter().map(|s| s.0.to_string()).collect());
            let _ = writeln!(
                out,
                "{indent}{} n{} [{toks}] slots=[{slots}] lock={} hits={} access={}{}{}",
                if last { "└─" } else { "├─" },
                c,
                n.lock_ref,
                n.hit_count,
                n.last_access,
                if n.priority != 0 {
                    format!(" prio={}", n.priority)
                } else {
                    String::new()
                },
                if n.indexed.is_some() {
                    " evictable"
                } else {
                    ""
                },
            );
            let deeper = format!("{indent}{}", if last { "   " } else { "│  " });
            self.render_children(c, &deeper, token, out);
        }
    }

    /// The evictable leaves in the order they would go now: each leaf's handle and its own
    /// tokens (not the path above it). For tests and diagnostics.
    pub fn eviction_order(&self) -> Vec<(NodeId, Vec<u32>)> {
        self.index
            .iter()
            .map(|&(_, i)| (self.id(i), self.node_tokens(i).to_vec()))
            .collect()
    }

    /// Checks the tree's internal invariants (sizes, lock counts, index membership, page
    /// alignment, parent links); returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let p = self.page_size as usize;
        let (mut evictable, mut protected, mut leaves) = (0, 0, 0);
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.live) {
            let i = i as u32;
            if n.parent == NONE {
                continue;
            }
            if n.len == 0 || n.len % p != 0 {
                return Err(format!(
                    "n{i} holds {} tokens, not a positive multiple of {p}",
                    n.len
                ));
            }
            let par = &self.nodes[n.parent as usize];
            if !par.live || !par.children.iter().any(|c| c == i) {
                return Err(format!("n{i} is not among its parent's children"));
            }
            if par.parent != NONE && par.lock_ref < n.lock_ref {
                return Err(format!(
                    "n{i} has more locks ({}) than its parent ({})",
                    n.lock_ref, par.lock_ref
                ));
            }
            if n.depth != par.depth + par.len {
                return Err(format!("n{i} depth {} != parent depth + len", n.depth));
            }
            if n.lock_ref > 0 {
                protected += n.len;
            } else {
                evictable += n.len;
            }
            let should = self.is_evictable_leaf(i);
            if should != n.indexed.is_some()
                || (should && !self.index.contains(&(n.indexed.unwrap(), i)))
            {
                return Err(format!(
                    "n{i}: evictable leaf = {should}, indexed = {:?}",
                    n.indexed
                ));
            }
            leaves += usize::from(should);
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return Err(format!(
                "sizes: counted evictable {evictable} protected {protected}, recorded {} {}",
                self.evictable, self.protected
            ));
        }
        if leaves != self.index.len() {
            return Err(format!(
                "index holds {} entries for {leaves} evictable leaves",
                self.index.len()
            ));
        }
        Ok(())
    }

    fn check_view(&self, req: &ReqView<'_>) -> Result<()> {
        req.check_lengths(self.page_size)?;
        let last = self.resolve(req.state.last_node)?;
        if self.nodes[last as usize].parent != NONE && self.nodes[last as usize].lock_ref == 0 {
            return Err(RadixCacheError::LockUnderflow(req.state.last_node));
        }
        Ok(())
    }
}

impl PrefixCache for RadixCache {
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
        let root = self.root_index(extra_key);
        let (last, len) = self.match_impl(root, key, Some(out));
        MatchResult {
            len,
            last_node: self.id(last),
        }
    }

    fn peek_prefix(&self, key: &[u32], extra_key: Option<&str>) -> (usize, Option<NodeId>) {
        let Some(root) = self.find_root(extra_key) else {
            return (0, None);
        };
        let key = &key[..floor_to_page(key.len(), self.page_size as usize)];
        match self.walk(root, key) {
            (_, pos, Some((c, common))) => (pos + common, Some(self.id(c))),
            (_, 0, None) => (0, None),
            (node, pos, None) => (pos, Some(self.id(node))),
        }
    }

    fn touch_prefix(&mut self, key: &[u32], extra_key: Option<&str>) -> (usize, Option<NodeId>) {
        let Some(root) = self.find_root(extra_key) else {
            return (0, None);
        };
        let key = &key[..floor_to_page(key.len(), self.page_size as usize)];
        self.tick();
        let (node, pos, partial) = self.walk(root, key);
        let mut i = partial.map_or(node, |(c, _)| c);
        while self.nodes[i as usize].parent != NONE {
            self.touch(i, false, None);
            i = self.nodes[i as usize].parent;
        }
        match partial {
            Some((c, common)) => (pos + common, Some(self.id(c))),
            None if pos == 0 => (0, None),
            None => (pos, Some(self.id(node))),
        }
    }

    fn parent(&self, node: NodeId) -> Option<NodeId> {
        let i = self.resolve(node).ok()?;
        let parent = self.nodes[i as usize].parent;
        (parent != NONE && self.nodes[parent as usize].parent != NONE).then(|| self.id(parent))
    }

    fn insert(
        &mut self,
        key: &[u32],
        extra_key: Option<&str>,
        slots: &[Slot],
        opts: InsertOptions,
    ) -> Result<InsertResult> {
        if slots.len() != key.len() {
            return Err(RadixCacheError::LengthMismatch {
                what: "insert slots",
                expected: key.len(),
                got: slots.len(),
            });
        }
        let root = self.root_index(extra_key);
        let r = self.insert_impl(root, key, slots, opts);
        self.maybe_compact();
        Ok(r)
    }

    fn cache_unfinished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &mut ReqToTokenPool,
        alloc: &mut dyn Allocator,
        chunked: bool,
    ) -> Result<()> {
        self.check_view(&req)?;
        let p = self.page_size as usize;
        let committed = req.committed_len;
        let aligned = floor_to_page(committed, p);
        let protected = req.state.cache_protected_len;
        let slots = rows.read(req.row, committed)?.to_vec();
        let root = self.root_index(req.extra_key);
        let opts = InsertOptions {
            priority: req.priority,
            chunked,
        };
        let ins = self.insert_impl(root, &req.tokens[..aligned], &slots[..aligned], opts);
        if ins.prefix_len > protected {
            alloc.free(&slots[protected..ins.prefix_len])?;
        }
        // Re-match for the tree's canonical slots and the new last node.
        let mut canonical = Vec::with_capacity(committed);
        let (last, len) = self.match_impl(root, &req.tokens[..aligned], Some(&mut canonical));
        debug_assert_eq!(len, aligned);
        rows.write(req.row, protected, &canonical[protected..aligned])?;
        self.lock_path(last, 1);
        let old = self.resolve(req.state.last_node)?;
        self.lock_path(old, -1);
        canonical.extend_from_slice(&slots[aligned..committed]);
        req.state.cache_protected_len = aligned;
        req.state.last_node = self.id(last);
        req.state.prefix_slots = canonical;
        self.maybe_compact();
        Ok(())
    }

    fn cache_finished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &ReqToTokenPool,
        alloc: &mut dyn Allocator,
        insert: bool,
    ) -> Result<()> {
        self.check_view(&req)?;
        let p = self.page_size as usize;
        let committed = req.committed_len;
        let aligned = floor_to_page(committed, p);
        let protected = req.state.cache_protected_len;
        let slots = rows.read(req.row, committed)?;
        let last = self.resolve(req.state.last_node)?;
        let owned_from = if insert {
            let root = self.root_index(req.extra_key);
            let opts = InsertOptions {
                priority: req.priority,
                chunked: false,
            };
            let ins = self.insert_impl(root, &req.tokens[..aligned], &slots[..aligned], opts);
            // Duplicates [protected, prefix_len) are ours to free; [prefix_len, aligned) now
            // belongs to the tree.
            if ins.prefix_len > protected {
                alloc.free(&slots[protected..ins.prefix_len])?;
            }
            aligned
        } else {
            protected
        };
        if committed > owned_from {
            alloc.free(&slots[owned_from..committed])?;
        }
        self.lock_path(last, -1);
        let root = self.root_index(req.extra_key);
        req.state.cache_protected_len = 0;
        req.state.last_node = self.id(root);
        req.state.prefix_slots.clear();
        self.maybe_compact();
        Ok(())
    }

    fn evict(&mut self, num_tokens: usize, alloc: &mut dyn Allocator) -> Result<usize> {
        let p = self.page_size as usize;
        let mut freed = 0;
        while freed < num_tokens {
            let Some(&(_, i)) = self.index.first() else {
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

    fn inc_lock_ref(&mut self, node: NodeId) -> Result<usize> {
        let i = self.resolve(node)?;
        self.tick();
        Ok(self.lock_path(i, 1))
    }

    fn dec_lock_ref(&mut self, node: NodeId) -> Result<usize> {
        let i = self.resolve(node)?;
        // Validate the whole path first, so an underflow changes nothing.
        let mut j = i;
        while self.nodes[j as usize].parent != NONE {
            if self.nodes[j as usize].lock_ref == 0 {
                return Err(RadixCacheError::LockUnderflow(node));
            }
            j = self.nodes[j as usize].parent;
        }
        self.tick();
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
        let mut all = Vec::with_capacity(self.evictable);
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && n.parent != NONE {
                all.extend_from_slice(self.node_slots(i as u32));
            }
        }
        alloc.free(&all)?;
        let (policy, events, partial, track) = (
            std::mem::replace(&mut self.policy, Box::new(crate::BuiltinPolicy::Lru)),
            self.events_enabled,
            self.partial_eviction,
            self.track_paths,
        );
        let clock = self.clock;
        let mut pending = std::mem::take(&mut self.events);
        *self = RadixCache::new(self.page_size, policy)
            .with_events(events)
            .with_partial_eviction(partial)
            .with_path_hashes(track);
        self.clock = clock;
        if events {
            pending.push(KvEvent::AllBlocksCleared);
        }
        self.events = pending;
        Ok(())
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn claim_ownership(&self, check: &mut OwnershipCheck) {
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && n.parent != NONE {
                check.claim(Owner::TreeNode(i as u64), self.node_slots(i as u32));
            }
        }
    }
}
