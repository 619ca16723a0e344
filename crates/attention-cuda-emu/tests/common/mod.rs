//! Shared by the tests that run whole decoders on the emulated kernels (`tiny_model`,
//! `graph`): the tiny Llama-shaped config whose attention has compiled kernels.

use model::tiny::tiny_config;
use model::ModelConfig;

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
