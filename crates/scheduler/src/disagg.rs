//! PD disaggregation as the scheduler sees it: the stages a request moves through, SGLang's
//! preallocation constants, and what the decode side's preallocation hands the engine and
//! reports (SGLang's `disaggregation/decode.py`: `DecodePreallocQueue.pop_preallocated`,
//! `_allocatable_tokens`). The scheduling itself is in `scheduler/disagg_prefill.rs` and
//! `scheduler/disagg_decode.rs`.
//!
//! Prefill: a request marked with [`Scheduler::hold_kv_at_finish`](crate::Scheduler::hold_kv_at_finish)
//! runs as any other (the engine forces `max_new_tokens = 1`); when it finishes it becomes
//! [`ReqStage::Held`] (SGLang's inflight queue) until the engine calls
//! [`release_held`](crate::Scheduler::release_held) after the transfer.
//!
//! Decode: [`ReqStage::PreallocQueued`] → ([`pop_preallocated`](crate::Scheduler::pop_preallocated))
//! [`ReqStage::Transferring`] → ([`commit_transferred`](crate::Scheduler::commit_transferred))
//! [`ReqStage::Running`]. There is no prebuilt extend batch: a committed request joins the
//! running requests at once, so SGLang's "512 × the just-finished prebuilt batch" term of the
//! budget is always 0 here (those requests are counted as running).

use std::fmt;

use kv_pool::Page;

use crate::req::ReqId;

/// Tokens reserved per active request for its future decode steps when budgeting
/// preallocation (SGLang's `SGLANG_NUM_RESERVED_DECODE_TOKENS` default). The default of
/// [`SchedulerConfig::num_reserved_decode_tokens`](crate::SchedulerConfig::num_reserved_decode_tokens).
pub const NUM_RESERVED_DECODE_TOKENS: usize = 512;

/// The clip on `max_new_tokens` in memory estimates (SGLang's `CLIP_MAX_NEW_TOKEN`, from
/// `SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`). The default of
/// [`SchedulerConfig::clip_max_new_tokens`](crate::SchedulerConfig::clip_max_new_tokens).
pub const CLIP_MAX_NEW_TOKEN: usize = 4096;

/// Where a live request is (between steps a request is in exactly one stage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReqStage {
    /// In the waiting queue (new, or retracted and waiting to be recomputed).
    Waiting,
    /// Mid chunked prefill (SGLang's `chunked_req`).
    Chunked,
    /// Decoding (SGLang's `running_batch`).
    Running,
    /// PD prefill: finished, KV kept until transferred (SGLang's inflight queue).
    Held,
    /// PD decode: waiting for KV preallocation (SGLang's `DecodePreallocQueue`).
    PreallocQueued,
    /// PD decode: KV preallocated, waiting for the transfer (SGLang's `DecodeTransferQueue`).
    Transferring,
}

impl fmt::Display for ReqStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReqStage::Waiting => "waiting",
            ReqStage::Chunked => "chunked",
            ReqStage::Running => "running",
            ReqStage::Held => "held",
            ReqStage::PreallocQueued => "prealloc-queued",
            ReqStage::Transferring => "transferring",
        })
    }
}

/// A request [`pop_preallocated`](crate::Scheduler::pop_preallocated) moved to the transfer
/// stage: what the engine sends the prefill (SGLang's `TransferInfo`: destination pages and
/// `decode_prefix_len`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preallocated {
    /// The request.
    pub id: ReqId,
    /// Prompt positions the decode radix cache already holds (locked until the request ends):
    /// page-aligned and at most `floor((input_len − 1) / P) · P`, so at least the last prompt
    /// token travels. SGLang's `decode_prefix_len`.
    pub prefix_len: usize,
    /// Destination pages for prompt positions `[prefix_len, input_len)`, in position order:
    /// `ceil((input_len − prefix_len) / P)` pages, the last possibly partly used.
    pub pages: Vec<Page>,
}

