//! Engine flags shared by `bench` and `serve` (SGLang's server arguments), the hierarchical
//! cache's and PD disaggregation's, and their conversion into an [`EngineSetup`].

use std::path::PathBuf;

use clap::Args;

use crate::error::{EngineError, Result};
use crate::setup::{
    default_setup, parse_policy, BackendKind, CudaAttentionKernel, CudaGraphSetup, CudaTensorCores,
    EngineSetup, HiCacheSetup, ModelSource,
};

/// Engine flags shared by `bench` and `serve`, named after SGLang's server arguments.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Read flags from this TOML file (keys are the long flags: `page-size = 16`); flags given
    /// on the command line win.
    #[arg(long, value_name = "FILE.toml", help_heading = "Engine")]
    pub config: Option<PathBuf>,
    /// A Hugging Face model directory (config.json, *.safetensors, tokenizer.json); default:
    /// the built-in tiny preset, which needs no download.
    #[arg(long, value_name = "DIR", help_heading = "Engine")]
    pub model_path: Option<PathBuf>,
    /// Compute backend: cpu, wgpu, cuda, rocm (among those compiled into this build; see
    /// `kvserve info`).
    #[arg(long, default_value = "cpu", help_heading = "Engine")]
    pub backend: String,
    /// CPU threads (default: the available cores).
    #[arg(long, value_name = "N", help_heading = "Engine")]
    pub threads: Option<usize>,
    /// KV cache element type: auto (float32), float32, float16, bfloat16, fp8_e4m3, fp8_e5m2.
    #[arg(long, default_value = "auto", help_heading = "Engine")]
    pub kv_cache_dtype: String,
    /// Page size in tokens.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Engine")]
    pub page_size: u32,
    /// KV pool size in tokens (default 131072, or with --mem-fraction-static the pool that
    /// fraction of the backend's memory holds, capped by this flag when both are given).
    #[arg(long, value_name = "N", help_heading = "Engine")]
    pub max_total_tokens: Option<usize>,
    /// Fraction of memory that weights plus the KV pool may use, in (0, 1] (SGLang's sizing
    /// rule: over host memory for the CPU backend, over the GPU's memory measured once the
    /// weights are on it for cuda and rocm; wgpu takes --max-total-tokens).
    #[arg(long, value_name = "F", help_heading = "Engine")]
    pub mem_fraction_static: Option<f64>,
    /// Request limit.
    #[arg(long, default_value_t = 256, help_heading = "Engine")]
    pub max_running_requests: usize,
    /// Chunk size of chunked prefill (≤ 0 disables chunking).
    #[arg(
        long,
        default_value_t = 8192,
        allow_negative_numbers = true,
        help_heading = "Engine"
    )]
    pub chunked_prefill_size: i64,
    /// Token budget of one prefill batch.
    #[arg(long, default_value_t = 16384, help_heading = "Engine")]
    pub max_prefill_tokens: usize,
    /// Schedule policy: fcfs, lpm, dfs-weight, lof, random.
    #[arg(long, default_value = "fcfs", help_heading = "Engine")]
    pub schedule_policy: String,
    /// Eviction policy of the radix cache.
    #[arg(long, default_value = "lru", help_heading = "Engine")]
    pub radix_eviction_policy: String,
    /// Context length (default: the workload's longest request for bench, the model's maximum
    /// position embeddings for serve).
    #[arg(long, help_heading = "Engine")]
    pub context_length: Option<usize>,
    /// Use the chunk cache (no prefix reuse) instead of the radix cache.
    #[arg(long, help_heading = "Engine")]
    pub disable_radix_cache: bool,
    /// Scales the scheduler's estimate of future decode tokens (higher: fewer retractions,
    /// smaller batches).
    #[arg(long, value_name = "X", default_value_t = 1.0, help_heading = "Engine")]
    pub schedule_conservativeness: f64,
    /// Let running decodes ride along in prefill batches.
    #[arg(long, help_heading = "Engine")]
    pub enable_mixed_chunk: bool,
    /// Batch-invariant ops: on the cuda and rocm backends, GEMMs take kvserve's own tiled
    /// kernel instead of cuBLAS (whose algorithm depends on the batch size), so a request's
    /// output is bitwise the same in any batch.
    #[arg(long, help_heading = "Engine")]
    pub enable_deterministic_inference: bool,
    /// Run decode batches eagerly instead of replaying CUDA graphs (cuda backend; ignored by
    /// the others, which have no graphs).
    #[arg(long, help_heading = "Engine")]
    pub disable_cuda_graph: bool,
    /// The largest decode batch captured as a CUDA graph (default: SGLang's sizes 1, 2, 4, 8,
    /// 16 … 160 by 8, capped by --max-running-requests); larger batches run eagerly. Cuda
    /// backend; ignored by the others.
    #[arg(long, value_name = "N", help_heading = "Engine")]
    pub cuda_graph_max_bs: Option<usize>,
    /// The paged-attention kernel of the cuda and rocm backends: `pipelined` (keys and values
    /// staged in shared memory by asynchronous copies several tiles ahead, f16/bf16 on the
    /// tensor cores: 80-87 % of an H100's memory bandwidth in decode) or `chunked` (keys in
    /// registers: 50-59 %). Ignored by the others.
    #[arg(
        long,
        value_enum,
        value_name = "KERNEL",
        default_value_t = CudaAttentionKernel::Pipelined,
        help_heading = "Engine"
    )]
    pub cuda_attention_kernel: CudaAttentionKernel,
    #[command(flatten)]
    pub tensor_cores: CudaTensorCoreArgs,
    #[command(flatten)]
    pub hicache: HiCacheArgs,
}

