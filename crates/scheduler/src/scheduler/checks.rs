//! The invariant checker (SGLang's `scheduler_components/invariant_checker.py`): the pool
//! partition between steps, SGLang's idle identity, and strict mode.

use kv_pool::{Allocator, Owner, OwnershipCheck};
use radix_cache::PrefixCache;

use super::Scheduler;
use crate::error::{Result, SchedulerError};

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// Proves that free pages, tree pages and request-private pages partition the pool (the
    /// kv-pool ownership checker; PD's held and transferring requests own their private
    /// slots too), and, when idle with nothing held or transferring, SGLang's identity
    /// `available + evictable + protected = total`, that nothing is protected and that every
    /// row is free. `Err` names the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut check = OwnershipCheck::new(&self.alloc);
        self.cache.claim_ownership(&mut check);
        let live = self
            .running
            .iter()
            .chain(self.chunked.iter())
            .chain(self.held.iter())
            .chain(self.transferring.iter());
        for id in live {
            let r = &self.reqs[id];
            let row = r.row.ok_or_else(|| format!("{id} runs without a row"))?;
            let slots = self
                .rows
                .read(row, r.allocated_len)
                .map_err(|e| e.to_string())?;
            check.claim(Owner::Request(row), &slots[r.prefix.cache_protected_len..]);
        }
        check.finish().map_err(|v| v.to_string())?;
        for id in &self.prealloc_queue {
            if self.reqs[id].row.is_some() {
                return Err(format!("{id} is prealloc-queued with a row"));
            }
        }
        if self.is_idle() && self.held.is_empty() && self.transferring.is_empty() {
            self.check_idle_identity()?;
        }
        Ok(())
    }

    /// SGLang's idle leak check (`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`).
    fn check_idle_identity(&self) -> std::result::Result<(), String> {
        let (available, evictable, protected) = (
            self.alloc.available_size(),
            self.cache.evictable_size(),
            self.cache.protected_size(),
        );
        if available + evictable + protected != self.alloc.size() {
            return Err(format!(
                "idle identity: available {available} + evictable {evictable} + protected {protected} != {}",
                self.alloc.size()
            ));
        }
        if protected != 0 {
            return Err(format!("idle with {protected} protected tokens"));
        }
        if self.rows.available_size() != self.rows.size() {
            return Err(format!(
                "idle with {} rows held",
                self.rows.size() - self.rows.available_size()
            ));
        }
        Ok(())
    }

    /// Strict mode (`SchedulerConfig::strict`): the invariants after every step, a violation
    /// failing the step.
    pub(super) fn strict_check(&self) -> Result<()> {
        if !self.cfg.strict {
            return Ok(());
        }
        self.check_invariants()
            .map_err(|message| SchedulerError::Invariant {
                step: self.steps,
                message,
            })
    }
}
