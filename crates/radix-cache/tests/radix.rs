//! RadixCache tests: scripted scenarios through the exported request harness rendered as
//! snapshots (the seeds' examples, splits, paged keys, locks, evictions in each policy's
//! order), and the exported suites (`radix_cache::testing`: the request flow with the ownership
//! checker after every step, the proptest against a reference model, the eviction-policy check)
//! on every cache and policy this crate has.

use kv_pool::{Allocator, ExtendRequest, PagedAllocator, ReqToTokenPool, Slot};
use radix_cache::events::{digest_to_block_id, page_digest};
use radix_cache::policy::{policy_from_name, Belady, CostAware, FutureIndex, LineageTtl};
use radix_cache::testing::{self, RequestHarness};
use radix_cache::{
    AnyEvictionPolicy, BuiltinPolicy, ChunkCache, EvictionKey, EvictionPolicy, InsertOptions,
    KvEvent, NodeId, NodeStats, PrefixCache, PrefixPeek, PrefixState, RadixCache, RadixCacheError,
    ReqView,
};

fn letter(t: u32) -> String {
    char::from(b'A' + (t as u8 - 1)).to_string()
}

fn toks(s: &str) -> Vec<u32> {
    s.bytes().map(|b| (b - b'A' + 1) as u32).collect()
}

/// The exported request harness over a radix cache, logging the tree after every step.
fn harness(page_size: u32, capacity: usize, policy: &str) -> RequestHarness<RadixCache> {
    RequestHarness::new(
        RadixCache::new(page_size, policy_from_name(policy).unwrap()),
        capacity,
    )
    .with_render(|c: &RadixCache| c.render_with(&letter))
}

