//! Decode attention on the CPU backend: KV bytes read per second against a memcpy of the same
//! bytes measured in the same group, at batch 16 × 4,096 tokens and batch 1 × 32,768 (32 query
//! heads over 8 KV heads of 128, Llama-3-8B's layer shape), f16 and f32 stores, page sizes 1 and
//! 16, slots scattered over a shuffled pool. Plus extend attention in tokens per second.
//!
//! Run: `cargo bench -p attention -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use attention::conformance::{nonzero_vec, scattered_slots};
use attention::{AttentionParams, Backend, BatchMetadata, CpuBackend, CpuTensor, RequestKv};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kv_pool::dtype::encode_f32;
use kv_pool::rng::SplitMix64;
use kv_pool::{HostKvStore, KvBuffer, KvDtype, KvLayout, KvShape, KvStore, Slot};

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;

/// A store holding `requests` (prefix, extend) on scattered slots, every prefix row filled.
struct Setup {
    store: HostKvStore,
    slots: Vec<Vec<Slot>>,
    extends: Vec<usize>,
}

fn setup(dtype: KvDtype, page_size: u32, requests: &[(usize, usize)]) -> Setup {
    let p = page_size as usize;
    let pages: usize = requests.iter().map(|&(a, b)| (a + b).div_ceil(p)).sum();
    let size = (pages + 2) * p;
    let shape = KvShape::mha(KV_HEADS as u32, HEAD_DIM as u32, HEAD_DIM as u32, 1, dtype).unwrap();
    let layout = KvLayout::new(shape, page_size, size).unwrap();
    let mut store = HostKvStore::new(layout).unwrap();
    let mut rng = SplitMix64::new(1);
    let slots = scattered_slots(page_size, size, requests, &mut rng).unwrap();
    // Fill every row with valid values: encode one random block, then copy it around.
    let row = KV_HEADS * HEAD_DIM;
    let block_rows = 1024;
    let mut block = vec![0u8; block_rows * row * dtype.bytes()];
    encode_f32(
        dtype,
        &nonzero_vec(&mut rng, block_rows * row),
        1.0,
        &mut block,
    );
    let all: Vec<Slot> = (0..layout.rows() as u32).map(Slot).collect();
    for chunk in all.chunks(block_rows) {
        let bytes = &block[..chunk.len() * row * dtype.bytes()];
        store.write_raw(0, KvBuffer::Key, chunk, bytes).unwrap();
        store.write_raw(0, KvBuffer::Value, chunk, bytes).unwrap();
    }
    Setup {
        store,
        slots,
        extends: requests.iter().map(|r| r.1).collect(),
    }
}

fn inputs(b: &CpuBackend, n: usize) -> (CpuTensor, CpuTensor, CpuTensor) {
    let mut rng = SplitMix64::new(2);
    let q = b
        .upload(
            &nonzero_vec(&mut rng, n * Q_HEADS * HEAD_DIM),
            &[n, Q_HEADS, HEAD_DIM],
        )
        .unwrap();
    let k = b
        .upload(
            &nonzero_vec(&mut rng, n * KV_HEADS * HEAD_DIM),
            &[n, KV_HEADS, HEAD_DIM],
        )
        .unwrap();
    let v = b
        .upload(
            &nonzero_vec(&mut rng, n * KV_HEADS * HEAD_DIM),
            &[n, KV_HEADS, HEAD_DIM],
        )
        .unwrap();
    (q, k, v)
}

fn decode(c: &mut Criterion) {
    let backend = CpuBackend::default();
    let params = AttentionParams::dense(1.0 / (HEAD_DIM as f32).sqrt());
    for (batch, len) in [(16usize, 4096usize), (1, 32768)] {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            for page_size in [1u32, 16] {
                let requests = vec![(len - 1, 1); batch];
                let mut s = setup(dtype, page_size, &requests);
                let reqs: Vec<RequestKv<'_>> = s
                    .slots
                    .iter()
                    .zip(&s.extends)
                    .map(|(sl, &e)| RequestKv {
                        slots: sl,
                        extend_len: e,
                    })
                    .collect();
                let meta = BatchMetadata::new_decode(page_size, &reqs).unwrap();
                let plan = backend.plan(&meta).unwrap();
                let (q, k, v) = inputs(&backend, batch);
                let kv_bytes = batch * len * 2 * KV_HEADS * HEAD_DIM * dtype.bytes();
                let src = vec![1u8; kv_bytes];
                let mut dst = vec![0u8; kv_bytes];
                let mut g =
                    c.benchmark_group(format!("decode/b{batch}x{len}/{dtype}/P{page_size}"));
                g.throughput(Throughput::Bytes(kv_bytes as u64));
                g.sample_size(10);
                g.bench_function("attention", |bench| {
                    bench.iter(|| {
                        black_box(
                            backend
                                .attention(0, &plan, &mut s.store, &q, &k, &v, &params)
                                .unwrap(),
                        )
                    })
                });
                g.bench_function("memcpy", |bench| {
                    bench.iter(|| {
                        dst.copy_from_slice(black_box(&src));
                        black_box(&dst);
                    })
                });
                g.finish();
            }
        }
    }
}

fn extend(c: &mut Criterion) {
    let backend = CpuBackend::default();
    let params = AttentionParams::dense(1.0 / (HEAD_DIM as f32).sqrt());
    // Chunked-prefill shape: 4 requests extending 256 tokens over 512-token cached prefixes.
    let requests = vec![(512, 256); 4];
    let mut s = setup(KvDtype::F16, 16, &requests);
    let reqs: Vec<RequestKv<'_>> = s
        .slots
        .iter()
        .zip(&s.extends)
        .map(|(sl, &e)| RequestKv {
            slots: sl,
            extend_len: e,
        })
        .collect();
    let meta = BatchMetadata::new(16, &reqs).unwrap();
    let plan = backend.plan(&meta).unwrap();
    let n = meta.num_tokens();
    let (q, k, v) = inputs(&backend, n);
    let mut g = c.benchmark_group("extend/4x(512+256)/float16/P16");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10);
    g.bench_function("attention", |bench| {
        bench.iter(|| {
            black_box(
                backend
                    .attention(0, &plan, &mut s.store, &q, &k, &v, &params)
                    .unwrap(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, decode, extend);
criterion_main!(benches);
