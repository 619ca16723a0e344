//! [`RadixCache`]: SGLang's radix tree (`mem_cache/radix_cache.py`) at page size 1 or `P`,
//! generic over its eviction policy.
//!
//! One job per file, layered so that no two modules use each other:
//!
//! | module | job | builds on |
//! |---|---|---|
//! | `arena` | the struct, the node arena, token/slot arenas, parent/child links, compaction | — |
//! | `index` | the evictable-leaf index: membership, policy keys, node statistics, the clock | `arena` |
//! | `match_insert` | walk, split, match, insert (and `BlockStored` events) | `arena`, `index` |
//! | `evict` | eviction in key order, partial eviction (and `BlockRemoved` events) | `arena`, `index` |
//! | `lock` | lock counts along a path | `arena`, `index` |
//! | `render` | rendering, eviction order, invariant check | `arena`, `index` |
//! | `prefix_cache` | the [`crate::PrefixCache`] implementation | all of the above |
//!
//! The evictable leaves sit in a `BTreeSet` ordered by (policy key, node index), so `evict`
//! costs O(log n) per freed node.

mod arena;
mod evict;
mod index;
mod lock;
mod match_insert;
mod prefix_cache;
mod render;

pub use arena::RadixCache;
