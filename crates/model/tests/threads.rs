//! Thread invariance of a whole forward pass on the CPU backend: prefill, decode and mixed
//! (extend + decode) batches give bitwise the same logits on 1, 2 and 3 worker threads, with
//! f32 weights and with bf16 weights (whose matmuls round the activations to bf16). The model
//! is wide enough (LM head 4,096 × 96, MLP 256) that its matmuls are split over the workers
//! even at one decode row.

use attention::{CpuBackend, CpuConfig};
use kv_pool::{KvDtype, KvLayout, Slot};
use model::tiny::{random_weights, tiny_config};
use model::{
    AttentionMode, ForwardInput, ForwardRequest, HostTensor, LlamaModel, LogitsMode, LogitsOutput,
    ModelConfig, ModelRunner, TensorMap, TensorSource,
};

fn config() -> ModelConfig {
    ModelConfig {
        hidden_size: 96,
        intermediate_size: 256,
        num_attention_heads: 6,
        vocab_size: 4096,
        ..tiny_config()
    }
}

/// The random weights with every matrix stored as bf16 (as a bf16 checkpoint reads).
struct Bf16Matrices(TensorMap);

impl TensorSource for Bf16Matrices {
    fn names(&self) -> Vec<String> {
        self.0.names()
    }
    fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        let (shape, dtype) = self.0.info(name)?;
        let dtype = if shape.len() == 2 {
            "BF16".into()
        } else {
            dtype
        };
        Some((shape, dtype))
    }
    fn load(&self, name: &str) -> model::Result<HostTensor> {
        let mut t = self.0.load(name)?;
        if t.shape.len() == 2 {
            t.data
                .iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
        Ok(t)
    }
}

fn runner(threads: usize, bf16: bool) -> ModelRunner<CpuBackend> {
    let cfg = config();
    let backend = CpuBackend::new(CpuConfig {
        threads,
        ..CpuConfig::default()
    })
    .unwrap();
    let weights = random_weights(&cfg, 21);
    let model = if bf16 {
        LlamaModel::load(&backend, cfg.clone(), &Bf16Matrices(weights)).unwrap()
    } else {
        LlamaModel::load(&backend, cfg.clone(), &weights).unwrap()
    };
    let layout = KvLayout::new(cfg.kv_shape(KvDtype::F16).unwrap(), 16, 1024).unwrap();
    ModelRunner::new(backend, model, layout).unwrap()
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % 4096)
        .collect()
}

/// One pass over `(new ids, slots)` per request.
fn pass(
    r: &mut ModelRunner<CpuBackend>,
    mode: AttentionMode,
    reqs: &[(&[u32], &[Slot])],
    logits: LogitsMode,
) -> LogitsOutput {
    let requests = reqs
        .iter()
        .map(|&(input_ids, slots)| ForwardRequest { input_ids, slots })
        .collect();
    r.forward(&ForwardInput {
        mode,
        requests,
        logits,
        layer_wait: None,
    })
    .unwrap()
}

/// A sequence's last token, at its position.
fn last<'a>(seq: &'a [u32], slots: &'a [Slot]) -> (&'a [u32], &'a [Slot]) {
    (&seq[seq.len() - 1..], &slots[..seq.len()])
}

/// Prefills A and B together, decodes both three steps, then runs a mixed batch (C's prompt
/// beside one more token of A and B); returns every logit of every pass, as bits.
fn session(threads: usize, bf16: bool) -> Vec<u32> {
    let mut r = runner(threads, bf16);
    let slots =
        |i: u32, len: usize| -> Vec<Slot> { (0..len as u32).map(|p| Slot(i * 256 + p)).collect() };
    let (sa, sb, sc) = (slots(0, 80), slots(1, 80), slots(2, 50));
    let mut seqs = [prompt(70, 1), prompt(33, 2)];
    let mut bits = Vec::new();
    let mut keep = |out: &LogitsOutput, seqs: &mut [Vec<u32>]| {
        bits.extend(out.logits.iter().map(|v| v.to_bits()));
        for (s, t) in seqs.iter_mut().zip(out.argmax()) {
            s.push(t.unwrap());
        }
    };
    let prefill = [(&seqs[0][..], &sa[..70]), (&seqs[1][..], &sb[..33])];
    let out = pass(
        &mut r,
        AttentionMode::Extend,
        &prefill,
        LogitsMode::AllTokens,
    );
    keep(&out, &mut seqs);
    for _ in 0..3 {
        let reqs = [last(&seqs[0], &sa), last(&seqs[1], &sb)];
        let out = pass(&mut r, AttentionMode::Decode, &reqs, LogitsMode::LastToken);
        keep(&out, &mut seqs);
    }
    let c = prompt(50, 3);
    let mixed = [(&c[..], &sc[..]), last(&seqs[0], &sa), last(&seqs[1], &sb)];
    let out = pass(&mut r, AttentionMode::Extend, &mixed, LogitsMode::AllTokens);
    keep(&out, &mut [c.clone(), seqs[0].clone(), seqs[1].clone()]);
    bits
}

#[test]
fn forward_passes_do_not_depend_on_threads() {
    for bf16 in [false, true] {
        let one = session(1, bf16);
        assert_eq!(one.len(), (70 + 33 + 2 * 3 + 52) * 4096);
        for threads in [2, 3] {
            let many = session(threads, bf16);
            let first = one.iter().zip(&many).position(|(a, b)| a != b);
            assert!(
                first.is_none(),
                "bf16 {bf16}, {threads} threads: logit {} differs from one thread",
                first.unwrap()
            );
        }
    }
}
