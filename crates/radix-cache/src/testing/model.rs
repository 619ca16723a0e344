//! The reference model: random workloads of inserts, matches, locks, unlocks and evictions over
//! six sequences sharing prefixes, checked step by step against the set of cached page-aligned
//! prefixes rebuilt from the cache's own KV events (keyed by SGLang block hash), with the
//! invariants and the ownership partition after every operation.

use std::collections::HashMap;

use kv_pool::{Allocator, ExtendRequest, OwnershipCheck, PagedAllocator, Slot};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

use crate::events::{digest_to_block_id, page_digest, KvEvent};
use crate::{InsertOptions, NodeId, PrefixCache};

/// One operation of a random workload. Sequences are indices into [`base_sequences`]; a key is
/// a sequence's first `len` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheOp {
    /// `Insert(sequence, len, priority)`: match the key, allocate the rest (evicting if the
    /// pool is short), insert, free what the cache did not take.
    Insert(usize, usize, i64),
    /// `Match(sequence, len)`: the match (and the peek) must return the model's longest prefix.
    Match(usize, usize),
    /// `Lock(sequence, len)`: match and lock the last node.
    Lock(usize, usize),
    /// `Unlock(i)`: drop held lock number `i % held` (nothing if none is held).
    Unlock(usize),
    /// `Evict(tokens)`: evict at least that many tokens, or everything evictable.
    Evict(usize),
}

/// A random [`CacheOp`], weighted towards inserts and matches.
pub fn cache_op() -> impl Strategy<Value = CacheOp> {
    prop_oneof![
        4 => (0usize..6, 1usize..24, -2i64..3).prop_map(|(b, l, p)| CacheOp::Insert(b, l, p)),
        3 => (0usize..6, 0usize..24).prop_map(|(b, l)| CacheOp::Match(b, l)),
        2 => (0usize..6, 1usize..24).prop_map(|(b, l)| CacheOp::Lock(b, l)),
        2 => (0usize..8).prop_map(CacheOp::Unlock),
        2 => (1usize..30).prop_map(CacheOp::Evict),
    ]
}

/// A random workload: a page size of 1, 2 or 4 and up to 79 operations.
pub fn workload() -> impl Strategy<Value = (u32, Vec<CacheOp>)> {
    (
        prop::sample::select(vec![1u32, 2, 4]),
        prop::collection::vec(cache_op(), 1..80),
    )
}

