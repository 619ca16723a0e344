//! The engine's component kinds, each one value with static dispatch over the implementations
//! compiled into this build: the KV allocator ([`kv_pool::AnyAllocator`]), the prefix cache
//! ([`radix_cache::AnyPrefixCache`]), the eviction policy ([`radix_cache::AnyEvictionPolicy`])
//! and the compute backend ([`AnyRunner`], here).
//!
//! A backend whose Cargo feature is off still has its variant: a zero-sized stand-in whose
//! constructor and methods answer [`EngineError::NotCompiled`], so choosing it gives a typed
//! error that names the feature and the code that matches on a backend has no `cfg` in it.
//! [`Inventory`] lists what this build has (`kvserve info`).

use std::fmt;
use std::sync::Arc;

use attention::{Backend, CpuBackend, CpuConfig};
use enum_dispatch::enum_dispatch;
use kv_pool::tier::CacheController;
use kv_pool::{AnyAllocator, DeviceKvRows, HostKvStore, KvLayout, KvStore, MemoryRegion};
use model::{ForwardInput, LogitsOutput, Model, ModelRunner};
use radix_cache::tiers::HiCacheConfig;
use radix_cache::{AnyEvictionPolicy, AnyPrefixCache, ChunkCache, RadixCache};
use scheduler::{Scheduler, SchedulerConfig};
use serde::Serialize;

use super::backend::BackendKind;
use super::cuda_graph::CudaGraphSetup;
use super::engine_setup::{CudaTensorCores, EngineSetup};
use super::pool;
use super::source::ModelSource;
use crate::error::{EngineError, Result};

/// What the engine needs from a model runner on some backend, without the backend's associated
/// types: one forward pass and the backend's name.
#[enum_dispatch]
pub trait ModelForward: Send {
    /// Runs one batch (see [`ModelRunner::forward`]).
    fn forward(&mut self, input: &ForwardInput<'_>) -> Result<LogitsOutput>;
    /// The backend's name, for logs and `/get_server_info`.
    fn backend_name(&self) -> String;
    /// The KV store's buffers, for registration with a transfer engine: host memory only
    /// (empty for a backend whose KV lives on a device, or a stand-in).
    fn kv_memory_regions(&self) -> Vec<MemoryRegion> {
        Vec::new()
    }
    /// Bytes of one page of the KV store in the canonical packed format (all layers).
    fn kv_page_bytes(&self) -> usize {
        0
    }
    /// The KV store's allocatable slots: the pool the scheduler's allocator gets.
    fn kv_capacity(&self) -> usize;
    /// The decode batch sizes captured as graphs, ascending (empty: every pass is eager).
    fn cuda_graph_bs(&self) -> Vec<usize> {
        Vec::new()
    }
    /// Device memory the captured graphs hold (their shared pool and per-size state; 0 when
    /// none are captured).
    fn cuda_graph_memory_bytes(&self) -> usize {
        0
    }
}

impl<B: Backend + Send> ModelForward for ModelRunner<B>
where
    B::KvStore: Send,
    B::Tensor: Send,
{
    fn forward(&mut self, input: &ForwardInput<'_>) -> Result<LogitsOutput> {
        ModelRunner::forward(self, input).map_err(|e| EngineError::Model(e.to_string()))
    }

    fn backend_name(&self) -> String {
        self.backend().name().to_string()
    }

    fn kv_memory_regions(&self) -> Vec<MemoryRegion> {
        if self.backend().name() == "cpu" {
            self.kv_store().memory_regions()
        } else {
            Vec::new()
        }
    }

    fn kv_page_bytes(&self) -> usize {
        self.kv_store().layout().page_bytes()
    }

    fn kv_capacity(&self) -> usize {
        self.kv_store().layout().size
    }

    fn cuda_graph_bs(&self) -> Vec<usize> {
        self.decode_graphs()
            .map(|g| g.captured_bs())
            .unwrap_or_default()
    }

    fn cuda_graph_memory_bytes(&self) -> usize {
        self.decode_graphs().map_or(0, |g| g.memory_bytes())
    }
}

/// The model runner on the backend `--backend` chose.
// One per engine: the stand-ins' small size does not matter, and boxing would add an
// indirection to every forward call.
#[allow(clippy::large_enum_variant)]
#[enum_dispatch(ModelForward)]
pub enum AnyRunner {
    Cpu(ModelRunner<CpuBackend>),
    /// On wgpu (a [`crate::error::NotCompiled`] stand-in without feature `wgpu`).
    Wgpu(WgpuRunner),
    /// On CUDA (a [`crate::error::NotCompiled`] stand-in without feature `cuda`).
    Cuda(CudaRunner),
    /// On ROCm (a [`crate::error::NotCompiled`] stand-in without feature `rocm`).
    Rocm(RocmRunner),
}

impl fmt::Debug for AnyRunner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AnyRunner({})", self.backend_name())
    }
}

