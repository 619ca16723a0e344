//! Scheduler configuration, named after SGLang's server arguments.

use std::fmt;
use std::str::FromStr;

use crate::error::{Result, SchedulerError};

/// How the waiting queue is ordered (`--schedule-policy`).
#[doc(alias = "CacheAwarePolicy")]
#[doc(alias = "CacheAgnosticPolicy")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SchedulePolicy {
    /// First come, first served (SGLang's default).
    Fcfs,
    /// Longest cached prefix first (falls back to FCFS above a queue-length threshold).
    Lpm,
    /// Requests sharing deep prefixes together: heavier subtrees first.
    DfsWeight,
    /// Longest output first (largest `max_new_tokens`).
    Lof,
    /// Seeded shuffle.
    Random,
}

impl SchedulePolicy {
    /// Every policy, in a stable order (what `--schedule-policy` accepts).
    pub const ALL: [SchedulePolicy; 5] = [
        SchedulePolicy::Fcfs,
        SchedulePolicy::Lpm,
        SchedulePolicy::DfsWeight,
        SchedulePolicy::Lof,
        SchedulePolicy::Random,
    ];

    /// Name as `--schedule-policy` spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            SchedulePolicy::Fcfs => "fcfs",
            SchedulePolicy::Lpm => "lpm",
            SchedulePolicy::DfsWeight => "dfs-weight",
            SchedulePolicy::Lof => "lof",
            SchedulePolicy::Random => "random",
        }
    }

    /// Whether it ranks by the prefix cache (falls back to FCFS without a radix cache).
    pub const fn is_cache_aware(self) -> bool {
        matches!(self, SchedulePolicy::Lpm | SchedulePolicy::DfsWeight)
    }
}

impl fmt::Display for SchedulePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SchedulePolicy {
    type Err = SchedulerError;
    fn from_str(s: &str) -> Result<Self> {
        SchedulePolicy::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| SchedulerError::InvalidConfig {
                field: "--schedule-policy",
                reason: format!(
                    "unknown policy {s:?}; expected one of {}",
                    SchedulePolicy::ALL.map(|p| p.as_str()).join(", ")
                ),
            })
    }
}

/// Everything the scheduler needs to know, named after SGLang's server arguments (SGLang's
/// `ServerArgs`), with SGLang's defaults.
#[doc(alias = "ServerArgs")]
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// `--page-size` (default 1).
    pub page_size: u32,
    /// Longest request, prompt + output (SGLang: the model's context length).
    pub context_len: usize,
    /// `--max-running-requests`: also the number of request rows.
    pub max_running_requests: usize,
    /// `--max-prefill-tokens` (default 16384): token budget of one prefill batch.
    pub max_prefill_tokens: usize,
    /// `--chunked-prefill-size` (SGLang picks it by GPU memory; `None` disables chunking).
    pub chunked_prefill_size: Option<usize>,
    /// `--schedule-policy` (default fcfs).
    pub schedule_policy: SchedulePolicy,
    /// LPM falls back to FCFS above this many waiting requests (default 128).
    pub lpm_fallback_threshold: usize,
    /// In-batch prefix caching: check requests whose cache hit is at most this (default 32).
    pub in_batch_prefix_check_threshold: usize,
    /// In-batch prefix caching: deprioritize when at least this many tokens are shared
    /// (default 32).
    pub in_batch_prefix_deprioritize_threshold: usize,
    /// `--enable-priority-scheduling` (default false; with fcfs or lof only).
    pub enable_priority_scheduling: bool,
    /// `--schedule-low-priority-values-first` (default false).
    pub low_priority_values_first: bool,
    /// `--priority-scheduling-preemption-threshold` (default 10).
    pub priority_preemption_threshold: i64,
    /// `--schedule-conservativeness` (default 1.0): scales the initial new-token ratio.
    pub schedule_conservativeness: f64,
    /// `--enable-mixed-chunk` (default false).
    pub enable_mixed_chunk: bool,
    /// `--max-queued-requests` (default unlimited).
    pub max_queued_requests: Option<usize>,
    /// Clip of `max_new_tokens` in admission and preallocation estimates (SGLang's
    /// `CLIP_MAX_NEW_TOKEN`, default [`CLIP_MAX_NEW_TOKEN`] = 4096).
    ///
    /// [`CLIP_MAX_NEW_TOKEN`]: crate::disagg::CLIP_MAX_NEW_TOKEN
    pub clip_max_new_tokens: usize,
    /// Decode steps over which the new-token ratio decays to its floor (default 600).
    pub new_token_ratio_decay_steps: usize,
    /// Tokens per remaining request to free after a retraction (default 20).
    pub retract_decode_steps: usize,
    /// Sorted-release mode for the allocator (SGLang's `need_sort`, which SGLang sets in both
    /// PD modes, `--disaggregation-mode prefill` and `decode`): freed pages collect in a
    /// release list that is merged and sorted when an allocation runs short, so pages come out
    /// in ascending runs and transfers (source and destination) coalesce. The scheduler sets
    /// it on its allocator at construction (default false).
    pub need_sort: bool,
    /// PD decode: tokens reserved per active request when budgeting preallocation (SGLang's
    /// `SGLANG_NUM_RESERVED_DECODE_TOKENS`, default [`NUM_RESERVED_DECODE_TOKENS`] = 512).
    ///
    /// [`NUM_RESERVED_DECODE_TOKENS`]: crate::disagg::NUM_RESERVED_DECODE_TOKENS
    pub num_reserved_decode_tokens: usize,
    /// Check the pool partition after every step, failing the step on a violation.
    pub strict: bool,
    /// Seed of the random policy.
    pub seed: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            page_size: 1,
            context_len: 8192,
            max_running_requests: 256,
            max_prefill_tokens: 16384,
            chunked_prefill_size: Some(8192),
            schedule_policy: SchedulePolicy::Fcfs,
            lpm_fallback_threshold: 128,
            in_batch_prefix_check_threshold: 32,
            in_batch_prefix_deprioritize_threshold: 32,
            enable_priority_scheduling: false,
            low_priority_values_first: false,
            priority_preemption_threshold: 10,
            schedule_conservativeness: 1.0,
            enable_mixed_chunk: false,
            max_queued_requests: None,
            clip_max_new_tokens: crate::disagg::CLIP_MAX_NEW_TOKEN,
            new_token_ratio_decay_steps: 600,
            retract_decode_steps: 20,
            need_sort: false,
            num_reserved_decode_tokens: crate::disagg::NUM_RESERVED_DECODE_TOKENS,
            strict: false,
            seed: 0,
        }
    }
}

