//! A toy eviction policy written against `radix_cache::policy::EvictionPolicy` alone: deepest
//! leaf first. A leaf whose last token lies furthest from the root goes first (the tails of
//! long contexts), so short shared prefixes (system prompts, few-shot headers) stay longest;
//! least recently used first among leaves ending at the same depth. None of SGLang's orderings
//! looks at depth.

use radix_cache::policy::{EvictionKey, EvictionPolicy, NodeStats};

/// Deepest leaf first, then least recently used.
#[derive(Debug, Clone, Default)]
pub struct DeepestFirst;

impl EvictionPolicy for DeepestFirst {
    fn name(&self) -> &str {
        "deepest-first"
    }

    fn key(&mut self, node: &NodeStats) -> EvictionKey {
        let end = node.depth.saturating_add(node.len);
        EvictionKey::new(
            -(end.min(i64::MAX as usize) as i64),
            node.last_access as i64,
        )
    }
}

/// A broken policy for the negative test: its key counts the calls it received, so the same
/// statistics get a different key each time (a key must be a function of the statistics and of
/// the `on_evict` / `advance_to` calls).
#[derive(Debug, Clone, Default)]
pub struct CallCounting {
    calls: i64,
}

impl EvictionPolicy for CallCounting {
    fn name(&self) -> &str {
        "call-counting"
    }

    fn key(&mut self, node: &NodeStats) -> EvictionKey {
        self.calls += 1;
        EvictionKey::new(node.last_access as i64, self.calls)
    }
}
