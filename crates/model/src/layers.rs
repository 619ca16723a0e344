//! Pieces shared by the decoders: checkpoint validation and loading against the expected
//! tensor list, the embedding / final norm / LM head trunk, and the gated SiLU MLP.

use attention::{AttentionError, Backend, TensorDtype};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::weights::{HostTensor, TensorSource};

/// Loads tensors from a source against the expected names and shapes. Construction checks
/// every expected tensor is present with its shape, so a bad checkpoint fails before anything
/// is uploaded.
pub(crate) struct Loader<'a, B: Backend> {
    backend: &'a B,
    source: &'a dyn TensorSource,
    expected: Vec<(String, Vec<usize>)>,
}

impl<'a, B: Backend> Loader<'a, B> {
    pub(crate) fn new(
        backend: &'a B,
        source: &'a dyn TensorSource,
        expected: Vec<(String, Vec<usize>)>,
    ) -> Result<Self> {
        for (name, shape) in &expected {
            match source.info(name) {
                None => return Err(ModelError::MissingTensor { name: name.clone() }),
                Some((got, _)) if got != *shape => {
                    return Err(ModelError::TensorShape {
                        name: name.clone(),
                        expected: shape.clone(),
                        got,
                    })
                }
                Some(_) => {}
            }
        }
        Ok(Loader {
            backend,
            source,
            expected,
        })
    }

    /// Reads an expected tensor to the host (f32).
    pub(crate) fn get(&self, name: &str) -> Result<HostTensor> {
        let shape = &self
            .expected
            .iter()
            .find(|(n, _)| n == name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?
            .1;
        self.source.load_shaped(name, shape)
    }

    /// Reads an expected tensor and uploads it as is.
    pub(crate) fn upload(&self, name: &str) -> Result<B::Tensor> {
        self.put(&self.get(name)?)
    }

    /// Uploads a host tensor.
    pub(crate) fn put(&self, t: &HostTensor) -> Result<B::Tensor> {
        Ok(self.backend.upload(&t.data, &t.shape)?)
    }

    /// The checkpoint's element type of `name` where the backend may keep a weight in it
    /// (f16, bf16), else f32.
    fn dtype(&self, name: &str) -> TensorDtype {
        match self.source.info(name).map(|(_, d)| d).as_deref() {
            Some("BF16") => TensorDtype::Bf16,
            Some("F16") => TensorDtype::F16,
            _ => TensorDtype::F32,
        }
    }

    /// Uploads `t`, whose values are taken unchanged from the checkpoint's tensor `name` (its
    /// rows or a transposition of them), as a weight in that tensor's type (exact).
    pub(crate) fn put_weight_of(&self, t: &HostTensor, name: &str) -> Result<B::Tensor> {
        Ok(self
            .backend
            .upload_weight(&t.data, &t.shape, self.dtype(name))?)
    }

    /// Reads the tensors of each row of `rows`, concatenated in order, and uploads the rows as
    /// one weight `[rows, elements]`, in the checkpoint's type where every tensor has the same
    /// (else f32): the routed experts' stacked `gate_up` and `down` ([`attention::MoeExperts`]).
    pub(crate) fn upload_stacked(&self, rows: &[Vec<String>]) -> Result<B::Tensor> {
        let mut data = Vec::new();
        let dtype = self.common_dtype(rows.iter().flatten());
        for (i, name) in rows.iter().flatten().enumerate() {
            let t = self.get(name)?;
            if i == 0 {
                data.reserve_exact(t.data.len() * rows.iter().flatten().count());
            }
            data.extend_from_slice(&t.data);
        }
        let shape = [rows.len(), data.len() / rows.len().max(1)];
        Ok(self.backend.upload_weight(&data, &shape, dtype)?)
    }

    /// The checkpoint's type shared by every tensor of `names` (f32 where they differ): what
    /// a weight joined from them is kept in.
    fn common_dtype<'n>(&self, names: impl IntoIterator<Item = &'n String>) -> TensorDtype {
        let mut dtypes = names.into_iter().map(|name| self.dtype(name));
        let first = dtypes.next().unwrap_or(TensorDtype::F32);
        if dtypes.all(|d| d == first) {
            first
        } else {
            TensorDtype::F32
        }
    }

    /// Reads an expected matrix (a matmul weight or the embedding) and uploads it as a weight
    /// in the checkpoint's type ([`Backend::upload_weight`]: exact, the values are that type's).
    pub(crate) fn upload_weight(&self, name: &str) -> Result<B::Tensor> {
        let t = self.get(name)?;
        Ok(self
            .backend
            .upload_weight(&t.data, &t.shape, self.dtype(name))?)
    }
}

/// Token embedding, final RMSNorm and LM head (tied to the embedding or separate).
pub(crate) struct Trunk<B: Backend> {
    embed: B::Tensor,
    lm_head: Option<B::Tensor>,
    final_norm: B::Tensor,
    vocab_size: usize,
    eps: f32,
}

