//! Loading Hugging Face checkpoints: greedy output equals an independent f64 forward; bad
//! checkpoints give errors that name the tensor or field.

mod common;

use std::path::Path;

use attention::{Backend, CpuBackend};
use common::{temp_dir, write_checkpoint, TestModel, Variant};
use kv_pool::{KvDtype, KvLayout, Slot};
use model::{
    load_model_dir, load_tokenizer_dir, ChatMessage, ForwardInput, ForwardMode, ForwardRequest,
    LogitsMode, ModelConfig, ModelError, ModelRunner, SafetensorsCheckpoint, TensorSource,
};

/// Loads the directory, runs greedy generation (prefill then decode steps, page size 4) and
/// compares with the f64 reference token for token, and the last logits within tolerance.
fn check_greedy(m: &TestModel, dir: &Path) {
    check_greedy_on(CpuBackend::default(), m, dir);
}

/// [`check_greedy`] on any backend.
fn check_greedy_on<B: Backend>(backend: B, m: &TestModel, dir: &Path) {
    let model = load_model_dir(&backend, dir).unwrap();
    let layout = KvLayout::new(model.config().kv_shape(KvDtype::F32).unwrap(), 4, 64).unwrap();
    let mut runner = ModelRunner::new(backend, model, layout).unwrap();
    let prompt: Vec<u32> = vec![1, 17, 42, 5, 88, 23, 9];
    let steps = 6;
    let want = m.reference_greedy(&prompt, steps);
    // Slots: position p at slot 4 + p (pages 1, 2, … in order).
    let slots: Vec<Slot> = (0..prompt.len() + steps)
        .map(|p| Slot(4 + p as u32))
        .collect();
    let mut seq = prompt.clone();
    let mut got = Vec::new();
    let mut last_logits = Vec::new();
    for step in 0..steps {
        let new = if step == 0 {
            &seq[..]
        } else {
            &seq[seq.len() - 1..]
        };
        let input = ForwardInput {
            mode: if step == 0 {
                ForwardMode::Extend
            } else {
                ForwardMode::Decode
            },
            requests: vec![ForwardRequest {
                input_ids: new,
                slots: &slots[..seq.len()],
            }],
            logits: LogitsMode::LastToken,
        };
        let out = runner.forward(&input).unwrap();
        last_logits = out.last(0).unwrap().to_vec();
        let t = out.argmax()[0].unwrap();
        got.push(t);
        seq.push(t);
    }
    assert_eq!(got, want, "greedy tokens differ from the f64 reference");
    let refl = m.reference_logits(&seq[..seq.len() - 1]);
    let refl = refl.last().unwrap();
    let num: f64 = refl
        .iter()
        .zip(&last_logits)
        .map(|(a, &b)| (a - b as f64).powi(2))
        .sum();
    let den: f64 = refl.iter().map(|a| a * a).sum();
    assert!(
        (num / den).sqrt() < 1e-4,
        "relative error {}",
        (num / den).sqrt()
    );
}

#[test]
fn llama_checkpoint_greedy_matches_f64_reference() {
    let m = TestModel::new(Variant::Llama, 1, false);
    let dir = temp_dir("llama");
    write_checkpoint(&m, &dir, false, false);
    check_greedy(&m, &dir);
}

#[test]
fn sharded_bf16_checkpoint_greedy_matches_f64_reference() {
    let m = TestModel::new(Variant::Llama, 2, true);
    let dir = temp_dir("sharded");
    write_checkpoint(&m, &dir, true, true);
    let ckpt = SafetensorsCheckpoint::open_dir(&dir).unwrap();
    assert_eq!(ckpt.files().len(), 2);
    assert_eq!(
        ckpt.info("model.embed_tokens.weight").unwrap().1,
        "BF16".to_string()
    );
    check_greedy(&m, &dir);
}

#[test]
fn qwen2_biases_greedy_matches_f64_reference() {
    let m = TestModel::new(Variant::Qwen2, 3, false);
    let dir = temp_dir("qwen2");
    write_checkpoint(&m, &dir, false, false);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert!(cfg.qkv_bias && !cfg.o_bias && cfg.tie_word_embeddings);
    check_greedy(&m, &dir);
}

#[test]
fn qwen3_qk_norm_greedy_matches_f64_reference() {
    let m = TestModel::new(Variant::Qwen3, 4, false);
    let dir = temp_dir("qwen3");
    write_checkpoint(&m, &dir, false, false);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert!(cfg.qk_norm && cfg.head_dim == 16);
    assert_eq!(cfg.eos_token_ids, vec![2, 3]);
    check_greedy(&m, &dir);
}

/// The same checkpoints loaded onto the wgpu backend (Mesa's lavapipe in CI) match the same f64
/// reference: a loaded checkpoint runs on the second backend unchanged. Skips without an
/// adapter unless `KVSERVE_REQUIRE_WGPU=1`.
#[test]
fn checkpoints_on_wgpu_match_the_f64_reference() {
    let variants = [
        (Variant::Llama, 1, false, false),
        (Variant::Llama, 2, true, true),
        (Variant::Qwen2, 3, false, false),
        (Variant::Qwen3, 4, false, false),
    ];
    for (variant, seed, bf16, sharded) in variants {
        let Some(backend) = attention_wgpu::test_support::backend_or_skip("checkpoint on wgpu")
        else {
            return;
        };
        let m = TestModel::new(variant, seed, bf16);
        let dir = temp_dir(&format!("wgpu-{seed}"));
        write_checkpoint(&m, &dir, bf16, sharded);
        check_greedy_on(backend, &m, &dir);
    }
}

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
