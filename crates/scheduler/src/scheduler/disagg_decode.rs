//! PD decode (SGLang's `disaggregation/decode.py`): `DecodePreallocQueue` →
//! `DecodeTransferQueue` → the running requests, with no prefill forward.
//!
//! - [`Scheduler::add_prealloc_request`] queues a request whose prompt KV will arrive from a
//!   prefill server.
//! - [`Scheduler::pop_preallocated`] admits the queue FIFO under SGLang's preallocation budget
//!   ([`PreallocBudget`]): for each request it matches the decode radix cache on
//!   `prompt[..len − 1]` and locks the match (so it cannot be evicted while the transfer
//!   runs), takes a row and allocates slots for the delta `[prefix_len, input_len)` through
//!   `alloc_extend` (page-aligned positions, so the delta is whole destination pages). Retracted
//!   requests being recomputed go first: no new preallocation while any request waits for a
//!   prefill pass (waiting or mid chunked prefill), so none takes the memory its next chunk
//!   needs.
//! - [`Scheduler::commit_transferred`] makes a transferred request a running decode request:
//!   committed = input length, output = the prefill's first token, finish checks applied (a
//!   request the first token finishes leaves at once, its prompt cached), prompt cached
//!   (`cache_unfinished_req`).
//!
//! Where SGLang offloads a retracted decode request's KV to host memory and loads it back,
//! kvserve recomputes it (the retraction path of [`Scheduler::step`]): the decode server has
//! the model, and the prompt is usually still in its radix cache.

use kv_pool::{ceil_to_page, Allocator, ExtendRequest, KvPoolError};
use radix_cache::PrefixCache;

