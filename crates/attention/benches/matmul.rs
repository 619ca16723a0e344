//! The CPU backend's batch-invariant matmul (`x · Wᵀ`) against the `gemm` crate it replaced
//! (which is not row-invariant), at a decode row, a small batch and a prefill chunk.
//!
//! Run: `cargo bench -p attention --bench matmul -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use attention::conformance::nonzero_vec;
use attention::{Backend, CpuBackend, TensorDtype};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kv_pool::rng::SplitMix64;

fn gemm_ref(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, dst: &mut [f32]) {
    assert!(x.len() == m * k && w.len() == n * k && dst.len() == m * n);
    // SAFETY: lengths asserted; dst is [m, n] row-major, x [m, k] row-major, w [n, k] read as
    // wᵀ (column stride k, row stride 1); no aliasing, dst not read.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

fn matmul(c: &mut Criterion) {
    let backend = CpuBackend::default();
    let mut rng = SplitMix64::new(7);
    for (m, k, n, dtype) in [
        (1usize, 4096usize, 4096usize, TensorDtype::F32),
        (16, 4096, 4096, TensorDtype::F32),
        (256, 4096, 1024, TensorDtype::F32),
        // A SmolLM2-135M prompt of 512 tokens through its MLP's up projection.
        (512, 576, 1536, TensorDtype::F32),
        (512, 576, 1536, TensorDtype::F16),
        (512, 576, 1536, TensorDtype::Bf16),
        // One decode row through the same projection, bf16 weights (the streaming tiles).
        (1, 576, 1536, TensorDtype::Bf16),
    ] {
        let x = nonzero_vec(&mut rng, m * k);
        let w = nonzero_vec(&mut rng, n * k);
        let xt = backend.upload(&x, &[m, k]).unwrap();
        let wt = backend.upload_weight(&w, &[n, k], dtype).unwrap();
        let mut dst = vec![0.0; m * n];
        let mut g = c.benchmark_group(format!("matmul/{m}x{k}x{n}/{dtype:?}"));
        g.throughput(Throughput::Elements((m * k * n) as u64));
        g.sample_size(10);
        g.bench_function("cpu_backend", |b| {
            b.iter(|| black_box(backend.matmul(&xt, &wt).unwrap()))
        });
        g.bench_function("gemm_crate", |b| {
            b.iter(|| {
                gemm_ref(&x, &w, m, k, n, &mut dst);
                black_box(&dst);
            })
        });
        g.finish();
    }
}

criterion_group!(benches, matmul);
criterion_main!(benches);
