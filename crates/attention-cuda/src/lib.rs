//! # attention-cuda — the CUDA compute backend for kvserve
//!
//! [`CudaBackend`] implements [`attention::Backend`] with CUDA C++ kernels: the dense ops of a
//! decoder layer (a batch-invariant matmul, RMSNorm, rotary, SiLU-and-mul, residual add, embedding), KV
//! writes at `out_cache_loc`, and paged attention (MHA / GQA / MQA and absorbed MLA, causal
//! over each request's cached prefix plus its new tokens, the KV range split across blocks and
//! merged by log-sum-exp) over [`CudaKvStore`], kv-pool's store trait in device memory.
//!
//! - [`kernels`]: the `.cu` sources under `kernels/` (embedded), specialised by `#define`s
//!   (store dtype f32/f16/bf16/fp8, head dim or MLA shape, page-size family, query heads per
//!   attention block: [`specs::GQA_HEADS_PER_BLOCK`] of a GQA group, or
//!   [`specs::MLA_HEADS_PER_BLOCK`] MLA heads, share each KV read) into the [`Spec`]s of
//!   [`specs`]; every specialisation is compiled by NVRTC in CI (the serving family's all the
//!   way to sm_90 machine code by NVRTC's ptxas, whose report [`ptxas`] reads: registers,
//!   spills, static shared memory; the rest to PTX) and every branch for gfx90a by hipRTC
//!   (features `cuda-13`, `rocm`; [`nvrtc`], `hiprtc`). Paged attention has two kernels
//!   with one contract, chosen by [`CudaConfig::attention_kernel`] ([`AttentionKernel`]):
//!   `paged_attention_pipelined` (the default: keys and values staged in shared memory by
//!   `cp.async` several tiles ahead, FlashInfer's decode schedule, f16/bf16/fp8 on the tensor
//!   cores; 83–89 % of an H100's memory bandwidth in f16/bf16 decode, 73–80 % fp8) and
//!   `paged_attention` (chunks of keys in registers; 55–60 %). The kernels'
//!   tuning defines (`ATTN_MIN_BLOCKS`, `V_UNROLL_MAX`, `KVS_SOFT_CVT`, `PL_*`) can be set at
//!   run time with `KVSERVE_CUDA_DEFINES` ([`nvrtc::tuning_defines`]) to measure them on a GPU.
//! - [`device`]: the [`Device`] trait the backend's host logic is generic over: allocation,
//!   copies, and launches by specialisation and kernel name. The CPU emulation
//!   (`attention-cuda-emu`, tests only) implements it by compiling the same `.cu` sources with
//!   g++, so the shared conformance suite runs the kernels' logic without a GPU.
//! - [`plan`] and [`geometry`]: host-side planning (page-table packing, write lists, split-KV
//!   plans) and launch geometry, plain functions unit-tested on their own.
//! - [`gemm`]: the GEMM path, chosen once per backend: the device's vendor BLAS (cuBLAS when
//!   libcublas loads) by default, the own kernel (batch-invariant) when there is none or with
//!   [`CudaConfig::enable_deterministic_inference`] (SGLang's
//!   `--enable-deterministic-inference`).
//! - [`graph`]: CUDA graphs for decode, as SGLang's `CudaGraphRunner`: [`CudaGraphRunner`]
//!   captures a decode forward per batch size of [`capture_bs`] and replays a batch padded
//!   to the next captured size; the backend serves the forward's buffers and uploads from one
//!   static pool every captured size shares ([`graph::pool`]; [`GraphMemory`] reports it) so
//!   that nothing is allocated or copied inside the capture. It implements [`attention::DecodeGraphs`], the seam the model runner replays
//!   decode batches through ([`route`]: pad, or eager for larger batches and longer requests).
//! - [`backend`], [`store`], [`tensor`]: the trait implementations.
//! - Devices: `cudarc_device` (NVIDIA, features `cuda-12`/`cuda-13`) and `hip_device` (AMD,
//!   feature `rocm`, kernels compiled by `hiprtc`), sharing [`kernel_cache`] (compile and load
//!   a specialisation on its first launch) and [`device::check_range`]; the emulation's lives
//!   in its own crate.
//!
//! ## Invariants
//! - The kernel sources stay within what NVRTC, hipRTC and the emulation compile: no
//!   cooperative groups, no CUDA headers, a compile-time warp size, 1-D blocks; inline PTX
//!   (the hardware f16 and fp8 conversions) only behind `__CUDA_ARCH__`, beside a portable
//!   form that the emulation runs and checks bit for bit against the host's decoders.
//! - Like every backend, it never allocates or frees slots: attention writes the new K/V at the
//!   plan's `out_cache_loc`, then reads every position back from the store.
//! - Bad input is a typed error, checked on the host with [`attention::check`] and
//!   [`kv_pool::store::check`] before anything is launched; attention kinds and shapes without
//!   kernels (head dims outside [`kernels::SPEC_HEAD_DIMS`], MLA shapes outside
//!   [`kernels::SPEC_MLA_DIMS`]) are typed `Unsupported` errors, announced by
//!   [`Backend::kv_support`](attention::Backend::kv_support).
//! - Stored bytes equal [`kv_pool::HostKvStore`]'s: the kernels round f32 to f16, bf16 and
//!   fp8 (e4m3, e5m2; saturating, with the layer's scales) to nearest even, as kv-pool's
//!   encoder does.
//! - The crate builds with no features and no CUDA anywhere; the `cuda` feature adds cudarc
//!   with dynamic loading, whose libraries are checked with `is_culib_present()` before any
//!   call (cudarc's loader panics otherwise). `rocm` links libamdhip64 (hip-sys), so it builds
//!   only where the HIP headers are installed; the device count is asked before any other call.
//! - NVRTC's PTX and hipRTC's code objects are kept on disk by a hash of everything the
//!   compile depends on ([`compile_cache`]), so a stale entry is never found; the cache is
//!   best effort.
//! - A plan's split-KV scratch is allocated once and reused by every layer of the batch.
//! - A captured graph replays only launches equal to the ones the step's forward makes (kernel,
//!   geometry, buffers, scalars: checked before every replay), over buffers that outlive it
//!   (the pool every captured size shares, or the forward's borrows); inside a capture the
//!   device refuses allocations, host copies and reads. Within one forward no two live
//!   tensors, and no static input and any other tensor, share a pool buffer; replays of
//!   different sizes, which share buffers, never overlap.
//!
//! ## Where it sits
//! Depends on `attention` (the traits it implements) and `kv-pool` (the store trait and its
//! validation), with `cuda` on cudarc and with `rocm` on hip-sys. Its tests and `attention-cuda-emu`'s conformance
//! test run the shared suite from `attention::conformance`.

