//! A backend's greedy decoding of the tiny models, checked against the CPU backend's: what the
//! CUDA backend's tests assert on the emulated device (`attention-cuda-emu`) and on a real GPU
//! (`attention-cuda/tests/gpu.rs`), one schedule for both.
//!
//! The schedule: four prompts (4, 37, 1 and 20 tokens) prefilled as one extend batch, then
//! [`STEPS`] batched decode steps, each request on its own pages, through [`ModelRunner`] with
//! last-token logits; the weights in f32 or, as a checkpoint stores them, in bf16 or f16
//! ([`Backend::upload_weight`]). Backends sum in different orders, so every logit row must agree with the
//! CPU's within a relative L2 bound and the greedy tokens must be equal.
//!
//! The configs are the tiny presets with a 512-token vocabulary, an untied LM head (tied random
//! embeddings make greedy decoding repeat the last token) and head shapes GPU attention
//! kernels are commonly specialised for: head dim 64 ([`llama_config`]); latent rows of
//! 32 + 16 ([`mla_config`]).

use attention::{Backend, CpuBackend, TensorDtype};
use kv_pool::{KvDtype, KvLayout, Slot};

use crate::tiny::{random_weights, tiny_config, tiny_mla_config};
use crate::weights::{HostTensor, TensorMap, TensorSource};
use crate::{
    AttentionMode, ForwardInput, ForwardRequest, LogitsMode, MlaConfig, Model, ModelConfig,
    ModelRunner, Result,
};

const PAGE: u32 = 16;
const PAGES_PER_REQUEST: u32 = 4;

/// Decode steps after the prefill.
pub const STEPS: usize = 6;

/// The tiny Llama preset with head dim 64, a 512-token vocabulary and an untied LM head.
pub fn llama_config() -> ModelConfig {
    ModelConfig {
        head_dim: 64,
        vocab_size: 512,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        ..tiny_config()
    }
}

/// The tiny MLA preset with `qk_rope_head_dim` 16 (latent rows of 32 + 16), a 512-token
/// vocabulary and an untied LM head.
pub fn mla_config() -> ModelConfig {
    let base = tiny_mla_config();
    let mla = base.mla.clone().expect("the MLA preset has its MLA fields");
    ModelConfig {
        head_dim: mla.qk_nope_head_dim + 16,
        mla: Some(MlaConfig {
            qk_rope_head_dim: 16,
            ..mla
        }),
        vocab_size: 512,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        ..base
    }
}

/// The schedule's prompts.
pub fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![17, 301, 5, 88],
        (0..37).map(|i| (i * 13 + 7) % 512).collect(),
        vec![400],
        (0..20).map(|i| (i * 101 + 3) % 512).collect(),
    ]
}

/// One backend's run of the schedule: per request, its greedy tokens and the logit rows they
/// came from (the prefill's, then each decode step's).
#[derive(Debug, Clone, PartialEq)]
pub struct GreedyRun {
    pub tokens: Vec<Vec<u32>>,
    pub logits: Vec<Vec<Vec<f32>>>,
}

/// Weights stored as `dtype`, as a checkpoint of that type would hold them: each value rounded
/// to it, and the type reported, so the loader keeps matrices in it.
pub struct StoredAs {
    weights: TensorMap,
    dtype: TensorDtype,
}

impl StoredAs {
    /// `weights` as a checkpoint of `dtype` would store them.
    pub fn new(weights: TensorMap, dtype: TensorDtype) -> Self {
        StoredAs { weights, dtype }
    }

    /// The safetensors name of the type.
    fn name(&self) -> &'static str {
        match self.dtype {
            TensorDtype::F32 => "F32",
            TensorDtype::F16 => "F16",
            TensorDtype::Bf16 => "BF16",
        }
    }
}

impl TensorSource for StoredAs {
    fn names(&self) -> Vec<String> {
        self.weights.names()
    }
    fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        let (shape, _) = self.weights.info(name)?;
        Some((shape, self.name().to_string()))
    }
    fn load(&self, name: &str) -> Result<HostTensor> {
        let mut t = self.weights.load(name)?;
        for v in &mut t.data {
            *v = self.dtype.round(*v);
        }
        Ok(t)
    }
}

