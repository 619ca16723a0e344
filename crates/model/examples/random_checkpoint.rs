//! Writes a Hugging Face checkpoint directory with seeded random weights in SmolLM2-135M's
//! shape (hidden 576, 30 layers, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49,152, tied
//! embeddings), for benchmarking the CPU backend with nothing downloaded:
//!
//! ```text
//! cargo run --release -p model --example random_checkpoint -- DIR [f32|bf16|f16]
//! kvserve bench --model-path DIR --workload random ...
//! ```
//!
//! The tokenizer is a word-level one over `w0 … w49151` (the random workload sends token ids).

use std::path::PathBuf;

use attention::RopeScaling;
use model::tiny::random_weights;
use model::{Architecture, ModelConfig};
use safetensors::tensor::{Dtype, TensorView};

fn smollm2_135m() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 100_000.0,
        rope_scaling: RopeScaling::None,
        max_position_embeddings: 8192,
        sliding_window: None,
        vocab_size: 49_152,
        tie_word_embeddings: true,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        mla: None,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .ok_or("usage: random_checkpoint DIR [f32|bf16|f16]")?,
    );
    let (dtype, torch_dtype) = match args.next().as_deref() {
        None | Some("f32") => (Dtype::F32, "float32"),
        Some("bf16") => (Dtype::BF16, "bfloat16"),
        Some("f16") => (Dtype::F16, "float16"),
        Some(other) => return Err(format!("unknown dtype {other} (f32, bf16 or f16)").into()),
    };
    std::fs::create_dir_all(&dir)?;
    let c = smollm2_135m();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "torch_dtype": torch_dtype,
    });
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