impl AnyRunner {
    /// The KV store's memory in host addresses: the `cpu` backend's store (`None` for a
    /// backend whose KV lives on a device).
    pub fn host_kv_store(&self) -> Option<&dyn KvStore> {
        match self {
            AnyRunner::Cpu(cpu) => Some(cpu.kv_store()),
            _ => None,
        }
    }

    /// A handle copying rows of the KV store through the device's queue or stream, ordered
    /// with the forward passes (`WgpuKvRows`, `CudaKvRows`): what HiCache's controller and PD's
    /// host mirror move a device store's KV through. `None` for the `cpu` backend (its store is
    /// host memory: [`Self::host_kv_store`]) and for a backend not compiled in.
    pub fn device_kv_rows(&self) -> Option<Arc<dyn DeviceKvRows>> {
        match self {
            #[cfg(feature = "wgpu")]
            AnyRunner::Wgpu(wgpu) => Some(Arc::new(wgpu.kv_store().device_rows())),
            #[cfg(any(feature = "cuda", feature = "cuda-13"))]
            AnyRunner::Cuda(cuda) => Some(Arc::new(cuda.kv_store().device_rows())),
            #[cfg(feature = "rocm")]
            AnyRunner::Rocm(rocm) => Some(Arc::new(rocm.kv_store().device_rows())),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Builds the model of `setup` on `setup.backend` with a KV store of `size`.
    pub fn build(setup: &EngineSetup, size: PoolSize) -> Result<Self> {
        match setup.backend {
            BackendKind::Cpu => {
                let backend = CpuBackend::new(CpuConfig {
                    threads: setup.threads.max(1),
                    ..CpuConfig::default()
                })
                .map_err(|e| EngineError::arg("--threads", e.to_string()))?;
                if !setup.shared_kv {
                    return Ok(runner_on(backend, setup, size)?.into());
                }
                // PD's shm transfer: the KV store lives in a shared mapping that prefill
                // servers on this host write into.
                let (model, layout) = model_on(&backend, setup, size)?;
                let mem =
                    transfer::shm::SharedMemory::create(layout.total_bytes()).map_err(|e| {
                        EngineError::arg("--disaggregation-transfer-backend", e.to_string())
                    })?;
                let store = HostKvStore::with_memory(layout, Box::new(mem))?;
                Ok(ModelRunner::with_kv_store(backend, model, store)
                    .map_err(|e| EngineError::Model(e.to_string()))?
                    .into())
            }
            BackendKind::Wgpu => Ok(WgpuRunner::build(setup, size)?.into()),
            BackendKind::Cuda => Ok(CudaRunner::build(setup, size)?.into()),
            BackendKind::Rocm => Ok(RocmRunner::build(setup, size)?.into()),
        }
    }
}

/// A host tier for [`build_scheduler`]'s radix tree: its configuration and the controller the
/// tree will own (`serve` / `bench`: the CPU cache controller; `sim`: a bookkeeping one).
pub struct TreeTier {
    /// For `RadixCache::with_host_tier`.
    pub config: HiCacheConfig,
    /// The controller moving (or, in a simulation, pretending to move) the pages.
    pub controller: Box<dyn CacheController>,
}

/// The scheduler over the prefix cache (radix with `eviction_policy`, or the chunk cache) and
/// allocator ([`AnyAllocator::for_page_size`]) of a `capacity`-token pool: the composition
/// `bench`, `serve` and `sim` share. With `kv_events` the radix tree records its KV events
/// (`serve --kv-events-config`; the engine loop drains them).
pub fn build_scheduler(
    config: SchedulerConfig,
    radix: bool,
    eviction_policy: &str,
    capacity: usize,
    tier: Option<TreeTier>,
    kv_events: bool,
) -> Result<Scheduler> {
    let alloc = AnyAllocator::for_page_size(capacity, config.page_size)?;
    build_scheduler_with(config, radix, eviction_policy, alloc, tier, kv_events)
}

/// [`build_scheduler`] over a given allocator (`kvserve sim --allocator`).
pub fn build_scheduler_with(
    config: SchedulerConfig,
    radix: bool,
    eviction_policy: &str,
    alloc: AnyAllocator,
    tier: Option<TreeTier>,
    kv_events: bool,
) -> Result<Scheduler> {
    let p = config.page_size;
    let cache = if radix {
        let policy = AnyEvictionPolicy::from_name(eviction_policy)?;
        let tree = RadixCache::new(p, policy).with_events(kv_events);
        let tree = match tier {
            None => tree,
            Some(t) => tree
                .with_host_tier(t.config, t.controller)
                .map_err(|e| EngineError::arg("--enable-hierarchical-cache", e.to_string()))?,
        };
        AnyPrefixCache::Radix(tree)
    } else {
        AnyPrefixCache::Chunk(ChunkCache::new(p))
    };
    Scheduler::new(config, cache, alloc).map_err(|e| match e {
        scheduler::SchedulerError::InvalidConfig { field, reason } => {
            EngineError::arg(field, reason)
        }
        e => EngineError::Simulation(e.to_string()),
    })
}

/// How each backend variant's runner is built. Implemented by the real runner of a compiled
/// backend and by the [`crate::error::NotCompiled`] stand-in of one whose feature is off.
pub trait BuildRunner: Sized {
    /// Builds the model of `setup` on this backend with a KV store of `size`.
    fn build(setup: &EngineSetup, size: PoolSize) -> Result<Self>;
    /// Opens the backend's device and describes it (with the GEMM path it would take under
    /// `--enable-deterministic-inference` = `deterministic`), or says why it cannot (`None`
    /// for a backend with nothing to open).
    fn probe(deterministic: bool) -> Option<String> {
        let _ = deterministic;
        None
    }
}

/// How large a KV store to build.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolSize {
    /// This many slots (a whole number of pages).
    Slots(usize),
    /// SGLang's `--mem-fraction-static` of the device's memory, measured once the weights are
    /// on it ([`Backend::device_memory`], [`pool::device_pool_plan`]), at most `cap` tokens.
    DeviceFraction {
        /// `--mem-fraction-static`.
        fraction: f64,
        /// `--max-total-tokens`, if given.
        cap: Option<usize>,
    },
}

/// Loads `setup`'s model onto `backend` and sizes its KV store: the one path every backend's
/// runner is built through.
pub fn runner_on<B: Backend>(
    backend: B,
    setup: &EngineSetup,
    size: PoolSize,
) -> Result<ModelRunner<B>> {
    let (model, layout) = model_on(&backend, setup, size)?;
    ModelRunner::new(backend, model, layout).map_err(|e| EngineError::Model(e.to_string()))
}

/// Loads `setup`'s model onto `backend` and lays out a KV pool of `size` for it (a device
/// fraction is measured after the weights load, as SGLang's `profile_max_num_token`).
fn model_on<B: Backend>(
    backend: &B,
    setup: &EngineSetup,
    size: PoolSize,
) -> Result<(Model<B>, KvLayout)> {
    let model_err = |e: model::ModelError| EngineError::Model(e.to_string());
    let model: Model<B> = match &setup.model {
        ModelSource::Tiny => model::tiny::tiny_model(backend).map_err(model_err)?.into(),
        ModelSource::Path(dir) => model::load_model_dir(backend, dir).map_err(model_err)?,
    };
    let shape = model
        .config()
        .kv_shape(setup.kv_dtype)
        .map_err(|e| EngineError::arg("--kv-cache-dtype", e.to_string()))?;
    let page = setup.scheduler.page_size;
    let capacity = match size {
        PoolSize::Slots(slots) => slots,
        PoolSize::DeviceFraction { fraction, cap } => {
            // Freed load-time temporaries go back to the device once its queue drains.
            backend
                .synchronize()
                .map_err(|e| EngineError::Model(e.to_string()))?;
            let memory = backend
                .device_memory()
                .map_err(|e| EngineError::arg("--mem-fraction-static", e.to_string()))?
                .ok_or_else(|| {
                    EngineError::arg(
                        "--mem-fraction-static",
                        format!(
                            "{} does not report its memory; give --max-total-tokens",
                            backend.name()
                        ),
                    )
                })?;
            let plan = pool::device_pool_plan(
                fraction,
                memory,
                shape,
                page,
                setup.scheduler.context_len,
                cap,
            )?;
            pool::whole_pages(plan.max_total_num_tokens(), page)?
        }
    };
    let layout = KvLayout::new(shape, page, capacity)?;
    Ok((model, layout))
}

/// Defines the stand-in of a backend whose feature is off: it cannot be built (its constructor
/// answers [`crate::error::NotCompiled`]) and, were one to exist, every method would answer the same.
// Unused in a build with every backend compiled in.
#[allow(unused_macros)]
macro_rules! not_compiled_backend {
    ($name:ident, $kind:expr) => {
        /// The stand-in for a backend this build lacks.
        #[derive(Debug)]
        pub struct $name(());

        impl BuildRunner for $name {
            fn build(_setup: &EngineSetup, _size: PoolSize) -> Result<Self> {
                Err($kind.not_compiled().into())
            }
        }

        impl ModelForward for $name {
            fn forward(&mut self, _input: &ForwardInput<'_>) -> Result<LogitsOutput> {
                Err($kind.not_compiled().into())
            }

            fn backend_name(&self) -> String {
                format!("{} (not compiled)", $kind.name())
            }

            fn kv_capacity(&self) -> usize {
                0
            }
        }
    };
}

/// The model on the wgpu backend.
#[cfg(feature = "wgpu")]
pub type WgpuRunner = ModelRunner<attention_wgpu::WgpuBackend>;

#[cfg(feature = "wgpu")]
impl BuildRunner for WgpuRunner {
    fn build(setup: &EngineSetup, size: PoolSize) -> Result<Self> {
        let backend = attention_wgpu::WgpuBackend::new(attention_wgpu::WgpuConfig::default())
            .map_err(|e| EngineError::arg("--backend", format!("wgpu: {e}")))?;
        runner_on(backend, setup, size)
    }

