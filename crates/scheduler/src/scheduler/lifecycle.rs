//! Requests entering and leaving the scheduler: [`Scheduler::add_request`] (validation, shared
//! with PD decode's `add_prealloc_request`), [`Scheduler::abort`] in every stage, where a
//! request is ([`Scheduler::stage`]), and finishing (what `take_finished` hands out).

use kv_pool::Allocator;
use radix_cache::{PrefixCache, PrefixState};

use super::Scheduler;
use crate::disagg::ReqStage;
use crate::error::{Result, SchedulerError};
use crate::report::FinishedReq;
use crate::req::{FinishReason, Req, ReqId, SamplingLimits};

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// Where a live request is (`None` once it finished and holds nothing).
    pub fn stage(&self, id: ReqId) -> Option<ReqStage> {
        if !self.reqs.contains_key(&id) {
            return None;
        }
        Some(if self.chunked == Some(id) {
            ReqStage::Chunked
        } else if self.held.contains(&id) {
            ReqStage::Held
        } else if self.transferring.contains(&id) {
            ReqStage::Transferring
        } else if self.prealloc_queue.contains(&id) {
            ReqStage::PreallocQueued
        } else if self.running.contains(&id) {
            ReqStage::Running
        } else {
            ReqStage::Waiting
        })
    }

    /// Adds a request to the waiting queue. Refused (a typed error, nothing changed) when the
    /// prompt is empty or does not leave room for one token in the context, when
    /// `max_new_tokens` is 0, or when the queue is at `max_queued_requests`. `max_new_tokens`
    /// is clipped so prompt + output fit the context, as SGLang.
    pub fn add_request(
        &mut self,
        input_ids: Vec<u32>,
        limits: SamplingLimits,
        priority: i64,
        extra_key: Option<String>,
    ) -> Result<ReqId> {
        let id = self.new_req(input_ids, limits, priority, extra_key, self.waiting.len())?;
        self.waiting.push_back(id);
        // HiCache with L3: fetch what storage holds beyond the local hit while it waits.
        if let Err(e) = self.start_prefetch(id) {
            self.waiting.pop_back();
            self.reqs.remove(&id);
            return Err(e);
        }
        Ok(id)
    }

    /// Validates a request (see [`add_request`](Self::add_request); `queued` is the length of
    /// the queue it joins) and enters it into the request table, in no queue yet.
    pub(super) fn new_req(
        &mut self,
        input_ids: Vec<u32>,
        limits: SamplingLimits,
        priority: i64,
        extra_key: Option<String>,
        queued: usize,
    ) -> Result<ReqId> {
        if input_ids.is_empty() {
            return Err(SchedulerError::InvalidRequest("the prompt is empty".into()));
        }
        if input_ids.len() >= self.cfg.context_len {
            return Err(SchedulerError::InvalidRequest(format!(
                "the prompt has {} tokens; the context length is {}",
                input_ids.len(),
                self.cfg.context_len
            )));
        }
        if limits.max_new_tokens == 0 {
            return Err(SchedulerError::InvalidRequest(
                "max_new_tokens must be at least 1".into(),
            ));
        }
        if let Some(limit) = self.cfg.max_queued_requests {
            if queued >= limit {
                return Err(SchedulerError::QueueFull { limit });
            }
        }
        let mut limits = limits;
        limits.max_new_tokens = limits
            .max_new_tokens
            .min(self.cfg.context_len - input_ids.len());
        let id = ReqId(self.next_id);
        self.next_id += 1;
        self.clock += 1;
        let root = self.cache.root(extra_key.as_deref());
        let req = Req {
            id,
            input_len: input_ids.len(),
            tokens: input_ids,
            limits,
            priority,
            arrival: self.clock,
            extra_key,
            row: None,
            committed_len: 0,
            allocated_len: 0,
            prefix: PrefixState::new(root),
            extend_end: 0,
            cached_tokens: 0,
            host_hit_len: 0,
            last_host_node: root,
            host_pin: None,
            retractions: 0,
            finish: None,
        };
        self.reqs.insert(id, req);
        Ok(id)
    }

    /// Aborts a request wherever it is, freeing its KV (what it computed stays cached); it
    /// shows up in [`take_finished`](Self::take_finished) with [`FinishReason::Abort`]. PD's
    /// states included: a prealloc-queued request just leaves; a transferring one frees its
    /// preallocated slots and unlocks its decode prefix. A held request (it already left
    /// through `take_finished`) is released as [`release_held`](Self::release_held) does and
    /// reported nowhere again.
    pub fn abort(&mut self, id: ReqId, message: &str) -> Result<()> {
        if !self.reqs.contains_key(&id) {
            return Err(SchedulerError::UnknownRequest(id));
        }
        if self.held.contains(&id) {
            return self.release_held(id);
        }
        let reason = FinishReason::Abort {
            message: message.to_string(),
        };
        if let Some(pos) = self.waiting.iter().position(|&w| w == id) {
            self.waiting.remove(pos);
        } else if let Some(pos) = self.running.iter().position(|&r| r == id) {
            self.running.remove(pos);
            self.release_kv(id, true)?;
        } else if self.chunked == Some(id) {
            self.chunked = None;
            self.release_kv(id, true)?;
        } else if let Some(pos) = self.prealloc_queue.iter().position(|&w| w == id) {
            self.prealloc_queue.remove(pos);
        } else if let Some(pos) = self.transferring.iter().position(|&r| r == id) {
            self.transferring.remove(pos);
            // The transferred KV never landed: nothing of it may enter the cache.
            self.release_kv(id, false)?;
        }
        self.finish(id, reason);
        Ok(())
    }

    /// Moves a request out with `reason` (its KV already released).
    pub(super) fn finish(&mut self, id: ReqId, reason: FinishReason) {
        self.hold_at_finish.remove(&id);
        // A prefetch still holding host pages for it lets them go (at its ack if in flight),
        // and so does a pin from a retraction to host. Only a tier bug can fail here; the
        // request finishes regardless.
        let released = [self.cache.release_prefetch(id.0), self.release_host_pin(id)];
        for e in released.into_iter().filter_map(|r| r.err()) {
            debug_assert!(false, "releasing the host tier's hold: {e}");
        }
        if let Some(r) = self.reqs.remove(&id) {
            self.finished.push(finished_req(&r, reason, false));
        }
    }
}

/// What [`Scheduler::take_finished`] hands out for `r`.
pub(super) fn finished_req(r: &Req, reason: FinishReason, kv_held: bool) -> FinishedReq {
    FinishedReq {
        id: r.id,
        prompt_tokens: r.input_len,
        cached_tokens: r.cached_tokens,
        output_ids: r.output_ids().to_vec(),
        reason,
        retractions: r.retractions,
        kv_held,
    }
}