/// The cuda backend's opt-in tensor-core forms (`serve`, `bench`, and `info`, which reports
/// what they select). Each is off by default until a GPU has checked and timed it, and is
/// ignored by the other backends.
#[derive(Debug, Clone, Copy, Default, Args)]
pub struct CudaTensorCoreArgs {
    /// Absorbed MLA (DeepSeek) over an f16/bf16 or fp8 KV cache on the tensor cores in the
    /// pipelined kernel: 16 heads a block on `mma.sync` (NVIDIA GPUs from sm_80), against 4 on
    /// the lanes' FMAs.
    #[arg(long, help_heading = "Engine")]
    pub cuda_mla_tensor_cores: bool,
    /// Mixture-of-experts layers with bf16 experts on the tensor cores: tiles of 64 rows by 64
    /// outputs on `mma.sync` over activations rounded to bf16 (NVIDIA GPUs from sm_80), against
    /// a warp's FMAs per output over tiles of 16 rows.
    #[arg(long, help_heading = "Engine")]
    pub cuda_moe_tensor_cores: bool,
    /// Matmuls over bf16 weights that take kvserve's own kernel (decode batches under CUDA
    /// graphs; every batch where cuBLAS is not loaded) on the tensor cores when they have more
    /// than 8 rows, as the MoE form computes; ignored with --enable-deterministic-inference.
    #[arg(long, help_heading = "Engine")]
    pub cuda_gemm_tensor_cores: bool,
    /// Prefill (extend batches) over an f16/bf16/fp8 KV cache with head dim 64 or 128 on the
    /// tensor cores: FlashAttention-2's schedule, a block per 64 new tokens of a request and
    /// query head (NVIDIA GPUs from sm_80), against a block per token.
    #[arg(long, help_heading = "Engine")]
    pub cuda_prefill_tensor_cores: bool,
}

impl CudaTensorCoreArgs {
    /// The forms these flags select.
    pub fn forms(&self) -> CudaTensorCores {
        CudaTensorCores {
            mla: self.cuda_mla_tensor_cores,
            moe: self.cuda_moe_tensor_cores,
            gemm: self.cuda_gemm_tensor_cores,
            prefill: self.cuda_prefill_tensor_cores,
        }
    }
}

