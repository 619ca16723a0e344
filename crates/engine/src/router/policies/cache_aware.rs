//! `cache_aware` (sgl-router's `CacheAwarePolicy`): route where the prompt's prefix was sent
//! before, unless the workers are imbalanced.
//!
//! Per request, over the candidate workers and their loads (in-flight requests):
//! - imbalanced when `max − min > balance_abs_threshold` and `max > balance_rel_threshold ×
//!   min`: the least loaded worker (the first on a tie);
//! - otherwise the approximate tree's longest match among the candidates: if it covers more
//!   than `cache_threshold` of the prompt, the worker holding it (the most recent); else the
//!   worker holding the fewest symbols (the most free cache).
//!
//! Either way the prompt is inserted for the chosen worker. `maintain` (every
//! `--eviction-interval` seconds) trims each worker's share of the tree to `max_tree_size`
//! symbols, least recently used leaves first.
//!
//! Where this differs from sgl-router: the match is restricted to the candidates (healthy
//! workers), so it never picks a worker it must then fall back from; and at a node held by
//! several workers it names the most recent one (sgl-router takes whichever its map yields
//! first).

use std::sync::Mutex;

use super::tree::ApproxTree;
use super::{Candidate, LoadBalancingPolicy, Prompt, WorkerId};
use crate::router::config::CacheAwareConfig;

/// The cache-aware policy.
#[derive(Debug)]
pub struct CacheAware {
    config: CacheAwareConfig,
    tree: Mutex<ApproxTree>,
}

impl CacheAware {
    /// A policy with an empty tree.
    pub fn new(config: CacheAwareConfig) -> Self {
        CacheAware {
            config,
            tree: Mutex::default(),
        }
    }

    fn tree(&self) -> std::sync::MutexGuard<'_, ApproxTree> {
        self.tree.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether the candidates' loads call for load balancing (`max − min > abs` and `max > rel ×
/// min`).
pub fn imbalanced(candidates: &[Candidate], config: &CacheAwareConfig) -> bool {
    let loads = candidates.iter().map(|c| c.load);
    let (Some(max), Some(min)) = (loads.clone().max(), loads.min()) else {
        return false;
    };
    max - min > config.balance_abs_threshold
        && max as f32 > min as f32 * config.balance_rel_threshold
}

impl LoadBalancingPolicy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn select(&self, candidates: &[Candidate], prompt: &Prompt) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        let key = prompt.symbols();
        let mut tree = self.tree();
        let pick = if imbalanced(candidates, &self.config) {
            (0..candidates.len()).min_by_key(|&i| candidates[i].load)?
        } else {
            let ids: Vec<WorkerId> = candidates.iter().map(|c| c.id).collect();
            let m = tree.prefix_match(&key, &|w| ids.contains(&w));
            let rate = if key.is_empty() {
                0.0
            } else {
                m.len as f32 / key.len() as f32
            };
            let chosen = match m.worker {
                Some(w) if rate > self.config.cache_threshold => w,
                _ => tree.smallest(&ids)?,
            };
            ids.iter().position(|&w| w == chosen)?
        };
        tree.insert(&key, candidates[pick].id);
        Some(pick)
    }

    fn remove_worker(&self, worker: WorkerId) {
        self.tree().remove_tenant(worker);
    }

    fn maintain(&self) {
        self.tree().evict_to(self.config.max_tree_size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::policies::candidates;

    #[test]
    fn a_shared_prefix_sticks_new_prefixes_spread_and_imbalance_overrides() {
        let p = CacheAware::new(CacheAwareConfig::default());
        let c = candidates(&[0, 0, 0]);
        let t = |s: &str| Prompt::Text(s.to_string());
        // Three new prefixes go to the three emptiest workers.
        let firsts: Vec<usize> = ["alpha one", "beta one", "gamma one"]
            .iter()
            .map(|s| p.select(&c, &t(s)).unwrap())
            .collect();
        assert_eq!(firsts, [0, 1, 2]);
        // Each follow-up shares most of its group's text: same worker.
        for (s, want) in [("alpha two", 0), ("gamma two", 2), ("beta two", 1)] {
            assert_eq!(p.select(&c, &t(s)), Some(want), "{s}");
        }
        // Below the threshold (1 of 9 symbols): the smallest tree, not the match.
        assert_eq!(p.select(&c, &t("azzzzzzzz")), Some(1));
        // Imbalanced (70 − 0 > 64 and 70 > 1.5 × 0): the least loaded, match or not.
        assert_eq!(
            p.select(&candidates(&[0, 70, 0]), &t("beta three")),
            Some(0)
        );
        // Only a candidate can be picked: worker 1 is gone from the list.
        let only = [c[0], c[2]];
        assert_eq!(p.select(&only, &t("gamma three")), Some(1));
    }

    #[test]
    fn maintain_trims_and_removal_forgets() {
        let cfg = CacheAwareConfig {
            max_tree_size: 4,
            ..CacheAwareConfig::default()
        };
        let p = CacheAware::new(cfg);
        let c = candidates(&[0, 0]);
        assert_eq!(
            p.select(&c, &Prompt::Tokens(vec![1, 2, 3, 4, 5, 6])),
            Some(0)
        );
        p.maintain();
        assert!(p.tree().size(WorkerId(0)) <= 4);
        p.remove_worker(WorkerId(0));
        assert_eq!(p.tree().size(WorkerId(0)), 0);
        p.tree().check().unwrap();
    }
}
