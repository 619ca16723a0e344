//! The load-balancing policies of the regular router (`--worker-urls`), behind one trait,
//! [`LoadBalancingPolicy`] (sgl-router's `policies/`), so the HTTP router and a simulator run
//! the same decisions: a policy sees the request's [`Prompt`] and the candidate workers with
//! their loads, and picks one. It never does I/O and never blocks on anything but its own
//! lock, and its only clock is logical, so a scripted sequence gives the same decisions
//! every time (`tests::scripted_decisions` snapshots them).
//!
//! - `random`, `round_robin`: [`Basic`] over the PD router's [`Selector`];
//! - `power_of_two`: [`PowerOfTwo`], the less loaded of two random workers;
//! - `cache_aware`: [`CacheAware`], sgl-router's approximate tree ([`tree`]) of routed
//!   prompts per worker, load-balanced when workers are imbalanced;
//! - `kv_events`: [`KvEvents`], the longest prefix a worker really holds, from the index of
//!   its KV events ([`kv_index`]: per worker, a map of block ids), weighed against load.

pub mod cache_aware;
pub mod kv_events;
pub mod kv_index;
pub mod power_of_two;
pub mod tree;

use std::fmt::Debug;
use std::sync::{Arc, Mutex};

pub use cache_aware::CacheAware;
pub use kv_events::KvEvents;
pub use kv_index::{KvIndex, KvIndexError};
pub use power_of_two::PowerOfTwo;

pub use super::config::CacheAwareConfig;
use super::config::PolicyKind;
use super::policy::Selector;

/// A worker's identity for the policies: given once per worker by the router (never reused,
/// so a removed worker's leftovers never pass for a new one's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// A worker a request may go to, as a policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Who it is.
    pub id: WorkerId,
    /// Its load: the requests the router has in flight on it.
    pub load: usize,
}

/// What a request asks to run, as far as routing cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// A text prompt (for chat, the messages' contents joined).
    Text(String),
    /// Token ids (`input_ids`, or a `prompt` of numbers).
    Tokens(Vec<u32>),
    /// Nothing to route on.
    Empty,
}

impl Prompt {
    /// The symbols an approximate tree keys on: the text's characters, or the token ids.
    pub fn symbols(&self) -> Vec<u32> {
        match self {
            Prompt::Text(t) => t.chars().map(u32::from).collect(),
            Prompt::Tokens(ids) => ids.clone(),
            Prompt::Empty => Vec::new(),
        }
    }
}

/// A load-balancing policy (sgl-router's `LoadBalancingPolicy`).
pub trait LoadBalancingPolicy: Send + Sync + Debug {
    /// Its `--policy` name.
    fn name(&self) -> &'static str;
    /// The index in `candidates` of the worker for a request of `prompt`; `None` only when
    /// `candidates` is empty.
    fn select(&self, candidates: &[Candidate], prompt: &Prompt) -> Option<usize>;
    /// A worker left the router: forget what is kept about it.
    fn remove_worker(&self, _worker: WorkerId) {}
    /// Periodic upkeep (every `--eviction-interval` seconds): trims what the policy keeps.
    fn maintain(&self) {}
}

/// `random` and `round_robin` over the candidates.
#[derive(Debug)]
pub struct Basic(Selector);

impl LoadBalancingPolicy for Basic {
    fn name(&self) -> &'static str {
        self.0.kind().as_str()
    }
    fn select(&self, candidates: &[Candidate], _prompt: &Prompt) -> Option<usize> {
        (!candidates.is_empty()).then(|| self.0.pick(candidates.len()))
    }
}

