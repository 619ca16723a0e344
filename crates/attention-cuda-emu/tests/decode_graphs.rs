//! The model runner's decode batches through CUDA graphs on the emulated device
//! (`ModelRunner::enable_decode_graphs` with attention-cuda's `CudaGraphRunner`): greedy
//! generation over a schedule of decode batches of varying sizes (captured sizes, sizes that
//! pad, a size beyond the largest captured one, a request past the graphs' context) gives
//! bitwise the logits and tokens of the same runner without graphs (what
//! `--disable-cuda-graph` builds), and each batch takes the route the host logic decides.
//! The MLA decoder captures and replays bitwise like the Llama decoder, with dense MLPs and
//! with mixture-of-experts layers (routed on the device by `fused_moe`, nothing read back).

mod common;

use std::sync::{Arc, Mutex};

use attention::TensorDtype;
use attention::{DecodeForward, DecodeGraphs, RequestKv};
use attention_cuda::{CudaBackend, CudaConfig, CudaGraphConfig, CudaGraphRunner, GraphRoute};
use attention_cuda_emu::{emu_or_skip, EmuDevice};
use kv_pool::{KvDtype, KvLayout, Slot};
use model::greedy_check::StoredAs;
use model::tiny::random_weights;
use model::{
    argmax, AttentionMode, ForwardInput, ForwardRequest, LogitsMode, Model, ModelConfig,
    ModelRunner,
};

type Emu = CudaBackend<EmuDevice>;

const PAGE: u32 = 16;
const PAGES_PER_REQUEST: u32 = 4;
/// The graphs' context: request 0 passes it in the schedule's last batch.
const MAX_CONTEXT: usize = 48;

fn prompts() -> Vec<Vec<u32>> {
    [40, 9, 30, 17, 5, 12]
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            (0..n)
                .map(|i| ((i * 31 + r * 7 + 3) % 512) as u32)
                .collect()
        })
        .collect()
}

/// Decode batches: requests `0..bs` each decode one token.
const SCHEDULE: [usize; 9] = [1, 3, 5, 2, 4, 6, 3, 1, 1];

/// The graph runner, logging each decode batch's route and whether it replayed.
struct Logged {
    inner: CudaGraphRunner<EmuDevice>,
    log: Arc<Mutex<Vec<String>>>,
}

impl DecodeGraphs<Emu> for Logged {
    fn capture(&mut self, forward: &mut DecodeForward<'_, Emu>) -> attention::Result<()> {
        self.inner.capture(forward)
    }

    fn replay(
        &mut self,
        requests: &[RequestKv<'_>],
        input_ids: &[u32],
        forward: &mut DecodeForward<'_, Emu>,
    ) -> attention::Result<Option<Vec<f32>>> {
        let route = self.inner.route(requests);
        let out = self.inner.replay(requests, input_ids, forward)?;
        let ran = if out.is_some() { "replayed" } else { "eager" };
        assert_eq!(out.is_some(), matches!(route, GraphRoute::Replay { .. }));
        self.log
            .lock()
            .unwrap()
            .push(format!("bs {}: {route} → {ran}", requests.len()));
        Ok(out)
    }

    fn captured_bs(&self) -> Vec<usize> {
        self.inner.captured_bs()
    }

    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
    }
}

fn graph_config() -> CudaGraphConfig {
    CudaGraphConfig {
        cuda_graph_max_bs: Some(4),
        max_running_requests: 8,
        max_context_len: MAX_CONTEXT,
        page_size: PAGE,
    }
}

/// A runner of `config`'s random model (`forms`' weights stored as their `TensorDtype`) on
/// `device` with `forms`' backend config and a bf16 store for every prompt.
fn runner(device: EmuDevice, config: &ModelConfig, forms: &Forms) -> ModelRunner<Emu> {
    let b = CudaBackend::new(device, forms.0);
    let weights = StoredAs::new(random_weights(config, 0x9a4b), forms.1);
    let model = Model::load(&b, config.clone(), &weights).unwrap();
    let shape = config.kv_shape(KvDtype::Bf16).unwrap();
    let slots = (1 + prompts().len() as u32 * PAGES_PER_REQUEST) * PAGE;
    let layout = KvLayout::new(shape, PAGE, slots as usize).unwrap();
    ModelRunner::new(b, model, layout).unwrap()
}

/// Request `r`'s slots for `len` positions (its own pages, after the padding page).
fn slots(r: usize, len: usize) -> Vec<Slot> {
    let first = 1 + r as u32 * PAGES_PER_REQUEST;
    (0..len as u32)
        .map(|p| Slot((first + p / PAGE) * PAGE + p % PAGE))
        .collect()
}

/// One pass of `mode` over `seqs[..n]`, each request's last `new[r]` tokens new.
fn pass(
    runner: &mut ModelRunner<Emu>,
    mode: AttentionMode,
    seqs: &[Vec<u32>],
    new: impl Fn(usize) -> usize,
) -> model::LogitsOutput {
    let lists: Vec<Vec<Slot>> = seqs
        .iter()
        .enumerate()
        .map(|(r, s)| slots(r, s.len()))
        .collect();
    let requests = seqs
        .iter()
        .zip(&lists)
        .enumerate()
        .map(|(r, (s, slots))| ForwardRequest {
            input_ids: &s[s.len() - new(r)..],
            slots,
        })
        .collect();
    runner
        .forward(&ForwardInput {
            mode,
            requests,
            logits: LogitsMode::LastToken,
            layer_wait: None,
        })
        .unwrap()
}

