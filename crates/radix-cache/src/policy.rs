//! Eviction policies: a policy maps a node's statistics to an ordering key; the cache evicts the
//! evictable leaf with the smallest key first.
//!
//! The cache keeps its evictable leaves in an ordered index keyed by [`EvictionKey`], and asks
//! the policy for a node's key only when the node enters the index or its statistics change (an
//! access, a hit, a partial eviction). So `evict` costs O(log n) per freed node, instead of
//! SGLang's heap rebuild over every leaf per call.
//!
//! SGLang's orderings (`mem_cache/evict_policy.py`; smaller is evicted first): `lru` last access;
//! `lfu` (hit count, last access); `fifo` creation; `mru` −last access; `filo` −creation;
//! `priority` (priority, last access); `slru` (protected segment = hit count ≥ 2, last access).
//! Ours: [`CostAware`] (GreedyDual-Size-Frequency over recompute cost), [`LineageTtl`] (LRU
//! with per-node hold times grown by the conversation turns behind a leaf; see its module) and
//! [`Belady`] (the offline optimum when the future is known, for trace replay).
//!
//! A user writes a policy by implementing [`EvictionPolicy`] in their own crate:
//!
//! ```
//! use radix_cache::policy::{EvictionKey, EvictionPolicy, NodeStats};
//!
//! /// Evict the longest leaves first (frees memory in few evictions), oldest first among equals.
//! #[derive(Debug)]
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
//! // A `RadixCache<LongestFirst>`: the policy is called statically, never through a box.
//! let cache = radix_cache::RadixCache::with_policy(1, LongestFirst);
//! assert_eq!(cache.policy_name(), "longest-first");
//! ```
//!
//! `radix_cache::testing::check_eviction_policy` (feature `testing`) checks such a policy against
//! what the tree relies on.

use std::fmt;
use std::str::FromStr;

use rustc_hash::FxHashMap;

use crate::error::{RadixCacheError, Result};

mod lineage_ttl;

pub use lineage_ttl::LineageTtl;

/// The ordering key of an evictable leaf: smaller is evicted first; ties break by node id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct EvictionKey {
    /// Compared first.
    pub primary: i64,
    /// Compared when `primary` ties.
    pub secondary: i64,
}

impl EvictionKey {
    /// A key from its two components.
    pub const fn new(primary: i64, secondary: i64) -> Self {
        EvictionKey { primary, secondary }
    }

    /// A key whose primary component orders like the float `value` (total order; NaN last).
    pub fn from_f64(value: f64, secondary: i64) -> Self {
        let bits = value.to_bits() as i64;
        // Flip the magnitude bits of negatives so the integers order like the floats.
        let ordered = bits ^ (((bits >> 63) as u64) >> 1) as i64;
        EvictionKey::new(ordered, secondary)
    }
}

/// What a policy may look at: a node's statistics on the cache's logical clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeStats {
    /// Tick of the last match or insert that touched the node.
    pub last_access: u64,
    /// Tick at which the node's tokens were first inserted.
    pub creation: u64,
    /// Matches and (non-chunked) inserts that went through the node.
    pub hit_count: u32,
    /// Request priority, max-propagated along inserted paths.
    pub priority: i64,
    /// Tokens between the root and the node's first token.
    pub depth: usize,
    /// Tokens held by the node.
    pub len: usize,
    /// Nodes on the path from the root through the node when it was created (a split's lower
    /// half counts the new upper half): 1 for a child of the root. A tree signal a flat cache
    /// lacks: in a multi-turn conversation each turn's new tokens hang under the previous
    /// turn's, so a leaf's lineage counts the turns behind it (plus one per shared prefix
    /// node, such as a system prompt).
    pub lineage: u32,
    /// A 64-bit hash of the token path from the root through the node's last page (equal
    /// paths give equal hashes; 0 unless the cache tracks paths); what [`Belady`] looks up in
    /// its future index. The last page is what a partial eviction removes first.
    pub path_hash: u64,
}