    fn probe(_deterministic: bool) -> Option<String> {
        Some(
            match attention_wgpu::WgpuBackend::new(attention_wgpu::WgpuConfig::default()) {
                Ok(b) => b.report().to_string(),
                Err(e) => format!("none: {e}"),
            },
        )
    }
}

#[cfg(not(feature = "wgpu"))]
not_compiled_backend!(WgpuRunner, BackendKind::Wgpu);
/// The CUDA/ROCm backend's tunables for `setup`.
#[cfg(any(feature = "cuda", feature = "cuda-13", feature = "rocm"))]
fn cuda_config(setup: &EngineSetup) -> attention_cuda::CudaConfig {
    use crate::setup::CudaAttentionKernel;
    attention_cuda::CudaConfig {
        enable_deterministic_inference: setup.enable_deterministic_inference,
        attention_kernel: match setup.cuda_attention_kernel {
            CudaAttentionKernel::Chunked => attention_cuda::AttentionKernel::Chunked,
            CudaAttentionKernel::Pipelined => attention_cuda::AttentionKernel::Pipelined,
        },
        mla_tensor_cores: setup.cuda_tensor_cores.mla,
        moe_tensor_cores: setup.cuda_tensor_cores.moe,
        gemm_tensor_cores: setup.cuda_tensor_cores.gemm,
        prefill_tensor_cores: setup.cuda_tensor_cores.prefill,
        ..Default::default()
    }
}

/// `kvserve info`'s line for an opened CUDA/ROCm device: what it is, the GEMM path a backend
/// on it takes (the backend's own choice, `attention_cuda::gemm::choose`) and where compiled
/// kernels are cached (`attention_cuda::compile_cache`, `KVSERVE_KERNEL_CACHE`).
#[cfg(any(feature = "cuda", feature = "cuda-13", feature = "rocm"))]
fn cuda_probe(
    report: impl fmt::Display,
    device: &impl attention_cuda::Device,
    deterministic: bool,
) -> String {
    let gemm = attention_cuda::gemm::choose(deterministic, device.blas());
    let cache = attention_cuda::compile_cache::CompileCache::from_env()
        .map_or_else(|| "off".to_string(), |c| c.dir().display().to_string());
    format!("{report}; GEMMs: {gemm}; kernel cache: {cache}")
}

/// Captures the decode forward of `runner` as CUDA graphs (`--cuda-graph-max-bs`, up to
/// `--max-running-requests`, for requests up to `--context-length`), unless
/// `--disable-cuda-graph`. A forward that cannot be captured (one that reads a tensor back to
/// the host) leaves decode eager, said on stderr.
#[cfg(any(feature = "cuda", feature = "cuda-13"))]
fn enable_cuda_graphs<D: attention_cuda::Device + 'static>(
    runner: &mut ModelRunner<attention_cuda::CudaBackend<D>>,
    setup: &EngineSetup,
) -> Result<()> {
    if let Err(off) = setup.cuda_graph.graphs_on(setup.backend) {
        eprintln!("kvserve: CUDA graphs {off}");
        return Ok(());
    }
    let config = attention_cuda::CudaGraphConfig {
        cuda_graph_max_bs: setup.cuda_graph.cuda_graph_max_bs,
        max_running_requests: setup.scheduler.max_running_requests,
        max_context_len: setup.scheduler.context_len,
        page_size: setup.scheduler.page_size,
    };
    let graphs = attention_cuda::CudaGraphRunner::new(runner.backend(), config)
        .map_err(|e| EngineError::arg("--cuda-graph-max-bs", e.to_string()))?;
    match runner.enable_decode_graphs(Box::new(graphs)) {
        Ok(()) => eprintln!(
            "kvserve: CUDA graphs captured for decode bs {:?} ({} of graph memory, one pool \
             shared by every size)",
            runner.cuda_graph_bs(),
            attention_cuda::graph::human_bytes(runner.cuda_graph_memory_bytes())
        ),
        Err(e) => eprintln!("kvserve: CUDA graphs off: the decode forward cannot be captured ({e}); decode runs eagerly"),
    }
    Ok(())
}

