//! Loading Hugging Face checkpoints: tokenizers and chat templates load from the directory; bad
//! checkpoints give errors that name the tensor or field. That a loaded checkpoint's greedy
//! output equals an independent f64 forward, on every backend, is tested in the workspace's
//! `tests/tests/model_backends.rs` (it needs the wgpu backend, which model must not depend on).

mod common;

use std::path::Path;

use attention::CpuBackend;
use common::{
    relative_error, temp_dir, write_checkpoint, TestModel, Variant, BF16_ACTIVATIONS_REL,
};
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

/// A bf16 checkpoint's matrices stay in 16 bits on the CPU backend, whose matmul rounds the
/// activations to bf16 for them (`vdpbf16ps` arithmetic, as llama.cpp): its logits are bitwise
/// the same on 1, 2 and 3 threads, differ from those of the same values stored as f32 (f32
/// activations), and lie within [`BF16_ACTIVATIONS_REL`] of the f64 reference. Tied (Qwen2) and
/// untied (Llama) LM heads.
#[test]
fn bf16_weights_round_activations_and_stay_thread_invariant() {
    use attention::{Backend, CpuConfig, DeviceTensor, TensorDtype};
    use kv_pool::{KvDtype, KvLayout, Slot};
    use model::{AttentionMode, ForwardInput, ForwardRequest, LogitsMode, ModelRunner};

    let ids: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 96).collect();
    let logits = |dir: &Path, threads: usize| -> Vec<f32> {
        let backend = CpuBackend::new(CpuConfig {
            threads,
            ..CpuConfig::default()
        })
        .unwrap();
        let model = load_model_dir(&backend, dir).unwrap();
        let layout = KvLayout::new(model.config().kv_shape(KvDtype::F32).unwrap(), 1, 64).unwrap();
        let mut r = ModelRunner::new(backend, model, layout).unwrap();
        let slots: Vec<Slot> = (0..20).map(Slot).collect();
        let out = r
            .forward(&ForwardInput {
                mode: AttentionMode::Extend,
                requests: vec![ForwardRequest {
                    input_ids: &ids,
                    slots: &slots,
                }],
                logits: LogitsMode::AllTokens,
                layer_wait: None,
            })
            .unwrap();
        out.logits
    };
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    for variant in [Variant::Llama, Variant::Qwen2] {
        let m = TestModel::new(variant, 9, true);
        let (d16, d32) = (temp_dir("bf16-kept"), temp_dir("bf16-as-f32"));
        write_checkpoint(&m, &d16, true, false);
        write_checkpoint(&m, &d32, false, false);
        let got = logits(&d16, 1);
        for threads in [2, 3] {
            let other = logits(&d16, threads);
            assert!(
                bits(&other) == bits(&got),
                "{variant:?}: {threads} threads differ"
            );
        }
        assert!(
            bits(&got) != bits(&logits(&d32, 1)),
            "{variant:?}: the activations were not rounded"
        );
        let want: Vec<f64> = m.reference_logits(&ids).concat();
        let error = relative_error(&want, &got);
        assert!(
            error < 1e-4 + BF16_ACTIVATIONS_REL,
            "{variant:?}: relative error {error}"
        );
        eprintln!("{variant:?}: relative error of bf16 activations {error:.2e}");
    }
    // The weight really is kept in 16 bits, and reads back exactly.
    let b = CpuBackend::default();
    let vals = [1.0f32, -2.5, 0.15625, 3.0e-3];
    let w = b.upload_weight(&vals, &[2, 2], TensorDtype::Bf16).unwrap();
    assert_eq!(w.dtype(), TensorDtype::Bf16);
    let back = b.download(&w).unwrap();
    let want: Vec<f32> = vals
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(back, want);
    // Ops that compute on f32 refuse it with a typed error.
    assert!(matches!(
        b.rms_norm(&w, &b.upload(&[1.0, 1.0], &[2]).unwrap(), 1e-5),
        Err(attention::AttentionError::Unsupported(_))
    ));
}
