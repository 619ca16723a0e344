//! # kvserve-tests — cross-crate end-to-end tests
//!
//! This crate holds the tests that span several kvserve crates, so no component crate needs a
//! dev-dependency on a crate above it: the model on every compiled backend, the server
//! scenarios, and components written outside the component crates (a toy allocator, prefix
//! cache and eviction policy) checked by the suites those crates export (`kv_pool::testing`,
//! `radix_cache::testing`). The library itself is empty; the tests live in `tests/`.
