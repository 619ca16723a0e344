//! The [`ModelRunner`]: a backend, a model and the paged KV store, running one forward pass
//! per scheduler batch: eagerly, or, for decode batches on a backend that captured the
//! decode forward ([`ModelRunner::enable_decode_graphs`]: CUDA graphs), by replaying it.

use std::fmt;
use std::ops::Range;

use attention::{AttentionError, Backend, BatchMetadata, DecodeForward, DecodeGraphs, RequestKv};
use kv_pool::{KvLayout, KvStore, LayerWait, Slot};

use crate::decoder::Model;
use crate::error::{ModelError, Result};
use crate::llama::LogitsMode;

/// Which attention plan a pass builds: the extend plan (any number of new tokens per request)
/// or the decode plan (one query per request, split over the KV). This is the part of the
/// scheduler's `ForwardMode` the model needs: the engine maps the scheduler's `Decode` to
/// `Decode` and `Extend` and `Mixed` to `Extend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionMode {
    /// Any number of new tokens per request (SGLang's `EXTEND` and `MIXED`).
    #[default]
    Extend,
    /// Exactly one new token per request (SGLang's `DECODE`).
    Decode,
}

/// One request of a batch: its new tokens and the slots of all its KV positions.
///
/// The engine builds it from the scheduler's `ForwardBatch`: `input_ids` is the request's
/// `extend_lens[r]` ids from `input_ids`, `slots` is `req_to_token[rows[r], 0..seq_lens[r]]`
/// (the cached prefix's slots, then the request's part of `out_cache_loc`). The token
/// positions are implied: the new tokens sit at `prefix_len .. seq_len` with
/// `prefix_len = slots.len() − input_ids.len()` (the scheduler's `positions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardRequest<'a> {
    /// New token ids (`1..=slots.len()` of them; exactly 1 in a decode batch).
    pub input_ids: &'a [u32],
    /// Slots of positions `0..seq_len`; the last `input_ids.len()` receive the new K/V.
    pub slots: &'a [Slot],
}

/// The input of one forward pass: a plain struct the engine fills from the scheduler's batch.
#[derive(Clone, Default)]
pub struct ForwardInput<'a> {
    /// Extend or decode.
    pub mode: AttentionMode,
    /// The requests, in batch order.
    pub requests: Vec<ForwardRequest<'a>>,
    /// Which rows get logits.
    pub logits: LogitsMode,
    /// What the pass waits on before reading each layer's KV while HiCache load-backs land
    /// (SGLang's `LayerDoneCounter`): `wait_layer(i)` before layer `i`; `None` without a host
    /// tier. An `Err` fails the pass with [`ModelError::LayerWait`].
    pub layer_wait: Option<&'a dyn LayerWait>,
}

impl fmt::Debug for ForwardInput<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForwardInput")
            .field("mode", &self.mode)
            .field("requests", &self.requests)
            .field("logits", &self.logits)
            .field("layer_wait", &self.layer_wait.map(|_| "gate"))
            .finish()
    }
}

/// Logits of a forward pass: `[rows, vocab]` row-major, with each request's rows. The engine's
/// executor samples from it and hands the scheduler a `scheduler::BatchResult`.
#[doc(alias = "LogitsProcessorOutput")]
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LogitsOutput {
    /// Vocabulary size (row length).
    pub vocab_size: usize,
    /// All logit rows, row-major.
    pub logits: Vec<f32>,
    /// Per request, its rows of `logits` (one row in [`LogitsMode::LastToken`], its new
    /// tokens in [`LogitsMode::AllTokens`], none in [`LogitsMode::None`]).
    pub rows: Vec<Range<usize>>,
}

impl LogitsOutput {
    /// Logits of row `row` (`vocab_size` values). Panics if `row` is out of range.
    pub fn row(&self, row: usize) -> &[f32] {
        &self.logits[row * self.vocab_size..(row + 1) * self.vocab_size]
    }

    /// Logits of request `r`'s last row, if it has one.
    pub fn last(&self, r: usize) -> Option<&[f32]> {
        let rows = self.rows.get(r)?;
        (!rows.is_empty()).then(|| self.row(rows.end - 1))
    }

    /// The greedy (argmax, lowest index on ties) next token of every request with logits.
    pub fn argmax(&self) -> Vec<Option<u32>> {
        (0..self.rows.len())
            .map(|r| self.last(r).map(crate::sampling::argmax))
            .collect()
    }
}

