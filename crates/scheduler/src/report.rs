//! What the scheduler reports: one step ([`StepReport`], one line per step in traces and
//! snapshots), a request that left ([`FinishedReq`]) and the running totals
//! ([`SchedulerStats`]).

use std::fmt;

use crate::batch::ForwardMode;
use crate::req::{FinishReason, ReqId};

/// A request that left the scheduler (finished, aborted or failed), as
/// [`Scheduler::take_finished`](crate::Scheduler::take_finished) hands it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedReq {
    /// The id [`Scheduler::add_request`](crate::Scheduler::add_request) returned.
    pub id: ReqId,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache at its last admission (after a retraction
    /// the re-admission counts, not the first one).
    pub cached_tokens: usize,
    /// Generated tokens, in order (the stop token included when one ended it).
    pub output_ids: Vec<u32>,
    /// Length, stop token or abort (with its message).
    pub reason: FinishReason,
    /// How often it was retracted (or preempted) and recomputed.
    pub retractions: u32,
    /// PD prefill: it finished but keeps its row, slots and prefix lock until
    /// [`Scheduler::release_held`](crate::Scheduler::release_held) (it was marked with
    /// [`Scheduler::hold_kv_at_finish`](crate::Scheduler::hold_kv_at_finish)); its KV is
    /// readable through [`Scheduler::committed_slots`](crate::Scheduler::committed_slots)
    /// until then. False for every other request.
    pub kv_held: bool,
}

/// A request that left during a step, and why (a line of [`StepReport`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepFinished {
    /// The request.
    pub id: ReqId,
    /// Length, stop token, or abort with its message.
    pub reason: FinishReason,
}

/// One request's part of a forward pass: positions `[from, to)` computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepEntry {
    /// The request.
    pub id: ReqId,
    /// First position computed (the committed length before the pass).
    pub from: usize,
    /// One past the last position computed.
    pub to: usize,
    /// A middle prefill chunk: no token is sampled, more chunks follow.
    pub middle_chunk: bool,
}

/// What one step did (its `Display` is one readable line, for traces and snapshots).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepReport {
    /// Step number, from 1.
    pub step: u64,
    /// The pass's mode (`None`: no pass ran — idle, nothing could be scheduled — or the pass
    /// failed and its requests are in `finished` as aborted).
    pub mode: Option<ForwardMode>,
    /// The requests of the pass, in batch order.
    pub entries: Vec<StepEntry>,
    /// Tokens computed (the batch's new tokens).
    pub tokens: usize,
    /// Prompt tokens served from the cache by this step's admissions.
    pub cached_tokens: usize,
    /// Tokens evicted from the prefix cache during the step.
    pub evicted: usize,
    /// Requests retracted (or preempted) back to the waiting queue.
    pub retracted: Vec<ReqId>,
    /// Requests that finished in the step, with why.
    pub finished: Vec<StepFinished>,
    /// The executor's time for the pass, in seconds (0 for the fake executor).
    pub elapsed_s: f64,
    /// Pool slots in use after the step (`size − available`).
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
                for e in &self.entries {
                    if mode == ForwardMode::Decode {
                        write!(f, " {}", e.id)?;
                    } else {
                        let star = if e.middle_chunk { "*" } else { "" };
                        write!(f, " {}[{}..{}){star}", e.id, e.from, e.to)?;
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
                .map(|f| format!("{}:{}", f.id, f.reason))
                .collect();
            write!(f, " | finished {}", r.join(" "))?;
        }
        write!(f, " | used {}", self.used_tokens)
    }
}

/// Counters since the scheduler started (SGLang logs the same figures per prefill batch).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    /// Prompt tokens of admitted requests (a re-admission after retraction counts again, over
    /// prompt + outputs so far).
    pub prompt_tokens: usize,
    /// Of those, tokens served from the prefix cache (every tier).
    pub cached_tokens: usize,
    /// Of those, tokens loaded back from the host tier (HiCache).
    pub host_hit_tokens: usize,
    /// Tokens computed by prefill passes.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Retractions and priority preemptions.
    pub retractions: usize,
    /// Tokens evicted from the prefix cache.
    pub evicted_tokens: usize,
    /// Highest pool use seen after a step, in slots.
    pub peak_used_tokens: usize,
}
