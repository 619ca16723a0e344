//! SGLang's `schedule_policy.py`: the order of the waiting queue (`calc_priority`) and the
//! admission budgets of one prefill batch ([`PrefillAdder`]).
//!
//! ## Queue order
//! Once per prefill pass, over the whole waiting queue:
//! - `fcfs`: arrival order; with priority scheduling, by (priority, arrival).
//! - `lpm`: every request is matched against the cache (refreshing the access times of the
//!   prefix it will use, as SGLang's `match_prefix` does, but splitting nothing) and sorted by
//!   matched length, longest first; above `lpm_fallback_threshold` waiting requests the pass
//!   is FCFS. In-batch prefix caching: a request whose cache hit is at most
//!   `in_batch_prefix_check_threshold` tokens is matched against a scratch tree of the
//!   earlier such requests; sharing at least `in_batch_prefix_deprioritize_threshold` tokens
//!   with one of them sends it to the back (keeping queue order among those sent back), so only
//!   one of several requests with a new common prefix is computed first and the others hit the
//!   cache later.
//! - `dfs-weight`: after the same matching, weigh each tree node by the waiting requests whose
//!   match ends in its subtree and walk from the root, heavier children first, emitting each
//!   node's requests after its subtree. SGLang computes the in-batch set here too but its DFS
//!   sort never reads it, so there is no in-batch pass.
//! - `lof`: largest `max_new_tokens` first (priority first if enabled).
//! - `random`: a seeded shuffle.
//!
//! Cache-aware policies are FCFS over a cache that does not reuse prefixes
//! ([`PrefixCache::reuses_prefixes`]). Requests are matched on `tokens[..len − 1]` (SGLang's
//! `adjust_max_prefix_ids`): at least one token is always computed, so the pass has logits.
//!
//! ## Admission budgets ([`PrefillAdder`])
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

use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};

use kv_pool::rng::SplitMix64;
use kv_pool::{ceil_to_page, Allocator, Slot};
use radix_cache::{NodeId, PrefixCache, RadixCache};

use crate::config::{SchedulePolicy, SchedulerConfig};
use crate::req::{Req, ReqId};

// ----- queue order ------------------------------------------------------------------------------

/// A request's LPM rank: deprioritized requests go last (in queue order), the others by
/// matched length, longest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LpmKey {
    /// Sent back by in-batch prefix caching.
    deprioritized: bool,
    /// Tokens of the request found in the cache.
    prefix_len: usize,
}

impl LpmKey {
    /// The sort key: SGLang sorts by `-len(prefix)`, or `+inf` for a deprioritized request.
    fn sort_key(self) -> (bool, Reverse<usize>) {
        let len = if self.deprioritized {
            0
        } else {
            self.prefix_len
        };
        (self.deprioritized, Reverse(len))
    }
}

/// What matching found for one waiting request while ranking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RankedMatch {
    id: ReqId,
    /// Tokens found in the cache.
    prefix_len: usize,
    /// The deepest node the match reaches (`None`: nothing matched).
    last_node: Option<NodeId>,
}

/// Orders `waiting` by the configured policy (SGLang's `SchedulePolicy.calc_priority`).
/// `cache` is mutable because cache-aware policies refresh the access times of the prefixes
/// they match.
pub(crate) fn calc_priority<C: PrefixCache + ?Sized>(
    cfg: &SchedulerConfig,
    cache: &mut C,
    reqs: &HashMap<ReqId, Req>,
    waiting: &mut VecDeque<ReqId>,
    rng: &mut SplitMix64,
) {
    let mut policy = cfg.schedule_policy;
    if policy.is_cache_aware() && !cache.reuses_prefixes() {
        policy = SchedulePolicy::Fcfs;
    }
    if policy == SchedulePolicy::Lpm && waiting.len() > cfg.lpm_fallback_threshold {
        policy = SchedulePolicy::Fcfs;
    }
    let ids = waiting.make_contiguous();
    // A larger priority value runs first unless configured the other way round.
    let prio = |r: &Req| {
        if cfg.low_priority_values_first {
            r.priority
        } else {
            -r.priority
        }
    };
    match policy {
        SchedulePolicy::Fcfs => {
            if cfg.enable_priority_scheduling {
                ids.sort_by_key(|id| (prio(&reqs[id]), reqs[id].arrival));
            }
        }
        SchedulePolicy::Lof => {
            ids.sort_by_key(|id| {
                let r = &reqs[id];
                let p = if cfg.enable_priority_scheduling {
                    prio(r)
                } else {
                    0
                };
                (p, Reverse(r.limits.max_new_tokens))
            });
        }
        SchedulePolicy::Random => rng.shuffle(ids),
        SchedulePolicy::Lpm => {
            let matches = match_waiting(cache, reqs, ids);
            let keys = in_batch_deprioritize(cfg, reqs, &matches);
            let mut keyed: Vec<(ReqId, LpmKey)> = ids.iter().copied().zip(keys).collect();
            keyed.sort_by_key(|(_, k)| k.sort_key());
            for (slot, (id, _)) in ids.iter_mut().zip(keyed) {
                *slot = id;
            }
        }
        SchedulePolicy::DfsWeight => {
            let matches = match_waiting(cache, reqs, ids);
            let order = dfs_weight_order(&*cache, &matches);
            ids.copy_from_slice(&order);
        }
    }
}

