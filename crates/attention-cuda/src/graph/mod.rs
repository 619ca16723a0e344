//! CUDA graphs for decode, as SGLang's `CudaGraphRunner` (`model_executor/cuda_graph_runner.py`):
//! the decode forward is captured once per batch size of [`capture_bs`] (largest first), and a
//! decode batch of `bs` requests is padded to the next captured size and replayed, its launches
//! issued as one graph instead of one by one.
//!
//! The forward is any closure over the backend (the model's decode pass: embedding, layers,
//! logits), lent to each capture and replay through [`attention::DecodeGraphs`], the seam the
//! model runner calls: it replays decode batches that fit a captured size and a batch
//! whose requests fit [`CudaGraphConfig::max_context_len`] ([`route`]), and leaves the rest
//! (larger batches, longer requests; extend batches never reach it) to the eager forward. Capture-safety is enforced, not assumed: inside the capture the device refuses
//! allocations, host copies and reads ([`Device::begin_capture`]); the backend serves its
//! buffers from one [`pool::GraphPool`] that every captured size shares (PyTorch's graph memory
//! pool, into which SGLang captures every size, largest first; each size's warmup forward
//! takes its buffers, allocating only what the pool lacks), its uploads (page table, write
//! list, rotary table, ids) become static inputs refilled before each replay, and before each
//! replay the forward's launches are checked to equal the captured ones. Padded requests hold
//! one position at [`Slot::PADDING`] (SGLang's padding slot 0, never allocated), and their
//! token id is 0.
//!
//! Differences from eager, by design: the split-KV plan is made for
//! [`CudaGraphConfig::max_context_len`] (the grid is fixed) and GEMMs take the own kernel.
//!
//! ## Graph memory
//! Sharing is sound because replays never overlap (one stream, one replay at a time, its
//! logits read back before the next; see [`pool`] for the rules a buffer is taken by).
//! [`CudaGraphRunner::memory`] reports the pool and each size's part, and the engine logs the
//! total at start-up. Before the pool was shared, every size kept one buffer per allocation
//! of its forward. For a 7B-shaped Llama (Llama-2-7B: hidden 4096, 32 layers, 32 heads of
//! 128, intermediate 11008, vocabulary 32000; f32 activations, context 4096, page 16) at the
//! default 23 sizes (1 … 160) that was 13.54 GiB; one pool shared by every size holds
//! 57.37 MiB in 77 buffers: the largest size's forward asks for 1.28 GiB over 392
//! allocations, which the pool serves with buffers freed by the forward's dropped tensors,
//! and no smaller size adds a byte. Computed from the pool's recorded allocations on a device
//! that only counts bytes (no GPU; the figures are exact for this host logic, not a
//! measurement of a GPU's allocator):
//! `cargo test -p attention-cuda-emu --test graph_memory 7b -- --nocapture`.
//!
//! On the `rocm` backend (HipDevice) nothing is captured: it launches on the null stream,
//! where HIP graphs cannot capture, so its `begin_capture` refuses and the engine runs eager.

mod memory;
pub mod pool;
mod routing;

use std::collections::BTreeMap;

use attention::{AttentionError, Backend, BatchMetadata, DecodeGraphs, RequestKv, Result};
use kv_pool::Slot;

use crate::backend::CudaBackend;
use crate::device::Device;
use crate::plan::PLAN_HEADER;
use crate::tensor::CudaTensor;
pub use memory::{human_bytes, GraphMemory, SizeMemory};
use pool::{GraphPool, GraphTape, Phase};

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

/// The decode forward a runner captures (see [`attention::DecodeForward`]).
pub type DecodeForward<'a, D> = attention::DecodeForward<'a, CudaBackend<D>>;

/// One captured batch size: its graph, and its tape over the shared pool.
struct Captured<D: Device> {
    graph: D::Graph,
    tape: GraphTape,
}

/// How a decode batch runs (SGLang's `CudaGraphRunner.can_run` and its bisect over the
/// captured sizes), decided on the host from the batch's size and its longest request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphRoute {
    /// Replay the graph captured for `padded` requests (the batch padded up to it).
    Replay {
        /// The captured size the batch is padded to.
        padded: usize,
    },
    /// Eagerly: more requests than the largest captured size.
    TooLarge {
        /// The largest captured size.
        largest: usize,
    },
    /// Eagerly: a request holds more positions than the graphs' page table and split plan
    /// cover ([`CudaGraphConfig::max_context_len`]).
    TooLong {
        /// The longest request's positions.
        longest: usize,
        /// The graphs' context.
        max_context_len: usize,
    },
    /// Eagerly: nothing is captured (yet).
    NotCaptured,
}

