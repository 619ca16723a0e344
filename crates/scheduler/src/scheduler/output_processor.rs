//! Processing a pass's results (SGLang's `scheduler_output_processor_mixin.py`): append each
//! sampled token, check finish conditions, cache or release KV, and the failure paths that end
//! a batch whose forward pass failed, or one request whose pass gave no usable token.

use kv_pool::Allocator;
use radix_cache::PrefixCache;

use super::Scheduler;
use crate::batch::{BatchResult, ForwardBatch, ForwardMode};
use crate::error::Result;
use crate::report::{StepFinished, StepReport};
use crate::req::{FinishReason, Req, ReqId};

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// Ends every request of `batch` after its forward pass failed: each is aborted with the
    /// executor's message and its KV released as after any abort. Only the tokens committed
    /// before this pass (whose KV was written by earlier passes) can enter the prefix cache;
    /// the slots allocated for this pass are freed.
    pub(super) fn fail_batch(
        &mut self,
        batch: &ForwardBatch,
        error: &str,
        report: &mut StepReport,
    ) -> Result<()> {
        let message = format!("the forward pass failed: {error}");
        for &id in &batch.reqs {
            if self.reqs.contains_key(&id) {
                self.abort_after_pass(id, message.clone(), report)?;
            }
        }
        Ok(())
    }

    /// Aborts request `id` of a pass that failed for it, before the pass's positions are
    /// committed: only the tokens committed by earlier passes can enter the prefix cache, and
    /// the slots allocated for this pass are freed. A chunked prefill's earlier chunks are in
    /// the cache already (`cache_unfinished_req`), which cannot take a prefix back out: so an
    /// executor names a middle chunk in `failed` too when its logits show the chunk's KV is
    /// bad (the engine's checks them), before the chunk is cached.
    fn abort_after_pass(
        &mut self,
        id: ReqId,
        message: String,
        report: &mut StepReport,
    ) -> Result<()> {
        self.running.retain(|&x| x != id);
        if self.chunked == Some(id) {
            self.chunked = None;
        }
        self.release_kv(id, true)?;
        let reason = FinishReason::Abort { message };
        report.finished.push(StepFinished {
            id,
            reason: reason.clone(),
        });
        self.finish(id, reason);
        self.batch_is_full = false;
        Ok(())
    }

    /// SGLang's `process_batch_result`: commits the pass's positions; a middle chunk is stashed
    /// in the tree (`cache_unfinished_req`, chunked); a sampled token is appended, and the
    /// request either finishes (KV released into the cache), or, after its prefill, has its
    /// prompt cached (`cache_unfinished_req`) and joins the running requests. Decode frees go
    /// through one free group.
    pub(super) fn process_batch_result(
        &mut self,
        batch: &ForwardBatch,
        out: &BatchResult,
        report: &mut StepReport,
    ) -> Result<()> {
        let tokens = &out.next_tokens;
        let decode_part = batch.mode != ForwardMode::Extend;
        if decode_part {
            self.alloc.free_group_begin()?;
        }
        for (k, &id) in batch.reqs.iter().enumerate() {
            if let Some(f) = out.failed.iter().find(|f| f.index == k) {
                let message = format!("the forward pass gave no token: {}", f.message);
                self.abort_after_pass(id, message, report)?;
                continue;
            }
            let is_decode = batch.extend_lens[k] == 1
                && self.running.contains(&id)
                && batch.mode != ForwardMode::Extend;
            let r = self.reqs.get_mut(&id).expect("request in batch");
            r.committed_len = batch.seq_lens[k];
            if !batch.sample[k] {
                let row = r.row.expect("row");
                let view = r.cache_view(row);
                self.cache
                    .cache_unfinished_req(view, &mut self.rows, &mut self.alloc, true)?;
                continue;
            }
            r.tokens.push(tokens[k]);
            self.stats.output_tokens += 1;
            if let Some(reason) = check_finished(r, tokens[k]) {
                if is_decode {
                    self.running.retain(|&x| x != id);
                }
                report.finished.push(StepFinished {
                    id,
                    reason: reason.clone(),
                });
                if self.hold_at_finish.contains(&id) {
                    // PD prefill: the KV stays where it is until it is transferred.
                    self.hold_finished(id, reason);
                } else {
                    self.release_kv(id, true)?;
                    self.finish(id, reason);
                }
            } else if !is_decode {
                let row = r.row.expect("row");
                let view = r.cache_view(row);
                self.cache
                    .cache_unfinished_req(view, &mut self.rows, &mut self.alloc, false)?;
                self.running.push(id);
            }
        }
        if decode_part {
            self.alloc.free_group_end()?;
        }
        if !report.finished.is_empty() {
            self.batch_is_full = false;
        }
        Ok(())
    }
}

/// SGLang's `Req.check_finished` after appending `token`: a stop token (unless `ignore_eos`),
/// then the length limit.
pub(super) fn check_finished(r: &Req, token: u32) -> Option<FinishReason> {
    if !r.limits.ignore_eos && r.limits.stop_token_ids.contains(&token) {
        return Some(FinishReason::Stop { token });
    }
    if r.generated() >= r.limits.max_new_tokens {
        return Some(FinishReason::Length {
            length: r.limits.max_new_tokens,
        });
    }
    None
}

/// Checks an executor's result against its batch: one token per request, and failures that name
/// distinct requests of the batch. A result that breaks this is the pass's failure.
pub(super) fn check_batch_result(
    batch: &ForwardBatch,
    out: BatchResult,
) -> std::result::Result<BatchResult, String> {
    if out.next_tokens.len() != batch.len() {
        return Err(format!(
            "{} tokens for a batch of {}",
            out.next_tokens.len(),
            batch.len()
        ));
    }
    let mut named = vec![false; batch.len()];
    for f in &out.failed {
        match named.get_mut(f.index) {
            Some(seen) if !*seen => *seen = true,
            Some(_) => return Err(format!("request {} failed twice in one result", f.index)),
            None => {
                return Err(format!(
                    "a failure of request {} in a batch of {}",
                    f.index,
                    batch.len()
                ))
            }
        }
    }
    Ok(out)
}
