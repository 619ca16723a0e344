//! wgpu backend benches on whatever adapter is found (its name is printed first):
//!
//! - `decode_attention`: one batched decode attention call over a paged store
//!   (`attention::bandwidth::measure_decode`, the median of 5 calls); throughput is the KV
//!   bytes read (every K and V row of every request once), reported as bytes/s. Set
//!   `KVSERVE_GPU_PEAK_GBPS` to the device's memory bandwidth to also print the fraction
//!   reached.
//! - `decoder_layer`: one Llama-shaped decoder layer (norms, projections, rotary, attention,
//!   MLP) for a decode batch, as tokens/s.
//! - `wgpu_decode_matmul`: a decode step's matmuls (the tiny preset's logits, 1 × 64 · 50,257ᵀ,
//!   and a 512 → 1536 projection of 4, 16 and 32 rows, where the kernels cross over) on the
//!   tiled kernel (`tiled`, `matmul_rows_max` 0)
//!   and on the thread-per-column kernel (`rows`, every batch), each on its own backend, in
//!   one run.
//!
//! Shapes are kept small so a run on the Vulkan software driver (lavapipe) takes seconds; on
//! lavapipe the figures only prove the kernels run.

use std::time::{Duration, Instant};

use attention::bandwidth::{measure_decode, DecodeCase};
use attention::{Backend, BatchMetadata, RequestKv};
use attention_wgpu::test_support::{backend_or_skip, backend_or_skip_with};
use attention_wgpu::{WgpuBackend, WgpuConfig};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kv_pool::{KvDtype, KvLayout, KvShape, Slot};
use model::tiny::random_weights;
use model::{Architecture, LlamaModel, ModelConfig};

const PAGE: u32 = 16;

/// A decode batch of `reqs` requests of `kv_len` positions on consecutive pages.
fn decode_meta(reqs: usize, kv_len: usize) -> BatchMetadata {
    let pages_per = kv_len.div_ceil(PAGE as usize) as u32;
    let slots: Vec<Vec<Slot>> = (0..reqs as u32)
        .map(|r| {
            (0..kv_len as u32)
                .map(|p| Slot((1 + r * pages_per + p / PAGE) * PAGE + p % PAGE))
                .collect()
        })
        .collect();
    let reqs: Vec<RequestKv<'_>> = slots
        .iter()
        .map(|s| RequestKv {
            slots: s,
            extend_len: 1,
        })
        .collect();
    BatchMetadata::new_decode(PAGE, &reqs).unwrap()
}

fn values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 1000.0)
        .collect()
}

fn report_rate(name: &str, what: &str, per_call: f64, dt: Duration, unit: &str) {
    let rate = per_call / dt.as_secs_f64();
    let mut line = format!("{name}: {:.3} {unit}/s ({what})", rate / 1e9);
    if unit == "GB" {
        if let Some(peak) = std::env::var("KVSERVE_GPU_PEAK_GBPS")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
        {
            line += &format!(", {:.1}% of {peak} GB/s", 100.0 * rate / 1e9 / peak);
        }
    }
    println!("{line}");
}

/// One batched decode attention call, timed by `attention::bandwidth::measure_decode` (the
/// CUDA backend's `decode_bandwidth` example times the same call on a GPU).
fn decode_attention(b: &WgpuBackend) {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let case = DecodeCase {
            requests: 8,
            kv_len: 512,
            page_size: PAGE,
            kv_heads: 8,
            q_heads: 32,
            head_dim: 128,
            dtype,
            mla_rope_dim: None,
        };
        let shape = KvShape::mha(8, 128, 128, 1, dtype).unwrap();
        if let Err(reason) = b.kv_support(&shape) {
            println!("decode_attention {dtype}: skipped ({reason})");
            continue;
        }
        let t = measure_decode(b, &case, 5).unwrap();
        report_rate(
            &format!("decode_attention {dtype}"),
            "8 requests x 512 positions, 32/8 heads x 128, KV bytes read",
            case.kv_bytes() as f64,
            Duration::from_secs_f64(t.seconds),
            "GB",
        );
    }
}

fn decoder_layer(c: &mut Criterion, b: &WgpuBackend) {
    let config = ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 512,
        intermediate_size: 1536,
        num_hidden_layers: 1,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: attention::RopeScaling::None,
        max_position_embeddings: 4096,
        sliding_window: None,
        vocab_size: 256,
        tie_word_embeddings: true,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        mla: None,
    };
    let model = LlamaModel::load(b, config.clone(), &random_weights(&config, 1)).unwrap();
    let (reqs, kv_len) = (16usize, 256usize);
    let pages = reqs * kv_len.div_ceil(PAGE as usize) + 1;
    let shape = config.kv_shape(KvDtype::F32).unwrap();
    let layout = KvLayout::new(shape, PAGE, pages * PAGE as usize).unwrap();
    let mut store = b.new_kv_store(layout).unwrap();
    let meta = decode_meta(reqs, kv_len);
    let plan = b.plan(&meta).unwrap();
    let positions = meta.positions();
    let x0 = values(reqs * config.hidden_size);
    let mut call = || {
        let mut x = b.upload(&x0, &[reqs, config.hidden_size]).unwrap();
        model
            .layer_forward(b, 0, &plan, &mut store, &mut x, &positions)
            .unwrap();
        b.synchronize().unwrap();
    };
    call();
    let t = Instant::now();
    let n = 5;
    for _ in 0..n {
        call();
    }
    let dt = t.elapsed() / n;
    println!(
        "decoder_layer: {:.1} tokens/s (decode batch {reqs} at {kv_len} positions, hidden {}, \
         {}/{} heads)",
        reqs as f64 / dt.as_secs_f64(),
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads
    );
    let mut g = c.benchmark_group("wgpu_decoder_layer");
    g.throughput(Throughput::Elements(reqs as u64));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(2));
    g.bench_function("llama_512_decode16", |bench| bench.iter(&mut call));
    g.finish();
}

fn decode_matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("wgpu_decode_matmul");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(3));
    for (kernel, rows_max) in [("tiled", 0), ("rows", u32::MAX)] {
        let config = WgpuConfig {
            matmul_rows_max: Some(rows_max),
            ..WgpuConfig::default()
        };
        let Some(b) = backend_or_skip_with("wgpu bench decode_matmul", config) else {
            return;
        };
        for (m, k, n) in [
            (1usize, 64usize, 50_257usize),
            (4, 512, 1536),
            (16, 512, 1536),
            (32, 512, 1536),
        ] {
            let x = b.upload(&values(m * k), &[m, k]).unwrap();
            let w = b.upload(&values(n * k), &[n, k]).unwrap();
            g.throughput(Throughput::Elements((m * k * n) as u64));
            g.bench_function(format!("{kernel}/{m}x{k}x{n}"), |bench| {
                bench.iter(|| {
                    let out = b.matmul(&x, &w).unwrap();
                    b.synchronize().unwrap();
                    out
                })
            });
        }
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    let Some(b) = backend_or_skip("wgpu bench") else {
        return;
    };
    println!("adapter: {}", b.report());
    decode_attention(&b);
    decoder_layer(c, &b);
    decode_matmul(c);
}

criterion_group!(wgpu_benches, benches);
criterion_main!(wgpu_benches);