/// Tensor names with their shapes.
pub(crate) type TensorList = Vec<(String, Vec<usize>)>;

/// The trunk's tensors with their shapes: those before the layers (the embedding) and those
/// after (the final norm and an untied LM head).
pub(crate) fn trunk_tensors(config: &ModelConfig) -> (TensorList, TensorList) {
    let d = config.hidden_size;
    let head = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![config.vocab_size, d],
    )];
    let mut tail = vec![("model.norm.weight".to_string(), vec![d])];
    if !config.tie_word_embeddings {
        tail.push(("lm_head.weight".to_string(), vec![config.vocab_size, d]));
    }
    (head, tail)
}

impl<B: Backend> Trunk<B> {
    pub(crate) fn load(loader: &Loader<'_, B>, config: &ModelConfig) -> Result<Self> {
        Ok(Trunk {
            embed: loader.upload_weight("model.embed_tokens.weight")?,
            lm_head: if config.tie_word_embeddings {
                None
            } else {
                Some(loader.upload_weight("lm_head.weight")?)
            },
            final_norm: loader.upload("model.norm.weight")?,
            vocab_size: config.vocab_size,
            eps: config.rms_norm_eps as f32,
        })
    }

    /// Token embeddings `[n, hidden]` of `ids` (every id must be `< vocab_size`).
    pub(crate) fn embed(&self, backend: &B, ids: &[u32]) -> Result<B::Tensor> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(ModelError::InvalidInput {
                request: 0,
                reason: format!(
                    "token id {bad} is outside the vocabulary ({})",
                    self.vocab_size
                ),
            });
        }
        Ok(backend.embedding(&self.embed, ids)?)
    }

    /// Final RMSNorm and LM head over the rows `rows` of `x` (all rows if `None`).
    pub(crate) fn logits(
        &self,
        backend: &B,
        x: &B::Tensor,
        rows: Option<&[u32]>,
    ) -> Result<B::Tensor> {
        let h = match rows {
            Some(rows) => {
                let sel = backend.embedding(x, rows)?;
                backend.rms_norm(&sel, &self.final_norm, self.eps)?
            }
            None => backend.rms_norm(x, &self.final_norm, self.eps)?,
        };
        Ok(backend.logits(&h, self.lm_head.as_ref().unwrap_or(&self.embed))?)
    }
}

/// The gated SiLU MLP (`down(silu(gate(x)) · up(x))`), gate and up merged into one matmul as
/// in SGLang.
pub(crate) struct DenseMlp<B: Backend> {
    /// `[2 · inter, hidden]`: gate rows, then up rows.
    gate_up: B::Tensor,
    down: B::Tensor,
}

/// The names and shapes of an MLP's tensors under `prefix` (e.g. `model.layers.0.mlp.`).
pub(crate) fn mlp_tensors(prefix: &str, inter: usize, hidden: usize) -> [(String, Vec<usize>); 3] {
    [
        (format!("{prefix}gate_proj.weight"), vec![inter, hidden]),
        (format!("{prefix}up_proj.weight"), vec![inter, hidden]),
        (format!("{prefix}down_proj.weight"), vec![hidden, inter]),
    ]
}

impl<B: Backend> DenseMlp<B> {
    pub(crate) fn load(loader: &Loader<'_, B>, prefix: &str) -> Result<Self> {
        let (g, u) = (
            format!("{prefix}gate_proj.weight"),
            format!("{prefix}up_proj.weight"),
        );
        let (gate, up) = (loader.get(&g)?, loader.get(&u)?);
        let mut shape = gate.shape.clone();
        shape[0] *= 2;
        let mut data = gate.data;
        data.extend_from_slice(&up.data);
        // Both halves in 16 bits only when both are stored so.
        let dtype = loader.common_dtype([&g, &u]);
        Ok(DenseMlp {
            gate_up: loader.backend.upload_weight(&data, &shape, dtype)?,
            down: loader.upload_weight(&format!("{prefix}down_proj.weight"))?,
        })
    }

    /// The MLP of `h` (`[n, hidden]` → `[n, hidden]`).
    pub(crate) fn forward(&self, backend: &B, h: &B::Tensor) -> Result<B::Tensor> {
        let gu = backend.matmul(h, &self.gate_up)?;
        let act = backend.silu_mul(&gu)?;
        Ok(backend.matmul(&act, &self.down)?)
    }
}

/// `x · Wᵢᵀ` for the `N` weights of `ws` as one backend op ([`Backend::matmul_many`]: the fused
/// QKV projection), bitwise the `N` matmuls.
pub(crate) fn matmul_n<B: Backend, const N: usize>(
    backend: &B,
    x: &B::Tensor,
    ws: [&B::Tensor; N],
) -> Result<[B::Tensor; N]> {
    let outs = backend.matmul_many(x, &ws)?;
    let got = outs.len();
    <[B::Tensor; N]>::try_from(outs).map_err(|_| {
        ModelError::Attention(AttentionError::LengthMismatch {
            what: "matmul_many results",
            expected: N,
            got,
        })
    })
}
