//! Worker selection ([`Selector`]: SGLang's `random` and `round_robin` load-balancing
//! policies, one selector per role so the two counters never interfere, as SGLang's PD router
//! keeps separate prefill and decode policies) and the per-request bootstrap rooms
//! ([`RoomGenerator`]).
//!
//! Both are lock-free: a counter advanced atomically and, for randomness, SplitMix64's
//! finaliser ([`kv_pool::rng::mix64`]) over it, seeded once per process from the standard
//! library's per-process random hasher keys.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kv_pool::rng::{mix64, GOLDEN_GAMMA};

use super::config::PolicyKind;

/// A random 64-bit seed, different in every process (and every call).
fn process_seed() -> u64 {
    RandomState::new().hash_one(std::process::id())
}

/// Random 64-bit values from a shared atomic SplitMix64 state.
#[derive(Debug)]
struct AtomicSplitMix(AtomicU64);

impl AtomicSplitMix {
    fn next(&self) -> u64 {
        mix64(
            self.0
                .fetch_add(GOLDEN_GAMMA, Relaxed)
                .wrapping_add(GOLDEN_GAMMA),
        )
    }
}

/// Picks the index of the worker that serves a request, among `n` workers of one role.
#[derive(Debug)]
pub struct Selector {
    kind: PolicyKind,
    counter: AtomicU64,
    rng: AtomicSplitMix,
}

impl Selector {
    /// A selector following `kind`, its random stream seeded per process.
    pub fn new(kind: PolicyKind) -> Self {
        Self::with_seed(kind, process_seed())
    }

    /// A selector whose random choices follow `seed` (for tests).
    pub fn with_seed(kind: PolicyKind, seed: u64) -> Self {
        Selector {
            kind,
            counter: AtomicU64::new(0),
            rng: AtomicSplitMix(AtomicU64::new(seed)),
        }
    }

    /// The policy it follows.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// An index in `0..n` (`0` when `n == 0`): `round_robin` cycles 0, 1, …, n − 1, 0, …
    /// across all callers; every other kind is uniform.
    pub fn pick(&self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        match self.kind {
            PolicyKind::RoundRobin => (self.counter.fetch_add(1, Relaxed) % n as u64) as usize,
            // The other policies draw their random choices through a `random` selector.
            _ => ((self.rng.next() as u128 * n as u128) >> 64) as usize,
        }
    }
}

/// Draws each request's `bootstrap_room`: uniform in `[0, 2⁶³ − 1]`, as SGLang's router
/// (Python's `random.randint(0, 2**63 - 1)`), so the room fits a signed 64-bit integer on
/// every side. Consecutive rooms of one generator come from distinct SplitMix64 states.
#[derive(Debug)]
pub struct RoomGenerator(AtomicSplitMix);

impl Default for RoomGenerator {
    fn default() -> Self {
        RoomGenerator(AtomicSplitMix(AtomicU64::new(process_seed())))
    }
}

impl RoomGenerator {
    /// The next room.
    pub fn next_room(&self) -> u64 {
        self.0.next() & (i64::MAX as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_cycles_and_random_covers_every_worker() {
        let rr = Selector::new(PolicyKind::RoundRobin);
        let picks: Vec<usize> = (0..7).map(|_| rr.pick(3)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
        let random = Selector::with_seed(PolicyKind::Random, 7);
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            seen[random.pick(4)] += 1;
        }
        assert!(seen.iter().all(|&c| (800..1200).contains(&c)), "{seen:?}");
        assert_eq!(random.pick(0), 0);
    }

    #[test]
    fn rooms_are_non_negative_i64_and_distinct() {
        let rooms = RoomGenerator::default();
        let drawn: std::collections::HashSet<u64> =
            (0..10_000).map(|_| rooms.next_room()).collect();
        assert_eq!(drawn.len(), 10_000);
        assert!(drawn.iter().all(|&r| r <= i64::MAX as u64));
    }
}
