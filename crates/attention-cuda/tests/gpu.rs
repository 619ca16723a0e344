//! The shared conformance suite on a real GPU (`CudaBackend<CudarcDevice>`). Without a CUDA
//! driver, device or NVRTC the tests print why and pass, unless `KVSERVE_REQUIRE_CUDA=1`.
#![cfg(any(feature = "cuda-12", feature = "cuda-13"))]

use attention::conformance::{self, SuiteSize};
use attention::TensorDtype;
use attention_cuda::{AttentionKernel, CudaBackend, CudaConfig, CudarcDevice};

fn gpu_or_skip(test: &str) -> Option<CudaBackend<CudarcDevice>> {
    gpu_with_or_skip(test, CudaConfig::default())
}

fn gpu_with_or_skip(test: &str, config: CudaConfig) -> Option<CudaBackend<CudarcDevice>> {
    match CudarcDevice::new(0) {
        Ok(d) => {
            println!("{test}: {:?}", d.report());
            Some(CudaBackend::new(d, config))
        }
        Err(e) => {
            if std::env::var("KVSERVE_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
                panic!("{test}: KVSERVE_REQUIRE_CUDA=1 but {e}");
            }
            println!("skipping {test}: {e}");
            None
        }
    }
}

#[test]
fn gpu_dense_conformance() {
    let Some(b) = gpu_or_skip("gpu_dense_conformance") else {
        return;
    };
    let outcomes = conformance::run_dense_suite(&b).unwrap();
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}

/// The quick attention suite on both paged-attention kernels, and on the pipelined one with
/// the split merge in the kernel and the most splits (every block of a long range counts
/// itself in, the last merges: the memory ordering the emulation cannot check).
#[test]
fn gpu_attention_conformance_quick() {
    let configs = AttentionKernel::ALL
        .iter()
        .map(|&kernel| CudaConfig {
            attention_kernel: kernel,
            ..CudaConfig::default()
        })
        .chain([CudaConfig {
            fuse_split_merge: true,
            split_kv_target_blocks: 1 << 20,
            ..CudaConfig::default()
        }]);
    for config in configs {
        let kernel = config.attention_kernel;
        let Some(b) = gpu_with_or_skip("gpu_attention_conformance_quick", config) else {
            return;
        };
        println!(
            "{kernel} (merge in the kernel: {}):",
            config.fuse_split_merge
        );
        let outcomes = conformance::run_attention_suite(&b, SuiteSize::Quick);
        for o in &outcomes {
            println!("{o}");
        }
        conformance::assert_all_passed(&outcomes);
    }
}

/// The tensor-core MLA form (`CudaConfig::mla_tensor_cores`, off by default until this has
/// run): the quick suite's MLA cases over f16 and bf16 stores (and fp8 at rank 512), with the
/// default split and the most splits merged in the kernel, then the tiny MLA decoder's greedy
/// schedule on it. Each backend must have the form (an sm_80 or later GPU) or the test fails.
#[test]
fn gpu_mla_tensor_cores() {
    use attention::conformance::{AttentionCase, CaseKind};
    use attention_cuda::Device;
    for split_kv_target_blocks in [CudaConfig::default().split_kv_target_blocks, 1 << 20] {
        let config = CudaConfig {
            mla_tensor_cores: true,
            fuse_split_merge: split_kv_target_blocks == 1 << 20,
            split_kv_target_blocks,
            ..CudaConfig::default()
        };
        let Some(b) = gpu_with_or_skip("gpu_mla_tensor_cores", config) else {
            return;
        };
        assert!(b.device().tensor_cores(), "no tensor-core form on this GPU");
        let outcomes: Vec<_> = conformance::attention_cases(SuiteSize::Quick)
            .into_iter()
            .filter(|c| matches!(c.kind, CaseKind::Mla { .. }))
            .flat_map(|c| {
                // fp8 has the form at rank 512 (`mla_tensor_core_form`).
                let fp8 = matches!(
                    c.kind,
                    CaseKind::Mla {
                        kv_lora_rank: 512,
                        ..
                    }
                );
                [
                    kv_pool::KvDtype::F16,
                    kv_pool::KvDtype::Bf16,
                    kv_pool::KvDtype::Fp8E4m3,
                    kv_pool::KvDtype::Fp8E5m2,
                ]
                .into_iter()
                .filter(move |d| fp8 || !d.is_fp8())
                .map(move |dtype| AttentionCase { dtype, ..c.clone() })
            })
            .map(|c| conformance::run_attention_case(&b, &c).unwrap())
            .collect();
        for o in &outcomes {
            println!("{o}");
        }
        conformance::assert_all_passed(&outcomes);
        let config = model::greedy_check::mla_config();
        let check = model::greedy_check::check_against_cpu(
            b.clone(),
            &config,
            kv_pool::KvDtype::Bf16,
            TensorDtype::F32,
            1e-3,
        )
        .unwrap();
        match check {
            Ok(tokens) => println!("{:?} {tokens}", config.architecture),
            Err(mismatch) => panic!("{:?} {mismatch}", config.architecture),
        }
    }
}

