//! [`LeafOrder`]: the evictable leaves in (policy key, node index) order, the first to go
//! first. Plain data over node indices; it knows nothing of the tree.
//!
//! Two parts, one order: an intrusive doubly linked list of the entries that arrived in
//! ascending order (each greater than the list's tail when it came), and a `BTreeSet` for the
//! rest. Under a policy whose keys grow with each access (LRU: the key is the access tick) almost
//! every entry arrives as the greatest, so insert, remove and `first` are O(1) list operations;
//! an entry that arrives out of order (a parent that becomes a leaf again with its old key, any
//! entry of a policy whose keys do not grow) goes to the set. The first entry is the smaller of
//! the two heads, so the order is exactly the one a single ordered set would give, whatever the
//! policy returns.

use std::collections::BTreeSet;

use crate::policy::EvictionKey;

/// No node (list ends).
const NIL: u32 = u32::MAX;

/// Where an indexed node sits in the list.
#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    /// Whether the node is in the list (not the set).
    in_list: bool,
    /// Its key, while it is in the list.
    key: EvictionKey,
}

const UNLINKED: Link = Link {
    prev: NIL,
    next: NIL,
    in_list: false,
    key: EvictionKey::new(0, 0),
};

/// The evictable leaves ordered by (key, node index).
#[derive(Debug, Default)]
pub(super) struct LeafOrder {
    /// Whether in-order arrivals go to the list (the policy's keys grow with access); when off,
    /// everything goes to the set.
    use_list: bool,
    /// Per node index: its list links (grown on demand).
    links: Vec<Link>,
    head: u32,
    tail: u32,
    listed: usize,
    set: BTreeSet<(EvictionKey, u32)>,
}

