//! Matching, splitting and inserting (SGLang's `match_prefix`, `_split_node`, `insert`). Builds
//! on `arena` (nodes, links) and `index` (access statistics, the evictable index).

use kv_pool::{floor_to_page, Slot};

use crate::events::{digest_to_block_id, page_digest, KvEvent, PageDigest};
use crate::policy::{path_hash, EvictionPolicy};
use crate::radix::arena::{Children, Node, RadixCache, NONE};
use crate::{InsertOptions, InsertResult};

/// Where a read-only walk of a key stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Walk {
    /// The deepest node the key matched completely (the root if none).
    pub(super) node: u32,
    /// Tokens matched from the root through `node`.
    pub(super) matched: usize,
    /// A child of `node` the key matched part-way, if any.
    pub(super) partial: Option<PartialMatch>,
}

/// A child matched part-way by a walk: splitting it after `len` tokens makes the match whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PartialMatch {
    pub(super) child: u32,
    /// Tokens of the child matched, page-floored (`0 < len < child's length`).
    pub(super) len: usize,
}

impl Walk {
    /// Tokens matched in all, the partial child included.
    pub(super) fn len(&self) -> usize {
        self.matched + self.partial.map_or(0, |p| p.len)
    }
}

/// What a mutating match reached: after the split of a part-matched node, `last` holds the
/// key's last matched token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Matched {
    pub(super) last: u32,
    /// Tokens matched (a multiple of `P`).
    pub(super) len: usize,
}

/// What [`RadixCache::match_impl`] found: the whole match, and its part on device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TieredMatch {
    /// The deepest matched node (on device or host-only).
    pub(super) last: u32,
    /// Tokens matched, host-only nodes included.
    pub(super) len: usize,
    /// The deepest matched node on device (`last` without a host tier).
    pub(super) device: u32,
    /// Tokens matched on device (`len` without a host tier); that many slots were appended.
    pub(super) device_len: usize,
}

