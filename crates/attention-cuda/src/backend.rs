//! [`CudaBackend`]: [`attention::Backend`] over any [`Device`]. Every op validates with
//! [`attention::check`] on the host, picks its kernel specialisation ([`crate::kernels`]) and
//! launch geometry ([`crate::geometry`]), and launches through the device; nothing here knows
//! whether the kernels run on a GPU or in the CPU emulation.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use attention::check::{self, MhaGeometry};
use attention::{
    AttentionError, AttentionParams, Backend, BatchMetadata, DeviceTensor, MoeExperts, MoeRouting,
    Result, RopeConfig, RopeStyle, TensorDtype,
};
use kv_pool::{KvBuffer, KvKind, KvLayout, KvShape, KvStore};

use crate::device::{Device, KernelArg};
use crate::gemm::{self, GemmChoice, GemmInputs, GemmPath};
use crate::geometry::{self, ATTN_THREADS, ROW_THREADS, THREADS};
use crate::graph::pool::{GraphPool, Phase};
use crate::kernels;
use crate::plan::{page_table, prefill_pack, write_list, SplitPlan, PREFILL_ROWS};
use crate::store::CudaKvStore;
use crate::tensor::CudaTensor;

/// Tunables of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaConfig {
    /// Attention blocks a batch should reach before the KV range stops being split: 1056 by
    /// default, eight per SM of an H100's 132 (about three of the kernel's blocks are
    /// resident per SM, so nearly three waves: a long context read by a few requests keeps
    /// every SM's loads in flight; two per SM left an H100 at 9 % of its bandwidth there).
    pub split_kv_target_blocks: usize,
    /// SGLang's `--enable-deterministic-inference`: batch-invariant ops, so GEMMs take the
    /// crate's own kernel even where the vendor BLAS is loaded ([`crate::gemm`]).
    pub enable_deterministic_inference: bool,
    /// The kernel paged attention (MHA, GQA and MLA; extend and decode) runs.
    pub attention_kernel: AttentionKernel,
    /// Merge a split (token, head group)'s partial states inside the attention kernel, in the
    /// block that finishes its last split, instead of in a `merge_states` launch after it
    /// (`kvs_attn_finish`): one launch less per split call, the same results bitwise. Off by
    /// default until a GPU has timed it (`examples/decode_bandwidth.rs` reports both).
    pub fuse_split_merge: bool,
    /// Absorbed MLA over f16/bf16 stores (and fp8 ones at a latent rank that is a multiple of
    /// 128, DeepSeek's 512) in the pipelined kernel's tensor-core form, where the
    /// device has one ([`Device::tensor_cores`]): 16 heads a block on `mma.sync` (the lanes'
    /// form serves 4 with FMAs). Off by default until a GPU has checked and timed it; the
    /// emulated conformance suite runs it (`examples/decode_bandwidth.rs` reports both forms).
    pub mla_tensor_cores: bool,
    /// `fused_moe`'s expert matmuls over bf16 experts on the tensor cores, where the device
    /// has them ([`Device::tensor_cores`]): `moe_matmul_mma`, tiles of 64 rows by 64 outputs
    /// on `mma.sync` over the activations rounded to bf16 (as
    /// [`Backend::upload_weight`](attention::Backend::upload_weight) allows for a bf16 weight),
    /// where the lanes' form (`moe_matmul`) runs a warp's FMAs per output over tiles of 16 rows.
    /// Both forms are batch-invariant; their bits differ. Off by default until a GPU has
    /// checked and timed it; the emulated conformance suite runs it.
    pub moe_tensor_cores: bool,
    /// Matmuls over bf16 weights that take the crate's own kernel (under a CUDA graph, or
    /// where no BLAS is loaded) on the tensor cores, where the device has them
    /// ([`Device::tensor_cores`]), for batches of more than [`gemm::MMA_MIN_ROWS`](crate::gemm::MMA_MIN_ROWS) rows:
    /// `matmul_mma` (the GEMM of `moe_matmul_mma`: 64 × 64 tiles on `mma.sync` over the
    /// activations rounded to bf16, as the BLAS path rounds them), where `matmul` sums each
    /// output with a warp's FMAs, compute-bound on large decode batches. A row's bits then
    /// depend on its batch's size, so `enable_deterministic_inference` keeps `matmul`. Off by
    /// default until a GPU has checked and timed it; the emulated conformance suite runs it.
    pub gemm_tensor_cores: bool,
    /// Extend batches (prefill) over f16, bf16 and fp8 stores with keys and values of one head
    /// dim, 64 or 128, on the tensor cores, where the device has them ([`Device::tensor_cores`]):
    /// `paged_prefill`, FlashAttention-2's schedule (a block per 64 query rows: up to 64 new
    /// tokens of a request × one query head, or fewer tokens × up to 4 heads of a GQA group,
    /// each staged key and value row serving all 64; the KV range split where the tiles do not
    /// fill the device; the splits always merge in a `merge_states` launch, whatever
    /// [`fuse_split_merge`](Self::fuse_split_merge) says), where the attention kernels serve
    /// one token a block and read its whole causal prefix again. Off by
    /// default until a GPU has checked and timed it; the emulated conformance suite runs it.
    pub prefill_tensor_cores: bool,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            split_kv_target_blocks: 1056,
            enable_deterministic_inference: false,
            attention_kernel: AttentionKernel::default(),
            fuse_split_merge: false,
            mla_tensor_cores: false,
            moe_tensor_cores: false,
            gemm_tensor_cores: false,
            prefill_tensor_cores: false,
        }
    }
}

impl CudaConfig {
    /// A configuration per form attention can run in, by name: each attention kernel (the
    /// pipelined one with its GQA tensor-core form), the tensor-core MLA form and
    /// `paged_prefill`. What the checks that hold for every form (a NaN input coming out as
    /// NaN, for one) iterate over, in the emulation and on a GPU.
    pub fn attention_forms() -> [(&'static str, CudaConfig); 4] {
        let pipelined = CudaConfig {
            attention_kernel: AttentionKernel::Pipelined,
            ..CudaConfig::default()
        };
        [
            (
                "chunked",
                CudaConfig {
                    attention_kernel: AttentionKernel::Chunked,
                    ..pipelined
                },
            ),
            ("pipelined", pipelined),
            (
                "mla tensor cores",
                CudaConfig {
                    mla_tensor_cores: true,
                    ..pipelined
                },
            ),
            (
                "prefill tensor cores",
                CudaConfig {
                    prefill_tensor_cores: true,
                    ..pipelined
                },
            ),
        ]
    }
}

/// The two paged-attention kernels of `attention.cu`: the same grid, arguments and partial
/// states (merged by `merge_states`), the same results within rounding; they differ in how
/// they read the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// `paged_attention`: chunks of 128 keys loaded into registers, a block-wide softmax per
    /// chunk (55–60 % of an H100's memory bandwidth for f16/bf16 KV in decode, 31–34 % fp8).
    Chunked,
    /// `paged_attention_pipelined` (the default): keys and values staged in shared memory by
    /// asynchronous copies (`cp.async`) several tiles ahead of the compute, no barrier per
    /// tile (FlashInfer's decode schedule); f16/bf16/fp8 stores of head dim 64 or 128 compute
    /// on the tensor cores (`mma.sync`). On an H100: f16/bf16 decode 83–89 % of the memory
    /// bandwidth, fp8 73–80 %.
    #[default]
    Pipelined,
}

impl AttentionKernel {
    /// Both kernels.
    pub const ALL: [AttentionKernel; 2] = [AttentionKernel::Chunked, AttentionKernel::Pipelined];

    /// The kernel's entry point in `attention.cu`.
    pub const fn entry_point(self) -> &'static str {
        match self {
            AttentionKernel::Chunked => "paged_attention",
            AttentionKernel::Pipelined => "paged_attention_pipelined",
        }
    }
}

impl fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttentionKernel::Chunked => "chunked",
            AttentionKernel::Pipelined => "pipelined",
        })
    }
}

impl std::str::FromStr for AttentionKernel {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        AttentionKernel::ALL
            .into_iter()
            .find(|k| k.to_string() == s)
            .ok_or_else(|| format!("unknown attention kernel {s:?} (chunked or pipelined)"))
    }
}