/// Runs the schedule on `backend` with the tiny model of `config` (seeded random weights,
/// stored as `weights`) over a store of `dtype`.
pub fn greedy<B: Backend>(
    backend: B,
    config: &ModelConfig,
    dtype: KvDtype,
    weights: TensorDtype,
) -> Result<GreedyRun> {
    let source = StoredAs {
        weights: random_weights(config, 0x5eed),
        dtype: weights,
    };
    let model = Model::load(&backend, config.clone(), &source)?;
    let n = prompts().len();
    let layout = KvLayout::new(
        config.kv_shape(dtype)?,
        PAGE,
        n * (PAGES_PER_REQUEST * PAGE) as usize + PAGE as usize,
    )?;
    let mut runner = ModelRunner::new(backend, model, layout)?;
    let slots = |r: usize, len: usize| -> Vec<Slot> {
        let first = 1 + r as u32 * PAGES_PER_REQUEST;
        (0..len as u32)
            .map(|p| Slot((first + p / PAGE) * PAGE + p % PAGE))
            .collect()
    };
    let mut seqs = prompts();
    let mut run = GreedyRun {
        tokens: vec![Vec::new(); n],
        logits: vec![Vec::new(); n],
    };
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
        let out = runner.forward(&ForwardInput {
            mode: if step == 0 {
                AttentionMode::Extend
            } else {
                AttentionMode::Decode
            },
            requests,
            logits: LogitsMode::LastToken,
            layer_wait: None,
        })?;
        for (r, tok) in out.argmax().into_iter().enumerate() {
            let tok = tok.expect("the schedule asks for last-token logits");
            run.tokens[r].push(tok);
            run.logits[r].push(out.last(r).expect("a last-token row").to_vec());
            seqs[r].push(tok);
        }
    }
    Ok(run)
}

/// Runs the schedule on `backend` and on the CPU backend (KV in `dtype`, weights stored as
/// `weights`) and compares them: `Err` names the first request and step whose logits differ by
/// more than `bound` (relative L2), or the tokens when they differ. `Ok` describes the tokens
/// decoded.
pub fn check_against_cpu<B: Backend>(
    backend: B,
    config: &ModelConfig,
    dtype: KvDtype,
    weights: TensorDtype,
    bound: f64,
) -> Result<std::result::Result<String, String>> {
    let want = greedy(CpuBackend::default(), config, dtype, weights)?;
    let got = greedy(backend, config, dtype, weights)?;
    for (r, (w, g)) in want.logits.iter().zip(&got.logits).enumerate() {
        for (step, (w, g)) in w.iter().zip(g).enumerate() {
            let err = relative_l2(w, g);
            // A NaN distance fails too.
            if err.is_nan() || err > bound {
                return Ok(Err(format!(
                    "{dtype} KV, {weights:?} weights, request {r} step {step}: logits differ by \
                     {err:.2e} (bound {bound:.0e})"
                )));
            }
        }
    }
    if got.tokens != want.tokens {
        return Ok(Err(format!(
            "{dtype} KV, {weights:?} weights: greedy tokens differ: {:?} vs the CPU's {:?}",
            got.tokens, want.tokens
        )));
    }
    let distinct: std::collections::HashSet<u32> = want.tokens.iter().flatten().copied().collect();
    Ok(Ok(format!(
        "{dtype} KV, {weights:?} weights: tokens {:?} ({} distinct)",
        got.tokens,
        distinct.len()
    )))
}

/// `‖w − g‖ / ‖w‖` in f64 (NaN when either holds a NaN).
fn relative_l2(w: &[f32], g: &[f32]) -> f64 {
    let num: f64 = w
        .iter()
        .zip(g)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum();
    let den: f64 = w.iter().map(|&a| (a as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_agrees_with_itself_and_a_wrong_bound_is_caught() {
        let config = llama_config();
        let same = check_against_cpu(
            CpuBackend::default(),
            &config,
            KvDtype::F32,
            TensorDtype::F32,
            0.0,
        )
        .unwrap();
        assert!(same.is_ok(), "{same:?}");
        // A negative bound fails on the first row, naming it.
        let err = check_against_cpu(
            CpuBackend::default(),
            &config,
            KvDtype::F32,
            TensorDtype::F32,
            -1.0,
        )
        .unwrap()
        .unwrap_err();
        assert!(err.contains("request 0 step 0"), "{err}");
        assert_eq!(relative_l2(&[1.0, 0.0], &[1.0, 0.0]), 0.0);
        assert!(relative_l2(&[1.0], &[f32::NAN]).is_nan());
    }
}