/// An eviction policy (SGLang's `EvictionStrategy`). `key` is called when a node becomes an
/// evictable leaf and whenever its statistics change while it is one; `on_evict` after each
/// eviction, with the victim's key. A key once given is kept until the node's next change, so
/// `key` must be a deterministic function of the statistics and of the policy's state, and that
/// state may change only in `on_evict` and `advance_to`.
///
/// [`AnyEvictionPolicy`] is the closed set of this crate's policies, dispatched statically; a
/// policy of your own is the type parameter of [`crate::RadixCache`]
/// (`RadixCache::with_policy(page_size, policy)`).
#[doc(alias = "EvictionStrategy")]
#[enum_dispatch::enum_dispatch]
pub trait EvictionPolicy: fmt::Debug + Send {
    /// The policy's name (as `--radix-eviction-policy` spells it).
    fn name(&self) -> &str;
    /// The ordering key of a node: smaller is evicted first.
    fn key(&mut self, node: &NodeStats) -> EvictionKey;
    /// Called after a node (or a part of it) is evicted with `key`. Default: nothing.
    fn on_evict(&mut self, _key: EvictionKey) {}
    /// Called by a replay driver before it serves request number `request` (0-based, in replay
    /// order); policies that know the future ([`Belady`]) use it. Default: nothing.
    fn advance_to(&mut self, _request: u64) {}
    /// Whether the policy reads [`NodeStats::path_hash`]. The cache computes path hashes only
    /// for such a policy, and evicts page by page for it (a leaf's next page to go may be needed
    /// sooner than another leaf's). Asked once, when the cache is built. Default: `false`.
    fn needs_path_hashes(&self) -> bool {
        false
    }
    /// Whether the key a node gets at an access (or at its insertion) is at least every key
    /// the policy gave before: LRU's key is the access tick; FIFO's the creation tick, which an
    /// access leaves alone. The cache then keeps the leaves that arrive in key order in an O(1)
    /// list instead of its ordered set; a wrong answer costs speed, never order. Asked once,
    /// when the cache is built. Default: `false`.
    fn keys_grow_with_access(&self) -> bool {
        false
    }
}

/// SGLang's built-in orderings (`mem_cache/evict_policy.py`, one strategy class each).
#[doc(alias = "LRUStrategy", alias = "LFUStrategy", alias = "FIFOStrategy")]
#[doc(
    alias = "MRUStrategy",
    alias = "FILOStrategy",
    alias = "PriorityStrategy"
)]
#[doc(alias = "SLRUStrategy")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BuiltinPolicy {
    /// Least recently used (SGLang's default): key = last access.
    #[doc(alias = "LRUStrategy")]
    Lru,
    /// Least frequently used, then least recently used: key = (hit count, last access).
    #[doc(alias = "LFUStrategy")]
    Lfu,
    /// First inserted, first evicted: key = creation.
    #[doc(alias = "FIFOStrategy")]
    Fifo,
    /// Most recently used first: key = −last access.
    #[doc(alias = "MRUStrategy")]
    Mru,
    /// Last inserted, first evicted: key = −creation.
    #[doc(alias = "FILOStrategy")]
    Filo,
    /// Lowest priority first, then least recently used: key = (priority, last access).
    #[doc(alias = "PriorityStrategy")]
    Priority,
    /// Segmented LRU: the probationary segment (hit count < 2) before the protected one, each
    /// by last access.
    #[doc(alias = "SLRUStrategy")]
    Slru,
}

impl BuiltinPolicy {
    /// SGLang's seven orderings, in a stable order.
    pub const ALL: [BuiltinPolicy; 7] = [
        BuiltinPolicy::Lru,
        BuiltinPolicy::Lfu,
        BuiltinPolicy::Fifo,
        BuiltinPolicy::Mru,
        BuiltinPolicy::Filo,
        BuiltinPolicy::Priority,
        BuiltinPolicy::Slru,
    ];

    /// SLRU's protected-segment threshold (SGLang's default).
    pub const SLRU_PROTECTED_HITS: u32 = 2;

