//! The compute-backend traits every device implements: [`DeviceTensor`] and [`Backend`]. The
//! parameter types of their ops live in [`crate::params`] and [`crate::rope`]; the input
//! validation every implementation runs in [`crate::check`].

use kv_pool::{KvLayout, KvShape, KvStore};

use crate::error::Result;
use crate::metadata::BatchMetadata;
use crate::moe::{MoeExperts, MoeRouting};
use crate::params::AttentionParams;
use crate::rope::RopeConfig;

/// Element type of a device tensor. The CPU backend computes in [`TensorDtype::F32`] only;
/// devices may keep weights in 16-bit types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorDtype {
    /// IEEE binary32: what every op computes in.
    F32,
    /// IEEE binary16: 10-bit mantissa, range ±65504.
    F16,
    /// bfloat16: f32's exponent range with a 7-bit mantissa.
    Bf16,
}

impl TensorDtype {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            TensorDtype::F32 => 4,
            TensorDtype::F16 | TensorDtype::Bf16 => 2,
        }
    }

    /// `v` rounded to this type (to nearest, ties to even), as f32: the value a tensor of
    /// this type holds for it.
    pub fn round(self, v: f32) -> f32 {
        match self {
            TensorDtype::F32 => v,
            _ => self.widen(self.narrow(v)),
        }
    }

    /// The 16-bit pattern of `v` rounded to this type (to nearest, ties to even); f32 has none
    /// and gives 0. What a backend keeping a weight in 16 bits stores.
    pub fn narrow(self, v: f32) -> u16 {
        match self {
            TensorDtype::F32 => 0,
            TensorDtype::F16 => half::f16::from_f32(v).to_bits(),
            TensorDtype::Bf16 => half::bf16::from_f32(v).to_bits(),
        }
    }

    /// The exact f32 value of a 16-bit pattern of this type (f32: 0).
    pub fn widen(self, bits: u16) -> f32 {
        match self {
            TensorDtype::F32 => 0.0,
            TensorDtype::F16 => half::f16::from_bits(bits).to_f32(),
            TensorDtype::Bf16 => half::bf16::from_bits(bits).to_f32(),
        }
    }
}

/// A device's memory as its driver reports it (`cuMemGetInfo`, `hipMemGetInfo`): what SGLang's
/// `--mem-fraction-static` sizes the KV pool from once the weights are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes no allocation holds.
    pub free_bytes: u64,
    /// The device's memory.
    pub total_bytes: u64,
}

/// A tensor owned by a backend: a row-major array with a shape and an element type. Data moves
/// in and out only through [`Backend::upload`] and [`Backend::download`].
pub trait DeviceTensor {
    /// Dimensions, outermost first (row-major: the last dimension is contiguous).
    fn shape(&self) -> &[usize];
    /// How the elements are stored on the device; [`Backend::download`] always returns f32.
    fn dtype(&self) -> TensorDtype;
    /// Number of elements (the product of the shape).
    fn numel(&self) -> usize {
        self.shape().iter().product()
    }
}

/// A compute backend: device tensors, the dense ops of a decoder layer, and paged attention
/// over a KV store. Every method validates its input and returns typed errors instead of
/// panicking; signatures are device-neutral (host slices only for small index lists).
///
/// Attention follows SGLang's contract: [`plan`](Backend::plan) once per batch, then per layer
/// one attention call that first writes the new K/V (and DoubleSparse labels) at the plan's
/// `out_cache_loc` and then attends over every request's slots read through the page table.
/// Backends never allocate or free slots.
#[doc(alias = "AttentionBackend")]
pub trait Backend {
    /// The backend's tensor: device memory the ops read and write, reached from the host only
    /// through [`upload`](Backend::upload) and [`download`](Backend::download).
    type Tensor: DeviceTensor;
    /// The KV store attention writes and reads, in the backend's memory (kv-pool's trait, so
    /// its raw rows and packed pages are byte-compatible with [`kv_pool::HostKvStore`]).
    type KvStore: KvStore;
    /// What [`plan`](Backend::plan) derives once per batch from [`BatchMetadata`] (page tables
    /// in the backend's memory) and every layer's attention call reuses.
    type Plan;

    /// A short name for logs and test output (`"cpu"`, `"wgpu"`); conformance outcomes start
    /// with it.
    fn name(&self) -> &str;

    /// Allocates a zeroed KV store for `layout` in the backend's memory.
    fn new_kv_store(&self, layout: KvLayout) -> Result<Self::KvStore>;