/// The CUDA backend over device `D` (see the [module docs](self)).
pub struct CudaBackend<D: Device> {
    pub(crate) device: Arc<D>,
    config: CudaConfig,
    gemm: GemmChoice,
    /// The static buffers of the batch size being captured or replayed
    /// ([`crate::graph`]); `None`: eager. Shared by the clones, like the device.
    pub(crate) graph: Arc<Mutex<Option<GraphPool<D::Buffer>>>>,
    /// DoubleSparse channel lists uploaded by eager calls, by content, so a layer's list goes
    /// to the device once instead of on every call (a graph phase uploads its own as static
    /// inputs). Shared by the clones; emptied when it reaches [`DS_CHANNEL_LISTS`].
    ds_channels: Arc<ChannelLists<D::Buffer>>,
}

/// DoubleSparse channel lists on the device, by content.
type ChannelLists<B> = Mutex<HashMap<Vec<u32>, Arc<B>>>;

/// The most DoubleSparse channel lists a backend keeps on the device (a model has one a layer).
const DS_CHANNEL_LISTS: usize = 1024;

/// A clone shares the device (its memory, kernels and stream), so tensors and stores of one
/// clone are valid on the others.
impl<D: Device> Clone for CudaBackend<D> {
    fn clone(&self) -> Self {
        CudaBackend {
            device: Arc::clone(&self.device),
            config: self.config,
            gemm: self.gemm.clone(),
            graph: Arc::clone(&self.graph),
            ds_channels: Arc::clone(&self.ds_channels),
        }
    }
}

impl<D: Device> fmt::Debug for CudaBackend<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device.name())
            .field("config", &self.config)
            .field("gemm", &self.gemm)
            .finish()
    }
}

/// The backend's plan for one batch: the page table and the write list in device memory, and
/// the split-KV scratch its layers share.
pub struct CudaPlan<D: Device> {
    meta: BatchMetadata,
    table: Arc<D::Buffer>,
    writes: Arc<D::Buffer>,
    kept_writes: usize,
    max_kv_len: usize,
    /// `paged_prefill`'s query tiles ([`crate::plan::prefill_tiles`]) for the pack of query
    /// heads they were made for, and their count: uploaded by the first layer that attends
    /// with the kernel (whichever backend attends with the plan, its own
    /// [`CudaConfig::prefill_tensor_cores`] decides), reused by the later ones.
    prefill_tiles: Mutex<Option<PrefillTiles<D::Buffer>>>,
    scratch: Mutex<Option<SplitScratch<D::Buffer>>>,
    split: Mutex<Option<(SplitKey, SplitPlan)>>,
}

/// `paged_prefill`'s tile table in device memory, for one pack of query heads.
struct PrefillTiles<B> {
    pack: usize,
    tiles: Arc<B>,
    count: usize,
}

/// What the plan's first attention call chose its split plan for: every later layer with the
/// same key takes the plan as it is (the "plan once per batch"), without asking the
/// device for its wave again.
#[derive(PartialEq)]
struct SplitKey {
    spec: kernels::Spec,
    entry: &'static str,
    /// Blocks per (token or tile) and per split: head groups or packs of query heads.
    head_groups: usize,
    /// Tokens (`paged_attention`) or tiles (`paged_prefill`, whose count depends on the pack).
    rows: usize,
    target: usize,
}

/// `paged_attention`'s partial outputs and log-sum-exps, allocated by the first layer that
/// attends with the plan and reused by every later one (replaced by a larger pair when a call
/// needs more), so a layer allocates nothing but its output. Launches run in order on the
/// device, so a layer's kernels overwrite the scratch only after the previous layer's merge
/// has read it. With the merge in the kernel ([`CudaConfig::fuse_split_merge`]) also its
/// counters, one per attention block of a split: zeroed when allocated, and left at zero by
/// every launch (the merging block resets its counter).
struct SplitScratch<B> {
    o: Arc<B>,
    lse: Arc<B>,
    counters: Option<Arc<B>>,
}

/// The plan's split scratch, taken by one attention call (its slot locked meanwhile) and put
/// back by [`ScratchLease::release`] once the call's launches are queued.
struct ScratchLease<'p, B> {
    slot: std::sync::MutexGuard<'p, Option<SplitScratch<B>>>,
    scratch: SplitScratch<B>,
}

impl<B> ScratchLease<'_, B> {
    fn release(self) {
        let ScratchLease { mut slot, scratch } = self;
        *slot = Some(scratch);
    }
}

impl<D: Device> fmt::Debug for CudaPlan<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPlan")
            .field("meta", &self.meta)
            .finish_non_exhaustive()
    }
}

impl<D: Device> CudaPlan<D> {
    /// The batch metadata the plan was built from.
    pub fn metadata(&self) -> &BatchMetadata {
        &self.meta
    }
}

fn dim(what: &'static str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| AttentionError::InvalidConfig {
        field: what,
        reason: format!("{x} does not fit the kernels' 32-bit sizes"),
    })
}

impl<D: Device> CudaBackend<D> {
    /// A backend on `device`.
    pub fn new(device: D, config: CudaConfig) -> Self {
        let gemm = gemm::choose(config.enable_deterministic_inference, device.blas());
        CudaBackend {
            device: Arc::new(device),
            config,
            gemm,
            graph: Arc::new(Mutex::new(None)),
            ds_channels: Arc::default(),
        }
    }

    /// A clone (the same device, memory and graphs) whose paged attention runs `kernel`.
    pub fn with_attention_kernel(&self, kernel: AttentionKernel) -> Self {
        self.with_config(CudaConfig {
            attention_kernel: kernel,
            ..self.config
        })
    }

    /// A clone (the same device, memory and graphs) that merges split attention's partial
    /// states in the attention kernel when `fuse` ([`CudaConfig::fuse_split_merge`]).
    pub fn with_split_merge_in_kernel(&self, fuse: bool) -> Self {
        self.with_config(CudaConfig {
            fuse_split_merge: fuse,
            ..self.config
        })
    }

    /// A clone (the same device, memory and graphs) that runs absorbed MLA in the tensor-core
    /// form where it applies ([`CudaConfig::mla_tensor_cores`]).
    pub fn with_mla_tensor_cores(&self, on: bool) -> Self {
        self.with_config(CudaConfig {
            mla_tensor_cores: on,
            ..self.config
        })
    }

    /// A clone (the same device, memory and graphs) whose expert matmuls take the tensor-core
    /// form where it applies ([`CudaConfig::moe_tensor_cores`]).
    pub fn with_moe_tensor_cores(&self, on: bool) -> Self {
        self.with_config(CudaConfig {
            moe_tensor_cores: on,
            ..self.config
        })
    }

    /// A clone (the same device, memory and graphs) whose own-kernel matmuls take the
    /// tensor-core form where it applies ([`CudaConfig::gemm_tensor_cores`]).
    pub fn with_gemm_tensor_cores(&self, on: bool) -> Self {
        self.with_config(CudaConfig {
            gemm_tensor_cores: on,
            ..self.config
        })
    }

    /// A clone (the same device, memory and graphs) whose extend batches take the tensor-core
    /// prefill kernel where it applies ([`CudaConfig::prefill_tensor_cores`]).
    pub fn with_prefill_tensor_cores(&self, on: bool) -> Self {
        self.with_config(CudaConfig {
            prefill_tensor_cores: on,
            ..self.config
        })
    }

    /// A clone (the same device, memory and graphs) with `config`.
    pub fn with_config(&self, config: CudaConfig) -> Self {
        CudaBackend {
            gemm: gemm::choose(config.enable_deterministic_inference, self.device.blas()),
            config,
            ..self.clone()
        }
    }

    /// A clone (the same device, memory and graphs) whose matmuls take the crate's own kernels
    /// even where the vendor BLAS is loaded, as they do under a CUDA graph: for the checks and
    /// benches of those kernels.
    pub fn without_blas(&self) -> Self {
        CudaBackend {
            gemm: gemm::choose(
                self.config.enable_deterministic_inference,
                Err("the BLAS set aside by CudaBackend::without_blas".into()),
            ),
            ..self.clone()
        }
    }

    /// The device the backend launches on.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The GEMM path `matmul` takes, and why (for `kvserve info`).
    pub fn gemm_choice(&self) -> &GemmChoice {
        &self.gemm
    }