    /// The name `--radix-eviction-policy` accepts for it (lowercase).
    pub const fn as_str(self) -> &'static str {
        match self {
            BuiltinPolicy::Lru => "lru",
            BuiltinPolicy::Lfu => "lfu",
            BuiltinPolicy::Fifo => "fifo",
            BuiltinPolicy::Mru => "mru",
            BuiltinPolicy::Filo => "filo",
            BuiltinPolicy::Priority => "priority",
            BuiltinPolicy::Slru => "slru",
        }
    }
}

impl EvictionPolicy for BuiltinPolicy {
    fn name(&self) -> &str {
        self.as_str()
    }

    fn keys_grow_with_access(&self) -> bool {
        matches!(self, BuiltinPolicy::Lru | BuiltinPolicy::Fifo)
    }

    fn key(&mut self, n: &NodeStats) -> EvictionKey {
        let access = n.last_access as i64;
        let creation = n.creation as i64;
        match self {
            BuiltinPolicy::Lru => EvictionKey::new(access, 0),
            BuiltinPolicy::Lfu => EvictionKey::new(n.hit_count as i64, access),
            BuiltinPolicy::Fifo => EvictionKey::new(creation, 0),
            BuiltinPolicy::Mru => EvictionKey::new(-access, 0),
            BuiltinPolicy::Filo => EvictionKey::new(-creation, 0),
            BuiltinPolicy::Priority => EvictionKey::new(n.priority, access),
            BuiltinPolicy::Slru => {
                EvictionKey::new(i64::from(n.hit_count >= Self::SLRU_PROTECTED_HITS), access)
            }
        }
    }
}

impl FromStr for BuiltinPolicy {
    type Err = RadixCacheError;

    fn from_str(s: &str) -> Result<Self> {
        BuiltinPolicy::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| RadixCacheError::UnknownPolicy {
                name: s.to_string(),
                known: policy_names().join(", "),
            })
    }
}

/// Every policy name [`policy_from_name`] accepts.
pub fn policy_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = BuiltinPolicy::ALL.iter().map(|p| p.as_str()).collect();
    names.push(CostAware::NAME);
    names.push(LineageTtl::NAME);
    names
}

/// Builds a policy from its name (case-insensitive): SGLang's seven, `cost-aware` and
/// `lineage-ttl`. `belady`
/// needs the future and is built with [`Belady::new`]. The same as
/// [`AnyEvictionPolicy::from_name`].
pub fn policy_from_name(name: &str) -> Result<AnyEvictionPolicy> {
    AnyEvictionPolicy::from_name(name)
}

/// Every policy this crate implements, as one value with static dispatch (the engine's
/// eviction-policy component).
#[enum_dispatch::enum_dispatch(EvictionPolicy)]
#[derive(Debug, Clone)]
pub enum AnyEvictionPolicy {
    /// One of SGLang's seven orderings.
    Builtin(BuiltinPolicy),
    /// GreedyDual-Size-Frequency over recompute cost ([`CostAware`]).
    CostAware(CostAware),
    /// LRU with lineage-grown per-node holds ([`LineageTtl`]).
    LineageTtl(LineageTtl),
    /// The offline oracle ([`Belady`]).
    Belady(Belady),
}

impl AnyEvictionPolicy {
    /// The policy `name` names (case-insensitive): SGLang's seven, `cost-aware` and
    /// `lineage-ttl` (with its default horizon). `belady` needs the future: build it with
    /// [`Belady::new`] and convert with `From`.
    pub fn from_name(name: &str) -> Result<Self> {
        if name.eq_ignore_ascii_case(CostAware::NAME) {
            return Ok(CostAware::default().into());
        }
        if name.eq_ignore_ascii_case(LineageTtl::NAME) {
            return Ok(LineageTtl::default().into());
        }
        if name.eq_ignore_ascii_case(Belady::NAME) {
            return Err(RadixCacheError::UnknownPolicy {
                name: name.to_string(),
                known: format!(
                    "{} (belady needs the future: build it with Belady::new over the workload)",
                    policy_names().join(", ")
                ),
            });
        }
        Ok(name.parse::<BuiltinPolicy>()?.into())
    }
}