/// The model on the CUDA backend (device 0).
#[cfg(any(feature = "cuda", feature = "cuda-13"))]
pub type CudaRunner = ModelRunner<attention_cuda::CudaBackend<attention_cuda::CudarcDevice>>;

#[cfg(any(feature = "cuda", feature = "cuda-13"))]
impl BuildRunner for CudaRunner {
    fn build(setup: &EngineSetup, size: PoolSize) -> Result<Self> {
        let device = attention_cuda::CudarcDevice::new(0)
            .map_err(|e| EngineError::arg("--backend", format!("cuda: {e}")))?;
        let backend = attention_cuda::CudaBackend::new(device, cuda_config(setup));
        let mut runner = runner_on(backend, setup, size)?;
        enable_cuda_graphs(&mut runner, setup)?;
        Ok(runner)
    }

    fn probe(deterministic: bool) -> Option<String> {
        Some(match attention_cuda::CudarcDevice::new(0) {
            Ok(d) => cuda_probe(d.report(), &d, deterministic),
            Err(e) => format!("none: {e}"),
        })
    }
}

#[cfg(not(any(feature = "cuda", feature = "cuda-13")))]
not_compiled_backend!(CudaRunner, BackendKind::Cuda);

/// The model on the ROCm backend (AMD GPU 0; the CUDA backend's kernels through hipRTC).
#[cfg(feature = "rocm")]
pub type RocmRunner = ModelRunner<attention_cuda::CudaBackend<attention_cuda::HipDevice>>;