/// The tensor-core expert matmuls (`CudaConfig::moe_tensor_cores`, off by default until this
/// has run): the dense suite with the form on, then `fused_moe` over bf16 experts against the
/// f64 computation that rounds the activations as the form does (several 64-row tiles an
/// expert, partial k steps and output blocks), batch-invariant. The GPU must have the form
/// (sm_80 or later) or the test fails. Small enough for compute-sanitizer.
#[test]
fn gpu_moe_tensor_cores() {
    let Some(b) = moe_tensor_core_backend("gpu_moe_tensor_cores") else {
        return;
    };
    let outcomes = conformance::run_dense_suite(&b).unwrap();
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
    moe_bf16_case(&b, (150, 72, 4, 104), 2);
}

/// The tensor-core prefill kernel (`CudaConfig::prefill_tensor_cores`, off by default until this
/// has run): `conformance::extend_cases` over f16, bf16 and fp8 stores (long extends of several
/// tiles included) against the reference and, within 1e-4, the stored values.
#[test]
fn gpu_prefill_tensor_cores() {
    prefill_tensor_core_cases(
        "gpu_prefill_tensor_cores",
        conformance::extend_cases(&[
            kv_pool::KvDtype::F16,
            kv_pool::KvDtype::Bf16,
            kv_pool::KvDtype::Fp8E4m3,
            kv_pool::KvDtype::Fp8E5m2,
        ]),
    );
}

/// The tensor-core prefill kernel over 24 random extend batches
/// (`conformance::random_extend_cases`: every packing of query heads, pages of 1 to 64, short
/// and long prefixes), split as the default target chooses; not under the sanitizer (its cases
/// are `gpu_prefill_tensor_cores`').
#[test]
fn gpu_prefill_tensor_cores_random_batches() {
    prefill_tensor_core_cases(
        "gpu_prefill_tensor_cores_random_batches",
        conformance::random_extend_cases(24, 0x5EED),
    );
}

/// Runs `cases` on a backend with `paged_prefill` on, where the GPU has it.
fn prefill_tensor_core_cases(test: &str, cases: Vec<conformance::AttentionCase>) {
    use attention_cuda::Device;
    let config = CudaConfig {
        prefill_tensor_cores: true,
        ..CudaConfig::default()
    };
    let Some(b) = gpu_with_or_skip(test, config) else {
        return;
    };
    assert!(b.device().tensor_cores(), "no tensor-core form on this GPU");
    let outcomes: Vec<_> = cases
        .iter()
        .map(|c| conformance::run_attention_case(&b, c).unwrap())
        .collect();
    report(&outcomes);
}

/// Prints every outcome, then fails on any that did not pass.
fn report(outcomes: &[conformance::Outcome]) {
    for o in outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(outcomes);
}

/// A NaN key comes out as NaN in exactly the rows that attend it (`run_nan_key_case`, every
/// store dtype, GQA and MLA, extend and decode), in every attention form.
#[test]
fn gpu_nan_keys_come_out_as_nan() {
    for (name, config) in CudaConfig::attention_forms() {
        let Some(b) = gpu_with_or_skip("gpu_nan_keys_come_out_as_nan", config) else {
            return;
        };
        println!("{name}:");
        report(&conformance::run_nan_key_suite(&b).unwrap());
    }
}