/// Longest common prefix of two token slices: 32 tokens at a time while they agree (branch-free
/// inside a chunk, so vector compares rather than a `memcmp` call), then 4 at a time with the
/// first difference read from an equality mask (one vector compare and a `movmsk` on x86), so
/// a mismatching chunk is never walked token by token.
fn lcp(a: &[u32], b: &[u32]) -> usize {
    const CHUNK: usize = 32;
    const LANES: usize = 4;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n {
        let (x, y) = (&a[i..i + CHUNK], &b[i..i + CHUNK]);
        if x.iter().zip(y).fold(0, |d, (s, t)| d | (s ^ t)) != 0 {
            break;
        }
        i += CHUNK;
    }
    while i + LANES <= n {
        let x: &[u32; LANES] = a[i..i + LANES].try_into().expect("LANES tokens");
        let y: &[u32; LANES] = b[i..i + LANES].try_into().expect("LANES tokens");
        let mut same = 0u32;
        for k in 0..LANES {
            same |= u32::from(x[k] == y[k]) << k;
        }
        if same != (1 << LANES) - 1 {
            return i + (!same).trailing_zeros() as usize;
        }
        i += LANES;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl<P: EvictionPolicy> RadixCache<P> {
    /// Splits `child` after its first `at` tokens (`0 < at < len`, a multiple of `P`); returns
    /// the new upper node, which takes the child's place under its parent.
    fn split(&mut self, child: u32, at: usize) -> u32 {
        let p = self.page_size as usize;
        debug_assert!(at > 0 && at < self.nodes[child as usize].len && at % p == 0);
        let c = &self.nodes[child as usize];
        let parent = c.parent;
        let upper_end_hash = if self.track_paths {
            self.node_tokens(child)[..at]
                .chunks(p)
                .fold(c.start_hash, path_hash)
        } else {
            0
        };
        // The upper half takes the child's statistics, field by field (no clone of the child's
        // children or digests).
        let upper = Node {
            generation: 0,
            live: true,
            parent,
            start: c.start,
            len: at,
            children: Children::default(),
            lock_ref: c.lock_ref,
            last_access: c.last_access,
            creation: c.creation,
            hit_count: c.hit_count,
            priority: c.priority,
            depth: c.depth,
            lineage: c.lineage,
            start_hash: c.start_hash,
            end_hash: upper_end_hash,
            digests: c.digests.get(..at / p).map_or_else(Vec::new, <[_]>::to_vec),
            indexed: None,
            on_device: c.on_device,
            backed_up: c.backed_up,
            // A pin protects the lower half from host eviction; the upper half has a child.
            host_ref: 0,
            device_children: 0,
        };
        let u = self.alloc_node(upper);
        self.replace_child(parent, child, u);
        {
            let lower = &mut self.nodes[child as usize];
            lower.parent = u;
            lower.start += at;
            lower.len -= at;
            lower.depth += at;
            // One more node above it now: the upper half (what a new leaf there would get).
            lower.lineage = lower.lineage.saturating_add(1);
            lower.start_hash = upper_end_hash;
            if !lower.digests.is_empty() {
                lower.digests.drain(..at / p);
            }
        }
        self.add_child(u, child);
        // The lower half keeps its place in the index, but its length and depth changed.
        let lower = &self.nodes[child as usize];
        if lower.indexed.is_some() || self.tier.is_some() {
            self.refresh(child);
        }
        u
    }

    /// Walks `key` (already page-floored) from `root` without changing anything.
    pub(super) fn walk(&self, root: u32, key: &[u32]) -> Walk {
        let p = self.page_size as usize;
        let (mut node, mut pos) = (root, 0);
        while pos < key.len() {
            let Some(c) = self.find_child(node, &key[pos..pos + p]) else {
                break;
            };
            let len = self.nodes[c as usize].len;
            // `find_child` compared the first page already.
            let same = p + lcp(&self.node_tokens(c)[p..], &key[pos + p..]);
            let common = if p == 1 { same } else { floor_to_page(same, p) };
            if common < len {
                let partial = (common > 0).then_some(PartialMatch {
                    child: c,
                    len: common,
                });
                return Walk {
                    node,
                    matched: pos,
                    partial,
                };
            }
            node = c;
            pos += len;
        }
        Walk {
            node,
            matched: pos,
            partial: None,
        }
    }

    /// Walks `key` (floored to pages here) from `root`, splitting a node matched part-way.
    pub(super) fn walk_and_split(&mut self, root: u32, key: &[u32]) -> Matched {
        let walk = self.walk(root, key);
        match walk.partial {
            Some(PartialMatch { child, len }) => Matched {
                last: self.split(child, len),
                len: walk.matched + len,
            },
            None => Matched {
                last: walk.node,
                len: walk.matched,
            },
        }
    }

    /// The deepest node on device at or above `i`, and the tokens from the root through it.
    pub(super) fn device_ancestor(&self, mut i: u32) -> (u32, usize) {
        while !self.nodes[i as usize].on_device {
            i = self.nodes[i as usize].parent;
        }
        let n = &self.nodes[i as usize];
        (i, n.depth + n.len)
    }

    /// SGLang's `match_prefix` under `root`: appends the slots of the matched path's on-device
    /// part to `out` (if given) and refreshes the access time of the whole matched path (host-only
    /// nodes at its end included).
    pub(super) fn match_impl(
        &mut self,
        root: u32,
        key: &[u32],
        out: Option<&mut Vec<Slot>>,
    ) -> TieredMatch {
        let p = self.page_size as usize;
        let key = &key[..floor_to_page(key.len(), p)];
        self.tick();
        let m = self.walk_and_split(root, key);
        self.matched_path(m, out)
    }

    /// The end of a match that reached `m` (the clock already ticked): appends the on-device
    /// part's slots to `out` (if given) and refreshes the access time of the whole path. Also
    /// what a caller that knows where a key ends (an insert just made it end at `m.last`) does
    /// instead of walking the key again.
    pub(super) fn matched_path(&mut self, m: Matched, out: Option<&mut Vec<Slot>>) -> TieredMatch {
        let (device, device_len) = if self.tier.is_some() {
            self.device_ancestor(m.last)
        } else {
            (m.last, m.len)
        };
        // One climb: access times bottom-up, gathering the path; then the on-device part's
        // slots root first (no padding written first). Host-only nodes sit below `device`.
        let mut path = std::mem::take(&mut self.path_scratch);
        path.clear();
        let mut i = m.last;
        while self.nodes[i as usize].parent != NONE {
            self.touch(i, false, None);
            path.push(i);
            i = self.nodes[i as usize].parent;
        }
        if let Some(out) = out {
            let on_device = path.iter().position(|&n| n == device).unwrap_or(path.len());
            out.reserve(device_len);
            for &i in path[on_device..].iter().rev() {
                out.extend_from_slice(self.node_slots(i));
            }
        }
        self.path_scratch = path;
        TieredMatch {
            last: m.last,
            len: m.len,
            device,
            device_len,
        }
    }

    /// SGLang's `insert` under `root` (`key` is floored to pages here; `slots` has one entry per
    /// key token). Host-only nodes on the matched path are revived: the caller's slots for them
    /// become their device slots, so `prefix_len` counts only the tokens already on device.
    pub(super) fn insert_impl(
        &mut self,
        root: u32,
        key: &[u32],
        slots: &[Slot],
        opts: InsertOptions,
    ) -> InsertResult {
        let p = self.page_size as usize;
        let key = &key[..floor_to_page(key.len(), p)];
        self.tick();
        let Matched {
            last: node,
            len: pos,
        } = self.walk_and_split(root, key);
        // Matched path: hits (unless chunked), access, priority.
        let mut i = node;
        while self.nodes[i as usize].parent != NONE {
            self.touch(i, !opts.chunked, Some(opts.priority));
            i = self.nodes[i as usize].parent;
        }
        let on_device = if self.tier.is_some() {
            self.revive_path(node, slots)
        } else {
            pos
        };
        if pos == key.len() {
            return InsertResult {
                prefix_len: on_device,
                inserted: pos - on_device,
                last_node: self.id(node),
            };
        }
        let leaf = self.new_leaf(node, &key[pos..], &slots[pos..key.len()], opts, true);
        InsertResult {
            prefix_len: on_device,
            inserted: key.len() - on_device,
            last_node: self.id(leaf),
        }
    }

    /// Revives the host-only nodes at the end of the path root → `last`: `slots` (one per token
    /// from the root) become their device slots. Returns the tokens that were on device before.
    fn revive_path(&mut self, last: u32, slots: &[Slot]) -> usize {
        let (top, device_len) = self.device_ancestor(last);
        let mut chain = Vec::new();
        let mut i = last;
        while i != top {
            chain.push(i);
            i = self.nodes[i as usize].parent;
        }
        for &i in chain.iter().rev() {
            let n = &self.nodes[i as usize];
            let (start, depth, len) = (n.start, n.depth, n.len);
            self.slots[start..start + len].copy_from_slice(&slots[depth..depth + len]);
            self.attach_device(i);
        }
        device_len
    }

    /// Makes host-only node `i` (whose parent is on device) an on-device node again, its device
    /// slots already written to the arena: sizes, the parent's device-child count, both
    /// indexes, and a `BlockStored` event.
    pub(super) fn attach_device(&mut self, i: u32) {
        let n = &mut self.nodes[i as usize];
        debug_assert!(!n.on_device);
        n.on_device = true;
        let (parent, len, locked) = (n.parent, n.len, n.lock_ref > 0);
        if locked {
            self.protected += len;
        } else {
            self.evictable += len;
        }
        self.nodes[parent as usize].device_children += 1;
        if self.events_enabled {
            let p = self.page_size as usize;
            let parent_block = self.parent_block(parent);
            let n = &self.nodes[i as usize];
            self.events.push(KvEvent::BlockStored {
                block_hashes: n.digests.iter().map(digest_to_block_id).collect(),
                parent_block_hash: parent_block,
                token_ids: self.node_tokens(i).to_vec(),
                block_size: p as u32,
            });
        }
        self.refresh(i);
        self.refresh(parent);
    }

    /// A new child of `parent` holding `key` with device `slots` (`on_device`), or a host-only
    /// child whose host slots the caller writes (`!on_device`: no event, no device size).
    pub(super) fn new_leaf(
        &mut self,
        parent: u32,
        key: &[u32],
        slots: &[Slot],
        opts: InsertOptions,
        on_device: bool,
    ) -> u32 {
        let p = self.page_size as usize;
        let start = self.tokens.len();
        self.reserve_arenas(key.len());
        self.tokens.extend_from_slice(key);
        self.slots.extend_from_slice(slots);
        if self.tier.is_some() {
            self.host_slots.resize(self.tokens.len(), Slot::PADDING);
        }
        let par = &self.nodes[parent as usize];
        let start_hash = par.end_hash;
        let depth = par.depth + par.len;
        let lineage = par.lineage.saturating_add(1);
        let end_hash = if self.track_paths {
            key.chunks(p).fold(start_hash, path_hash)
        } else {
            0
        };
        // Digests serve events and, with an L3 store, storage keys.
        let keep_digests = self.events_enabled || self.tier.as_ref().is_some_and(|t| t.storage);
        let digests = if keep_digests {
            let mut prev = par
                .digests
                .last()
                .copied()
                .or_else(|| self.last_digest_above(parent));
            let parent_block = self.parent_block(parent);
            let mut d = Vec::with_capacity(key.len() / p);
            for page in key.chunks(p) {
                let digest = page_digest(prev.as_ref(), page);
                d.push(digest);
                prev = Some(digest);
            }
            if on_device && self.events_enabled {
                self.events.push(KvEvent::BlockStored {
                    block_hashes: d.iter().map(digest_to_block_id).collect(),
                    parent_block_hash: parent_block,
                    token_ids: key.to_vec(),
                    block_size: self.page_size,
                });
            }
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
            lineage,
            start_hash,
            end_hash,
            digests,
            indexed: None,
            on_device,
            backed_up: false,
            host_ref: 0,
            device_children: 0,
        });
        self.add_child(parent, leaf);
        if on_device {
            self.evictable += key.len();
        }
        // The parent may have been an evictable leaf (of either index).
        let par = &self.nodes[parent as usize];
        if par.indexed.is_some() || self.tier.is_some() {
            self.refresh(parent);
        }
        self.refresh(leaf);
        leaf
    }

    /// The block id an event reports as the parent of pages stored below node `i`: its last
    /// page's, or none below a root (whose digest, if any, is only its namespace's seed).
    fn parent_block(&self, i: u32) -> Option<i64> {
        if self.nodes[i as usize].parent == NONE {
            return None;
        }
        self.last_digest_above(i).map(|d| digest_to_block_id(&d))
    }

    /// The block digest of the nearest page above node `i` (inclusive), for chaining events (a
    /// non-default namespace's root holds its seed).
    pub(super) fn last_digest_above(&self, mut i: u32) -> Option<PageDigest> {
        while i != NONE {
            if let Some(d) = self.nodes[i as usize].digests.last() {
                return Some(*d);
            }
            i = self.nodes[i as usize].parent;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::lcp;

    proptest! {
        /// `lcp` is where two keys first differ, whatever the lengths and wherever the cut falls
        /// against its 32- and 4-token chunks.
        #[test]
        fn lcp_is_the_first_difference(
            a in prop::collection::vec(any::<u32>(), 0..200),
            cut in 0usize..220,
            tail in prop::collection::vec(any::<u32>(), 0..40),
        ) {
            let mut b = a[..cut.min(a.len())].to_vec();
            if let Some(&t) = a.get(cut) {
                b.push(t ^ 1);
            }
            b.extend(tail);
            let naive = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            prop_assert_eq!(lcp(&a, &b), naive);
            prop_assert_eq!(lcp(&b, &a), naive);
        }
    }
}
