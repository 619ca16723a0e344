//! The tree's storage: the [`RadixCache`] struct, its nodes in an arena, and the parent/child
//! links. Everything else in `radix/` builds on this module; it calls none of them.
//!
//! Nodes live in a `Vec<Node>` whose freed entries are reused; a [`NodeId`] carries the entry's
//! generation, so a handle to an evicted node is detected rather than aliased to a reused one.
//! Every node's key tokens and slot values are ranges of two parallel arenas (`tokens`,
//! `slots`), so a split only divides a range and a partial eviction only shortens one. A node's
//! children are a hash map from its first page (the token itself at `P = 1`, a hash of the page
//! otherwise, verified on lookup; colliding pages go to a short overflow list). Each namespace
//! (`extra_key`) has its own root, so namespaces never share nodes.

use std::collections::hash_map::Entry;
use std::hash::Hasher;

use kv_pool::Slot;
use rustc_hash::{FxHashMap, FxHasher};

use crate::error::{RadixCacheError, Result};
use crate::events::{namespace_seed, KvEvent, PageDigest};
use crate::policy::{AnyEvictionPolicy, EvictionKey, EvictionPolicy, PATH_HASH_SEED};
use crate::radix::host::HostTier;
use crate::radix::leaves::LeafOrder;

use crate::NodeId;

/// The parent index of a root (roots have no parent).
pub(super) const NONE: u32 = u32::MAX;

/// Tokens the token and slot arenas reserve on their first growth (4 MiB of address space
/// each). Pages are committed only when written, so the reservation costs nothing until used,
/// and growth up to it never copies: doubling from empty copied every arena into fresh memory
/// (about 1.5 times its final size faulted in, for W1 most of its wall time).
const ARENA_RESERVE: usize = 1 << 20;

/// A node's children, found by their first page.
#[derive(Debug, Default, Clone)]
pub(super) struct Children {
    pub(super) by_first_page: FxHashMap<u64, u32>,
    /// Children whose first-page hash collides with another child's (practically never).
    pub(super) overflow: Vec<u32>,
}

impl Children {
    pub(super) fn is_empty(&self) -> bool {
        self.by_first_page.is_empty() && self.overflow.is_empty()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_first_page
            .values()
            .copied()
            .chain(self.overflow.iter().copied())
    }
}

/// One tree node (SGLang's `TreeNode`): a run of whole pages, its statistics and its links.
#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) generation: u32,
    pub(super) live: bool,
    /// [`NONE`] for a root.
    pub(super) parent: u32,
    /// Offset of the node's tokens and slots in the arenas.
    pub(super) start: usize,
    /// Tokens held (a positive multiple of `P`; 0 for a root).
    pub(super) len: usize,
    pub(super) children: Children,
    /// Requests holding the path through this node (a root is permanently locked once).
    pub(super) lock_ref: u32,
    /// Logical-clock tick of the last match or insert through the node.
    pub(super) last_access: u64,
    /// Logical-clock tick of the node's first insert.
    pub(super) creation: u64,
    pub(super) hit_count: u32,
    pub(super) priority: i64,
    /// Tokens between the root and the node's first token.
    pub(super) depth: usize,
    /// Nodes on the root path through this node when it was created ([`NodeStats::lineage`]).
    ///
    /// [`NodeStats::lineage`]: crate::policy::NodeStats::lineage
    pub(super) lineage: u32,
    /// Path hash of everything before the node, and through its last token (only when the
    /// policy wants path hashes).
    pub(super) start_hash: u64,
    pub(super) end_hash: u64,
    /// SGLang block digests of the node's pages (when events are on, or an L3 store: they are its
    /// storage keys); a non-default namespace's root holds the seed its chains start from.
    pub(super) digests: Vec<PageDigest>,
    /// The node's key in the evictable index, if it is in it.
    pub(super) indexed: Option<EvictionKey>,
    /// Its device slots are valid (always, without a host tier; roots are on device). The
    /// on-device nodes form a root-anchored subtree.
    pub(super) on_device: bool,
    /// Its host slots (the `host_slots` arena) are valid (SGLang's `backuped`).
    pub(super) backed_up: bool,
    /// Copies reading the node's host pages in flight (SGLang's `host_ref_counter`): a
    /// pinned node is never host-evicted.
    pub(super) host_ref: u32,
    /// Children on device: the node is a device leaf when this is 0.
    pub(super) device_children: u32,
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
            lineage: 0,
            start_hash: PATH_HASH_SEED,
            end_hash: PATH_HASH_SEED,
            digests: Vec::new(),
            indexed: None,
            on_device: true,
            backed_up: false,
            host_ref: 0,
            device_children: 0,
        }
    }
}