use super::output_processor::check_finished;
use super::Scheduler;
use crate::disagg::{
    PreallocBudget, PreallocNeed, PreallocPass, PreallocStop, Preallocated, ReqStage,
};
use crate::error::{Result, SchedulerError};
use crate::req::{ReqId, SamplingLimits};

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// Queues a PD decode request for preallocation (SGLang's `DecodePreallocQueue.add`). The
    /// same checks as [`add_request`](Self::add_request) (`max_queued_requests` applies to the
    /// prealloc queue); typed errors, nothing changed.
    pub fn add_prealloc_request(
        &mut self,
        input_ids: Vec<u32>,
        limits: SamplingLimits,
        priority: i64,
        extra_key: Option<String>,
    ) -> Result<ReqId> {
        let queued = self.prealloc_queue.len();
        let id = self.new_req(input_ids, limits, priority, extra_key, queued)?;
        self.prealloc_queue.push_back(id);
        Ok(id)
    }

    /// Requests waiting for preallocation.
    pub fn num_prealloc_queued(&self) -> usize {
        self.prealloc_queue.len()
    }

    /// Requests with preallocated KV waiting for their transfer.
    pub fn num_transferring(&self) -> usize {
        self.transferring.len()
    }

    /// What the last [`pop_preallocated`](Self::pop_preallocated) decided: its budget, each
    /// admission and why it stopped.
    pub fn last_prealloc_pass(&self) -> &PreallocPass {
        &self.last_prealloc
    }

    /// SGLang's `_allocatable_tokens` now (see [`PreallocBudget`] for the formula).
    pub fn prealloc_budget(&self) -> PreallocBudget {
        let reserve = self.cfg.num_reserved_decode_tokens;
        let clip = self.cfg.clip_max_new_tokens;
        let available = self.alloc.available_size();
        let evictable = self.cache.evictable_size();
        let active = self.running.len()
            + usize::from(self.chunked.is_some())
            + self.waiting.len()
            + self.transferring.len();
        let reserved_decode = reserve * active;
        let retractable: usize = self
            .running
            .iter()
            .map(|id| self.reqs[id].tokens.len())
            .sum();
        let single_req_need = self
            .running
            .iter()
            .map(|id| {
                let r = &self.reqs[id];
                (r.limits.max_new_tokens.min(clip) + r.input_len) as i64
            })
            .max()
            .map_or(0, |m| m - retractable as i64);
        let resuming: usize = self
            .waiting
            .iter()
            .chain(self.chunked.iter())
            .map(|id| &self.reqs[id])
            .map(|r| r.tokens.len() - r.committed_len + reserve)
            .sum();
        let allocatable = (available + evictable) as i64
            - (reserved_decode as i64).max(single_req_need)
            - resuming as i64;
        PreallocBudget {
            available,
            evictable,
            active,
            reserved_decode,
            retractable,
            single_req_need,
            resuming,
            allocatable,
        }
    }

    /// SGLang's `DecodePreallocQueue.pop_preallocated`: admits prealloc-queued requests FIFO
    /// while a row is free and the budget allows, moving each to the transfer stage with its
    /// decode prefix locked and its delta's slots allocated. Returns the admitted requests in
    /// order with `decode_prefix_len` and their destination pages (the engine sends them to
    /// the prefill). A head request that could never fit (nothing else holds memory and it
    /// still does not) is aborted (it shows up in [`take_finished`](Self::take_finished)).
    /// `Err` is a pool or cache error (a bug).
    pub fn pop_preallocated(&mut self) -> Result<Vec<Preallocated>> {
        let budget = self.prealloc_budget();
        let mut pass = PreallocPass {
            budget,
            ..PreallocPass::default()
        };
        let mut out = Vec::new();
        let resuming = self.waiting.len() + usize::from(self.chunked.is_some());
        if resuming > 0 && !self.prealloc_queue.is_empty() {
            pass.stopped = Some(PreallocStop::ResumeFirst(resuming));
            self.last_prealloc = pass;
            return Ok(out);
        }
        let mut allocatable = budget.allocatable;
        while let Some(&id) = self.prealloc_queue.front() {
            if self.rows.available_size() == 0 {
                pass.stopped = Some(PreallocStop::NoRow);
                break;
            }
            self.match_prefix(id);
            // With a host tier: the host hit comes back from host memory, not over the wire.
            allocatable -= self.prealloc_load_back(id, allocatable)? as i64;
            let need = self.prealloc_need(id, budget.retractable);
            if need.need() > allocatable {
                self.unmatch(id);
                pass.stopped = Some(self.refuse(id, need, allocatable));
                break;
            }
            // Lock the match: its tokens stop being evictable, so they leave the budget.
            let last_node = self.reqs[&id].prefix.last_node;
            allocatable -= self.cache.inc_lock_ref(last_node)? as i64;
            let pages = if need.need() <= allocatable {
                self.prealloc(id)?
            } else {
                None
            };
            let Some(pages) = pages else {
                // Over budget once locked, or the pool cannot give the delta even after
                // eviction (a page larger than the reserve): undone, the request waits (or,
                // with nothing else in the pool, can never fit and is aborted).
                self.cache.dec_lock_ref(last_node)?;
                self.unmatch(id);
                pass.stopped = Some(self.refuse(id, need, allocatable));
                break;
            };
            allocatable -= need.required as i64;
            self.prealloc_queue.pop_front();
            self.transferring.push(id);
            pass.admitted.push((id, need));
            out.push(Preallocated {
                id,
                prefix_len: need.prefix_len,
                pages,
            });
        }
        self.last_prealloc = pass;
        Ok(out)
    }

    /// What a matched prealloc-queued request asks of the budget.
    fn prealloc_need(&self, id: ReqId, retractable: usize) -> PreallocNeed {
        let r = &self.reqs[&id];
        let delta = r.input_len - r.committed_len;
        let clip = self.cfg.clip_max_new_tokens;
        PreallocNeed {
            prefix_len: r.committed_len,
            delta,
            required: delta + self.cfg.num_reserved_decode_tokens,
            worst_case: (delta + r.limits.max_new_tokens.min(clip)) as i64 - retractable as i64,
        }
    }

    /// Why the head request `id` was refused; aborts it if it can never fit: nothing else
    /// holds or awaits memory, so the budget is the whole pool.
    fn refuse(&mut self, id: ReqId, need: PreallocNeed, allocatable: i64) -> PreallocStop {
        let nothing_else = self.running.is_empty()
            && self.chunked.is_none()
            && self.waiting.is_empty()
            && self.transferring.is_empty()
            && self.held.is_empty();
        if !nothing_else {
            return PreallocStop::Budget {
                id,
                need,
                allocatable,
            };
        }
        self.prealloc_queue.pop_front();
        let message = format!(
            "the request needs max(required {}, worst case {}) KV tokens to preallocate, more than the KV pool's {} slots allow",
            need.required,
            need.worst_case,
            self.alloc.size()
        );
        self.finish(id, crate::req::FinishReason::Abort { message });
        PreallocStop::Unfittable(id)
    }

    /// Gives a matched, locked request its row (prefix slots written in) and slots for
    /// `[prefix_len, input_len)`, evicting the shortfall first. Returns the delta's pages, or
    /// `None` (nothing changed) if the pool cannot provide them.
    fn prealloc(&mut self, id: ReqId) -> Result<Option<Vec<kv_pool::Page>>> {
        let p = self.cfg.page_size;
        let r = &self.reqs[&id];
        let (prefix_len, input_len) = (r.committed_len, r.input_len);
        let last_loc = r.prefix.prefix_slots.last().copied();
        self.ensure_available(ceil_to_page(input_len - prefix_len, p as usize))?;
        let mut slots = Vec::with_capacity(input_len - prefix_len);
        let req = ExtendRequest {
            prefix_len,
            seq_len: input_len,
            last_loc,
        };
        match self.alloc.alloc_extend(&[req], &mut slots) {
            Ok(()) => {}
            Err(KvPoolError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let row = self.rows.alloc_one()?;
        let r = self.reqs.get_mut(&id).expect("prealloc-queued request");
        self.rows.write(row, 0, &r.prefix.prefix_slots)?;
        self.rows.write(row, prefix_len, &slots)?;
        r.row = Some(row);
        r.allocated_len = input_len;
        r.extend_end = input_len;
        r.cached_tokens = prefix_len;
        self.stats.prompt_tokens += input_len;
        self.stats.cached_tokens += prefix_len;
        // The prefix is page-aligned, so every P-th slot of the delta starts a page.
        Ok(Some(
            slots
                .iter()
                .step_by(p as usize)
                .map(|s| s.page(p))
                .collect(),
        ))
    }

    /// SGLang's `commit_transfer_to_req` and the prebuilt batch in one: the transfer of `id`
    /// landed, with the prefill's `first_token_ids` (exactly one: kvserve's prefill samples one
    /// token). The request's prompt KV becomes committed and cached (`cache_unfinished_req`),
    /// the token is its first output, finish checks run: a request that token finishes
    /// (`max_new_tokens` 1, a stop token) leaves at once through
    /// [`take_finished`](Self::take_finished); any other joins the running requests and
    /// decodes from the next step. Its [`FinishedReq::cached_tokens`](crate::FinishedReq) is
    /// the decode-side prefix (`decode_prefix_len`); the prefill's count travels in the
    /// transfer's metadata. Typed errors (nothing changed): unknown id, a request not
    /// transferring, no token or more than one.
    pub fn commit_transferred(&mut self, id: ReqId, first_token_ids: &[u32]) -> Result<()> {
        self.expect_stage(id, ReqStage::Transferring)?;
        let &[token] = first_token_ids else {
            return Err(SchedulerError::InvalidRequest(format!(
                "{id}: the transfer must carry exactly one first token, got {}",
                first_token_ids.len()
            )));
        };
        self.transferring.retain(|&t| t != id);
        let r = self.reqs.get_mut(&id).expect("transferring request");
        r.committed_len = r.input_len;
        r.tokens.push(token);
        self.stats.output_tokens += 1;
        if let Some(reason) = check_finished(r, token) {
            self.release_kv(id, true)?;
            self.finish(id, reason);
        } else {
            let row = r.row.expect("transferring request has a row");
            let view = r.cache_view(row);
            self.cache
                .cache_unfinished_req(view, &mut self.rows, &mut self.alloc, false)?;
            self.running.push(id);
        }
        Ok(())
    }
}
