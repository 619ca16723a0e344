//! CUDA graphs for decode, as SGLang's `CudaGraphRunner` (`model_executor/cuda_graph_runner.py`):
//! the decode forward is captured once per batch size of [`capture_bs`] (largest first), and a
//! decode batch of `bs` requests is padded to the next captured size and replayed, its launches
//! issued as one graph instead of one by one.
//!
//! The forward is any closure over the backend (the model's decode pass: embedding, layers,
//! logits). Capture-safety is enforced, not assumed: inside the capture the device refuses
//! allocations, host copies and reads ([`Device::begin_capture`]); the backend serves its
//! buffers from the batch size's [`pool::GraphPool`] (allocated by a warmup forward), its
//! uploads (page table, write list, rotary table, ids) become static inputs refilled before
//! each replay, and before each replay the forward's launches are checked to equal the
//! captured ones. Padded requests hold one position at [`Slot::PADDING`] (SGLang's padding
//! slot 0, never allocated), and their token id is 0.
//!
//! Differences from eager, by design: the split-KV plan is made for
//! [`CudaGraphConfig::max_context_len`] (the grid is fixed), GEMMs take the tiled kernel, and a
//! batch's longest request may not exceed `max_context_len`.

pub mod pool;
mod routing;

use std::collections::BTreeMap;

use attention::{AttentionError, Backend, BatchMetadata, RequestKv, Result};
use kv_pool::Slot;

use crate::backend::CudaBackend;
use crate::device::Device;
use crate::plan::PLAN_HEADER;
use crate::tensor::CudaTensor;
use pool::{GraphPool, Phase};

/// SGLang's flags for CUDA graphs, and what the pools are sized for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaGraphConfig {
    /// `--cuda-graph-max-bs`: the largest batch size captured (`None`: SGLang's list up to
    /// 160).
    pub cuda_graph_max_bs: Option<usize>,
    /// `--max-running-requests` (the request table's size): no larger batch is captured.
    pub max_running_requests: usize,
    /// The longest request (positions) a replayed batch may hold: sizes the page table and
    /// the split-KV plan.
    pub max_context_len: usize,
    /// The KV store's page size.
    pub page_size: u32,
}

/// SGLang's `get_batch_sizes_to_capture` (no speculative decoding, padding on): 1, 2, 4, 8,
/// then 16 to 160 by 8; with `cuda_graph_max_bs` only sizes up to it, extended from the largest
/// by steps of 16 up to it (so a bound off that grid is not itself captured, as in SGLang); never more than `max_running_requests` (which is added when the list would
/// pass it). Sorted, without repeats. SGLang also extends the list to 256 on GPUs with more
/// than 96 GB; here `cuda_graph_max_bs` does that.
pub fn capture_bs(cuda_graph_max_bs: Option<usize>, max_running_requests: usize) -> Vec<usize> {
    let mut bs: Vec<usize> = [1, 2, 4, 8]
        .into_iter()
        .chain((16..=160).step_by(8))
        .collect();
    let req_pool = max_running_requests;
    if bs.iter().max().is_some_and(|&m| m > req_pool) {
        bs.extend([req_pool.saturating_sub(1), req_pool]);
    }
    if let Some(max) = cuda_graph_max_bs {
        bs.retain(|&b| b <= max);
        let top = bs.iter().copied().max().unwrap_or(0);
        if top < max {
            bs.extend((top.max(1)..=max).step_by(16));
        }
    }
    bs.retain(|&b| b > 0 && b <= req_pool);
    bs.sort_unstable();
    bs.dedup();
    bs
}

/// The decode forward a runner captures: `(backend, batch, input_ids) → output`, whose first
/// dimension is the batch's requests.
pub type DecodeForward<'a, D> =
    dyn FnMut(&CudaBackend<D>, &BatchMetadata, &[u32]) -> Result<CudaTensor<D>> + Send + 'a;

