//! Writes a Hugging Face checkpoint directory with seeded random weights, for benchmarking
//! with nothing downloaded:
//!
//! - `smollm2-135m` (the default): SmolLM2-135M's shape (Llama: hidden 576, 30 layers, 9 query
//!   / 3 KV heads of 64, MLP 1536, vocabulary 49,152, tied embeddings);
//! - `deepseek-v2-lite-2l`: DeepSeek-V2-Lite's shape cut to its first two layers (MLA: hidden
//!   2048, 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, YaRN ×40; layer 0 a
//!   dense MLP of 10,944, layer 1 64 routed experts of 1,408, top 6, and 2 shared; vocabulary
//!   102,400, untied). About 1.1 B weights (2.2 GB in bf16).
//!
//! ```text
//! cargo run --release -p model --example random_checkpoint -- DIR [f32|bf16|f16] [SHAPE]
//! kvserve bench --model-path DIR --workload random ...
//! ```
//!
//! The tokenizer is a word-level one over `w0 … w{vocab - 1}` (the random workload sends
//! token ids). The config is written first and parsed back, so the weights are exactly the
//! tensors the loader expects.

use std::path::PathBuf;

use model::tiny::random_weights;
use model::ModelConfig;
use safetensors::tensor::{Dtype, TensorView};

/// The `config.json` of `shape`, or `None` for an unknown shape.
fn config_json(shape: &str, torch_dtype: &str) -> Option<serde_json::Value> {
    Some(match shape {
        "smollm2-135m" => serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
            "vocab_size": 49152,
            "tie_word_embeddings": true,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "torch_dtype": torch_dtype,
        }),
        "deepseek-v2-lite-2l" => serde_json::json!({
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "num_hidden_layers": 2,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": null,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "n_shared_experts": 2,
            "moe_intermediate_size": 1408,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "norm_topk_prob": false,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "scoring_func": "softmax",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707
            },
            "max_position_embeddings": 163840,
            "vocab_size": 102400,
            "tie_word_embeddings": false,
            "attention_bias": false,
            "bos_token_id": 100000,
            "eos_token_id": 100001,
            "hidden_act": "silu",
            "torch_dtype": torch_dtype,
        }),
        _ => return None,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: random_checkpoint DIR [f32|bf16|f16] [smollm2-135m|deepseek-v2-lite-2l]";
    let dir = PathBuf::from(args.next().ok_or(usage)?);
    let (dtype, torch_dtype) = match args.next().as_deref() {
        None | Some("f32") => (Dtype::F32, "float32"),
        Some("bf16") => (Dtype::BF16, "bfloat16"),
        Some("f16") => (Dtype::F16, "float16"),
        Some(other) => return Err(format!("unknown dtype {other} (f32, bf16 or f16)").into()),
    };
    let shape = args.next().unwrap_or_else(|| "smollm2-135m".into());
    let config = config_json(&shape, torch_dtype)
        .ok_or_else(|| format!("unknown shape {shape}; {usage}"))?;
    let c = ModelConfig::from_json_str(&config.to_string())?;
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let vocab = (0..c.vocab_size as u32)
        .map(|i| (format!("w{i}"), i))
        .collect();
    let words = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(vocab)
        .unk_token("w0".into())
        .build()?;
    let mut tokenizer = tokenizers::Tokenizer::new(words);
    tokenizer.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace));
    tokenizer.save(dir.join("tokenizer.json"), false)?;
    let weights = random_weights(&c, 0x5eed);
    let bytes: Vec<(&String, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(name, t)| {
            let bytes = match dtype {
                Dtype::BF16 => t
                    .data
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
                Dtype::F16 => t
                    .data
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
                _ => t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            (name, t.shape.clone(), bytes)
        })
        .collect();
    let mut views = Vec::with_capacity(bytes.len());
    for (name, shape, b) in &bytes {
        views.push((name.to_string(), TensorView::new(dtype, shape.clone(), b)?));
    }
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))?;
    println!("wrote {}", dir.display());
    Ok(())
}