/// A boxed policy of this crate converts as the policy itself, so code written when
/// [`crate::RadixCache::new`] took `Box<dyn EvictionPolicy>` (`RadixCache::new(page,
/// Box::new(BuiltinPolicy::Lru))`, as in the peer-radix benchmark) still builds, now with static
/// dispatch.
impl<P: Into<AnyEvictionPolicy>> From<Box<P>> for AnyEvictionPolicy {
    fn from(policy: Box<P>) -> Self {
        (*policy).into()
    }
}

/// Cost-aware eviction: GreedyDual-Size-Frequency (Cao & Irani 1997; Cherkasova 1998) with the
/// cost of recomputing a node's KV.
///
/// Recomputing the `len` tokens of a node at `depth` costs a prefill of those tokens whose
/// attention reads everything before them: `len × (linear + quadratic × (depth + len / 2))`
/// (`linear` stands for the per-token weight FLOPs, `quadratic` for the per-token-pair attention
/// FLOPs, both relative). The node holds `len` tokens of KV, so its cost per byte held is
/// proportional to `linear + quadratic × (depth + len / 2)`: a deep node (long context behind
/// it) is dearer to recompute per byte than a shallow one. The node's value is
/// `H = L + (hit_count + 1) × cost_per_token`, where `L` is the inflation clock: the `H` of the
/// last victim. A node accessed long ago keeps its old, lower `H` while `L` rises past it, so
/// recency still matters; frequency and recompute cost raise a node above it. Evicted first:
/// smallest `H`, then least recently used.
#[derive(Debug, Clone, PartialEq)]
pub struct CostAware {
    /// Relative cost of one token's weight FLOPs.
    pub linear: f64,
    /// Relative cost of attention per token pair.
    pub quadratic: f64,
    inflation: f64,
}

impl CostAware {
    /// The name `--radix-eviction-policy` accepts for it.
    pub const NAME: &'static str = "cost-aware";

    /// A cost-aware policy with the given relative costs (`linear`, `quadratic` ≥ 0).
    pub fn new(linear: f64, quadratic: f64) -> Self {
        CostAware {
            linear: linear.max(0.0),
            quadratic: quadratic.max(0.0),
            inflation: 0.0,
        }
    }

    /// The inflation clock `L` (the `H` of the last victim).
    pub fn inflation(&self) -> f64 {
        self.inflation
    }

    /// Recompute cost per token of a node (see the type's documentation).
    pub fn cost_per_token(&self, node: &NodeStats) -> f64 {
        self.linear + self.quadratic * (node.depth as f64 + node.len as f64 / 2.0)
    }
}

impl Default for CostAware {
    /// Per token, a Llama-3-8B-like model spends about 2 × 8e9 FLOPs on weights and
    /// 4 × 32 layers × 4096 = 5.2e5 FLOPs per earlier token on attention: `quadratic / linear ≈
    /// 3.3e-5`, so a context of 30,000 tokens doubles the per-token cost.
    fn default() -> Self {
        CostAware::new(1.0, 3.3e-5)
    }
}

impl EvictionPolicy for CostAware {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn key(&mut self, n: &NodeStats) -> EvictionKey {
        let h = self.inflation + (n.hit_count as f64 + 1.0) * self.cost_per_token(n);
        EvictionKey::from_f64(h, n.last_access as i64)
    }

    fn on_evict(&mut self, key: EvictionKey) {
        // Invert `from_f64` to recover H.
        let bits = key.primary ^ ((((key.primary >> 63) as u64) >> 1) as i64);
        let h = f64::from_bits(bits as u64);
        if h.is_finite() && h > self.inflation {
            self.inflation = h;
        }
    }
}

/// Where every page-aligned prefix of a known request sequence is used next: the oracle behind
/// [`Belady`]. Prefixes are identified by [`path_hash`] over their pages.
#[derive(Debug, Clone, Default)]
pub struct FutureIndex {
    page_size: usize,
    /// Path hash of a prefix ending at a page boundary → ascending request indices using it.
    uses: FxHashMap<u64, Vec<u32>>,
}