impl std::fmt::Display for GraphRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GraphRoute::Replay { padded } => write!(f, "replay the graph of bs {padded}"),
            GraphRoute::TooLarge { largest } => {
                write!(f, "eager: larger than the largest captured bs {largest}")
            }
            GraphRoute::TooLong {
                longest,
                max_context_len,
            } => write!(
                f,
                "eager: a request of {longest} positions exceeds the graphs' {max_context_len}"
            ),
            GraphRoute::NotCaptured => write!(f, "eager: no graph captured"),
        }
    }
}

/// The route of a decode batch of `bs` requests whose longest holds `longest` positions, over
/// the `captured` sizes (ascending) of graphs made for `max_context_len` positions.
pub fn route(captured: &[usize], max_context_len: usize, bs: usize, longest: usize) -> GraphRoute {
    let Some(&largest) = captured.last() else {
        return GraphRoute::NotCaptured;
    };
    if longest > max_context_len {
        return GraphRoute::TooLong {
            longest,
            max_context_len,
        };
    }
    match captured.iter().find(|&&b| b >= bs.max(1)) {
        Some(&padded) => GraphRoute::Replay { padded },
        None => GraphRoute::TooLarge { largest },
    }
}

impl CudaGraphConfig {
    /// Refuses values no graph can be captured with: a `cuda_graph_max_bs` of 0 or above
    /// `max_running_requests` (no batch is that large), and zero requests, context or page
    /// size.
    pub fn check(&self) -> Result<()> {
        let bad = |field: &'static str, reason: String| {
            Err(AttentionError::InvalidConfig { field, reason })
        };
        if self.max_running_requests == 0 {
            return bad("max_running_requests", "0: must be at least 1".into());
        }
        match self.cuda_graph_max_bs {
            Some(0) => return bad("cuda_graph_max_bs", "0: must be at least 1".into()),
            Some(n) if n > self.max_running_requests => {
                return bad(
                    "cuda_graph_max_bs",
                    format!(
                        "{n} exceeds max_running_requests ({}): no batch is that large",
                        self.max_running_requests
                    ),
                )
            }
            _ => {}
        }
        if self.max_context_len == 0 {
            return bad("max_context_len", "0: must be at least 1".into());
        }
        if self.page_size == 0 {
            return bad("page_size", "0: must be at least 1".into());
        }
        Ok(())
    }
}

/// Captured decode graphs and their replay (see the [module docs](self)). The forward is
/// lent to each call ([`attention::DecodeGraphs`]): the graphs hold the addresses of the
/// buffers it reads (weights, the KV store), and each replay's feed pass checks that the
/// forward still names exactly those.
pub struct CudaGraphRunner<D: Device> {
    backend: CudaBackend<D>,
    config: CudaGraphConfig,
    graphs: BTreeMap<usize, Captured<D>>,
    /// The memory every graph's buffers lie in; replaced only with every graph dropped.
    pool: GraphPool<D::Buffer>,
}

impl<D: Device> std::fmt::Debug for CudaGraphRunner<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraphRunner")
            .field("config", &self.config)
            .field("captured", &self.captured_bs())
            .finish_non_exhaustive()
    }
}