/// SGLang's hierarchical-cache flags (`--enable-hierarchical-cache` and the `--hicache-*`
/// family), with SGLang's defaults.
#[derive(Debug, Clone, Args)]
pub struct HiCacheArgs {
    /// Keep KV evicted from the device pool in a host pool (and, with a storage backend, in an
    /// L3 store) and load it back on a hit.
    #[arg(long, help_heading = "Hierarchical cache")]
    pub enable_hierarchical_cache: bool,
    /// Host pool size as a multiple of the device pool (ignored when --hicache-size is given).
    #[arg(
        long,
        value_name = "X",
        default_value_t = 2.0,
        help_heading = "Hierarchical cache"
    )]
    pub hicache_ratio: f64,
    /// Host pool size in GB (10^9 bytes); 0: use --hicache-ratio.
    #[arg(
        long,
        value_name = "GB",
        default_value_t = 0.0,
        help_heading = "Hierarchical cache"
    )]
    pub hicache_size: f64,
    /// When device KV is copied to the host: write_through (at the first hit),
    /// write_through_selective (at the second), write_back (on eviction).
    #[arg(
        long,
        default_value = "write_through",
        help_heading = "Hierarchical cache"
    )]
    pub hicache_write_policy: String,
    /// Host pool memory layout: layer_first, page_first, page_first_direct.
    #[arg(
        long,
        default_value = "page_first",
        help_heading = "Hierarchical cache"
    )]
    pub hicache_mem_layout: String,
    /// L3 store behind the host pool: file (a directory) or redis.
    #[arg(long, value_name = "BACKEND", help_heading = "Hierarchical cache")]
    pub hicache_storage_backend: Option<String>,
    /// When a prefetch from L3 stops: best_effort, wait_complete, timeout.
    #[arg(long, default_value = "timeout", help_heading = "Hierarchical cache")]
    pub hicache_storage_prefetch_policy: String,
    /// The storage backend's settings as JSON (or @FILE): `file_path` for file, `url` or
    /// `urls` (a cluster) for redis, SGLang's prefetch keys.
    #[arg(long, value_name = "JSON", help_heading = "Hierarchical cache")]
    pub hicache_storage_backend_extra_config: Option<String>,
}

impl HiCacheArgs {
    /// The hierarchical cache these flags describe (`None` without
    /// `--enable-hierarchical-cache`); every value is checked, naming its flag.
    pub fn setup(&self) -> Result<Option<HiCacheSetup>> {
        if !self.enable_hierarchical_cache {
            if self.hicache_storage_backend.is_some() {
                return Err(EngineError::arg(
                    "--hicache-storage-backend",
                    "an L3 store sits behind the host tier: add --enable-hierarchical-cache",
                ));
            }
            return Ok(None);
        }
        let arg = |flag: &'static str| move |e: String| EngineError::arg(flag, e);
        let storage_config = match &self.hicache_storage_backend_extra_config {
            None => hicache::storage::StorageConfig::default(),
            Some(text) => hicache::storage::StorageConfig::from_arg(text).map_err(|e| {
                EngineError::arg("--hicache-storage-backend-extra-config", e.to_string())
            })?,
        };
        Ok(Some(HiCacheSetup {
            write_policy: self
                .hicache_write_policy
                .parse()
                .map_err(|e: radix_cache::RadixCacheError| e.to_string())
                .map_err(arg("--hicache-write-policy"))?,
            mem_layout: self
                .hicache_mem_layout
                .parse()
                .map_err(|e: kv_pool::KvPoolError| e.to_string())
                .map_err(arg("--hicache-mem-layout"))?,
            ratio: self.hicache_ratio,
            size_gb: self.hicache_size,
            storage: self
                .hicache_storage_backend
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: hicache::storage::StorageError| e.to_string())
                .map_err(arg("--hicache-storage-backend"))?,
            storage_config,
            prefetch_policy: self
                .hicache_storage_prefetch_policy
                .parse()
                .map_err(|e: radix_cache::RadixCacheError| e.to_string())
                .map_err(arg("--hicache-storage-prefetch-policy"))?,
        }))
    }
}