/// The own matmul's tensor-core form (`CudaConfig::gemm_tensor_cores`): the dense suite with
/// it on, then bf16 matmuls of 130 × 72 → 100 (partial row and output blocks, a partial k
/// step) and 1000 × 512 → 700 within 1e-5 of the f64 matmul of the activations rounded to
/// bf16. Under a graph phase (decode) and without cuBLAS the form is what runs; eager here,
/// the backend takes cuBLAS where it is loaded, so the check clears that path first.
#[test]
fn gpu_gemm_tensor_cores() {
    use attention_cuda::Device;
    let config = CudaConfig {
        gemm_tensor_cores: true,
        ..CudaConfig::default()
    };
    let Some(b) = gpu_with_or_skip("gpu_gemm_tensor_cores", config) else {
        return;
    };
    assert!(b.device().tensor_cores(), "no tensor-core form on this GPU");
    let b = b.without_blas();
    let outcomes = conformance::run_dense_suite(&b).unwrap();
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
    for dims in [(130, 72, 100), (1000, 512, 700)] {
        let (rounded, reference) =
            conformance::matmul_bf16_activations_case(&b, dims, 0x6E).unwrap();
        println!("{dims:?}: rounded {rounded:.2e}, reference {reference:.2e}");
        assert!(rounded < 1e-5, "{rounded}");
        assert!(reference < conformance::BF16_WEIGHT_BOUND, "{reference}");
    }
}

/// [`gpu_moe_tensor_cores`]' check on a prefill-sized batch: 4096 tokens, top 6 of 64 experts
/// (about 384 rows, six tiles, an expert).
#[test]
fn gpu_moe_tensor_cores_prefill() {
    let Some(b) = moe_tensor_core_backend("gpu_moe_tensor_cores_prefill") else {
        return;
    };
    moe_bf16_case(&b, (4096, 256, 64, 128), 6);
}

fn moe_tensor_core_backend(test: &str) -> Option<CudaBackend<CudarcDevice>> {
    use attention_cuda::Device;
    let config = CudaConfig {
        moe_tensor_cores: true,
        ..CudaConfig::default()
    };
    let b = gpu_with_or_skip(test, config)?;
    assert!(b.device().tensor_cores(), "no tensor-core form on this GPU");
    Some(b)
}

/// `conformance::moe_bf16_activations_case` of `dims` (tokens, hidden, experts,
/// intermediate), top `top_k`: within 1e-4 of the rounded computation, the bf16 bound of the
/// reference, and batch-invariant.
fn moe_bf16_case(b: &CudaBackend<CudarcDevice>, dims: (usize, usize, usize, usize), top_k: usize) {
    let routing = attention::moe::MoeRouting {
        top_k,
        renormalize: true,
        routed_scaling_factor: 1.0,
    };
    let o = conformance::moe_bf16_activations_case(b, dims, &routing, 0x7C).unwrap();
    println!(
        "{dims:?} top {top_k}: rounded {:.2e}, reference {:.2e}, batch-variant {:?}",
        o.rounded_error, o.reference_error, o.batch_variant_tokens
    );
    assert!(o.rounded_error < 1e-4, "{o:?}");
    assert!(
        o.reference_error < 2.0 * conformance::BF16_WEIGHT_BOUND,
        "{o:?}"
    );
    assert!(o.batch_variant_tokens.is_empty(), "{o:?}");
}

/// The tiny Llama and MLA decoders' greedy schedule on the GPU against the CPU backend
/// (`model::greedy_check`, the schedule the emulated device runs in `attention-cuda-emu`):
/// logits within the store dtype's bound, greedy tokens equal.
#[test]
fn gpu_tiny_decoders_greedy_match_cpu() {
    let Some(b) = gpu_or_skip("gpu_tiny_decoders_greedy_match_cpu") else {
        return;
    };
    for config in [
        model::greedy_check::llama_config(),
        model::greedy_check::mla_config(),
    ] {
        // bf16 weights: the CPU rounds their activations to bf16, as cuBLAS's bf16 GEMM does,
        // but the own kernel (under graphs) does not; both within the same bound.
        for (dtype, weights, bound) in [
            (kv_pool::KvDtype::F32, TensorDtype::F32, 1e-4),
            (kv_pool::KvDtype::Bf16, TensorDtype::F32, 1e-3),
            (kv_pool::KvDtype::Bf16, TensorDtype::Bf16, 1e-2),
            (kv_pool::KvDtype::F32, TensorDtype::F16, 1e-4),
        ] {
            let check =
                model::greedy_check::check_against_cpu(b.clone(), &config, dtype, weights, bound)
                    .unwrap();
            match check {
                Ok(tokens) => println!("{:?} {tokens}", config.architecture),
                Err(mismatch) => panic!("{:?} {mismatch}", config.architecture),
            }
        }
    }
}
