//! Whole decoders on the emulated CUDA kernels: greedy decoding of a tiny Llama-shaped model
//! (random untied weights, head dim 64 so the attention kernels are specialised for it) and of
//! the tiny DeepSeek-V2-shaped MLA model (absorbed MLA over the latent store, rope dim 16 so
//! `kv_lora_rank + rope` is a compiled MLA shape) through the model crate's `ModelRunner`,
//! against the CPU backend (`model::greedy_check`, the schedule `attention-cuda/tests/gpu.rs`
//! runs on a real GPU): logits within a bound (relative L2 per row), greedy tokens equal; a
//! prefill of a batch of prompts, then batched decode steps, over f32 and bf16 stores.

mod common;

use attention::TensorDtype;
use attention_cuda::{CudaBackend, CudaConfig};
use attention_cuda_emu::emu_or_skip;
use kv_pool::KvDtype;
use model::greedy_check::check_against_cpu;
use model::ModelConfig;

/// Logits of a model with bf16 weights on a backend that keeps f32 activations, against the
/// CPU's (activations rounded to bf16 for each such matmul): up to `2⁻⁸` relative per activation, a few 1e-3 on these logits.
const BF16_WEIGHTS_BOUND: f64 = 1e-2;

#[test]
fn tiny_decoder_greedy_matches_cpu() {
    greedy_matches_cpu("tiny_decoder_greedy_matches_cpu", &common::llama_config());
}

#[test]
fn tiny_mla_decoder_greedy_matches_cpu() {
    greedy_matches_cpu("tiny_mla_decoder_greedy_matches_cpu", &common::mla_config());
}

/// The MLA decoder over a bf16 store with the tensor-core MLA form
/// (`CudaConfig::mla_tensor_cores`), which its attention launches must have taken.
#[test]
fn tiny_mla_decoder_on_the_tensor_core_form_greedy_matches_cpu() {
    let Some(device) = emu_or_skip("tiny_mla_decoder_on_the_tensor_core_form") else {
        return;
    };
    let config = CudaConfig {
        mla_tensor_cores: true,
        ..CudaConfig::default()
    };
    let emu = CudaBackend::new(device, config);
    let model = common::mla_config();
    match check_against_cpu(emu.clone(), &model, KvDtype::Bf16, TensorDtype::F32, 1e-3).unwrap() {
        Ok(tokens) => println!("{tokens}"),
        Err(mismatch) => panic!("{mismatch}"),
    }
    let mma = |spec: &attention_cuda::Spec| spec.defines.iter().any(|(k, _)| *k == "MMA_HEADS");
    assert!(emu.device().launch_count("paged_attention_pipelined", mma) > 0);
}

/// The Llama and MLA decoders (the MLA one's layer 1 routes to 4 experts) with bf16 weights on
/// the tensor-core GEMMs (`CudaConfig::gemm_tensor_cores` and `moe_tensor_cores`), which the
/// prefill's matmuls (more than `gemm::MMA_MIN_ROWS` rows) and the MoE layer must have taken
/// (both round the activations to bf16, as the CPU backend does for a bf16 weight), and the
/// tensor-core prefill attention (`prefill_tensor_cores`), which the Llama decoder's prefill
/// over its bf16 store must have taken.
#[test]
fn tiny_decoders_on_the_tensor_core_forms_greedy_match_cpu() {
    let Some(device) = emu_or_skip("tiny_decoders_on_the_tensor_core_forms") else {
        return;
    };
    let config = CudaConfig {
        gemm_tensor_cores: true,
        moe_tensor_cores: true,
        prefill_tensor_cores: true,
        ..CudaConfig::default()
    };
    let emu = CudaBackend::new(device, config);
    let mla = common::mla_config();
    assert!(mla.mla.as_ref().is_some_and(|m| m.moe.is_some()));
    for model in [common::llama_config(), mla] {
        let check = check_against_cpu(
            emu.clone(),
            &model,
            KvDtype::Bf16,
            TensorDtype::Bf16,
            BF16_WEIGHTS_BOUND,
        );
        match check.unwrap() {
            Ok(tokens) => println!("{:?} {tokens}", model.architecture),
            Err(mismatch) => panic!("{:?} {mismatch}", model.architecture),
        }
    }
    for kernel in ["matmul_mma", "moe_matmul_mma", "paged_prefill"] {
        assert!(emu.device().launch_count(kernel, |_| true) > 0, "{kernel}");
    }
}

fn greedy_matches_cpu(test: &str, config: &ModelConfig) {
    let Some(device) = emu_or_skip(test) else {
        return;
    };
    let emu = CudaBackend::new(device, CudaConfig::default());
    // f32 stores: only summation order differs. bf16 stores: both round K/V identically (the
    // device store's bytes equal the host's), so the same bound holds with margin. bf16
    // weights: the CPU rounds a bf16 weight's activations to bf16 (`Backend::upload_weight`'s
    // liberty), the kernels widen the weight and keep f32 activations.
    for (dtype, weights, bound) in [
        (KvDtype::F32, TensorDtype::F32, 1e-4),
        (KvDtype::Bf16, TensorDtype::F32, 1e-3),
        (KvDtype::Bf16, TensorDtype::Bf16, BF16_WEIGHTS_BOUND),
        (KvDtype::F32, TensorDtype::F16, 1e-4),
    ] {
        match check_against_cpu(emu.clone(), config, dtype, weights, bound).unwrap() {
            Ok(tokens) => println!("{tokens}"),
            Err(mismatch) => panic!("{mismatch}"),
        }
    }
}