/// The key a waiting request is matched on: everything but its last token.
fn match_key(r: &Req) -> &[u32] {
    &r.tokens[..r.tokens.len() - 1]
}

/// Matches every waiting request, refreshing access times without splitting.
fn match_waiting<C: PrefixCache + ?Sized>(
    cache: &mut C,
    reqs: &HashMap<ReqId, Req>,
    ids: &[ReqId],
) -> Vec<RankedMatch> {
    ids.iter()
        .map(|&id| {
            let r = &reqs[&id];
            let peek = cache.touch_prefix(match_key(r), r.extra_key.as_deref());
            RankedMatch {
                id,
                prefix_len: peek.len,
                last_node: peek.deepest,
            }
        })
        .collect()
}

/// In-batch prefix caching: the LPM key of each match.
fn in_batch_deprioritize(
    cfg: &SchedulerConfig,
    reqs: &HashMap<ReqId, Req>,
    matches: &[RankedMatch],
) -> Vec<LpmKey> {
    // SGLang's `waiting_queue_radix_tree`: page size 1, dummy values, rebuilt every pass.
    let mut scratch = RadixCache::new(1, radix_cache::BuiltinPolicy::Lru);
    let mut dummy = Vec::new();
    matches
        .iter()
        .map(|m| {
            let r = &reqs[&m.id];
            let key = match_key(r);
            let mut deprioritized = false;
            if m.prefix_len <= cfg.in_batch_prefix_check_threshold {
                let shared = scratch.peek_prefix_len(key, r.extra_key.as_deref());
                if shared >= cfg.in_batch_prefix_deprioritize_threshold {
                    deprioritized = true;
                } else {
                    dummy.resize(key.len(), Slot::PADDING);
                    // The scratch tree holds no slots of the pool: nothing to free.
                    let _ = scratch.insert(key, r.extra_key.as_deref(), &dummy, Default::default());
                }
            }
            LpmKey {
                deprioritized,
                prefix_len: m.prefix_len,
            }
        })
        .collect()
}

/// DFS-weight: weigh every tree node by the waiting requests whose match ends in its subtree,
/// then walk from the roots, heavier children first (ties by node, for determinism), emitting
/// each node's requests after its subtree.
fn dfs_weight_order<C: PrefixCache + ?Sized>(cache: &C, matches: &[RankedMatch]) -> Vec<ReqId> {
    let mut weight: HashMap<NodeId, usize> = HashMap::new();
    let mut children: HashMap<Option<NodeId>, Vec<NodeId>> = HashMap::new();
    let mut at: HashMap<Option<NodeId>, Vec<ReqId>> = HashMap::new();
    for m in matches {
        at.entry(m.last_node).or_default().push(m.id);
        let mut n = m.last_node;
        while let Some(cur) = n {
            let w = weight.entry(cur).or_insert(0);
            *w += 1;
            let parent = cache.parent(cur);
            if *w == 1 {
                children.entry(parent).or_default().push(cur);
            }
            n = parent;
        }
    }
    let mut out = Vec::with_capacity(matches.len());
    // Iterative post-order from the virtual root (None).
    let mut stack: Vec<(Option<NodeId>, bool)> = vec![(None, false)];
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            out.extend(at.get(&node).into_iter().flatten().copied());
            continue;
        }
        stack.push((node, true));
        let mut kids = children.get(&node).cloned().unwrap_or_default();
        kids.sort_by_key(|k| (Reverse(weight[k]), *k));
        // Pushed in reverse to pop in order.
        for k in kids.into_iter().rev() {
            stack.push((Some(k), false));
        }
    }
    out
}

// ----- admission budgets ------------------------------------------------------------------------

