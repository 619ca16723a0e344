//! [`Scheduler`]: SGLang's event loop as a synchronous state machine (reference §2.9–2.11).
//!
//! One [`Scheduler::step`]: build a prefill batch if the waiting queue (or the chunked request)
//! allows one — prefill has priority — else a decode step of the running requests (after the
//! decode memory check, retracting if needed); run it on the [`Executor`]; process the results
//! (append tokens, finish checks, `cache_unfinished_req` / `cache_finished_req`). Time is a
//! logical clock; randomness is seeded; the same inputs in the same order give the same
//! decisions, so whole runs replay and snapshot.

use std::collections::{HashMap, VecDeque};
use std::fmt;

use kv_pool::{
    Allocator, DecodeRequest, ExtendRequest, Owner, OwnershipCheck, ReqRow, ReqToTokenPool, Slot,
};
use radix_cache::{PrefixCache, PrefixState, RadixCache};

use crate::adder::{AddResult, Admission, Candidate, PrefillAdder};
use crate::batch::{Executor, ForwardBatch, ForwardMode};
use crate::config::{NewTokenRatio, SchedulePolicy, SchedulerConfig};
use crate::error::{Result, SchedulerError};
use crate::req::{FinishReason, Req, ReqId, SamplingLimits};

/// A request that left the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedReq {
    /// Its id.
    pub id: ReqId,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (at its last admission).
    pub cached_tokens: usize,
    /// Generated tokens.
    pub output_ids: Vec<u32>,
    /// Why it finished.
    pub reason: FinishReason,
    /// Times it was retracted.
    pub retractions: u32,
}

/// What one step did (its `Display` is one readable line, for traces and snapshots).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepReport {
    /// Step number.
    pub step: u64,
    /// The pass's mode (`None`: idle).
    pub mode: Option<ForwardMode>,
    /// Per request in the pass: id, positions computed, whether it is a middle chunk.
    pub entries: Vec<(ReqId, usize, usize, bool)>,
    /// Tokens computed.
    pub tokens: usize,
    /// Prompt tokens served from the cache by this step's admissions.
    pub cached_tokens: usize,
    /// Tokens evicted from the prefix cache.
    pub evicted: usize,
    /// Requests retracted to the waiting queue.
    pub retracted: Vec<ReqId>,
    /// Requests that finished, with why.
    pub finished: Vec<(ReqId, FinishReason)>,
    /// The executor's time for the pass.
    pub elapsed_s: f64,
    /// Pool slots in use after the step.
    pub used_tokens: usize,
}

impl fmt::Display for StepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {:>3}: ", self.step)?;
        match self.mode {
            None => write!(f, "idle")?,
            Some(mode) => {
                let m = match mode {
                    ForwardMode::Extend => "extend",
                    ForwardMode::Decode => "decode",
                    ForwardMode::Mixed => "mixed ",
                };
                write!(f, "{m}")?;
                for (id, from, to, chunk) in &self.entries {
                    if mode == ForwardMode::Decode {
                        write!(f, " {id}")?;
                    } else {
                        write!(f, " {id}[{from}..{to}){}", if *chunk { "*" } else { "" })?;
                    }
                }
                write!(f, " | tokens {}", self.tokens)?;
            }
        }
        if self.cached_tokens > 0 {
            write!(f, " | cached {}", self.cached_tokens)?;
        }
        if self.evicted > 0 {
            write!(f, " | evicted {}", self.evicted)?;
        }
        if !self.retracted.is_empty() {
            let r: Vec<String> = self.retracted.iter().map(|r| r.to_string()).collect();
            write!(f, " | retracted {}", r.join(" "))?;
        }
        if !self.finished.is_empty() {
            let r: Vec<String> = self
                .finished
                .iter()
                .map(|(id, why)| format!("{id}:{why}"))
                .collect();
            write!(f, " | finished {}", r.join(" "))?;
        }
        write!(f, " | used {}", self.used_tokens)
    }
}

