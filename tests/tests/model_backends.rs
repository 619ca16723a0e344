//! The model on every compiled backend: tiny Hugging Face checkpoints (Llama, sharded bf16,
//! Qwen2 biases, Qwen3 q/k norm) written to a temp dir, loaded onto each backend, and greedy
//! output equal to an independent f64 forward over the same weights. One test body per
//! checkpoint, run on the CPU backend and on wgpu ([`kvserve_tests::on_every_backend!`]).
//!
//! The checkpoint writer and the f64 forward are the model crate's own test helpers
//! (`crates/model/tests/common/mod.rs`), compiled here from that file so there is one copy.

#[path = "../../crates/model/tests/common/mod.rs"]
mod common;

use std::path::Path;

use attention::Backend;
use common::{
    relative_error, temp_dir, write_checkpoint, TestModel, Variant, BF16_ACTIVATIONS_REL,
};
use kv_pool::{KvDtype, KvLayout, Slot};
use kvserve_tests::{attention, on_every_backend};
use model::{
    load_model_dir, AttentionMode, ForwardInput, ForwardRequest, LogitsMode, ModelConfig,
    ModelRunner, SafetensorsCheckpoint, TensorSource,
};

/// Loads the directory onto `backend`, runs greedy generation (prefill then decode steps, page
/// size 4) and compares with the f64 reference token for token, and the last logits within a
/// relative error of 1e-4, plus `extra` (what a backend may add for the checkpoint's dtype).
fn check_greedy<B: Backend>(backend: B, m: &TestModel, dir: &Path, extra: f64) {
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
        // Step 0 prefills the prompt; every later step decodes the token sampled before it.
        let (mode, first) = match step {
            0 => (AttentionMode::Extend, 0),
            _ => (AttentionMode::Decode, seq.len() - 1),
        };
        let requests = vec![ForwardRequest {
            input_ids: &seq[first..],
            slots: &slots[..seq.len()],
        }];
        let logits = LogitsMode::LastToken;
        let out = runner
            .forward(&ForwardInput {
                mode,
                requests,
                logits,
                layer_wait: None,
            })
            .unwrap();
        last_logits = out.last(0).unwrap().to_vec();
        let token = out.argmax()[0].unwrap();
        got.push(token);
        seq.push(token);
    }
    assert_eq!(got, want, "greedy tokens differ from the f64 reference");
    let want_logits = m.reference_logits(&seq[..seq.len() - 1]);
    let error = relative_error(want_logits.last().unwrap(), &last_logits);
    assert!(error < 1e-4 + extra, "relative error {error}");
}

/// A fresh checkpoint directory for `name` on `backend` (the backends' tests run in parallel).
fn checkpoint_dir<B: Backend>(name: &str, backend: &B) -> std::path::PathBuf {
    temp_dir(&format!("{name}-{}", backend.name()))
}

on_every_backend! {
    fn llama_checkpoint_greedy_matches_f64_reference(backend) {
        let m = TestModel::new(Variant::Llama, 1, false);
        let dir = checkpoint_dir("llama", &backend);
        write_checkpoint(&m, &dir, false, false);
        check_greedy(backend, &m, &dir, 0.0);
    }
}

on_every_backend! {
    fn sharded_bf16_checkpoint_greedy_matches_f64_reference(backend) {
        let m = TestModel::new(Variant::Llama, 2, true);
        let dir = checkpoint_dir("sharded", &backend);
        write_checkpoint(&m, &dir, true, true);
        let ckpt = SafetensorsCheckpoint::open_dir(&dir).unwrap();
        assert_eq!(ckpt.files().len(), 2);
        assert_eq!(
            ckpt.info("model.embed_tokens.weight").unwrap().1,
            "BF16".to_string()
        );
        // bf16 weights: the CPU backend rounds the activations to bf16 for them.
        check_greedy(backend, &m, &dir, BF16_ACTIVATIONS_REL);
    }
}

on_every_backend! {
    fn qwen2_biases_greedy_matches_f64_reference(backend) {
        let m = TestModel::new(Variant::Qwen2, 3, false);
        let dir = checkpoint_dir("qwen2", &backend);
        write_checkpoint(&m, &dir, false, false);
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        assert!(cfg.qkv_bias && !cfg.o_bias && cfg.tie_word_embeddings);
        check_greedy(backend, &m, &dir, 0.0);
    }
}

on_every_backend! {
    fn qwen3_qk_norm_greedy_matches_f64_reference(backend) {
        let m = TestModel::new(Variant::Qwen3, 4, false);
        let dir = checkpoint_dir("qwen3", &backend);
        write_checkpoint(&m, &dir, false, false);
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        assert!(cfg.qk_norm && cfg.head_dim == 16);
        assert_eq!(cfg.eos_token_ids, vec![2, 3]);
        check_greedy(backend, &m, &dir, 0.0);
    }
}