    /// An op's f32 output of `shape`, which the op's kernels overwrite whole: uninitialised
    /// when eager, a pool buffer under a graph ([`Self::alloc`]).
    fn output(&self, shape: &[usize]) -> Result<CudaTensor<D>> {
        let n: usize = shape.iter().product();
        Ok(CudaTensor {
            buf: self.alloc(n * 4)?,
            shape: shape.to_vec(),
            dtype: TensorDtype::F32,
        })
    }

    /// Launches on the device, or through the graph pool when one is installed.
    fn launch(
        &self,
        spec: &kernels::Spec,
        kernel: &str,
        cfg: crate::device::LaunchConfig,
        args: &[KernelArg<'_, D::Buffer>],
    ) -> Result<()> {
        if let Some(pool) = self.graph_slot().as_mut() {
            return pool.launch(&*self.device, spec, kernel, cfg, args);
        }
        self.device.launch(spec, kernel, cfg, args)
    }

    fn dense(
        &self,
        kernel: &str,
        cfg: crate::device::LaunchConfig,
        args: &[KernelArg<'_, D::Buffer>],
    ) -> Result<()> {
        self.launch(&kernels::dense(), kernel, cfg, args)
    }

    /// MHA/GQA geometry of a store, or why the kernels cannot attend over it.
    fn mha_dims(shape: &KvShape) -> std::result::Result<(usize, usize, usize), String> {
        match shape.kind {
            KvKind::Mha {
                kv_heads,
                head_dim,
                v_head_dim,
            } => {
                let (h, d, dv) = (kv_heads as usize, head_dim as usize, v_head_dim as usize);
                kernels::attention(shape.dtype, d, dv, 1, 1)?;
                Ok((h, d, dv))
            }
            KvKind::Mla { .. } => Err("attention over an MLA store is attention_mla".into()),
            // Dense extend runs the attention kernels over its K and V; decode, `ds_decode`.
            KvKind::DoubleSparse {
                kv_heads,
                head_dim,
                v_head_dim,
                ..
            } => {
                let (h, d, dv) = (kv_heads as usize, head_dim as usize, v_head_dim as usize);
                kernels::attention(shape.dtype, d, dv, 1, 1)?;
                kernels::sparse(shape.dtype)?;
                if d.max(dv) > geometry::DS_MAX_DIM {
                    return Err(format!(
                        "the DoubleSparse decode kernel takes heads of up to {} elements, not {}",
                        geometry::DS_MAX_DIM,
                        d.max(dv)
                    ));
                }
                Ok((h, d, dv))
            }
        }
    }
}

/// The dense kernels that read a weight, in a variant per weight type (`kernels/dense.cu`'s
/// `KVS_WEIGHT_VARIANTS`).
#[derive(Debug, Clone, Copy)]
enum WeightKernel {
    Matmul,
    Bmm,
    Embedding,
    MoeMatmul,
}

impl WeightKernel {
    /// The entry point reading a weight stored as `dtype`.
    fn name(self, dtype: TensorDtype) -> &'static str {
        use TensorDtype::{Bf16, F16, F32};
        match (self, dtype) {
            (WeightKernel::Matmul, F32) => "matmul",
            (WeightKernel::Matmul, F16) => "matmul_f16",
            (WeightKernel::Matmul, Bf16) => "matmul_bf16",
            (WeightKernel::Bmm, F32) => "bmm",
            (WeightKernel::Bmm, F16) => "bmm_f16",
            (WeightKernel::Bmm, Bf16) => "bmm_bf16",
            (WeightKernel::Embedding, F32) => "embedding",
            (WeightKernel::Embedding, F16) => "embedding_f16",
            (WeightKernel::Embedding, Bf16) => "embedding_bf16",
            (WeightKernel::MoeMatmul, F32) => "moe_matmul",
            (WeightKernel::MoeMatmul, F16) => "moe_matmul_f16",
            (WeightKernel::MoeMatmul, Bf16) => "moe_matmul_bf16",
        }
    }
}

/// A batch's (token, rank) rows grouped by expert (`moe_align`'s output): the rows in expert
/// order and the tile table the expert matmuls walk, `count` tiles of up to `tile_rows` rows.
struct MoeGroups<'a, B> {
    sorted: &'a B,
    tiles: &'a B,
    count: usize,
    tile_rows: u32,
}

impl<D: Device> CudaBackend<D> {
    /// The first `len` elements of `t` converted by the elementwise dense kernel `kernel`
    /// into a new buffer of `bytes` per element: `round_bf16` (f32 activations to bf16, a bf16
    /// weight's BLAS GEMM input) or `widen_f16` (an f16 weight to f32, for SGEMM).
    fn convert(
        &self,
        t: &CudaTensor<D>,
        kernel: &'static str,
        len: usize,
        bytes: usize,
    ) -> Result<Arc<D::Buffer>> {
        let out = self.alloc(len * bytes)?;
        self.dense(
            kernel,
            geometry::elementwise(kernel, len)?,
            &[
                KernelArg::Buf(&t.buf),
                KernelArg::Buf(&out),
                KernelArg::U32(dim("len", len)?),
            ],
        )?;
        Ok(out)
    }

    /// An expert matmul over `(x_div, kdim, n)`: for every grouped row `r`, `out[r] = x[r /
    /// x_div] · w[expert(r)]ᵀ` with `w` an expert's `[n, kdim]` matrix per row of the stack; by
    /// `moe_matmul_mma` over `x` rounded to bf16 when `groups` were tiled for it and `w` is
    /// bf16 with `kdim` a multiple of 8 ([`Self::moe_mma_takes`]), else by `moe_matmul`.
    fn moe_matmul(
        &self,
        x: &CudaTensor<D>,
        w: &CudaTensor<D>,
        groups: &MoeGroups<'_, D::Buffer>,
        out: &CudaTensor<D>,
        (x_div, kdim, n): (usize, usize, usize),
    ) -> Result<()> {
        let scalars = [
            KernelArg::U32(dim("top_k", x_div)?),
            KernelArg::U32(dim("kdim", kdim)?),
            KernelArg::U32(dim("n", n)?),
        ];
        if groups.tile_rows == geometry::GEMM_MMA_ROWS && self.moe_mma_takes(w, kdim) {
            let rounded = self.convert(x, "round_bf16", x.shape.iter().product(), 2)?;
            let mut args: Vec<KernelArg<'_, D::Buffer>> = vec![
                KernelArg::Buf(&rounded),
                KernelArg::Buf(&w.buf),
                KernelArg::Buf(groups.sorted),
                KernelArg::Buf(groups.tiles),
                KernelArg::Buf(&out.buf),
            ];
            args.extend(scalars);
            return self.dense(
                "moe_matmul_mma",
                geometry::moe_matmul_mma(groups.count, n)?,
                &args,
            );
        }
        let mut args: Vec<KernelArg<'_, D::Buffer>> = vec![
            KernelArg::Buf(&x.buf),
            KernelArg::Buf(&w.buf),
            KernelArg::Buf(groups.sorted),
            KernelArg::Buf(groups.tiles),
            KernelArg::Buf(&out.buf),
        ];
        args.extend(scalars);
        self.dense(
            WeightKernel::MoeMatmul.name(w.dtype),
            geometry::moe_matmul(groups.count, n)?,
            &args,
        )
    }

    /// Whether an expert matmul over `w` with inner dimension `kdim` takes `moe_matmul_mma`
    /// ([`CudaConfig::moe_tensor_cores`]): bf16 experts, rows of whole 16-byte units, and a
    /// device with tensor cores.
    fn moe_mma_takes(&self, w: &CudaTensor<D>, kdim: usize) -> bool {
        self.config.moe_tensor_cores
            && w.dtype == TensorDtype::Bf16
            && kdim % 8 == 0
            && self.device.tensor_cores()
    }
}

/// One `paged_attention` call: the specialisation, the query, the layer's cache buffers and
/// the scalars the kernel takes.
struct PagedAttention<'a, D: Device> {
    spec: kernels::Spec,
    q: &'a CudaTensor<D>,
    k_cache: &'a D::Buffer,
    v_cache: &'a D::Buffer,
    q_heads: usize,
    kv_heads: usize,
    v_head_dim: usize,
    page_size: u32,
    scale: f32,
    k_scale: f32,
    v_scale: f32,
}

