//! The seam through which a backend runs decode batches some other way than one eager forward
//! (CUDA graphs: SGLang's `CudaGraphRunner`). The model runner owns the decode forward (its
//! model and KV store); a [`DecodeGraphs`] implementation owns what it captured and decides,
//! per batch, whether it can run it. Backends without graphs implement nothing: the runner
//! has no `DecodeGraphs` and runs every pass eagerly.

use crate::backend::Backend;
use crate::error::Result;
use crate::metadata::{BatchMetadata, RequestKv};

/// The decode forward a [`DecodeGraphs`] captures and replays: `(backend, batch, input_ids)`
/// → the logits, one row per request of the batch (embedding, every layer, the LM head).
/// It must read nothing back to the host and make the same launches for the same batch
/// size, whatever the requests hold (what a capture checks).
pub type DecodeForward<'a, B> =
    dyn FnMut(&B, &BatchMetadata, &[u32]) -> Result<<B as Backend>::Tensor> + 'a;

/// Runs decode batches through captured graphs (see the [module docs](self)).
pub trait DecodeGraphs<B: Backend>: Send {
    /// Captures `forward` for every batch size this runner serves (at start-up, as SGLang).
    /// A forward that is not capture-safe fails with the device's error; the runner then
    /// has no graphs and must not be used.
    fn capture(&mut self, forward: &mut DecodeForward<'_, B>) -> Result<()>;

    /// The decode forward of `requests` (one new token each, `input_ids[r]`) through a graph:
    /// the logits rows of the real requests, row-major. `Ok(None)`: this batch runs eagerly
    /// (larger than every captured size, a request longer than the graphs' context).
    /// `forward` must be the one [`capture`](DecodeGraphs::capture) was given, over the same
    /// weights and KV store.
    fn replay(
        &mut self,
        requests: &[RequestKv<'_>],
        input_ids: &[u32],
        forward: &mut DecodeForward<'_, B>,
    ) -> Result<Option<Vec<f32>>>;

    /// The captured batch sizes, ascending (for `kvserve info` and the server's report).
    fn captured_bs(&self) -> Vec<usize>;

    /// Bytes of device memory the captured graphs hold (for the start-up log).
    fn memory_bytes(&self) -> usize;
}
