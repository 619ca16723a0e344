//! Forward-pass invariances on the CPU backend (deterministic, batch-invariant mode): paged
//! over scattered slots = contiguous, prefix-cached extend = full prefill, chunked prefill =
//! one pass, a mixed decode batch = each request alone.
//!
//! The CPU backend is batch-invariant end to end (attention in fixed position blocks, a matmul
//! whose every output is one fixed-order dot product), so every comparison here is bitwise.

use attention::{CpuBackend, RopeScaling};
use kv_pool::{KvDtype, KvLayout, Slot};
use model::tiny::random_weights;
use model::{
    Architecture, AttentionMode, ForwardInput, ForwardRequest, LlamaModel, LogitsMode,
    LogitsOutput, ModelConfig, ModelError, ModelRunner,
};

const POOL: usize = 512;

fn config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Qwen2,
        hidden_size: 48,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 6,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 500_000.0,
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        },
        max_position_embeddings: 1024,
        sliding_window: None,
        vocab_size: 128,
        tie_word_embeddings: false,
        qkv_bias: true,
        o_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        mla: None,
    }
}

/// Asserts logit rows are bitwise equal (naming the first differing logit); returns true so
/// call sites can keep asserting on it.
fn assert_bitwise(got: &[f32], want: &[f32], vocab: usize, what: &str) -> bool {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (r, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        if let Some(i) = g
            .iter()
            .zip(w)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            panic!(
                "{what}: row {r} logit {i}: {} vs {} (not bitwise equal)",
                g[i], w[i]
            );
        }
    }
    true
}

fn runner(page_size: u32) -> ModelRunner<CpuBackend> {
    let cfg = config();
    let backend = CpuBackend::default();
    let weights = random_weights(&cfg, 7);
    let model = LlamaModel::load(&backend, cfg.clone(), &weights).unwrap();
    let layout = KvLayout::new(cfg.kv_shape(KvDtype::F32).unwrap(), page_size, POOL).unwrap();
    ModelRunner::new(backend, model, layout).unwrap()
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % 128)
        .collect()
}

/// Slots for `len` positions on the given pages (position p at `pages[p / P] · P + p mod P`).
fn slots_on(pages: &[u32], page_size: u32, len: usize) -> Vec<Slot> {
    (0..len)
        .map(|p| Slot(pages[p / page_size as usize] * page_size + (p as u32 % page_size)))
        .collect()
}

fn contiguous(page_size: u32, len: usize, first_page: u32) -> Vec<Slot> {
    let pages: Vec<u32> = (first_page..first_page + (len as u32).div_ceil(page_size)).collect();
    slots_on(&pages, page_size, len)
}

fn extend(
    r: &mut ModelRunner<CpuBackend>,
    ids: &[u32],
    slots: &[Slot],
    logits: LogitsMode,
) -> LogitsOutput {
    r.forward(&ForwardInput {
        mode: AttentionMode::Extend,
        requests: vec![ForwardRequest {
            input_ids: ids,
            slots,
        }],
        logits,
        layer_wait: None,
    })
    .unwrap()
}

#[test]
fn paged_scattered_slots_equal_contiguous() {
    for page_size in [1u32, 4, 16] {
        let ids = prompt(37, 1);
        let mut a = runner(page_size);
        let want = extend(
            &mut a,
            &ids,
            &contiguous(page_size, 37, 1),
            LogitsMode::AllTokens,
        );
        // Scattered: pages in a shuffled, non-contiguous order.
        let npages = 37usize.div_ceil(page_size as usize) as u32;
        let total = (POOL as u32) / page_size;
        let pages: Vec<u32> = (0..npages).map(|i| total - 2 * i).collect();
        let mut b = runner(page_size);
        let got = extend(
            &mut b,
            &ids,
            &slots_on(&pages, page_size, 37),
            LogitsMode::AllTokens,
        );
        assert_eq!(got, want, "page size {page_size}");
    }
}

#[test]
fn prefix_cached_extend_equals_full_prefill() {
    let ids = prompt(30, 2);
    let slots = contiguous(4, 30, 3);
    let mut a = runner(4);
    let full = extend(&mut a, &ids, &slots, LogitsMode::AllTokens);
    for prefix in [1usize, 8, 13, 29] {
        let mut b = runner(4);
        extend(&mut b, &ids[..prefix], &slots[..prefix], LogitsMode::None);
        let rest = extend(&mut b, &ids[prefix..], &slots, LogitsMode::AllTokens);
        let want = &full.logits[prefix * full.vocab_size..];
        assert_bitwise(
            &rest.logits,
            want,
            full.vocab_size,
            &format!("prefix {prefix}"),
        );
    }
}

#[test]
fn chunked_prefill_equals_one_pass() {
    let ids = prompt(100, 3);
    let slots = contiguous(1, 100, 1);
    let mut a = runner(1);
    let full = extend(&mut a, &ids, &slots, LogitsMode::AllTokens);
    for chunk in [1usize, 7, 64] {
        let mut b = runner(1);
        let mut logits = Vec::new();
        let mut done = 0;
        while done < ids.len() {
            let end = (done + chunk).min(ids.len());
            let out = extend(
                &mut b,
                &ids[done..end],
                &slots[..end],
                LogitsMode::AllTokens,
            );
            logits.extend_from_slice(&out.logits);
            done = end;
        }
        assert_bitwise(
            &logits,
            &full.logits,
            full.vocab_size,
            &format!("chunk {chunk}"),
        );
    }
}

