//! Loading Hugging Face checkpoints: tokenizers and chat templates load from the directory; bad
//! checkpoints give errors that name the tensor or field. That a loaded checkpoint's greedy
//! output equals an independent f64 forward, on every backend, is tested in the workspace's
//! `tests/tests/model_backends.rs` (it needs the wgpu backend, which model must not depend on).

mod common;

use std::path::Path;

use attention::CpuBackend;
use common::{temp_dir, write_checkpoint, TestModel, Variant};
use model::{load_model_dir, load_tokenizer_dir, ChatMessage, ModelConfig, ModelError};

#[test]
fn tokenizer_and_chat_template_load_from_dir() {
    let m = TestModel::new(Variant::Llama, 5, false);
    let dir = temp_dir("tok");
    write_checkpoint(&m, &dir, false, false);
    let (tok, tmpl) = load_tokenizer_dir(&dir).unwrap();
    assert_eq!(tok.vocab_size(), m.vocab);
    let ids = tok.encode("w5 w17 w95", false).unwrap();
    assert_eq!(ids, vec![5, 17, 95]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "w5 w17 w95");
    let text = tmpl
        .unwrap()
        .apply(
            &[
                ChatMessage::new("user", "w5 w6"),
                ChatMessage::new("assistant", "w7"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(text, "<s>user w5 w6</s>\n<s>assistant w7</s>\n<s>assistant");
}

fn load_err(dir: &Path) -> String {
    let backend = CpuBackend::default();
    match load_model_dir(&backend, dir) {
        Ok(_) => panic!("loaded a bad checkpoint"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let mut m = TestModel::new(Variant::Llama, 6, false);
    m.weights.remove("model.layers.1.mlp.up_proj.weight");
    let dir = temp_dir("missing");
    write_checkpoint(&m, &dir, false, false);
    let e = load_err(&dir);
    assert_eq!(e, "missing tensor `model.layers.1.mlp.up_proj.weight`");
}

#[test]
fn wrong_shape_is_named_with_expected_and_got() {
    let mut m = TestModel::new(Variant::Llama, 7, false);
    m.weights.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        (vec![8, 32], vec![0.5; 256]),
    );
    let dir = temp_dir("shape");
    write_checkpoint(&m, &dir, false, false);
    let e = load_err(&dir);
    assert_eq!(
        e,
        "tensor `model.layers.0.self_attn.k_proj.weight`: expected shape [16, 32], got [8, 32]"
    );
}

#[test]
fn unsupported_architecture_is_named_and_supported_listed() {
    let m = TestModel::new(Variant::Llama, 8, false);
    let dir = temp_dir("arch");
    write_checkpoint(&m, &dir, false, false);
    let mut cfg = m.config_json();
    cfg["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("`GPT2LMHeadModel`"), "{e}");
    assert!(
        e.contains("LlamaForCausalLM") && e.contains("Qwen3ForCausalLM"),
        "{e}"
    );
}

#[test]
fn truncated_file_is_a_corrupt_checkpoint_error() {
    let m = TestModel::new(Variant::Llama, 9, false);
    let dir = temp_dir("trunc");
    write_checkpoint(&m, &dir, false, false);
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let backend = CpuBackend::default();
    let err = load_model_dir(&backend, &dir).err().unwrap();
    assert!(matches!(err, ModelError::CorruptCheckpoint { .. }), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
    // A file cut inside its header.
    std::fs::write(&path, &bytes[..20]).unwrap();
    let err = load_model_dir(&backend, &dir).err().unwrap();
    assert!(matches!(err, ModelError::CorruptCheckpoint { .. }), "{err}");
}

#[test]
fn malformed_config_names_the_field() {
    let m = TestModel::new(Variant::Llama, 10, false);
    let mut cfg = m.config_json();
    cfg["hidden_size"] = "wide".into();
    let e = ModelConfig::from_json_str(&cfg.to_string())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "config field `hidden_size`: expected a non-negative integer, got \"wide\""
    );

    let mut cfg = m.config_json();
    cfg.as_object_mut().unwrap().remove("vocab_size");
    let e = ModelConfig::from_json_str(&cfg.to_string())
        .unwrap_err()
        .to_string();
    assert_eq!(e, "config field `vocab_size`: missing");

    let mut cfg = m.config_json();
    cfg["num_key_value_heads"] = 3.into();
    let e = ModelConfig::from_json_str(&cfg.to_string())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("config field `num_key_value_heads`"), "{e}");

    let mut cfg = m.config_json();
    cfg["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    let e = ModelConfig::from_json_str(&cfg.to_string())
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("config field `rope_scaling.rope_type`"),
        "{e}"
    );

    let e = ModelConfig::from_json_str("{ not json").unwrap_err();
    assert!(matches!(e, ModelError::Json { .. }), "{e}");
}

#[test]
fn llama3_rope_scaling_and_eos_forms_parse() {
    let m = TestModel::new(Variant::Llama, 11, false);
    let mut cfg = m.config_json();
    cfg["rope_scaling"] = serde_json::json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
    });
    cfg["eos_token_id"] = 2.into();
    let c = ModelConfig::from_json_str(&cfg.to_string()).unwrap();
    assert!(matches!(
        c.rope_scaling,
        attention::RopeScaling::Llama3 { .. }
    ));
    assert_eq!(c.eos_token_ids, vec![2]);
    assert_eq!(c.bos_token_id, Some(1));
}
