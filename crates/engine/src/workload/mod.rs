//! Workloads: lists of requests (prompt token ids, output length, arrival time) that the trace
//! replayer, the simulator and the benchmark client all consume.
//!
//! Sources:
//! - [`mooncake`]: Mooncake JSONL traces, with tokens synthesized from the block hash ids;
//! - [`gsp`]: SGLang bench_serving's generated-shared-prefix workload;
//! - [`multiturn`]: multi-turn chat sessions whose prompts carry the whole history;
//! - [`random`]: SGLang bench_serving's random lengths (no shared prefixes).
//!
//! Generated workloads are deterministic functions of their configuration and seed.

pub mod gsp;
pub mod mooncake;
pub mod multiturn;
pub mod random;

pub use gsp::GspConfig;
pub use mooncake::{load_mooncake, parse_mooncake, MOONCAKE_BLOCK_TOKENS};
pub use multiturn::MultiTurnConfig;
pub use random::RandomConfig;

use scheduler::summary::ratio;
use std::collections::HashSet;

use kv_pool::rng::SplitMix64;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// Tokens to generate.
    pub output_len: usize,
    /// Arrival time in seconds from the start of the workload (0 for closed-loop workloads).
    pub arrival_s: f64,
}

/// A named list of requests, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// A short description (source and parameters), used in reports and plot captions.
    pub name: String,
    /// The requests, in the order they are served.
    pub requests: Vec<Request>,
}

/// Sizes of a workload as a prefix cache with page size `page_size` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadStats {
    /// Page size the figures are computed for.
    pub page_size: u32,
    pub requests: usize,
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// The longest prompt.
    pub max_prompt_tokens: usize,
    /// Distinct page-aligned prefix tokens: what a cache that never evicts holds at the end.
    pub unique_tokens: u64,
    /// Prompt tokens an infinite cache serves from cache (every request reuses the longest
    /// page-aligned prefix it shares with any earlier request).
    pub ideal_cached_tokens: u64,
}

impl WorkloadStats {
    /// `ideal_cached_tokens / prompt_tokens` (0 for an empty workload).
    pub fn ideal_hit_rate(&self) -> f64 {
        ratio(self.ideal_cached_tokens as f64, self.prompt_tokens as f64)
    }

    /// A capacity (in tokens, a multiple of the page size) with which a replay never evicts:
    /// every distinct prefix plus the longest prompt's pages (at least one page).
    pub fn never_evicting_capacity(&self) -> usize {
        let p = self.page_size as usize;
        (self.unique_tokens as usize + self.max_prompt_tokens.div_ceil(p) * p).max(p)
    }
}

impl Workload {
    /// Prompt tokens over all requests.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.tokens.len() as u64).sum()
    }

    /// Prompt plus output tokens of the longest request (at least 1): the context a run of
    /// this workload needs, less one.
    pub fn longest_request(&self) -> usize {
        self.requests
            .iter()
            .map(|r| r.tokens.len() + r.output_len.max(1))
            .max()
            .unwrap_or(1)
    }

    /// The workload's sizes at page size `page_size` (0 is taken as 1).
    ///
    /// The distinct page-aligned prefixes of a set of sequences number `Σ pages(sᵢ) −
    /// Σ lcp_pages(sᵢ, sᵢ₋₁)` over the sequences in sorted order, so this sorts the prompts
    /// instead of building a tree. With an infinite cache every request inserts its aligned
    /// prompt and adds exactly its unmatched pages, so the ideal cached tokens are
    /// `Σ aligned(sᵢ) − unique_tokens`.
    pub fn stats(&self, page_size: u32) -> WorkloadStats {
        let p = page_size.max(1) as usize;
        let aligned: Vec<&[u32]> = self
            .requests
            .iter()
            .map(|r| &r.tokens[..r.tokens.len() / p * p])
            .collect();
        let aligned_total: u64 = aligned.iter().map(|s| s.len() as u64).sum();
        let mut order: Vec<usize> = (0..aligned.len()).collect();
        order.sort_unstable_by(|&a, &b| aligned[a].cmp(aligned[b]));
        let shared: u64 = order
            .windows(2)
            .map(|w| (common_prefix(aligned[w[0]], aligned[w[1]]) / p * p) as u64)
            .sum();
        let unique = aligned_total - shared;
        WorkloadStats {
            page_size: p as u32,
            requests: self.requests.len(),
            prompt_tokens: self.prompt_tokens(),
            max_prompt_tokens: self
                .requests
                .iter()
                .map(|r| r.tokens.len())
                .max()
                .unwrap_or(0),
            unique_tokens: unique,
            ideal_cached_tokens: aligned_total - unique,
        }
    }
}