impl EngineArgs {
    /// The engine set-up these flags describe, with `default_context_len` unless
    /// `--context-length` is given.
    pub fn setup(&self, default_context_len: usize) -> Result<EngineSetup> {
        let mut setup = default_setup(self.context_length.unwrap_or(default_context_len));
        setup.backend = BackendKind::parse(&self.backend)?;
        setup.kv_dtype = match self.kv_cache_dtype.as_str() {
            "auto" => kv_pool::KvDtype::F32,
            other => other.parse().map_err(|e: kv_pool::KvPoolError| {
                EngineError::arg("--kv-cache-dtype", e.to_string())
            })?,
        };
        setup.model = self
            .model_path
            .clone()
            .map_or(ModelSource::Tiny, ModelSource::Path);
        setup.mem_fraction_static = self.mem_fraction_static;
        setup.capacity_tokens = match (self.max_total_tokens, self.mem_fraction_static) {
            (Some(n), _) => n,
            (None, Some(_)) => usize::MAX,
            (None, None) => 1 << 17,
        };
        setup.scheduler.schedule_conservativeness = self.schedule_conservativeness;
        setup.scheduler.enable_mixed_chunk = self.enable_mixed_chunk;
        setup.enable_deterministic_inference = self.enable_deterministic_inference;
        setup.cuda_attention_kernel = self.cuda_attention_kernel;
        setup.cuda_tensor_cores = self.tensor_cores.forms();
        setup.threads = self
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        setup.eviction_policy = self.radix_eviction_policy.clone();
        setup.scheduler.page_size = self.page_size;
        setup.scheduler.max_running_requests = self.max_running_requests;
        setup.cuda_graph = CudaGraphSetup::new(
            self.disable_cuda_graph,
            self.cuda_graph_max_bs,
            self.max_running_requests,
        )?;
        setup.scheduler.chunked_prefill_size =
            (self.chunked_prefill_size > 0).then_some(self.chunked_prefill_size as usize);
        setup.scheduler.max_prefill_tokens = self.max_prefill_tokens;
        setup.scheduler.schedule_policy = parse_policy(&self.schedule_policy)?;
        setup.hicache = self.hicache.setup()?;
        Ok(setup)
    }
}

/// Flags of `kvserve serve`, named after SGLang's server arguments.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Refuse new requests (503) while this many wait.
    #[arg(long)]
    pub max_queued_requests: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Publish the prefix cache's KV events (vLLM's `KVEventsConfig` as JSON): e.g.
    /// '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
    /// "topic": "kv-events"}'; msgpack `KVEventBatch`es on a ZMQ PUB socket.
    #[arg(long, value_name = "JSON")]
    pub kv_events_config: Option<String>,
    #[command(flatten)]
    pub disaggregation: DisaggregationArgs,
}

/// PD disaggregation flags of `serve` (SGLang's names and defaults; the timeouts also read
/// SGLang's environment variables).
#[derive(Debug, Clone, Args)]
pub struct DisaggregationArgs {
    /// This server's role: null (prefill and decode), prefill, or decode.
    #[arg(long, default_value = "null", help_heading = "PD disaggregation")]
    pub disaggregation_mode: String,
    /// How KV moves from prefill to decode: tcp, shm (both servers on one host), nixl, fake
    /// (moves nothing: warm-up and tests of the protocol). Both servers must agree.
    #[arg(long, default_value = "tcp", help_heading = "PD disaggregation")]
    pub disaggregation_transfer_backend: String,
    /// Prefill: the port of the bootstrap server decode servers handshake with.
    #[arg(long, default_value_t = 8998, help_heading = "PD disaggregation")]
    pub disaggregation_bootstrap_port: u16,
    /// Prefill: seconds a request may wait for its decode server's handshake.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        env = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
        help_heading = "PD disaggregation"
    )]
    pub disaggregation_bootstrap_timeout: f64,
    /// Decode: seconds a request may wait for its KV.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        env = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
        help_heading = "PD disaggregation"
    )]
    pub disaggregation_waiting_timeout: f64,
    /// Decode: seconds between health checks of each prefill server.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 5.0,
        env = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",
        help_heading = "PD disaggregation"
    )]
    pub disaggregation_heartbeat_interval: f64,
    /// Decode: failed health checks in a row after which a prefill server's requests fail.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 2,
        env = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
        help_heading = "PD disaggregation"
    )]
    pub disaggregation_heartbeat_max_failures: u32,
    /// Test hook: the tcp backend corrupts the N-th frame it sends (counting from 0) after
    /// checksumming it, so tests see a corrupted transfer fail cleanly.
    #[arg(long, value_name = "N", hide = true)]
    pub disaggregation_test_corrupt_frame: Option<u64>,
}