/// One DoubleSparse attention call: its kernels, geometry and softmax scale, its label
/// channels on the device, channels per KV head and positions kept per query head.
struct DoubleSparse<D: Device> {
    spec: kernels::Spec,
    geo: MhaGeometry,
    scale: f32,
    channels: Arc<D::Buffer>,
    heavy: usize,
    top_k: usize,
}

impl<D: Device> CudaBackend<D> {
    /// `channels` on the device: uploaded once per distinct list when eager (kept in
    /// `ds_channels`), as a static input of the graph under one.
    fn ds_channel_list(&self, channels: &[u32]) -> Result<Arc<D::Buffer>> {
        if self.graph_phase().is_some() {
            return self.buffer_from(bytemuck::cast_slice(channels));
        }
        let mut lists = self.ds_channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(buf) = lists.get(channels) {
            return Ok(Arc::clone(buf));
        }
        if lists.len() >= DS_CHANNEL_LISTS {
            lists.clear();
        }
        let buf = self.buffer_from(bytemuck::cast_slice(channels))?;
        lists.insert(channels.to_vec(), Arc::clone(&buf));
        Ok(buf)
    }

    /// DoubleSparse channel lists this backend (and its clones) keep on the device.
    pub fn ds_channel_lists(&self) -> usize {
        self.ds_channels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The scales the kernels divide by when storing and multiply by when reading: the
    /// layer's for fp8 stores, 1 otherwise (as the host store).
    fn kernel_scales(store: &CudaKvStore<D>, layer: usize) -> Result<(f32, f32)> {
        let scales = store.scales(layer)?;
        Ok(if store.layout().shape.dtype.is_fp8() {
            scales
        } else {
            (1.0, 1.0)
        })
    }

    /// The grid of a kernel over the plan's write list (`store_kv`, `store_labels`): under a
    /// graph one block per token (the kernel reads the list's count, which padding rows
    /// sharing the padding slot lower); eager, one per kept write.
    fn write_list_blocks(&self, plan: &CudaPlan<D>) -> usize {
        match self.graph_phase() {
            Some(_) => plan.meta.num_tokens(),
            None => plan.kept_writes,
        }
    }

    /// Writes the batch's new rows `src` (one per token) into `buffer` of `layer` at the
    /// plan's `out_cache_loc`, converted to the store dtype (divided by `scale`).
    fn store_new_rows(
        &self,
        plan: &CudaPlan<D>,
        store: &CudaKvStore<D>,
        layer: usize,
        buffer: KvBuffer,
        src: &CudaTensor<D>,
        scale: f32,
    ) -> Result<()> {
        let blocks = self.write_list_blocks(plan);
        if blocks == 0 {
            return Ok(());
        }
        let row = store.layout().shape.row_elems(buffer);
        self.launch(
            store.spec(),
            "store_kv",
            geometry::per_row("store_kv", blocks, ROW_THREADS)?,
            &[
                KernelArg::Buf(&src.buf),
                KernelArg::Buf(&plan.writes),
                KernelArg::Buf(store.buffer(layer, buffer)),
                KernelArg::U32(dim("row", row)?),
                KernelArg::F32(scale),
            ],
        )
    }

    /// Writes the new tokens' DoubleSparse labels (their keys at the label channels) into the
    /// label buffer of `layer` at the plan's `out_cache_loc`.
    fn store_labels(
        &self,
        plan: &CudaPlan<D>,
        store: &CudaKvStore<D>,
        layer: usize,
        k: &CudaTensor<D>,
        ds: &DoubleSparse<D>,
    ) -> Result<()> {
        let blocks = self.write_list_blocks(plan);
        if blocks == 0 {
            return Ok(());
        }
        self.launch(
            &ds.spec,
            "store_labels",
            geometry::per_row("store_labels", blocks, ROW_THREADS)?,
            &[
                KernelArg::Buf(&k.buf),
                KernelArg::Buf(&plan.writes),
                KernelArg::Buf(&ds.channels),
                KernelArg::Buf(store.buffer(layer, KvBuffer::Label)),
                KernelArg::U32(dim("kv_heads", ds.geo.kv_heads)?),
                KernelArg::U32(dim("head_dim", ds.geo.head_dim)?),
                KernelArg::U32(dim("heavy_channels", ds.heavy)?),
            ],
        )
    }

    /// DoubleSparse decode: every (token, query head) attends over the `top_k` positions of its
    /// request with the best label scores (all of them when there are at most `top_k`).
    fn ds_decode(
        &self,
        plan: &CudaPlan<D>,
        store: &CudaKvStore<D>,
        layer: usize,
        q: &CudaTensor<D>,
        ds: &DoubleSparse<D>,
    ) -> Result<CudaTensor<D>> {
        let geo = &ds.geo;
        let n = plan.meta.num_tokens();
        let out = self.output(&[n, geo.q_heads, geo.v_head_dim])?;
        if n == 0 {
            return Ok(out);
        }
        let (k_scale, v_scale) = Self::kernel_scales(store, layer)?;
        self.launch(
            &ds.spec,
            "ds_decode",
            geometry::per_row("ds_decode", n * geo.q_heads, geometry::DS_THREADS)?,
            &[
                KernelArg::Buf(&q.buf),
                KernelArg::Buf(store.buffer(layer, KvBuffer::Key)),
                KernelArg::Buf(store.buffer(layer, KvBuffer::Value)),
                KernelArg::Buf(store.buffer(layer, KvBuffer::Label)),
                KernelArg::Buf(&plan.table),
                KernelArg::Buf(&ds.channels),
                KernelArg::Buf(&out.buf),
                KernelArg::U32(dim("q_heads", geo.q_heads)?),
                KernelArg::U32(dim("kv_heads", geo.kv_heads)?),
                KernelArg::U32(dim("head_dim", geo.head_dim)?),
                KernelArg::U32(dim("v_head_dim", geo.v_head_dim)?),
                KernelArg::U32(dim("heavy_channels", ds.heavy)?),
                KernelArg::U32(dim("top_k", ds.top_k.min(u32::MAX as usize))?),
                KernelArg::U32(store.layout().page_size),
                KernelArg::F32(ds.scale),
                KernelArg::F32(k_scale),
                KernelArg::F32(v_scale),
            ],
        )?;
        Ok(out)
    }

    /// The plan's split of the KV range for `key` over `key.rows` (tokens, or prefill tiles) ×
    /// `key.head_groups` blocks of `threads`, never shorter than `min_split` positions: chosen
    /// by the first call with that key ([`SplitPlan::filling_waves`] with the device's wave)
    /// and taken as it is by every later layer.
    fn split_plan(
        &self,
        plan: &CudaPlan<D>,
        key: SplitKey,
        min_split: usize,
        threads: u32,
    ) -> Result<SplitPlan> {
        let mut chosen = plan
            .split
            .lock()
            .map_err(|_| AttentionError::Device("split plan poisoned".into()))?;
        match &*chosen {
            Some((k, split)) if *k == key => Ok(*split),
            _ => {
                let split = SplitPlan::filling_waves(
                    key.rows,
                    key.head_groups,
                    plan.max_kv_len,
                    key.target,
                    min_split,
                    self.device.wave_blocks(&key.spec, key.entry, threads)?,
                );
                *chosen = Some((key, split));
                Ok(split)
            }
        }
    }

    /// The plan's split scratch for `split` over `rows` (token, query head) rows of
    /// `v_head_dim` values: a log-sum-exp per row and split, and unless the plan is unsplit
    /// (the kernel then writes the output itself) a partial output too. A larger pair replaces
    /// a smaller one; leased to the caller.
    fn split_scratch<'p>(
        &self,
        plan: &'p CudaPlan<D>,
        split: SplitPlan,
        rows: usize,
        v_head_dim: usize,
    ) -> Result<ScratchLease<'p, D::Buffer>> {
        let partials = split.num_splits as usize * rows;
        let lse_bytes = partials * 4;
        let o_bytes = if split.num_splits == 1 {
            0
        } else {
            partials * v_head_dim * 4
        };
        let mut slot = plan
            .scratch
            .lock()
            .map_err(|_| AttentionError::Device("split scratch poisoned".into()))?;
        let scratch = match slot.take() {
            Some(s) if self.device.len(&s.o) >= o_bytes && self.device.len(&s.lse) >= lse_bytes => {
                s
            }
            smaller => {
                drop(smaller); // freed before the larger pair is allocated
                SplitScratch {
                    o: self.alloc(o_bytes)?,
                    lse: self.alloc(lse_bytes)?,
                    counters: None,
                }
            }
        };
        Ok(ScratchLease { slot, scratch })
    }

    /// The plan's `paged_prefill` tile table for `pack` query heads a block, and its count
    /// (built and uploaded by the first call for that pack).
    fn prefill_tiles(&self, plan: &CudaPlan<D>, pack: usize) -> Result<(Arc<D::Buffer>, usize)> {
        let mut made = plan
            .prefill_tiles
            .lock()
            .map_err(|_| AttentionError::Device("prefill tiles poisoned".into()))?;
        if let Some(t) = &*made {
            if t.pack == pack {
                return Ok((Arc::clone(&t.tiles), t.count));
            }
        }
        let tiles = crate::plan::prefill_tiles(&plan.meta, PREFILL_ROWS / pack)?;
        let count = tiles.len() / 2;
        let buffer = self.buffer_from(bytemuck::cast_slice(&tiles))?;
        *made = Some(PrefillTiles {
            pack,
            tiles: Arc::clone(&buffer),
            count,
        });
        Ok((buffer, count))
    }

    /// `merge_states`: the `num_splits` partial states of each of `rows` rows into `out`.
    fn merge_splits(
        &self,
        spec: &kernels::Spec,
        (partial_o, partial_lse): (&D::Buffer, &D::Buffer),
        out: &D::Buffer,
        rows: usize,
        num_splits: u32,
    ) -> Result<()> {
        self.launch(
            spec,
            "merge_states",
            geometry::per_row("merge_states", rows, ATTN_THREADS)?,
            &[
                KernelArg::Buf(partial_o),
                KernelArg::Buf(partial_lse),
                KernelArg::Buf(out),
                KernelArg::U32(num_splits),
            ],
        )
    }

    /// `paged_prefill`: a block per tile of the plan's new tokens, pack of query heads of one KV
    /// head ([`prefill_pack`]: a tile is [`PREFILL_ROWS`] / pack tokens) and split of
    /// the KV range ([`SplitPlan`] over tiles × head blocks, splits of at least
    /// [`geometry::PREFILL_MIN_SPLIT`] positions), each writing its rows' normalised partial
    /// states, merged as [`paged_attention`](Self::paged_attention)'s are (unsplit, the kernel
    /// writes the output).
    fn paged_prefill(
        &self,
        plan: &CudaPlan<D>,
        a: &PagedAttention<'_, D>,
    ) -> Result<CudaTensor<D>> {
        let n = plan.meta.num_tokens();
        let out = self.output(&[n, a.q_heads, a.v_head_dim])?;
        let pack = prefill_pack(a.q_heads / a.kv_heads.max(1));
        let (tiles, count) = self.prefill_tiles(plan, pack)?;
        if count == 0 {
            return Ok(out);
        }
        let head_blocks = geometry::attention_head_groups(a.q_heads, a.kv_heads, pack as u32);
        let key = SplitKey {
            spec: a.spec.clone(),
            entry: "paged_prefill",
            head_groups: head_blocks,
            rows: count,
            target: self.config.split_kv_target_blocks,
        };
        let split = self.split_plan(
            plan,
            key,
            geometry::PREFILL_MIN_SPLIT,
            geometry::PREFILL_THREADS,
        )?;
        let unsplit = split.num_splits == 1;
        let lease = self.split_scratch(plan, split, n * a.q_heads, a.v_head_dim)?;
        let scratch = &lease.scratch;
        let partial_o = if unsplit { &*out.buf } else { &*scratch.o };
        self.launch(
            &a.spec,
            "paged_prefill",
            geometry::prefill(count, head_blocks, split)?,
            &[
                KernelArg::Buf(&a.q.buf),
                KernelArg::Buf(a.k_cache),
                KernelArg::Buf(a.v_cache),
                KernelArg::Buf(&plan.table),
                KernelArg::Buf(&tiles),
                KernelArg::Buf(partial_o),
                KernelArg::Buf(&scratch.lse),
                KernelArg::U32(dim("q_heads", a.q_heads)?),
                KernelArg::U32(dim("kv_heads", a.kv_heads)?),
                KernelArg::U32(dim("pack", pack)?),
                KernelArg::U32(a.page_size),
                KernelArg::U32(a.page_size.trailing_zeros()),
                KernelArg::U32(split.split_size),
                KernelArg::F32(a.scale),
                KernelArg::F32(a.k_scale),
                KernelArg::F32(a.v_scale),
            ],
        )?;
        if !unsplit {
            self.merge_splits(
                &a.spec,
                (partial_o, &scratch.lse),
                &out.buf,
                n * a.q_heads,
                split.num_splits,
            )?;
        }
        lease.release();
        Ok(out)
    }

    /// Attention of every token of the plan over its request's positions `0..=pos`, read back
    /// from the store: the KV range split across blocks by a [`SplitPlan`], then the splits
    /// merged by their log-sum-exp. Returns `[tokens, q_heads, v_head_dim]`. A plan of one
    /// split has nothing to merge: its partial outputs, laid out `[tokens, q_heads, 1,
    /// v_head_dim]`, are the output (normalised by the kernel, bitwise what `merge_states`
    /// would copy; only a row without a single key, which causal attention never has, would
    /// read 0 where the merge gave NaN), so the kernel writes them there and no merge is
    /// launched.
    fn paged_attention(
        &self,
        plan: &CudaPlan<D>,
        a: &PagedAttention<'_, D>,
    ) -> Result<CudaTensor<D>> {
        let n = plan.meta.num_tokens();
        let out = self.output(&[n, a.q_heads, a.v_head_dim])?;
        if n == 0 {
            return Ok(out);
        }
        // One block per KV head and group of up to heads_per_block of its query heads (GQA's
        // and MLA's share the KV rows the block reads).
        let entry = self.config.attention_kernel.entry_point();
        let head_groups = geometry::attention_head_groups(
            a.q_heads,
            a.kv_heads,
            a.spec.heads_per_block_of(entry),
        );
        let key = SplitKey {
            spec: a.spec.clone(),
            entry,
            head_groups,
            rows: n,
            target: self.config.split_kv_target_blocks,
        };
        let split = self.split_plan(plan, key, ATTN_THREADS as usize, ATTN_THREADS)?;
        let unsplit = split.num_splits == 1;
        let fuse = self.config.fuse_split_merge && !unsplit;
        let counter_bytes = if fuse { n * head_groups * 4 } else { 0 };
        let mut lease = self.split_scratch(plan, split, n * a.q_heads, a.v_head_dim)?;
        if fuse
            && lease
                .scratch
                .counters
                .as_ref()
                .is_none_or(|c| self.device.len(c) < counter_bytes)
        {
            let counters = self.alloc(counter_bytes)?;
            self.launch(
                &a.spec,
                "zero_counters",
                geometry::elementwise("zero_counters", n * head_groups)?,
                &[
                    KernelArg::Buf(&counters),
                    KernelArg::U32(dim("counters", n * head_groups)?),
                ],
            )?;
            lease.scratch.counters = Some(counters);
        }
        let scratch = &lease.scratch;
        let partial_lse = &*scratch.lse;
        let partial_o = if unsplit { &*out.buf } else { &*scratch.o };
        self.launch(
            &a.spec,
            entry,
            geometry::attention(n, head_groups, split)?,
            &[
                KernelArg::Buf(&a.q.buf),
                KernelArg::Buf(a.k_cache),
                KernelArg::Buf(a.v_cache),
                KernelArg::Buf(&plan.table),
                KernelArg::Buf(partial_o),
                KernelArg::Buf(partial_lse),
                KernelArg::U32(dim("q_heads", a.q_heads)?),
                KernelArg::U32(dim("kv_heads", a.kv_heads)?),
                KernelArg::U32(a.page_size),
                KernelArg::U32(a.page_size.trailing_zeros()),
                KernelArg::U32(split.split_size),
                KernelArg::F32(a.scale),
                KernelArg::F32(a.k_scale),
                KernelArg::F32(a.v_scale),
                KernelArg::Buf(&out.buf),
                // Unused without the merge in the kernel: any buffer.
                KernelArg::Buf(scratch.counters.as_deref().unwrap_or(partial_lse)),
                KernelArg::U32(u32::from(fuse)),
            ],
        )?;
        if !unsplit && !fuse {
            self.merge_splits(
                &a.spec,
                (partial_o, partial_lse),
                &out.buf,
                n * a.q_heads,
                split.num_splits,
            )?;
        }
        lease.release();
        Ok(out)
    }
}

