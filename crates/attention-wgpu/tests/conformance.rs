//! The shared conformance suite from `attention` on the wgpu backend, against the f64
//! reference. Cases the adapter cannot run (bf16 and fp8 stores, f16 without f16 shaders,
//! DoubleSparse) are skipped with a printed reason through `Backend::kv_support`.

use attention::conformance::{self, AttentionCase, CaseKind, SuiteSize};
use attention::Backend;
use attention_wgpu::kernels::dense::MM_ROWS_MAX;
use attention_wgpu::test_support::{self, backend_or_skip, backend_or_skip_with};
use attention_wgpu::WgpuConfig;
use kv_pool::KvDtype;

#[test]
fn wgpu_dense_conformance() {
    let Some(backend) = backend_or_skip("wgpu_dense_conformance") else {
        return;
    };
    let outcomes = conformance::run_dense_suite(&backend).unwrap();
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}

/// A matmul row is bitwise the same whatever the batch around it and whichever kernel runs
/// it: batches of up to `matmul_rows_max` rows take the thread-per-column kernel, larger ones
/// the tiled kernel, and both sum each dot product in `k` order. Checked with the adapter's
/// default and with each kernel forced.
#[test]
fn wgpu_matmul_rows_do_not_depend_on_the_batch() {
    let (k, n) = (67, 300);
    let mut rng = kv_pool::rng::SplitMix64::new(7);
    let mut values = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| (rng.below(2001) as f32 - 1000.0) / 997.0)
            .collect()
    };
    let x = values(40 * k);
    let w = values(n * k);
    let mut batch_of_40: Option<Vec<f32>> = None;
    for rows_max in [None, Some(0), Some(MM_ROWS_MAX)] {
        let config = WgpuConfig {
            matmul_rows_max: rows_max,
            ..WgpuConfig::default()
        };
        let Some(backend) =
            backend_or_skip_with("wgpu_matmul_rows_do_not_depend_on_the_batch", config)
        else {
            return;
        };
        let wt = backend.upload(&w, &[n, k]).unwrap();
        let rows_of = |m: usize| -> Vec<f32> {
            let xs = backend.upload(&x[..m * k], &[m, k]).unwrap();
            backend
                .download(&backend.matmul(&xs, &wt).unwrap())
                .unwrap()
        };
        let all = batch_of_40.get_or_insert_with(|| rows_of(40)).clone();
        for m in [1, 3, MM_ROWS_MAX as usize, MM_ROWS_MAX as usize + 1, 40] {
            let got = rows_of(m);
            let same = got
                .iter()
                .zip(&all)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "matmul_rows_max {rows_max:?} ({} here): the first {m} rows differ from the \
                 same rows in a batch of 40",
                backend.matmul_rows_max()
            );
        }
    }
}

#[test]
fn wgpu_attention_conformance_quick() {
    let Some(backend) = backend_or_skip("wgpu_attention_conformance_quick") else {
        return;
    };
    let outcomes = conformance::run_attention_suite(&backend, SuiteSize::Quick);
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
    // An adapter may lack a store dtype (those cases are skipped above, each with its reason),
    // but it must not lack the ones it advertises: f32 always, f16 with f16 shaders. Checked
    // when an adapter is required (CI); elsewhere the count is only printed.
    let run = outcomes.iter().filter(|o| o.skipped.is_none()).count();
    let f16 = backend.report().f16;
    let supported = conformance::attention_cases(SuiteSize::Quick)
        .iter()
        .filter(|c| !matches!(c.kind, CaseKind::DoubleSparse { .. }))
        .filter(|c| c.dtype == KvDtype::F32 || (f16 && c.dtype == KvDtype::F16))
        .count();
    println!("{run} cases ran; the adapter advertises {supported}");
    if test_support::required() {
        assert!(
            run >= supported.max(1),
            "only {run} cases ran of the {supported} this adapter advertises (f16 {f16})"
        );
    }
}

/// A NaN key comes out as NaN in exactly the rows that attend it (`run_nan_key_case`), over
/// the store dtypes the adapter has.
#[test]
fn wgpu_nan_keys_come_out_as_nan() {
    let Some(backend) = backend_or_skip("wgpu_nan_keys_come_out_as_nan") else {
        return;
    };
    let outcomes = conformance::run_nan_key_suite(&backend).unwrap();
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}

/// The quick suite gives each shape and page size two dtypes in rotation, most of them ones
/// this backend skips; here every MHA and MLA case runs over both f32 and f16 stores, so every
/// shape × page size × batch meets the reference on wgpu.
#[test]
fn wgpu_attention_conformance_every_shape_f32_f16() {
    let Some(backend) = backend_or_skip("wgpu_attention_conformance_every_shape") else {
        return;
    };
    let mut cases = conformance::attention_cases(SuiteSize::Quick);
    cases.retain(|c| !matches!(c.kind, CaseKind::DoubleSparse { .. }));
    let mut seen = std::collections::HashSet::new();
    let mut outcomes = Vec::new();
    for case in cases {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let case = AttentionCase {
                dtype,
                ..case.clone()
            };
            if seen.insert(format!("{case}")) {
                outcomes.push(conformance::run_attention_case(&backend, &case).unwrap());
            }
        }
    }
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}

/// Every case without split-KV (one workgroup per query over its whole range, normalised in
/// place) and with every split (as many workgroups as key blocks), so both paths of the
/// kernel meet the reference whatever the batch.
#[test]
fn wgpu_attention_conformance_split_extremes() {
    for (name, target) in [("no split", 1), ("max split", 1 << 20)] {
        let config = WgpuConfig {
            split_kv_target_workgroups: target,
            ..WgpuConfig::default()
        };
        let Some(backend) = backend_or_skip_with("wgpu_attention_split_extremes", config) else {
            return;
        };
        let cases = conformance::attention_cases(SuiteSize::Quick);
        let outcomes: Vec<_> = cases
            .iter()
            .step_by(3)
            .map(|c| conformance::run_attention_case(&backend, c).unwrap())
            .collect();
        println!("{name}:");
        for o in &outcomes {
            println!("{o}");
        }
        conformance::assert_all_passed(&outcomes);
    }
}

/// With a 512 KiB binding limit most per-layer KV buffers of the suite (up to 6 MiB) are
/// split across several wgpu buffers (13 for the largest), so the chunked addressing runs
/// against the reference. On an adapter with 16 storage buffers per kernel (GL) the store
/// grows the largest buffers' chunks to fit 6 per buffer, still chunked.
#[test]
fn wgpu_attention_conformance_chunked_store() {
    let config = WgpuConfig {
        max_binding_bytes: Some(512 << 10),
        ..WgpuConfig::default()
    };
    let Some(backend) = backend_or_skip_with("wgpu_attention_conformance_chunked", config) else {
        return;
    };
    let cases = conformance::attention_cases(SuiteSize::Quick);
    let outcomes: Vec<_> = cases
        .iter()
        .step_by(2)
        .map(|c| conformance::run_attention_case(&backend, c).unwrap())
        .collect();
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}

/// The full suite (longer sequences, every dtype for every shape): `cargo test --release -p
/// attention-wgpu -- --ignored`.
#[test]
#[ignore]
fn wgpu_attention_conformance_full() {
    let Some(backend) = backend_or_skip("wgpu_attention_conformance_full") else {
        return;
    };
    let outcomes = conformance::run_attention_suite(&backend, SuiteSize::Full);
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}
