//! [`Scheduler`]: SGLang's event loop (`managers/scheduler.py`) as a synchronous state machine.
//!
//! One [`Scheduler::step`]: build a prefill batch if the waiting queue (or the chunked request)
//! allows one — prefill has priority — else a decode step of the running requests (after the
//! decode memory check, retracting if needed); run it on the [`Executor`]; process the results
//! (append tokens, finish checks, `cache_unfinished_req` / `cache_finished_req`). Time is a
//! logical clock; randomness is seeded; the same inputs in the same order give the same
//! decisions, so whole runs replay and snapshot.
//!
//! This file holds the loop and admission (`get_next_batch_to_run`, `get_new_batch_prefill`);
//! the child modules hold what SGLang keeps elsewhere:
//! `schedule_batch` (preparing passes, the decode memory check, retraction, releasing KV),
//! `output_processor` (results), `checks` (the invariant checker), `preempt` (priority
//! preemption), `lifecycle` (adding, aborting and finishing requests), and PD
//! disaggregation's queues: `disagg_prefill` (KV held after the one prefill token until it is
//! transferred, SGLang's `disaggregation/prefill.py`) and `disagg_decode` (preallocation →
//! transfer → running, SGLang's `disaggregation/decode.py`).

mod checks;
mod disagg_decode;
mod disagg_prefill;
mod hicache;
mod lifecycle;
mod output_processor;
mod preempt;
mod schedule_batch;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

use kv_pool::rng::SplitMix64;
use kv_pool::{Allocator, AnyAllocator, ReqRow, ReqToTokenPool};
use radix_cache::{AnyPrefixCache, PrefixCache, PrefixState};

use crate::batch::{Executor, ForwardBatch, ForwardMode};
use crate::config::{NewTokenRatio, SchedulerConfig};
use crate::disagg::PreallocPass;
use crate::error::{Result, SchedulerError};
use crate::report::{FinishedReq, SchedulerStats, StepFinished, StepReport};
use crate::req::{FinishReason, Req, ReqId};
use crate::schedule_policy::{calc_priority, AddResult, Admission, Candidate, PrefillAdder};
use output_processor::check_batch_result;

/// The continuous-batching scheduler (SGLang's `Scheduler`) over one KV pool: a prefix cache
/// `C` and an allocator `A` (the engine's defaults choose their implementation at run time; a
/// fixed pair compiles to direct calls).
///
/// Requests wait in a queue, are admitted into prefill batches under [`PrefillAdder`]'s
/// budgets (at most one of them chunked at a time), then decode together until they finish.
/// Between steps every pool slot is free, in the cache, or private to one live request
/// ([`Scheduler::check_invariants`]).
pub struct Scheduler<C: PrefixCache = AnyPrefixCache, A: Allocator = AnyAllocator> {
    cfg: SchedulerConfig,
    cache: C,
    alloc: A,
    rows: ReqToTokenPool,
    /// Every live request (waiting, running or chunked), by id.
    reqs: HashMap<ReqId, Req>,
    waiting: VecDeque<ReqId>,
    /// Decoding requests, in batch order (SGLang's `running_batch`).
    running: Vec<ReqId>,
    /// The request mid-chunked-prefill, if any (SGLang's `chunked_req`).
    chunked: Option<ReqId>,
    /// PD prefill: live requests that keep their KV when they finish
    /// ([`Scheduler::hold_kv_at_finish`]).
    hold_at_finish: HashSet<ReqId>,
    /// PD prefill: finished requests whose row, slots and prefix lock are kept until the KV is
    /// transferred (SGLang's disagg inflight queue), in finishing order.
    held: Vec<ReqId>,
    /// PD decode: requests waiting for KV preallocation, FIFO (SGLang's `DecodePreallocQueue`).
    prealloc_queue: VecDeque<ReqId>,
    /// PD decode: requests with preallocated KV waiting for the transfer to land (SGLang's
    /// `DecodeTransferQueue`), in preallocation order.
    transferring: Vec<ReqId>,
    /// PD decode: what the last `pop_preallocated` decided (for logs and tests).
    last_prealloc: PreallocPass,
    finished: Vec<FinishedReq>,
    ratio: NewTokenRatio,
    /// The last admission ran out of tokens: skip prefill until something finishes or leaves.
    batch_is_full: bool,
    next_id: u64,
    /// Logical clock: one tick per added request and per step (arrival order for priority
    /// scheduling).
    clock: u64,
    steps: u64,
    /// The random policy's generator, seeded from the config.
    rng: SplitMix64,
    /// Wall-clock seconds the engine last gave ([`Scheduler::set_time`]): what HiCache's
    /// prefetch timeout measures against (0 unless set).
    now_s: f64,
    /// HiCache tokens loaded back (host → device) and prefetched (L3 → host) since the last
    /// pass ran: the next [`ForwardBatch`] carries them for the executor's cost model.
    io_pending: (usize, usize),
    /// Totals since start.
    pub stats: SchedulerStats,
}

