//! The compute-backend traits every device implements, and the parameter types of their ops.

use kv_pool::{KvLayout, KvShape, KvStore};

use crate::error::{AttentionError, Result};
use crate::metadata::BatchMetadata;

/// Element type of a device tensor. The CPU backend computes in [`TensorDtype::F32`] only;
/// devices may keep weights in 16-bit types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

/// A tensor owned by a backend: a row-major array with a shape and an element type. Data moves
/// in and out only through [`Backend::upload`] and [`Backend::download`].
pub trait DeviceTensor {
    /// Dimensions, outermost first.
    fn shape(&self) -> &[usize];
    /// Element type.
    fn dtype(&self) -> TensorDtype;
    /// Number of elements (the product of the shape).
    fn numel(&self) -> usize {
        self.shape().iter().product()
    }
}

/// Rotary layout: which elements form a rotated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// GPT-NeoX / Llama (HF `rotate_half`): element `i` pairs with `i + rotary_dim / 2`.
    Neox,
    /// GPT-J (interleaved): element `2i` pairs with `2i + 1`.
    GptJ,
}

/// Frequency scaling applied to the rotary inverse frequencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Linear position interpolation: every inverse frequency divided by `factor`.
    Linear {
        /// Divisor (`≥ 1` in practice; must be finite and `> 0`).
        factor: f64,
    },
    /// Llama 3 (`rope_type = "llama3"` in HF configs): long wavelengths are divided by `factor`,
    /// short ones kept, and the band in between interpolated smoothly.
    Llama3 {
        /// Scale for low frequencies (e.g. 8.0).
        factor: f64,
        /// e.g. 1.0.
        low_freq_factor: f64,
        /// e.g. 4.0.
        high_freq_factor: f64,
        /// The pre-training context (e.g. 8192).
        original_max_position_embeddings: f64,
    },
    /// YaRN (`rope_type` / `type = "yarn"`) inverse frequencies, as DeepSeek-V2 and HF
    /// compute them: with `d = rotary_dim`, the correction dims
    /// `c(r) = d · ln(original / (2π r)) / (2 ln θ)`, `low = max(⌊c(beta_fast)⌋, 0)` and
    /// `high = min(⌈c(beta_slow)⌉, d − 1)`, the ramp `γ_i = clamp((i − low) / (high − low), 0,
    /// 1)` (`high` nudged by 0.001 when equal to `low`), each frequency is
    /// `f_i / factor · γ_i + f_i · (1 − γ_i)`. Only the frequencies: YaRN's magnitude scale
    /// (`mscale` on cos/sin and on the softmax scale) is the model's to apply.
    Yarn {
        /// Context extension factor (e.g. 40).
        factor: f64,
        /// The pre-training context (e.g. 4096).
        original_max_position_embeddings: f64,
        /// Rotations above which dims are kept (extrapolated), e.g. 32.
        beta_fast: f64,
        /// Rotations below which dims are interpolated, e.g. 1.
        beta_slow: f64,
    },
}

/// Rotary position embedding of one tensor of heads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Dimension of each head (the last dimension of the tensor).
    pub head_dim: usize,
    /// Leading dims of each head that are rotated (`≤ head_dim`, even); the rest pass through.
    pub rotary_dim: usize,
    /// Base of the frequencies (`rope_theta`).
    pub theta: f64,
    /// Pairing of rotated elements.
    pub style: RopeStyle,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// Full-head NeoX rotary with no scaling.
    pub fn neox(head_dim: usize, theta: f64) -> Self {
        RopeConfig {
            head_dim,
            rotary_dim: head_dim,
            theta,
            style: RopeStyle::Neox,
            scaling: RopeScaling::None,
        }
    }

    /// Validates the configuration and returns the `rotary_dim / 2` inverse frequencies, in f64
    /// (every backend derives its tables from these, so they agree on the scaling rules).
    pub fn inv_freqs(&self) -> Result<Vec<f64>> {
        let bad = |field, reason: String| Err(AttentionError::InvalidConfig { field, reason });
        if self.rotary_dim == 0 || self.rotary_dim % 2 != 0 || self.rotary_dim > self.head_dim {
            return bad(
                "rotary_dim",
                format!(
                    "{} must be even, positive and at most head_dim {}",
                    self.rotary_dim, self.head_dim
                ),
            );
        }
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return bad("theta", format!("{} must be finite and > 1", self.theta));
        }
        let half = self.rotary_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| self.theta.powf(-(2.0 * i as f64) / self.rotary_dim as f64))
            .collect();
        match self.scaling {
            RopeScaling::None => Ok(base),
            RopeScaling::Linear { factor } => {
                if !(factor.is_finite() && factor > 0.0) {
                    return bad("factor", format!("{factor} must be finite and > 0"));
                }
                Ok(base.into_iter().map(|f| f / factor).collect())
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let ok = |x: f64| x.is_finite() && x > 0.0;
                let valid = ok(factor)
                    && ok(low_freq_factor)
                    && ok(old)
                    && high_freq_factor.is_finite()
                    && high_freq_factor > low_freq_factor;
                if !valid {
                    return bad(
                        "llama3 rope scaling",
                        format!(
                            "factor {factor}, low_freq_factor {low_freq_factor}, \
                             high_freq_factor {high_freq_factor}, original {old}: all must be \
                             finite and > 0 with high > low"
                        ),
                    );
                }
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                Ok(base
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect())
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
            } => {
                let ok = |x: f64| x.is_finite() && x > 0.0;
                if !(ok(factor) && ok(old) && ok(beta_fast) && ok(beta_slow)) {
                    return bad(
                        "yarn rope scaling",
                        format!(
                            "factor {factor}, original {old}, beta_fast {beta_fast}, \
                             beta_slow {beta_slow}: all must be finite and > 0"
                        ),
                    );
                }
                let d = self.rotary_dim as f64;
                let corr = |rot: f64| {
                    d * (old / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * self.theta.ln())
                };
                let low = corr(beta_fast).floor().max(0.0);
                let mut high = corr(beta_slow).ceil().min(d - 1.0);
                if high == low {
                    high += 0.001;
                }
                Ok(base
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        f / factor * ramp + f * (1.0 - ramp)
                    })
                    .collect())
            }
        }
    }
}

