//! RadixCache tests: scripted scenarios rendered as snapshots (the seeds' examples, splits,
//! paged keys, locks, evictions in each policy's order), the request-level calls with the
//! ownership checker after every step, and proptest against a naive reference model.

use std::collections::HashMap;

use kv_pool::{
    Allocator, ExtendRequest, Owner, OwnershipCheck, PagedAllocator, ReqRow, ReqToTokenPool, Slot,
};
use radix_cache::events::{digest_to_block_id, page_digest};
use radix_cache::policy::{policy_from_name, BuiltinPolicy};
use radix_cache::{
    InsertOptions, KvEvent, NodeId, PrefixCache, PrefixState, RadixCache, RadixCacheError, ReqView,
};

fn letter(t: u32) -> String {
    char::from(b'A' + (t as u8 - 1)).to_string()
}

fn toks(s: &str) -> Vec<u32> {
    s.bytes().map(|b| (b - b'A' + 1) as u32).collect()
}

/// A request as a scheduler would hold it.
struct Req {
    name: &'static str,
    tokens: Vec<u32>,
    row: ReqRow,
    committed: usize,
    state: PrefixState,
}

/// A cache, an allocator and a request table, with a log for snapshots.
struct Harness {
    cache: RadixCache,
    alloc: PagedAllocator,
    rows: ReqToTokenPool,
    /// Live requests: row → (cache_protected_len, committed_len).
    live: HashMap<ReqRow, (usize, usize)>,
    log: String,
}

impl Harness {
    fn new(page_size: u32, capacity: usize, policy: &str) -> Self {
        Harness {
            cache: RadixCache::new(page_size, policy_from_name(policy).unwrap()),
            alloc: PagedAllocator::new(capacity, page_size).unwrap(),
            rows: ReqToTokenPool::new(8, 64).unwrap(),
            live: HashMap::new(),
            log: String::new(),
        }
    }

    fn view<'a>(r: &'a mut Req) -> ReqView<'a> {
        ReqView {
            tokens: &r.tokens,
            extra_key: None,
            row: r.row,
            committed_len: r.committed,
            priority: 0,
            state: &mut r.state,
        }
    }

    /// Admits a request: a row, the cached prefix written into it, the prefix locked.
    fn admit(&mut self, name: &'static str, tokens: &str) -> Req {
        let tokens = toks(tokens);
        let row = self.rows.alloc_one().unwrap();
        let mut prefix = Vec::new();
        let m = self.cache.match_prefix(&tokens, None, &mut prefix);
        self.cache.inc_lock_ref(m.last_node).unwrap();
        self.rows.write(row, 0, &prefix).unwrap();
        let state = PrefixState {
            cache_protected_len: m.len,
            last_node: m.last_node,
            prefix_slots: prefix,
        };
        let r = Req {
            name,
            tokens,
            row,
            committed: m.len,
            state,
        };
        self.track(&r);
        self.step(&format!("admit {name}: matched {}", m.len));
        r
    }

    /// Computes KV for positions `committed..upto` (fresh slots) and caches the prefix.
    fn prefill(&mut self, r: &mut Req, upto: usize) {
        let last_loc =
            (r.committed > 0).then(|| self.rows.read(r.row, r.committed).unwrap()[r.committed - 1]);
        let mut out = Vec::new();
        self.alloc
            .alloc_extend(
                &[ExtendRequest {
                    prefix_len: r.committed,
                    seq_len: upto,
                    last_loc,
                }],
                &mut out,
            )
            .unwrap();
        self.rows.write(r.row, r.committed, &out).unwrap();
        r.committed = upto;
        self.cache
            .cache_unfinished_req(Self::view(r), &mut self.rows, &mut self.alloc, false)
            .unwrap();
        let desc = format!(
            "prefill {} to {upto} (new slots {:?})",
            r.name,
            out.iter().map(|s| s.0).collect::<Vec<_>>()
        );
        self.track(r);
        self.step(&desc);
    }

    fn finish(&mut self, mut r: Req) {
        self.cache
            .cache_finished_req(Self::view(&mut r), &self.rows, &mut self.alloc, true)
            .unwrap();
        self.rows.free(r.row).unwrap();
        self.live.remove(&r.row);
        self.step(&format!("finish {}", r.name));
    }

    fn track(&mut self, r: &Req) {
        self.live
            .insert(r.row, (r.state.cache_protected_len, r.committed));
    }

    /// Logs the tree and proves the partition: free pages, tree pages and each live request's
    /// private slots `[protected, committed)`.
    fn step(&mut self, what: &str) {
        self.cache.check_invariants().unwrap();
        let mut check = OwnershipCheck::new(&self.alloc);
        self.cache.claim_ownership(&mut check);
        let p = self.alloc.page_size() as usize;
        let mut private = 0;
        for (&row, &(protected, committed)) in &self.live {
            let slots = self.rows.read(row, committed).unwrap();
            check.claim(Owner::Request(row), &slots[protected..]);
            private += (committed - protected).div_ceil(p) * p;
        }
        check
            .finish()
            .unwrap_or_else(|v| panic!("after {what}: {v}"));
        let used = self.alloc.size() - self.alloc.available_size();
        assert_eq!(used, self.cache.total_size() + private, "after {what}");
        self.log += &format!("## {what}\n{}\n", self.cache.render_with(&letter));
    }
}