#[cfg(feature = "rocm")]
impl BuildRunner for RocmRunner {
    fn build(setup: &EngineSetup, size: PoolSize) -> Result<Self> {
        let device = attention_cuda::HipDevice::new(0)
            .map_err(|e| EngineError::arg("--backend", format!("rocm: {e}")))?;
        let backend = attention_cuda::CudaBackend::new(device, cuda_config(setup));
        runner_on(backend, setup, size)
    }

    fn probe(deterministic: bool) -> Option<String> {
        Some(match attention_cuda::HipDevice::new(0) {
            Ok(d) => cuda_probe(d.report(), &d, deterministic),
            Err(e) => format!("none: {e}"),
        })
    }
}

#[cfg(not(feature = "rocm"))]
not_compiled_backend!(RocmRunner, BackendKind::Rocm);

/// Everything a component choice can name in this build, for `kvserve info` and for error
/// messages.
#[derive(Debug, Clone, Serialize)]
pub struct Inventory {
    pub version: &'static str,
    /// The engine crate's Cargo features that are on.
    pub features: Vec<&'static str>,
    /// Backends, compiled or not.
    pub backends: Vec<BackendEntry>,
    /// KV allocators ([`AnyAllocator`]).
    pub allocators: Vec<&'static str>,
    /// Prefix caches ([`AnyPrefixCache`]).
    pub prefix_caches: Vec<&'static str>,
    /// Eviction policies `--radix-eviction-policy` accepts.
    pub eviction_policies: Vec<String>,
    /// Schedule policies `--schedule-policy` accepts.
    pub schedule_policies: Vec<&'static str>,
    /// KV cache dtypes `--kv-cache-dtype` accepts.
    pub kv_cache_dtypes: Vec<&'static str>,
    /// Model architectures (`architectures` in config.json) the model crate loads.
    pub architectures: Vec<&'static str>,
    /// `--hicache-write-policy` values.
    pub hicache_write_policies: Vec<String>,
    /// `--hicache-mem-layout` values.
    pub hicache_mem_layouts: Vec<String>,
    /// `--hicache-storage-backend` values, and whether this build has each.
    pub hicache_storage_backends: Vec<String>,
    /// The device each compiled device backend opens (filled by [`Inventory::probe`]).
    pub devices: Vec<(BackendKind, String)>,
    /// The cuda backend's decode graphs (the sizes it captures, or why none), with the flags
    /// [`Inventory::with_cuda_graphs`] was given.
    pub cuda_graphs: String,
    /// The cuda backend's form of absorbed-MLA attention, with the flag
    /// [`Inventory::with_cuda_tensor_cores`] was given.
    pub cuda_mla: String,
    /// The cuda backend's form of mixture-of-experts matmuls, with the flag
    /// [`Inventory::with_cuda_tensor_cores`] was given.
    pub cuda_moe: String,
    /// The cuda backend's own matmul kernel's form, with the flag
    /// [`Inventory::with_cuda_tensor_cores`] was given.
    pub cuda_gemm: String,
    /// The cuda backend's prefill attention, with the flag
    /// [`Inventory::with_cuda_tensor_cores`] was given.
    pub cuda_prefill: String,
}

