//! HiCache's configuration and reports for a [`crate::RadixCache`] with a host tier (SGLang's
//! `HiRadixCache`, `mem_cache/hiradix_cache.py`): the write policy that decides when device
//! pages are backed up to host memory, the prefetch policy that decides when a request stops
//! waiting for L3 storage, the thresholds, what a load-back did, and the tier counters.
//!
//! The tree itself lives in `radix/`; a cache gets its host tier from
//! [`crate::RadixCache::with_host_tier`]. Without one, none of this is used.

use std::fmt;
use std::str::FromStr;

use crate::error::{RadixCacheError, Result};
use crate::NodeId;

/// When device pages are copied to host memory (SGLang's `--hicache-write-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WritePolicy {
    /// `write_through`: a node is backed up as soon as its hit count reaches 1.
    #[default]
    WriteThrough,
    /// `write_through_selective`: a node is backed up when its hit count reaches 2.
    WriteThroughSelective,
    /// `write_back`: nothing is copied until a node is evicted from the device; eviction then
    /// copies it and waits for the copy.
    WriteBack,
}

impl WritePolicy {
    /// Every policy, in SGLang's order.
    pub const ALL: [WritePolicy; 3] = [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective,
        WritePolicy::WriteBack,
    ];

    /// SGLang's name for the policy.
    pub const fn as_str(self) -> &'static str {
        match self {
            WritePolicy::WriteThrough => "write_through",
            WritePolicy::WriteThroughSelective => "write_through_selective",
            WritePolicy::WriteBack => "write_back",
        }
    }

    /// The hit count at which an insert backs a node up (SGLang's `write_through_threshold`);
    /// `None` for write-back, which backs up only on eviction.
    pub const fn threshold(self) -> Option<u32> {
        match self {
            WritePolicy::WriteThrough => Some(1),
            WritePolicy::WriteThroughSelective => Some(2),
            WritePolicy::WriteBack => None,
        }
    }
}

impl fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for WritePolicy {
    type Err = RadixCacheError;

    fn from_str(s: &str) -> Result<Self> {
        parse_named(
            s,
            "hicache write policy",
            WritePolicy::ALL,
            WritePolicy::as_str,
        )
    }
}

/// When a request waiting for an L3 prefetch may go on (SGLang's
/// `--hicache-storage-prefetch-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PrefetchPolicy {
    /// `best_effort`: stop at the first check, keep whatever landed.
    #[default]
    BestEffort,
    /// `wait_complete`: wait until the prefetch has completed.
    WaitComplete,
    /// `timeout`: wait until it completes or its timeout passes
    /// ([`HiCacheConfig::prefetch_timeout_s`]).
    Timeout,
}

impl PrefetchPolicy {
    /// Every policy, in SGLang's order.
    pub const ALL: [PrefetchPolicy; 3] = [
        PrefetchPolicy::BestEffort,
        PrefetchPolicy::WaitComplete,
        PrefetchPolicy::Timeout,
    ];

    /// SGLang's name for the policy.
    pub const fn as_str(self) -> &'static str {
        match self {
            PrefetchPolicy::BestEffort => "best_effort",
            PrefetchPolicy::WaitComplete => "wait_complete",
            PrefetchPolicy::Timeout => "timeout",
        }
    }
}

impl fmt::Display for PrefetchPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PrefetchPolicy {
    type Err = RadixCacheError;

    fn from_str(s: &str) -> Result<Self> {
        parse_named(
            s,
            "hicache prefetch policy",
            PrefetchPolicy::ALL,
            PrefetchPolicy::as_str,
        )
    }
}

/// The one of `all` whose SGLang name is `s`, or an error listing the names.
fn parse_named<T: Copy, const N: usize>(
    s: &str,
    what: &'static str,
    all: [T; N],
    name: fn(T) -> &'static str,
) -> Result<T> {
    all.into_iter()
        .find(|&v| name(v) == s)
        .ok_or_else(|| RadixCacheError::UnknownOption {
            what,
            name: s.to_string(),
            known: all.map(name).join(", "),
        })
}

/// A host tier's configuration, with SGLang's defaults ([`Default`]).
#[derive(Debug, Clone, PartialEq)]
pub struct HiCacheConfig {
    /// When device pages are backed up to host.
    pub write_policy: WritePolicy,
    /// Allocatable host slots (tokens), a positive multiple of the page size; the host pool
    /// has one padding page more (as the device pool).
    pub host_slots: usize,
    /// Fewest host-only tokens worth a load-back (SGLang's `load_back_threshold`, 10).
    pub load_back_threshold: usize,
    /// Fewest page-aligned tokens beyond the device + host match worth an L3 prefetch
    /// (SGLang's `prefetch_threshold`, 256).
    pub prefetch_threshold: usize,
    /// Largest share of the host pool that in-flight prefetches may reserve (0.5).
    pub prefetch_max_host_share: f64,
    /// When a request stops waiting for its prefetch.
    pub prefetch_policy: PrefetchPolicy,
    /// `timeout` policy: seconds granted to every prefetch (2.0).
    pub prefetch_timeout_base_s: f64,
    /// `timeout` policy: seconds granted per 1024 prefetched tokens (0.1).
    pub prefetch_timeout_per_ki_token_s: f64,
    /// `timeout` policy: the most seconds any prefetch is granted (30.0).
    pub prefetch_timeout_max_s: f64,
}