#[test]
fn snapshot_seed_examples() {
    let mut h = Harness::new(1, 64, "lru");
    // Example 1: the cache holds [A, B]; a request [A, B, C, D, E] inserts [C, D, E].
    let mut r1 = h.admit("r1", "AB");
    h.prefill(&mut r1, 2);
    h.finish(r1);
    let mut r2 = h.admit("r2", "ABCDE");
    assert_eq!(r2.state.cache_protected_len, 2);
    h.prefill(&mut r2, 5);
    assert_eq!(r2.state.cache_protected_len, 5);
    // Example 2: a request that matched [A, B, C] while [D, E] were not yet cached computes
    // [D, E, F, G, H] itself; inserting frees its duplicates of [D, E] and stores [F, G, H].
    let mut r3 = h.admit("r3", "ABCDEFGH");
    r3.committed = 3;
    r3.state.cache_protected_len = 3;
    // Re-point r3's lock at the node ending after C (as if it matched before D, E existed).
    let mut s = Vec::new();
    let m = h.cache.match_prefix(&toks("ABC"), None, &mut s);
    h.cache.inc_lock_ref(m.last_node).unwrap();
    h.cache.dec_lock_ref(r3.state.last_node).unwrap();
    r3.state.last_node = m.last_node;
    h.track(&r3);
    h.step("r3 holds only [A, B, C]");
    let before = h.alloc.available_size();
    h.prefill(&mut r3, 8);
    assert_eq!(
        h.alloc.available_size(),
        before - 5 + 2,
        "D, E duplicates freed"
    );
    h.finish(r2);
    h.finish(r3);
    insta::assert_snapshot!(h.log);
}

#[test]
fn snapshot_splits_paged_keys_and_partial_tails() {
    // P = 2: keys floor to whole pages, children are found by their first page, and the
    // unaligned tail stays private until the request finishes.
    let mut h = Harness::new(2, 64, "lru");
    let mut a = h.admit("a", "ABCDEFG");
    h.prefill(&mut a, 7);
    assert_eq!(
        a.state.cache_protected_len, 6,
        "the 7th token's page is private"
    );
    let mut b = h.admit("b", "ABCDXY");
    assert_eq!(b.state.cache_protected_len, 4, "split at a page boundary");
    h.prefill(&mut b, 6);
    let mut c = h.admit("c", "ABCE");
    assert_eq!(
        c.state.cache_protected_len, 2,
        "a mismatch inside a page floors the match"
    );
    h.prefill(&mut c, 4);
    h.finish(a);
    h.finish(b);
    h.finish(c);
    insta::assert_snapshot!(h.log);
}