impl FutureIndex {
    /// Indexes `requests` (their prompt tokens, in replay order) at page size `page_size`.
    pub fn new<'a>(page_size: u32, requests: impl IntoIterator<Item = &'a [u32]>) -> Self {
        let p = page_size.max(1) as usize;
        let mut uses: FxHashMap<u64, Vec<u32>> = FxHashMap::default();
        for (i, tokens) in requests.into_iter().enumerate() {
            let mut h = PATH_HASH_SEED;
            for page in tokens.chunks_exact(p) {
                h = path_hash(h, page);
                let list = uses.entry(h).or_default();
                if list.last() != Some(&(i as u32)) {
                    list.push(i as u32);
                }
            }
        }
        FutureIndex { page_size: p, uses }
    }

    /// The page size the index was built for.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The first request after `now` whose prompt contains the prefix `path_hash`, if any.
    pub fn next_use(&self, path_hash: u64, now: u32) -> Option<u32> {
        let list = self.uses.get(&path_hash)?;
        let i = list.partition_point(|&r| r <= now);
        list.get(i).copied()
    }
}

/// Belady's optimal policy for a known future: evict the leaf page whose next use is farthest
/// (never used again first). It [needs path hashes](EvictionPolicy::needs_path_hashes), so the
/// cache evicts one page per decision. The replay driver advances [`Belady::set_now`] to the
/// index of the request being served; a node's key is refreshed whenever it is used, so a
/// stored key is exact until the node's next use.
#[derive(Debug, Clone)]
pub struct Belady {
    future: FutureIndex,
    now: u32,
}

impl Belady {
    /// The name replay listings use for it (not accepted by [`policy_from_name`]: it needs the
    /// future).
    pub const NAME: &'static str = "belady";

    /// A Belady policy over the requests indexed by `future`.
    pub fn new(future: FutureIndex) -> Self {
        Belady { future, now: 0 }
    }

    /// Sets the index of the request being served.
    pub fn set_now(&mut self, request: u32) {
        self.now = request;
    }
}

impl EvictionPolicy for Belady {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn advance_to(&mut self, request: u64) {
        self.set_now(request.min(u32::MAX as u64) as u32);
    }

    fn needs_path_hashes(&self) -> bool {
        true
    }

    fn key(&mut self, n: &NodeStats) -> EvictionKey {
        // Farthest next use first: never used again sorts before everything.
        let next = self
            .future
            .next_use(n.path_hash, self.now)
            .map_or(i64::MAX, i64::from);
        EvictionKey::new(-next, n.last_access as i64)
    }
}