/// The policy `kind` with `cache` (`cache_aware`'s settings; `kv_events` takes its balance
/// thresholds), its random choices from `seed` (`None`: a per-process seed); `kv_events`
/// reads `index`.
pub fn build(
    kind: PolicyKind,
    cache: CacheAwareConfig,
    seed: Option<u64>,
    index: Arc<Mutex<KvIndex>>,
) -> Box<dyn LoadBalancingPolicy> {
    let selector = |k| match seed {
        Some(s) => Selector::with_seed(k, s),
        None => Selector::new(k),
    };
    match kind {
        PolicyKind::Random | PolicyKind::RoundRobin => Box::new(Basic(selector(kind))),
        PolicyKind::PowerOfTwo => Box::new(PowerOfTwo::new(selector(PolicyKind::Random))),
        PolicyKind::CacheAware => Box::new(CacheAware::new(cache)),
        PolicyKind::KvEvents => Box::new(KvEvents::new(cache, index)),
    }
}

/// The chained block ids of `tokens`' whole pages of `page` tokens (for tests).
#[cfg(test)]
pub(crate) fn block_ids(tokens: &[u32], page: usize) -> Vec<i64> {
    use radix_cache::events::{chain_digests, digest_to_block_id};
    chain_digests(None, tokens, page)
        .iter()
        .map(digest_to_block_id)
        .collect()
}

/// A worker's `BlockStored` for pages `from..to` of `tokens` (for tests).
#[cfg(test)]
pub(crate) fn stored_pages(
    tokens: &[u32],
    from: usize,
    to: usize,
    page: usize,
) -> radix_cache::KvEvent {
    let all = block_ids(tokens, page);
    radix_cache::KvEvent::BlockStored {
        block_hashes: all[from..to].to_vec(),
        parent_block_hash: from.checked_sub(1).map(|i| all[i]),
        token_ids: tokens[from * page..to * page].to_vec(),
        block_size: page as u32,
    }
}

/// Candidates `0..` with these loads (for tests).
#[cfg(test)]
pub(crate) fn candidates(loads: &[usize]) -> Vec<Candidate> {
    loads
        .iter()
        .enumerate()
        .map(|(i, &load)| Candidate {
            id: WorkerId(i as u32),
            load,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;

    /// A scripted sequence: prompts of three groups sharing a prefix, loads that drift, one
    /// moment of imbalance; every policy's decisions as text.
    #[test]
    fn scripted_decisions() {
        let groups = [
            "You are a pirate. ",
            "Translate to French: ",
            "SELECT * FROM ",
        ];
        let order = [0, 0, 1, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2, 0, 1, 2, 1, 0];
        let mut out = format!("{:<13}", "group");
        for g in order {
            let _ = write!(out, " {g}");
        }
        out.push('\n');
        for kind in [
            PolicyKind::Random,
            PolicyKind::RoundRobin,
            PolicyKind::PowerOfTwo,
            PolicyKind::CacheAware,
        ] {
            let cache = CacheAwareConfig {
                balance_abs_threshold: 4,
                ..CacheAwareConfig::default()
            };
            let p = build(kind, cache, Some(42), Arc::default());
            let mut loads = [0usize; 3];
            let _ = write!(out, "{:<13}", p.name());
            for i in 0..18 {
                let prompt = if i == 17 {
                    Prompt::Empty
                } else {
                    Prompt::Text(format!("{}question {i}", groups[order[i]]))
                };
                if i == 12 {
                    loads = [9, 0, 1]; // imbalanced: max − min > 4 and max > 1.5 × min
                }
                let c = candidates(&loads);
                let pick = p.select(&c, &prompt).unwrap();
                if i < 12 {
                    loads[pick] += 1;
                }
                let _ = write!(out, " {pick}");
            }
            out.push('\n');
        }
        insta::assert_snapshot!(out);
    }

    #[test]
    fn no_candidate_is_none() {
        for kind in [
            PolicyKind::Random,
            PolicyKind::RoundRobin,
            PolicyKind::PowerOfTwo,
            PolicyKind::CacheAware,
            PolicyKind::KvEvents,
        ] {
            let p = build(kind, CacheAwareConfig::default(), Some(1), Arc::default());
            assert_eq!(p.select(&[], &Prompt::Empty), None, "{}", p.name());
            let one = [Candidate {
                id: WorkerId(7),
                load: 3,
            }];
            assert_eq!(p.select(&one, &Prompt::Text("x".into())), Some(0));
        }
    }
}