/// Greedy generation: a prefill of every prompt, then [`SCHEDULE`]'s decode batches. Returns
/// the sequences and every decode batch's logits.
fn generate(runner: &mut ModelRunner<Emu>) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut seqs = prompts();
    let lens: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let out = pass(runner, AttentionMode::Extend, &seqs, |r| lens[r]);
    let mut next: Vec<u32> = (0..seqs.len())
        .map(|r| argmax(out.last(r).unwrap()))
        .collect();
    let mut logits = Vec::new();
    for bs in SCHEDULE {
        for r in 0..bs {
            seqs[r].push(next[r]);
        }
        let out = pass(runner, AttentionMode::Decode, &seqs[..bs], |_| 1);
        for (r, t) in next.iter_mut().enumerate().take(bs) {
            *t = argmax(out.last(r).unwrap());
        }
        logits.push(out.logits);
    }
    (seqs, logits)
}

/// `config`'s decoder greedy over [`SCHEDULE`] with and without graphs: equal tokens and
/// bitwise equal logits. Returns each decode batch's route, or `None` without the emulation.
fn graphs_match_eager(test: &str, config: &ModelConfig) -> Option<String> {
    graphs_match_eager_on(test, config, &(CudaConfig::default(), TensorDtype::F32))
}

/// A backend config and the weights' stored type.
type Forms = (CudaConfig, TensorDtype);

/// [`graphs_match_eager`] on a backend of `forms`.
fn graphs_match_eager_on(test: &str, config: &ModelConfig, forms: &Forms) -> Option<String> {
    let (Some(d1), Some(d2)) = (emu_or_skip(test), emu_or_skip(test)) else {
        return None;
    };
    let mut eager = runner(d1, config, forms);
    let mut graphed = runner(d2, config, forms);
    let log = Arc::new(Mutex::new(Vec::new()));
    let inner = CudaGraphRunner::new(graphed.backend(), graph_config()).unwrap();
    graphed
        .enable_decode_graphs(Box::new(Logged {
            inner,
            log: Arc::clone(&log),
        }))
        .unwrap();
    assert!(eager.decode_graphs().is_none());
    let captured = graphed.decode_graphs().map(|g| g.captured_bs());
    assert_eq!(captured, Some(vec![1, 2, 4]));

    let (want_seqs, want_logits) = generate(&mut eager);
    let (got_seqs, got_logits) = generate(&mut graphed);
    assert_eq!(got_seqs, want_seqs, "greedy tokens");
    for (step, (got, want)) in got_logits.iter().zip(&want_logits).enumerate() {
        let same = got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(g, w)| g.to_bits() == w.to_bits());
        assert!(
            same,
            "decode batch {step} (bs {}): logits differ",
            SCHEDULE[step]
        );
    }
    let moe = config.mla.as_ref().is_some_and(|m| m.moe.is_some());
    if forms.0.moe_tensor_cores && moe {
        // Run or recorded into a graph: the tensor-core expert matmuls took part.
        let launches = graphed
            .backend()
            .device()
            .launch_count("moe_matmul_mma", |_| true);
        assert!(launches > 0, "no moe_matmul_mma launch");
    }
    let log = log.lock().unwrap().join("\n");
    Some(log)
}

#[test]
fn decode_batches_through_graphs_are_bitwise_the_eager_ones() {
    let test = "decode_batches_through_graphs_are_bitwise_the_eager_ones";
    if let Some(log) = graphs_match_eager(test, &common::llama_config()) {
        insta::assert_snapshot!(log);
    }
}

/// MLA without mixture-of-experts layers (every MLP dense): concat_last runs on the device, so
/// nothing reads back and the decode forward captures; the batches take the Llama decoder's
/// routes.
#[test]
fn dense_mla_decode_batches_through_graphs_are_bitwise_the_eager_ones() {
    let test = "dense_mla_decode_batches_through_graphs_are_bitwise_the_eager_ones";
    let mut config = common::mla_config();
    config.mla.as_mut().expect("an MLA config").moe = None;
    let Some(mla_log) = graphs_match_eager(test, &config) else {
        return;
    };
    let llama_log = graphs_match_eager(test, &common::llama_config()).expect("the emulation ran");
    assert_eq!(mla_log, llama_log);
}

/// MLA with mixture-of-experts layers: routing and the experts run on the device
/// (`fused_moe`), so the decode forward captures too, and replays bitwise like the eager one.
#[test]
fn moe_mla_decode_batches_through_graphs_are_bitwise_the_eager_ones() {
    let test = "moe_mla_decode_batches_through_graphs_are_bitwise_the_eager_ones";
    let config = common::mla_config();
    assert!(config.mla.as_ref().is_some_and(|m| m.moe.is_some()));
    let Some(moe_log) = graphs_match_eager(test, &config) else {
        return;
    };
    let llama_log = graphs_match_eager(test, &common::llama_config()).expect("the emulation ran");
    assert_eq!(moe_log, llama_log);
}

/// The MoE decoder with bf16 weights on every opt-in tensor-core form (`moe_tensor_cores`,
/// `gemm_tensor_cores`, `prefill_tensor_cores`): its decode batches capture and replay bitwise
/// like the eager ones (the expert matmuls on `moe_matmul_mma`, their activations rounded by a
/// launch the graph records), and take the Llama decoder's routes.
#[test]
fn tensor_core_forms_decode_batches_through_graphs_are_bitwise_the_eager_ones() {
    let test = "tensor_core_forms_decode_batches_through_graphs_are_bitwise_the_eager_ones";
    let forms = (
        CudaConfig {
            moe_tensor_cores: true,
            gemm_tensor_cores: true,
            prefill_tensor_cores: true,
            ..CudaConfig::default()
        },
        TensorDtype::Bf16,
    );
    let Some(log) = graphs_match_eager_on(test, &common::mla_config(), &forms) else {
        return;
    };
    let llama_log = graphs_match_eager(test, &common::llama_config()).expect("the emulation ran");
    assert_eq!(log, llama_log);
}