/// Seed of [`path_hash`] chains (the empty path).
pub const PATH_HASH_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// Extends a path hash by one page of tokens (a fast 64-bit chain; not SGLang's SHA-256 block
/// hash, which is in [`crate::events`]).
pub fn path_hash(prev: u64, page: &[u32]) -> u64 {
    use std::hash::Hasher;
    let mut h = rustc_hash::FxHasher::default();
    h.write_u64(prev);
    for &t in page {
        h.write_u32(t);
    }
    // FxHash's low bits are weak: finalise with a splitmix round.
    let mut z = h.finish().wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(last_access: u64, creation: u64, hit_count: u32, priority: i64) -> NodeStats {
        NodeStats {
            last_access,
            creation,
            hit_count,
            priority,
            depth: 0,
            len: 4,
            lineage: 1,
            path_hash: 0,
        }
    }

    #[test]
    fn builtin_orderings_match_sglang() {
        // Three nodes: a (old, created first, hot, low priority), b, c (recent, created last).
        let a = stats(1, 0, 5, -1);
        let b = stats(5, 1, 1, 0);
        let c = stats(9, 2, 2, 3);
        let order = |p: BuiltinPolicy| {
            let mut p = p;
            let mut v = [("a", p.key(&a)), ("b", p.key(&b)), ("c", p.key(&c))];
            v.sort_by_key(|x| x.1);
            v.map(|x| x.0).join("")
        };
        assert_eq!(order(BuiltinPolicy::Lru), "abc");
        assert_eq!(order(BuiltinPolicy::Lfu), "bca");
        assert_eq!(order(BuiltinPolicy::Fifo), "abc");
        assert_eq!(order(BuiltinPolicy::Mru), "cba");
        assert_eq!(order(BuiltinPolicy::Filo), "cba");
        assert_eq!(order(BuiltinPolicy::Priority), "abc");
        // SLRU: b is probationary (1 hit); a and c protected (≥ 2), by recency.
        assert_eq!(order(BuiltinPolicy::Slru), "bac");
    }

    #[test]
    fn names_parse_case_insensitively_and_unknown_is_an_error() {
        for p in BuiltinPolicy::ALL {
            assert_eq!(
                p.as_str().to_uppercase().parse::<BuiltinPolicy>().unwrap(),
                p
            );
            assert_eq!(policy_from_name(p.as_str()).unwrap().name(), p.as_str());
        }
        assert_eq!(policy_from_name("Cost-Aware").unwrap().name(), "cost-aware");
        assert_eq!(
            policy_from_name("Lineage-TTL").unwrap().name(),
            "lineage-ttl"
        );
        let err = policy_from_name("lru2").unwrap_err().to_string();
        assert!(err.contains("lru2") && err.contains("slru"), "{err}");
        assert!(policy_from_name("belady")
            .unwrap_err()
            .to_string()
            .contains("future"));
    }

    #[test]
    fn a_boxed_policy_builds_the_same_cache() {
        let boxed = crate::RadixCache::new(16, Box::new(BuiltinPolicy::Slru));
        assert_eq!(boxed.policy_name(), "slru");
        let cost: AnyEvictionPolicy = Box::new(CostAware::default()).into();
        assert_eq!(cost.name(), "cost-aware");
    }

    #[test]
    fn float_keys_order_like_floats() {
        let vals = [-3.5, -0.0, 0.0, 1e-9, 2.0, 1e300, f64::INFINITY];
        let keys: Vec<_> = vals.iter().map(|&v| EvictionKey::from_f64(v, 0)).collect();
        assert!(keys.windows(2).all(|w| w[0] <= w[1]), "{keys:?}");
    }

    #[test]
    fn cost_aware_prefers_keeping_deep_and_hot_nodes_and_inflates() {
        let mut p = CostAware::new(1.0, 0.01);
        let shallow = NodeStats {
            depth: 0,
            ..stats(1, 0, 0, 0)
        };
        let deep = NodeStats {
            depth: 1000,
            ..stats(1, 0, 0, 0)
        };
        let hot = NodeStats {
            hit_count: 10,
            ..shallow
        };
        assert!(p.key(&shallow) < p.key(&deep));
        assert!(p.key(&shallow) < p.key(&hot));
        let victim = p.key(&deep);
        p.on_evict(victim);
        assert!((p.inflation() - (1.0 + 0.01 * 1002.0)).abs() < 1e-9);
        // After inflation a fresh shallow node outranks the old deep one's stored key.
        assert!(p.key(&shallow) > victim);
    }

    #[test]
    fn belady_evicts_the_farthest_next_use() {
        let reqs: Vec<Vec<u32>> = vec![vec![1, 2], vec![3, 4], vec![1, 2], vec![5, 6], vec![3, 4]];
        let future = FutureIndex::new(2, reqs.iter().map(|r| r.as_slice()));
        let h12 = path_hash(PATH_HASH_SEED, &[1, 2]);
        let h34 = path_hash(PATH_HASH_SEED, &[3, 4]);
        let h56 = path_hash(PATH_HASH_SEED, &[5, 6]);
        assert_eq!(future.next_use(h12, 0), Some(2));
        assert_eq!(future.next_use(h34, 1), Some(4));
        assert_eq!(future.next_use(h12, 2), None);
        let mut p = Belady::new(future);
        p.set_now(1);
        let key = |p: &mut Belady, h| {
            p.key(&NodeStats {
                path_hash: h,
                ..stats(0, 0, 0, 0)
            })
        };
        let (k12, k34, k56) = (key(&mut p, h12), key(&mut p, h34), key(&mut p, h56));
        // 3,4 is next used at 4 (farthest), 5,6 at 3, 1,2 at 2.
        assert!(k34 < k56 && k56 < k12);
        p.set_now(3);
        assert!(
            key(&mut p, h12) < key(&mut p, h34),
            "never used again goes first"
        );
    }
}
