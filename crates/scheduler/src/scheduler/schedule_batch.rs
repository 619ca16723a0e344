//! Preparing forward passes and managing their memory (SGLang's `ScheduleBatch` in
//! `managers/schedule_batch.py`): `prepare_for_extend` / `prepare_for_decode` over the
//! allocator (evicting the shortfall from the prefix cache first), the decode memory check,
//! `retract_decode`, and `release_kv` (SGLang's `release_kv_cache`).

use kv_pool::{Allocator, DecodeRequest, ExtendRequest};
use radix_cache::{PrefixCache, PrefixState};

use super::Scheduler;
use crate::batch::{ForwardBatch, ForwardMode};
use crate::error::Result;
use crate::report::{StepEntry, StepFinished, StepReport};
use crate::req::{FinishReason, ReqId};

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// Evicts from the cache so that `need` slots are free, if it can (the shortfall only).
    pub(super) fn ensure_available(&mut self, need: usize) -> Result<()> {
        let avail = self.alloc.available_size();
        if avail < need {
            let freed = self.cache.evict(need - avail, &mut self.alloc)?;
            self.stats.evicted_tokens += freed;
        }
        Ok(())
    }

    /// Builds the prefill pass of `ids` (each with `extend_end` set by admission): rows for
    /// new requests with their cached prefix written in, then slots for the new positions
    /// (all or nothing). With `mixed`, the running requests' decode tokens join the pass
    /// when the pool can take them. SGLang's mixed path runs no decode memory check and never
    /// retracts: admission charged one token per running request. A running request at a page
    /// boundary needs a whole page, though, so if the pool cannot give every running request
    /// its next slot the pass runs as a plain extend and they decode next step, where the
    /// check (and retraction) runs — where SGLang's allocation would fail the batch.
    pub(super) fn prepare_for_extend(
        &mut self,
        ids: &[ReqId],
        mixed: bool,
        report: &mut StepReport,
    ) -> Result<ForwardBatch> {
        let p = self.cfg.page_size as usize;
        let need_rows = ids.iter().filter(|id| self.reqs[id].row.is_none()).count();
        let mut new_rows = self.rows.alloc(need_rows)?.into_iter();
        let mut batch_reqs = Vec::with_capacity(ids.len());
        let mut extend_tokens = 0;
        for &id in ids {
            let r = self.reqs.get_mut(&id).expect("request");
            if r.row.is_none() {
                let row = new_rows.next().expect("allocated rows");
                r.row = Some(row);
                self.rows.write(row, 0, &r.prefix.prefix_slots)?;
            }
            let row = r.row.expect("row");
            let last_loc = if r.committed_len > 0 {
                Some(self.rows.read(row, r.committed_len)?[r.committed_len - 1])
            } else {
                None
            };
            batch_reqs.push(ExtendRequest {
                prefix_len: r.committed_len,
                seq_len: r.extend_end,
                last_loc,
            });
            extend_tokens += r.extend_end - r.committed_len;
        }
        // The paged allocator may need one page per request beyond the tokens themselves.
        let worst = extend_tokens + if p > 1 { ids.len() * p } else { 0 };
        self.ensure_available(worst)?;
        let mut slots = Vec::with_capacity(extend_tokens);
        self.alloc.alloc_extend(&batch_reqs, &mut slots)?;
        let mut batch = ForwardBatch::new(ForwardMode::Extend);
        let mut off = 0;
        for &id in ids {
            let r = self.reqs.get_mut(&id).expect("request");
            let n = r.extend_end - r.committed_len;
            let row = r.row.expect("row");
            self.rows
                .write(row, r.committed_len, &slots[off..off + n])?;
            let middle = r.extend_end < r.tokens.len();
            batch.push(
                id,
                row,
                r.committed_len,
                &r.tokens[r.committed_len..r.extend_end],
                &slots[off..off + n],
                !middle,
            );
            report.entries.push(StepEntry {
                id,
                from: r.committed_len,
                to: r.extend_end,
                middle_chunk: middle,
            });
            r.allocated_len = r.extend_end;
            off += n;
        }
        self.stats.prefill_tokens += extend_tokens;
        if mixed && !self.running.is_empty() {
            let need = self.decode_mem_need();
            self.ensure_available(need)?;
            if self.alloc.available_size() >= need {
                batch.mode = ForwardMode::Mixed;
                self.prepare_for_decode(&mut batch, report)?;
            }
        }
        Ok(batch)
    }

    /// Adds one decode token per running request to `batch` (the caller made sure the pool
    /// has [`decode_mem_need`](Self::decode_mem_need) slots).
    pub(super) fn prepare_for_decode(
        &mut self,
        batch: &mut ForwardBatch,
        report: &mut StepReport,
    ) -> Result<()> {
        if self.running.is_empty() {
            return Ok(());
        }
        let mut reqs = Vec::with_capacity(self.running.len());
        for id in &self.running {
            let r = &self.reqs[id];
            let row = r.row.expect("running request has a row");
            let last_loc = self.rows.read(row, r.committed_len)?[r.committed_len - 1];
            reqs.push(DecodeRequest {
                seq_len: r.committed_len + 1,
                last_loc: Some(last_loc),
            });
        }
        let mut slots = Vec::with_capacity(reqs.len());
        self.alloc.alloc_decode(&reqs, &mut slots)?;
        for (k, id) in self.running.iter().enumerate() {
            let r = self.reqs.get_mut(id).expect("request");
            let row = r.row.expect("row");
            let pos = r.committed_len;
            self.rows.write(row, pos, &slots[k..k + 1])?;
            batch.push(
                *id,
                row,
                pos,
                &r.tokens[pos..pos + 1],
                &slots[k..k + 1],
                true,
            );
            report.entries.push(StepEntry {
                id: *id,
                from: pos,
                to: pos + 1,
                middle_chunk: false,
            });
            r.allocated_len = pos + 1;
        }
        Ok(())
    }

    // ----- decode memory and retraction -------------------------------------------------------

    /// Slots the next decode step needs: a fresh page for every running request whose
    /// committed length is a multiple of `P` (the others write into their last page).
    fn decode_mem_need(&self) -> usize {
        let p = self.cfg.page_size as usize;
        let pages = self
            .running
            .iter()
            .filter(|id| self.reqs[id].committed_len % p == 0)
            .count();
        pages * p
    }

    /// SGLang's decode memory check: evict the shortfall of
    /// [`decode_mem_need`](Self::decode_mem_need); pass iff that many slots are free.
    pub(super) fn check_decode_mem(&mut self) -> Result<bool> {
        let need = self.decode_mem_need();
        self.ensure_available(need)?;
        Ok(self.alloc.available_size() >= need)
    }

    /// SGLang's `retract_decode`: retracts running requests (fewest generated tokens first,
    /// then longest prompt) until the decode check passes; never the last one, which is
    /// aborted if it alone cannot fit. Re-estimates the new-token ratio afterwards.
    pub(super) fn retract_decode(&mut self, report: &mut StepReport) -> Result<()> {
        let mut order = self.running.clone();
        order.sort_by_key(|id| {
            let r = &self.reqs[id];
            std::cmp::Reverse((r.generated(), std::cmp::Reverse(r.input_len)))
        });
        while !self.check_decode_mem()? {
            // HiCache: waiting requests' prefetches may lock what the running ones need.
            if self.release_waiting_prefetches()? {
                continue;
            }
            if self.running.len() == 1 {
                let id = self.running.remove(0);
                let (need, pool) = (self.cfg.page_size as usize, self.alloc.size());
                self.release_kv(id, true)?;
                let message = format!(
                    "out of memory even after retracting every other request: one more token needs {need} free slots and the pool has {pool}"
                );
                report.finished.push(StepFinished {
                    id,
                    reason: FinishReason::Abort {
                        message: message.clone(),
                    },
                });
                self.finish(id, FinishReason::Abort { message });
                break;
            }
            let victim = order.pop().expect("a request to retract");
            self.retract(victim, report)?;
            // Free enough for the others to make progress for a while.
            let keep = self.running.len() * self.cfg.retract_decode_steps;
            self.ensure_available(keep)?;
        }
        let (generated, max_new) = self
            .running
            .iter()
            .map(|id| {
                (
                    self.reqs[id].generated(),
                    self.reqs[id].limits.max_new_tokens,
                )
            })
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        self.ratio.after_retraction(
            generated,
            max_new,
            self.running.len(),
            self.cfg.retract_decode_steps,
        );
        Ok(())
    }

    /// Releases a running request's KV without inserting it (as SGLang) and re-queues it; it
    /// will be prefilled again over prompt + outputs. With a host tier its committed KV is
    /// inserted and backed up to host instead, so the prefill finds it there.
    pub(super) fn retract(&mut self, id: ReqId, report: &mut StepReport) -> Result<()> {
        self.running.retain(|&r| r != id);
        // With a host tier its KV moves to host memory and it resumes with a load-back;
        // otherwise (SGLang) it is recomputed.
        if !self.retract_to_host(id)? {
            self.release_kv(id, false)?;
        }
        let root = self.cache.root(self.reqs[&id].extra_key.as_deref());
        let r = self.reqs.get_mut(&id).expect("request");
        r.committed_len = 0;
        r.allocated_len = 0;
        r.extend_end = 0;
        r.prefix = PrefixState::new(root);
        r.retractions += 1;
        self.waiting.push_back(id);
        self.stats.retractions += 1;
        self.batch_is_full = false;
        report.retracted.push(id);
        Ok(())
    }

    /// SGLang's `release_kv_cache`: caches (if `insert`) and frees the request's KV through
    /// `cache_finished_req`, frees any over-allocation, then its row.
    pub(super) fn release_kv(&mut self, id: ReqId, insert: bool) -> Result<()> {
        let r = self.reqs.get_mut(&id).expect("request");
        let Some(row) = r.row else { return Ok(()) };
        let view = r.cache_view(row);
        self.cache
            .cache_finished_req(view, &self.rows, &mut self.alloc, insert)?;
        // Over-allocation beyond the committed length's page (none between steps here).
        let p = self.cfg.page_size as usize;
        let kept = r.committed_len.div_ceil(p) * p;
        if r.allocated_len > kept {
            let extra = self
                .rows
                .read_range(row, kept, r.allocated_len - kept)?
                .to_vec();
            self.alloc.free(&extra)?;
        }
        self.rows.free(row)?;
        let r = self.reqs.get_mut(&id).expect("request");
        r.row = None;
        r.allocated_len = 0;
        Ok(())
    }
}
