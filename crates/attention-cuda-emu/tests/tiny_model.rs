//! Whole decoders on the emulated CUDA kernels: greedy decoding of a tiny Llama-shaped model
//! (random untied weights, head dim 64 so the attention kernels are specialised for it) and of
//! the tiny DeepSeek-V2-shaped MLA model (absorbed MLA over the latent store, rope dim 16 so
//! `kv_lora_rank + rope` is a compiled MLA shape) through the model crate's `ModelRunner`,
//! against the CPU backend. The backends sum in different orders, so logits agree within a
//! bound (relative L2 per row) and the greedy tokens must be equal: a prefill of a batch of
//! prompts, then batched decode steps, over f32 and bf16 stores.

mod common;

use attention::{Backend, CpuBackend};
use attention_cuda::{CudaBackend, CudaConfig};
use attention_cuda_emu::emu_or_skip;
use kv_pool::{KvDtype, KvLayout, Slot};
use model::tiny::random_weights;
use model::{
    AttentionMode, ForwardInput, ForwardRequest, LogitsMode, Model, ModelConfig, ModelRunner,
};

const PAGE: u32 = 16;
const PAGES_PER_REQUEST: u32 = 4;
const STEPS: usize = 6;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![17, 301, 5, 88],
        (0..37).map(|i| (i * 13 + 7) % 512).collect(),
        vec![400],
        (0..20).map(|i| (i * 101 + 3) % 512).collect(),
    ]
}

/// Per request, the greedy tokens and the logit rows they came from.
fn greedy<B: Backend>(
    backend: B,
    config: &ModelConfig,
    dtype: KvDtype,
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let config = config.clone();
    let model = Model::load(&backend, config.clone(), &random_weights(&config, 0x5eed)).unwrap();
    let shape = config.kv_shape(dtype).unwrap();
    let n = prompts().len();
    let layout = KvLayout::new(
        shape,
        PAGE,
        n * (PAGES_PER_REQUEST * PAGE) as usize + PAGE as usize,
    )
    .unwrap();
    let mut runner = ModelRunner::new(backend, model, layout).unwrap();
    let slots = |r: usize, len: usize| -> Vec<Slot> {
        let first = 1 + r as u32 * PAGES_PER_REQUEST;
        (0..len as u32)
            .map(|p| Slot((first + p / PAGE) * PAGE + p % PAGE))
            .collect()
    };
    let mut seqs = prompts();
    let (mut tokens, mut logits) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for step in 0..=STEPS {
        let slot_lists: Vec<Vec<Slot>> = (0..n).map(|r| slots(r, seqs[r].len())).collect();
        let requests: Vec<ForwardRequest<'_>> = (0..n)
            .map(|r| {
                let new = if step == 0 { seqs[r].len() } else { 1 };
                ForwardRequest {
                    input_ids: &seqs[r][seqs[r].len() - new..],
                    slots: &slot_lists[r],
                }
            })
            .collect();
        let out = runner
            .forward(&ForwardInput {
                mode: if step == 0 {
                    AttentionMode::Extend
                } else {
                    AttentionMode::Decode
                },
                requests,
                logits: LogitsMode::LastToken,
                layer_wait: None,
            })
            .unwrap();
        for (r, tok) in out.argmax().into_iter().enumerate() {
            let tok = tok.expect("last-token logits");
            tokens[r].push(tok);
            logits[r].push(out.last(r).unwrap().to_vec());
            seqs[r].push(tok);
        }
    }
    (tokens, logits)
}

#[test]
fn tiny_decoder_greedy_matches_cpu() {
    greedy_matches_cpu("tiny_decoder_greedy_matches_cpu", &common::llama_config());
}

#[test]
fn tiny_mla_decoder_greedy_matches_cpu() {
    greedy_matches_cpu("tiny_mla_decoder_greedy_matches_cpu", &common::mla_config());
}

fn greedy_matches_cpu(test: &str, config: &ModelConfig) {
    let Some(device) = emu_or_skip(test) else {
        return;
    };
    let emu = CudaBackend::new(device, CudaConfig::default());
    // f32 stores: only summation order differs. bf16 stores: both round K/V identically (the
    // device store's bytes equal the host's), so the same bound holds with margin.
    for (dtype, bound) in [(KvDtype::F32, 1e-4), (KvDtype::Bf16, 1e-3)] {
        let (want_tokens, want_logits) = greedy(CpuBackend::default(), config, dtype);
        let (got_tokens, got_logits) = greedy(emu.clone(), config, dtype);
        for (r, (w, g)) in want_logits.iter().zip(&got_logits).enumerate() {
            for (step, (w, g)) in w.iter().zip(g).enumerate() {
                let num: f64 = w
                    .iter()
                    .zip(g)
                    .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
                    .sum();
                let den: f64 = w.iter().map(|&a| (a as f64).powi(2)).sum();
                let err = (num / den).sqrt();
                assert!(
                    err <= bound,
                    "{dtype} request {r} step {step}: logits differ by {err:.2e}"
                );
            }
        }
        let distinct: std::collections::HashSet<u32> =
            want_tokens.iter().flatten().copied().collect();
        println!(
            "{dtype}: tokens {got_tokens:?} ({} distinct)",
            distinct.len()
        );
        assert_eq!(got_tokens, want_tokens, "{dtype}: greedy tokens differ");
    }
}