/// A pass's pool and the forward's result (see `CudaGraphRunner::pass`).
type PassResult<D> = (GraphPool<<D as Device>::Buffer>, Result<CudaTensor<D>>);

/// One captured batch size.
struct Captured<D: Device> {
    graph: D::Graph,
    pool: GraphPool<D::Buffer>,
}

/// Captured decode graphs and their replay (see the [module docs](self)). The forward is
/// borrowed for `'a`: whatever it reads (weights, the KV store) outlives the graphs, which
/// hold those buffers' addresses.
pub struct CudaGraphRunner<'a, D: Device> {
    backend: CudaBackend<D>,
    forward: Box<DecodeForward<'a, D>>,
    config: CudaGraphConfig,
    graphs: BTreeMap<usize, Captured<D>>,
}

impl<D: Device> std::fmt::Debug for CudaGraphRunner<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraphRunner")
            .field("config", &self.config)
            .field("captured", &self.captured_bs())
            .finish_non_exhaustive()
    }
}

impl<'a, D: Device> CudaGraphRunner<'a, D> {
    /// Captures `forward` for every size of [`capture_bs`], largest first (SGLang's order),
    /// each after a warmup forward of a padding batch (which writes only the padding slot).
    /// A forward that is not capture-safe fails here with the device's or the pool's error.
    pub fn new(
        backend: &CudaBackend<D>,
        config: CudaGraphConfig,
        forward: Box<DecodeForward<'a, D>>,
    ) -> Result<Self> {
        let mut runner = CudaGraphRunner {
            backend: backend.clone(),
            forward,
            config,
            graphs: BTreeMap::new(),
        };
        for bs in capture_bs(
            runner.config.cuda_graph_max_bs,
            runner.config.max_running_requests,
        )
        .into_iter()
        .rev()
        {
            let captured = runner.capture(bs)?;
            runner.graphs.insert(bs, captured);
        }
        Ok(runner)
    }

    /// The captured batch sizes, ascending.
    pub fn captured_bs(&self) -> Vec<usize> {
        self.graphs.keys().copied().collect()
    }

    /// The captured size a batch of `bs` requests is padded to (SGLang's bisect), or `None`
    /// when it is larger than every captured size (it then runs eagerly).
    pub fn padded_bs(&self, bs: usize) -> Option<usize> {
        self.graphs.range(bs.max(1)..).next().map(|(&b, _)| b)
    }

    /// `(launches, static buffers)` of the graph captured for `bs`.
    pub fn graph_size(&self, bs: usize) -> Option<(usize, usize)> {
        self.graphs
            .get(&bs)
            .map(|c| (c.pool.launches(), c.pool.buffers()))
    }

    fn pool_bytes(&self, bs: usize) -> usize {
        let pages = self
            .config
            .max_context_len
            .div_ceil(self.config.page_size.max(1) as usize);
        (PLAN_HEADER + 2 * bs + (bs + 1) + bs * pages) * 4
    }

    /// Runs the forward with `pool` installed in phase `phase`. `Err`: the pool could not be
    /// installed or taken back (lost with its graph); otherwise the pool and the forward's
    /// result.
    fn pass(
        &mut self,
        mut pool: GraphPool<D::Buffer>,
        phase: Phase,
        meta: &BatchMetadata,
        ids: &[u32],
    ) -> Result<PassResult<D>> {
        pool.start(phase);
        self.backend.install_graph_pool(pool)?;
        let out = (self.forward)(&self.backend, meta, ids);
        let pool = self.backend.take_graph_pool().ok_or_else(|| {
            AttentionError::Device("CUDA graph: the pool was taken during the forward".into())
        })?;
        let out = out.and_then(|t| pool.finish().map(|()| t));
        Ok((pool, out))
    }