/// `kvserve info`'s line on the cuda backend's MLA attention.
fn describe_cuda_mla(tensor_cores: bool) -> String {
    if tensor_cores {
        "the tensor-core form (mma.sync) on sm_80 and later GPUs for f16/bf16 KV and fp8 KV \
         of a latent rank that is a multiple of 128, the lanes' form elsewhere \
         (--cuda-mla-tensor-cores)"
            .into()
    } else {
        "the lanes' form (--cuda-mla-tensor-cores: the tensor-core form on sm_80 and later, \
         not yet checked on a GPU)"
            .into()
    }
}

/// `kvserve info`'s line on the cuda backend's mixture-of-experts matmuls.
fn describe_cuda_moe(tensor_cores: bool) -> String {
    if tensor_cores {
        "the tensor-core form (mma.sync, activations rounded to bf16) on sm_80 and later GPUs \
         for bf16 experts whose rows are multiples of 8, the lanes' form elsewhere \
         (--cuda-moe-tensor-cores)"
            .into()
    } else {
        "the lanes' form (--cuda-moe-tensor-cores: the tensor-core form for bf16 experts on \
         sm_80 and later, not yet checked on a GPU)"
            .into()
    }
}

/// `kvserve info`'s line on the cuda backend's own matmul kernel.
fn describe_cuda_gemm(tensor_cores: bool) -> String {
    if tensor_cores {
        "bf16 weights of batches over 8 rows on the tensor cores (mma.sync, activations \
         rounded to bf16) on sm_80 and later GPUs, FMAs elsewhere and with \
         --enable-deterministic-inference (--cuda-gemm-tensor-cores)"
            .into()
    } else {
        "FMAs (--cuda-gemm-tensor-cores: bf16 weights of batches over 8 rows on the tensor \
         cores on sm_80 and later, not yet checked on a GPU)"
            .into()
    }
}