/// Inserts `key` with fresh slots (the way a finished request would), returning the last node.
fn insert_fresh(
    cache: &mut RadixCache,
    alloc: &mut PagedAllocator,
    key: &[u32],
    opts: InsertOptions,
) -> NodeId {
    let mut prefix = Vec::new();
    let m = cache.match_prefix(key, None, &mut prefix);
    let mut fresh = Vec::new();
    alloc
        .alloc_extend(
            &[ExtendRequest {
                prefix_len: m.len,
                seq_len: key.len(),
                last_loc: prefix.last().copied(),
            }],
            &mut fresh,
        )
        .unwrap();
    prefix.extend_from_slice(&fresh);
    let r = cache.insert(key, None, &prefix, opts).unwrap();
    assert_eq!(r.prefix_len, m.len);
    let owned = r.prefix_len + r.inserted;
    if owned < prefix.len() {
        alloc.free(&prefix[owned..]).unwrap();
    }
    r.last_node
}

#[test]
fn snapshot_eviction_order_of_every_policy() {
    // Five leaves under a shared root node, with distinct creation, access, hits and priority.
    let mut log = String::new();
    let names: Vec<&str> = BuiltinPolicy::ALL
        .iter()
        .map(|p| p.as_str())
        .chain(["cost-aware"])
        .collect();
    for name in names {
        let mut cache =
            RadixCache::new(1, policy_from_name(name).unwrap()).with_partial_eviction(false);
        let mut alloc = PagedAllocator::new(64, 1).unwrap();
        let leaves = ["SA", "SBB", "SCCC", "SDDDD", "SE"];
        for (i, l) in leaves.iter().enumerate() {
            insert_fresh(
                &mut cache,
                &mut alloc,
                &toks(l),
                InsertOptions {
                    priority: [3, 1, 4, 0, 2][i],
                    chunked: false,
                },
            );
        }
        // Hits: SC three more times, SA once more; then touch SD last (most recent access).
        for key in ["SCCC", "SCCC", "SCCC", "SA"] {
            insert_fresh(&mut cache, &mut alloc, &toks(key), InsertOptions::default());
        }
        let mut out = Vec::new();
        cache.match_prefix(&toks("SDDDD"), None, &mut out);
        cache.check_invariants().unwrap();
        let mut order = Vec::new();
        while cache.evictable_size() > 0 {
            let (_, victim) = cache.eviction_order().remove(0);
            let freed = cache.evict(1, &mut alloc).unwrap();
            assert_eq!(freed, victim.len(), "whole-node eviction");
            cache.check_invariants().unwrap();
            order.push(victim.iter().map(|&t| letter(t)).collect::<String>());
        }
        log += &format!("{name:>10}: {}\n", order.join(" → "));
    }
    insta::assert_snapshot!(log);
}

#[test]
fn whole_node_eviction_as_sglang_overshoots_and_partial_does_not() {
    for partial in [false, true] {
        let mut cache =
            RadixCache::new(4, Box::new(BuiltinPolicy::Lru)).with_partial_eviction(partial);
        let mut alloc = PagedAllocator::new(256, 4).unwrap();
        insert_fresh(
            &mut cache,
            &mut alloc,
            &(1..=100).collect::<Vec<_>>(),
            InsertOptions::default(),
        );
        let freed = cache.evict(3, &mut alloc).unwrap();
        assert_eq!(freed, if partial { 4 } else { 100 });
        assert_eq!(cache.evictable_size(), 100 - freed);
        cache.check_invariants().unwrap();
        // What is left still matches, page-aligned.
        let mut out = Vec::new();
        let m = cache.match_prefix(&(1..=100).collect::<Vec<_>>(), None, &mut out);
        assert_eq!(m.len, 100 - freed);
    }
}

#[test]
fn locks_protect_and_move_sizes_exactly() {
    let mut cache = RadixCache::new(1, Box::new(BuiltinPolicy::Lru));
    let mut alloc = PagedAllocator::new(64, 1).unwrap();
    let ab = insert_fresh(
        &mut cache,
        &mut alloc,
        &toks("ABCD"),
        InsertOptions::default(),
    );
    let ax = insert_fresh(
        &mut cache,
        &mut alloc,
        &toks("ABXY"),
        InsertOptions::default(),
    );
    assert_eq!((cache.evictable_size(), cache.protected_size()), (6, 0));
    assert_eq!(
        cache.inc_lock_ref(ab).unwrap(),
        4,
        "AB and CD become protected"
    );
    assert_eq!(
        cache.inc_lock_ref(ax).unwrap(),
        2,
        "only XY is new; AB already locked"
    );
    assert_eq!((cache.evictable_size(), cache.protected_size()), (0, 6));
    assert_eq!(
        cache.evict(10, &mut alloc).unwrap(),
        0,
        "locked nodes are never evicted"
    );
    assert_eq!(cache.dec_lock_ref(ab).unwrap(), 2);
    assert_eq!(
        cache.evict(10, &mut alloc).unwrap(),
        2,
        "only CD was unlocked"
    );
    assert_eq!(cache.dec_lock_ref(ax).unwrap(), 4);
    assert_eq!(
        cache.dec_lock_ref(ax),
        Err(RadixCacheError::LockUnderflow(ax))
    );
    cache.check_invariants().unwrap();
    assert_eq!(cache.evict(10, &mut alloc).unwrap(), 4);
    assert!(
        matches!(cache.inc_lock_ref(ab), Err(RadixCacheError::StaleNode(_))),
        "evicted node handle"
    );
    assert_eq!(alloc.available_size(), 64);
}

