//! The built-in `tiny` preset: a small Llama-shaped model with seeded random weights and the
//! GPT-2 `r50k_base` vocabulary from `tiktoken-rs`, so an engine runs with nothing downloaded.
//! Its output is gibberish, but deterministic: the same seed gives the same weights everywhere.

use attention::{Backend, RopeScaling};

use crate::config::{Architecture, ModelConfig};
use crate::error::Result;
use crate::llama::{expected_tensors, LlamaModel};
use crate::sampling::SplitMix64;
use crate::tokenizer::{TiktokenEncoding, Tokenizer};
use crate::weights::{HostTensor, TensorMap};

/// The seed of the preset's weights.
pub const TINY_SEED: u64 = 0x006b_7673_6572_7665; // "kvserve" in ASCII

/// `<|endoftext|>` of `r50k_base`, the preset's BOS and EOS.
pub const TINY_EOS: u32 = 50_256;

/// The preset's configuration: 2 layers, width 64, 4 query heads over 2 KV heads of 16,
/// MLP 128, vocabulary 50,257 (tied embeddings).
pub fn tiny_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        max_position_embeddings: 2048,
        vocab_size: 50_257,
        tie_word_embeddings: true,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        bos_token_id: Some(TINY_EOS),
        eos_token_ids: vec![TINY_EOS],
        mla: None,
    }
}

/// Seeded random weights for any Llama-family `config`, with every tensor the loader expects:
/// matrices uniform in `±1/√fan_in`, embeddings uniform in `±1`, norm weights near 1, biases
/// small. Deterministic in `(config, seed)`.
pub fn random_weights(config: &ModelConfig, seed: u64) -> TensorMap {
    let mut rng = SplitMix64::new(seed);
    let mut map = TensorMap::new();
    for (name, shape) in expected_tensors(config) {
        let n: usize = shape.iter().product();
        let mut uniform = |scale: f64, offset: f64| -> Vec<f32> {
            (0..n)
                .map(|_| (offset + scale * (2.0 * rng.next_f64() - 1.0)) as f32)
                .collect()
        };
        let data = if name.ends_with("norm.weight") {
            uniform(0.1, 1.0)
        } else if name.ends_with(".bias") {
            uniform(0.1, 0.0)
        } else if name == "model.embed_tokens.weight" {
            uniform(1.0, 0.0)
        } else {
            uniform(1.0 / (shape[1] as f64).sqrt(), 0.0)
        };
        // Shapes come from `expected_tensors`, so the lengths agree.
        let _ = map.insert(name, HostTensor { shape, data });
    }
    map
}

/// The preset's model on `backend`.
pub fn tiny_model<B: Backend>(backend: &B) -> Result<LlamaModel<B>> {
    let config = tiny_config();
    let weights = random_weights(&config, TINY_SEED);
    LlamaModel::load(backend, config, &weights)
}

/// The preset's tokenizer: tiktoken `r50k_base`, shipped inside `tiktoken-rs`.
pub fn tiny_tokenizer() -> Tokenizer {
    Tokenizer::tiktoken(TiktokenEncoding::R50kBase)
}
