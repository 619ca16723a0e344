//! [`LineageTtl`]: LRU whose leaves deep in a conversation get an extra hold time, drawn per
//! node and grown with the node's lineage (the turns behind it), so a capacity too small for the
//! workload's reuse distances keeps a subset of conversations long enough to be reused instead
//! of thrashing through all of them.
//!
//! ## What it keys on, and why
//!
//! The key of a leaf is `last_access + horizon × u × w` (smaller is evicted first; ties by last
//! access), where
//! - `u` ∈ [0, 1) is a hash of the node's creation tick: a fixed, per-node draw (every page of
//!   the node, and both halves of a split, share it; the same calls give the same keys);
//! - `w = min(lineage − 2, 3) / 3` (0 below lineage 2) grows with [`NodeStats::lineage`], the
//!   nodes on the root path when the node was created. Each turn of a conversation hangs its
//!   new tokens under the previous turn's, so lineage counts turns (plus one per shared prefix
//!   node, such as a system prompt). On the Mooncake conversation trace the chance that a
//!   request is continued rises with the turns behind it: 30 % after a first turn, 51 % after
//!   the third, 77 % after the seventh. A leaf with at most one node above it (a first turn, a
//!   question under a shared system prompt) gets no hold: such leaves are mostly never reused
//!   (generated-shared-prefix questions never are), and holding them displaces the shared
//!   prefixes.
//!
//! Conversations come back hundreds of requests later (median 430 requests on the Mooncake
//! trace; the chance of a return is lowest in the first 50 requests and peaks at 200–800). A
//! cache whose LRU reach is shorter than that evicts every conversation before it returns. With
//! the holds spread over `[0, horizon × w)`, eviction takes the short holds first, so at a small
//! capacity the long holds (a subset, biased to long conversations) outlive their return, as in
//! bimodal insertion (Qureshi et al., ISCA 2007); at a capacity whose reach is beyond `horizon`
//! the holds are small next to it and the order is LRU's with jitter. Nothing is tuned per
//! capacity.
//!
//! `horizon` is in the cache's logical ticks (one per match, insert and eviction decision, so
//! several per request); [`LineageTtl::DEFAULT_HORIZON`] was chosen on the Mooncake conversation
//! trace at page size 512 (README, "Eviction policy research", has the sweep and the results on
//! the other workloads: a large gain on multi-turn chat, a small one on the Mooncake trace,
//! within 0.6 points of LRU on shared-prefix prompts, a point behind it on some trace variants:
//! it is opt-in, LRU stays the default). The keys do not grow with access (a hold can put an older
//! leaf after a newer one), so the cache keeps the leaves in its ordered set: O(log n) per key
//! change, as LFU.

use super::{EvictionKey, EvictionPolicy, NodeStats};

/// LRU with per-node hold times that grow with lineage: see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LineageTtl {
    /// The longest extra hold, in cache ticks, a leaf of lineage [`Self::FULL_LINEAGE`] or more
    /// can draw.
    pub horizon: u64,
}

impl LineageTtl {
    /// The name `--radix-eviction-policy` accepts for it.
    pub const NAME: &'static str = "lineage-ttl";

    /// The default hold horizon in ticks (see the module documentation).
    pub const DEFAULT_HORIZON: u64 = 10_000;

    /// Lineage up to which a leaf gets no hold (plain LRU).
    pub const BASE_LINEAGE: u32 = 2;

    /// Lineage from which a leaf draws from the whole horizon.
    pub const FULL_LINEAGE: u32 = 5;

    /// A policy with the given hold horizon in ticks (0 is LRU).
    pub const fn new(horizon: u64) -> Self {
        LineageTtl { horizon }
    }

    /// The extra hold node `n` gets, in ticks: `horizon × u × w` of the module documentation.
    pub fn hold(&self, n: &NodeStats) -> u64 {
        let full = u64::from(Self::FULL_LINEAGE - Self::BASE_LINEAGE);
        let w = u64::from(n.lineage.saturating_sub(Self::BASE_LINEAGE)).min(full);
        // u in [0, 1) as a 32-bit fraction; the product fits u128 for any horizon.
        let u = unit_draw(n.creation) >> 32;
        let scaled = u128::from(self.horizon) * u128::from(u) * u128::from(w);
        (scaled / (u128::from(full) << 32)) as u64
    }
}

impl Default for LineageTtl {
    fn default() -> Self {
        LineageTtl::new(Self::DEFAULT_HORIZON)
    }
}

impl EvictionPolicy for LineageTtl {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn key(&mut self, n: &NodeStats) -> EvictionKey {
        let deadline = n.last_access.saturating_add(self.hold(n));
        EvictionKey::new(
            deadline.min(i64::MAX as u64) as i64,
            n.last_access.min(i64::MAX as u64) as i64,
        )
    }
}

/// A well-mixed 64-bit draw from `x` (a splitmix64 round): equal inputs give equal draws.
fn unit_draw(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(last_access: u64, creation: u64, lineage: u32) -> NodeStats {
        NodeStats {
            last_access,
            creation,
            hit_count: 1,
            priority: 0,
            depth: 0,
            len: 16,
            lineage,
            path_hash: 0,
        }
    }

    #[test]
    fn shallow_leaves_are_lru_and_holds_grow_with_lineage() {
        let p = LineageTtl::default();
        // Lineage 0 to 2: no hold, whatever the draw.
        for creation in 0..100 {
            for lineage in 0..=2 {
                assert_eq!(p.hold(&stats(500, creation, lineage)), 0);
            }
        }
        // The same draw (creation tick) at deeper lineages: holds grow, then stop at 5.
        let mut grew = false;
        for creation in 0..100 {
            let h: Vec<u64> = (2..=7).map(|l| p.hold(&stats(0, creation, l))).collect();
            assert!(h.windows(2).all(|w| w[0] <= w[1]), "{h:?}");
            assert_eq!(
                h[3], h[5],
                "lineage 5 and beyond draw from the whole horizon"
            );
            assert!(h[5] < p.horizon);
            grew |= h[1] > 0 && h[2] > h[1];
        }
        assert!(grew);
        assert_eq!(LineageTtl::new(0).hold(&stats(0, 7, 9)), 0);
    }

    #[test]
    fn holds_spread_over_the_horizon() {
        let p = LineageTtl::new(1000);
        let holds: Vec<u64> = (0..10_000).map(|c| p.hold(&stats(0, c, 5))).collect();
        let mean = holds.iter().sum::<u64>() as f64 / holds.len() as f64;
        assert!((mean - 500.0).abs() < 20.0, "mean hold {mean}");
        assert!(holds.iter().any(|&h| h < 50) && holds.iter().any(|&h| h > 950));
    }

    #[test]
    fn keys_are_the_deadline_then_the_last_access() {
        let mut p = LineageTtl::new(1000);
        let n = stats(40, 3, 3);
        let k = p.key(&n);
        assert_eq!(k.primary, 40 + p.hold(&n) as i64);
        assert_eq!(k.secondary, 40);
        // A huge horizon or tick saturates instead of wrapping.
        let mut big = LineageTtl::new(u64::MAX);
        let k = big.key(&stats(u64::MAX - 1, 3, 9));
        assert_eq!(k.primary, i64::MAX);
    }
}
