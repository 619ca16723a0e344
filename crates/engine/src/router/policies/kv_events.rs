//! `kv_events`: route to the worker with the longest prefix it really holds, as its own KV
//! events report it ([`KvIndex`], fed by the router's subscribers or a simulator), weighed
//! against load.
//!
//! Per request, over the candidates and their loads (in-flight requests):
//! - imbalanced (`cache_aware`'s test: `max − min > --balance-abs-threshold` and `max >
//!   --balance-rel-threshold × min`): the least loaded worker;
//! - otherwise the worker holding the most leading pages of the prompt's chained block ids;
//!   ties (no match at all, typically) go to the less loaded, then to the one holding fewer
//!   pages (the most free cache), then to the first.
//!
//! A prompt given as text cannot be hashed without the workers' tokenizer, which the router
//! does not load: such requests are routed by the tie rule alone (load, then cache size).

use std::sync::{Arc, Mutex};

use super::cache_aware::imbalanced;
use super::kv_index::KvIndex;
use super::{Candidate, LoadBalancingPolicy, Prompt, WorkerId};
use crate::router::config::CacheAwareConfig;

/// The KV-event policy.
#[derive(Debug)]
pub struct KvEvents {
    balance: CacheAwareConfig,
    index: Arc<Mutex<KvIndex>>,
}

impl KvEvents {
    /// A policy reading `index`, load-balanced with `balance`'s thresholds.
    pub fn new(balance: CacheAwareConfig, index: Arc<Mutex<KvIndex>>) -> Self {
        KvEvents { balance, index }
    }

    /// The index it reads (its subscribers write it).
    pub fn index(&self) -> &Arc<Mutex<KvIndex>> {
        &self.index
    }
}

impl LoadBalancingPolicy for KvEvents {
    fn name(&self) -> &'static str {
        "kv_events"
    }

    fn select(&self, candidates: &[Candidate], prompt: &Prompt) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        if imbalanced(candidates, &self.balance) {
            return (0..candidates.len()).min_by_key(|&i| candidates[i].load);
        }
        let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        let matched = match prompt {
            Prompt::Tokens(t) => {
                let ids: Vec<WorkerId> = candidates.iter().map(|c| c.id).collect();
                index.matched_pages_of(&ids, t)
            }
            _ => vec![0; candidates.len()],
        };
        (0..candidates.len()).min_by_key(|&i| {
            let c = candidates[i];
            (
                std::cmp::Reverse(matched[i]),
                c.load,
                index.held_pages(c.id),
                i,
            )
        })
    }

    fn remove_worker(&self, worker: WorkerId) {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        index.remove_worker(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::policies::candidates;
    use radix_cache::KvEvent;

    const P: usize = 4;

    fn ids(tokens: &[u32]) -> Vec<i64> {
        crate::router::policies::block_ids(tokens, P)
    }

    /// A worker's `BlockStored` for pages `from..` of `tokens`.
    fn stored(tokens: &[u32], from: usize) -> KvEvent {
        crate::router::policies::stored_pages(tokens, from, tokens.len() / P, P)
    }

    #[test]
    fn the_longest_real_prefix_wins_and_removals_count() {
        let p = KvEvents::new(CacheAwareConfig::default(), Arc::default());
        let a: Vec<u32> = (0..16).collect(); // 4 pages
        let mut b = a[..8].to_vec();
        b.extend(100..108); // shares 2 pages with a
        {
            let mut ix = p.index().lock().unwrap();
            ix.apply(WorkerId(0), &[stored(&a[..8], 0)]).unwrap();
            ix.apply(WorkerId(1), &[stored(&a, 0)]).unwrap();
            ix.apply(WorkerId(2), &[stored(&b, 0)]).unwrap();
            ix.check().unwrap();
            assert_eq!(ix.matched_pages(WorkerId(2), &ids(&a)), 2);
        }
        let c = candidates(&[0, 0, 0]);
        assert_eq!(p.select(&c, &Prompt::Tokens(a.clone())), Some(1));
        assert_eq!(p.select(&c, &Prompt::Tokens(b.clone())), Some(2));
        // Worker 1 evicts its last two pages: 0 and 1 then tie at 2 pages; 0 holds fewer.
        let gone = ids(&a)[2..].to_vec();
        p.index()
            .lock()
            .unwrap()
            .apply(WorkerId(1), &[KvEvent::BlockRemoved { block_hashes: gone }])
            .unwrap();
        p.index().lock().unwrap().check().unwrap();
        assert_eq!(p.select(&c, &Prompt::Tokens(a.clone())), Some(0));
        // Load breaks a tie; imbalance overrides a match.
        assert_eq!(
            p.select(&candidates(&[3, 0, 0]), &Prompt::Tokens(a.clone())),
            Some(1)
        );
        assert_eq!(
            p.select(&candidates(&[0, 0, 70]), &Prompt::Tokens(b)),
            Some(0)
        );
        // Text cannot be hashed: the tie rule (worker 0 holds the fewest pages).
        assert_eq!(p.select(&c, &Prompt::Text("hi".into())), Some(0));
        // A cleared worker holds nothing; a removed one is forgotten.
        let mut ix = p.index().lock().unwrap();
        ix.apply(WorkerId(2), &[KvEvent::AllBlocksCleared]).unwrap();
        ix.remove_worker(WorkerId(1));
        ix.check().unwrap();
        assert_eq!(ix.held_pages(WorkerId(2)) + ix.held_pages(WorkerId(1)), 0);
        assert_eq!(ix.matched_pages(WorkerId(0), &ids(&a)), 2);
    }

    #[test]
    fn a_late_chain_is_left_out_and_a_foreign_page_size_refused() {
        let mut ix = KvIndex::default();
        let a: Vec<u32> = (0..12).collect();
        ix.apply(WorkerId(0), &[stored(&a, 1)]).unwrap();
        assert_eq!((ix.held_pages(WorkerId(0)), ix.unplaced()), (0, 2));
        let bad = KvEvent::BlockStored {
            block_hashes: vec![1],
            parent_block_hash: None,
            token_ids: vec![0; 8],
            block_size: 8,
        };
        assert!(ix.apply(WorkerId(0), &[bad]).is_err());
        ix.check().unwrap();
    }
}
