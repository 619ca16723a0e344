//! Priority preemption (SGLang's `PrefillAdder.preempt_to_schedule` in `schedule_policy.py`):
//! a waiting request that beats running ones by more than the threshold retracts them, and the
//! reserved-token arithmetic admission shares with it.

use kv_pool::Allocator;
use radix_cache::PrefixCache;

use super::Scheduler;
use crate::error::Result;
use crate::report::StepReport;
use crate::req::ReqId;

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// Priority preemption (SGLang's `preempt_to_schedule`): if `id` beats running requests by
    /// more than the threshold, retract them worst-first until the tokens it needs could be
    /// free; returns the reserved tokens credited back (0: nothing preempted).
    pub(super) fn try_preempt_for(&mut self, id: ReqId, report: &mut StepReport) -> Result<f64> {
        if !self.cfg.enable_priority_scheduling {
            return Ok(0.0);
        }
        let low_first = self.cfg.low_priority_values_first;
        let prio = self.reqs[&id].priority;
        // How far `id` is ahead of a running request (positive: `id` is better).
        let gap = |p: i64| if low_first { p - prio } else { prio - p };
        let threshold = self.cfg.priority_preemption_threshold;
        let mut victims: Vec<ReqId> = self
            .running
            .iter()
            .copied()
            .filter(|r| gap(self.reqs[r].priority) > threshold)
            .collect();
        if victims.is_empty() {
            return Ok(0.0);
        }
        // Worst priority first, then the latest arrival.
        victims.sort_by_key(|r| {
            let q = &self.reqs[r];
            (
                std::cmp::Reverse(gap(q.priority)),
                std::cmp::Reverse(q.arrival),
            )
        });
        let need = self.reqs[&id].extend_input_len()
            + self.reqs[&id]
                .remaining_new_tokens()
                .min(self.cfg.clip_max_new_tokens)
            + self.cfg.page_size as usize;
        let mut credited = 0.0;
        for v in victims {
            if (self.alloc.available_size() + self.cache.evictable_size()) as f64
                > need as f64 + self.reserved_tokens()
            {
                break;
            }
            credited += self.reserved_for(v);
            self.retract(v, report)?;
        }
        if credited > 0.0 {
            self.batch_is_full = false;
        }
        Ok(credited)
    }

    /// The future decode tokens admission reserves for a running request.
    pub(super) fn reserved_for(&self, id: ReqId) -> f64 {
        self.reqs[&id]
            .remaining_new_tokens()
            .min(self.cfg.clip_max_new_tokens) as f64
            * self.ratio.current
    }

    /// What admission reserves for all running requests.
    pub(super) fn reserved_tokens(&self) -> f64 {
        self.running.iter().map(|&r| self.reserved_for(r)).sum()
    }
}