/// The continuous-batching scheduler over one KV pool.
pub struct Scheduler {
    cfg: SchedulerConfig,
    cache: Box<dyn PrefixCache>,
    radix_enabled: bool,
    alloc: Box<dyn Allocator>,
    rows: ReqToTokenPool,
    reqs: HashMap<ReqId, Req>,
    waiting: VecDeque<ReqId>,
    running: Vec<ReqId>,
    chunked: Option<ReqId>,
    finished: Vec<FinishedReq>,
    ratio: NewTokenRatio,
    batch_is_full: bool,
    next_id: u64,
    clock: u64,
    steps: u64,
    rng: u64,
    /// Totals since start.
    pub stats: SchedulerStats,
}

/// Counters since the scheduler started.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    /// Prompt tokens of admitted requests (counting re-admissions after retraction).
    pub prompt_tokens: usize,
    /// Of those, tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Tokens computed by prefill passes.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Retractions.
    pub retractions: usize,
    /// Tokens evicted from the prefix cache.
    pub evicted_tokens: usize,
    /// Highest pool use seen after a step.
    pub peak_used_tokens: usize,
}

impl fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheduler")
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .field("chunked", &self.chunked)
            .field("steps", &self.steps)
            .finish()
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Scheduler {
    /// A scheduler over `cache` and `alloc` (their page sizes must match the config's);
    /// `radix_enabled` says whether `cache` reuses prefixes (cache-aware policies fall back to
    /// FCFS otherwise).
    pub fn new(
        cfg: SchedulerConfig,
        cache: Box<dyn PrefixCache>,
        radix_enabled: bool,
        alloc: Box<dyn Allocator>,
    ) -> Result<Self> {
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
        Ok(Scheduler {
            ratio: NewTokenRatio::new(
                cfg.schedule_conservativeness,
                cfg.new_token_ratio_decay_steps,
            ),
            rng: cfg.seed,
            cfg,
            cache,
            radix_enabled,
            alloc,
            rows,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            chunked: None,
            finished: Vec::new(),
            batch_is_full: false,
            next_id: 0,
            clock: 0,
            steps: 0,
            stats: SchedulerStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The prefix cache.
    pub fn cache(&self) -> &dyn PrefixCache {
        &*self.cache
    }

    /// The allocator.
    pub fn allocator(&self) -> &dyn Allocator {
        &*self.alloc
    }

    /// The request-to-token table.
    pub fn rows(&self) -> &ReqToTokenPool {
        &self.rows
    }

    /// The current new-token ratio.
    pub fn new_token_ratio(&self) -> f64 {
        self.ratio.current
    }

    /// Waiting requests.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Running (decoding) requests, plus the chunked one.
    pub fn num_running(&self) -> usize {
        self.running.len() + usize::from(self.chunked.is_some())
    }

    /// Whether nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.chunked.is_none()
    }

    /// A live request.
    pub fn request(&self, id: ReqId) -> Option<&Req> {
        self.reqs.get(&id)
    }

    /// Takes the requests that finished since the last call.
    pub fn take_finished(&mut self) -> Vec<FinishedReq> {
        std::mem::take(&mut self.finished)
    }

    /// Steps run so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Adds a request to the waiting queue.
    pub fn add_request(
        &mut self,
        input_ids: Vec<u32>,
        limits: SamplingLimits,
        priority: i64,
        extra_key: Option<String>,
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
            if self.waiting.len() >= limit {
                return Err(SchedulerError::QueueFull { limit });
            }
        }
        let mut limits = limits;
        // Like SGLang, clip the output so prompt + output fits the context.
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
            retractions: 0,
            finish: None,
        };
        self.reqs.insert(id, req);
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Aborts a request wherever it is, freeing its KV; it shows up in
    /// [`take_finished`](Self::take_finished) with [`FinishReason::Abort`].
    pub fn abort(&mut self, id: ReqId, message: &str) -> Result<()> {
        if !self.reqs.contains_key(&id) {
            return Err(SchedulerError::UnknownRequest(id));
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
        }
        self.finish(id, reason);
        Ok(())
    }

    /// Runs one step; `Ok(None)` when idle.
    pub fn step(&mut self, exec: &mut dyn Executor) -> Result<StepReport> {
        self.steps += 1;
        self.clock += 1;
        let mut report = StepReport {
            step: self.steps,
            ..StepReport::default()
        };
        let evicted_before = self.stats.evicted_tokens;
        let batch = self.get_next_batch_to_run(&mut report)?;
        if let Some(batch) = batch {
            let out = exec.forward(&batch, &self.rows).and_then(|out| {
                if out.next_tokens.len() == batch.len() {
                    Ok(out)
                } else {
                    Err(format!(
                        "{} tokens for a batch of {}",
                        out.next_tokens.len(),
                        batch.len()
                    ))
                }
            });
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
            self.process_batch_result(&batch, &out.next_tokens, &mut report)?;
        } else {
            // Idle: reset the admission optimism.
            self.ratio.reset();
        }
        report.evicted = self.stats.evicted_tokens - evicted_before;
        report.used_tokens = self.alloc.size() - self.alloc.available_size();
        self.stats.peak_used_tokens = self.stats.peak_used_tokens.max(report.used_tokens);
        if self.cfg.strict {
            self.check_invariants()
                .map_err(|message| SchedulerError::Invariant {
                    step: self.steps,
                    message,
                })?;
        }
        Ok(report)
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

    // ----- batch selection --------------------------------------------------------------------

    fn get_next_batch_to_run(&mut self, report: &mut StepReport) -> Result<Option<ForwardBatch>> {
        let prefill = self.get_new_batch_prefill(report)?;
        if let Some((reqs, mixed)) = prefill {
            return self.prepare_for_extend(&reqs, mixed, report).map(Some);
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

    /// Chooses the requests of a prefill pass. Returns them (the chunked one first) and
    /// whether the running requests ride along (mixed chunk), or `None`.
    fn get_new_batch_prefill(
        &mut self,
        report: &mut StepReport,
    ) -> Result<Option<(Vec<ReqId>, bool)>> {
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
        self.order_waiting();
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
            let r = &self.reqs[&id];
            let c = Candidate {
                extend_input_len: r.extend_input_len(),
                remaining_new_tokens: r.remaining_new_tokens(),
                last_node: r.prefix.last_node,
            };
            if let Admission::Admitted {
                extend,
                chunked,
                next,
            } = adder.add_chunked_req(c, &*self.cache, &*self.alloc)
            {
                let r = self.reqs.get_mut(&id).expect("chunked request");
                r.extend_end = r.committed_len + extend;
                if !chunked {
                    self.chunked = None;
                }
                chosen.push(id);
                state = next;
            }
        }
        let mut new_chunked = None;
        let mut admitted_new = 0;
        let mut retried = None;
        // Admission takes the queue's head each time: an admitted request leaves the queue, a
        // rejected one ends the pass.
        while state == AddResult::Continue && admitted_new < allocatable {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            self.match_prefix(id);
            let r = &self.reqs[&id];
            let c = Candidate {
                extend_input_len: r.extend_input_len(),
                remaining_new_tokens: r.remaining_new_tokens(),
                last_node: r.prefix.last_node,
            };
            match adder.add_one_req(c, &mut *self.cache, &*self.alloc) {
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
        if state == AddResult::NoToken {
            self.batch_is_full = true;
        }
        if let Some(id) = new_chunked {
            self.chunked = Some(id);
        }
        if chosen.is_empty() {
            if self.running.is_empty() && self.chunked.is_none() {
                // Admission on an empty pool fails iff extend + reserved output + one page does
                // not fit in it: such a request can never run, so abort it rather than wait.
                if let Some(&id) = self.waiting.front() {
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
                        report.finished.push((
                            id,
                            FinishReason::Abort {
                                message: message.clone(),
                            },
                        ));
                        self.finish(id, FinishReason::Abort { message });
                    }
                }
            }
            return Ok(None);
        }
        Ok(Some((chosen, mixed)))
    }

    /// Matches a waiting request against the cache (splitting nodes, as SGLang's
    /// `init_next_round_input`); records the prefix on the request without locking it.
    fn match_prefix(&mut self, id: ReqId) {
        let r = self.reqs.get_mut(&id).expect("request");
        let mut slots = std::mem::take(&mut r.prefix.prefix_slots);
        slots.clear();
        // Leave at least one token to compute, so the pass produces logits.
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
    }

    fn unmatch(&mut self, id: ReqId) {
        let root = self.cache.root(self.reqs[&id].extra_key.as_deref());
        let r = self.reqs.get_mut(&id).expect("request");
        r.prefix = PrefixState::new(root);
        r.committed_len = 0;
    }

    // ----- policies ----------------------------------------------------------------------------

    fn order_waiting(&mut self) {
        let mut policy = self.cfg.schedule_policy;
        if policy.is_cache_aware() && !self.radix_enabled {
            policy = SchedulePolicy::Fcfs;
        }
        if policy == SchedulePolicy::Lpm && self.waiting.len() > self.cfg.lpm_fallback_threshold {
            policy = SchedulePolicy::Fcfs;
        }
        let mut ids: Vec<ReqId> = self.waiting.iter().copied().collect();
        let prio = |r: &Req| {
            if self.cfg.low_priority_values_first {
                r.priority
            } else {
                -r.priority
            }
        };
        match policy {
            SchedulePolicy::Fcfs => {
                if self.cfg.enable_priority_scheduling {
                    ids.sort_by_key(|id| (prio(&self.reqs[id]), self.reqs[id].arrival));
                }
            }
            SchedulePolicy::Lof => {
                ids.sort_by_key(|id| {
                    let r = &self.reqs[id];
                    let p = if self.cfg.enable_priority_scheduling {
                        prio(r)
                    } else {
                        0
                    };
                    (p, std::cmp::Reverse(r.limits.max_new_tokens))
                });
            }
            SchedulePolicy::Random => {
                for i in (1..ids.len()).rev() {
                    let j = (splitmix(&mut self.rng) % (i as u64 + 1)) as usize;
                    ids.swap(i, j);
                }
            }
            SchedulePolicy::Lpm => {
                let keys = self.lpm_keys(&ids);
                let mut keyed: Vec<_> = ids.into_iter().zip(keys).collect();
                keyed.sort_by_key(|&(_, (deprioritized, len))| {
                    (deprioritized, std::cmp::Reverse(len))
                });
                ids = keyed.into_iter().map(|(id, _)| id).collect();
            }
            SchedulePolicy::DfsWeight => ids = self.dfs_weight_order(&ids),
        }
        self.waiting = ids.into();
    }

    /// LPM keys: (deprioritized by in-batch prefix caching, cached prefix length). Matching is
    /// read-only: it never splits the tree.
    fn lpm_keys(&self, ids: &[ReqId]) -> Vec<(bool, usize)> {
        let mut scratch = RadixCache::new(1, radix_cache::BuiltinPolicy::Lru);
        let mut dummy = Vec::new();
        ids.iter()
            .map(|id| {
                let r = &self.reqs[id];
                let len = self
                    .cache
                    .peek_prefix_len(&r.tokens[..r.tokens.len() - 1], r.extra_key.as_deref());
                let mut deprioritized = false;
                if len <= self.cfg.in_batch_prefix_check_threshold {
                    let shared = scratch.peek_prefix_len(&r.tokens, r.extra_key.as_deref());
                    if shared >= self.cfg.in_batch_prefix_deprioritize_threshold {
                        deprioritized = true;
                    } else {
                        dummy.resize(r.tokens.len(), Slot::PADDING);
                        let _ = scratch.insert(
                            &r.tokens,
                            r.extra_key.as_deref(),
                            &dummy,
                            Default::default(),
                        );
                    }
                }
                (deprioritized, len)
            })
            .collect()
    }

    /// DFS-weight: weigh every tree node by the waiting requests whose match ends in its
    /// subtree, then walk from the roots, heavier children first, emitting each node's requests
    /// after its subtree.
    fn dfs_weight_order(&self, ids: &[ReqId]) -> Vec<ReqId> {
        use radix_cache::NodeId;
        let mut weight: HashMap<NodeId, usize> = HashMap::new();
        let mut children: HashMap<Option<NodeId>, Vec<NodeId>> = HashMap::new();
        let mut at: HashMap<Option<NodeId>, Vec<ReqId>> = HashMap::new();
        for &id in ids {
            let r = &self.reqs[&id];
            let (_, node) = self
                .cache
                .peek_prefix(&r.tokens[..r.tokens.len() - 1], r.extra_key.as_deref());
            at.entry(node).or_default().push(id);
            let mut n = node;
            while let Some(cur) = n {
                let w = weight.entry(cur).or_insert(0);
                *w += 1;
                let parent = self.cache.parent(cur);
                if *w == 1 {
                    children.entry(parent).or_default().push(cur);
                }
                n = parent;
            }
        }
        let mut out = Vec::with_capacity(ids.len());
        // Iterative post-order from the virtual root (None).
        let mut stack: Vec<(Option<NodeId>, bool)> = vec![(None, false)];
        while let Some((node, expanded)) = stack.pop() {
            if expanded {
                out.extend(at.get(&node).into_iter().flatten().copied());
                continue;
            }
            stack.push((node, true));
            let mut kids = children.get(&node).cloned().unwrap_or_default();
            // Heavier first; ties by node for determinism. Pushed in reverse to pop in order.
            kids.sort_by_key(|k| (std::cmp::Reverse(weight[k]), *k));
            for k in kids.into_iter().rev() {
                stack.push((Some(k), false));
            }
        }
        out
    }

    /// Priority preemption: if `id` beats the lowest-priority running request by more than
    /// the threshold, retract running requests worst-first until at least the tokens it needs
    /// could be free; returns whether anything was preempted.
    fn try_preempt_for(&mut self, id: ReqId, report: &mut StepReport) -> Result<f64> {
        if !self.cfg.enable_priority_scheduling {
            return Ok(0.0);
        }
        let low_first = self.cfg.low_priority_values_first;
        let prio = self.reqs[&id].priority;
        // How far `id` is ahead of a running request (positive: `id` is better).
        let gap = |p: i64| if low_first { p - prio } else { prio - p };
        let threshold = self.cfg.priority_preemption_threshold;
        let mut victims: Vec<ReqId> = self
            .running
            .iter()
            .copied()
            .filter(|r| gap(self.reqs[r].priority) > threshold)
            .collect();
        if victims.is_empty() {
            return Ok(0.0);
        }
        // Worst priority first, then the latest arrival.
        victims.sort_by_key(|r| {
            let q = &self.reqs[r];
            (
                std::cmp::Reverse(gap(q.priority)),
                std::cmp::Reverse(q.arrival),
            )
        });
        let need = self.reqs[&id].extend_input_len()
            + self.reqs[&id]
                .remaining_new_tokens()
                .min(self.cfg.clip_max_new_tokens)
            + self.cfg.page_size as usize;
        let mut credited = 0.0;
        for v in victims {
            if (self.alloc.available_size() + self.cache.evictable_size()) as f64
                > need as f64 + self.reserved_tokens()
            {
                break;
            }
            credited += self.reqs[&v]
                .remaining_new_tokens()
                .min(self.cfg.clip_max_new_tokens) as f64
                * self.ratio.current;
            self.retract(v, report)?;
        }
        if credited > 0.0 {
            self.batch_is_full = false;
        }
        Ok(credited)
    }

    fn reserved_tokens(&self) -> f64 {
        self.running
            .iter()
            .map(|r| {
                self.reqs[r]
                    .remaining_new_tokens()
                    .min(self.cfg.clip_max_new_tokens) as f64
                    * self.ratio.current
            })
            .sum()
    }

    // ----- preparing passes --------------------------------------------------------------------

    /// Evicts from the cache so that `need` slots are free, if it can (the shortfall only).
    fn ensure_available(&mut self, need: usize) -> Result<()> {
        let avail = self.alloc.available_size();
        if avail < need {
            let freed = self.cache.evict(need - avail, &mut *self.alloc)?;
            self.stats.evicted_tokens += freed;
        }
        Ok(())
    }

    fn prepare_for_extend(
        &mut self,
        ids: &[ReqId],
        mixed: bool,
        report: &mut StepReport,
    ) -> Result<ForwardBatch> {
        let p = self.cfg.page_size as usize;
        // Rows first (all or nothing), then the cached prefixes written into them.
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
        let worst = extend_tokens + if p > 1 { ids.len() * p } else { 0 };
        self.ensure_available(worst)?;
        let mut slots = Vec::with_capacity(extend_tokens);
        self.alloc.alloc_extend(&batch_reqs, &mut slots)?;
        let mode = if mixed {
            ForwardMode::Mixed
        } else {
            ForwardMode::Extend
        };
        let mut batch = ForwardBatch::new(mode);
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
            report
                .entries
                .push((id, r.committed_len, r.extend_end, middle));
            r.allocated_len = r.extend_end;
            off += n;
        }
        self.stats.prefill_tokens += extend_tokens;
        if mixed {
            if !self.check_decode_mem()? {
                self.retract_decode(report)?;
            }
            self.prepare_for_decode(&mut batch, report)?;
        }
        Ok(batch)
    }

    /// Adds one decode token per running request to `batch`.
    fn prepare_for_decode(
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
            report.entries.push((*id, pos, pos + 1, false));
            r.allocated_len = pos + 1;
        }
        Ok(())
    }

    // ----- decode memory and retraction -------------------------------------------------------

    /// SGLang's decode memory check: every request whose committed length is a multiple of
    /// `P` needs a fresh page; evict that much if short; pass iff it is available.
    fn check_decode_mem(&mut self) -> Result<bool> {
        let p = self.cfg.page_size as usize;
        let pages = self
            .running
            .iter()
            .filter(|id| self.reqs[id].committed_len % p == 0)
            .count();
        let need = pages * p;
        self.ensure_available(need)?;
        Ok(self.alloc.available_size() >= need)
    }

    /// Retracts running requests (fewest generated tokens first, then longest prompt) until the
    /// decode check passes; never the last one, which is aborted if it alone cannot fit.
    fn retract_decode(&mut self, report: &mut StepReport) -> Result<()> {
        let mut order = self.running.clone();
        order.sort_by_key(|id| {
            let r = &self.reqs[id];
            std::cmp::Reverse((r.generated(), std::cmp::Reverse(r.input_len)))
        });
        while !self.check_decode_mem()? {
            if self.running.len() == 1 {
                let id = self.running.remove(0);
                let (need, pool) = (self.cfg.page_size as usize, self.alloc.size());
                self.release_kv(id, true)?;
                let message = format!(
                    "out of memory even after retracting every other request: one more token needs {need} free slots and the pool has {pool}"
                );
                report.finished.push((
                    id,
                    FinishReason::Abort {
                        message: message.clone(),
                    },
                ));
                self.finish(id, FinishReason::Abort { message });
                break;
            }
            let victim = order.pop().expect("a request to retract");
            self.retract(victim, report)?;
            // Free enough for the others to make progress for a while.
            let keep = self.running.len() * self.cfg.retract_decode_steps;
            self.ensure_available(keep)?;
        }
        let (generated, max_new): (usize, usize) = self
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
    /// will be prefilled again over prompt + outputs.
    fn retract(&mut self, id: ReqId, report: &mut StepReport) -> Result<()> {
        self.running.retain(|&r| r != id);
        self.release_kv(id, false)?;
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

    // ----- results ------------------------------------------------------------------------------

    /// Ends every request of `batch` after its forward pass failed: each is aborted with the
    /// executor's message and its KV released as after any abort. Only the tokens committed
    /// before this pass (whose KV was written by earlier passes) can enter the prefix cache;
    /// the slots allocated for this pass are freed.
    fn fail_batch(
        &mut self,
        batch: &ForwardBatch,
        error: &str,
        report: &mut StepReport,
    ) -> Result<()> {
        let message = format!("the forward pass failed: {error}");
        for &id in &batch.reqs {
            if !self.reqs.contains_key(&id) {
                continue;
            }
            self.running.retain(|&x| x != id);
            if self.chunked == Some(id) {
                self.chunked = None;
            }
            self.release_kv(id, true)?;
            let reason = FinishReason::Abort {
                message: message.clone(),
            };
            report.finished.push((id, reason.clone()));
            self.finish(id, reason);
        }
        self.batch_is_full = false;
        Ok(())
    }

    fn process_batch_result(
        &mut self,
        batch: &ForwardBatch,
        tokens: &[u32],
        report: &mut StepReport,
    ) -> Result<()> {
        let decode_part = batch.mode != ForwardMode::Extend;
        if decode_part {
            self.alloc.free_group_begin()?;
        }
        for (k, &id) in batch.reqs.iter().enumerate() {
            let is_decode = batch.extend_lens[k] == 1
                && self.running.contains(&id)
                && batch.mode != ForwardMode::Extend;
            let r = self.reqs.get_mut(&id).expect("request in batch");
            r.committed_len = batch.seq_lens[k];
            if !batch.sample[k] {
                // A middle chunk: stash its KV in the tree (locked), no token.
                let r = self.reqs.get_mut(&id).expect("request");
                let row = r.row.expect("row");
                let view = r.cache_view(row);
                self.cache
                    .cache_unfinished_req(view, &mut self.rows, &mut *self.alloc, true)?;
                continue;
            }
            r.tokens.push(tokens[k]);
            self.stats.output_tokens += 1;
            let finish = Self::check_finished(r, tokens[k]);
            if let Some(reason) = finish {
                if is_decode {
                    self.running.retain(|&x| x != id);
                }
                self.release_kv(id, true)?;
                report.finished.push((id, reason.clone()));
                self.finish(id, reason);
            } else if !is_decode {
                // Prefill done: make the prompt shareable now, then decode.
                let r = self.reqs.get_mut(&id).expect("request");
                let row = r.row.expect("row");
                let view = r.cache_view(row);
                self.cache
                    .cache_unfinished_req(view, &mut self.rows, &mut *self.alloc, false)?;
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

    fn check_finished(r: &Req, token: u32) -> Option<FinishReason> {
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

    /// SGLang's `release_kv_cache`: cache (or not) and free the request's KV, then its row.
    fn release_kv(&mut self, id: ReqId, insert: bool) -> Result<()> {
        let r = self.reqs.get_mut(&id).expect("request");
        let Some(row) = r.row else { return Ok(()) };
        let view = r.cache_view(row);
        self.cache
            .cache_finished_req(view, &self.rows, &mut *self.alloc, insert)?;
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

    fn finish(&mut self, id: ReqId, reason: FinishReason) {
        if let Some(r) = self.reqs.remove(&id) {
            self.finished.push(FinishedReq {
                id,
                prompt_tokens: r.input_len,
                cached_tokens: r.cached_tokens,
                output_ids: r.output_ids().to_vec(),
                reason,
                retractions: r.retractions,
            });
        }
    }

    // ----- checks --------------------------------------------------------------------------------

    /// Proves that free pages, tree pages and request-private pages partition the pool (the
    /// kv-pool ownership checker), and, when idle, SGLang's identity `available + evictable +
    /// protected = total` and that every row is free.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut check = OwnershipCheck::new(&*self.alloc);
        self.cache.claim_ownership(&mut check);
        let live = self.running.iter().chain(self.chunked.iter());
        for id in live {
            let r = &self.reqs[id];
            let row = r.row.ok_or_else(|| format!("{id} runs without a row"))?;
            let slots = self
                .rows
                .read(row, r.allocated_len)
                .map_err(|e| e.to_string())?;
            check.claim(Owner::Request(row), &slots[r.prefix.cache_protected_len..]);
        }
        check.finish().map_err(|v| v.to_string())?;
        if self.is_idle() {
            let total = self.alloc.available_size()
                + self.cache.evictable_size()
                + self.cache.protected_size();
            if total != self.alloc.size() {
                return Err(format!(
                    "idle identity: available {} + evictable {} + protected {} != {}",
                    self.alloc.available_size(),
                    self.cache.evictable_size(),
                    self.cache.protected_size(),
                    self.alloc.size()
                ));
            }
            if self.cache.protected_size() != 0 {
                return Err(format!(
                    "idle with {} protected tokens",
                    self.cache.protected_size()
                ));
            }
            if self.rows.available_size() != self.rows.size() {
                return Err(format!(
                    "idle with {} rows held",
                    self.rows.size() - self.rows.available_size()
                ));
            }
        }
        Ok(())
    }

    /// Empties the prefix cache (SGLang's `/flush_cache`); refused unless idle.
    pub fn flush_cache(&mut self) -> Result<()> {
        if !self.is_idle() {
            return Err(SchedulerError::InvalidRequest(
                "flush_cache needs an idle scheduler".into(),
            ));
        }
        self.cache.reset(&mut *self.alloc)?;
        Ok(())
    }

    /// Rows held by requests (for leak checks).
    pub fn held_rows(&self) -> Vec<ReqRow> {
        self.reqs.values().filter_map(|r| r.row).collect()
    }
}