/// SGLang's radix prefix cache (`mem_cache/radix_cache.py`) at page size 1 or `P`, generic over
/// its eviction policy `P` (statically dispatched; [`AnyEvictionPolicy`] by default), with an
/// incremental eviction index and partial eviction.
///
/// Build it with [`RadixCache::new`] from any of this crate's policies, or with
/// [`RadixCache::with_policy`] from a policy of your own:
///
/// ```
/// use radix_cache::{BuiltinPolicy, PrefixCache, RadixCache};
///
/// let cache = RadixCache::new(16, BuiltinPolicy::Lru); // RadixCache<AnyEvictionPolicy>
/// assert_eq!((cache.page_size(), cache.policy_name()), (16, "lru"));
/// let own = RadixCache::with_policy(1, BuiltinPolicy::Lfu); // RadixCache<BuiltinPolicy>
/// assert_eq!(own.policy_name(), "lfu");
/// ```
#[derive(Debug)]
pub struct RadixCache<P: EvictionPolicy = AnyEvictionPolicy> {
    pub(super) page_size: u32,
    pub(super) policy: P,
    /// Whether nodes carry path hashes (the policy's [`EvictionPolicy::needs_path_hashes`]).
    pub(super) track_paths: bool,
    pub(super) events_enabled: bool,
    pub(super) partial_eviction: bool,
    pub(super) nodes: Vec<Node>,
    pub(super) free_nodes: Vec<u32>,
    /// Namespace name → root node index; the default namespace is `None`.
    pub(super) roots: FxHashMap<Option<String>, u32>,
    /// The default namespace's root, as in `roots` (kept apart so the common lookup hashes
    /// nothing).
    pub(super) default_root: u32,
    pub(super) tokens: Vec<u32>,
    pub(super) slots: Vec<Slot>,
    /// Host slots, parallel to `tokens` and `slots` (empty without a host tier); valid for
    /// backed-up nodes.
    pub(super) host_slots: Vec<Slot>,
    /// Arena tokens no live node covers (reclaimed by compaction).
    pub(super) dead_tokens: usize,
    /// The evictable leaves ordered by (policy key, node index): first goes first.
    pub(super) index: LeafOrder,
    pub(super) evictable: usize,
    pub(super) protected: usize,
    /// The logical clock: one tick per match, insert, lock change and eviction step.
    pub(super) clock: u64,
    pub(super) events: Vec<KvEvent>,
    /// Scratch: the nodes of a matched path (reused, so a match allocates nothing).
    pub(super) path_scratch: Vec<u32>,
    /// The host tier (`None`: a device-only tree, SGLang's `RadixCache`). Every tier check is
    /// one branch on this.
    pub(super) tier: Option<Box<HostTier>>,
}

impl RadixCache {
    /// An empty cache with page size `page_size` (0 is taken as 1) and one of this crate's
    /// policies (a [`crate::BuiltinPolicy`], [`crate::policy::CostAware`],
    /// [`crate::policy::Belady`] or an [`AnyEvictionPolicy`]). Partial eviction is on; events
    /// are off.
    pub fn new(page_size: u32, policy: impl Into<AnyEvictionPolicy>) -> Self {
        Self::with_policy(page_size, policy.into())
    }
}