/// Owns a backend, a model ([`Model`]: Llama family or MLA) on it and the paged KV store it
/// attends over; and, on a backend with graphs, the captured decode forward
/// ([`DecodeGraphs`], SGLang's `CudaGraphRunner` in its `ModelRunner`).
pub struct ModelRunner<B: Backend> {
    backend: B,
    model: Model<B>,
    store: B::KvStore,
    graphs: Option<Box<dyn DecodeGraphs<B>>>,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner with a new zeroed KV store of `layout`, which must match the model: an MHA
    /// layout (KV heads, head dim) for the Llama family, an MLA layout (`kv_lora_rank`,
    /// `qk_rope_head_dim`) for DeepSeek-V2, and the model's layer count.
    pub fn new(backend: B, model: impl Into<Model<B>>, layout: KvLayout) -> Result<Self> {
        let model = model.into();
        Self::check_layout(&model, &layout)?;
        let store = backend.new_kv_store(layout)?;
        Self::with_kv_store(backend, model, store)
    }

    /// A runner over a KV store the caller made (a host store in shared memory, for PD
    /// disaggregation's `shm` transfer); its layout must match the model as for [`Self::new`].
    pub fn with_kv_store(
        backend: B,
        model: impl Into<Model<B>>,
        store: B::KvStore,
    ) -> Result<Self> {
        let model = model.into();
        Self::check_layout(&model, store.layout())?;
        Ok(ModelRunner {
            backend,
            model,
            store,
            graphs: None,
        })
    }

    /// Captures the model's decode forward with `graphs` (every batch size it serves, now,
    /// as SGLang does at start-up); from then on [`forward`](Self::forward) replays the decode
    /// batches `graphs` can run and runs the rest eagerly. A forward that cannot be captured
    /// (one that reads back to the host, as the MLA decoder's concatenation and MoE routing
    /// do on a backend whose `concat_last` / `fused_moe` run through the host) is the
    /// backend's typed error, and the runner stays eager.
    pub fn enable_decode_graphs(&mut self, mut graphs: Box<dyn DecodeGraphs<B>>) -> Result<()> {
        let pass = Pass {
            model: &self.model,
            store: &mut self.store,
            layer_wait: None,
        };
        pass.lend(|forward| graphs.capture(forward))?;
        self.graphs = Some(graphs);
        Ok(())
    }

    /// The captured decode forward, if [`enable_decode_graphs`](Self::enable_decode_graphs)
    /// succeeded.
    pub fn decode_graphs(&self) -> Option<&dyn DecodeGraphs<B>> {
        self.graphs.as_deref()
    }

    /// Refuses a layout whose kind or layer count is not the model's.
    fn check_layout(model: &Model<B>, layout: &KvLayout) -> Result<()> {
        let c = model.config();
        let want = model.kv_kind();
        if layout.shape.kind != want || layout.shape.layers as usize != c.num_hidden_layers {
            return Err(ModelError::ConfigField {
                field: "kv layout".into(),
                reason: format!(
                    "{:?} × {} layers does not match the model ({want:?} × {} layers)",
                    layout.shape.kind, layout.shape.layers, c.num_hidden_layers
                ),
            });
        }
        Ok(())
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The model.
    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    /// The KV store.
    pub fn kv_store(&self) -> &B::KvStore {
        &self.store
    }

    /// The KV store, mutably (the engine copies or offloads pages through it).
    pub fn kv_store_mut(&mut self) -> &mut B::KvStore {
        &mut self.store
    }

    /// Runs one forward pass: writes every layer's K/V for the new tokens at their slots and
    /// returns the requested logits. Inconsistent input is a typed error before any KV write.
    pub fn forward(&mut self, input: &ForwardInput<'_>) -> Result<LogitsOutput> {
        let vocab = self.model.config().vocab_size;
        if input.requests.is_empty() {
            return Ok(LogitsOutput {
                vocab_size: vocab,
                ..Default::default()
            });
        }
        let mut kvs = Vec::with_capacity(input.requests.len());
        let mut ids = Vec::new();
        for (r, req) in input.requests.iter().enumerate() {
            let (n, kv) = (req.input_ids.len(), req.slots.len());
            if n == 0 || n > kv {
                return Err(ModelError::InvalidInput {
                    request: r,
                    reason: format!("{n} new tokens for {kv} slots (need 1..=slots)"),
                });
            }
            if let Some(&bad) = req.input_ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::InvalidInput {
                    request: r,
                    reason: format!("token id {bad} is outside the vocabulary ({vocab})"),
                });
            }
            ids.extend_from_slice(req.input_ids);
            kvs.push(RequestKv {
                slots: req.slots,
                extend_len: n,
            });
        }
        let page_size = self.store.layout().page_size;
        let meta = match input.mode {
            AttentionMode::Extend => BatchMetadata::new(page_size, &kvs),
            AttentionMode::Decode => BatchMetadata::new_decode(page_size, &kvs),
        }
        .map_err(|e| match e {
            attention::AttentionError::InvalidRequest { request, reason } => {
                ModelError::InvalidInput { request, reason }
            }
            e => e.into(),
        })?;
        let nreq = meta.num_requests();
        if input.mode == AttentionMode::Decode && input.logits != LogitsMode::None {
            if let Some(logits) = self.replay_decode(&kvs, &ids, input.layer_wait)? {
                return Ok(LogitsOutput {
                    vocab_size: vocab,
                    logits,
                    rows: (0..nreq).map(|r| r..r + 1).collect(),
                });
            }
        }
        let (rows, sel): (Vec<Range<usize>>, Option<Vec<u32>>) = match input.logits {
            // One new token per request (a decode batch): its rows are the requests.
            LogitsMode::LastToken if meta.num_tokens() == nreq => {
                ((0..nreq).map(|r| r..r + 1).collect(), None)
            }
            LogitsMode::LastToken => (
                (0..nreq).map(|r| r..r + 1).collect(),
                Some(
                    (0..nreq)
                        .map(|r| (meta.qo_range(r).end - 1) as u32)
                        .collect(),
                ),
            ),
            LogitsMode::AllTokens => ((0..nreq).map(|r| meta.qo_range(r)).collect(), None),
            LogitsMode::None => {
                Pass {
                    model: &self.model,
                    store: &mut self.store,
                    layer_wait: input.layer_wait,
                }
                .layers(&self.backend, &meta, &ids)?;
                return Ok(LogitsOutput {
                    vocab_size: vocab,
                    logits: Vec::new(),
                    rows: vec![0..0; nreq],
                });
            }
        };
        let b = &self.backend;
        let x = Pass {
            model: &self.model,
            store: &mut self.store,
            layer_wait: input.layer_wait,
        }
        .layers(b, &meta, &ids)?;
        let logits = self.model.logits(b, &x, sel.as_deref())?;
        Ok(LogitsOutput {
            vocab_size: vocab,
            logits: b.download(&logits)?,
            rows,
        })
    }

    /// The decode batch `kvs` through the captured graphs: its logits rows, or `None` when
    /// there are none or they leave this batch to the eager forward.
    fn replay_decode(
        &mut self,
        kvs: &[RequestKv<'_>],
        ids: &[u32],
        layer_wait: Option<&dyn LayerWait>,
    ) -> Result<Option<Vec<f32>>> {
        let Some(graphs) = self.graphs.as_mut() else {
            return Ok(None);
        };
        let pass = Pass {
            model: &self.model,
            store: &mut self.store,
            layer_wait,
        };
        pass.lend(|forward| graphs.replay(kvs, ids, forward))
    }
}