/// Length of the longest common prefix of two token slices.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Draws the token ids of generated workloads: uniform over `0..vocab_size`, except that the
/// first tokens of independent sequences (system prompts, questions, sessions) are drawn
/// without replacement while the vocabulary allows, so two sequences share exactly what the
/// workload means them to share, never a chance first token.
#[derive(Debug)]
pub(crate) struct TokenSource {
    rng: SplitMix64,
    vocab_size: u32,
    distinct_starts: bool,
    starts_used: HashSet<u32>,
}

impl TokenSource {
    /// A source for a workload that starts `sequences` independent sequences.
    pub(crate) fn new(seed: u64, vocab_size: u32, sequences: usize) -> Self {
        TokenSource {
            rng: SplitMix64::new(seed),
            vocab_size,
            distinct_starts: sequences <= vocab_size as usize,
            starts_used: HashSet::new(),
        }
    }

    fn token(&mut self) -> u32 {
        self.rng.below(self.vocab_size as usize) as u32
    }

    /// Appends an independent sequence of `len` tokens to `out`.
    pub(crate) fn sequence(&mut self, len: usize, out: &mut Vec<u32>) {
        if len == 0 {
            return;
        }
        let mut first = self.token();
        if self.distinct_starts {
            while !self.starts_used.insert(first) {
                first = self.token();
            }
        }
        out.push(first);
        for _ in 1..len {
            let t = self.token();
            out.push(t);
        }
    }

    /// The generator, for shuffling.
    pub(crate) fn rng(&mut self) -> &mut SplitMix64 {
        &mut self.rng
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(tokens: &[u32]) -> Request {
        Request {
            tokens: tokens.to_vec(),
            output_len: 1,
            arrival_s: 0.0,
        }
    }

    #[test]
    fn stats_count_distinct_aligned_prefixes() {
        let w = Workload {
            name: "t".into(),
            requests: vec![
                req(&[1, 2, 3, 4, 5]),
                req(&[1, 2, 3, 9]),
                req(&[1, 2, 3, 4, 5]),
                req(&[7]),
            ],
        };
        let s1 = w.stats(1);
        // Trie: 1-2-3-{4-5, 9}, 7 → 7 nodes.
        assert_eq!(s1.unique_tokens, 7);
        assert_eq!(s1.prompt_tokens, 15);
        assert_eq!(s1.ideal_cached_tokens, 3 + 5);
        assert_eq!(s1.max_prompt_tokens, 5);
        let s2 = w.stats(2);
        // Aligned: [1 2 3 4], [1 2 3 9], [1 2 3 4], [] → pages {12}, {12,34}, {12,39}.
        assert_eq!(s2.unique_tokens, 6);
        assert_eq!(s2.ideal_cached_tokens, 2 + 4);
        assert_eq!(s2.never_evicting_capacity(), 6 + 6);
    }

    #[test]
    fn token_source_starts_are_distinct() {
        let mut src = TokenSource::new(3, 10, 10);
        let mut firsts = HashSet::new();
        for _ in 0..10 {
            let mut v = Vec::new();
            src.sequence(3, &mut v);
            assert!(v.iter().all(|&t| t < 10));
            assert!(firsts.insert(v[0]));
        }
    }
}
