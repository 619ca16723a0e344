//! The suites that check a [`PrefixCache`] or an [`EvictionPolicy`] of your own, with one call
//! each (feature `testing`). This crate's tests run the same functions on [`crate::RadixCache`]
//! (with every policy this crate has) and [`crate::ChunkCache`].
//!
//! In your crate's `Cargo.toml`:
//!
//! ```toml
//! [dev-dependencies]
//! radix-cache = { version = "…", features = ["testing"] }
//! ```
//!
//! A prefix cache: pass a function that builds an empty cache for a page size, with KV events
//! on (the reference model is rebuilt from them; a cache that stores nothing reports none).
//!
//! ```
//! use radix_cache::{testing, BuiltinPolicy, ChunkCache, RadixCache};
//!
//! testing::check_prefix_cache(|page_size| ChunkCache::new(page_size));
//! testing::check_prefix_cache(|page_size| {
//!     RadixCache::new(page_size, BuiltinPolicy::Lru).with_events(true)
//! });
//! ```
//!
//! An eviction policy (it must be `Clone`: every workload starts from a fresh copy):
//!
//! ```
//! use radix_cache::policy::{EvictionKey, EvictionPolicy, NodeStats};
//!
//! /// Evict the longest leaves first, oldest first among equals.
//! #[derive(Debug, Clone)]
//! struct LongestFirst;
//!
//! impl EvictionPolicy for LongestFirst {
//!     fn name(&self) -> &str {
//!         "longest-first"
//!     }
//!     fn key(&mut self, node: &NodeStats) -> EvictionKey {
//!         EvictionKey::new(-(node.len as i64), node.last_access as i64)
//!     }
//! }
//!
//! radix_cache::testing::check_eviction_policy(LongestFirst);
//! ```
//!
//! A failed check panics with what went wrong; a failed random workload also prints the
//! smallest failing case (a page size and a list of [`CacheOp`]s), which
//! [`run_cache_ops`] replays.
//!
//! Pieces for suites of your own: [`RequestHarness`] drives a cache the way a scheduler does
//! (admit, prefill chunks, finish) and checks the ownership partition after every step;
//! [`workload`] and [`run_cache_ops`] are the random workloads and the reference model.

mod harness;
mod model;
mod policy;

pub use harness::{Render, RequestHarness, ScriptedReq};
pub use model::{base_sequences, cache_op, run_cache_ops, workload, CacheOp};
pub use policy::check_eviction_policy;

#[cfg(doc)]
use crate::policy::EvictionPolicy;
use crate::PrefixCache;

/// Checks a prefix cache built by `make(page_size)` against the contract of [`PrefixCache`],
/// panicking with what went wrong:
///
/// - scripted requests at page sizes 1, 2 and 4 (chunked prefill, a request sharing a running
///   one's prefix, two requests computing the same tokens at once, an abort, eviction, reset),
///   with the cache's invariants, the kv-pool ownership partition (free pages, the cache's
///   pages, each request's private slots) and the slot accounting checked after every step;
///   a cache whose [`PrefixCache::reuses_prefixes`] is true matches exactly what earlier
///   requests cached (page-aligned) and stores every insert whole; one whose flag is false
///   matches and stores nothing;
/// - 96 random workloads of inserts, matches, locks, unlocks and evictions against a reference
///   model of the cached prefixes rebuilt from the cache's KV events: every match returns the
///   model's longest prefix with its slots, sizes agree with the pool and the model, locks
///   hold, and everything is freed by `reset` (see [`run_cache_ops`]).
pub fn check_prefix_cache<C: PrefixCache>(make: impl Fn(u32) -> C) {
    for page in [1, 2, 4] {
        harness::check_request_flow(make(page));
    }
    model::for_random_workloads(96, "prefix-cache workload", |page, ops| {
        run_cache_ops(make(page), ops)
    });
}
