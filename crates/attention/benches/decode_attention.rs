//! Decode attention on the CPU backend: KV bytes read per second against a memcpy of the same
//! bytes measured in the same group, at batch 16 × 4,096 tokens and batch 1 × 32,768 (32 query
//! heads over 8 KV heads of 128, Llama-3-8B's layer shape), f16 and f32 stores, page sizes 1 and
//! 16, slots scattered over a shuffled pool. Plus extend attention in tokens per second, one
//! thread: chunked prefill at Llama-3-8B's shape (4 requests extending 256 tokens over 512
//! cached ones) and a 512-token prompt at SmolLM2-135M's (9 query heads over 3 KV heads of 64).
//!
//! Run: `cargo bench -p attention -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use attention::conformance::{nonzero_vec, scattered_slots};
use attention::{AttentionParams, Backend, BatchMetadata, CpuBackend, CpuTensor, RequestKv};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kv_pool::dtype::encode_f32;
use kv_pool::rng::SplitMix64;
use kv_pool::{HostKvStore, KvBuffer, KvDtype, KvLayout, KvShape, KvStore, Slot};

/// The attention heads of a layer.
#[derive(Clone, Copy)]
struct Heads {
    q: usize,
    kv: usize,
    dim: usize,
}

const LLAMA3_8B: Heads = Heads {
    q: 32,
    kv: 8,
    dim: 128,
};
const SMOLLM2_135M: Heads = Heads {
    q: 9,
    kv: 3,
    dim: 64,
};

/// A store holding `requests` (prefix, extend) on scattered slots, every prefix row filled.
struct Setup {
    store: HostKvStore,
    slots: Vec<Vec<Slot>>,
    extends: Vec<usize>,
}

impl Setup {
    /// The requests' KV views.
    fn requests(&self) -> Vec<RequestKv<'_>> {
        self.slots
            .iter()
            .zip(&self.extends)
            .map(|(sl, &e)| RequestKv {
                slots: sl,
                extend_len: e,
            })
            .collect()
    }
}

fn setup(h: Heads, dtype: KvDtype, page_size: u32, requests: &[(usize, usize)]) -> Setup {
    let p = page_size as usize;
    let pages: usize = requests.iter().map(|&(a, b)| (a + b).div_ceil(p)).sum();
    let size = (pages + 2) * p;
    let shape = KvShape::mha(h.kv as u32, h.dim as u32, h.dim as u32, 1, dtype).unwrap();
    let layout = KvLayout::new(shape, page_size, size).unwrap();
    let mut store = HostKvStore::new(layout).unwrap();
    let mut rng = SplitMix64::new(1);
    let slots = scattered_slots(page_size, size, requests, &mut rng).unwrap();
    // Fill every row with valid values: encode one random block, then copy it around.
    let row = h.kv * h.dim;
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

fn inputs(h: Heads, b: &CpuBackend, n: usize) -> (CpuTensor, CpuTensor, CpuTensor) {
    let mut rng = SplitMix64::new(2);
    let q = b
        .upload(&nonzero_vec(&mut rng, n * h.q * h.dim), &[n, h.q, h.dim])
        .unwrap();
    let k = b
        .upload(&nonzero_vec(&mut rng, n * h.kv * h.dim), &[n, h.kv, h.dim])
        .unwrap();
    let v = b
        .upload(&nonzero_vec(&mut rng, n * h.kv * h.dim), &[n, h.kv, h.dim])
        .unwrap();
    (q, k, v)
}

fn decode(c: &mut Criterion) {
    let backend = CpuBackend::default();
    let h = LLAMA3_8B;
    let params = AttentionParams::dense(1.0 / (h.dim as f32).sqrt());
    for (batch, len) in [(16usize, 4096usize), (1, 32768)] {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            for page_size in [1u32, 16] {
                let requests = vec![(len - 1, 1); batch];
                let mut s = setup(h, dtype, page_size, &requests);
                let reqs = s.requests();
                let meta = BatchMetadata::new_decode(page_size, &reqs).unwrap();
                let plan = backend.plan(&meta).unwrap();
                let (q, k, v) = inputs(h, &backend, batch);
                let kv_bytes = batch * len * 2 * h.kv * h.dim * dtype.bytes();
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
    let cases = [
        ("4x(512+256)/llama3-8b", LLAMA3_8B, vec![(512, 256); 4]),
        ("1x(0+512)/smollm2-135m", SMOLLM2_135M, vec![(0, 512)]),
    ];
    for (name, h, requests) in cases {
        let params = AttentionParams::dense(1.0 / (h.dim as f32).sqrt());
        let mut s = setup(h, KvDtype::F16, 16, &requests);
        let reqs = s.requests();
        let meta = BatchMetadata::new(16, &reqs).unwrap();
        let plan = backend.plan(&meta).unwrap();
        let n = meta.num_tokens();
        let (q, k, v) = inputs(h, &backend, n);
        let mut g = c.benchmark_group(format!("extend/{name}/float16/P16"));
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
}

criterion_group!(benches, decode, extend);
criterion_main!(benches);
