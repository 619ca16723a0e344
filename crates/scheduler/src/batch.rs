//! What the scheduler hands an executor: one forward pass ([`ForwardBatch`]), and the
//! [`Executor`] trait that runs it.

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

/// One forward pass. Requests are in order; per request `i` its new tokens are
/// `input_ids[start_i..start_i + extend_lens[i]]` at positions `prefix_lens[i]..seq_lens[i]`,
/// and their KV goes to `out_cache_loc` at the same offsets. A request's earlier positions are
/// read from its row of the request-to-token table (what attention backends turn into page
/// tables).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardBatch {
    /// Extend, decode or mixed.
    pub mode: ForwardMode,
    /// The requests.
    pub reqs: Vec<ReqId>,
    /// Their rows.
    pub rows: Vec<ReqRow>,
    /// New tokens, concatenated.
    pub input_ids: Vec<u32>,
    /// Position of each new token.
    pub positions: Vec<u32>,
    /// Length after the pass.
    pub seq_lens: Vec<usize>,
    /// Positions with KV before the pass.
    pub prefix_lens: Vec<usize>,
    /// New tokens per request.
    pub extend_lens: Vec<usize>,
    /// Slot of each new token.
    pub out_cache_loc: Vec<Slot>,
    /// Whether each request samples a token (false for a middle prefill chunk).
    pub sample: Vec<bool>,
}

impl ForwardBatch {
    /// An empty batch of `mode`.
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
        }
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// New tokens in the batch.
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

/// What a forward pass produced.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// One next token per request (ignored where the batch says not to sample).
    pub next_tokens: Vec<u32>,
    /// Time the pass took (measured, or charged by a cost model); 0 if unknown.
    pub elapsed_s: f64,
}

/// Runs forward passes: the model runner, a fake in tests, a cost-model simulator.
pub trait Executor {
    /// Runs `batch`; `rows` gives each request's slots for all its positions.
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        rows: &ReqToTokenPool,
    ) -> Result<ForwardOutput, String>;
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
    /// The next token after `token` at `position`.
    pub fn next_token(&self, token: u32, position: u32) -> u32 {
        let mut z = self.seed ^ ((token as u64) << 32) ^ position as u64;
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % self.vocab as u64) as u32
    }
}

impl Executor for FakeExecutor {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        _rows: &ReqToTokenPool,
    ) -> Result<ForwardOutput, String> {
        let mut start = 0;
        let mut next_tokens = Vec::with_capacity(batch.len());
        for &n in &batch.extend_lens {
            let last = start + n - 1;
            next_tokens.push(self.next_token(batch.input_ids[last], batch.positions[last]));
            start += n;
        }
        Ok(ForwardOutput {
            next_tokens,
            elapsed_s: 0.0,
        })
    }
}
