//! The built-in `tiny` preset: a small Llama-shaped model with seeded random weights and the
//! GPT-2 `r50k_base` vocabulary from `tiktoken-rs`, so an engine runs with nothing downloaded.
//! Its output is gibberish, but deterministic: the same seed gives the same weights everywhere.

use attention::{Backend, RopeScaling};

use crate::config::{Architecture, MlaConfig, ModelConfig, MoeConfig};
use crate::decoder::Model;
use crate::error::Result;
use crate::llama::{expected_tensors, LlamaModel};
use crate::mla::mla_expected_tensors;
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
        sliding_window: None,
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

/// A tiny DeepSeek-V2-Lite-shaped MLA model on the same vocabulary (tied embeddings): 2
/// layers of width 64 (layer 0 dense with MLP 128, layer 1 MoE with 4 routed experts, top 2,
/// and 1 shared expert of width 32), 4 heads, `kv_lora_rank` 32, `qk_nope` 16, `qk_rope` 8,
/// `v_head_dim` 16, no query compression.
pub fn tiny_mla_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::DeepseekV2,
        num_key_value_heads: 4,
        head_dim: 24,
        mla: Some(MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 16,
            rope_mscale: 1.0,
            softmax_mscale: 1.0,
            moe: Some(MoeConfig {
                n_routed_experts: 4,
                num_experts_per_tok: 2,
                n_shared_experts: 1,
                moe_intermediate_size: 32,
                first_k_dense_replace: 1,
                moe_layer_freq: 1,
                norm_topk_prob: false,
                routed_scaling_factor: 1.0,
            }),
        }),
        ..tiny_config()
    }
}

/// The half-width of the preset's uniform embedding weights. Small beside what attention and
/// the MLPs add to the residual stream (their inputs are normalised), so a token's logits depend
/// on its context and not mostly on itself: with tied embeddings and a scale of 1, the current
/// token's own embedding dominated and greedy decoding repeated the last prompt token whatever
/// came before, so no test could see wrong KV in its tokens.
const EMBED_SCALE: f64 = 0.1;

/// Seeded random weights for any supported `config` (Llama family or MLA), with every tensor
/// the loader expects:
/// matrices uniform in `±1/√fan_in`, embeddings uniform in `±`[`EMBED_SCALE`], norm weights
/// near 1, biases small. Deterministic in `(config, seed)`.
pub fn random_weights(config: &ModelConfig, seed: u64) -> TensorMap {
    let mut rng = SplitMix64::new(seed);
    let mut map = TensorMap::new();
    let tensors = if config.mla.is_some() {
        mla_expected_tensors(config)
    } else {
        expected_tensors(config)
    };
    for (name, shape) in tensors {
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
            uniform(EMBED_SCALE, 0.0)
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

/// The MLA preset ([`tiny_mla_config`]) on `backend`, with seeded random weights.
pub fn tiny_mla_model<B: Backend>(backend: &B) -> Result<Model<B>> {
    let config = tiny_mla_config();
    let weights = random_weights(&config, TINY_SEED);
    Model::load(backend, config, &weights)
}

/// The preset's tokenizer: tiktoken `r50k_base`, shipped inside `tiktoken-rs`.
pub fn tiny_tokenizer() -> Tokenizer {
    Tokenizer::tiktoken(TiktokenEncoding::R50kBase)
}