impl<D: Device> CudaGraphRunner<D> {
    /// A runner for `config` (checked: [`CudaGraphConfig::check`]) on `backend`, with nothing
    /// captured yet ([`attention::DecodeGraphs::capture`] captures).
    pub fn new(backend: &CudaBackend<D>, config: CudaGraphConfig) -> Result<Self> {
        config.check()?;
        Ok(CudaGraphRunner {
            backend: backend.clone(),
            config,
            graphs: BTreeMap::new(),
            pool: GraphPool::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CudaGraphConfig {
        &self.config
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

    /// How a batch of `requests` runs ([`route`] over the captured sizes).
    pub fn route(&self, requests: &[RequestKv<'_>]) -> GraphRoute {
        let longest = requests.iter().map(|r| r.slots.len()).max().unwrap_or(0);
        route(
            &self.captured_bs(),
            self.config.max_context_len,
            requests.len(),
            longest,
        )
    }

    /// `(launches, allocations)` of the graph captured for `bs` (each allocation and upload
    /// of its forward is served by one buffer of the shared pool).
    pub fn graph_size(&self, bs: usize) -> Option<(usize, usize)> {
        self.graphs
            .get(&bs)
            .map(|c| (c.tape.launches(), c.tape.allocations()))
    }

    /// The device memory the graphs hold: the shared pool, and each size's part of it.
    pub fn memory(&self) -> GraphMemory {
        let device = self.backend.device();
        GraphMemory {
            pool_bytes: self.pool.bytes(device),
            pool_buffers: self.pool.buffers(),
            sizes: self
                .graphs
                .iter()
                .rev()
                .map(|(&bs, c)| SizeMemory {
                    bs,
                    launches: c.tape.launches(),
                    allocations: c.tape.allocations(),
                    requested_bytes: c.tape.requested_bytes(),
                    added_bytes: c.tape.added_bytes(),
                })
                .collect(),
        }
    }

    fn pool_bytes(&self, bs: usize) -> usize {
        let pages = self
            .config
            .max_context_len
            .div_ceil(self.config.page_size.max(1) as usize);
        (PLAN_HEADER + 2 * bs + (bs + 1) + bs * pages) * 4
    }

    /// Runs the forward with the pool installed over `tape` in phase `phase`. `Err`: the pool
    /// could not be installed (the tape is lost with its graph) or taken back (every graph is
    /// dropped, as their buffers are gone); otherwise the tape and the forward's result.
    fn pass(
        &mut self,
        tape: GraphTape,
        phase: Phase,
        meta: &BatchMetadata,
        ids: &[u32],
        forward: &mut DecodeForward<'_, D>,
    ) -> Result<(GraphTape, Result<CudaTensor<D>>)> {
        self.pool.start(phase, tape);
        self.backend.install_graph_pool(&mut self.pool)?;
        let out = forward(&self.backend, meta, ids);
        let Some(pool) = self.backend.take_graph_pool() else {
            self.graphs.clear();
            return Err(AttentionError::Device(
                "CUDA graph: the pool was taken during the forward".into(),
            ));
        };
        self.pool = pool;
        let (tape, done) = self.pool.end();
        Ok((tape, out.and_then(|t| done.map(|()| t))))
    }

    fn capture_one(
        &mut self,
        bs: usize,
        forward: &mut DecodeForward<'_, D>,
    ) -> Result<Captured<D>> {
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
        let tape = GraphTape::new(self.pool_bytes(bs), self.config.max_context_len);
        let (tape, warm) = self.pass(tape, Phase::Warmup, &meta, &ids, forward)?;
        drop(warm?);
        self.backend.device().begin_capture()?;
        let pass = self.pass(tape, Phase::Capture, &meta, &ids, forward);
        let graph = self.backend.device().end_capture();
        let (tape, out) = pass?;
        drop(out?);
        Ok(Captured {
            graph: graph?,
            tape,
        })
    }
}

impl<D: Device> DecodeGraphs<CudaBackend<D>> for CudaGraphRunner<D> {
    /// Captures `forward` for every size of [`capture_bs`] into one fresh pool, largest
    /// first (SGLang's order, so the smaller sizes find the buffers they need), each after a
    /// warmup forward of a padding batch (which writes only the padding slot). On an error
    /// nothing stays captured.
    fn capture(&mut self, forward: &mut DecodeForward<'_, D>) -> Result<()> {
        self.graphs.clear();
        self.pool = GraphPool::new();
        let sizes = capture_bs(
            self.config.cuda_graph_max_bs,
            self.config.max_running_requests,
        );
        for bs in sizes.into_iter().rev() {
            match self.capture_one(bs, forward) {
                Ok(captured) => {
                    self.graphs.insert(bs, captured);
                }
                Err(e) => {
                    self.graphs.clear();
                    self.pool = GraphPool::new();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Replays the graph of the batch's [`route`], the batch padded with padding requests
    /// (one position at [`Slot::PADDING`], token 0); `Ok(None)` for a batch that runs eagerly.
    fn replay(
        &mut self,
        requests: &[RequestKv<'_>],
        input_ids: &[u32],
        forward: &mut DecodeForward<'_, D>,
    ) -> Result<Option<Vec<f32>>> {
        let bs = requests.len();
        let GraphRoute::Replay { padded } = self.route(requests) else {
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
        let (tape, out) = self.pass(captured.tape, Phase::Feed, &meta, &ids, forward)?;
        let graph = captured.graph;
        let result = out.and_then(|out| {
            // SAFETY: the feed pass just checked that the forward's launches, buffers by
            // address, are the captured ones. Those buffers are the shared pool's (owned by
            // `self.pool`, which is replaced only after every graph is dropped) or ones the
            // forward reads (weights, the KV store), which `forward`, borrowed for this call,
            // keeps alive until it returns. No other graph's replay runs meanwhile (`&mut
            // self`, one stream), and the logits are read back below before this returns, so
            // the buffers this graph shares with the other sizes hold this replay's data.
            // Inside the forward's passes the backend refuses to create a KV store and the
            // device refuses allocations while capturing, so no buffer a launch names was made
            // and dropped by the forward itself. So the replay runs exactly the launches an
            // eager feed pass would have run, over live buffers.
            unsafe { self.backend.device().replay(&graph) }?;
            let rows = out.shape.first().copied().unwrap_or(0);
            let all = self.backend.download(&out)?;
            let per_row = all.len().checked_div(rows).unwrap_or(0);
            Ok(all[..bs.min(rows) * per_row].to_vec())
        });
        self.graphs.insert(padded, Captured { graph, tape });
        result.map(Some)
    }

    fn captured_bs(&self) -> Vec<usize> {
        CudaGraphRunner::captured_bs(self)
    }

    fn memory_bytes(&self) -> usize {
        self.memory().pool_bytes
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

    /// The route of every batch size around the captured ones, and of requests at and past
    /// the graphs' context.
    #[test]
    fn batches_pad_to_the_next_captured_size_or_run_eagerly() {
        let captured = capture_bs(Some(24), 256);
        let mut table = format!("captured {captured:?}, context 4096\n");
        for (bs, longest) in [
            (1, 1),
            (2, 4096),
            (3, 100),
            (5, 100),
            (9, 100),
            (16, 100),
            (17, 100),
            (24, 100),
            (25, 100),
            (3, 4097),
            (0, 0),
        ] {
            let r = route(&captured, 4096, bs, longest);
            table += &format!("bs {bs:>2}, longest {longest:>4}: {r}\n");
        }
        table += &format!("nothing captured: {}\n", route(&[], 4096, 1, 1));
        insta::assert_snapshot!(table);
    }

    proptest::proptest! {
        /// A replayed batch pads to the smallest captured size that holds it; only a batch
        /// larger than every captured size, or a request past the context, runs eagerly.
        #[test]
        fn a_batch_pads_to_the_smallest_captured_size_that_holds_it(
            max_bs in proptest::option::of(1usize..300),
            max_running in 1usize..300,
            bs in 0usize..320,
            longest in 0usize..100,
        ) {
            let captured = capture_bs(max_bs.map(|m| m.min(max_running)), max_running);
            let largest = *captured.last().unwrap();
            match route(&captured, 64, bs, longest) {
                GraphRoute::Replay { padded } => {
                    proptest::prop_assert!(captured.contains(&padded) && padded >= bs);
                    proptest::prop_assert!(longest <= 64);
                    proptest::prop_assert!(!captured.iter().any(|&c| c >= bs.max(1) && c < padded));
                }
                GraphRoute::TooLarge { largest: l } => {
                    proptest::prop_assert_eq!(l, largest);
                    proptest::prop_assert!(bs > largest && longest <= 64);
                }
                GraphRoute::TooLong { .. } => proptest::prop_assert!(longest > 64),
                GraphRoute::NotCaptured => proptest::prop_assert!(false, "{:?}", captured),
            }
        }
    }

    #[test]
    fn bad_configs_are_typed_errors() {
        let good = CudaGraphConfig {
            cuda_graph_max_bs: Some(8),
            max_running_requests: 8,
            max_context_len: 64,
            page_size: 16,
        };
        assert_eq!(good.check(), Ok(()));
        let with = |f: fn(&mut CudaGraphConfig)| {
            let mut c = good.clone();
            f(&mut c);
            c.check().unwrap_err().to_string()
        };
        let errors = [
            with(|c| c.cuda_graph_max_bs = Some(0)),
            with(|c| c.cuda_graph_max_bs = Some(9)),
            with(|c| c.max_running_requests = 0),
            with(|c| c.max_context_len = 0),
            with(|c| c.page_size = 0),
        ];
        insta::assert_snapshot!(errors.join("\n"));
    }
}
