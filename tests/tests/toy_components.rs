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