    /// Whether this backend can hold a store of `shape` and attend over it: `Err(reason)` for a
    /// dtype or attention kind the backend (or its device) lacks, such as f16 on an adapter
    /// without f16 shaders. Callers (the conformance suite, an engine choosing a KV dtype)
    /// ask before they build a store; the ops themselves still refuse with a typed
    /// [`AttentionError::Unsupported`](crate::AttentionError::Unsupported). The default supports everything.
    fn kv_support(&self, shape: &KvShape) -> std::result::Result<(), String> {
        let _ = shape;
        Ok(())
    }

    /// Copies host data into a new tensor of `shape` (`data.len()` must match it).
    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<Self::Tensor>;

    /// Copies a weight into a new tensor of `shape` kept in `dtype` where the backend can
    /// (a checkpoint's bf16 or f16 matrices: `data` holds their exact f32 values, so nothing is
    /// rounded). Such a tensor is only taken as [`matmul`](Backend::matmul)'s `w`,
    /// [`logits`](Backend::logits)' `lm_head`, [`embedding`](Backend::embedding)'s table and by
    /// [`download`](Backend::download), and gives the results its f32 values give, but for one
    /// liberty: a backend may compute a bf16 weight's matmul on activations rounded to bf16
    /// (the CPU backend does, as llama.cpp and SGLang's CPU kernels: `vdpbf16ps` arithmetic),
    /// off by at most 2⁻⁸ relative per input element (bf16 keeps 8 significant bits). The default keeps f32
    /// ([`upload`](Backend::upload)).
    fn upload_weight(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: TensorDtype,
    ) -> Result<Self::Tensor> {
        let _ = dtype;
        self.upload(data, shape)
    }

    /// Reads a tensor back to the host as f32.
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;

    /// Gives a tensor a new shape with the same number of elements (no data movement).
    fn reshape(&self, t: Self::Tensor, shape: &[usize]) -> Result<Self::Tensor>;

    /// `x · Wᵀ`: `x` is `[m, k]`, `w` is `[n, k]` (PyTorch's `Linear` weight), the result
    /// `[m, n]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Tensor>;

    /// `x · Wᵢᵀ` for every weight of `ws` (each `[nᵢ, k]` with `x`'s `k`): the results of
    /// [`matmul`](Backend::matmul) for each, bitwise, in order. A backend may run them as one
    /// op: the CPU backend splits the union of their output columns over its threads (one
    /// dispatch for SGLang's `QKVParallelLinear` instead of three). The default calls
    /// `matmul` per weight.
    fn matmul_many(&self, x: &Self::Tensor, ws: &[&Self::Tensor]) -> Result<Vec<Self::Tensor>> {
        ws.iter().map(|w| self.matmul(x, w)).collect()
    }

