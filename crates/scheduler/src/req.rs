//! Requests with SGLang's per-request state (`Req` in SGLang's `managers/schedule_batch.py`).

use std::fmt;

use kv_pool::ReqRow;
use radix_cache::{PrefixState, ReqView};

/// A request id, assigned by the scheduler from 0 in arrival order; displayed `r<n>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReqId(pub u64);

impl fmt::Display for ReqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// The sampling limits the scheduler enforces (the sampling itself is the executor's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplingLimits {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// Keep generating past stop tokens (EOS included).
    pub ignore_eos: bool,
    /// Tokens that finish the request (the model's EOS among them).
    pub stop_token_ids: Vec<u32>,
}

impl SamplingLimits {
    /// `max_new_tokens` with no stop tokens.
    pub fn max_new(max_new_tokens: usize) -> Self {
        SamplingLimits {
            max_new_tokens,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
        }
    }
}

/// Why a request finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached `max_new_tokens`.
    Length {
        /// The request's `max_new_tokens` (after clipping to the context).
        length: usize,
    },
    /// Generated a stop token.
    Stop {
        /// The stop token generated (it is the last output token).
        token: u32,
    },
    /// Aborted (by the client, or because it cannot fit in memory).
    Abort {
        /// Human-readable cause (the client's, or which limit made it unservable).
        message: String,
    },
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FinishReason::Length { length } => write!(f, "length({length})"),
            FinishReason::Stop { token } => write!(f, "stop({token})"),
            FinishReason::Abort { message } => write!(f, "abort({message})"),
        }
    }
}

/// A request and its scheduling state (SGLang's `Req`; SGLang's name, so no alias is needed).
#[derive(Debug, Clone)]
pub struct Req {
    /// Its id (the key of the scheduler's request table).
    pub id: ReqId,
    /// Prompt then generated tokens (SGLang's `origin_input_ids + output_ids`).
    pub tokens: Vec<u32>,
    /// Prompt length in tokens: `tokens[..input_len]` is the prompt.
    pub input_len: usize,
    /// What ends it: `max_new_tokens` (clipped to the context) and stop tokens.
    pub limits: SamplingLimits,
    /// Priority (larger runs first unless configured otherwise).
    pub priority: i64,
    /// Arrival on the scheduler's logical clock.
    pub arrival: u64,
    /// Cache namespace (LoRA id, cache salt).
    pub extra_key: Option<String>,
    /// Its request-table row while it holds one.
    pub row: Option<ReqRow>,
    /// Positions whose KV is valid (SGLang's `kv_committed_len`).
    pub committed_len: usize,
    /// Positions with slots (`kv_allocated_len`; equals committed between steps here).
    pub allocated_len: usize,
    /// The prefix cache's state on it: protected length, locked node, matched slots.
    pub prefix: PrefixState,
    /// Positions of the current forward pass: `[committed_len, extend_end)`.
    pub extend_end: usize,
    /// Prompt tokens served from the cache at its (last) admission (every tier: device, host
    /// loaded back, storage prefetched).
    pub cached_tokens: usize,
    /// HiCache: tokens of host-only nodes at the end of its last match (loaded back at
    /// admission when worth it; 0 without a host tier).
    pub host_hit_len: usize,
    /// HiCache: the deepest node of its last match, host-only ones included.
    pub last_host_node: radix_cache::NodeId,
    /// HiCache: the node whose host pages hold its KV since it was retracted to host, pinned
    /// until it is admitted again (or ends).
    pub host_pin: Option<radix_cache::NodeId>,
    /// Times it was retracted (or preempted) and re-queued.
    pub retractions: u32,
    /// Why it finished, once it has.
    pub finish: Option<FinishReason>,
}

impl Req {
    /// Generated tokens (SGLang's `output_ids`): `tokens[input_len..]`.
    pub fn output_ids(&self) -> &[u32] {
        &self.tokens[self.input_len..]
    }

    /// Generated token count (`output_ids().len()`).
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.input_len
    }

    /// Tokens it may still generate: `max_new_tokens − generated`, never negative.
    pub fn remaining_new_tokens(&self) -> usize {
        self.limits.max_new_tokens.saturating_sub(self.generated())
    }

    /// The request as the prefix cache sees it, holding `row`.
    pub fn cache_view(&mut self, row: ReqRow) -> ReqView<'_> {
        ReqView {
            tokens: &self.tokens,
            extra_key: self.extra_key.as_deref(),
            row,
            committed_len: self.committed_len,
            priority: self.priority,
            state: &mut self.prefix,
        }
    }

    /// Tokens the next prefill must compute (everything without KV).
    pub fn extend_input_len(&self) -> usize {
        self.tokens.len() - self.committed_len
    }
}
