//! Thread invariance of the CPU backend's dense ops: a matmul's output is bitwise the same
//! for any number of worker threads, whatever its shape (odd sizes, fewer output columns than
//! threads, one row or many). Attention across threads is in `invariance.rs`.

use attention::conformance::nonzero_vec;
use attention::{Backend, CpuBackend, CpuConfig};
use kv_pool::rng::SplitMix64;
use proptest::prelude::*;

fn backend(threads: usize) -> CpuBackend {
    CpuBackend::new(CpuConfig {
        threads,
        ..CpuConfig::default()
    })
    .unwrap()
}

/// `x[m, k] · w[n, k]ᵀ` on `b`, as bits.
fn matmul_bits(b: &CpuBackend, x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<u32> {
    let xt = b.upload(x, &[m, k]).unwrap();
    let wt = b.upload(w, &[n, k]).unwrap();
    let out = b.download(&b.matmul(&xt, &wt).unwrap()).unwrap();
    out.iter().map(|v| v.to_bits()).collect()
}

/// The model's shapes (SmolLM2-135M's projections, MLP and a slice of its LM head) at decode
/// and prefill batch sizes, on 1, 2 and 3 threads.
#[test]
fn model_shaped_matmuls_do_not_depend_on_threads() {
    let backends: Vec<CpuBackend> = (1..=3).map(backend).collect();
    let mut rng = SplitMix64::new(11);
    for (k, n) in [
        (576, 576),
        (576, 192),
        (576, 3072),
        (1536, 576),
        (576, 4099),
    ] {
        let w = nonzero_vec(&mut rng, n * k);
        for m in [1, 2, 16, 37] {
            let x = nonzero_vec(&mut rng, m * k);
            let want = matmul_bits(&backends[0], &x, &w, m, k, n);
            for b in &backends[1..] {
                let got = matmul_bits(b, &x, &w, m, k, n);
                assert!(
                    got == want,
                    "{m}x{k}x{n}: {} threads differ from 1",
                    b.config().threads
                );
            }
        }
    }
}

/// The fused QKV projection (`matmul_many`) gives each projection's `matmul` bitwise on 1, 2
/// and 3 threads, at decode and prefill batch sizes; a weight of another `k` is a typed error.
#[test]
fn matmul_many_equals_separate_matmuls_on_any_threads() {
    let mut rng = SplitMix64::new(12);
    let (k, ns) = (576, [576, 192, 192]);
    let ws: Vec<Vec<f32>> = ns.iter().map(|&n| nonzero_vec(&mut rng, n * k)).collect();
    for m in [1, 3, 37] {
        let x = nonzero_vec(&mut rng, m * k);
        let want: Vec<Vec<u32>> = ws
            .iter()
            .zip(ns)
            .map(|(w, n)| matmul_bits(&backend(1), &x, w, m, k, n))
            .collect();
        for t in 1..=3 {
            let b = backend(t);
            let xt = b.upload(&x, &[m, k]).unwrap();
            let wt: Vec<_> = ws
                .iter()
                .zip(ns)
                .map(|(w, n)| b.upload(w, &[n, k]).unwrap())
                .collect();
            let got = b.matmul_many(&xt, &[&wt[0], &wt[1], &wt[2]]).unwrap();
            assert_eq!(got.len(), 3);
            for (i, g) in got.iter().enumerate() {
                let bits: Vec<u32> = b.download(g).unwrap().iter().map(|v| v.to_bits()).collect();
                assert!(bits == want[i], "m {m}, {t} threads, weight {i}");
            }
            let bad = b.upload(&ws[1][..192 * 100], &[192, 100]).unwrap();
            assert!(b.matmul_many(&xt, &[&wt[0], &bad]).is_err());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random shapes and thread counts: bitwise equal to one thread.
    #[test]
    fn random_matmuls_do_not_depend_on_threads(
        m in 1usize..24,
        k in 1usize..600,
        n in 1usize..400,
        threads in 2usize..5,
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = nonzero_vec(&mut rng, m * k);
        let w = nonzero_vec(&mut rng, n * k);
        let one = matmul_bits(&backend(1), &x, &w, m, k, n);
        let many = matmul_bits(&backend(threads), &x, &w, m, k, n);
        prop_assert!(one == many, "{}x{}x{} on {} threads", m, k, n, threads);
    }
}