/// DoubleSparse decode: which label channels to score with and how many tokens to keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoubleSparseConfig {
    /// Tokens kept per query head (`≥ 1`). A request with `kv_len ≤ top_k` attends to all.
    pub top_k: usize,
    /// Heavy channels per KV head, `[kv_heads × heavy_channels]` row-major: indices into
    /// `head_dim`. The label row of a token is its key at these channels (written with K), and
    /// a query head scores tokens with its own values at its KV head's channels.
    pub channels: Vec<u32>,
}

/// Per-call attention parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionParams {
    /// Softmax scale applied to `q·k` (usually `1/√head_dim`).
    pub scale: f32,
    /// Required for DoubleSparse layouts (labels are written from K at these channels; decode
    /// batches attend sparsely); must be `None` for plain MHA layouts.
    pub double_sparse: Option<DoubleSparseConfig>,
}

impl AttentionParams {
    /// Dense attention with the given scale.
    pub fn dense(scale: f32) -> Self {
        AttentionParams {
            scale,
            double_sparse: None,
        }
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
pub trait Backend {
    /// The backend's tensor.
    type Tensor: DeviceTensor;
    /// The KV store the backend attends over.
    type KvStore: KvStore;
    /// The per-batch plan built from [`BatchMetadata`].
    type Plan;

    /// A short name for logs and test output.
    fn name(&self) -> &str;

    /// Allocates a zeroed KV store for `layout` in the backend's memory.
    fn new_kv_store(&self, layout: KvLayout) -> Result<Self::KvStore>;

    /// Whether this backend can hold a store of `shape` and attend over it: `Err(reason)` for a
    /// dtype or attention kind the backend (or its device) lacks, such as f16 on an adapter
    /// without f16 shaders. Callers (the conformance suite, an engine choosing a KV dtype)
    /// ask before they build a store; the ops themselves still refuse with a typed
    /// [`AttentionError::Unsupported`]. The default supports everything.
    fn kv_support(&self, shape: &KvShape) -> std::result::Result<(), String> {
        let _ = shape;
        Ok(())
    }

    /// Copies host data into a new tensor of `shape` (`data.len()` must match it).
    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<Self::Tensor>;

    /// Reads a tensor back to the host as f32.
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;

    /// Gives a tensor a new shape with the same number of elements (no data movement).
    fn reshape(&self, t: Self::Tensor, shape: &[usize]) -> Result<Self::Tensor>;

    /// `x · Wᵀ`: `x` is `[m, k]`, `w` is `[n, k]` (PyTorch's `Linear` weight), the result
    /// `[m, n]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Tensor>;

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

    /// Final logits `hidden · lm_headᵀ`: `hidden` `[m, d]`, `lm_head` `[vocab, d]`.
    fn logits(&self, hidden: &Self::Tensor, lm_head: &Self::Tensor) -> Result<Self::Tensor> {
        self.matmul(hidden, lm_head)
    }

    /// Builds the backend's plan for one batch (once per batch, reused by every layer).
    fn plan(&self, meta: &BatchMetadata) -> Result<Self::Plan>;

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