#[test]
fn namespaces_never_share_nodes() {
    let mut cache = RadixCache::new(1, Box::new(BuiltinPolicy::Lru));
    let mut slots = Vec::new();
    let mut alloc = PagedAllocator::new(64, 1).unwrap();
    alloc.alloc(3, &mut slots).unwrap();
    cache
        .insert(
            &toks("ABC"),
            Some("lora-1"),
            &slots,
            InsertOptions::default(),
        )
        .unwrap();
    let mut out = Vec::new();
    assert_eq!(cache.match_prefix(&toks("ABC"), None, &mut out).len, 0);
    assert_eq!(
        cache
            .match_prefix(&toks("ABC"), Some("lora-2"), &mut out)
            .len,
        0
    );
    assert_eq!(
        cache
            .match_prefix(&toks("ABC"), Some("lora-1"), &mut out)
            .len,
        3
    );
    assert_eq!(cache.peek_prefix_len(&toks("ABD"), Some("lora-1")), 2);
    assert_eq!(cache.peek_prefix_len(&toks("ABD"), Some("nope")), 0);
}

#[test]
fn peek_does_not_split_or_touch() {
    let mut cache = RadixCache::new(1, Box::new(BuiltinPolicy::Lru));
    let mut alloc = PagedAllocator::new(64, 1).unwrap();
    insert_fresh(
        &mut cache,
        &mut alloc,
        &toks("ABCDEF"),
        InsertOptions::default(),
    );
    let before = cache.render_with(&letter);
    assert_eq!(cache.peek_prefix_len(&toks("ABCX"), None), 3);
    assert_eq!(cache.render_with(&letter), before);
    assert_eq!(cache.node_count(), 1);
}

#[test]
fn bad_input_is_refused() {
    let mut cache = RadixCache::new(2, Box::new(BuiltinPolicy::Lru));
    let mut alloc = PagedAllocator::new(64, 2).unwrap();
    let mut rows = ReqToTokenPool::new(2, 16).unwrap();
    assert!(matches!(
        cache.insert(&toks("ABCD"), None, &[Slot(2)], InsertOptions::default()),
        Err(RadixCacheError::LengthMismatch { .. })
    ));
    let row = rows.alloc_one().unwrap();
    let root = cache.root(None);
    let tokens = toks("ABCD");
    let mut state = PrefixState {
        cache_protected_len: 3,
        last_node: root,
        prefix_slots: vec![],
    };
    let view = ReqView {
        tokens: &tokens,
        extra_key: None,
        row,
        committed_len: 4,
        priority: 0,
        state: &mut state,
    };
    assert!(matches!(
        cache.cache_unfinished_req(view, &mut rows, &mut alloc, false),
        Err(RadixCacheError::InvalidRequest(_))
    ));
    let mut state = PrefixState::new(root);
    let view = ReqView {
        tokens: &tokens,
        extra_key: None,
        row,
        committed_len: 9,
        priority: 0,
        state: &mut state,
    };
    assert!(matches!(
        cache.cache_finished_req(view, &rows, &mut alloc, true),
        Err(RadixCacheError::LengthMismatch { .. })
    ));
    let stale = NodeId {
        index: 999,
        generation: 0,
    };
    assert_eq!(
        cache.inc_lock_ref(stale),
        Err(RadixCacheError::StaleNode(stale))
    );
    assert_eq!(cache.total_size(), 0);
    assert_eq!(alloc.available_size(), 64);
}

