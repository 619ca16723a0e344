//! Shared by the tests that run whole decoders on the emulated kernels (`tiny_model`,
//! `graph`, `decode_graphs`): the tiny Llama- and MLA-shaped configs whose attention has
//! compiled kernels.

use attention::{AttentionError, Backend, BatchMetadata};
use attention_cuda::{CudaBackend, CudaKvStore, CudaTensor, Device};
use model::{Model, ModelError};

/// The tiny presets with head dim 64 (a compiled attention shape) and, for MLA, latent rows of
/// 32 + 16 (a compiled MLA shape), a 512-token vocabulary and an untied LM head.
// Not every test binary uses both configs.
#[allow(unused_imports)]
pub use model::greedy_check::{llama_config, mla_config};

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
