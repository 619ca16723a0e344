//! The `cache_aware` policy's approximate radix tree (sgl-router's `policies/tree.rs`): the
//! prompts the router sent to each worker, one tree shared by all workers ("tenants"), each
//! node remembering which workers routed through it and when they last did.
//!
//! Keys are sequences of `u32` symbols: a text prompt's characters (as sgl-router, which
//! matches raw text to avoid tokenizing) or a prompt's token ids. Time is a logical clock (one
//! tick per insert), so decisions are reproducible.
//!
//! Invariants ([`ApproxTree::check`] proves them; the proptests run it after every step):
//! - every node but the root has a non-empty key, and siblings differ in their first symbol;
//! - a child's tenants are a subset of its parent's (an insert marks the whole path; eviction
//!   takes a tenant's leaves first), so the tenant found at the end of a match holds the whole
//!   matched prefix;
//! - `sizes[t]` is the number of symbols in the nodes that hold `t` (what `--max-tree-size`
//!   bounds), and no node but the root is without tenants.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::WorkerId;

/// Index of the root node.
const ROOT: usize = 0;

#[derive(Debug, Clone, Default)]
struct Node {
    key: Vec<u32>,
    parent: usize,
    /// First symbol → child.
    children: HashMap<u32, usize>,
    /// The workers that routed through this node, with their last access (logical time).
    tenants: Vec<(WorkerId, u64)>,
    live: bool,
}

impl Node {
    fn access(&self, t: WorkerId) -> Option<u64> {
        self.tenants.iter().find(|(w, _)| *w == t).map(|(_, a)| *a)
    }
}

/// What [`ApproxTree::prefix_match`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeMatch {
    /// Symbols of the key matched (a node matched part-way counts the part).
    pub len: usize,
    /// The most recent of the allowed workers holding the whole matched prefix (`None` when
    /// nothing matched).
    pub worker: Option<WorkerId>,
}

/// One approximate radix tree for every worker.
#[derive(Debug, Clone)]
pub struct ApproxTree {
    nodes: Vec<Node>,
    free: Vec<usize>,
    sizes: HashMap<WorkerId, usize>,
    clock: u64,
}

impl Default for ApproxTree {
    fn default() -> Self {
        ApproxTree {
            nodes: vec![Node {
                live: true,
                ..Node::default()
            }],
            free: Vec::new(),
            sizes: HashMap::new(),
            clock: 0,
        }
    }
}