impl SchedulerConfig {
    /// Checks the values; errors name the flag.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: &str| {
            Err(SchedulerError::InvalidConfig {
                field,
                reason: reason.into(),
            })
        };
        if self.page_size == 0 {
            return bad("--page-size", "must be at least 1");
        }
        if self.context_len == 0 {
            return bad("--context-length", "must be at least 1");
        }
        if self.max_running_requests == 0 {
            return bad("--max-running-requests", "must be at least 1");
        }
        if self.max_prefill_tokens == 0 {
            return bad("--max-prefill-tokens", "must be at least 1");
        }
        if let Some(c) = self.chunked_prefill_size {
            if c < self.page_size as usize {
                return bad(
                    "--chunked-prefill-size",
                    "must be at least one page (or off)",
                );
            }
        }
        if !(self.schedule_conservativeness.is_finite() && self.schedule_conservativeness > 0.0) {
            return bad("--schedule-conservativeness", "must be a positive number");
        }
        if self.enable_priority_scheduling
            && !matches!(
                self.schedule_policy,
                SchedulePolicy::Fcfs | SchedulePolicy::Lof
            )
        {
            return bad(
                "--enable-priority-scheduling",
                "works only with --schedule-policy fcfs or lof",
            );
        }
        if self.max_queued_requests == Some(0) {
            return bad("--max-queued-requests", "must be at least 1");
        }
        Ok(())
    }
}

/// SGLang's `new_token_ratio`: the fraction of each running request's remaining
/// `max_new_tokens` that admission reserves. Starts at `min(0.7 × conservativeness, 1)`,
/// decays linearly to `min(initial × 0.14, 1)` over `decay_steps` decode steps, is re-estimated
/// after a retraction, and resets when the scheduler goes idle.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTokenRatio {
    /// Initial value, `min(0.7 × conservativeness, 1)`; restored when idle.
    pub initial: f64,
    /// Floor of the decay, `min(initial × 0.14, 1)`.
    pub min: f64,
    /// Subtracted per decode step without retraction: `(initial − min) / decay_steps`.
    pub decay: f64,
    /// The ratio admission uses now, in `[min, 1]`.
    pub current: f64,
}

impl NewTokenRatio {
    /// From `--schedule-conservativeness` and the decay horizon in decode steps (SGLang: 600).
    pub fn new(conservativeness: f64, decay_steps: usize) -> Self {
        let initial = (0.7 * conservativeness).min(1.0);
        let min = (initial * 0.14).min(1.0);
        let decay = (initial - min) / decay_steps.max(1) as f64;
        NewTokenRatio {
            initial,
            min,
            decay,
            current: initial,
        }
    }

    /// One decode step without retraction: decays toward the floor.
    pub fn step(&mut self) {
        self.current = (self.current - self.decay).max(self.min);
    }

    /// After a retraction: `min(1, (Σ generated + steps × n) / (Σ max_new + 1))` over the
    /// requests that remain.
    pub fn after_retraction(
        &mut self,
        generated: usize,
        max_new: usize,
        remaining: usize,
        steps: usize,
    ) {
        self.current = ((generated + steps * remaining) as f64 / (max_new as f64 + 1.0)).min(1.0);
    }

    /// Back to the initial value (idle).
    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}
