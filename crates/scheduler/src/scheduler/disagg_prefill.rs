//! PD prefill (SGLang's `disaggregation/prefill.py`): a request marked with
//! [`Scheduler::hold_kv_at_finish`] is scheduled as any other, but when it finishes it keeps
//! its row, its slots and its prefix lock (SGLang's inflight queue) instead of
//! `cache_finished_req`, so the engine can send its KV; [`Scheduler::release_held`] then does
//! what finishing would have done.
//!
//! Slot stability, which lets the engine send pages as chunks complete: the slot of a
//! position `< committed_len` does not change after the step that committed it. A middle
//! chunk's `cache_unfinished_req` may re-point pages computed in that very step at the tree's
//! copy (another request inserted the same tokens first); pages committed earlier are already
//! the tree's (locked by the request) or private, and held KV is never touched.

use kv_pool::{Allocator, Slot};
use radix_cache::PrefixCache;

use super::lifecycle::finished_req;
use super::Scheduler;
use crate::disagg::ReqStage;
use crate::error::{Result, SchedulerError};
use crate::req::{FinishReason, ReqId};

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// Marks a live request so that when it finishes (SGLang: its one prefill token) it keeps
    /// its KV until [`release_held`](Self::release_held): it still shows up in
    /// [`take_finished`](Self::take_finished), with `kv_held == true`. Idempotent. An abort,
    /// or a failed forward pass, ends it as usual (nothing held). Refused for an unknown id
    /// and for a decode-side request (prealloc-queued or transferring).
    pub fn hold_kv_at_finish(&mut self, id: ReqId) -> Result<()> {
        let stage = self.stage(id).ok_or(SchedulerError::UnknownRequest(id))?;
        match stage {
            ReqStage::Held => Ok(()),
            ReqStage::PreallocQueued | ReqStage::Transferring => Err(SchedulerError::WrongStage {
                id,
                expected: ReqStage::Waiting,
                found: stage,
            }),
            ReqStage::Waiting | ReqStage::Chunked | ReqStage::Running => {
                self.hold_at_finish.insert(id);
                Ok(())
            }
        }
    }

    /// Releases a held request's KV as finishing would have (SGLang's `release_kv_cache` after
    /// the transfer succeeded or failed): its committed tokens enter the prefix cache, the
    /// rest is freed, its lock and row are dropped. Typed errors for an unknown id and for a
    /// request that holds nothing; nothing changes then.
    pub fn release_held(&mut self, id: ReqId) -> Result<()> {
        self.expect_stage(id, ReqStage::Held)?;
        self.release_kv(id, true)?;
        self.held.retain(|&h| h != id);
        self.reqs.remove(&id);
        self.batch_is_full = false;
        Ok(())
    }

    /// `Ok` iff `id` is live and in `expected`; else `UnknownRequest` or `WrongStage`.
    pub(super) fn expect_stage(&self, id: ReqId, expected: ReqStage) -> Result<()> {
        let found = self.stage(id).ok_or(SchedulerError::UnknownRequest(id))?;
        if found != expected {
            return Err(SchedulerError::WrongStage {
                id,
                expected,
                found,
            });
        }
        Ok(())
    }

    /// Requests holding their KV after finishing (SGLang's inflight queue length).
    pub fn num_held(&self) -> usize {
        self.held.len()
    }

    /// Whether any finished request still holds KV (then the pool is not idle even when
    /// [`is_idle`](Self::is_idle) says no step has work).
    pub fn has_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// The held requests, in finishing order.
    pub fn held(&self) -> &[ReqId] {
        &self.held
    }

    /// The slots of a live or held request's committed positions `[0, committed_len)` (empty
    /// without a row): what the engine sends. Whole pages of it are final once a step has
    /// committed them (see the module notes); a held request's are all final.
    pub fn committed_slots(&self, id: ReqId) -> Result<&[Slot]> {
        let r = self
            .reqs
            .get(&id)
            .ok_or(SchedulerError::UnknownRequest(id))?;
        match r.row {
            Some(row) => Ok(self.rows.read(row, r.committed_len)?),
            None => Ok(&[]),
        }
    }

    /// A request marked to hold finished with `reason`: it moves to the held list with its KV
    /// untouched and is reported finished with `kv_held`.
    pub(super) fn hold_finished(&mut self, id: ReqId, reason: FinishReason) {
        self.hold_at_finish.remove(&id);
        let r = &self.reqs[&id];
        self.finished.push(finished_req(r, reason, true));
        self.held.push(id);
    }
}
