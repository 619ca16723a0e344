//! Greedy decoding of the tiny presets on wgpu against the CPU backend, through the model
//! crate's `ModelRunner` (prefill of a batch of prompts, then batched decode steps).
//!
//! The two backends sum in different orders (the CPU's 8-lane dot products and 32-position
//! attention blocks, the GPU's tiled matmul and 64-key blocks with split-KV), so logits are not
//! bitwise equal: they must agree within `LOGIT_BOUND` (relative L2 per row, f32 rounding of
//! a few thousand-term sums), and the greedy tokens must be equal. Should a token ever differ,
//! the test accepts it only at a near tie (the CPU's top two logits closer than the bound
//! allows the backends to disagree by) and reports it; any other divergence fails.

use attention::{Backend, CpuBackend};
use attention_wgpu::test_support::backend_or_skip;
use kv_pool::{KvDtype, KvLayout, Slot};
use model::tiny::{
    random_weights, tiny_config, tiny_mla_config, tiny_mla_model, tiny_model, tiny_tokenizer,
};
use model::{
    AttentionMode, ForwardInput, ForwardRequest, LogitsMode, Model, ModelConfig, ModelRunner,
};

const PAGE: u32 = 16;
const PAGES_PER_REQUEST: u32 = 8;
/// Decode steps after the prefill (a forward takes about half a second on lavapipe in CI,
/// twice that on its GL driver, and the suite runs on both).
const STEPS: usize = 3;
/// Relative L2 error allowed between a CPU and a wgpu logit row over f32 stores.
const LOGIT_BOUND: f64 = 1e-4;
/// Over f16 stores: both round K/V to f16, but WGSL lets the device round either way at a
/// tie-free boundary, so a stored element may differ by one f16 ulp (`2⁻¹⁰` relative); the
/// logits then differ by at most a few times that.
const LOGIT_BOUND_F16: f64 = 4.0 / 1024.0;

/// Per request: the greedy tokens and the logit row each came from.
struct Trace {
    tokens: Vec<Vec<u32>>,
    logits: Vec<Vec<Vec<f32>>>,
}

fn slots(r: usize, len: usize) -> Vec<Slot> {
    let first = 1 + r as u32 * PAGES_PER_REQUEST;
    (0..len as u32)
        .map(|p| Slot((first + p / PAGE) * PAGE + p % PAGE))
        .collect()
}