impl Default for HiCacheConfig {
    fn default() -> Self {
        HiCacheConfig {
            write_policy: WritePolicy::WriteThrough,
            host_slots: 0,
            load_back_threshold: 10,
            prefetch_threshold: 256,
            prefetch_max_host_share: 0.5,
            prefetch_policy: PrefetchPolicy::BestEffort,
            prefetch_timeout_base_s: 2.0,
            prefetch_timeout_per_ki_token_s: 0.1,
            prefetch_timeout_max_s: 30.0,
        }
    }
}

impl HiCacheConfig {
    /// The `timeout` policy's limit for a prefetch of `tokens` tokens, in seconds:
    /// `min(max, base + per_ki × tokens / 1024)`.
    pub fn prefetch_timeout_s(&self, tokens: usize) -> f64 {
        (self.prefetch_timeout_base_s
            + self.prefetch_timeout_per_ki_token_s * tokens as f64 / 1024.0)
            .min(self.prefetch_timeout_max_s)
    }
}

/// What [`crate::PrefixCache::init_load_back`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadBack {
    /// Tokens loaded back (their new device slots were appended to the caller's buffer); 0 if
    /// nothing was.
    pub loaded: usize,
    /// The deepest node now on device along the path: lock this one for the request.
    pub last_node: NodeId,
}

/// A host tier's counters and occupancy ([`crate::PrefixCache::tier_stats`]). Sizes are in
/// tokens (slots); the op counters count operations, the page counters pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    /// Allocatable host slots.
    pub host_slots_total: usize,
    /// Host slots allocated (backed-up nodes, in-flight prefetches, pages pinned by an
    /// in-flight copy of a dropped node).
    pub host_slots_used: usize,
    /// Host slots of host-only nodes that host eviction may free now.
    pub host_slots_evictable: usize,
    /// Host slots in use that host eviction may not free now.
    pub host_slots_protected: usize,
    /// Tokens `match_prefix` found on device.
    pub device_hit_tokens: u64,
    /// Tokens loaded back from host (`init_load_back`).
    pub host_hit_tokens: u64,
    /// Tokens prefetched from L3 storage and inserted.
    pub storage_hit_tokens: u64,
    /// Device → host copies queued.
    pub writes_queued: u64,
    /// Device → host copies acknowledged.
    pub writes_acked: u64,
    /// Write-through copies queued again after their copy failed (counted in `writes_acked`
    /// once per attempt; `writes_queued` counts the first).
    pub writes_retried: u64,
    /// Host → device load-backs queued.
    pub loads_queued: u64,
    /// Host → device load-backs acknowledged.
    pub loads_acked: u64,
    /// Load-backs queued again after their copy failed (counted in `loads_acked` once per
    /// attempt; `loads_queued` counts the first).
    pub loads_retried: u64,
    /// Host → L3 backups queued.
    pub backups_queued: u64,
    /// Host → L3 backups acknowledged.
    pub backups_acked: u64,
    /// L3 → host prefetches queued (after a query found pages).
    pub prefetches_queued: u64,
    /// L3 → host prefetches acknowledged.
    pub prefetches_acked: u64,
    /// Pages demoted from device to host-only.
    pub pages_demoted: u64,
    /// Pages freed by host eviction.
    pub pages_host_evicted: u64,
    /// Pages dropped from both tiers (write-back eviction with no host room).
    pub pages_dropped: u64,
    /// Operations the controller reported as failed.
    pub ops_failed: u64,
    /// Operations queued and not yet acknowledged (every kind, existence queries included),
    /// plus prefetches not yet stopped.
    pub ops_in_flight: usize,
}

impl TierStats {
    /// Operations in flight ([`ops_in_flight`](Self::ops_in_flight)): while any is, nodes stay
    /// locked or pinned, so a scheduler is not idle (and `reset` is refused).
    pub fn in_flight(&self) -> usize {
        self.ops_in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_is_an_error() {
        for p in WritePolicy::ALL {
            assert_eq!(p.to_string().parse::<WritePolicy>().unwrap(), p);
        }
        for p in PrefetchPolicy::ALL {
            assert_eq!(p.to_string().parse::<PrefetchPolicy>().unwrap(), p);
        }
        assert!("write-through".parse::<WritePolicy>().is_err());
        assert!("never".parse::<PrefetchPolicy>().is_err());
        assert_eq!(WritePolicy::WriteThroughSelective.threshold(), Some(2));
    }

    #[test]
    fn timeout_grows_with_tokens_up_to_the_max() {
        let c = HiCacheConfig::default();
        assert!((c.prefetch_timeout_s(0) - 2.0).abs() < 1e-9);
        assert!((c.prefetch_timeout_s(10240) - 3.0).abs() < 1e-9);
        assert!((c.prefetch_timeout_s(1 << 30) - 30.0).abs() < 1e-9);
    }
}