impl<P: EvictionPolicy> RadixCache<P> {
    /// An empty cache with page size `page_size` (0 is taken as 1) and eviction `policy` of any
    /// type. Partial eviction is on; events are off; path hashes are kept iff the policy
    /// [needs them](EvictionPolicy::needs_path_hashes).
    pub fn with_policy(page_size: u32, policy: P) -> Self {
        let track_paths = policy.needs_path_hashes();
        let index = LeafOrder::new(policy.keys_grow_with_access());
        let mut cache = RadixCache {
            page_size: page_size.max(1),
            policy,
            track_paths,
            events_enabled: false,
            partial_eviction: true,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: FxHashMap::default(),
            default_root: NONE,
            tokens: Vec::new(),
            slots: Vec::new(),
            host_slots: Vec::new(),
            dead_tokens: 0,
            index,
            evictable: 0,
            protected: 0,
            clock: 0,
            events: Vec::new(),
            path_scratch: Vec::new(),
            tier: None,
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

    /// The eviction policy's name (as `--radix-eviction-policy` spells it).
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// The eviction policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// The eviction policy, e.g. for a replay driver's [`EvictionPolicy::advance_to`]. Keys
    /// already in the eviction index are not recomputed.
    pub fn policy_mut(&mut self) -> &mut P {
        &mut self.policy
    }

    /// The logical clock (ticks once per match, insert, lock change and eviction step).
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

    /// Whether `node` is in the tree (a root, or a live node the handle's generation matches).
    pub fn contains(&self, node: NodeId) -> bool {
        self.resolve(node).is_ok()
    }

    /// Evictable leaves currently indexed.
    pub fn evictable_leaves(&self) -> usize {
        self.index.len()
    }

    pub(super) fn id(&self, index: u32) -> NodeId {
        NodeId {
            index,
            generation: self.nodes[index as usize].generation,
        }
    }

    pub(super) fn resolve(&self, id: NodeId) -> Result<u32> {
        match self.nodes.get(id.index as usize) {
            Some(n) if n.live && n.generation == id.generation => Ok(id.index),
            _ => Err(RadixCacheError::StaleNode(id)),
        }
    }

    /// The root of namespace `extra_key`, created on first use (the default namespace's lookup
    /// inline, everything else out of line).
    #[inline]
    pub(super) fn root_index(&mut self, extra_key: Option<&str>) -> u32 {
        if extra_key.is_none() && self.default_root != NONE {
            return self.default_root;
        }
        self.root_index_slow(extra_key)
    }

    #[inline(never)]
    fn root_index_slow(&mut self, extra_key: Option<&str>) -> u32 {
        if let Some(&r) = self.roots.get(&extra_key.map(str::to_string)) {
            return r;
        }
        let mut root = Node::root(0);
        // Page digests (events, storage keys) of a namespace chain from its seed, so two
        // namespaces never share a key; the default namespace has none (SGLang's hashes).
        root.digests.extend(namespace_seed(extra_key));
        let r = self.alloc_node(root);
        self.roots.insert(extra_key.map(str::to_string), r);
        if extra_key.is_none() {
            self.default_root = r;
        }
        r
    }

    pub(super) fn find_root(&self, extra_key: Option<&str>) -> Option<u32> {
        match extra_key {
            None => (self.default_root != NONE).then_some(self.default_root),
            Some(k) => self.roots.get(&Some(k.to_string())).copied(),
        }
    }

    /// Empties the tree (nodes, roots, arenas, index, sizes); keeps the policy, the options, the
    /// clock and pending events. The default namespace's root is recreated as node 0.
    pub(super) fn clear_tree(&mut self) {
        self.nodes.clear();
        self.free_nodes.clear();
        self.roots.clear();
        self.default_root = NONE;
        self.tokens.clear();
        self.slots.clear();
        self.host_slots.clear();
        self.dead_tokens = 0;
        self.index.clear();
        if let Some(t) = self.tier.as_mut() {
            t.index.clear();
            t.keys.clear();
        }
        self.evictable = 0;
        self.protected = 0;
        self.root_index(None);
    }

    pub(super) fn alloc_node(&mut self, mut node: Node) -> u32 {
        if let Some(i) = self.free_nodes.pop() {
            node.generation = self.nodes[i as usize].generation.wrapping_add(1);
            self.nodes[i as usize] = node;
            i
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    /// Room for `extra` more tokens in the token and slot arenas: the first growth reserves
    /// [`ARENA_RESERVE`], later ones double (so appends stay amortised O(1)).
    #[inline]
    pub(super) fn reserve_arenas(&mut self, extra: usize) {
        let (len, cap) = (self.tokens.len(), self.tokens.capacity());
        if len + extra > cap {
            let target = (len + extra).max(2 * cap).max(ARENA_RESERVE);
            self.tokens.reserve_exact(target - len);
            self.slots.reserve_exact(target - self.slots.len());
        }
    }

    pub(super) fn node_tokens(&self, i: u32) -> &[u32] {
        let n = &self.nodes[i as usize];
        &self.tokens[n.start..n.start + n.len]
    }

    pub(super) fn node_slots(&self, i: u32) -> &[Slot] {
        let n = &self.nodes[i as usize];
        &self.slots[n.start..n.start + n.len]
    }

    /// Node `i`'s host slots (valid when it is backed up; empty without a host tier).
    pub(super) fn node_host_slots(&self, i: u32) -> &[Slot] {
        let n = &self.nodes[i as usize];
        self.host_slots.get(n.start..n.start + n.len).unwrap_or(&[])
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

    pub(super) fn find_child(&self, parent: u32, page: &[u32]) -> Option<u32> {
        let p = self.page_size as usize;
        let children = &self.nodes[parent as usize].children;
        // At P = 1 one compare (a slice `==` of run-time length is a `memcmp` call).
        let matches = |c: u32| {
            let first = &self.node_tokens(c)[..p];
            if p == 1 {
                first[0] == page[0]
            } else {
                first == page
            }
        };
        if let Some(&c) = children.by_first_page.get(&self.page_key(page)) {
            if matches(c) {
                return Some(c);
            }
        }
        children.overflow.iter().copied().find(|&c| matches(c))
    }

    pub(super) fn add_child(&mut self, parent: u32, child: u32) {
        let p = self.page_size as usize;
        if self.nodes[child as usize].on_device {
            self.nodes[parent as usize].device_children += 1;
        }
        let key = self.page_key(&self.node_tokens(child)[..p]);
        let children = &mut self.nodes[parent as usize].children;
        if let Entry::Vacant(e) = children.by_first_page.entry(key) {
            e.insert(child);
        } else {
            children.overflow.push(child);
        }
    }

    pub(super) fn remove_child(&mut self, parent: u32, child: u32) {
        let p = self.page_size as usize;
        if self.nodes[child as usize].on_device {
            self.nodes[parent as usize].device_children -= 1;
        }
        let key = self.page_key(&self.node_tokens(child)[..p]);
        let children = &mut self.nodes[parent as usize].children;
        let in_map = match children.by_first_page.entry(key) {
            Entry::Occupied(e) if *e.get() == child => {
                e.remove();
                true
            }
            _ => false,
        };
        if in_map {
            // Promote a colliding child into the map slot.
            if !children.overflow.is_empty() {
                let other = children.overflow.swap_remove(0);
                let key = self.page_key(&self.node_tokens(other)[..p]);
                let children = &mut self.nodes[parent as usize].children;
                match children.by_first_page.entry(key) {
                    Entry::Vacant(e) => {
                        e.insert(other);
                    }
                    Entry::Occupied(_) => children.overflow.push(other),
                }
            }
        } else {
            children.overflow.retain(|&c| c != child);
        }
    }

    /// Replaces `old` by `new` among `parent`'s children (`new` starts with `old`'s first
    /// page): one lookup by that page, no scan of the parent's children.
    pub(super) fn replace_child(&mut self, parent: u32, old: u32, new: u32) {
        let p = self.page_size as usize;
        let key = self.page_key(&self.node_tokens(new)[..p]);
        let children = &mut self.nodes[parent as usize].children;
        let slot = match children.by_first_page.get_mut(&key) {
            Some(c) if *c == old => Some(c),
            _ => children.overflow.iter_mut().find(|c| **c == old),
        };
        match slot {
            Some(c) => *c = new,
            None => debug_assert!(false, "node {old} is not a child of {parent}"),
        }
    }

    /// Rebuilds the token and slot arenas from the live nodes when dead ranges dominate (the
    /// check inline: every operation ends with it; the rebuild out of line).
    #[inline]
    pub(super) fn maybe_compact(&mut self) {
        let live = self.tokens.len() - self.dead_tokens;
        if self.dead_tokens >= (1 << 16) && self.dead_tokens >= live {
            self.compact();
        }
    }

    #[cold]
    #[inline(never)]
    fn compact(&mut self) {
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
            if self.tier.is_some() {
                self.host_slots.copy_within(start..start + len, w);
            }
            self.nodes[i as usize].start = w;
            w += len;
        }
        self.tokens.truncate(w);
        self.slots.truncate(w);
        if self.tier.is_some() {
            self.host_slots.truncate(w);
        }
        self.dead_tokens = 0;
    }
}