impl<D: Device> Backend for CudaBackend<D> {
    type Tensor = CudaTensor<D>;
    type KvStore = CudaKvStore<D>;
    type Plan = CudaPlan<D>;

    fn name(&self) -> &str {
        self.device.name()
    }

    fn new_kv_store(&self, layout: KvLayout) -> Result<CudaKvStore<D>> {
        if self.graph_phase().is_some() {
            return Err(AttentionError::Device(
                "CUDA graph: a KV store cannot be created inside a captured forward".into(),
            ));
        }
        CudaKvStore::new(Arc::clone(&self.device), layout)
    }

    fn kv_support(&self, shape: &KvShape) -> std::result::Result<(), String> {
        match shape.kind {
            KvKind::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
            } => kernels::attention_mla(
                shape.dtype,
                kv_lora_rank as usize,
                qk_rope_head_dim as usize,
                1,
                false,
            )
            .map(|_| ()),
            _ => Self::mha_dims(shape).map(|_| ()),
        }
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<CudaTensor<D>> {
        self.upload_weight(data, shape, TensorDtype::F32)
    }

    /// Keeps f16 and bf16 weights in 16 bits: half the memory, and half the bytes a matmul
    /// reads. The kernels widen each element exactly as they load it; with the vendor BLAS a
    /// bf16 weight's GEMM runs on activations rounded to bf16 (`round_bf16`, then a bf16 GEMM
    /// accumulating in f32), as the trait allows. An f16 weight's GEMM always takes the kernel.
    fn upload_weight(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: TensorDtype,
    ) -> Result<CudaTensor<D>> {
        let n: usize = shape.iter().product();
        if data.len() != n {
            return Err(AttentionError::LengthMismatch {
                what: "data",
                expected: n,
                got: data.len(),
            });
        }
        let buf = match dtype {
            TensorDtype::F32 => self.buffer_from(bytemuck::cast_slice(data))?,
            _ => {
                let bits: Vec<u16> = data.iter().map(|&v| dtype.narrow(v)).collect();
                self.buffer_from(bytemuck::cast_slice(&bits))?
            }
        };
        Ok(CudaTensor {
            buf,
            shape: shape.to_vec(),
            dtype,
        })
    }