impl<C: PrefixCache, A: Allocator> fmt::Debug for Scheduler<C, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheduler")
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .field("chunked", &self.chunked)
            .field("steps", &self.steps)
            .finish()
    }
}

impl<C: PrefixCache, A: Allocator> Scheduler<C, A> {
    /// A scheduler over `cache` and `alloc`, whose page sizes must match the config's.
    /// Cache-aware policies run as FCFS over a cache that does not reuse prefixes
    /// ([`PrefixCache::reuses_prefixes`]), as SGLang's with `--disable-radix-cache`.
    pub fn new(cfg: SchedulerConfig, cache: C, alloc: A) -> Result<Self> {
        cfg.validate()?;
        if cache.page_size() != cfg.page_size || alloc.page_size() != cfg.page_size {
            return Err(SchedulerError::InvalidConfig {
                field: "--page-size",
                reason: format!(
                    "the cache has page size {} and the allocator {}, the config {}",
                    cache.page_size(),
                    alloc.page_size(),
                    cfg.page_size
                ),
            });
        }
        let rows = ReqToTokenPool::new(cfg.max_running_requests, cfg.context_len)?;
        let mut alloc = alloc;
        if cfg.need_sort {
            alloc.set_sorted_release(true);
        }
        Ok(Scheduler {
            ratio: NewTokenRatio::new(
                cfg.schedule_conservativeness,
                cfg.new_token_ratio_decay_steps,
            ),
            rng: SplitMix64::new(cfg.seed),
            now_s: 0.0,
            io_pending: (0, 0),
            cfg,
            cache,
            alloc,
            rows,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            chunked: None,
            hold_at_finish: HashSet::new(),
            held: Vec::new(),
            prealloc_queue: VecDeque::new(),
            transferring: Vec::new(),
            last_prealloc: PreallocPass::default(),
            finished: Vec::new(),
            batch_is_full: false,
            next_id: 0,
            clock: 0,
            steps: 0,
            stats: SchedulerStats::default(),
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The prefix cache, read-only (sizes, rendering, peeks).
    pub fn cache(&self) -> &dyn PrefixCache {
        &self.cache
    }

    /// Drains the prefix cache's KV events since the last call ([`PrefixCache::take_events`]:
    /// empty unless the cache was built with events on), for an engine that publishes them.
    pub fn take_cache_events(&mut self) -> Vec<radix_cache::events::KvEvent> {
        self.cache.take_events()
    }

    /// The KV pool's allocator, read-only (`size`, `available_size`).
    pub fn allocator(&self) -> &dyn Allocator {
        &self.alloc
    }

    /// The request-to-token table (each live request's row of slots).
    pub fn rows(&self) -> &ReqToTokenPool {
        &self.rows
    }

    /// The current new-token ratio (admission's optimism about future decode growth).
    pub fn new_token_ratio(&self) -> f64 {
        self.ratio.current
    }

    /// Requests in the waiting queue (retracted ones included).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Decoding requests, plus the chunked one.
    pub fn num_running(&self) -> usize {
        self.running.len() + usize::from(self.chunked.is_some())
    }

    /// Whether nothing is waiting or running: no [`step`](Self::step) has work (finished
    /// requests not yet taken do not count). PD's requests never need steps, so they do not
    /// count either: held requests (prefill), and prealloc-queued and transferring requests
    /// (decode), which wait on [`pop_preallocated`](Self::pop_preallocated) and
    /// [`commit_transferred`](Self::commit_transferred). An engine loop keeps polling while
    /// [`has_pd_work`](Self::has_pd_work).
    pub fn is_idle(&self) -> bool {
        !self.has_requests() && !self.has_cache_io()
    }

    /// Whether a request waits, runs or is mid-chunk (what a step can make progress on; an
    /// idle scheduler has none and no HiCache copy in flight).
    pub fn has_requests(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || self.chunked.is_some()
    }

    /// Whether PD disaggregation still has requests in its queues: held KV (prefill),
    /// prealloc-queued or transferring requests (decode). These need the engine's calls
    /// (`release_held`, `pop_preallocated`, `commit_transferred`, `abort`), not steps.
    pub fn has_pd_work(&self) -> bool {
        !self.held.is_empty() || !self.prealloc_queue.is_empty() || !self.transferring.is_empty()
    }

    /// A live request's state (`None` once it finished; a held request is live until
    /// released).
    pub fn request(&self, id: ReqId) -> Option<&Req> {
        self.reqs.get(&id)
    }

    /// Takes the requests that finished since the last call, in finishing order.
    pub fn take_finished(&mut self) -> Vec<FinishedReq> {
        std::mem::take(&mut self.finished)
    }

    /// Steps run so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Runs one step: chooses a batch, runs it on `exec`, processes the results. A report with
    /// no mode when nothing could run. A failed forward pass aborts its batch's requests and
    /// the step still succeeds; `Err` is a pool or cache error (a bug) or, in strict mode, a
    /// broken invariant.
    pub fn step(&mut self, exec: &mut dyn Executor) -> Result<StepReport> {
        self.steps += 1;
        self.clock += 1;
        let mut report = StepReport {
            step: self.steps,
            ..StepReport::default()
        };
        let evicted_before = self.stats.evicted_tokens;
        // HiCache: copies that completed since the last step unlock their nodes first.
        self.poll_cache_events()?;
        let batch = self.next_batch_with_io(&mut report)?;
        if let Some(batch) = batch {
            let out = exec
                .forward(&batch, &self.rows)
                .and_then(|out| check_batch_result(&batch, out));
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    // The pass failed (a device error, a batch too large for the device): its
                    // requests end, the others go on.
                    self.fail_batch(&batch, &e, &mut report)?;
                    return Ok(report);
                }
            };
            report.mode = Some(batch.mode);
            report.tokens = batch.num_tokens();
            report.elapsed_s = out.elapsed_s;
            self.process_batch_result(&batch, &out, &mut report)?;
        } else {
            // Idle: reset the admission optimism.
            self.ratio.reset();
        }
        report.evicted = self.stats.evicted_tokens - evicted_before;
        report.used_tokens = self.alloc.size() - self.alloc.available_size();
        self.stats.peak_used_tokens = self.stats.peak_used_tokens.max(report.used_tokens);
        self.strict_check()?;
        Ok(report)
    }

    /// [`get_next_batch_to_run`](Self::get_next_batch_to_run), with the HiCache copies its
    /// admissions started (and any from passes that admitted nothing) recorded on the batch.
    fn next_batch_with_io(&mut self, report: &mut StepReport) -> Result<Option<ForwardBatch>> {
        let storage = |s: &Self| s.cache.tier_stats().map_or(0, |t| t.storage_hit_tokens);
        let (loaded, stored) = (self.stats.host_hit_tokens, storage(self));
        let batch = self.get_next_batch_to_run(report)?;
        self.io_pending.0 += self.stats.host_hit_tokens - loaded;
        self.io_pending.1 += (storage(self) - stored) as usize;
        Ok(batch.map(|mut b| {
            (b.load_back_tokens, b.prefetch_tokens) = std::mem::take(&mut self.io_pending);
            b
        }))
    }

    /// Runs until idle or `max_steps`; returns every step's report.
    pub fn run_to_idle(
        &mut self,
        exec: &mut dyn Executor,
        max_steps: u64,
    ) -> Result<Vec<StepReport>> {
        let mut reports = Vec::new();
        for _ in 0..max_steps {
            if self.is_idle() {
                break;
            }
            reports.push(self.step(exec)?);
        }
        Ok(reports)
    }

    /// Empties the prefix cache (SGLang's `/flush_cache`); refused unless idle with no PD work.
    pub fn flush_cache(&mut self) -> Result<()> {
        if !self.is_idle() || self.has_pd_work() {
            return Err(SchedulerError::InvalidRequest(
                "flush_cache needs an idle scheduler".into(),
            ));
        }
        self.cache.reset(&mut self.alloc)?;
        Ok(())
    }

    /// Rows held by live requests (for leak checks).
    pub fn held_rows(&self) -> Vec<ReqRow> {
        self.reqs.values().filter_map(|r| r.row).collect()
    }

    // ----- batch selection --------------------------------------------------------------------

    /// SGLang's `get_next_batch_to_run`: a prefill batch if one can be built, else one decode
    /// step of the running requests (after the decode memory check), else nothing.
    fn get_next_batch_to_run(&mut self, report: &mut StepReport) -> Result<Option<ForwardBatch>> {
        if let Some(prefill) = self.get_new_batch_prefill(report)? {
            return self
                .prepare_for_extend(&prefill.reqs, prefill.mixed, report)
                .map(Some);
        }
        if self.running.is_empty() {
            return Ok(None);
        }
        if !self.check_decode_mem()? {
            self.retract_decode(report)?;
            if self.running.is_empty() {
                return Ok(None);
            }
        } else {
            self.ratio.step();
        }
        let mut batch = ForwardBatch::new(ForwardMode::Decode);
        self.prepare_for_decode(&mut batch, report)?;
        Ok(Some(batch))
    }

    /// SGLang's `get_new_batch_prefill`: ranks the queue, then admits the chunked request and
    /// waiting requests under one [`PrefillAdder`] until a budget says stop.
    fn get_new_batch_prefill(&mut self, report: &mut StepReport) -> Result<Option<PrefillPlan>> {
        if self.waiting.is_empty() && self.chunked.is_none() {
            return Ok(None);
        }
        if self.running.is_empty() {
            // Nothing running can free memory: the batch is never "full" then.
            self.batch_is_full = false;
        }
        if self.batch_is_full && self.chunked.is_none() {
            return Ok(None);
        }
        let allocatable = self
            .cfg
            .max_running_requests
            .saturating_sub(self.running.len() + usize::from(self.chunked.is_some()))
            .min(self.rows.available_size());
        if allocatable == 0 && self.chunked.is_none() {
            self.batch_is_full = true;
            return Ok(None);
        }
        calc_priority(
            &self.cfg,
            &mut self.cache,
            &self.reqs,
            &mut self.waiting,
            &mut self.rng,
        );
        let mixed = self.cfg.enable_mixed_chunk && !self.running.is_empty();
        let mixed_tokens = if mixed { self.running.len() } else { 0 };
        let remaining: Vec<usize> = self
            .running
            .iter()
            .map(|id| self.reqs[id].remaining_new_tokens())
            .collect();
        let mut adder = PrefillAdder::new(
            self.cfg.page_size,
            self.cfg.clip_max_new_tokens,
            self.cfg.max_prefill_tokens,
            self.cfg.chunked_prefill_size,
            self.ratio.current,
            remaining,
            mixed_tokens,
        );
        let mut chosen = Vec::new();
        let mut state = AddResult::Continue;
        if let Some(id) = self.chunked {
            let c = self.candidate(id);
            match adder.add_chunked_req(c, &self.cache, &self.alloc) {
                Admission::Admitted {
                    extend,
                    chunked,
                    next,
                } => {
                    let r = self.reqs.get_mut(&id).expect("chunked request");
                    r.extend_end = r.committed_len + extend;
                    if !chunked {
                        self.chunked = None;
                    }
                    chosen.push(id);
                    state = next;
                }
                // Less than a page of chunk budget (mixed decode tokens took it): the chunked
                // request waits for the next pass, and no other request may start a chunk.
                Admission::Rejected(why) => state = why,
            }
        }
        let mut new_chunked = None;
        let mut admitted_new = 0;
        let mut retried = None;
        // Admission takes the queue's head each time: an admitted request leaves the queue, a
        // rejected one ends the pass.
        // Requests whose L3 prefetch may not stop yet sit this pass out, in order.
        let mut prefetching = Vec::new();
        while state == AddResult::Continue && admitted_new < allocatable {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            if !self.prefetch_ready(id)? {
                prefetching.push(self.waiting.pop_front().expect("the head"));
                continue;
            }
            self.match_prefix(id);
            // A load-back takes device slots now: only when the pass's budget (what it has not
            // promised to the requests admitted before) would admit the request.
            self.load_back(id, &adder)?;
            let c = self.candidate(id);
            match adder.add_one_req(c, &mut self.cache, &self.alloc) {
                Admission::Admitted {
                    extend,
                    chunked,
                    next,
                } => {
                    let r = self.reqs.get_mut(&id).expect("waiting request");
                    r.extend_end = r.committed_len + extend;
                    // After a retraction the committed prefix can include the request's own
                    // outputs; only prompt tokens count as cached.
                    r.cached_tokens = r.committed_len.min(r.input_len);
                    self.stats.prompt_tokens += r.tokens.len();
                    self.stats.cached_tokens += r.committed_len;
                    report.cached_tokens += r.committed_len;
                    self.waiting.pop_front();
                    // A retracted request's KV was loaded back (or recomputed): unpin it.
                    self.release_host_pin(id)?;
                    chosen.push(id);
                    admitted_new += 1;
                    state = next;
                    if chunked {
                        new_chunked = Some(id);
                        break;
                    }
                }
                Admission::Rejected(why) => {
                    self.unmatch(id);
                    if why == AddResult::NoToken && retried != Some(id) {
                        let credited = self.try_preempt_for(id, report)?;
                        if credited > 0.0 {
                            // The victims' reserved tokens come back; retry this request once.
                            adder.rem_total_offset -= credited;
                            retried = Some(id);
                            continue;
                        }
                    }
                    state = why;
                }
            }
        }
        for id in prefetching.into_iter().rev() {
            self.waiting.push_front(id);
        }
        if state == AddResult::NoToken {
            self.batch_is_full = true;
        }
        if let Some(id) = new_chunked {
            self.chunked = Some(id);
        }
        if chosen.is_empty() {
            if self.running.is_empty() && self.chunked.is_none() {
                if state == AddResult::NoToken {
                    self.release_blocking_prefetches()?;
                }
                self.abort_unfittable_head(report);
            }
            return Ok(None);
        }
        Ok(Some(PrefillPlan {
            reqs: chosen,
            mixed,
        }))
    }

    /// A request as the [`PrefillAdder`] sees it, after its prefix match.
    fn candidate(&self, id: ReqId) -> Candidate {
        let r = &self.reqs[&id];
        Candidate {
            extend_input_len: r.extend_input_len(),
            remaining_new_tokens: r.remaining_new_tokens(),
            last_node: r.prefix.last_node,
        }
    }

    /// Admission on an empty pool fails iff extend + reserved output + one page does not fit
    /// in it: such a request can never run, so it is aborted rather than left waiting.
    fn abort_unfittable_head(&mut self, report: &mut StepReport) {
        let Some(&id) = self.waiting.front() else {
            return;
        };
        let r = &self.reqs[&id];
        let (extend, reserve) = (
            r.extend_input_len(),
            r.remaining_new_tokens().min(self.cfg.clip_max_new_tokens),
        );
        if extend + reserve + self.cfg.page_size as usize >= self.alloc.size() {
            self.waiting.pop_front();
            let message = format!(
                "the request needs {extend} prompt tokens plus {reserve} reserved output tokens, more than the KV pool's {} slots",
                self.alloc.size()
            );
            report.finished.push(StepFinished {
                id,
                reason: FinishReason::Abort {
                    message: message.clone(),
                },
            });
            self.finish(id, FinishReason::Abort { message });
        }
    }

    /// Matches a waiting request against the cache (splitting a node matched part-way, as
    /// SGLang's `init_next_round_input`); records the prefix on the request without locking
    /// it. At least the last token is left to compute, so the pass produces logits.
    fn match_prefix(&mut self, id: ReqId) {
        let r = self.reqs.get_mut(&id).expect("request");
        let mut slots = std::mem::take(&mut r.prefix.prefix_slots);
        slots.clear();
        let key_len = r.tokens.len() - 1;
        let m = self
            .cache
            .match_prefix(&r.tokens[..key_len], r.extra_key.as_deref(), &mut slots);
        r.prefix = PrefixState {
            cache_protected_len: m.len,
            last_node: m.last_node,
            prefix_slots: slots,
        };
        r.committed_len = m.len;
        r.host_hit_len = m.host_hit_len;
        r.last_host_node = m.last_host_node;
    }

    /// Forgets a rejected request's match (it was never locked).
    fn unmatch(&mut self, id: ReqId) {
        let root = self.cache.root(self.reqs[&id].extra_key.as_deref());
        let r = self.reqs.get_mut(&id).expect("request");
        r.prefix = PrefixState::new(root);
        r.committed_len = 0;
    }
}

/// The requests a prefill pass runs (the chunked one first) and whether the running requests
/// ride along (mixed chunk).
struct PrefillPlan {
    reqs: Vec<ReqId>,
    mixed: bool,
}