    fn capture(&mut self, bs: usize) -> Result<Captured<D>> {
        let slots = [Slot::PADDING];
        let kvs = vec![
            RequestKv {
                slots: &slots,
                extend_len: 1,
            };
            bs
        ];
        let meta = BatchMetadata::new_decode(self.config.page_size, &kvs)?;
        let ids = vec![0u32; bs];
        let pool = GraphPool::new(self.pool_bytes(bs), self.config.max_context_len);
        let (pool, warm) = self.pass(pool, Phase::Warmup, &meta, &ids)?;
        drop(warm?);
        self.backend.device().begin_capture()?;
        let pass = self.pass(pool, Phase::Capture, &meta, &ids);
        let graph = self.backend.device().end_capture();
        let (pool, out) = pass?;
        drop(out?);
        Ok(Captured {
            graph: graph?,
            pool,
        })
    }

    /// The decode forward of `requests` (one new token each, `input_ids[r]`) by replaying the
    /// graph of the next captured size, the batch padded with padding requests; returns the
    /// output's rows of the real requests, as f32. `Ok(None)`: no captured size fits (run the
    /// forward eagerly).
    pub fn replay(
        &mut self,
        requests: &[RequestKv<'_>],
        input_ids: &[u32],
    ) -> Result<Option<Vec<f32>>> {
        let bs = requests.len();
        let Some(padded) = self.padded_bs(bs) else {
            return Ok(None);
        };
        if input_ids.len() != bs {
            return Err(AttentionError::LengthMismatch {
                what: "input_ids",
                expected: bs,
                got: input_ids.len(),
            });
        }
        let padding = [Slot::PADDING];
        let mut kvs = requests.to_vec();
        kvs.resize(
            padded,
            RequestKv {
                slots: &padding,
                extend_len: 1,
            },
        );
        let meta = BatchMetadata::new_decode(self.config.page_size, &kvs)?;
        let mut ids = input_ids.to_vec();
        ids.resize(padded, 0);
        let Some(captured) = self.graphs.remove(&padded) else {
            return Ok(None);
        };
        let (pool, out) = self.pass(captured.pool, Phase::Feed, &meta, &ids)?;
        let graph = captured.graph;
        let result = out.and_then(|out| {
            // SAFETY: the graph's launches were checked by the feed pass to be the captured
            // ones; their buffers are the pool's (owned by `pool`, alive until it is put back
            // below) or buffers the forward borrows for 'a (weights, the KV store), which
            // outlive `self`. Inside the forward's passes the backend refuses to create a KV
            // store and the device refuses allocations while capturing, so no buffer a launch
            // names was made and dropped by the forward itself.
            unsafe { self.backend.device().replay(&graph) }?;
            let rows = out.shape.first().copied().unwrap_or(0);
            let all = self.backend.download(&out)?;
            let per_row = all.len().checked_div(rows).unwrap_or(0);
            Ok(all[..bs.min(rows) * per_row].to_vec())
        });
        self.graphs.insert(padded, Captured { graph, pool });
        result.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_bs_follows_sglang() {
        let default = capture_bs(None, 4096);
        assert_eq!(&default[..6], &[1, 2, 4, 8, 16, 24]);
        assert_eq!(default.last(), Some(&160));
        assert_eq!(default.len(), 4 + 19);
        assert_eq!(capture_bs(Some(8), 4096), vec![1, 2, 4, 8]);
        assert_eq!(capture_bs(Some(20), 4096), vec![1, 2, 4, 8, 16]);
        // Past SGLang's 160: steps of 16 from the largest kept size, up to the bound.
        let big = capture_bs(Some(200), 4096);
        assert_eq!(&big[big.len() - 3..], &[160, 176, 192]);
        assert_eq!(capture_bs(Some(4), 8), vec![1, 2, 4]);
        // A small request table caps the list and is itself captured.
        assert_eq!(capture_bs(None, 6), vec![1, 2, 4, 5, 6]);
        assert_eq!(capture_bs(Some(3), 2), vec![1, 2]);
    }
}