/// `kvserve info`'s line on the cuda backend's prefill attention.
fn describe_cuda_prefill(tensor_cores: bool) -> String {
    if tensor_cores {
        "paged_prefill on the tensor cores (a block per 64 new tokens and query head) on sm_80 \
         and later GPUs for f16/bf16/fp8 KV of head dim 64 or 128, the configured attention kernel \
         elsewhere (--cuda-prefill-tensor-cores)"
            .into()
    } else {
        "the configured attention kernel, a block per token (--cuda-prefill-tensor-cores: \
         FlashAttention-2's schedule on the tensor cores, not yet checked on a GPU)"
            .into()
    }
}

/// One backend in an [`Inventory`].
#[derive(Debug, Clone, Serialize)]
pub struct BackendEntry {
    /// Its `--backend` name.
    pub name: BackendKind,
    /// Whether this build has it.
    pub compiled: bool,
    /// The feature that compiles it, if any.
    pub feature: Option<&'static str>,
}

impl Inventory {
    /// This build's inventory.
    pub fn of_this_build() -> Self {
        let features = BackendKind::ALL
            .iter()
            .filter(|b| b.compiled())
            .filter_map(|b| b.feature())
            .collect();
        Inventory {
            version: env!("CARGO_PKG_VERSION"),
            features,
            backends: BackendKind::ALL
                .iter()
                .map(|&b| BackendEntry {
                    name: b,
                    compiled: b.compiled(),
                    feature: b.feature(),
                })
                .collect(),
            allocators: AnyAllocator::NAMES.to_vec(),
            prefix_caches: AnyPrefixCache::NAMES.to_vec(),
            eviction_policies: radix_cache::policy::policy_names()
                .into_iter()
                .map(str::to_string)
                .chain([radix_cache::policy::Belady::NAME.to_string() + " (cache-sim only)"])
                .collect(),
            schedule_policies: scheduler::SchedulePolicy::ALL
                .iter()
                .map(|p| p.as_str())
                .collect(),
            kv_cache_dtypes: std::iter::once("auto")
                .chain(kv_pool::KvDtype::ALL.iter().map(|d| d.name()))
                .collect(),
            architectures: model::Architecture::ALL.iter().map(|(_, n)| *n).collect(),
            hicache_write_policies: radix_cache::WritePolicy::ALL
                .iter()
                .map(ToString::to_string)
                .collect(),
            hicache_mem_layouts: kv_pool::host_pool::HostLayout::ALL
                .iter()
                .map(ToString::to_string)
                .collect(),
            hicache_storage_backends: vec![
                "file".into(),
                if cfg!(feature = "redis") {
                    "redis".into()
                } else {
                    "redis (not compiled; feature `redis`)".into()
                },
            ],
            devices: Vec::new(),
            cuda_graphs: CudaGraphSetup::default().describe(256),
            cuda_mla: describe_cuda_mla(false),
            cuda_moe: describe_cuda_moe(false),
            cuda_gemm: describe_cuda_gemm(false),
            cuda_prefill: describe_cuda_prefill(false),
        }
    }