/// SGLang's `_allocatable_tokens` for one preallocation pass, term by term (tokens; signed,
/// as the budget can be negative):
///
/// `allocatable = available + evictable − max(reserved_decode, single_req_need) − resuming`
///
/// where `reserved_decode = num_reserved_decode_tokens × active` (active: running, chunked,
/// waiting and transferring requests), `single_req_need = max over running requests of
/// (min(max_new_tokens, clip) + prompt_len) − retractable` (0 without running requests;
/// `retractable` = the running requests' tokens, prompt + output: what retracting all of them
/// would free), and `resuming` = Σ over the requests waiting for a prefill pass (waiting or
/// mid chunked prefill) of (their tokens without KV + `num_reserved_decode_tokens`): SGLang's
/// term for queued retracted requests, which a decode server recomputes. Evictable tokens
/// count as free because the decode server keeps a radix cache (SGLang with the decode radix
/// cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PreallocBudget {
    /// Free slots in the allocator.
    pub available: usize,
    /// Unlocked tokens of the prefix cache.
    pub evictable: usize,
    /// Running + chunked + waiting + transferring requests.
    pub active: usize,
    /// `num_reserved_decode_tokens × active`.
    pub reserved_decode: usize,
    /// Tokens of the running requests (prompt + outputs).
    pub retractable: usize,
    /// The largest running request's `min(max_new, clip) + prompt`, less `retractable`.
    pub single_req_need: i64,
    /// KV the requests waiting for a prefill pass still need (tokens without KV + reserve
    /// each); on a decode server these are retracted requests being recomputed.
    pub resuming: usize,
    /// What new preallocations may take.
    pub allocatable: i64,
}

impl fmt::Display for PreallocBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allocatable {} = available {} + evictable {} - max(reserved {} for {} active, single-request need {}) - resuming {}",
            self.allocatable,
            self.available,
            self.evictable,
            self.reserved_decode,
            self.active,
            self.single_req_need,
            self.resuming
        )
    }
}

/// What one request asks of the preallocation budget (SGLang's `pop_preallocated` check).
/// It is admitted iff `max(required, worst_case) ≤ allocatable`; admission then takes
/// `required` from the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreallocNeed {
    /// Prompt tokens the decode radix cache holds (`decode_prefix_len`).
    pub prefix_len: usize,
    /// Tokens to preallocate: `input_len − prefix_len`.
    pub delta: usize,
    /// `delta + num_reserved_decode_tokens`.
    pub required: usize,
    /// `delta + min(max_new_tokens, clip) − retractable`: the request running to its limit
    /// with every running request retracted.
    pub worst_case: i64,
}

impl PreallocNeed {
    /// What the budget check compares with `allocatable`: `max(required, worst_case)`.
    pub fn need(&self) -> i64 {
        (self.required as i64).max(self.worst_case)
    }
}

/// Why a preallocation pass stopped before the queue was empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreallocStop {
    /// This many requests wait for a prefill pass (waiting, or mid chunked prefill): on a
    /// decode server, retracted requests being recomputed by [`step`](crate::Scheduler::step).
    /// They are resumed before any new preallocation, as SGLang, so a preallocation never
    /// takes the memory a resuming request's next chunk needs.
    ResumeFirst(usize),
    /// No request row is free.
    NoRow,
    /// The head request does not fit the budget.
    Budget {
        /// The head request.
        id: ReqId,
        /// What it asked.
        need: PreallocNeed,
        /// What was left.
        allocatable: i64,
    },
    /// The head request could never fit (nothing else holds memory and it still does not):
    /// it was aborted.
    Unfittable(ReqId),
}

/// One [`pop_preallocated`](crate::Scheduler::pop_preallocated) pass, for logs and tests
/// ([`Scheduler::last_prealloc_pass`](crate::Scheduler::last_prealloc_pass)); its `Display`
/// is one line per decision.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PreallocPass {
    /// The budget at the start of the pass.
    pub budget: PreallocBudget,
    /// The admitted requests, in order, with what each asked.
    pub admitted: Vec<(ReqId, PreallocNeed)>,
    /// Why the pass stopped (`None`: the queue emptied).
    pub stopped: Option<PreallocStop>,
}

impl fmt::Display for PreallocPass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "  budget: {}", self.budget)?;
        for (id, n) in &self.admitted {
            writeln!(
                f,
                "  admit {id}: prefix {} delta {} required {} worst case {}",
                n.prefix_len, n.delta, n.required, n.worst_case
            )?;
        }
        match &self.stopped {
            None => writeln!(f, "  queue empty"),
            Some(PreallocStop::ResumeFirst(n)) => {
                writeln!(f, "  stop: {n} requests waiting for a prefill pass resume first")
            }
            Some(PreallocStop::NoRow) => writeln!(f, "  stop: no free request row"),
            Some(PreallocStop::Budget {
                id,
                need,
                allocatable,
            }) => writeln!(
                f,
                "  stop at {id}: needs max(required {}, worst case {}) = {} > allocatable {allocatable}",
                need.required,
                need.worst_case,
                need.need()
            ),
            Some(PreallocStop::Unfittable(id)) => {
                writeln!(f, "  abort {id}: it can never fit the pool")
            }
        }
    }
}