#[test]
fn events_carry_sglang_block_hashes() {
    let mut cache = RadixCache::new(2, Box::new(BuiltinPolicy::Lru)).with_events(true);
    let mut alloc = PagedAllocator::new(64, 2).unwrap();
    insert_fresh(
        &mut cache,
        &mut alloc,
        &[1, 2, 3, 4],
        InsertOptions::default(),
    );
    insert_fresh(
        &mut cache,
        &mut alloc,
        &[1, 2, 3, 4, 5, 6],
        InsertOptions::default(),
    );
    let d1 = page_digest(None, &[1, 2]);
    let d2 = page_digest(Some(&d1), &[3, 4]);
    let d3 = page_digest(Some(&d2), &[5, 6]);
    let ev = cache.take_events();
    assert_eq!(
        ev,
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![digest_to_block_id(&d1), digest_to_block_id(&d2)],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
            },
            KvEvent::BlockStored {
                block_hashes: vec![digest_to_block_id(&d3)],
                parent_block_hash: Some(digest_to_block_id(&d2)),
                token_ids: vec![5, 6],
                block_size: 2,
            },
        ]
    );
    cache.evict(2, &mut alloc).unwrap();
    assert_eq!(
        cache.take_events(),
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![digest_to_block_id(&d3)]
        }]
    );
    cache.reset(&mut alloc).unwrap();
    assert_eq!(cache.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert_eq!(alloc.available_size(), 64);
}

#[test]
fn reset_refuses_while_locked() {
    let mut cache = RadixCache::new(1, Box::new(BuiltinPolicy::Lru));
    let mut alloc = PagedAllocator::new(64, 1).unwrap();
    let n = insert_fresh(
        &mut cache,
        &mut alloc,
        &toks("ABC"),
        InsertOptions::default(),
    );
    cache.inc_lock_ref(n).unwrap();
    assert!(cache.reset(&mut alloc).is_err());
    assert_eq!(cache.total_size(), 3);
    cache.dec_lock_ref(n).unwrap();
    cache.reset(&mut alloc).unwrap();
    assert_eq!((cache.total_size(), alloc.available_size()), (0, 64));
}

// ---------------------------------------------------------------------------------------------
// Proptest against a reference model built from the cache's own KV events: the set of cached
// page-aligned prefixes (by SGLang block hash) with their slots.
// ---------------------------------------------------------------------------------------------

use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Insert(usize, usize, i64),
    Match(usize, usize),
    Lock(usize, usize),
    Unlock(usize),
    Evict(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..6, 1usize..24, -2i64..3).prop_map(|(b, l, p)| Op::Insert(b, l, p)),
        3 => (0usize..6, 0usize..24).prop_map(|(b, l)| Op::Match(b, l)),
        2 => (0usize..6, 1usize..24).prop_map(|(b, l)| Op::Lock(b, l)),
        2 => (0usize..8).prop_map(Op::Unlock),
        2 => (1usize..30).prop_map(Op::Evict),
    ]
}

/// Six base sequences sharing prefixes at different depths.
fn bases() -> Vec<Vec<u32>> {
    let trunk: Vec<u32> = (0..24).map(|i| 1 + i % 3).collect();
    let mut v = vec![trunk.clone()];
    for (fork, tok) in [(4, 7), (8, 8), (8, 9), (13, 10), (0, 11)] {
        let mut b = trunk[..fork].to_vec();
        b.extend((0..24 - fork).map(|i| tok + (i % 2) as u32));
        v.push(b);
    }
    v
}

#[derive(Default)]
struct Model {
    /// Block id of each cached page-aligned prefix → its page's slots.
    pages: HashMap<i64, Vec<Slot>>,
}

