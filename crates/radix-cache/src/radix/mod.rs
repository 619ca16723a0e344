//! [`RadixCache`]: SGLang's radix tree (`mem_cache/radix_cache.py`) at page size 1 or `P`,
//! generic over its eviction policy, with an optional host tier (SGLang's `HiRadixCache`,
//! `mem_cache/hiradix_cache.py`).
//!
//! One job per file, layered so that no two modules use each other:
//!
//! | module | job | builds on |
//! |---|---|---|
//! | `host` | the host tier's state (controller, host allocator, host index, pending ops, prefetches) | — |
//! | `leaves` | the evictable-leaf order: an O(1) list of in-order arrivals beside an ordered set | — |
//! | `arena` | the struct, the node arena, token/slot/host-slot arenas, parent/child links, compaction | `host`, `leaves` |
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
//! The evictable leaves sit in a [`leaves::LeafOrder`] ordered by (policy key, node index): an
//! O(1) list for leaves that arrive in key order (nearly all, under LRU), a `BTreeSet` for the
//! rest, so `evict` costs O(1) to O(log n) per freed node; with a host tier the host-evictable
//! nodes sit in a second `BTreeSet`.

mod acks;
mod arena;
mod demote;
mod evict;
mod host;
mod index;
mod leaves;
mod load_back;
mod lock;
mod match_insert;
mod prefetch;
mod prefix_cache;
mod render;
mod tier;

pub use arena::RadixCache;
