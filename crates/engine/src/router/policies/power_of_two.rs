//! `power_of_two` (sgl-router's `PowerOfTwoPolicy`): two distinct workers drawn at random,
//! the request goes to the less loaded (the first drawn on a tie). Loads are the router's own
//! in-flight counts.

use super::{Candidate, LoadBalancingPolicy, Prompt};
use crate::router::policy::Selector;

/// The power-of-two-choices policy.
#[derive(Debug)]
pub struct PowerOfTwo(Selector);

impl PowerOfTwo {
    /// Draws through `random` (a `random` selector).
    pub fn new(random: Selector) -> Self {
        PowerOfTwo(random)
    }
}

impl LoadBalancingPolicy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&self, candidates: &[Candidate], _prompt: &Prompt) -> Option<usize> {
        let n = candidates.len();
        if n < 2 {
            return (n == 1).then_some(0);
        }
        let a = self.0.pick(n);
        // The second is drawn among the others: shift past `a`.
        let b = (a + 1 + self.0.pick(n - 1)) % n;
        Some(if candidates[b].load < candidates[a].load {
            b
        } else {
            a
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::config::PolicyKind;
    use crate::router::policies::WorkerId;

    #[test]
    fn the_most_loaded_worker_is_never_picked_and_the_least_loaded_most_often() {
        let p = PowerOfTwo::new(Selector::with_seed(PolicyKind::Random, 3));
        let c: Vec<Candidate> = [5, 0, 2]
            .iter()
            .enumerate()
            .map(|(i, &load)| Candidate {
                id: WorkerId(i as u32),
                load,
            })
            .collect();
        let mut seen = [0; 3];
        for _ in 0..3000 {
            seen[p.select(&c, &Prompt::Empty).unwrap()] += 1;
        }
        // Worker 1 wins whenever drawn (2 of 3 pairs), worker 2 against worker 0 only.
        assert_eq!(seen[0], 0, "{seen:?}");
        assert!((1800..2200).contains(&seen[1]), "{seen:?}");
        assert!((800..1200).contains(&seen[2]), "{seen:?}");
    }
}
