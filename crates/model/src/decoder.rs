//! [`Model`]: any decoder this crate implements, behind one interface for the
//! [`ModelRunner`](crate::ModelRunner) and the loaders.

use attention::Backend;
use kv_pool::KvKind;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::llama::LlamaModel;
use crate::mla::MlaModel;
use crate::weights::TensorSource;

/// A decoder on a backend: the Llama family (GQA over an MHA store) or DeepSeek-V2 (MLA over
/// an MLA store).
pub enum Model<B: Backend> {
    /// Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM.
    Llama(LlamaModel<B>),
    /// DeepSeek-V2 (multi-head latent attention, dense and MoE MLPs).
    Mla(MlaModel<B>),
}

impl<B: Backend> From<LlamaModel<B>> for Model<B> {
    fn from(m: LlamaModel<B>) -> Self {
        Model::Llama(m)
    }
}

impl<B: Backend> From<MlaModel<B>> for Model<B> {
    fn from(m: MlaModel<B>) -> Self {
        Model::Mla(m)
    }
}

impl<B: Backend> Model<B> {
    /// Loads the decoder `config.architecture` names from `source` onto `backend`.
    pub fn load(backend: &B, config: ModelConfig, source: &dyn TensorSource) -> Result<Self> {
        if config.mla.is_some() {
            Ok(Model::Mla(MlaModel::load(backend, config, source)?))
        } else {
            Ok(Model::Llama(LlamaModel::load(backend, config, source)?))
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Llama(m) => m.config(),
            Model::Mla(m) => m.config(),
        }
    }

    /// The per-token KV kind the model's store must have.
    pub fn kv_kind(&self) -> KvKind {
        let c = self.config();
        match &c.mla {
            Some(m) => KvKind::Mla {
                kv_lora_rank: m.kv_lora_rank as u32,
                qk_rope_head_dim: m.qk_rope_head_dim as u32,
            },
            None => KvKind::Mha {
                kv_heads: c.num_key_value_heads as u32,
                head_dim: c.head_dim as u32,
                v_head_dim: c.head_dim as u32,
            },
        }
    }

    /// Token embeddings `[n, hidden]` of `ids` (every id must be `< vocab_size`).
    pub fn embed(&self, backend: &B, ids: &[u32]) -> Result<B::Tensor> {
        match self {
            Model::Llama(m) => m.embed(backend, ids),
            Model::Mla(m) => m.embed(backend, ids),
        }
    }

    /// One decoder layer over `x` (see [`LlamaModel::layer_forward`] and
    /// [`MlaModel::layer_forward`]).
    pub fn layer_forward(
        &self,
        backend: &B,
        layer: usize,
        plan: &B::Plan,
        store: &mut B::KvStore,
        x: &mut B::Tensor,
        positions: &[u32],
    ) -> Result<()> {
        match self {
            Model::Llama(m) => m.layer_forward(backend, layer, plan, store, x, positions),
            Model::Mla(m) => m.layer_forward(backend, layer, plan, store, x, positions),
        }
    }

    /// Final RMSNorm and LM head over the rows `rows` of `x` (all rows if `None`).
    pub fn logits(&self, backend: &B, x: &B::Tensor, rows: Option<&[u32]>) -> Result<B::Tensor> {
        match self {
            Model::Llama(m) => m.logits(backend, x, rows),
            Model::Mla(m) => m.logits(backend, x, rows),
        }
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        match self {
            Model::Llama(m) => m.num_layers(),
            Model::Mla(m) => m.num_layers(),
        }
    }
}
