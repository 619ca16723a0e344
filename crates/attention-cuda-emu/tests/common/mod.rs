//! Shared by the tests that run whole decoders on the emulated kernels (`tiny_model`,
//! `graph`, `decode_graphs`): the tiny Llama- and MLA-shaped configs whose attention has
//! compiled kernels.

use attention::{AttentionError, Backend, BatchMetadata};
use attention_cuda::{CudaBackend, CudaKvStore, CudaTensor, Device};
use model::tiny::{tiny_config, tiny_mla_config};
use model::{MlaConfig, Model, ModelConfig, ModelError};

/// The tiny preset with head dim 64 (a compiled attention shape), a 512-token vocabulary and
/// an untied LM head.
pub fn llama_config() -> ModelConfig {
    ModelConfig {
        head_dim: 64,
        vocab_size: 512,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        ..tiny_config()
    }
}

/// The tiny MLA preset with `qk_rope_head_dim` 16 (latent rows of 32 + 16, a compiled shape)
/// and an untied LM head (tied random embeddings make greedy decoding repeat the last token).
// Not every test binary uses both configs.
#[allow(dead_code)]
pub fn mla_config() -> ModelConfig {
    let base = tiny_mla_config();
    let mla = base.mla.clone().expect("the MLA preset");
    ModelConfig {
        head_dim: mla.qk_nope_head_dim + 16,
        mla: Some(MlaConfig {
            qk_rope_head_dim: 16,
            ..mla
        }),
        vocab_size: 512,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        ..base
    }
}

fn model_err(e: ModelError) -> AttentionError {
    match e {
        ModelError::Attention(e) => e,
        e => AttentionError::Device(e.to_string()),
    }
}

/// The decode forward as the model runner makes it: plan, embedding, layers, logits.
// Not every test binary runs forwards by hand.
#[allow(dead_code)]
pub fn decode_forward<D: Device>(
    b: &CudaBackend<D>,
    model: &Model<CudaBackend<D>>,
    store: &mut CudaKvStore<D>,
    meta: &BatchMetadata,
    ids: &[u32],
) -> attention::Result<CudaTensor<D>> {
    let positions = meta.positions();
    let plan = b.plan(meta)?;
    let mut x = model.embed(b, ids).map_err(model_err)?;
    for layer in 0..model.num_layers() {
        model
            .layer_forward(b, layer, &plan, store, &mut x, &positions)
            .map_err(model_err)?;
    }
    model.logits(b, &x, None).map_err(model_err)
}