/// Runs `check(page_size, ops)` on `cases` random [`workload`]s; panics with `what` and the
/// smallest failing workload proptest finds. The workloads come from a fixed seed, so a suite
/// run is reproducible (the same cases on every machine, as kv-pool's allocator suite).
pub(super) fn for_random_workloads(cases: u32, what: &str, check: impl Fn(u32, &[CacheOp])) {
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    let result = TestRunner::new_with_rng(config, rng).run(&workload(), |(page, ops)| {
        check(page, &ops);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{what}: {e}");
    }
}

/// The six 24-token sequences the workloads draw keys from: a trunk of `1 2 3 1 2 3 …` and
/// five branches leaving it after 4, 8, 8, 13 and 0 tokens (e.g. to build a
/// [`crate::policy::FutureIndex`] over).
pub fn base_sequences() -> Vec<Vec<u32>> {
    let trunk: Vec<u32> = (0..24).map(|i| 1 + i % 3).collect();
    let mut v = vec![trunk.clone()];
    for (fork, tok) in [(4, 7), (8, 8), (8, 9), (13, 10), (0, 11)] {
        let mut b = trunk[..fork].to_vec();
        b.extend((0..24 - fork).map(|i| tok + (i % 2) as u32));
        v.push(b);
    }
    v
}

/// What the cache holds according to its own events.
#[derive(Default)]
struct Model {
    /// Block id of each cached page-aligned prefix → its page's slots.
    pages: HashMap<i64, Vec<Slot>>,
}

impl Model {
    fn apply(&mut self, events: Vec<KvEvent>, page: usize, page_slots: &HashMap<i64, Vec<Slot>>) {
        for e in events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    ..
                } => {
                    // Look up the stored pages' slots from what we inserted, page by page (a
                    // run may be stored in parts: a cache with a host tier revives host-only
                    // nodes inside an inserted run one node at a time).
                    debug_assert_eq!(token_ids.len(), block_hashes.len() * page);
                    for h in &block_hashes {
                        let s = page_slots.get(h).cloned().unwrap_or_default();
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

/// How a workload run reaches the cache where a suite wants more than the plain calls.
pub(super) trait Driver<C: PrefixCache> {
    /// Called before operation number `i` (0-based).
    fn before_op(&mut self, _cache: &mut C, _i: usize) {}
    /// Evicts at least `n` tokens (or everything evictable); returns the tokens freed.
    fn evict(&mut self, cache: &mut C, n: usize, alloc: &mut PagedAllocator) -> usize {
        cache.evict(n, alloc).expect("evict")
    }
    /// Called after each operation with the nodes the workload holds locks on.
    fn after_op(&mut self, _cache: &C, _locked: &[NodeId]) {}
}

/// The plain calls.
pub(super) struct Plain;

impl<C: PrefixCache> Driver<C> for Plain {}

/// Runs `ops` through `cache` (built with KV events on) against the reference model, checking
/// after every operation; panics with what went wrong. Replays a case a failed
/// [`super::check_prefix_cache`] printed.
pub fn run_cache_ops<C: PrefixCache>(cache: C, ops: &[CacheOp]) {
    run_with(cache, ops, &mut Plain);
}

pub(super) fn run_with<C: PrefixCache>(mut cache: C, ops: &[CacheOp], driver: &mut dyn Driver<C>) {
    let page = cache.page_size();
    let p = page as usize;
    let mut alloc = PagedAllocator::new(96 * p, page).expect("model pool");
    let bases = base_sequences();
    let mut model = Model::default();
    let mut locks: Vec<NodeId> = Vec::new();
    // A cache that says it reuses prefixes stores every insert whole; one that does not stores
    // nothing.
    let reuses = cache.reuses_prefixes();
    for (i, op) in ops.iter().enumerate() {
        driver.before_op(&mut cache, i);
        // Block id of each page this op inserts → its slots, for the events of this op.
        let mut stored: HashMap<i64, Vec<Slot>> = HashMap::new();
        match *op {
            CacheOp::Insert(b, l, prio) => {
                let key = &bases[b][..l];
                let mut prefix = Vec::new();
                let m = cache.match_prefix(key, None, &mut prefix);
                model.apply(cache.take_events(), p, &stored);
                let need = key.len() - m.len;
                let short = need.div_ceil(p) * p;
                if alloc.available_size() < short {
                    driver.evict(&mut cache, short - alloc.available_size(), &mut alloc);
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
                let mut prev = None;
                for (k, page_tokens) in key[..aligned].chunks_exact(p).enumerate() {
                    let d = page_digest(prev.as_ref(), page_tokens);
                    if k * p >= m.len {
                        stored.insert(digest_to_block_id(&d), prefix[k * p..(k + 1) * p].to_vec());
                    }
                    prev = Some(d);
                }
                let opts = InsertOptions {
                    priority: prio,
                    chunked: false,
                };
                let r = cache.insert(key, None, &prefix, opts).expect("insert");
                assert_eq!(r.prefix_len, m.len);
                let owned = r.prefix_len + r.inserted;
                if aligned > m.len {
                    let now = owned == aligned;
                    assert!(
                        now || owned == m.len,
                        "insert of {key:?} kept {owned} of {aligned} tokens: all or none"
                    );
                    assert_eq!(
                        now, reuses,
                        "insert of {key:?} kept {owned} of {aligned} tokens, but reuses_prefixes() \
                         is {reuses}"
                    );
                }
                if owned < prefix.len() {
                    alloc.free(&prefix[owned..]).expect("free the rest");
                }
            }
            CacheOp::Match(b, l) => {
                let key = &bases[b][..l];
                let expected = model.longest(key, p);
                assert_eq!(cache.peek_prefix_len(key, None), expected.len());
                let mut out = Vec::new();
                let m = cache.match_prefix(key, None, &mut out);
                assert_eq!(out, expected, "match of {key:?}");
                assert_eq!(m.len, expected.len());
            }
            CacheOp::Lock(b, l) => {
                let mut out = Vec::new();
                let m = cache.match_prefix(&bases[b][..l], None, &mut out);
                cache.inc_lock_ref(m.last_node).expect("lock");
                locks.push(m.last_node);
            }
            CacheOp::Unlock(i) => {
                if !locks.is_empty() {
                    let n = locks.remove(i % locks.len());
                    cache.dec_lock_ref(n).expect("unlock");
                }
            }
            CacheOp::Evict(n) => {
                let before = cache.evictable_size();
                let freed = driver.evict(&mut cache, n, &mut alloc);
                assert!(
                    freed >= n.min(before) && freed <= before,
                    "freed {freed} of {before} for {n}"
                );
            }
        }
        // A cache with a host tier finishes its copies (a scheduler does this every step).
        cache.check_hicache_events().expect("hicache events");
        model.apply(cache.take_events(), p, &stored);
        if let Err(e) = cache.check_invariants() {
            panic!("after {op:?}: {e}");
        }
        let mut check = OwnershipCheck::new(&alloc);
        cache.claim_ownership(&mut check);
        check
            .finish()
            .unwrap_or_else(|v| panic!("after {op:?}: {v}"));
        assert_eq!(alloc.size() - alloc.available_size(), cache.total_size());
        assert_eq!(
            model.pages.len() * p,
            cache.total_size(),
            "after {op:?}: the KV events account for {} pages × {page} tokens = {} tokens, but \
             the cache holds {} (is the cache built with events on, and does it report every \
             stored and removed run?)",
            model.pages.len(),
            model.pages.len() * p,
            cache.total_size()
        );
        driver.after_op(&cache, &locks);
    }
    for n in locks {
        cache.dec_lock_ref(n).expect("unlock");
    }
    assert_eq!(cache.protected_size(), 0);
    cache.reset(&mut alloc).expect("reset");
    assert_eq!(alloc.available_size(), alloc.size());
}