impl Model {
    fn apply(
        &mut self,
        events: Vec<KvEvent>,
        page: usize,
        tokens_slots: &HashMap<Vec<u32>, Vec<Slot>>,
    ) {
        for e in events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    ..
                } => {
                    // Look up the stored pages' slots from what we inserted.
                    let slots = tokens_slots.get(&token_ids).cloned();
                    for (k, h) in block_hashes.iter().enumerate() {
                        let s = slots
                            .as_ref()
                            .map(|s| s[k * page..(k + 1) * page].to_vec())
                            .unwrap_or_default();
                        assert!(self.pages.insert(*h, s).is_none(), "page stored twice");
                    }
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    for h in block_hashes {
                        assert!(self.pages.remove(&h).is_some(), "removed a page not cached");
                    }
                }
                KvEvent::AllBlocksCleared => self.pages.clear(),
            }
        }
    }

    /// The longest cached page-aligned prefix of `key`, with its slots.
    fn longest(&self, key: &[u32], page: usize) -> Vec<Slot> {
        let mut prev = None;
        let mut out = Vec::new();
        for p in key.chunks_exact(page) {
            let d = page_digest(prev.as_ref(), p);
            match self.pages.get(&digest_to_block_id(&d)) {
                Some(s) => out.extend_from_slice(s),
                None => break,
            }
            prev = Some(d);
        }
        out
    }
}

