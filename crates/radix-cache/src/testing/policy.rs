//! The eviction-policy check: what a policy must guarantee for the tree to stay correct.
//!
//! The cache stores a leaf's key when the leaf enters the eviction index or its statistics
//! change, and evicts the smallest stored key first. So a policy's `key` must be a deterministic
//! function of the statistics it is given and of its own state, that state may change only in
//! `on_evict` and `advance_to` (and the same calls must give the same state: no clock, no
//! unseeded randomness), and its capabilities must not change while the cache runs.

use kv_pool::rng::SplitMix64;
use kv_pool::PagedAllocator;

use crate::policy::{path_hash, EvictionKey, EvictionPolicy, NodeStats, PATH_HASH_SEED};
use crate::testing::model::{base_sequences, for_random_workloads, run_with, Driver};
use crate::{NodeId, PrefixCache, RadixCache};

/// A policy wrapped so every call is checked: `key` twice and on a clone fed the same calls
/// must agree; the victim's key is kept for the eviction-order check.
#[derive(Debug, Clone)]
struct Checked<P> {
    inner: P,
    /// A clone given the same `on_evict` / `advance_to` calls.
    shadow: P,
    last_evicted: Option<EvictionKey>,
}

impl<P: EvictionPolicy + Clone> Checked<P> {
    fn new(policy: P) -> Self {
        Checked {
            shadow: policy.clone(),
            inner: policy,
            last_evicted: None,
        }
    }
}

impl<P: EvictionPolicy> EvictionPolicy for Checked<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn key(&mut self, node: &NodeStats) -> EvictionKey {
        let k = self.inner.key(node);
        let again = self.inner.key(node);
        let clone = self.shadow.key(node);
        let name = self.inner.name();
        assert_eq!(again, k, "{name}: two keys for the same stats {node:?}");
        assert_eq!(
            clone, k,
            "{name}: a clone given the same calls keys {node:?} differently"
        );
        k
    }

    fn on_evict(&mut self, key: EvictionKey) {
        self.inner.on_evict(key);
        self.shadow.on_evict(key);
        self.last_evicted = Some(key);
    }

    fn advance_to(&mut self, request: u64) {
        self.inner.advance_to(request);
        self.shadow.advance_to(request);
    }

    fn needs_path_hashes(&self) -> bool {
        self.inner.needs_path_hashes()
    }
}

/// Random statistics; path hashes are those of the workload's prefixes (so a future-aware
/// policy finds them) or random.
fn random_stats(rng: &mut SplitMix64, paths: &[u64]) -> NodeStats {
    let path_hash = if rng.below(4) == 0 {
        rng.next_u64()
    } else {
        paths[rng.below(paths.len())]
    };
    NodeStats {
        last_access: rng.below(1000) as u64,
        creation: rng.below(1000) as u64,
        hit_count: rng.below(8) as u32,
        priority: rng.below(7) as i64 - 3,
        depth: rng.below(4096),
        lineage: rng.below(12) as u32,
        len: 1 + rng.below(64),
        path_hash,
    }
}

/// Keys are a deterministic function of the stats and of the calls the policy was given.
fn check_keys<P: EvictionPolicy + Clone>(policy: &P) {
    let paths: Vec<u64> = base_sequences()
        .iter()
        .flat_map(|s| {
            s.iter().scan(PATH_HASH_SEED, |h, &t| {
                *h = path_hash(*h, &[t]);
                Some(*h)
            })
        })
        .collect();
    let (name, needs_paths) = (policy.name().to_string(), policy.needs_path_hashes());
    let mut a = Checked::new(policy.clone());
    let mut rng = SplitMix64::new(0x5EED);
    let mut keys = Vec::new();
    for i in 0..2000u64 {
        let stats = random_stats(&mut rng, &paths);
        keys.push(a.key(&stats));
        if i % 16 == 15 {
            a.on_evict(keys[rng.below(keys.len())]);
        }
        if i % 50 == 49 {
            a.advance_to(i / 50);
        }
        assert_eq!(a.name(), name, "the policy's name changed");
        assert_eq!(
            a.needs_path_hashes(),
            needs_paths,
            "{name}: needs_path_hashes changed"
        );
    }
}

/// Drives a workload through a `RadixCache<Checked<P>>`: advances the policy to each operation,
/// evicts one decision at a time checking that the smallest stored key goes, and checks that
/// locked nodes stay.
struct PolicyDriver {
    page: usize,
    whole_nodes: bool,
}

impl<P: EvictionPolicy + Clone> Driver<RadixCache<Checked<P>>> for PolicyDriver {
    fn before_op(&mut self, cache: &mut RadixCache<Checked<P>>, i: usize) {
        cache.policy_mut().advance_to(i as u64);
    }

    fn evict(
        &mut self,
        cache: &mut RadixCache<Checked<P>>,
        n: usize,
        alloc: &mut PagedAllocator,
    ) -> usize {
        let protected = cache.protected_size();
        let mut freed = 0;
        while freed < n {
            let Some(&(smallest, victim)) = cache.stored_keys().first() else {
                break;
            };
            // One page asks for one decision: one leaf, whole or its last page(s).
            let got = cache.evict(self.page, alloc).expect("evict");
            assert!(got >= self.page, "evicted {got} tokens for a page");
            let name = cache.policy_name().to_string();
            assert_eq!(
                cache.policy().last_evicted,
                Some(smallest),
                "{name}: the victim's key is not the smallest stored key"
            );
            if self.whole_nodes {
                assert!(!cache.contains(victim), "{name}: {victim} was not evicted");
            }
            freed += got;
        }
        assert_eq!(
            cache.protected_size(),
            protected,
            "eviction changed what is locked"
        );
        freed
    }

    fn after_op(&mut self, cache: &RadixCache<Checked<P>>, locked: &[NodeId]) {
        for &n in locked {
            assert!(cache.contains(n), "locked {n} was evicted");
        }
    }
}

/// Checks an eviction policy against what [`RadixCache`] relies on, panicking with what went
/// wrong:
///
/// - `key` is a deterministic function of the stats it is given: asked twice, and asked of a
///   clone that received the same `on_evict` / `advance_to` calls, it gives the same key (over
///   2,000 random stats, with evictions and advances in between); `name` and
///   `needs_path_hashes` never change;
/// - random workloads (page sizes 1, 2 and 4; partial and whole-node eviction) through a
///   `RadixCache` with this policy, advanced to each operation with `advance_to`: every
///   eviction takes the leaf with the smallest stored key, locked nodes are never evicted, and
///   after every operation the tree's invariants, the kv-pool ownership partition and the
///   reference model of [`super::check_prefix_cache`] hold.
pub fn check_eviction_policy<P: EvictionPolicy + Clone>(policy: P) {
    check_keys(&policy);
    for partial in [true, false] {
        let what = format!("{} (partial eviction {partial})", policy.name());
        for_random_workloads(48, &what, |page, ops| {
            let cache = RadixCache::with_policy(page, Checked::new(policy.clone()))
                .with_events(true)
                .with_partial_eviction(partial);
            let mut driver = PolicyDriver {
                page: page as usize,
                whole_nodes: !partial && !policy.needs_path_hashes(),
            };
            run_with(cache, ops, &mut driver);
        });
    }
}