fn common_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl ApproxTree {
    /// Symbols held for `worker` (0 for a worker the tree does not know).
    pub fn size(&self, worker: WorkerId) -> usize {
        self.sizes.get(&worker).copied().unwrap_or(0)
    }

    /// Nodes in the tree, the root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn alloc(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Marks `worker` on `node` at time `now`, counting the node's symbols if it is new there.
    fn mark(&mut self, node: usize, worker: WorkerId, now: u64) {
        let n = &mut self.nodes[node];
        match n.tenants.iter_mut().find(|(w, _)| *w == worker) {
            Some(entry) => entry.1 = now,
            None => {
                n.tenants.push((worker, now));
                *self.sizes.entry(worker).or_default() += n.key.len();
            }
        }
    }

    /// Records that `key` was routed to `worker`: every node of its path holds `worker` now.
    pub fn insert(&mut self, key: &[u32], worker: WorkerId) {
        self.clock += 1;
        let now = self.clock;
        self.sizes.entry(worker).or_default();
        self.mark(ROOT, worker, now);
        let (mut node, mut rest) = (ROOT, key);
        while let Some(&first) = rest.first() {
            let Some(&child) = self.nodes[node].children.get(&first) else {
                let leaf = self.alloc(Node {
                    key: rest.to_vec(),
                    parent: node,
                    live: true,
                    ..Node::default()
                });
                self.nodes[node].children.insert(first, leaf);
                self.mark(leaf, worker, now);
                return;
            };
            let l = common_len(&self.nodes[child].key, rest);
            let next = if l < self.nodes[child].key.len() {
                self.split(child, l)
            } else {
                child
            };
            self.mark(next, worker, now);
            node = next;
            rest = &rest[l..];
        }
    }

    /// Splits `child` after `l` symbols; returns the new upper node (same tenants, so every
    /// tenant's size is unchanged).
    fn split(&mut self, child: usize, l: usize) -> usize {
        let parent = self.nodes[child].parent;
        let tail = self.nodes[child].key.split_off(l);
        let head = std::mem::replace(&mut self.nodes[child].key, tail);
        let upper = self.alloc(Node {
            key: head,
            parent,
            children: HashMap::new(),
            tenants: self.nodes[child].tenants.clone(),
            live: true,
        });
        let (first_head, first_tail) = (self.nodes[upper].key[0], self.nodes[child].key[0]);
        self.nodes[parent].children.insert(first_head, upper);
        self.nodes[upper].children.insert(first_tail, child);
        self.nodes[child].parent = upper;
        upper
    }

    /// The longest prefix of `key` that one of the workers `allowed` accepts was routed
    /// with, and the most recent such worker there (ties: the smallest id).
    pub fn prefix_match(&self, key: &[u32], allowed: &dyn Fn(WorkerId) -> bool) -> TreeMatch {
        let best = |node: &Node| {
            node.tenants
                .iter()
                .filter(|(w, _)| allowed(*w))
                .max_by_key(|(w, a)| (*a, Reverse(*w)))
                .map(|(w, _)| *w)
        };
        let (mut node, mut len) = (ROOT, 0);
        let mut worker = None;
        while let Some(&first) = key.get(len) {
            let Some(&child) = self.nodes[node].children.get(&first) else {
                break;
            };
            let Some(w) = best(&self.nodes[child]) else {
                break;
            };
            worker = Some(w);
            let l = common_len(&self.nodes[child].key, &key[len..]);
            len += l;
            if l < self.nodes[child].key.len() {
                break;
            }
            node = child;
        }
        TreeMatch { len, worker }
    }

    /// Of `candidates`, the one holding the fewest symbols (ties: the first).
    pub fn smallest(&self, candidates: &[WorkerId]) -> Option<WorkerId> {
        candidates.iter().copied().min_by_key(|w| self.size(*w))
    }

    /// Whether `worker` is on `node` and on none of its children.
    fn is_leaf_of(&self, node: usize, worker: WorkerId) -> bool {
        let n = &self.nodes[node];
        n.access(worker).is_some()
            && n.children
                .values()
                .all(|&c| self.nodes[c].access(worker).is_none())
    }

    /// Takes `worker` off `node`; frees the node (and unlinks it) when no worker is left.
    fn unmark(&mut self, node: usize, worker: WorkerId) {
        let n = &mut self.nodes[node];
        n.tenants.retain(|(w, _)| *w != worker);
        let freed = n.key.len();
        if let Some(s) = self.sizes.get_mut(&worker) {
            *s -= freed;
        }
        if node != ROOT && self.nodes[node].tenants.is_empty() {
            let (parent, first) = (self.nodes[node].parent, self.nodes[node].key[0]);
            self.nodes[parent].children.remove(&first);
            self.nodes[node] = Node::default();
            self.free.push(node);
        }
    }

    /// sgl-router's `evict_tenant_by_size`: every worker holding more than `max_size`
    /// symbols loses its least recently used leaves until it holds at most that.
    pub fn evict_to(&mut self, max_size: usize) {
        let over: Vec<WorkerId> = self
            .sizes
            .iter()
            .filter(|(_, s)| **s > max_size)
            .map(|(w, _)| *w)
            .collect();
        for worker in over {
            let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (1..self.nodes.len())
                .filter(|&i| self.nodes[i].live && self.is_leaf_of(i, worker))
                .filter_map(|i| Some(Reverse((self.nodes[i].access(worker)?, i))))
                .collect();
            while self.size(worker) > max_size {
                let Some(Reverse((_, node))) = heap.pop() else {
                    break;
                };
                let parent = self.nodes[node].parent;
                self.unmark(node, worker);
                if parent != ROOT && self.is_leaf_of(parent, worker) {
                    if let Some(a) = self.nodes[parent].access(worker) {
                        heap.push(Reverse((a, parent)));
                    }
                }
            }
        }
    }

    /// Forgets `worker` everywhere (it was removed from the router).
    pub fn remove_tenant(&mut self, worker: WorkerId) {
        // Children first, so a node is freed after everything under it.
        let mut order = vec![ROOT];
        let mut i = 0;
        while i < order.len() {
            let n = order[i];
            order.extend(self.nodes[n].children.values().copied());
            i += 1;
        }
        for &n in order.iter().rev() {
            if self.nodes[n].access(worker).is_some() {
                self.unmark(n, worker);
            }
        }
        self.sizes.remove(&worker);
    }

    /// Checks the invariants in the module doc; the first violation.
    pub fn check(&self) -> Result<(), String> {
        let mut sizes: HashMap<WorkerId, usize> = HashMap::new();
        let mut seen = 0;
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.live {
                continue;
            }
            seen += 1;
            for (&first, &c) in &n.children {
                let child = &self.nodes[c];
                if !child.live || child.parent != i || child.key.first() != Some(&first) {
                    return Err(format!("node {c} is linked under {i} by {first} wrongly"));
                }
                if let Some((w, _)) = child.tenants.iter().find(|(w, _)| n.access(*w).is_none()) {
                    return Err(format!("node {c} holds {w:?}, its parent {i} does not"));
                }
            }
            if i != ROOT && (n.key.is_empty() || n.tenants.is_empty()) {
                return Err(format!("node {i} has no key or no worker"));
            }
            for (w, _) in &n.tenants {
                *sizes.entry(*w).or_default() += n.key.len();
            }
        }
        if seen != self.node_count() {
            return Err(format!("{seen} live nodes, {} counted", self.node_count()));
        }
        for (w, s) in &self.sizes {
            if sizes.get(w).copied().unwrap_or(0) != *s {
                return Err(format!(
                    "{w:?} is counted {s} symbols, holds {:?}",
                    sizes.get(w)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn w(i: u32) -> WorkerId {
        WorkerId(i)
    }
    fn s(text: &str) -> Vec<u32> {
        text.chars().map(u32::from).collect()
    }
    const ALL: &dyn Fn(WorkerId) -> bool = &|_| true;

    #[test]
    fn matches_split_and_name_the_most_recent_worker() {
        let mut t = ApproxTree::default();
        t.insert(&s("hello world"), w(0));
        t.insert(&s("hello there"), w(1));
        t.check().unwrap();
        assert_eq!(t.size(w(0)), 11);
        assert_eq!(t.size(w(1)), 11);
        let m = t.prefix_match(&s("hello world!"), ALL);
        assert_eq!(
            m,
            TreeMatch {
                len: 11,
                worker: Some(w(0))
            }
        );
        // "hello " is held by both; w1 was there last.
        let m = t.prefix_match(&s("hello you"), ALL);
        assert_eq!(
            m,
            TreeMatch {
                len: 6,
                worker: Some(w(1))
            }
        );
        let m = t.prefix_match(&s("hello you"), &|x| x == w(0));
        assert_eq!(
            m,
            TreeMatch {
                len: 6,
                worker: Some(w(0))
            }
        );
        assert_eq!(t.prefix_match(&s("bye"), ALL).worker, None);
        // Part of a node counts.
        assert_eq!(t.prefix_match(&s("hello wo"), ALL).len, 8);
        assert_eq!(t.smallest(&[w(0), w(1), w(2)]), Some(w(2)));
    }

    #[test]
    fn eviction_takes_least_recent_leaves_and_removal_forgets_a_worker() {
        let mut t = ApproxTree::default();
        t.insert(&s("aaaa1111"), w(0));
        t.insert(&s("aaaa2222"), w(0));
        t.insert(&s("bbbb"), w(1));
        assert_eq!(t.size(w(0)), 12);
        t.evict_to(8);
        t.check().unwrap();
        assert_eq!(t.size(w(0)), 8);
        assert_eq!(
            t.prefix_match(&s("aaaa1111"), ALL).len,
            4,
            "the older leaf went"
        );
        assert_eq!(t.prefix_match(&s("aaaa2222"), ALL).len, 8);
        assert_eq!(t.size(w(1)), 4, "under the limit: untouched");
        t.remove_tenant(w(0));
        t.check().unwrap();
        assert_eq!(t.prefix_match(&s("aaaa2222"), ALL).len, 0);
        assert_eq!(t.node_count(), 2);
    }

    fn model_match(inserted: &[(Vec<u32>, u32)], key: &[u32]) -> usize {
        inserted
            .iter()
            .map(|(k, _)| common_len(k, key))
            .max()
            .unwrap_or(0)
    }

    proptest! {
        /// Without eviction, a match is as long as the longest common prefix with anything
        /// inserted, and its worker inserted a key sharing that whole prefix.
        #[test]
        fn matches_agree_with_a_list_of_inserted_keys(
            ops in proptest::collection::vec(
                (proptest::collection::vec(0u32..3, 0..12), 0u32..4), 1..60),
            probes in proptest::collection::vec(proptest::collection::vec(0u32..3, 0..12), 1..10),
        ) {
            let mut t = ApproxTree::default();
            let mut inserted = Vec::new();
            for (k, wk) in &ops {
                t.insert(k, w(*wk));
                inserted.push((k.clone(), *wk));
                prop_assert_eq!(t.check(), Ok(()));
            }
            for p in &probes {
                let m = t.prefix_match(p, ALL);
                prop_assert_eq!(m.len, model_match(&inserted, p));
                if m.len > 0 {
                    let wk = m.worker.unwrap().0;
                    prop_assert!(inserted.iter().any(|(k, x)| *x == wk && common_len(k, p) >= m.len));
                }
            }
        }

        /// Eviction and removal keep the invariants and bring every worker under the limit.
        #[test]
        fn eviction_bounds_every_worker(
            ops in proptest::collection::vec(
                (proptest::collection::vec(0u32..4, 1..16), 0u32..3), 1..60),
            max in 0usize..20,
            gone in 0u32..3,
        ) {
            let mut t = ApproxTree::default();
            for (i, (k, wk)) in ops.iter().enumerate() {
                t.insert(k, w(*wk));
                if i % 7 == 6 {
                    t.evict_to(max);
                    prop_assert_eq!(t.check(), Ok(()));
                }
            }
            t.evict_to(max);
            prop_assert_eq!(t.check(), Ok(()));
            for x in 0..3 {
                prop_assert!(t.size(w(x)) <= max);
            }
            t.remove_tenant(w(gone));
            prop_assert_eq!(t.check(), Ok(()));
            prop_assert_eq!(t.size(w(gone)), 0);
        }
    }
}