    /// A matmul per head (SGLang's `torch.bmm` over MLA's per-head `w_kc` and `w_vc`):
    /// `x` `[n, heads, k]` and `w` `[heads, m, k]` give `[n, heads, m]` with
    /// `out[t, h] = x[t, h] · w[h]ᵀ`, each head's product as [`matmul`](Backend::matmul)
    /// computes it (so `w` may be a 16-bit weight from
    /// [`upload_weight`](Backend::upload_weight), and the same rounding rules hold).
    fn bmm(&self, x: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Tensor>;

    /// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) · weight`; `x` is `[m, d]`,
    /// `weight` is `[d]`.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;

    /// Applies rotary embedding in place to `x` of shape `[n, heads, cfg.head_dim]`, token `i` at
    /// position `positions[i]`.
    fn rotary(&self, x: &mut Self::Tensor, positions: &[u32], cfg: &RopeConfig) -> Result<()>;

    /// SGLang's `SiluAndMul`: `x` is `[m, 2d]` (gate, then up); the result is
    /// `silu(gate) · up`, `[m, d]`.
    fn silu_mul(&self, x: &Self::Tensor) -> Result<Self::Tensor>;

    /// Residual add in place: `x += y` (equal shapes).
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;

    /// Row gather: `table` is `[vocab, d]`, the result `[ids.len(), d]` (embedding lookup; also
    /// selects the last hidden row of each request before the final logits).
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;

    /// Concatenation along the last dimension: `a` is `[.., da]`, `b` is `[.., db]` with the
    /// same leading dimensions; the result is `[.., da + db]`, each row `a`'s row then `b`'s
    /// (the MLA decoder assembles its query and latent rows from a no-position part and a
    /// rotary part with it).
    ///
    /// The default goes through the host ([`download`](Backend::download), interleave,
    /// [`upload`](Backend::upload)), so every backend has it; a device may override it with a
    /// kernel. It is exact (a copy), so the result is the same on every backend.
    fn concat_last(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor> {
        let (rows, da, db) = crate::check::concat_last(a.shape(), b.shape())?;
        let (ha, hb) = (self.download(a)?, self.download(b)?);
        let mut out = Vec::with_capacity(rows * (da + db));
        for r in 0..rows {
            out.extend_from_slice(&ha[r * da..(r + 1) * da]);
            out.extend_from_slice(&hb[r * db..(r + 1) * db]);
        }
        let mut shape = a.shape().to_vec();
        *shape.last_mut().expect("rank checked above") = da + db;
        self.upload(&out, &shape)
    }

    /// SGLang's `FusedMoE` (top-k routing and the routed experts of a mixture-of-experts MLP;
    /// shared experts are the model's dense ops): `h` `[n, hidden]`, `router_logits`
    /// `[n, experts]` (the router's matmul); each token goes to its `routing.top_k` experts
    /// ([`moe::route_token`](crate::moe::route_token)'s rule), and the result `[n, hidden]` is
    /// the sum over them, in rank order, of the routing weight times the expert's
    /// `down · silu_mul(gate_up · h)`. Input is checked by [`moe::check`](crate::moe::check).
    ///
    /// The default runs [`moe::fused_moe_by_embedding`](crate::moe::fused_moe_by_embedding):
    /// the routing on the host (a read-back), every backend has it; a device overrides it with
    /// kernels that keep the routing on the device, so a decode forward with MoE layers can be
    /// captured.
    fn fused_moe(
        &self,
        h: &Self::Tensor,
        router_logits: &Self::Tensor,
        experts: &MoeExperts<Self::Tensor>,
        routing: &MoeRouting,
    ) -> Result<Self::Tensor> {
        crate::moe::fused_moe_by_embedding(self, h, router_logits, experts, routing)
    }

    /// Final logits `hidden · lm_headᵀ`: `hidden` `[m, d]`, `lm_head` `[vocab, d]`.
    fn logits(&self, hidden: &Self::Tensor, lm_head: &Self::Tensor) -> Result<Self::Tensor> {
        self.matmul(hidden, lm_head)
    }

    /// Builds the backend's plan for one batch (once per batch, reused by every layer).
    fn plan(&self, meta: &BatchMetadata) -> Result<Self::Plan>;

    /// Waits until every op submitted so far has finished (for timing: a device backend
    /// returns from an op once it is queued). A no-op where ops run to completion when called.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The memory of the device the backend computes on, as its driver reports it now, or
    /// `None` where the backend cannot tell (the default: the CPU, whose memory is the host's,
    /// and wgpu, which exposes none).
    fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        Ok(None)
    }

    /// MHA / GQA / MQA (and DoubleSparse) attention for one layer.
    ///
    /// `q` is `[n, q_heads, head_dim]`, `k` `[n, kv_heads, head_dim]`, `v`
    /// `[n, kv_heads, v_head_dim]` with `n = meta.num_tokens()` and `q_heads` a multiple of
    /// `kv_heads` (the store's). Writes `k`, `v` (and DoubleSparse labels) at `out_cache_loc`,
    /// then attends causally; returns `[n, q_heads, v_head_dim]`. DoubleSparse decode batches
    /// attend over each query head's top-k tokens by label score.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        layer: usize,
        plan: &Self::Plan,
        store: &mut Self::KvStore,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        params: &AttentionParams,
    ) -> Result<Self::Tensor>;

    /// MLA attention in absorbed form for one layer.
    ///
    /// `q` is `[n, heads, kv_lora_rank + rope_dim]` (the absorbed no-position part, then the
    /// rotary part), `latent` `[n, kv_lora_rank + rope_dim]` (the compressed KV, then the rotary
    /// key). Writes `latent` at `out_cache_loc`, then attends causally with scores
    /// `scale · q·latent` over the whole row and values the first `kv_lora_rank` dims of each
    /// latent row; returns `[n, heads, kv_lora_rank]`.
    fn attention_mla(
        &self,
        layer: usize,
        plan: &Self::Plan,
        store: &mut Self::KvStore,
        q: &Self::Tensor,
        latent: &Self::Tensor,
        params: &AttentionParams,
    ) -> Result<Self::Tensor>;
}
