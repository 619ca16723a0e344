//! [`EngineSetup`]: everything `bench` and `serve` decide before building an engine.

use std::fmt;

use hicache::storage::{StorageConfig, StorageKind};
use kv_pool::host_pool::HostLayout;
use kv_pool::KvDtype;
use radix_cache::tiers::{HiCacheConfig, PrefetchPolicy, WritePolicy};
use scheduler::{SchedulePolicy, SchedulerConfig};

use super::backend::BackendKind;
use super::cuda_graph::CudaGraphSetup;
use super::source::ModelSource;
use crate::error::{EngineError, Result};

/// The engine configuration of a bench run or a server.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSetup {
    pub model: ModelSource,
    /// KV pool size in tokens; with `mem_fraction_static`, its cap (`usize::MAX`: none).
    pub capacity_tokens: usize,
    /// `--mem-fraction-static`: size the pool from host memory (`setup/pool.rs`).
    pub mem_fraction_static: Option<f64>,
    pub kv_dtype: KvDtype,
    /// Scheduler settings; `scheduler.context_len` is the context the engine serves.
    pub scheduler: SchedulerConfig,
    /// Eviction policy of the radix cache (`--radix-eviction-policy`).
    pub eviction_policy: String,
    pub backend: BackendKind,
    /// CPU threads of the backend.
    pub threads: usize,
    /// Seed of sampling (greedy requests ignore it).
    pub seed: u64,
    /// Put the KV store in shared memory (a PD decode server on the `shm` transfer backend:
    /// prefill servers on this host write into it). CPU backend only.
    pub shared_kv: bool,
    /// The hierarchical cache (`--enable-hierarchical-cache`), if on.
    pub hicache: Option<HiCacheSetup>,
    /// The radix cache records KV events (`--kv-events-config` with a publisher).
    pub kv_events: bool,
    /// `--enable-deterministic-inference`: batch-invariant GEMMs on the cuda/rocm backends.
    pub enable_deterministic_inference: bool,
    /// `--disable-cuda-graph` and `--cuda-graph-max-bs` (the cuda backend's decode graphs).
    pub cuda_graph: CudaGraphSetup,
    /// `--cuda-attention-kernel`: the cuda and rocm backends' paged-attention kernel.
    pub cuda_attention_kernel: CudaAttentionKernel,
    /// `--cuda-{mla,moe,gemm,prefill}-tensor-cores`: the cuda backend's opt-in tensor-core
    /// forms.
    pub cuda_tensor_cores: CudaTensorCores,
}

/// The cuda backend's opt-in tensor-core forms (named here so the flags exist in builds
/// without the backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CudaTensorCores {
    /// `--cuda-mla-tensor-cores`: absorbed MLA's tensor-core form
    /// (`attention_cuda::CudaConfig::mla_tensor_cores`).
    pub mla: bool,
    /// `--cuda-moe-tensor-cores`: the tensor-core expert matmuls
    /// (`attention_cuda::CudaConfig::moe_tensor_cores`).
    pub moe: bool,
    /// `--cuda-gemm-tensor-cores`: the own matmul kernel's tensor-core form
    /// (`attention_cuda::CudaConfig::gemm_tensor_cores`).
    pub gemm: bool,
    /// `--cuda-prefill-tensor-cores`: the tensor-core prefill attention kernel
    /// (`attention_cuda::CudaConfig::prefill_tensor_cores`).
    pub prefill: bool,
}

/// The cuda and rocm backends' paged-attention kernel (`attention_cuda::AttentionKernel`, named
/// here so the flag exists in builds without those backends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CudaAttentionKernel {
    /// Chunks of keys in registers.
    Chunked,
    /// Keys and values staged in shared memory by asynchronous copies, on the tensor cores for
    /// f16/bf16 stores (the default: 80-87 % of an H100's memory bandwidth in decode, against
    /// 50-59 % for `Chunked`).
    #[default]
    Pipelined,
}

/// Parses `--schedule-policy` for the bench (one policy).
pub fn parse_policy(s: &str) -> Result<SchedulePolicy> {
    s.parse().map_err(|e: scheduler::SchedulerError| {
        EngineError::arg("--schedule-policy", e.to_string())
    })
}

/// The default bench setup: the tiny model, a 128k-token pool in pages of 16, SGLang's
/// scheduler defaults with 8k-token chunks, LRU eviction.
pub fn default_setup(context_len: usize) -> EngineSetup {
    EngineSetup {
        model: ModelSource::Tiny,
        capacity_tokens: 1 << 17,
        mem_fraction_static: None,
        kv_dtype: KvDtype::F32,
        scheduler: SchedulerConfig {
            page_size: 16,
            context_len,
            max_running_requests: 256,
            chunked_prefill_size: Some(8192),
            ..SchedulerConfig::default()
        },
        eviction_policy: "lru".into(),
        backend: BackendKind::Cpu,
        threads: 1,
        seed: 0,
        shared_kv: false,
        hicache: None,
        kv_events: false,
        enable_deterministic_inference: false,
        cuda_graph: CudaGraphSetup::default(),
        cuda_attention_kernel: CudaAttentionKernel::default(),
        cuda_tensor_cores: CudaTensorCores::default(),
    }
}

/// The hierarchical cache's settings, validated from the flags.
#[derive(Debug, Clone, PartialEq)]
pub struct HiCacheSetup {
    /// `--hicache-write-policy`.
    pub write_policy: WritePolicy,
    /// `--hicache-mem-layout`.
    pub mem_layout: HostLayout,
    /// `--hicache-ratio`.
    pub ratio: f64,
    /// `--hicache-size` (GB; 0 uses the ratio).
    pub size_gb: f64,
    /// `--hicache-storage-backend` and its extra config.
    pub storage: Option<StorageKind>,
    /// `--hicache-storage-backend-extra-config`, parsed (its prefetch keys apply with or
    /// without a backend).
    pub storage_config: StorageConfig,
    /// `--hicache-storage-prefetch-policy`.
    pub prefetch_policy: PrefetchPolicy,
}

impl fmt::Display for HiCacheSetup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ", self.write_policy, self.mem_layout)?;
        if self.size_gb > 0.0 {
            write!(f, "{} GB", self.size_gb)?;
        } else {
            write!(f, "×{}", self.ratio)?;
        }
        match self.storage {
            Some(kind) => write!(f, ", L3 {kind} ({})", self.prefetch_policy),
            None => Ok(()),
        }
    }
}

impl HiCacheSetup {
    /// The tree's configuration for a host tier of `host_slots` slots: the write policy, the
    /// prefetch stop policy and SGLang's prefetch keys from the extra config, SGLang's defaults
    /// for the rest. (The simulators build their tiers from it too.)
    pub fn tree_config(&self, host_slots: usize) -> HiCacheConfig {
        let c = &self.storage_config;
        HiCacheConfig {
            write_policy: self.write_policy,
            host_slots,
            prefetch_threshold: c.prefetch_threshold,
            prefetch_policy: self.prefetch_policy,
            prefetch_timeout_base_s: c.prefetch_timeout_base_s,
            prefetch_timeout_per_ki_token_s: c.prefetch_timeout_per_ki_token_s,
            prefetch_timeout_max_s: c.prefetch_timeout_max_s,
            ..HiCacheConfig::default()
        }
    }
}