#[test]
fn mixed_decode_batch_equals_each_request_alone() {
    let lens = [3usize, 11, 29, 1];
    let page = 4u32;
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| prompt(l, 10 + i as u32))
        .collect();
    // Each request gets 16 pages of its own, placed at different offsets.
    let slot_lists: Vec<Vec<Slot>> = (0..lens.len())
        .map(|i| contiguous(page, 40, 1 + 20 * i as u32))
        .collect();
    let steps = 4;
    // Batched: prefill every request alone, then decode all together.
    let mut batched = runner(page);
    let mut seqs = prompts.clone();
    for (i, p) in prompts.iter().enumerate() {
        let out = extend(
            &mut batched,
            p,
            &slot_lists[i][..p.len()],
            LogitsMode::LastToken,
        );
        seqs[i].push(out.argmax()[0].unwrap());
    }
    let mut batch_logits = Vec::new();
    for _ in 0..steps {
        let reqs: Vec<ForwardRequest> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| ForwardRequest {
                input_ids: &s[s.len() - 1..],
                slots: &slot_lists[i][..s.len()],
            })
            .collect();
        let out = batched
            .forward(&ForwardInput {
                mode: AttentionMode::Decode,
                requests: reqs,
                logits: LogitsMode::LastToken,
                layer_wait: None,
            })
            .unwrap();
        let next = out.argmax();
        for (i, s) in seqs.iter_mut().enumerate() {
            s.push(next[i].unwrap());
        }
        batch_logits.push(out);
    }
    // Alone: each request in its own runner, one decode at a time.
    for i in 0..lens.len() {
        let mut alone = runner(page);
        let p = &prompts[i];
        extend(
            &mut alone,
            p,
            &slot_lists[i][..p.len()],
            LogitsMode::LastToken,
        );
        for (step, batch_out) in batch_logits.iter().enumerate() {
            let len = p.len() + step + 1;
            let s = &seqs[i][..len];
            let out = alone
                .forward(&ForwardInput {
                    mode: AttentionMode::Decode,
                    requests: vec![ForwardRequest {
                        input_ids: &s[len - 1..],
                        slots: &slot_lists[i][..len],
                    }],
                    logits: LogitsMode::LastToken,
                    layer_wait: None,
                })
                .unwrap();
            assert_bitwise(
                out.last(0).unwrap(),
                batch_out.last(i).unwrap(),
                out.vocab_size,
                &format!("request {i}, step {step}"),
            );
        }
    }
}

#[test]
fn bad_forward_input_is_a_typed_error() {
    let mut r = runner(1);
    let slots = contiguous(1, 4, 1);
    let err = |r: &mut ModelRunner<CpuBackend>, ids: &[u32], slots: &[Slot], mode| {
        r.forward(&ForwardInput {
            mode,
            requests: vec![ForwardRequest {
                input_ids: ids,
                slots,
            }],
            logits: LogitsMode::LastToken,
            layer_wait: None,
        })
        .unwrap_err()
    };
    let e = err(&mut r, &[1, 2, 3, 4, 5], &slots, AttentionMode::Extend);
    assert!(
        matches!(e, ModelError::InvalidInput { request: 0, .. }),
        "{e}"
    );
    let e = err(&mut r, &[1, 999], &slots[..2], AttentionMode::Extend);
    assert!(e.to_string().contains("token id 999"), "{e}");
    let e = err(&mut r, &[1, 2], &slots[..2], AttentionMode::Decode);
    assert!(matches!(e, ModelError::InvalidInput { .. }), "{e}");
    let e = err(&mut r, &[], &slots[..2], AttentionMode::Extend);
    assert!(matches!(e, ModelError::InvalidInput { .. }), "{e}");
    // A slot beyond the pool.
    let e = err(&mut r, &[1], &[Slot(100_000)], AttentionMode::Extend);
    assert!(matches!(e, ModelError::Attention(_)), "{e}");
}

/// Records the layers a pass waited for; fails at `fail_at`.
struct RecordingGate {
    waited: std::sync::Mutex<Vec<usize>>,
    fail_at: Option<usize>,
}

impl kv_pool::LayerWait for RecordingGate {
    fn wait_layer(&self, layer: usize) -> Result<(), String> {
        self.waited.lock().unwrap().push(layer);
        match self.fail_at {
            Some(l) if l == layer => Err("copy refused".into()),
            _ => Ok(()),
        }
    }
}

#[test]
fn a_pass_waits_for_each_layer_in_order_and_a_failed_wait_fails_it() {
    let ids = prompt(9, 3);
    let slots = contiguous(4, 9, 1);
    let mut r = runner(4);
    let want = extend(&mut r, &ids, &slots, LogitsMode::LastToken);
    let gate = RecordingGate {
        waited: Default::default(),
        fail_at: None,
    };
    let input = |gate: &RecordingGate| {
        let mut r = runner(4);
        let out = r.forward(&ForwardInput {
            mode: AttentionMode::Extend,
            requests: vec![ForwardRequest {
                input_ids: &ids,
                slots: &slots,
            }],
            logits: LogitsMode::LastToken,
            layer_wait: Some(gate),
        });
        (out, format!("{:?}", gate.waited.lock().unwrap()))
    };
    let (out, waited) = input(&gate);
    assert_bitwise(&out.unwrap().logits, &want.logits, 128, "gated pass");
    assert_eq!(waited, "[0, 1]");
    let failing = RecordingGate {
        waited: Default::default(),
        fail_at: Some(1),
    };
    let (out, waited) = input(&failing);
    assert!(
        matches!(out, Err(ModelError::LayerWait { layer: 1, ref reason }) if reason == "copy refused")
    );
    assert_eq!(waited, "[0, 1]");
}