/// The outcome of one admission attempt (SGLang's `AddReqResult`).
#[doc(alias = "AddReqResult")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddResult {
    /// Admitted (or skipped) and the budgets allow more (`CONTINUE`).
    Continue,
    /// Out of tokens: stop, and treat the running batch as full until something finishes
    /// (`NO_TOKEN`).
    NoToken,
    /// Out of input or chunk budget, or the candidate does not fit a chunk: stop this pass
    /// (`OTHER`).
    Other,
}

/// What the adder decided for one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Not admitted, and why the pass should stop.
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
    /// Tokens still without KV after the prefix match (SGLang's `extend_input_len`).
    pub extend_input_len: usize,
    /// `max_new_tokens − generated`.
    pub remaining_new_tokens: usize,
    /// The matched node, locked while the request is admitted.
    pub last_node: NodeId,
}

/// The budgets of one prefill batch (SGLang's `PrefillAdder`, same name; the rules are in the
/// module docs). Token figures are pool slots.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillAdder {
    page_size: usize,
    clip: usize,
    /// Reserved tokens subtracted from `available + evictable` for the total budget
    /// (fractional: future growth is scaled by the new-token ratio).
    pub rem_total_offset: f64,
    /// Reserved tokens subtracted for the current budget (what this batch itself allocates).
    pub cur_rem_offset: usize,
    /// `--max-prefill-tokens` left in this batch (negative once overdrawn).
    pub rem_input_tokens: i64,
    /// `--chunked-prefill-size` left in this batch (`None` without chunking).
    pub rem_chunk_tokens: Option<i64>,
    /// Requests admitted so far, the chunked one included (SGLang's `len(can_run_list)`).
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

    /// `available + evictable − rem_total_offset`: room left counting every admitted and
    /// running request's expected growth.
    pub fn rem_total_tokens(&self, cache: &dyn PrefixCache, alloc: &dyn Allocator) -> f64 {
        Self::free_tokens(cache, alloc) - self.rem_total_offset
    }

    /// `available + evictable − cur_rem_offset`: room left for this batch's own allocations.
    pub fn cur_rem_tokens(&self, cache: &dyn PrefixCache, alloc: &dyn Allocator) -> f64 {
        Self::free_tokens(cache, alloc) - self.cur_rem_offset as f64
    }

    /// The budget state now (SGLang's `budget_state`).
    pub fn state(&self, cache: &dyn PrefixCache, alloc: &dyn Allocator) -> AddResult {
        if self.rem_total_tokens(cache, alloc) <= 0.0 || self.cur_rem_tokens(cache, alloc) <= 0.0 {
            AddResult::NoToken
        } else if self.rem_input_tokens <= 0 || self.rem_chunk_tokens.is_some_and(|c| c <= 0) {
            AddResult::Other
        } else {
            AddResult::Continue
        }
    }

    /// SGLang's `_update_prefill_budget`.
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

    /// Sizes the next chunk of the in-flight chunked request, admitted before any waiting
    /// request: the budget is `min(rem_chunk, rem_total)`, or `rem_chunk` if that is not
    /// positive (SGLang: leaving it out would leak it). The last chunk takes the whole
    /// remainder if it fits the budget; a middle chunk is the budget floored to whole pages
    /// (its end stays page-aligned, the prefix being so). A budget under one page leaves the
    /// request out of this pass ([`Admission::Rejected`] with [`AddResult::Other`]) rather
    /// than overdraw it; it runs when the decode tokens charged against the chunk budget are
    /// fewer. Reserves no decode tokens while the request stays chunked.
    pub fn add_chunked_req(
        &mut self,
        c: Candidate,
        cache: &dyn PrefixCache,
        alloc: &dyn Allocator,
    ) -> Admission {
        let rem_chunk = self.rem_chunk_tokens.unwrap_or(i64::MAX);
        // `int(rem_total_tokens)` in SGLang: truncation toward zero.
        let total = self.rem_total_tokens(cache, alloc) as i64;
        let budget = match rem_chunk.min(total) {
            b if b > 0 => b,
            _ => rem_chunk,
        };
        let (extend, chunked) = if c.extend_input_len as i64 <= budget {
            (c.extend_input_len, false)
        } else {
            let aligned = budget.max(0) as usize / self.page_size * self.page_size;
            if aligned == 0 {
                return Admission::Rejected(AddResult::Other);
            }
            (aligned, true)
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
        // Without chunking, the first request is always admitted; a later one must leave some
        // of `--max-prefill-tokens` (SGLang's `input_tokens >= rem_input_tokens`).
        if self.rem_chunk_tokens.is_none() && self.admitted > 0 && input >= self.rem_input_tokens {
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
