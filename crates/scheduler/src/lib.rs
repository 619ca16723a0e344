//! # scheduler — continuous batching as SGLang does it, deterministic and replayable
//!
//! Decides, step by step, which requests run: SGLang's scheduler semantics (its
//! `managers/scheduler.py`, `schedule_policy.py` and `schedule_batch.py`; the map from SGLang's
//! names to ours is in ARCHITECTURE.md) over kv-pool's allocators and request table and
//! radix-cache's prefix caches.
//!
//! - [`Req`]: per-request state (tokens, limits, row, committed / allocated / protected lengths,
//!   prefix, priority, arrival, finish reason).
//! - [`SchedulerConfig`]: SGLang's server arguments (`--schedule-policy`, `--page-size`,
//!   `--chunked-prefill-size`, `--max-prefill-tokens`, `--max-running-requests`, …).
//! - [`schedule_policy`]: the waiting queue's order ([`SchedulePolicy`]: `fcfs`, `lpm` with
//!   FCFS fallback above a threshold and in-batch prefix caching, `dfs-weight`, `lof`, seeded
//!   `random`; matching refreshes the access times of the prefixes waiting requests will use,
//!   without splitting nodes) and [`PrefillAdder`], every budget rule of SGLang's admission.
//! - [`Scheduler`], generic over its [`PrefixCache`](radix_cache::PrefixCache) and
//!   [`Allocator`](kv_pool::Allocator): admission with priority preemption, chunked prefill
//!   (one chunked request, page-aligned chunk ends), mixed chunks, `prepare_for_extend` /
//!   `prepare_for_decode` over the allocator (evicting the shortfall from the prefix cache),
//!   result processing (`cache_unfinished_req` / `cache_finished_req`), the decode memory
//!   check and `retract_decode`, the new-token ratio, aborts, `max_queued_requests`, and a
//!   strict mode that runs the invariant checker after every step.
//! - PD disaggregation's queues ([`disagg`]; SGLang's `disaggregation/prefill.py` and
//!   `decode.py`): on a prefill server a request marked with
//!   [`Scheduler::hold_kv_at_finish`] keeps its row, slots and prefix lock after its one
//!   token until [`Scheduler::release_held`] (the inflight queue); on a decode server
//!   [`Scheduler::add_prealloc_request`] → [`Scheduler::pop_preallocated`] (SGLang's
//!   preallocation budget, the decode radix match locked, slots for the missing pages only)
//!   → [`Scheduler::commit_transferred`] (the prefill's first token; the request decodes from
//!   the next step). [`SchedulerConfig::need_sort`] puts the allocator in sorted-release mode.
//! - [`Executor`]: `forward(&ForwardBatch) → next token per request` (a failed pass aborts
//!   its batch; a request the pass could not serve, named in [`BatchResult::failed`], is
//!   aborted alone), implemented by the model
//!   runner, by [`FakeExecutor`] in tests, and by [`SimExecutor`], which charges a roofline
//!   cost model's time instead of computing (with HiCache, also the pass's load-back and L3
//!   prefetch bytes, which [`ForwardBatch`] carries); [`simulate`] replays timed requests on a simulated
//!   clock and reports hit rate, throughput, TTFT and inter-token latency through
//!   [`summary::RunSummary`], the one place those figures are computed.
//!   [`sim_contiguity::ContiguityProbe`] measures what the allocator does to page contiguity
//!   there (runs per request, page-table reads, PD transfer blocks, free-page fragmentation).
//!
//! ## Invariants
//! - Plain synchronous CPU logic: no async, no I/O, no device calls. Time is a logical clock,
//!   randomness is seeded: the same inputs in the same order give the same decisions.
//! - Between steps, every pool page is exactly one of: free, held by the prefix cache, or
//!   private to one live request (its positions `[cache_protected_len, allocated_len)`; PD's
//!   held and transferring requests are live); [`Scheduler::check_invariants`] proves it, and
//!   when idle with nothing held or transferring also SGLang's identity `available + evictable
//!   + protected = total`.
//! - A request's KV is freed exactly once: at finish (for a held request: at release), abort
//!   or retraction.
//! - The slot of a committed position does not change after the step (or the
//!   `commit_transferred`) that committed it, unless the request is retracted, so a PD prefill can send whole pages as chunks
//!   complete.
//! - [`Scheduler::is_idle`] means "no step has work"; PD's queues wait on the engine's calls
//!   instead, reported by [`Scheduler::has_pd_work`].
//!
//! ## Where it sits
//! Above kv-pool and radix-cache; below the engine, which owns threads, I/O and the executor.

// The embeddable crates document every public item; the engine, model and backends document
// where a name does not already say it.
#![warn(missing_docs)]

pub mod batch;
pub mod config;
pub mod disagg;
pub mod error;
pub mod report;
pub mod req;
pub mod schedule_policy;
pub mod scheduler;
pub mod sim;
pub mod sim_contiguity;
pub mod summary;

pub use batch::{BatchResult, Executor, FakeExecutor, ForwardBatch, ForwardMode, RequestFailure};
pub use config::{NewTokenRatio, SchedulePolicy, SchedulerConfig};
pub use disagg::{
    PreallocBudget, PreallocNeed, PreallocPass, PreallocStop, Preallocated, ReqStage,
    CLIP_MAX_NEW_TOKEN, NUM_RESERVED_DECODE_TOKENS,
};
pub use error::{Result, SchedulerError};
pub use report::{FinishedReq, SchedulerStats, StepEntry, StepFinished, StepReport};
pub use req::{FinishReason, Req, ReqId, SamplingLimits};
pub use schedule_policy::{AddResult, Admission, Candidate, PrefillAdder};
pub use scheduler::Scheduler;
pub use sim::{
    replay, replay_observed, simulate, Accelerator, Clock, CostModel, ModelShape, ReplayConfig,
    SimExecutor, SimReport, SimRequest,
};
pub use sim_contiguity::{ContiguityProbe, ContiguityReport};
