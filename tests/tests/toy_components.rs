//! Components written outside the component crates, checked by the suites those crates export
//! (issue 11, "every swap point ships its suite"): a toy allocator through
//! `kv_pool::testing::check_allocator`, a toy prefix cache through
//! `radix_cache::testing::check_prefix_cache`, and a toy eviction policy through
//! `radix_cache::testing::check_eviction_policy` and inside a `RadixCache`. Each toy is a real,
//! small implementation of a different design from the crates' own; each suite is also shown to
//! catch a deliberately broken variant, so a pass is not vacuous.

// The toys live beside this file (a crate root's `mod` looks in its own directory).
#[path = "toy_components/allocator.rs"]
mod allocator;
#[path = "toy_components/policy.rs"]
mod policy;
#[path = "toy_components/prefix_cache.rs"]
mod prefix_cache;

use std::panic::{catch_unwind, AssertUnwindSafe};

use allocator::LowestFirst;
use policy::{CallCounting, DeepestFirst};
use prefix_cache::HashedPages;
use radix_cache::{testing, RadixCache};

/// The panic message of `f`, which must panic.
fn panic_message(f: impl FnOnce()) -> String {
    let payload = catch_unwind(AssertUnwindSafe(f)).expect_err("the suite accepted a broken toy");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn toy_allocator_passes_the_allocator_suite() {
    kv_pool::testing::check_allocator(&[1, 4, 16], |size, page_size| {
        LowestFirst::new(size, page_size).expect("a valid toy pool")
    })
    .unwrap_or_else(|failure| panic!("{failure}"));
}

#[test]
fn allocator_suite_catches_an_accepted_double_free() {
    let failure = kv_pool::testing::check_allocator(&[4], |size, page_size| {
        LowestFirst::new(size, page_size)
            .expect("a valid toy pool")
            .accepting_double_free()
    })
    .expect_err("a double free was accepted");
    assert!(failure.contains("double free"), "{failure}");
}

#[test]
fn toy_prefix_cache_passes_the_prefix_cache_suite() {
    testing::check_prefix_cache(HashedPages::new);
}

#[test]
fn prefix_cache_suite_catches_unreported_evictions() {
    let message = panic_message(|| {
        testing::check_prefix_cache(|p| HashedPages::new(p).with_silent_evictions())
    });
    assert!(message.contains("KV events"), "{message}");
}

#[test]
fn toy_policy_passes_the_policy_suite() {
    testing::check_eviction_policy(DeepestFirst);
}

#[test]
fn toy_policy_in_a_radix_cache_passes_the_prefix_cache_suite() {
    testing::check_prefix_cache(|p| RadixCache::with_policy(p, DeepestFirst).with_events(true));
}

#[test]
fn policy_suite_catches_call_dependent_keys() {
    let message = panic_message(|| testing::check_eviction_policy(CallCounting::default()));
    assert!(message.contains("two keys for the same stats"), "{message}");
}

/// `check_prefix_cache` also accepts a cache that never reuses anything (as `ChunkCache`), so
/// this shows the toy does: what is inserted is matched, per namespace, and eviction takes the
/// least recently used leaf page first.
#[test]
fn toy_prefix_cache_reuses_prefixes() {
    use kv_pool::Allocator;
    use radix_cache::{InsertOptions, PrefixCache};

    let mut alloc = LowestFirst::new(64, 4).expect("a valid toy pool");
    let mut cache = HashedPages::new(4);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    alloc.alloc(12, &mut a).expect("room");
    alloc.alloc(12, &mut b).expect("room");
    let key_a: Vec<u32> = (1..=10).collect();
    let mut key_b = key_a[..4].to_vec();
    key_b.extend(100..108);
    let opts = InsertOptions::default();
    let ins = cache
        .insert(&key_a, None, &a[..10], opts)
        .expect("insert a");
    assert_eq!((ins.prefix_len, ins.inserted), (0, 8), "whole pages only");
    alloc
        .free(&a[8..])
        .expect("the unaligned tail stays the caller's");
    let ins = cache.insert(&key_b, None, &b, opts).expect("insert b");
    assert_eq!(
        (ins.prefix_len, ins.inserted),
        (4, 8),
        "b shares a's first page"
    );
    alloc
        .free(&b[..4])
        .expect("b's duplicate of the shared page");

    let mut out = Vec::new();
    let m = cache.match_prefix(&key_a, None, &mut out);
    assert_eq!((m.len, &out[..]), (8, &a[..8]));
    assert_eq!(cache.peek_prefix_len(&key_a, Some("other namespace")), 0);
    assert_eq!(cache.evictable_size(), 16);
    // b's leaf page was used least recently: it goes first, then b's middle page.
    assert_eq!(cache.evict(8, &mut alloc).expect("evict"), 8);
    assert_eq!(cache.peek_prefix_len(&key_b, None), 4);
    assert_eq!(cache.peek_prefix_len(&key_a, None), 8);
    assert_eq!(
        alloc.available_size(),
        64 - 8,
        "only a's two pages are held"
    );
}
