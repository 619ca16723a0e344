//! [`PrefillAdder`]: SGLang's admission budgets for one prefill batch (`schedule_policy.py`,
//! reference §2.8).
//!
//! - `rem_total_tokens = available + evictable − rem_total_offset`, where the offset starts at
//!   the mixed-in decode tokens plus, for every running request, `min(max_new − generated,
//!   clip) × new_token_ratio` (its expected future growth);
//! - `cur_rem_tokens = available + evictable − cur_rem_offset` (offset: mixed decode tokens);
//! - `rem_input_tokens = max_prefill_tokens − mixed`; `rem_chunk_tokens = chunked_prefill_size −
//!   mixed` (none without chunking).
//!
//! Admitting charges (input rounded up to `P`): `rem_total_offset += input + max_new + P`,
//! `cur_rem_offset += input + P`, `rem_input −= input`, `rem_chunk −= input`. After each
//! admission: [`AddResult::NoToken`] if a token budget is exhausted (the batch is full until
//! something finishes), [`AddResult::Other`] if the input or chunk budget is, else
//! [`AddResult::Continue`]. Evictable tokens count as free, so a candidate's matched prefix is
//! locked before the final check (its tokens stop being evictable).

use kv_pool::{ceil_to_page, Allocator};
use radix_cache::{NodeId, PrefixCache};

/// The outcome of one admission attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddResult {
    /// Admitted (or skipped) and the budgets allow more.
    Continue,
    /// Out of tokens: stop, and treat the running batch as full.
    NoToken,
    /// Out of input or chunk budget (or the candidate does not fit a chunk): stop.
    Other,
}

/// What the adder decided for one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Not admitted.
    Rejected(AddResult),
    /// Admitted: run `extend` tokens; `chunked` if that is not the whole remainder.
    Admitted {
        /// Tokens to compute in this pass.
        extend: usize,
        /// Whether the request continues as the chunked request.
        chunked: bool,
        /// The budget state after charging.
        next: AddResult,
    },
}

/// A candidate as the adder sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Tokens still without KV after the prefix match.
    pub extend_input_len: usize,
    /// `max_new_tokens − generated`.
    pub remaining_new_tokens: usize,
    /// The matched node to lock while admitted.
    pub last_node: NodeId,
}

/// Budgets of one prefill batch.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillAdder {
    page_size: usize,
    clip: usize,
    /// Reserved tokens subtracted from `available + evictable` for the total budget.
    pub rem_total_offset: f64,
    /// Reserved tokens subtracted for the current budget.
    pub cur_rem_offset: usize,
    /// Input token budget left.
    pub rem_input_tokens: i64,
    /// Chunk token budget left (`None` without chunking).
    pub rem_chunk_tokens: Option<i64>,
    /// Requests admitted so far.
    pub admitted: usize,
}

impl PrefillAdder {
    /// Budgets for a batch next to `running` requests (`(max_new − generated)` each), with
    /// `mixed_decode_tokens` decode tokens riding in the same pass.
    pub fn new(
        page_size: u32,
        clip_max_new_tokens: usize,
        max_prefill_tokens: usize,
        chunked_prefill_size: Option<usize>,
        new_token_ratio: f64,
        running_remaining_new_tokens: impl IntoIterator<Item = usize>,
        mixed_decode_tokens: usize,
    ) -> Self {
        let reserved: f64 = running_remaining_new_tokens
            .into_iter()
            .map(|r| r.min(clip_max_new_tokens) as f64 * new_token_ratio)
            .sum();
        PrefillAdder {
            page_size: page_size as usize,
            clip: clip_max_new_tokens,
            rem_total_offset: mixed_decode_tokens as f64 + reserved,
            cur_rem_offset: mixed_decode_tokens,
            rem_input_tokens: max_prefill_tokens as i64 - mixed_decode_tokens as i64,
            rem_chunk_tokens: chunked_prefill_size.map(|c| c as i64 - mixed_decode_tokens as i64),
            admitted: 0,
        }
    }

    fn free_tokens(cache: &dyn PrefixCache, alloc: &dyn Allocator) -> f64 {
        (alloc.available_size() + cache.evictable_size()) as f64
    }

    /// `available + evictable − rem_total_offset`.
    pub fn rem_total_tokens(&self, cache: &dyn PrefixCache, alloc: &dyn Allocator) -> f64 {
        Self::free_tokens(cache, alloc) - self.rem_total_offset
    }