#[test]
fn snapshot_seed_examples() {
    let mut h = harness(1, 64, "lru");
    // Example 1: the cache holds [A, B]; a request [A, B, C, D, E] inserts [C, D, E].
    let mut r1 = h.admit("r1", &toks("AB"));
    h.prefill(&mut r1, 2);
    h.finish(r1);
    let mut r2 = h.admit("r2", &toks("ABCDE"));
    assert_eq!(r2.state.cache_protected_len, 2);
    h.prefill(&mut r2, 5);
    assert_eq!(r2.state.cache_protected_len, 5);
    // Example 2: a request that matched [A, B, C] while [D, E] were not yet cached computes
    // [D, E, F, G, H] itself; inserting frees its duplicates of [D, E] and stores [F, G, H].
    let mut r3 = h.admit("r3", &toks("ABCDEFGH"));
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
    let mut h = harness(2, 64, "lru");
    let mut a = h.admit("a", &toks("ABCDEFG"));
    h.prefill(&mut a, 7);
    assert_eq!(
        a.state.cache_protected_len, 6,
        "the 7th token's page is private"
    );
    let mut b = h.admit("b", &toks("ABCDXY"));
    assert_eq!(b.state.cache_protected_len, 4, "split at a page boundary");
    h.prefill(&mut b, 6);
    let mut c = h.admit("c", &toks("ABCE"));
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
fn insert_fresh<P: EvictionPolicy>(
    cache: &mut RadixCache<P>,
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

/// Keys a leaf by (depth, lineage) and logs each victim's key, to read lineages back.
#[derive(Debug, Clone, Default)]
struct LogsLineage(std::sync::Arc<std::sync::Mutex<Vec<(i64, i64)>>>);

impl EvictionPolicy for LogsLineage {
    fn name(&self) -> &str {
        "logs-lineage"
    }
    fn key(&mut self, node: &NodeStats) -> EvictionKey {
        EvictionKey::new(node.depth as i64, i64::from(node.lineage))
    }
    fn on_evict(&mut self, key: EvictionKey) {
        self.0.lock().unwrap().push((key.primary, key.secondary));
    }
}

#[test]
fn lineage_counts_the_nodes_on_the_root_path_at_creation() {
    let log = LogsLineage::default();
    let mut cache = RadixCache::with_policy(1, log.clone()).with_partial_eviction(false);
    let mut alloc = PagedAllocator::new(64, 1).unwrap();
    // SAB: one node under the root (lineage 1). SAC splits it into SA (1) and B (2), and hangs
    // C (2) under SA; SACD hangs D (3) under C: the turns of a conversation.
    for key in ["SAB", "SAC", "SACD"] {
        insert_fresh(&mut cache, &mut alloc, &toks(key), InsertOptions::default());
    }
    while cache.evictable_size() > 0 {
        cache.evict(1, &mut alloc).unwrap();
    }
    // (depth, lineage) of each victim: B, D, then C and SA as they become leaves.
    assert_eq!(*log.0.lock().unwrap(), [(2, 2), (3, 3), (2, 2), (0, 1)]);
}

#[test]
fn snapshot_eviction_order_of_every_policy() {
    // Five leaves under a shared root node, with distinct creation, access, hits and priority.
    let mut log = String::new();
    let names: Vec<&str> = BuiltinPolicy::ALL
        .iter()
        .map(|p| p.as_str())
        .chain(["cost-aware", "lineage-ttl"])
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
        let mut cache = RadixCache::new(4, BuiltinPolicy::Lru).with_partial_eviction(partial);
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
    let mut cache = RadixCache::new(1, BuiltinPolicy::Lru);
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
    let mut cache = RadixCache::new(1, BuiltinPolicy::Lru);
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
    let mut cache = RadixCache::new(1, BuiltinPolicy::Lru);
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
    let mut cache = RadixCache::new(2, BuiltinPolicy::Lru);
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
    let mut cache = RadixCache::new(2, BuiltinPolicy::Lru).with_events(true);
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
    let mut cache = RadixCache::new(1, BuiltinPolicy::Lru);
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
// The exported suites (`radix_cache::testing`) on this crate's caches and policies: the request
// harness and the proptest against a reference model built from the cache's own KV events (the
// set of cached page-aligned prefixes by SGLang block hash, with their slots), and the
// eviction-policy check.
// ---------------------------------------------------------------------------------------------

/// Belady over the suites' workload sequences at page size `page`.
fn belady(page: u32) -> Belady {
    let bases = testing::base_sequences();
    Belady::new(FutureIndex::new(page, bases.iter().map(|b| b.as_slice())))
}

#[test]
fn every_builtin_policy_passes_the_prefix_cache_suite() {
    for policy in BuiltinPolicy::ALL {
        testing::check_prefix_cache(|page| RadixCache::new(page, policy).with_events(true));
    }
}

#[test]
fn cost_aware_lineage_ttl_and_belady_pass_the_prefix_cache_suite() {
    testing::check_prefix_cache(|page| {
        RadixCache::new(page, CostAware::default()).with_events(true)
    });
    testing::check_prefix_cache(|page| {
        RadixCache::new(page, LineageTtl::new(40)).with_events(true)
    });
    testing::check_prefix_cache(|page| RadixCache::new(page, belady(page)).with_events(true));
}

#[test]
fn whole_node_eviction_passes_the_prefix_cache_suite() {
    testing::check_prefix_cache(|page| {
        RadixCache::new(page, BuiltinPolicy::Lru)
            .with_events(true)
            .with_partial_eviction(false)
    });
}

#[test]
fn chunk_cache_passes_the_prefix_cache_suite() {
    testing::check_prefix_cache(ChunkCache::new);
}

#[test]
fn every_policy_passes_the_eviction_policy_check() {
    for policy in BuiltinPolicy::ALL {
        testing::check_eviction_policy(policy);
    }
    testing::check_eviction_policy(CostAware::default());
    testing::check_eviction_policy(CostAware::new(1.0, 0.01));
    testing::check_eviction_policy(LineageTtl::default());
    // A horizon about the workloads' tick spans, so holds reorder leaves there.
    testing::check_eviction_policy(LineageTtl::new(40));
    testing::check_eviction_policy(AnyEvictionPolicy::from_name("lineage-ttl").unwrap());
    testing::check_eviction_policy(belady(1));
    testing::check_eviction_policy(AnyEvictionPolicy::from(belady(2)));
}

/// A policy whose keys depend on how often it was asked: the cache's stored keys would go stale.
#[derive(Debug, Clone, Default)]
struct CountsCalls(i64);

impl EvictionPolicy for CountsCalls {
    fn name(&self) -> &str {
        "counts-calls"
    }
    fn key(&mut self, node: &NodeStats) -> EvictionKey {
        self.0 += 1;
        EvictionKey::new(node.last_access as i64, self.0)
    }
}

#[test]
#[should_panic(expected = "two keys for the same stats")]
fn the_eviction_policy_check_refuses_a_nondeterministic_key() {
    testing::check_eviction_policy(CountsCalls::default());
}

#[test]
fn reference_model_regressions() {
    // Shrunk from a proptest failure: page 1, lru.
    use testing::CacheOp::{Insert, Match};
    testing::run_cache_ops(
        RadixCache::new(1, BuiltinPolicy::Lru).with_events(true),
        &[Insert(1, 5, 0), Match(0, 1)],
    );
}

#[test]
fn chunk_cache_keeps_kv_private_and_frees_it_all_at_finish() {
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
    let mut cache = RadixCache::new(1, BuiltinPolicy::Lru);
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
    let peek = cache.peek_prefix(&toks("ABCDZ"), None);
    assert_eq!((peek.len, peek.deepest), (4, Some(abcd)));
    let ab = cache.parent(abcd).expect("AB above CD");
    assert_eq!(cache.parent(abxy), Some(ab));
    assert_eq!(cache.parent(ab), None, "the root is not reported");
    // A match ending inside XY reports XY (not split by peeking).
    let peek = cache.peek_prefix(&toks("ABXQ"), None);
    assert_eq!((peek.len, peek.deepest), (3, Some(abxy)));
    assert_eq!(cache.peek_prefix(&toks("Q"), None), PrefixPeek::default());
    assert_eq!(cache.node_count(), 3);
}