fn run_model(page: u32, policy: &str, ops: &[Op]) {
    let p = page as usize;
    let mut cache = RadixCache::new(page, policy_from_name(policy).unwrap()).with_events(true);
    let mut alloc = PagedAllocator::new(96 * p, page).unwrap();
    let bases = bases();
    let mut model = Model::default();
    let mut locks: Vec<NodeId> = Vec::new();
    for op in ops {
        // Stored run token ids → their slots, for the events of this op.
        let mut stored: HashMap<Vec<u32>, Vec<Slot>> = HashMap::new();
        match *op {
            Op::Insert(b, l, prio) => {
                let key = &bases[b][..l];
                let mut prefix = Vec::new();
                let m = cache.match_prefix(key, None, &mut prefix);
                model.apply(cache.take_events(), p, &stored);
                let need = key.len() - m.len;
                let short = need.div_ceil(p) * p;
                if alloc.available_size() < short {
                    cache
                        .evict(short - alloc.available_size(), &mut alloc)
                        .unwrap();
                    model.apply(cache.take_events(), p, &stored);
                }
                let mut fresh = Vec::new();
                let req = ExtendRequest {
                    prefix_len: m.len,
                    seq_len: key.len(),
                    last_loc: prefix.last().copied(),
                };
                if alloc.alloc_extend(&[req], &mut fresh).is_err() {
                    continue; // everything left is locked
                }
                prefix.extend_from_slice(&fresh);
                let aligned = key.len() / p * p;
                stored.insert(
                    key[m.len..aligned].to_vec(),
                    prefix[m.len..aligned].to_vec(),
                );
                let r = cache
                    .insert(
                        key,
                        None,
                        &prefix,
                        InsertOptions {
                            priority: prio,
                            chunked: false,
                        },
                    )
                    .unwrap();
                assert_eq!(r.prefix_len, m.len);
                assert_eq!(r.prefix_len + r.inserted, aligned);
                if aligned < prefix.len() {
                    alloc.free(&prefix[aligned..]).unwrap();
                }
            }
            Op::Match(b, l) => {
                let key = &bases[b][..l];
                let expected = model.longest(key, p);
                assert_eq!(cache.peek_prefix_len(key, None), expected.len());
                let mut out = Vec::new();
                let m = cache.match_prefix(key, None, &mut out);
                assert_eq!(out, expected, "match of {key:?}");
                assert_eq!(m.len, expected.len());
            }
            Op::Lock(b, l) => {
                let mut out = Vec::new();
                let m = cache.match_prefix(&bases[b][..l], None, &mut out);
                cache.inc_lock_ref(m.last_node).unwrap();
                locks.push(m.last_node);
            }
            Op::Unlock(i) => {
                if !locks.is_empty() {
                    let n = locks.remove(i % locks.len());
                    cache.dec_lock_ref(n).unwrap();
                }
            }
            Op::Evict(n) => {
                let before = cache.evictable_size();
                let freed = cache.evict(n, &mut alloc).unwrap();
                assert!(
                    freed >= n.min(before) && freed <= before,
                    "freed {freed} of {before} for {n}"
                );
            }
        }
        model.apply(cache.take_events(), p, &stored);
        cache.check_invariants().unwrap();
        let mut check = OwnershipCheck::new(&alloc);
        cache.claim_ownership(&mut check);
        check.finish().unwrap();
        assert_eq!(alloc.size() - alloc.available_size(), cache.total_size());
        assert_eq!(model.pages.len() * p, cache.total_size());
    }
    for n in locks {
        cache.dec_lock_ref(n).unwrap();
    }
    assert_eq!(cache.protected_size(), 0);
    cache.reset(&mut alloc).unwrap();
    assert_eq!(alloc.available_size(), alloc.size());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn matches_equal_the_reference_model(
        page in prop::sample::select(vec![1u32, 2, 4]),
        policy in prop::sample::select(vec!["lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "cost-aware"]),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run_model(page, policy, &ops);
    }
}

#[test]
fn chunk_cache_keeps_kv_private_and_frees_it_all_at_finish() {
    use radix_cache::ChunkCache;
    let mut cache = ChunkCache::new(4);
    let mut alloc = PagedAllocator::new(64, 4).unwrap();
    let mut rows = ReqToTokenPool::new(2, 32).unwrap();
    let tokens: Vec<u32> = (1..=10).collect();
    let mut out = Vec::new();
    let m = cache.match_prefix(&tokens, None, &mut out);
    assert_eq!((m.len, out.len()), (0, 0));
    let row = rows.alloc_one().unwrap();
    let mut state = PrefixState::new(m.last_node);
    // Two prefill chunks: 6 tokens, then 4.
    let mut committed = 0;
    for upto in [6, 10] {
        let last_loc = (committed > 0).then(|| rows.read(row, committed).unwrap()[committed - 1]);
        let mut fresh = Vec::new();
        alloc
            .alloc_extend(
                &[ExtendRequest {
                    prefix_len: committed,
                    seq_len: upto,
                    last_loc,
                }],
                &mut fresh,
            )
            .unwrap();
        rows.write(row, committed, &fresh).unwrap();
        committed = upto;
        let view = ReqView {
            tokens: &tokens,
            extra_key: None,
            row,
            committed_len: committed,
            priority: 0,
            state: &mut state,
        };
        cache
            .cache_unfinished_req(view, &mut rows, &mut alloc, true)
            .unwrap();
        assert_eq!(
            state.prefix_slots,
            rows.read(row, committed).unwrap(),
            "the request keeps its own KV"
        );
        assert_eq!(state.cache_protected_len, 0);
    }
    assert_eq!(alloc.available_size(), 64 - 12);
    let view = ReqView {
        tokens: &tokens,
        extra_key: None,
        row,
        committed_len: 10,
        priority: 0,
        state: &mut state,
    };
    cache
        .cache_finished_req(view, &rows, &mut alloc, true)
        .unwrap();
    assert_eq!(alloc.available_size(), 64, "everything freed");
    assert_eq!(
        (cache.total_size(), cache.evict(100, &mut alloc).unwrap()),
        (0, 0)
    );
    assert!(cache
        .inc_lock_ref(NodeId {
            index: 3,
            generation: 1
        })
        .is_err());
}

#[test]
fn peek_prefix_reports_the_deepest_node_and_parents_link_up() {
    let mut cache = RadixCache::new(1, Box::new(BuiltinPolicy::Lru));
    let mut alloc = PagedAllocator::new(64, 1).unwrap();
    let abcd = insert_fresh(
        &mut cache,
        &mut alloc,
        &toks("ABCD"),
        InsertOptions::default(),
    );
    let abxy = insert_fresh(
        &mut cache,
        &mut alloc,
        &toks("ABXY"),
        InsertOptions::default(),
    );
    // ABXY split ABCD into AB → {CD, XY}.
    let (len, node) = cache.peek_prefix(&toks("ABCDZ"), None);
    assert_eq!((len, node), (4, Some(abcd)));
    let ab = cache.parent(abcd).expect("AB above CD");
    assert_eq!(cache.parent(abxy), Some(ab));
    assert_eq!(cache.parent(ab), None, "the root is not reported");
    // A match ending inside XY reports XY (not split by peeking).
    assert_eq!(cache.peek_prefix(&toks("ABXQ"), None), (3, Some(abxy)));
    assert_eq!(cache.peek_prefix(&toks("Q"), None), (0, None));
    assert_eq!(cache.node_count(), 3);
}