    /// Reports the cuda backend's MLA, mixture-of-experts, own-matmul and prefill forms under
    /// `--cuda-{mla,moe,gemm,prefill}-tensor-cores`.
    pub fn with_cuda_tensor_cores(mut self, forms: CudaTensorCores) -> Self {
        self.cuda_mla = describe_cuda_mla(forms.mla);
        self.cuda_moe = describe_cuda_moe(forms.moe);
        self.cuda_gemm = describe_cuda_gemm(forms.gemm);
        self.cuda_prefill = describe_cuda_prefill(forms.prefill);
        self
    }

    /// Reports the cuda backend's decode graphs under `setup` and `--max-running-requests`
    /// `max_running_requests`.
    pub fn with_cuda_graphs(mut self, setup: &CudaGraphSetup, max_running_requests: usize) -> Self {
        self.cuda_graphs = setup.describe(max_running_requests);
        self
    }

    /// Opens each compiled device backend's device and records what it found.
    pub fn probe(mut self, deterministic: bool) -> Self {
        let probes = [
            (
                BackendKind::Wgpu,
                <WgpuRunner as BuildRunner>::probe(deterministic),
            ),
            (
                BackendKind::Cuda,
                <CudaRunner as BuildRunner>::probe(deterministic),
            ),
            (
                BackendKind::Rocm,
                <RocmRunner as BuildRunner>::probe(deterministic),
            ),
        ];
        self.devices = probes
            .into_iter()
            .filter_map(|(kind, found)| Some((kind, found?)))
            .collect();
        self
    }
}

impl fmt::Display for Inventory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "kvserve {}", self.version)?;
        let features = if self.features.is_empty() {
            "(none beyond the defaults)".to_string()
        } else {
            self.features.join(", ")
        };
        writeln!(f, "features:           {features}")?;
        let backends: Vec<String> = self
            .backends
            .iter()
            .map(|b| match (b.compiled, b.feature) {
                (true, _) => b.name.to_string(),
                (false, Some(feat)) => format!("{} (not compiled; feature `{feat}`)", b.name),
                (false, None) => format!("{} (not written yet)", b.name),
            })
            .collect();
        writeln!(f, "backends:           {}", backends.join(", "))?;
        writeln!(f, "allocators:         {}", self.allocators.join(", "))?;
        writeln!(f, "prefix caches:      {}", self.prefix_caches.join(", "))?;
        writeln!(
            f,
            "eviction policies:  {}",
            self.eviction_policies.join(", ")
        )?;
        writeln!(
            f,
            "schedule policies:  {}",
            self.schedule_policies.join(", ")
        )?;
        writeln!(f, "kv cache dtypes:    {}", self.kv_cache_dtypes.join(", "))?;
        writeln!(f, "architectures:      {}", self.architectures.join(", "))?;
        writeln!(
            f,
            "hicache policies:   {}",
            self.hicache_write_policies.join(", ")
        )?;
        writeln!(
            f,
            "hicache layouts:    {}",
            self.hicache_mem_layouts.join(", ")
        )?;
        write!(
            f,
            "hicache storage:    {}",
            self.hicache_storage_backends.join(", ")
        )?;
        write!(f, "\ncuda graphs:        {}", self.cuda_graphs)?;
        write!(f, "\ncuda mla:           {}", self.cuda_mla)?;
        write!(f, "\ncuda moe:           {}", self.cuda_moe)?;
        write!(f, "\ncuda own gemm:      {}", self.cuda_gemm)?;
        write!(f, "\ncuda prefill:       {}", self.cuda_prefill)?;
        for (kind, device) in &self.devices {
            write!(f, "\n{:<20}{device}", format!("{kind} device:"))?;
        }
        Ok(())
    }
}
