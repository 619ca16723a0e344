//! Model throughput on the CPU backend: the `tiny` preset's prefill and decode tokens/s, and
//! one decoder layer's forward tokens/s at the tiny shape and at a TinyLlama-1.1B layer shape
//! (hidden 2048, 32 query heads over 4 KV heads of 64, MLP 5632).
//!
//! The `tiny_mla` group runs the same prefill and decode on the DeepSeek-V2-Lite-shaped tiny
//! MLA preset, and `decoder_layer/v2lite_dense_*` one dense DeepSeek-V2-Lite layer (hidden
//! 2048, 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, MLP 10944).
//!
//! Run: `cargo bench -p model --bench tiny_model -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use attention::{Backend, BatchMetadata, CpuBackend, RequestKv, RopeScaling};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kv_pool::{KvDtype, KvLayout, Slot};
use model::tiny::{random_weights, tiny_config, tiny_mla_config, tiny_mla_model, tiny_model};
use model::{
    Architecture, AttentionMode, ForwardInput, ForwardRequest, LogitsMode, MlaConfig, Model,
    ModelConfig, ModelRunner,
};

const PAGE: u32 = 16;

fn tiny_runner(mla: bool, pool: usize) -> ModelRunner<CpuBackend> {
    let backend = CpuBackend::default();
    let (model, cfg): (Model<CpuBackend>, ModelConfig) = if mla {
        (tiny_mla_model(&backend).unwrap(), tiny_mla_config())
    } else {
        (tiny_model(&backend).unwrap().into(), tiny_config())
    };
    let layout = KvLayout::new(cfg.kv_shape(KvDtype::F32).unwrap(), PAGE, pool).unwrap();
    ModelRunner::new(backend, model, layout).unwrap()
}

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 50_000)
        .collect()
}

/// Request `r`'s slots: its own run of pages starting at page `1 + r · pages_each`.
fn slots(r: usize, len: usize, pages_each: usize) -> Vec<Slot> {
    let base = (1 + r * pages_each) as u32 * PAGE;
    (0..len as u32).map(|p| Slot(base + p)).collect()
}

fn bench_tiny(c: &mut Criterion) {
    bench_tiny_group(c, "tiny", false);
    bench_tiny_group(c, "tiny_mla", true);
}

fn bench_tiny_group(c: &mut Criterion, group: &str, mla: bool) {
    let mut g = c.benchmark_group(group);
    // Prefill: one request of 512 tokens, logits for the last.
    let prompt = 512;
    let mut runner = tiny_runner(mla, 4096);
    let p_ids = ids(prompt, 1);
    let p_slots = slots(0, prompt, prompt / PAGE as usize);
    g.throughput(Throughput::Elements(prompt as u64));
    g.bench_function("prefill_512", |b| {
        b.iter(|| {
            let out = runner
                .forward(&ForwardInput {
                    mode: AttentionMode::Extend,
                    requests: vec![ForwardRequest {
                        input_ids: &p_ids,
                        slots: &p_slots,
                    }],
                    logits: LogitsMode::LastToken,
                    layer_wait: None,
                })
                .unwrap();
            black_box(out);
        })
    });
    // Decode: 16 requests with 512 tokens of context each, one step (re-run at the same
    // position, so the KV state is the same every iteration).
    let batch = 16;
    let ctx = 512;
    let pages_each = ctx / PAGE as usize + 1;
    let mut runner = tiny_runner(mla, batch * pages_each * PAGE as usize + PAGE as usize);
    let all: Vec<(Vec<u32>, Vec<Slot>)> = (0..batch)
        .map(|r| (ids(ctx, r as u32), slots(r, ctx, pages_each)))
        .collect();
    for (i, s) in &all {
        runner
            .forward(&ForwardInput {
                mode: AttentionMode::Extend,
                requests: vec![ForwardRequest {
                    input_ids: &i[..ctx - 1],
                    slots: &s[..ctx - 1],
                }],
                logits: LogitsMode::None,
                layer_wait: None,
            })
            .unwrap();
    }
    g.throughput(Throughput::Elements(batch as u64));
    g.bench_function("decode_16x512", |b| {
        b.iter(|| {
            let reqs = all
                .iter()
                .map(|(i, s)| ForwardRequest {
                    input_ids: &i[ctx - 1..],
                    slots: s,
                })
                .collect();
            let out = runner
                .forward(&ForwardInput {
                    mode: AttentionMode::Decode,
                    requests: reqs,
                    logits: LogitsMode::LastToken,
                    layer_wait: None,
                })
                .unwrap();
            black_box(out);
        })
    });
    g.finish();
}

fn tinyllama_layer() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 2048,
        intermediate_size: 5632,
        num_hidden_layers: 1,
        num_attention_heads: 32,
        num_key_value_heads: 4,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        max_position_embeddings: 2048,
        sliding_window: None,
        vocab_size: 256,
        tie_word_embeddings: true,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        mla: None,
    }
}

/// One dense layer of DeepSeek-V2-Lite (its layer 0).
fn v2lite_dense_layer() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::DeepseekV2,
        hidden_size: 2048,
        intermediate_size: 10944,
        num_attention_heads: 16,
        num_key_value_heads: 16,
        head_dim: 192,
        rms_norm_eps: 1e-6,
        mla: Some(MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            rope_mscale: 1.0,
            softmax_mscale: 1.0,
            moe: None,
        }),
        ..tinyllama_layer()
    }
}

fn bench_layer(c: &mut Criterion) {
    let mut g = c.benchmark_group("decoder_layer");
    g.sample_size(10);
    for (name, cfg, n) in [
        ("tiny_128", tiny_config(), 128usize),
        ("tinyllama_128", tinyllama_layer(), 128),
        ("tinyllama_decode_16", tinyllama_layer(), 16),
        ("tiny_mla_moe_128", tiny_mla_config(), 128),
        ("v2lite_dense_128", v2lite_dense_layer(), 128),
        ("v2lite_dense_decode_16", v2lite_dense_layer(), 16),
    ] {
        let backend = CpuBackend::default();
        let model = Model::load(&backend, cfg.clone(), &random_weights(&cfg, 1)).unwrap();
        let layout = KvLayout::new(cfg.kv_shape(KvDtype::F32).unwrap(), PAGE, 4096).unwrap();
        let mut store = backend.new_kv_store(layout).unwrap();
        let decode = name.contains("decode");
        // The tiny MLA preset's layer 1 is its MoE layer.
        let layer = usize::from(name.contains("moe"));
        // Extend: one request of n tokens. Decode: n requests of 1 token at position 0.
        let slot_lists: Vec<Vec<Slot>> = if decode {
            (0..n).map(|r| slots(r, 1, 1)).collect()
        } else {
            vec![slots(0, n, n / PAGE as usize)]
        };
        let reqs: Vec<RequestKv> = slot_lists
            .iter()
            .map(|s| RequestKv {
                slots: s,
                extend_len: s.len(),
            })
            .collect();
        let meta = if decode {
            BatchMetadata::new_decode(PAGE, &reqs).unwrap()
        } else {
            BatchMetadata::new(PAGE, &reqs).unwrap()
        };
        let positions = meta.positions();
        let plan = backend.plan(&meta).unwrap();
        let x0 = model
            .embed(
                &backend,
                &ids(n, 5)
                    .iter()
                    .map(|t| t % cfg.vocab_size as u32)
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut x = x0.clone();
                model
                    .layer_forward(&backend, layer, &plan, &mut store, &mut x, &positions)
                    .unwrap();
                black_box(x);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_tiny, bench_layer);
criterion_main!(benches);