impl LeafOrder {
    /// An empty order; `use_list` as the policy's `keys_grow_with_access`.
    pub(super) fn new(use_list: bool) -> Self {
        LeafOrder {
            use_list,
            links: Vec::new(),
            head: NIL,
            tail: NIL,
            listed: 0,
            set: BTreeSet::new(),
        }
    }

    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.listed + self.set.len()
    }

    /// Empties the order (the list mode stays).
    pub(super) fn clear(&mut self) {
        self.links.clear();
        self.head = NIL;
        self.tail = NIL;
        self.listed = 0;
        self.set.clear();
    }

    /// Adds node `i` (not held) under `key`.
    pub(super) fn insert(&mut self, key: EvictionKey, i: u32) {
        let after_tail =
            self.tail == NIL || (self.links[self.tail as usize].key, self.tail) < (key, i);
        if !(self.use_list && after_tail) {
            self.set.insert((key, i));
            return;
        }
        let ix = i as usize;
        if self.links.len() <= ix {
            // Doubling: nodes are numbered densely, so this grows once per doubling.
            let len = (ix + 1).max(2 * self.links.len());
            self.links.resize(len, UNLINKED);
        }
        self.links[ix] = Link {
            prev: self.tail,
            next: NIL,
            in_list: true,
            key,
        };
        if self.tail == NIL {
            self.head = i;
        } else {
            self.links[self.tail as usize].next = i;
        }
        self.tail = i;
        self.listed += 1;
    }

    /// Moves node `i` from key `old` to key `new`. The list's tail whose key grows (LRU's
    /// leaf touched again: a match and the insert after it) only takes the new key in place.
    pub(super) fn rekey(&mut self, old: EvictionKey, new: EvictionKey, i: u32) {
        if self.tail == i && new >= old {
            if let Some(link) = self.links.get_mut(i as usize).filter(|l| l.in_list) {
                link.key = new;
                return;
            }
        }
        self.remove(old, i);
        self.insert(new, i);
    }

    /// Removes node `i`, held under `key`.
    pub(super) fn remove(&mut self, key: EvictionKey, i: u32) {
        let ix = i as usize;
        match self.links.get(ix) {
            Some(&Link {
                prev,
                next,
                in_list: true,
                ..
            }) => {
                if prev == NIL {
                    self.head = next;
                } else {
                    self.links[prev as usize].next = next;
                }
                if next == NIL {
                    self.tail = prev;
                } else {
                    self.links[next as usize].prev = prev;
                }
                self.links[ix] = UNLINKED;
                self.listed -= 1;
            }
            _ => {
                self.set.remove(&(key, i));
            }
        }
    }

    /// Whether node `i` is held under `key`.
    pub(super) fn contains(&self, key: EvictionKey, i: u32) -> bool {
        match self.links.get(i as usize) {
            Some(l) if l.in_list => l.key == key,
            _ => self.set.contains(&(key, i)),
        }
    }

    /// The entry to go first.
    pub(super) fn first(&self) -> Option<(EvictionKey, u32)> {
        let listed = (self.head != NIL).then(|| (self.links[self.head as usize].key, self.head));
        match (listed, self.set.first().copied()) {
            (Some(l), Some(s)) => Some(l.min(s)),
            (l, s) => l.or(s),
        }
    }

    /// Every entry, first to go first.
    pub(super) fn iter(&self) -> impl Iterator<Item = (EvictionKey, u32)> + '_ {
        let mut listed =
            std::iter::successors((self.head != NIL).then_some(self.head), move |&i| {
                let next = self.links[i as usize].next;
                (next != NIL).then_some(next)
            })
            .map(move |i| (self.links[i as usize].key, i))
            .peekable();
        let mut set = self.set.iter().copied().peekable();
        std::iter::from_fn(move || match (listed.peek(), set.peek()) {
            (Some(l), Some(s)) if l < s => listed.next(),
            (Some(_), Some(_)) | (None, Some(_)) => set.next(),
            (Some(_), None) => listed.next(),
            (None, None) => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(p: i64) -> EvictionKey {
        EvictionKey::new(p, 0)
    }

    /// Against a plain ordered set, over random inserts and removes in both modes.
    #[test]
    fn orders_as_one_ordered_set() {
        for use_list in [false, true] {
            let mut order = LeafOrder::new(use_list);
            let mut reference = BTreeSet::new();
            let mut held: Vec<Option<EvictionKey>> = vec![None; 64];
            let mut rng = kv_pool::rng::SplitMix64::new(7);
            let mut clock = 0i64;
            for step in 0..20_000 {
                let i = (rng.next_u64() % 64) as u32;
                match held[i as usize] {
                    Some(key) if rng.next_u64() % 3 == 0 => {
                        // A touch: the key grows (usually) or drops back.
                        clock += (rng.next_u64() % 2) as i64;
                        let new = k(clock - (rng.next_u64() % 8 == 0) as i64 * 40);
                        assert!(order.contains(key, i));
                        order.rekey(key, new, i);
                        reference.remove(&(key, i));
                        reference.insert((new, i));
                        held[i as usize] = Some(new);
                    }
                    Some(key) => {
                        assert!(order.contains(key, i));
                        order.remove(key, i);
                        reference.remove(&(key, i));
                        held[i as usize] = None;
                    }
                    None => {
                        // Mostly growing keys (ties included), sometimes an old one.
                        clock += (rng.next_u64() % 2) as i64;
                        let key = if rng.next_u64() % 4 == 0 {
                            k(clock - (rng.next_u64() % 50) as i64)
                        } else {
                            k(clock)
                        };
                        order.insert(key, i);
                        reference.insert((key, i));
                        held[i as usize] = Some(key);
                    }
                }
                assert_eq!(order.len(), reference.len(), "step {step}");
                assert_eq!(order.first(), reference.first().copied(), "step {step}");
                if step % 97 == 0 {
                    let all: Vec<_> = order.iter().collect();
                    let want: Vec<_> = reference.iter().copied().collect();
                    assert_eq!(all, want, "step {step}");
                }
            }
            order.clear();
            assert_eq!((order.len(), order.first()), (0, None));
        }
    }
}
