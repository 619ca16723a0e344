//! What the scheduler hands an executor: one forward pass ([`ForwardBatch`]), and the
//! [`Executor`] trait that runs it.

use kv_pool::rng::{mix64, GOLDEN_GAMMA};
use kv_pool::{ReqRow, ReqToTokenPool, Slot};

use crate::ReqId;

/// The kind of forward pass (SGLang's `ForwardMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardMode {
    /// Prefill / extend: several new tokens per request.
    Extend,
    /// One new token per request.
    Decode,
    /// Extend requests followed by decode requests in one pass (`--enable-mixed-chunk`).
    Mixed,
}

/// One forward pass (SGLang's `ForwardBatch`, built from its `ScheduleBatch` through a
/// `ModelWorkerBatch`). Requests are in order; per request `i` its new tokens are
/// `input_ids[start_i..start_i + extend_lens[i]]` at positions `prefix_lens[i]..seq_lens[i]`,
/// and their KV goes to `out_cache_loc` at the same offsets. A request's earlier positions are
/// read from its row of the request-to-token table (what attention backends turn into page
/// tables).
#[doc(alias = "ScheduleBatch")]
#[doc(alias = "ModelWorkerBatch")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardBatch {
    /// Extend, decode or mixed (extend requests first, then one decode token per running
    /// request).
    pub mode: ForwardMode,
    /// The requests, in pass order.
    pub reqs: Vec<ReqId>,
    /// Each request's row of the request-to-token table (`req_pool_indices`).
    pub rows: Vec<ReqRow>,
    /// New tokens of all requests, concatenated in pass order.
    pub input_ids: Vec<u32>,
    /// Position of each new token in its request (parallel to `input_ids`).
    pub positions: Vec<u32>,
    /// Each request's length after the pass (`prefix_lens + extend_lens`).
    pub seq_lens: Vec<usize>,
    /// Each request's positions with KV before the pass.
    pub prefix_lens: Vec<usize>,
    /// Each request's new tokens in the pass (1 for decode).
    pub extend_lens: Vec<usize>,
    /// The pool slot each new token's KV is written to (parallel to `input_ids`).
    pub out_cache_loc: Vec<Slot>,
    /// Whether each request samples a token (false for a middle prefill chunk).
    pub sample: Vec<bool>,
    /// HiCache: tokens loaded back from the host tier into device slots for this pass (the
    /// host → device copies its admissions started; SGLang's `init_load_back`). 0 without a
    /// host tier. A cost model charges their bytes at the host link's bandwidth.
    pub load_back_tokens: usize,
    /// HiCache: tokens prefetched from L3 storage into the host tier for requests since the
    /// previous pass (the prefetches that stopped in this pass's admission scan). 0 without
    /// storage. A cost model charges their bytes at the storage bandwidth.
    pub prefetch_tokens: usize,
}

impl ForwardBatch {
    /// An empty batch of `mode`; the scheduler fills it request by request.
    pub fn new(mode: ForwardMode) -> Self {
        ForwardBatch {
            mode,
            reqs: Vec::new(),
            rows: Vec::new(),
            input_ids: Vec::new(),
            positions: Vec::new(),
            seq_lens: Vec::new(),
            prefix_lens: Vec::new(),
            extend_lens: Vec::new(),
            out_cache_loc: Vec::new(),
            sample: Vec::new(),
            load_back_tokens: 0,
            prefetch_tokens: 0,
        }
    }

    /// Number of requests in the batch (not tokens: see [`num_tokens`](Self::num_tokens)).
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether the batch has no request.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// New tokens in the batch, all requests together.
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Appends one request's part of the pass.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &mut self,
        id: ReqId,
        row: ReqRow,
        prefix_len: usize,
        tokens: &[u32],
        slots: &[Slot],
        sample: bool,
    ) {
        debug_assert_eq!(tokens.len(), slots.len());
        self.reqs.push(id);
        self.rows.push(row);
        self.input_ids.extend_from_slice(tokens);
        self.positions
            .extend((prefix_len..prefix_len + tokens.len()).map(|p| p as u32));
        self.seq_lens.push(prefix_len + tokens.len());
        self.prefix_lens.push(prefix_len);
        self.extend_lens.push(tokens.len());
        self.out_cache_loc.extend_from_slice(slots);
        self.sample.push(sample);
    }
}

/// What an executor's forward pass gives back to the scheduler: the sampled tokens and the
/// time the pass took. (The model's own output, logits, is `model::LogitsOutput`; the engine's
/// executor samples from it.)
#[doc(alias = "GenerationBatchResult")]
#[derive(Debug, Clone, PartialEq)]
pub struct BatchResult {
    /// One next token per request (ignored where the batch says not to sample, and for the
    /// requests in `failed`).
    pub next_tokens: Vec<u32>,
    /// Time the pass took (measured, or charged by a cost model); 0 if unknown.
    pub elapsed_s: f64,
    /// The requests of the batch whose pass ran but gave no usable next token (logits that are
    /// not finite, for example), or, for a middle chunk, no usable KV: the scheduler aborts
    /// each of them alone, with its message, before the pass's positions are committed or
    /// cached, and the rest of the batch goes on. At most one entry per request.
    pub failed: Vec<RequestFailure>,
}

/// One request of a batch that its pass could not serve (see [`BatchResult::failed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFailure {
    /// The request's index in the batch.
    pub index: usize,
    /// Why (the request's abort message says it).
    pub message: String,
}

/// Runs forward passes: the model runner, a fake in tests, a cost-model simulator.
pub trait Executor {
    /// Runs `batch`; `rows` gives each request's slots for all its positions.
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        rows: &ReqToTokenPool,
    ) -> Result<BatchResult, String>;
}

/// A deterministic fake model: the next token is a fixed function of the request's token at
/// the last position and that position (so outputs depend on history, not on batching, chunking
/// or cache hits). Token `eos` (if any) comes out with probability about `1 / vocab`.
#[derive(Debug, Clone)]
pub struct FakeExecutor {
    /// Vocabulary size (tokens are `0..vocab`).
    pub vocab: u32,
    /// Seed mixed into every token.
    pub seed: u64,
}

impl FakeExecutor {
    /// The next token after `token` at `position`: `mix64(seed ^ token << 32 ^ position +
    /// GOLDEN_GAMMA) % vocab` (one SplitMix64 step keyed by the pair).
    pub fn next_token(&self, token: u32, position: u32) -> u32 {
        let key = self.seed ^ ((token as u64) << 32) ^ position as u64;
        (mix64(key.wrapping_add(GOLDEN_GAMMA)) % self.vocab as u64) as u32
    }
}

impl Executor for FakeExecutor {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        _rows: &ReqToTokenPool,
    ) -> Result<BatchResult, String> {
        let mut start = 0;
        let mut next_tokens = Vec::with_capacity(batch.len());
        for &n in &batch.extend_lens {
            let last = start + n - 1;
            next_tokens.push(self.next_token(batch.input_ids[last], batch.positions[last]));
            start += n;
        }
        Ok(BatchResult {
            next_tokens,
            elapsed_s: 0.0,
            failed: Vec::new(),
        })
    }
}