    fn download(&self, t: &CudaTensor<D>) -> Result<Vec<f32>> {
        if let Some(phase) = self.graph_phase() {
            if phase != Phase::Warmup {
                return Err(AttentionError::Device(format!(
                    "CUDA graph: a tensor cannot be read back inside a captured forward \
                     ({phase:?}): its values exist only after the replay"
                )));
            }
        }
        if t.dtype == TensorDtype::F32 {
            let mut out = vec![0f32; t.numel()];
            self.device
                .read(&t.buf, 0, bytemuck::cast_slice_mut(&mut out))?;
            return Ok(out);
        }
        let mut bits = vec![0u16; t.numel()];
        self.device
            .read(&t.buf, 0, bytemuck::cast_slice_mut(&mut bits))?;
        Ok(bits.into_iter().map(|b| t.dtype.widen(b)).collect())
    }

    fn reshape(&self, t: CudaTensor<D>, shape: &[usize]) -> Result<CudaTensor<D>> {
        check::reshape(&t.shape, shape)?;
        Ok(CudaTensor {
            buf: t.buf,
            shape: shape.to_vec(),
            dtype: t.dtype,
        })
    }

    fn matmul(&self, x: &CudaTensor<D>, w: &CudaTensor<D>) -> Result<CudaTensor<D>> {
        let (m, k, n) = check::matmul(&x.shape, &w.shape)?;
        check::f32_tensor("matmul's x", x.dtype)?;
        let mut out = self.output(&[m, n])?;
        if m * n == 0 {
            return Ok(out);
        }
        // Under a graph, GEMMs take the own kernel: cuBLAS allocates its workspace on first
        // use, which a capture refuses, and a pooled output is shared with the pool. So does
        // k = 0 (the kernel writes the zeros itself). An f16 weight reaches the BLAS only as
        // f32 (its activations may not be rounded, and no BLAS multiplies f16 by f32): widened
        // per call for a batch of more than one row block (prefill, where the GEMM's work
        // dwarfs the widening), the kernel reading its 16 bits otherwise ([`crate::gemm`]).
        let blas = match (self.gemm.path, self.graph_phase(), w.dtype) {
            _ if k == 0 => None,
            (GemmPath::Blas, None, TensorDtype::F32) => Some(GemmInputs::F32),
            (GemmPath::Blas, None, TensorDtype::Bf16) => Some(GemmInputs::Bf16),
            (GemmPath::Blas, None, TensorDtype::F16)
                if m > geometry::MATMUL_BLOCK_ROWS as usize =>
            {
                Some(GemmInputs::F32)
            }
            _ => None,
        }
        .and_then(|inputs| Some((gemm::gemm_args(m, k, n).ok()?, inputs)));
        if let Some((args, inputs)) = blas {
            let rounded = match inputs {
                GemmInputs::Bf16 => Some(self.convert(x, "round_bf16", m * k, 2)?),
                GemmInputs::F32 => None,
            };
            let widened = match w.dtype {
                TensorDtype::F16 => Some(self.convert(w, "widen_f16", n * k, 4)?),
                _ => None,
            };
            if let Some(out_buf) = Arc::get_mut(&mut out.buf) {
                let xb = rounded.as_ref().unwrap_or(&x.buf);
                let wb = widened.as_ref().unwrap_or(&w.buf);
                self.device.blas_gemm(&args, inputs, wb, xb, out_buf)?;
                return Ok(out);
            }
        }
        if self.config.gemm_tensor_cores
            && !self.config.enable_deterministic_inference
            && m > gemm::MMA_MIN_ROWS
            && w.dtype == TensorDtype::Bf16
            && k > 0
            && k % 8 == 0
            && self.device.tensor_cores()
        {
            let rounded = self.convert(x, "round_bf16", m * k, 2)?;
            return self
                .dense(
                    "matmul_mma",
                    geometry::matmul_mma(m, n)?,
                    &[
                        KernelArg::Buf(&rounded),
                        KernelArg::Buf(&w.buf),
                        KernelArg::Buf(&out.buf),
                        KernelArg::U32(dim("m", m)?),
                        KernelArg::U32(dim("k", k)?),
                        KernelArg::U32(dim("n", n)?),
                    ],
                )
                .map(|()| out);
        }
        self.dense(
            WeightKernel::Matmul.name(w.dtype),
            geometry::matmul(m, n)?,
            &[
                KernelArg::Buf(&x.buf),
                KernelArg::Buf(&w.buf),
                KernelArg::Buf(&out.buf),
                KernelArg::U32(dim("m", m)?),
                KernelArg::U32(dim("k", k)?),
                KernelArg::U32(dim("n", n)?),
            ],
        )?;
        Ok(out)
    }

    /// The own kernel (`bmm`, the lanes' GEMV of `matmul` per head along grid.z) at every
    /// size: MLA's absorptions are small (16 heads of 128 × 512), and a decode step's must be
    /// capturable.
    fn bmm(&self, x: &CudaTensor<D>, w: &CudaTensor<D>) -> Result<CudaTensor<D>> {
        let (n, heads, k, m) = check::bmm(&x.shape, &w.shape)?;
        check::f32_tensor("bmm's x", x.dtype)?;
        let out = self.output(&[n, heads, m])?;
        if n * heads * m == 0 {
            return Ok(out);
        }
        // The kernel indexes rows of x and out with 32 bits.
        dim("bmm rows", n * heads)?;
        self.dense(
            WeightKernel::Bmm.name(w.dtype),
            geometry::bmm(n, m, heads)?,
            &[
                KernelArg::Buf(&x.buf),
                KernelArg::Buf(&w.buf),
                KernelArg::Buf(&out.buf),
                KernelArg::U32(dim("n", n)?),
                KernelArg::U32(dim("k", k)?),
                KernelArg::U32(dim("m", m)?),
                KernelArg::U32(dim("heads", heads)?),
            ],
        )?;
        Ok(out)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor<D>,
        weight: &CudaTensor<D>,
        eps: f32,
    ) -> Result<CudaTensor<D>> {
        let (m, d) = check::rms_norm(&x.shape, &weight.shape)?;
        check::f32_tensor("rms_norm", x.dtype)?;
        check::f32_tensor("rms_norm's weight", weight.dtype)?;
        let out = self.output(&[m, d])?;
        if m * d > 0 {
            self.dense(
                "rms_norm",
                geometry::per_row("rms_norm", m, THREADS)?,
                &[
                    KernelArg::Buf(&x.buf),
                    KernelArg::Buf(&weight.buf),
                    KernelArg::Buf(&out.buf),
                    KernelArg::U32(dim("d", d)?),
                    KernelArg::F32(eps),
                ],
            )?;
        }
        Ok(out)
    }