    /// `available + evictable − cur_rem_offset`.
    pub fn cur_rem_tokens(&self, cache: &dyn PrefixCache, alloc: &dyn Allocator) -> f64 {
        Self::free_tokens(cache, alloc) - self.cur_rem_offset as f64
    }

    /// The budget state now.
    pub fn state(&self, cache: &dyn PrefixCache, alloc: &dyn Allocator) -> AddResult {
        if self.rem_total_tokens(cache, alloc) <= 0.0 || self.cur_rem_tokens(cache, alloc) <= 0.0 {
            AddResult::NoToken
        } else if self.rem_input_tokens <= 0 || self.rem_chunk_tokens.is_some_and(|c| c <= 0) {
            AddResult::Other
        } else {
            AddResult::Continue
        }
    }

    fn charge(&mut self, extend: usize, max_new: usize) {
        let input = ceil_to_page(extend, self.page_size);
        self.rem_total_offset += (input + max_new + self.page_size) as f64;
        self.cur_rem_offset += input + self.page_size;
        self.rem_input_tokens -= input as i64;
        if let Some(c) = &mut self.rem_chunk_tokens {
            *c -= input as i64;
        }
        self.admitted += 1;
    }

    /// Sizes the next chunk of the in-flight chunked request (admitted first, always):
    /// `min(rem_chunk, rem_total)` tokens, or `rem_chunk` if that is not positive, ending on a
    /// page boundary unless it is the last chunk. Reserves no decode tokens while it stays
    /// chunked.
    pub fn add_chunked_req(
        &mut self,
        c: Candidate,
        cache: &dyn PrefixCache,
        alloc: &dyn Allocator,
    ) -> Admission {
        let rem_chunk = self.rem_chunk_tokens.unwrap_or(i64::MAX);
        let total = self.rem_total_tokens(cache, alloc).floor() as i64;
        let budget = match rem_chunk.min(total) {
            b if b > 0 => b,
            _ => rem_chunk,
        }
        .max(self.page_size as i64) as usize;
        let (extend, chunked) = if c.extend_input_len <= budget {
            (c.extend_input_len, false)
        } else {
            (
                (budget / self.page_size * self.page_size).max(self.page_size),
                true,
            )
        };
        let max_new = if chunked {
            0
        } else {
            c.remaining_new_tokens.min(self.clip)
        };
        self.charge(extend, max_new);
        Admission::Admitted {
            extend,
            chunked,
            next: self.state(cache, alloc),
        }
    }

    /// Tries to admit a waiting request (SGLang's `add_one_req`). On admission its matched node
    /// stays locked (the caller unlocks it when the request releases its KV).
    pub fn add_one_req(
        &mut self,
        c: Candidate,
        cache: &mut dyn PrefixCache,
        alloc: &dyn Allocator,
    ) -> Admission {
        let p = self.page_size;
        let max_new = c.remaining_new_tokens.min(self.clip);
        let total = (c.extend_input_len + max_new + p) as f64;
        if total >= self.rem_total_tokens(cache, alloc) {
            return Admission::Rejected(AddResult::NoToken);
        }
        let input = ceil_to_page(c.extend_input_len, p) as i64;
        if self.rem_chunk_tokens.is_none() && self.admitted > 0 && input > self.rem_input_tokens {
            return Admission::Rejected(AddResult::Other);
        }
        // Lock the match so its tokens stop counting as evictable, then check again.
        if cache.inc_lock_ref(c.last_node).is_err() {
            return Admission::Rejected(AddResult::Other);
        }
        if total >= self.rem_total_tokens(cache, alloc) {
            let _ = cache.dec_lock_ref(c.last_node);
            return Admission::Rejected(AddResult::NoToken);
        }
        match self.rem_chunk_tokens {
            Some(chunk) if input > chunk => {
                // Chunk it: the largest page-aligned piece (the prefix is page-aligned).
                let trunc = chunk.max(0) as usize / p * p;
                if trunc == 0 {
                    let _ = cache.dec_lock_ref(c.last_node);
                    return Admission::Rejected(AddResult::Other);
                }
                self.charge(trunc, 0);
                Admission::Admitted {
                    extend: trunc,
                    chunked: true,
                    next: self.state(cache, alloc),
                }
            }
            _ => {
                self.charge(c.extend_input_len, max_new);
                Admission::Admitted {
                    extend: c.extend_input_len,
                    chunked: false,
                    next: self.state(cache, alloc),
                }
            }
        }
    }
}
