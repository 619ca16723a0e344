//! [`RadixCache`]: SGLang's radix tree (`mem_cache/radix_cache.py`) at page size 1 or `P`,
//! generic over its eviction policy, with an optional host tier (SGLang's `HiRadixCache`,
//! `mem_cache/hiradix_cache.py`).
//!
//! One job per file, layered so that no two modules use each other:
//!
//! | module | job | builds on |
//! |---|---|---|
//! | `host` | the host tier's state (controller, host allocator, host index, pending ops, prefetches) | — |
//! | `arena` | the struct, the node arena, token/slot/host-slot arenas, parent/child links, compaction | `host` |
//! | `index` | the evictable-leaf indexes (device and host): membership, policy keys, node statistics, the clock | `arena` |
//! | `match_insert` | walk, split, match, insert, revival of host-only nodes (and `BlockStored` events) | `arena`, `index` |
//! | `evict` | eviction in key order, partial eviction (and `BlockRemoved` events) | `arena`, `index` |
//! | `lock` | lock counts along a path | `arena`, `index` |
//! | `tier` | adding a host tier, host allocation and eviction, backups, storage keys, tier stats | `arena`, `index`, `lock` |
//! | `demote` | device eviction with a host tier: demotion, write-back, drops | `evict`, `tier` |
//! | `load_back` | host → device load-back, `write_back_path` | `lock`, `tier`, `demote` |
//! | `prefetch` | L3 → host prefetch: start, query/copy acks, insertion, release | `match_insert`, `lock`, `tier` |
//! | `acks` | the controller's acks, the prefetch stop decision | `lock`, `tier`, `prefetch` |
//! | `render` | rendering, eviction order, invariant check | `arena`, `index` |
//! | `prefix_cache` | the [`crate::PrefixCache`] implementation | all of the above |
//!
//! The evictable leaves sit in a `BTreeSet` ordered by (policy key, node index), so `evict`
//! costs O(log n) per freed node; with a host tier the host-evictable nodes sit in a second
//! one.

mod acks;
mod arena;
mod demote;
mod evict;
mod host;
mod index;
mod load_back;
mod lock;
mod match_insert;
mod prefetch;
mod prefix_cache;
mod render;
mod tier;

pub use arena::RadixCache;