pub mod backend;
pub mod compile_cache;
#[cfg(any(feature = "cuda-12", feature = "cuda-13"))]
pub mod cudarc_device;
pub mod device;
pub mod gemm;
pub mod geometry;
pub mod graph;
#[cfg(feature = "rocm")]
pub mod hip_device;
#[cfg(feature = "rocm")]
pub mod hiprtc;
pub mod kernel_cache;
pub mod kernels;
#[cfg(any(feature = "cuda-12", feature = "cuda-13"))]
pub mod nvrtc;
pub mod plan;
pub mod ptxas;
/// The kernel specialisations (plain data, shared with the emulation's build script).
pub mod specs;
pub mod store;
pub mod tensor;

pub use backend::{AttentionKernel, CudaBackend, CudaConfig, CudaPlan};
#[cfg(any(feature = "cuda-12", feature = "cuda-13"))]
pub use cudarc_device::{CudaError, CudaReport, CudarcDevice};
pub use device::{packed_args, Device, KernelArg, LaunchConfig};
pub use gemm::{GemmChoice, GemmPath};
pub use graph::{
    capture_bs, route, CudaGraphConfig, CudaGraphRunner, DecodeForward, GraphMemory, GraphRoute,
    SizeMemory,
};
#[cfg(feature = "rocm")]
pub use hip_device::{HipDevice, HipError, HipReport};
pub use specs::{Source, Spec};
pub use store::{CudaKvRows, CudaKvStore};
pub use tensor::CudaTensor;