    fn rotary(&self, x: &mut CudaTensor<D>, positions: &[u32], cfg: &RopeConfig) -> Result<()> {
        let inv = check::rotary(&x.shape, positions.len(), cfg)?;
        check::f32_tensor("rotary", x.dtype)?;
        let (n, heads) = (x.shape[0], x.shape[1]);
        if n == 0 || heads == 0 || inv.is_empty() {
            return Ok(());
        }
        // cos/sin in f64 on the host, rounded to f32: the table the CPU backend uses.
        let mut cs = Vec::with_capacity(n * inv.len() * 2);
        for &pos in positions {
            for &f in &inv {
                let (s, c) = (pos as f64 * f).sin_cos();
                cs.extend([c as f32, s as f32]);
            }
        }
        let table = self.buffer_from(bytemuck::cast_slice(&cs))?;
        self.dense(
            "rotary",
            geometry::elementwise("rotary", n * heads * inv.len())?,
            &[
                KernelArg::Buf(&x.buf),
                KernelArg::Buf(&table),
                KernelArg::U32(dim("n", n)?),
                KernelArg::U32(dim("heads", heads)?),
                KernelArg::U32(dim("head_dim", cfg.head_dim)?),
                KernelArg::U32(dim("rotary_dim", cfg.rotary_dim)?),
                KernelArg::U32(u32::from(cfg.style == RopeStyle::Neox)),
            ],
        )
    }

    fn silu_mul(&self, x: &CudaTensor<D>) -> Result<CudaTensor<D>> {
        let (m, d) = check::silu_mul(&x.shape)?;
        check::f32_tensor("silu_mul", x.dtype)?;
        let out = self.output(&[m, d])?;
        if m * d > 0 {
            self.dense(
                "silu_mul",
                geometry::elementwise("silu_mul", m * d)?,
                &[
                    KernelArg::Buf(&x.buf),
                    KernelArg::Buf(&out.buf),
                    KernelArg::U32(dim("m", m)?),
                    KernelArg::U32(dim("d", d)?),
                ],
            )?;
        }
        Ok(out)
    }

    fn add_assign(&self, x: &mut CudaTensor<D>, y: &CudaTensor<D>) -> Result<()> {
        check::add_assign(&x.shape, &y.shape)?;
        check::f32_tensor("add_assign", x.dtype)?;
        check::f32_tensor("add_assign", y.dtype)?;
        let n = x.numel();
        if n == 0 {
            return Ok(());
        }
        self.dense(
            "add_assign",
            geometry::elementwise("add_assign", n)?,
            &[
                KernelArg::Buf(&x.buf),
                KernelArg::Buf(&y.buf),
                KernelArg::U32(dim("len", n)?),
            ],
        )
    }

    fn embedding(&self, table: &CudaTensor<D>, ids: &[u32]) -> Result<CudaTensor<D>> {
        let (_, d) = check::embedding(&table.shape, ids)?;
        let out = self.output(&[ids.len(), d])?;
        if ids.is_empty() || d == 0 {
            return Ok(out);
        }
        let idx = self.buffer_from(bytemuck::cast_slice(ids))?;
        self.dense(
            WeightKernel::Embedding.name(table.dtype),
            geometry::per_row("embedding", ids.len(), THREADS)?,
            &[
                KernelArg::Buf(&table.buf),
                KernelArg::Buf(&idx),
                KernelArg::Buf(&out.buf),
                KernelArg::U32(dim("d", d)?),
            ],
        )?;
        Ok(out)
    }

    /// On the device (the trait's default reads both back to the host: a synchronisation, and
    /// impossible inside a captured graph).
    fn concat_last(&self, a: &CudaTensor<D>, b: &CudaTensor<D>) -> Result<CudaTensor<D>> {
        let (rows, da, db) = check::concat_last(&a.shape, &b.shape)?;
        check::f32_tensor("concat_last", a.dtype)?;
        check::f32_tensor("concat_last", b.dtype)?;
        let mut shape = a.shape.clone();
        *shape
            .last_mut()
            .expect("rank checked by check::concat_last") = da + db;
        let out = self.output(&shape)?;
        if rows == 0 || da + db == 0 {
            return Ok(out);
        }
        self.dense(
            "concat_last",
            geometry::per_row("concat_last", rows, THREADS)?,
            &[
                KernelArg::Buf(&a.buf),
                KernelArg::Buf(&b.buf),
                KernelArg::Buf(&out.buf),
                KernelArg::U32(dim("da", da)?),
                KernelArg::U32(dim("db", db)?),
            ],
        )?;
        Ok(out)
    }