fn greedy<B: Backend>(runner: &mut ModelRunner<B>, prompts: &[Vec<u32>]) -> Trace {
    let n = prompts.len();
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut trace = Trace {
        tokens: vec![Vec::new(); n],
        logits: vec![Vec::new(); n],
    };
    for step in 0..=STEPS {
        let slot_lists: Vec<Vec<Slot>> = seqs
            .iter()
            .enumerate()
            .map(|(r, s)| slots(r, s.len()))
            .collect();
        let requests: Vec<ForwardRequest<'_>> = seqs
            .iter()
            .zip(&slot_lists)
            .enumerate()
            .map(|(r, (s, sl))| ForwardRequest {
                input_ids: if step == 0 { &s[..] } else { &s[s.len() - 1..] },
                slots: if step == 0 {
                    &sl[..prompts[r].len()]
                } else {
                    sl
                },
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
            trace.tokens[r].push(tok);
            trace.logits[r].push(out.last(r).unwrap().to_vec());
            seqs[r].push(tok);
        }
    }
    trace
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|&b| (b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Compares the traces; returns a report line per request.
fn compare(cpu: &Trace, gpu: &Trace, bound: f64) -> Vec<String> {
    let mut report = Vec::new();
    for r in 0..cpu.tokens.len() {
        let mut worst = 0.0f64;
        for (step, (c, g)) in cpu.logits[r].iter().zip(&gpu.logits[r]).enumerate() {
            let err = rel_l2(g, c);
            worst = worst.max(err);
            assert!(
                err <= bound,
                "request {r} step {step}: logits differ by {err:.3e} > {bound:.0e}"
            );
            let (ct, gt) = (cpu.tokens[r][step], gpu.tokens[r][step]);
            if ct != gt {
                // Only a near tie may flip: the CPU's gap between the two tokens must be
                // within what the bound lets the rows differ by.
                let norm = c.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
                let gap = (c[ct as usize] - c[gt as usize]) as f64;
                assert!(
                    gap <= 2.0 * bound * norm,
                    "request {r} step {step}: wgpu chose {gt}, cpu {ct}, with a logit gap of \
                     {gap:.3e} (not a near tie)"
                );
                report.push(format!(
                    "request {r}: first divergence at step {step} is a near tie (gap {gap:.2e})"
                ));
                break;
            }
        }
        report.push(format!(
            "request {r}: tokens {:?}, worst logit error {worst:.2e}",
            gpu.tokens[r]
        ));
    }
    report
}

fn prompts() -> Vec<Vec<u32>> {
    let tok = tiny_tokenizer();
    [
        "The quick brown fox",
        "Paged attention reads the KV cache through a page table, one page at a time.",
        "Hello",
        "kvserve runs the same decoder on a CPU and on any GPU that wgpu can reach, and the \
         greedy tokens agree.",
    ]
    .iter()
    .map(|s| tok.encode(s, false).unwrap())
    .collect()
}

fn run<B: Backend>(backend: B, model: Model<B>, dtype: KvDtype) -> Trace {
    let shape = model.config().kv_shape(dtype).unwrap();
    let n = prompts().len() as u32;
    let layout = KvLayout::new(shape, PAGE, (n * PAGES_PER_REQUEST * PAGE) as usize).unwrap();
    let mut runner = ModelRunner::new(backend, model, layout).unwrap();
    greedy(&mut runner, &prompts())
}

#[test]
fn tiny_greedy_matches_cpu() {
    let Some(gpu) = backend_or_skip("tiny_greedy_matches_cpu") else {
        return;
    };
    let cpu = CpuBackend::default();
    let want = run(cpu.clone(), tiny_model(&cpu).unwrap().into(), KvDtype::F32);
    let got = run(gpu.clone(), tiny_model(&gpu).unwrap().into(), KvDtype::F32);
    assert_eq!(tiny_config().num_hidden_layers, 2);
    for line in compare(&want, &got, LOGIT_BOUND) {
        println!("{line}");
    }
    assert_eq!(got.tokens, want.tokens, "greedy tokens differ");
}

#[test]
fn tiny_mla_greedy_matches_cpu() {
    let Some(gpu) = backend_or_skip("tiny_mla_greedy_matches_cpu") else {
        return;
    };
    assert!(tiny_mla_config().mla.is_some());
    let cpu = CpuBackend::default();
    let want = run(cpu.clone(), tiny_mla_model(&cpu).unwrap(), KvDtype::F32);
    let got = run(gpu.clone(), tiny_mla_model(&gpu).unwrap(), KvDtype::F32);
    for line in compare(&want, &got, LOGIT_BOUND) {
        println!("{line}");
    }
    assert_eq!(got.tokens, want.tokens, "greedy tokens differ");
}

/// An f16 store on wgpu against an f16 host store: both round K/V to f16 on write, so the
/// outputs stay within the f16 bound and the greedy tokens agree.
#[test]
fn tiny_greedy_f16_store_matches_cpu() {
    let Some(gpu) = backend_or_skip("tiny_greedy_f16_store_matches_cpu") else {
        return;
    };
    let shape = tiny_config().kv_shape(KvDtype::F16).unwrap();
    if let Err(reason) = gpu.kv_support(&shape) {
        println!("SKIP tiny_greedy_f16_store_matches_cpu: {reason}");
        return;
    }
    let cpu = CpuBackend::default();
    let want = run(cpu.clone(), tiny_model(&cpu).unwrap().into(), KvDtype::F16);
    let got = run(gpu.clone(), tiny_model(&gpu).unwrap().into(), KvDtype::F16);
    for line in compare(&want, &got, LOGIT_BOUND_F16) {
        println!("{line}");
    }
    assert_eq!(got.tokens, want.tokens, "greedy tokens differ");
}

/// The presets tie the LM head to the embedding, so their random weights mostly echo the last
/// token. With an untied head of its own (the same shapes otherwise) the greedy continuation
/// wanders through the vocabulary, so the comparison covers many different KV contents.
#[test]
fn untied_presets_greedy_match_cpu() {
    let Some(gpu) = backend_or_skip("untied_presets_greedy_match_cpu") else {
        return;
    };
    let cpu = CpuBackend::default();
    for base in [tiny_config(), tiny_mla_config()] {
        let config = ModelConfig {
            tie_word_embeddings: false,
            ..base
        };
        let weights = random_weights(&config, 0x5eed);
        let want = run(
            cpu.clone(),
            Model::load(&cpu, config.clone(), &weights).unwrap(),
            KvDtype::F32,
        );
        let got = run(
            gpu.clone(),
            Model::load(&gpu, config.clone(), &weights).unwrap(),
            KvDtype::F32,
        );
        for line in compare(&want, &got, LOGIT_BOUND) {
            println!("{line}");
        }
        let distinct: std::collections::HashSet<u32> =
            want.tokens.iter().flatten().copied().collect();
        println!(
            "{:?}: {} distinct tokens",
            config.architecture,
            distinct.len()
        );
        assert_eq!(got.tokens, want.tokens, "greedy tokens differ");
    }
}