/// What one forward pass runs over: the model, the KV store it writes, and what it waits on
/// before each layer.
struct Pass<'a, B: Backend> {
    model: &'a Model<B>,
    store: &'a mut B::KvStore,
    layer_wait: Option<&'a dyn LayerWait>,
}

impl<B: Backend> Pass<'_, B> {
    /// Embedding and every layer of `meta`'s batch (waiting on `layer_wait` before each
    /// layer): the final hidden state, one row per token.
    fn layers(&mut self, b: &B, meta: &BatchMetadata, ids: &[u32]) -> Result<B::Tensor> {
        let positions = meta.positions();
        let plan = b.plan(meta)?;
        let mut x = self.model.embed(b, ids)?;
        for layer in 0..self.model.num_layers() {
            if let Some(gate) = self.layer_wait {
                gate.wait_layer(layer)
                    .map_err(|reason| ModelError::LayerWait { layer, reason })?;
            }
            self.model
                .layer_forward(b, layer, &plan, self.store, &mut x, &positions)?;
        }
        Ok(x)
    }

    /// The decode forward [`DecodeGraphs`] captures: [`layers`](Self::layers) and the logits
    /// of every row (one per request), as the eager decode pass computes them.
    fn decode(&mut self, b: &B, meta: &BatchMetadata, ids: &[u32]) -> Result<B::Tensor> {
        let x = self.layers(b, meta, ids)?;
        self.model.logits(b, &x, None)
    }

    /// Lends the decode forward to `call` (a [`DecodeGraphs`] method); a model error inside it
    /// comes back as itself, not as the attention error it stood in as.
    fn lend<T>(
        mut self,
        call: impl FnOnce(&mut DecodeForward<'_, B>) -> attention::Result<T>,
    ) -> Result<T> {
        let mut failed = None;
        let result = call(&mut |b: &B, meta: &BatchMetadata, ids: &[u32]| {
            self.decode(b, meta, ids).map_err(|e| keep(&mut failed, e))
        });
        restore(result, failed)
    }
}

/// A model error inside a forward lent to [`DecodeGraphs`] (which speaks
/// [`AttentionError`]): an attention error passes through; any other is kept in `failed` for
/// [`restore`] and stands in as a device error.
fn keep(failed: &mut Option<ModelError>, e: ModelError) -> AttentionError {
    match e {
        ModelError::Attention(e) => e,
        e => {
            let stand_in = AttentionError::Device(e.to_string());
            *failed = Some(e);
            stand_in
        }
    }
}

/// The result of a [`DecodeGraphs`] call, its error the model error [`keep`] kept if any.
fn restore<T>(r: attention::Result<T>, failed: Option<ModelError>) -> Result<T> {
    r.map_err(|e| failed.unwrap_or(e.into()))
}