    /// On the device, with no read-back (so a decode forward with MoE layers captures):
    /// `moe_topk` routes every token (ids and weights in device memory), `moe_align` groups
    /// the (token, rank) rows by expert into tiles (SGLang's `moe_align_block_size`),
    /// `moe_matmul` runs each tile through its expert's gate and up rows, `silu_mul`,
    /// `moe_matmul` again through the expert's down rows, and `moe_combine` adds a token's
    /// rows weighted, in rank order. An expert's weights are read once per tile of up to
    /// [`geometry::MOE_TILE`] of its rows, or [`geometry::GEMM_MMA_ROWS`] where either matmul
    /// takes the tensor-core form ([`CudaConfig::moe_tensor_cores`]); every output is one dot
    /// product in a fixed k order whatever shares its tile, so results are batch-invariant.
    /// Every buffer and grid is sized by the batch alone (tiles: [`geometry::moe_tiles`]), as a
    /// graph replay needs.
    fn fused_moe(
        &self,
        h: &CudaTensor<D>,
        router_logits: &CudaTensor<D>,
        experts: &MoeExperts<CudaTensor<D>>,
        routing: &MoeRouting,
    ) -> Result<CudaTensor<D>> {
        let dims = attention::moe::check(h, router_logits, experts, routing)?;
        check::f32_tensor("fused_moe's hidden states", h.dtype)?;
        check::f32_tensor("fused_moe's router logits", router_logits.dtype)?;
        let (n, d, e, i, k) = (
            dims.tokens,
            dims.hidden,
            dims.experts,
            dims.intermediate,
            dims.top_k,
        );
        if e > geometry::MOE_MAX_EXPERTS {
            // Eager: the host algorithm (a read-back), as every backend without kernels runs.
            if self.graph_phase().is_none() {
                return attention::moe::fused_moe_by_embedding(
                    self,
                    h,
                    router_logits,
                    experts,
                    routing,
                );
            }
            return Err(AttentionError::Unsupported(format!(
                "fused_moe under a CUDA graph: {e} experts; the kernels group rows for at \
                 most {} (decode runs eagerly)",
                geometry::MOE_MAX_EXPERTS
            )));
        }
        let out = self.output(&[n, d])?;
        if n == 0 {
            return Ok(out);
        }
        let rows = n * k;
        let tile_rows =
            if self.moe_mma_takes(&experts.gate_up, d) || self.moe_mma_takes(&experts.down, i) {
                geometry::GEMM_MMA_ROWS
            } else {
                geometry::MOE_TILE
            };
        let tiles = geometry::moe_tiles(rows, e, tile_rows);
        let ids = self.alloc(rows * 4)?;
        let weights = self.output(&[n, k])?;
        self.dense(
            "moe_topk",
            geometry::elementwise("moe_topk", n)?,
            &[
                KernelArg::Buf(&router_logits.buf),
                KernelArg::Buf(&ids),
                KernelArg::Buf(&weights.buf),
                KernelArg::U32(dim("n", n)?),
                KernelArg::U32(dim("experts", e)?),
                KernelArg::U32(dim("top_k", k)?),
                KernelArg::U32(u32::from(routing.renormalize)),
                KernelArg::F32(routing.routed_scaling_factor as f32),
            ],
        )?;
        let sorted = self.alloc(rows * 4)?;
        let tile_table = self.alloc(tiles * 3 * 4)?;
        self.dense(
            "moe_align",
            geometry::per_row("moe_align", 1, THREADS)?,
            &[
                KernelArg::Buf(&ids),
                KernelArg::Buf(&sorted),
                KernelArg::Buf(&tile_table),
                KernelArg::U32(dim("rows", rows)?),
                KernelArg::U32(dim("experts", e)?),
                KernelArg::U32(dim("tiles", tiles)?),
                KernelArg::U32(tile_rows),
            ],
        )?;
        let grouped: MoeGroups<'_, D::Buffer> = MoeGroups {
            sorted: &sorted,
            tiles: &tile_table,
            count: tiles,
            tile_rows,
        };
        let gate_up = self.output(&[rows, 2 * i])?;
        self.moe_matmul(h, &experts.gate_up, &grouped, &gate_up, (k, d, 2 * i))?;
        let act = self.silu_mul(&gate_up)?;
        let down = self.output(&[rows, d])?;
        self.moe_matmul(&act, &experts.down, &grouped, &down, (1, i, d))?;
        self.dense(
            "moe_combine",
            geometry::elementwise("moe_combine", n * d)?,
            &[
                KernelArg::Buf(&down.buf),
                KernelArg::Buf(&weights.buf),
                KernelArg::Buf(&out.buf),
                KernelArg::U32(dim("n", n)?),
                KernelArg::U32(dim("top_k", k)?),
                KernelArg::U32(dim("d", d)?),
            ],
        )?;
        Ok(out)
    }

    fn synchronize(&self) -> Result<()> {
        self.device.synchronize()
    }

    fn device_memory(&self) -> Result<Option<attention::DeviceMemory>> {
        self.device.memory_info()
    }

    fn plan(&self, meta: &BatchMetadata) -> Result<CudaPlan<D>> {
        let table = page_table(meta)?;
        let writes = write_list(meta.out_cache_loc());
        let mut max_kv_len = meta.kv_lens().iter().copied().max().unwrap_or(0);
        let mut table_bytes = table.len() * 4;
        if let Some(tape) = self.graph_slot().as_ref().map(|p| p.tape()) {
            if max_kv_len > tape.max_kv_len {
                return Err(AttentionError::InvalidConfig {
                    field: "kv_len",
                    reason: format!(
                        "{max_kv_len} positions exceed the captured graph's {}",
                        tape.max_kv_len
                    ),
                });
            }
            (max_kv_len, table_bytes) = (tape.max_kv_len, tape.table_bytes);
        }
        Ok(CudaPlan {
            meta: meta.clone(),
            table: self.upload_bytes(bytemuck::cast_slice(&table), table_bytes)?,
            // Room for every token's write: padding rows share one slot, so the dummy batch
            // a graph is captured with keeps fewer writes than a real one.
            writes: self.upload_bytes(
                bytemuck::cast_slice(&writes),
                (1 + 2 * meta.out_cache_loc().len()) * 4,
            )?,
            kept_writes: writes[0] as usize,
            max_kv_len,
            prefill_tiles: Mutex::new(None),
            scratch: Mutex::new(None),
            split: Mutex::new(None),
        })
    }

    fn attention(
        &self,
        layer: usize,
        plan: &CudaPlan<D>,
        store: &mut CudaKvStore<D>,
        q: &CudaTensor<D>,
        k: &CudaTensor<D>,
        v: &CudaTensor<D>,
        params: &AttentionParams,
    ) -> Result<CudaTensor<D>> {
        let layout = *store.layout();
        for t in [q, k, v] {
            check::f32_tensor("attention", t.dtype)?;
        }
        let geo = check::attention(
            layer,
            &plan.meta,
            &layout,
            (&q.shape, &k.shape, &v.shape),
            params,
        )?;
        Self::mha_dims(&layout.shape).map_err(AttentionError::Unsupported)?;
        let spec = kernels::attention(
            layout.shape.dtype,
            geo.head_dim,
            geo.v_head_dim,
            layout.page_size,
            geo.q_heads / geo.kv_heads.max(1),
        )
        .map_err(AttentionError::Unsupported)?;
        let (k_scale, v_scale) = Self::kernel_scales(store, layer)?;
        // 1. The new tokens' K and V at out_cache_loc, converted to the store dtype.
        self.store_new_rows(plan, store, layer, KvBuffer::Key, k, k_scale)?;
        self.store_new_rows(plan, store, layer, KvBuffer::Value, v, v_scale)?;
        // DoubleSparse: the labels too, and decode batches attend over each head's top_k.
        if let (Some(heavy), Some(ds)) = (geo.heavy_channels, &params.double_sparse) {
            let sparse = DoubleSparse {
                spec: kernels::sparse(layout.shape.dtype).map_err(AttentionError::Unsupported)?,
                geo,
                scale: params.scale,
                channels: self.ds_channel_list(&ds.channels)?,
                heavy,
                top_k: ds.top_k,
            };
            self.store_labels(plan, store, layer, k, &sparse)?;
            if plan.meta.is_decode() {
                return self.ds_decode(plan, store, layer, q, &sparse);
            }
        }
        // 2. Attention over every position read back from the store: an extend batch on the
        //    tensor-core prefill kernel where it applies, else the configured kernel.
        let call = PagedAttention {
            spec,
            q,
            k_cache: store.buffer(layer, KvBuffer::Key),
            v_cache: store.buffer(layer, KvBuffer::Value),
            q_heads: geo.q_heads,
            kv_heads: geo.kv_heads,
            v_head_dim: geo.v_head_dim,
            page_size: layout.page_size,
            scale: params.scale,
            k_scale,
            v_scale,
        };
        if !plan.meta.is_decode()
            && self.config.prefill_tensor_cores
            && call.spec.has_prefill()
            && self.device.tensor_cores()
        {
            self.paged_prefill(plan, &call)
        } else {
            self.paged_attention(plan, &call)
        }
    }

    fn attention_mla(
        &self,
        layer: usize,
        plan: &CudaPlan<D>,
        store: &mut CudaKvStore<D>,
        q: &CudaTensor<D>,
        latent: &CudaTensor<D>,
        params: &AttentionParams,
    ) -> Result<CudaTensor<D>> {
        let layout = *store.layout();
        check::f32_tensor("attention_mla", q.dtype)?;
        check::f32_tensor("attention_mla", latent.dtype)?;
        let (heads, d, dv) =
            check::attention_mla(layer, &plan.meta, &layout, &q.shape, &latent.shape, params)?;
        let tensor_cores = self.config.mla_tensor_cores && self.device.tensor_cores();
        let spec = kernels::attention_mla(
            layout.shape.dtype,
            dv,
            d - dv,
            layout.page_size,
            tensor_cores,
        )
        .map_err(AttentionError::Unsupported)?;
        let (k_scale, _) = Self::kernel_scales(store, layer)?;
        // 1. The new tokens' latent rows at out_cache_loc.
        self.store_new_rows(plan, store, layer, KvBuffer::Key, latent, k_scale)?;
        // 2. Every head attends over the one latent row per position: scores over the whole
        //    row, values its first kv_lora_rank elements (the same buffer, the same scale).
        let latent_rows = store.buffer(layer, KvBuffer::Key);
        self.paged_attention(
            plan,
            &PagedAttention {
                spec,
                q,
                k_cache: latent_rows,
                v_cache: latent_rows,
                q_heads: heads,
                kv_heads: 1,
                v_head_dim: dv,
                page_size: layout.page_size,
                scale: params.scale,
                k_scale,
                v_scale: k_scale,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_kernels_parse_their_names_and_name_their_entry_points() {
        for k in AttentionKernel::ALL {
            assert_eq!(k.to_string().parse::<AttentionKernel>(), Ok(k));
            assert!(crate::specs::Source::Attention
                .kernels()
                .contains(&k.entry_point()));
        }
        assert_eq!(AttentionKernel::default(), AttentionKernel::Pipelined);
        let err = "flash".parse::<AttentionKernel>().unwrap_err();
        assert!(err.contains("chunked or pipelined"), "{err}");
    }
}
