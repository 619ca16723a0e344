//! The shared conformance suite from `attention` on `CudaBackend<EmuDevice>`: attention-cuda's
//! kernels, compiled for the CPU, against the f64 reference; and DoubleSparse decode where
//! label scores tie, against the reference and the CPU backend.

use attention::conformance::{self, AttentionCase, CaseKind, SuiteSize};
use attention::Backend;
use attention_cuda::{AttentionKernel, CudaBackend, CudaConfig};
use attention_cuda_emu::emu_or_skip;
use kv_pool::KvDtype;

fn backend(test: &str, config: CudaConfig) -> Option<CudaBackend<attention_cuda_emu::EmuDevice>> {
    emu_or_skip(test).map(|d| CudaBackend::new(d, config))
}

fn report(outcomes: &[conformance::Outcome]) {
    for o in outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(outcomes);
}

#[test]
fn emu_dense_conformance() {
    let Some(b) = backend("emu_dense_conformance", CudaConfig::default()) else {
        return;
    };
    report(&conformance::run_dense_suite(&b).unwrap());
}

/// A backend whose paged attention runs `kernel`.
fn with_kernel(kernel: AttentionKernel) -> CudaConfig {
    CudaConfig {
        attention_kernel: kernel,
        ..CudaConfig::default()
    }
}

/// The quick suite on the default attention kernel (pipelined), and every other case of it on
/// the chunked one (half the emulation's time for the kernel `--cuda-attention-kernel` opts
/// into; the split-extremes test below runs it on more).
#[test]
fn emu_attention_conformance_quick() {
    let Some(b) = backend(
        "emu_attention_conformance_quick",
        with_kernel(AttentionKernel::Pipelined),
    ) else {
        return;
    };
    println!("pipelined:");
    let outcomes = conformance::run_attention_suite(&b, SuiteSize::Quick);
    report(&outcomes);
    // Every MHA, MLA and DoubleSparse case has kernels (every store dtype), so it must have
    // run.
    let runnable = conformance::attention_cases(SuiteSize::Quick)
        .iter()
        .filter(|c| has_kernels(c))
        .count();
    let ran = outcomes.iter().filter(|o| o.skipped.is_none()).count();
    println!("{ran} of {} cases ran", outcomes.len());
    assert_eq!(ran, runnable);
    let Some(b) = backend(
        "emu_attention_conformance_quick",
        with_kernel(AttentionKernel::Chunked),
    ) else {
        return;
    };
    println!("chunked:");
    let outcomes: Vec<_> = conformance::attention_cases(SuiteSize::Quick)
        .iter()
        .filter(|c| has_kernels(c))
        .step_by(2)
        .map(|c| conformance::run_attention_case(&b, c).unwrap())
        .collect();
    report(&outcomes);
}

fn has_kernels(case: &AttentionCase) -> bool {
    matches!(
        case.kind,
        CaseKind::Mha { .. } | CaseKind::Mla { .. } | CaseKind::DoubleSparse { .. }
    )
}

/// The quick suite gives each MHA shape and page size two dtypes in rotation (MLA one); here
/// every MHA, MLA and DoubleSparse case runs over the other store dtypes too.
#[test]
fn emu_attention_conformance_every_shape_and_dtype() {
    let Some(b) = backend("emu_attention_every_shape", CudaConfig::default()) else {
        return;
    };
    // The quick suite's own cases run in emu_attention_conformance_quick.
    let mut seen: std::collections::HashSet<String> =
        conformance::attention_cases(SuiteSize::Quick)
            .iter()
            .map(|c| format!("{c}"))
            .collect();
    let mut outcomes = Vec::new();
    for case in conformance::attention_cases(SuiteSize::Quick) {
        if !has_kernels(&case) {
            continue;
        }
        for dtype in KvDtype::ALL {
            let case = AttentionCase {
                dtype,
                ..case.clone()
            };
            if seen.insert(format!("{case}")) {
                outcomes.push(conformance::run_attention_case(&b, &case).unwrap());
            }
        }
    }
    report(&outcomes);
}

/// No split (one block per query over its whole range) and the most splits (one chunk of
/// keys per block, empty splits for the shorter requests), so both the single-split path and
/// the log-sum-exp merge meet the reference, on both attention kernels; the most splits again
/// with the merge in the attention kernel (`fuse_split_merge`).
#[test]
fn emu_attention_conformance_split_extremes() {
    for kernel in AttentionKernel::ALL {
        // (name, split target, merge in the kernel, every n-th case)
        for (name, target, fuse_split_merge, every) in [
            ("no split", 1, false, 3),
            ("max split", 1 << 20, false, 3),
            ("max split, merged in the kernel", 1 << 20, true, 7),
        ] {
            let config = CudaConfig {
                split_kv_target_blocks: target,
                fuse_split_merge,
                ..with_kernel(kernel)
            };
            let Some(b) = backend("emu_attention_split_extremes", config) else {
                return;
            };
            let outcomes: Vec<_> = conformance::attention_cases(SuiteSize::Quick)
                .iter()
                .filter(|c| has_kernels(c))
                .step_by(every)
                .map(|c| conformance::run_attention_case(&b, c).unwrap())
                .collect();
            println!("{kernel}, {name}:");
            report(&outcomes);
        }
    }
}

/// An MLA block serves `MLA_HEADS_PER_BLOCK` query heads (one read of the latent rows for all
/// of them); the suite's head counts (16, 4) are multiples of it, so here the small MLA shape
/// runs with 6 heads (two blocks per token, the second with idle heads), over
/// every store dtype (each with one page size, in rotation), extend and decode, on both kernels
/// with the most splits (the harder case: empty splits and the merge).
#[test]
fn emu_mla_head_counts_off_the_block_grid() {
    const HEADS: usize = 6;
    let hpb = attention_cuda::specs::MLA_HEADS_PER_BLOCK as usize;
    assert!(HEADS > hpb && HEADS % hpb != 0);
    let mut outcomes = Vec::new();
    // No split is the split-extremes test's (every case shape, MLA included).
    let configs = [
        (AttentionKernel::Chunked, 1 << 20),
        (AttentionKernel::Pipelined, 1 << 20),
    ];
    for (kernel, target) in configs {
        let config = CudaConfig {
            split_kv_target_blocks: target,
            ..with_kernel(kernel)
        };
        let Some(b) = backend("emu_mla_head_counts_off_the_block_grid", config) else {
            return;
        };
        for case in conformance::attention_cases(SuiteSize::Full) {
            let CaseKind::Mla {
                kv_lora_rank: 32,
                rope_dim,
                ..
            } = case.kind
            else {
                continue;
            };
            let dtype_index = KvDtype::ALL.iter().position(|&d| d == case.dtype);
            if [1, 16, 64][dtype_index.unwrap_or(0) % 3] != case.page_size {
                continue;
            }
            let case = AttentionCase {
                kind: CaseKind::Mla {
                    heads: HEADS,
                    kv_lora_rank: 32,
                    rope_dim,
                },
                ..case.clone()
            };
            outcomes.push(conformance::run_attention_case(&b, &case).unwrap());
        }
    }
    assert_eq!(outcomes.len(), 2 * 5 * 2);
    report(&outcomes);
}

/// The tensor-core MLA form (`CudaConfig::mla_tensor_cores`: f16/bf16 stores, and fp8 at rank
/// 512, `MLA_MMA_HEADS` heads a block in the pipelined kernel, warps splitting the head dims):
/// both MLA shapes of the quick suite (DeepSeek's 512 + 64 at 16 heads, and 32 + 16 at 4) over
/// f16 and bf16 (and the large shape over fp8 e4m3 and e5m2), every page size, extend and
/// decode, with no split, the most splits, and the most splits merged in the kernel; the
/// chunked kernel on the same specialisations (its own block size); then the small shape at
/// head counts off the form's block grid (6: one block with idle heads; 20: a full block and
/// one of 4). Each backend must have launched the tensor-core specialisations once a case.
#[test]
fn emu_mla_tensor_cores() {
    let mma = |spec: &attention_cuda::Spec| spec.defines.iter().any(|(k, _)| *k == "MMA_HEADS");
    let mla_cases = |heads: Option<usize>| -> Vec<AttentionCase> {
        let mut cases = Vec::new();
        for case in conformance::attention_cases(SuiteSize::Quick) {
            let CaseKind::Mla {
                heads: h,
                kv_lora_rank,
                rope_dim,
            } = case.kind
            else {
                continue;
            };
            if heads.is_some() && kv_lora_rank != 32 {
                continue;
            }
            let fp8: &[KvDtype] = if kv_lora_rank == 512 {
                &[KvDtype::Fp8E4m3, KvDtype::Fp8E5m2]
            } else {
                &[]
            };
            for &dtype in [KvDtype::F16, KvDtype::Bf16].iter().chain(fp8) {
                cases.push(AttentionCase {
                    kind: CaseKind::Mla {
                        heads: heads.unwrap_or(h),
                        kv_lora_rank,
                        rope_dim,
                    },
                    dtype,
                    ..case.clone()
                });
            }
        }
        cases
    };
    // (kernel, split target, merge in the kernel, head count: None the suite's)
    let runs = [
        (AttentionKernel::Pipelined, 1, false, None),
        (AttentionKernel::Pipelined, 1 << 20, false, None),
        (AttentionKernel::Pipelined, 1 << 20, true, None),
        (AttentionKernel::Chunked, 1 << 20, false, None),
        (AttentionKernel::Pipelined, 1 << 20, false, Some(6)),
        (AttentionKernel::Pipelined, 1 << 20, true, Some(20)),
    ];
    for (kernel, target, fuse_split_merge, heads) in runs {
        let config = CudaConfig {
            split_kv_target_blocks: target,
            fuse_split_merge,
            mla_tensor_cores: true,
            ..with_kernel(kernel)
        };
        let Some(b) = backend("emu_mla_tensor_cores", config) else {
            return;
        };
        let cases = mla_cases(heads);
        let outcomes: Vec<_> = cases
            .iter()
            .map(|c| conformance::run_attention_case(&b, c).unwrap())
            .collect();
        println!("{kernel}, split target {target}, merged {fuse_split_merge}, heads {heads:?}:");
        report(&outcomes);
        assert!(outcomes.iter().all(|o| o.skipped.is_none()));
        let launched = b.device().launch_count(kernel.entry_point(), mma);
        assert!(
            launched >= cases.len(),
            "{launched} launches of the tensor-core specialisations for {} cases",
            cases.len()
        );
    }
}

/// Between two barriers a block's threads run in thread order by default; reversed, or in a
/// new random order after every barrier (`Schedule`), a race-free kernel gives the same bits,
/// and one that reads what another thread wrote with no barrier between them (a race on a GPU)
/// does not. Cases of the quick attention suite on both kernels (the pipelined one with the
/// tensor-core MLA and prefill forms, and with the most splits merged in the kernel) and the
/// dense suite (with the tensor-core MoE and GEMM forms) run reversed and shuffled; their
/// errors against the reference must agree bit for bit, which they do only when the outputs
/// do. The reversed run places every buffer against the
/// guard page before it, so an access before a buffer's start faults there (the other runs,
/// and the other emulated suites, in thread order, place them against the one after).
#[test]
fn emu_results_do_not_depend_on_the_thread_schedule() {
    use attention_cuda_emu::{EmuDevice, Placement, Schedule};
    let configs = [
        (
            CudaConfig {
                mla_tensor_cores: true,
                moe_tensor_cores: true,
                gemm_tensor_cores: true,
                prefill_tensor_cores: true,
                ..with_kernel(AttentionKernel::Pipelined)
            },
            4,
        ),
        (
            CudaConfig {
                split_kv_target_blocks: 1 << 20,
                fuse_split_merge: true,
                ..with_kernel(AttentionKernel::Pipelined)
            },
            9,
        ),
        (with_kernel(AttentionKernel::Chunked), 7),
    ];
    let run =
        |schedule: Schedule, placement: Placement| -> Option<Vec<(String, u64, Option<u64>)>> {
            let mut errors = Vec::new();
            for (i, &(config, every)) in configs.iter().enumerate() {
                let device = EmuDevice::new()
                    .ok()?
                    .with_schedule(schedule)
                    .with_placement(placement);
                let b = CudaBackend::new(device, config);
                let mut outcomes: Vec<_> = conformance::attention_cases(SuiteSize::Quick)
                    .iter()
                    .filter(|c| has_kernels(c))
                    .skip(i)
                    .step_by(every)
                    .map(|c| conformance::run_attention_case(&b, c).unwrap())
                    .collect();
                if i == 0 {
                    outcomes.extend(conformance::run_dense_suite(&b).unwrap());
                    for kernel in ["paged_prefill", "matmul_mma", "moe_matmul_mma"] {
                        assert!(b.device().launch_count(kernel, |_| true) > 0, "{kernel}");
                    }
                }
                conformance::assert_all_passed(&outcomes);
                errors.extend(
                    outcomes
                        .into_iter()
                        .map(|o| (o.name, o.error.to_bits(), o.stored_error.map(f64::to_bits))),
                );
            }
            Some(errors)
        };
    if emu_or_skip("emu_results_do_not_depend_on_the_thread_schedule").is_none() {
        return;
    }
    // Reversed with buffers against the guard page before them (an under-run faults),
    // shuffled with them against the one after (an overrun faults).
    let reversed = run(Schedule::Reversed, Placement::Start).unwrap();
    let shuffled = run(Schedule::Shuffled(0x5EED), Placement::End).unwrap();
    println!("{} cases", reversed.len());
    assert_eq!(reversed.len(), shuffled.len());
    for (a, b) in reversed.iter().zip(&shuffled) {
        assert_eq!(a, b, "{}: reversed and shuffled threads differ", a.0);
    }
}

/// Page sizes that are not powers of two (`PAGE_FAMILY 2`, the kernels' general page-table
/// walk, which the quick suite's 1, 16 and 64 never take): every fifth MHA, MLA and DoubleSparse case with
/// pages of 24 and of 3 and the store dtypes in turn, on both attention kernels.
#[test]
fn emu_attention_conformance_any_page_size() {
    let mut outcomes = Vec::new();
    for kernel in AttentionKernel::ALL {
        let Some(b) = backend("emu_attention_any_page_size", with_kernel(kernel)) else {
            return;
        };
        let cases = conformance::attention_cases(SuiteSize::Quick);
        for (i, case) in cases
            .iter()
            .filter(|c| has_kernels(c))
            .step_by(5)
            .enumerate()
        {
            let case = AttentionCase {
                page_size: [24, 3][i % 2],
                dtype: KvDtype::ALL[i % KvDtype::ALL.len()],
                ..case.clone()
            };
            assert_eq!(attention_cuda::kernels::page_family(case.page_size), 2);
            outcomes.push(conformance::run_attention_case(&b, &case).unwrap());
        }
    }
    assert!(outcomes.len() >= 8, "{} cases", outcomes.len());
    report(&outcomes);
}

#[test]
fn unsupported_stores_are_announced() {
    let Some(b) = backend("unsupported_stores_are_announced", CudaConfig::default()) else {
        return;
    };
    for dtype in KvDtype::ALL {
        let mha = kv_pool::KvShape::mha(2, 64, 64, 1, dtype).unwrap();
        assert_eq!(b.kv_support(&mha), Ok(()));
    }
    for dtype in KvDtype::ALL {
        let ds = kv_pool::KvShape::double_sparse(2, 64, 64, 8, 1, dtype).unwrap();
        assert_eq!(b.kv_support(&ds), Ok(()));
    }
    let ds = kv_pool::KvShape::double_sparse(2, 72, 72, 8, 1, KvDtype::F16).unwrap();
    assert!(b.kv_support(&ds).unwrap_err().contains("head dims"));
    for (rank, rope) in attention_cuda::kernels::SPEC_MLA_DIMS {
        let mla = kv_pool::KvShape::mla(rank, rope, 1, KvDtype::Bf16).unwrap();
        assert_eq!(b.kv_support(&mla), Ok(()));
    }
    let mla = kv_pool::KvShape::mla(32, 8, 1, KvDtype::F16).unwrap();
    assert!(b.kv_support(&mla).unwrap_err().contains("MLA"));
    let odd = kv_pool::KvShape::mha(2, 72, 72, 1, KvDtype::F16).unwrap();
    assert!(b.kv_support(&odd).unwrap_err().contains("head dims"));
}

/// `attention::bandwidth::measure_decode`, what `examples/decode_bandwidth.rs` times on a GPU,
/// runs the emulated split-KV decode kernels (both) at every page family (1, a power of two,
/// other), over an MHA store and an MLA one (the pipelined kernel's MLA in both forms).
#[test]
fn emu_decode_bandwidth_measures_every_page_family() {
    use attention::bandwidth::{measure_decode, DecodeCase};
    for (kernel, page_size) in AttentionKernel::ALL
        .into_iter()
        .flat_map(|k| [1, 16, 24].map(|p| (k, p)))
    {
        for mla_tensor_cores in [false, true] {
            let config = CudaConfig {
                mla_tensor_cores,
                ..with_kernel(kernel)
            };
            let Some(b) = backend("emu_decode_bandwidth", config) else {
                return;
            };
            let mha = DecodeCase {
                requests: 2,
                kv_len: 40,
                page_size,
                kv_heads: 1,
                q_heads: 2,
                head_dim: 64,
                dtype: KvDtype::F16,
                mla_rope_dim: None,
            };
            let mla = DecodeCase {
                q_heads: 6,
                head_dim: 48,
                dtype: KvDtype::Bf16,
                mla_rope_dim: Some(16),
                ..mha
            };
            let cases = if mla_tensor_cores {
                vec![mla]
            } else {
                vec![mha, mla]
            };
            for case in cases {
                let t = measure_decode(&b, &case, 1).unwrap();
                assert!(t.seconds > 0.0 && t.gbps() > 0.0, "{t:?}");
            }
        }
    }
}

/// The tensor-core prefill kernel (`CudaConfig::prefill_tensor_cores`, `paged_prefill`): every
/// MHA/GQA extend case of the quick suite over f16, bf16, fp8 e4m3 and e5m2 stores in turn
/// (head dims 64 and 128;
/// groups of 1, 4, 7 and 8; pages of 1, 16 and 64), and long extends (150 new tokens from no
/// prefix: three tiles, the last partial; 66 after a prefix of 70; a one-token request beside
/// them) over pages of 16 and 24, short and long extends after long prefixes, against the
/// reference and, within 1e-4, the stored values; with the KV range split (the default target)
/// and unsplit. Each case must have launched the kernel; decode batches keep the attention
/// kernel.
#[test]
fn emu_prefill_tensor_cores() {
    let config = CudaConfig {
        prefill_tensor_cores: true,
        ..CudaConfig::default()
    };
    let Some(b) = backend("emu_prefill_tensor_cores", config) else {
        return;
    };
    let any = |_: &attention_cuda::Spec| true;
    let cases = conformance::extend_cases(&[
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Fp8E4m3,
        KvDtype::Fp8E5m2,
    ]);
    let mut outcomes = Vec::new();
    // The default split target splits the KV range of the cases with few tiles (the short
    // extend after 700 positions: 6 splits); a target of one block splits none.
    for split_kv_target_blocks in [config.split_kv_target_blocks, 1] {
        let b = b.with_config(CudaConfig {
            split_kv_target_blocks,
            ..config
        });
        let merges = b.device().launch_count("merge_states", any);
        for case in &cases {
            let before = b.device().launch_count("paged_prefill", any);
            outcomes.push(conformance::run_attention_case(&b, case).unwrap());
            let launched = b.device().launch_count("paged_prefill", any) - before;
            assert!(launched > 0, "{case}: paged_prefill did not run");
        }
        let merges = b.device().launch_count("merge_states", any) - merges;
        println!("split target {split_kv_target_blocks}: {merges} merges");
        assert_eq!(merges > 0, split_kv_target_blocks > 1);
    }
    report(&outcomes);
    // A decode batch keeps the attention kernel.
    let decode = conformance::attention_cases(SuiteSize::Quick)
        .into_iter()
        .find(|c| matches!(c.kind, CaseKind::Mha { .. }) && c.requests.iter().all(|r| r.1 == 1))
        .unwrap();
    let before = b.device().launch_count("paged_prefill", any);
    report(&[conformance::run_attention_case(
        &b,
        &AttentionCase {
            dtype: KvDtype::Bf16,
            ..decode
        },
    )
    .unwrap()]);
    assert_eq!(b.device().launch_count("paged_prefill", any), before);
}

/// `paged_prefill` over random extend batches (`conformance::random_extend_cases`: GQA groups
/// 1 to 8, so every packing of query heads, pages of 1 to 64, 1 to 3 requests after prefixes
/// of up to 300), each with its KV range unsplit, split toward the default target and split
/// the most, against the reference and the stored values.
#[test]
fn emu_prefill_tensor_cores_random_batches() {
    let any = |_: &attention_cuda::Spec| true;
    let mut outcomes = Vec::new();
    for (i, case) in conformance::random_extend_cases(12, 0x5EED)
        .iter()
        .enumerate()
    {
        let split_kv_target_blocks =
            [1, CudaConfig::default().split_kv_target_blocks, 1 << 20][i % 3];
        let config = CudaConfig {
            prefill_tensor_cores: true,
            split_kv_target_blocks,
            ..CudaConfig::default()
        };
        let Some(b) = backend("emu_prefill_tensor_cores_random_batches", config) else {
            return;
        };
        let before = b.device().launch_count("paged_prefill", any);
        let outcome = conformance::run_attention_case(&b, case).unwrap();
        println!("{outcome} (split target {split_kv_target_blocks})");
        assert!(
            b.device().launch_count("paged_prefill", any) > before,
            "{case}"
        );
        outcomes.push(outcome);
    }
    report(&outcomes);
}

/// A NaN key comes out as NaN in exactly the rows that attend it (`run_nan_key_case`, every
/// store dtype, GQA and MLA, extend and decode) on every kernel form: both attention kernels
/// (the pipelined one's GQA tensor-core form included), the tensor-core MLA form and
/// `paged_prefill`; and with the KV range split the most, the partial states merged by
/// `merge_states` and in the kernel. The tensor-core forms convert fp8 by moving bits, which
/// must still read e4m3's NaN byte as NaN; a state whose sum is NaN must not pass for an
/// empty one.
#[test]
fn emu_nan_keys_come_out_as_nan() {
    let most_splits = CudaConfig {
        split_kv_target_blocks: 1 << 20,
        ..CudaConfig::default()
    };
    let split = [
        ("most splits, merge_states", most_splits),
        (
            "most splits, merged in the kernel",
            CudaConfig {
                fuse_split_merge: true,
                ..most_splits
            },
        ),
    ];
    let any = |_: &attention_cuda::Spec| true;
    for (name, config) in CudaConfig::attention_forms().into_iter().chain(split) {
        let Some(b) = backend("emu_nan_keys_come_out_as_nan", config) else {
            return;
        };
        println!("{name}:");
        let merges = b.device().launch_count("merge_states", any);
        let fused = b.device().launch_count("zero_counters", any);
        let outcomes = conformance::run_nan_key_suite(&b).unwrap();
        report(&outcomes);
        // The split forms did split: the NaN states went through a merge.
        if config.split_kv_target_blocks == 1 << 20 {
            let merged = if config.fuse_split_merge {
                b.device().launch_count("zero_counters", any) - fused
            } else {
                b.device().launch_count("merge_states", any) - merges
            };
            assert!(merged > 0, "{name}: no split merged");
        }
    }
}

/// The own matmul's tensor-core form (`CudaConfig::gemm_tensor_cores`, `matmul_mma`) over bf16
/// weights: the dense suite (whose bf16 matmuls of 33 and 70 rows take it); then 130 rows (two
/// full row blocks and a partial one) by k 72 (a quarter-full last step) into 100 outputs (a
/// full output block and a partial one), within 1e-5 of the f64 matmul of the activations
/// rounded to bf16; batches of at most `gemm::MMA_MIN_ROWS` rows, and deterministic inference,
/// keep `matmul_bf16`.
#[test]
fn emu_gemm_tensor_cores() {
    let config = CudaConfig {
        gemm_tensor_cores: true,
        ..CudaConfig::default()
    };
    let Some(b) = backend("emu_gemm_tensor_cores", config) else {
        return;
    };
    let any = |_: &attention_cuda::Spec| true;
    let count = |b: &CudaBackend<attention_cuda_emu::EmuDevice>| {
        (
            b.device().launch_count("matmul_mma", any),
            b.device().launch_count("matmul_bf16", any),
        )
    };
    report(&conformance::run_dense_suite(&b).unwrap());
    let (mma, _) = count(&b);
    assert!(mma >= 4, "{mma} matmul_mma launches");
    let (mma, lanes) = count(&b);
    let (rounded, reference) =
        conformance::matmul_bf16_activations_case(&b, (130, 72, 100), 0x6E).unwrap();
    println!("130x72·(100x72 bf16)ᵀ: {rounded:.2e} against bf16 activations, {reference:.2e} against the reference");
    assert!(rounded < 1e-5, "{rounded}");
    assert!(reference < conformance::BF16_WEIGHT_BOUND, "{reference}");
    assert_eq!(count(&b), (mma + 1, lanes));
    let rows = attention_cuda::gemm::MMA_MIN_ROWS;
    conformance::matmul_bf16_activations_case(&b, (rows, 72, 100), 0x6F).unwrap();
    assert_eq!(count(&b), (mma + 1, lanes + 1));
    let deterministic = b.with_config(CudaConfig {
        enable_deterministic_inference: true,
        ..config
    });
    let (_, reference) =
        conformance::matmul_bf16_activations_case(&deterministic, (130, 72, 100), 0x6E).unwrap();
    assert!(reference < conformance::BF16_WEIGHT_BOUND, "{reference}");
    assert_eq!(count(&b), (mma + 1, lanes + 2));
}

/// `attention::gemm_throughput` (what `examples/gemm_throughput.rs` runs on a GPU) times a
/// small MoE layer and matmul in both forms, and the tensor-core forms really run in their rows.
#[test]
fn emu_gemm_throughput_measures_both_forms() {
    use attention::gemm_throughput::{
        measure_matmul, measure_moe, moe_experts, MatmulCase, MoeCase,
    };
    let Some(lanes) = backend("emu_gemm_throughput", CudaConfig::default()) else {
        return;
    };
    let case = MoeCase {
        tokens: 40,
        hidden: 64,
        experts: 8,
        intermediate: 32,
        top_k: 2,
        dtype: attention::TensorDtype::Bf16,
    };
    let experts = moe_experts(&lanes, &case).unwrap();
    let any = |_: &attention_cuda::Spec| true;
    for (mma, b) in [
        (false, lanes.clone()),
        (true, lanes.with_moe_tensor_cores(true)),
    ] {
        let before = b.device().launch_count("moe_matmul_mma", any);
        let t = measure_moe(&b, &case, &experts, 2, 2).unwrap();
        assert!(t.seconds > 0.0 && t.tflops() > 0.0, "{t:?}");
        // One untimed call and two samples of two, two expert matmuls each.
        let launched = b.device().launch_count("moe_matmul_mma", any) - before;
        assert_eq!(launched, if mma { 10 } else { 0 });
    }
    let case = MatmulCase::dense(20, 64, 48, attention::TensorDtype::Bf16);
    for (mma, b) in [
        (false, lanes.clone()),
        (true, lanes.with_gemm_tensor_cores(true)),
    ] {
        let before = b.device().launch_count("matmul_mma", any);
        let t = measure_matmul(&b, &case, 2, 2).unwrap();
        assert!(t.seconds > 0.0 && t.tflops() > 0.0, "{t:?}");
        let launched = b.device().launch_count("matmul_mma", any) - before;
        assert_eq!(launched, if mma { 5 } else { 0 });
    }
}

/// `fused_moe` on the device groups a batch's rows by expert into tiles; a token's output is
/// still bitwise the same alone as in a batch of 40 (where experts get several tiles, shared
/// with other tokens); more experts than `moe_align` groups for take the host algorithm.
#[test]
fn emu_fused_moe_rows_do_not_depend_on_the_batch() {
    use attention::moe::{MoeExperts, MoeRouting};
    let Some(b) = backend("emu_fused_moe_batch_invariance", CudaConfig::default()) else {
        return;
    };
    let (n, d, e, i) = (40, 24, 4, 20);
    let mut rng = kv_pool::rng::SplitMix64::new(0x3E);
    let h = conformance::nonzero_vec(&mut rng, n * d);
    let logits = conformance::nonzero_vec(&mut rng, n * e);
    let experts = MoeExperts {
        gate_up: b
            .upload(
                &conformance::nonzero_vec(&mut rng, e * 2 * i * d),
                &[e, 2 * i * d],
            )
            .unwrap(),
        down: b
            .upload(&conformance::nonzero_vec(&mut rng, e * d * i), &[e, d * i])
            .unwrap(),
        intermediate: i,
    };
    let routing = MoeRouting {
        top_k: 2,
        renormalize: true,
        routed_scaling_factor: 1.0,
    };
    let moe = |rows: std::ops::Range<usize>| {
        let m = rows.len();
        let x = b.upload(&h[rows.start * d..rows.end * d], &[m, d]).unwrap();
        let l = b
            .upload(&logits[rows.start * e..rows.end * e], &[m, e])
            .unwrap();
        let out = b.fused_moe(&x, &l, &experts, &routing).unwrap();
        b.download(&out).unwrap()
    };
    let batch = moe(0..n);
    for t in [0, 17, n - 1] {
        let alone: Vec<u32> = moe(t..t + 1).iter().map(|x| x.to_bits()).collect();
        let within: Vec<u32> = batch[t * d..(t + 1) * d]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(alone, within, "token {t}");
    }
    let many = attention_cuda::geometry::MOE_MAX_EXPERTS + 1;
    let too_many = MoeExperts {
        gate_up: b.upload(&vec![0.5; many * 2], &[many, 2]).unwrap(),
        down: b.upload(&vec![0.5; many], &[many, 1]).unwrap(),
        intermediate: 1,
    };
    let x = b.upload(&[0.5], &[1, 1]).unwrap();
    let l = b.upload(&vec![0.5; many], &[1, many]).unwrap();
    let got = b.fused_moe(&x, &l, &too_many, &routing).unwrap();
    let want = attention::reference::fused_moe(
        &[0.5],
        &vec![0.5; many],
        &vec![0.5; many * 2],
        &vec![0.5; many],
        (1, 1, many, 1),
        &routing,
    );
    let err = conformance::relative_error(&b.download(&got).unwrap(), &want);
    assert!(err < 1e-6, "{err}");
}

/// `fused_moe`'s tensor-core form (`CudaConfig::moe_tensor_cores`, `moe_matmul_mma`) over bf16
/// experts: the dense suite (whose bf16 MoE cases take it for gate/up and, where the
/// intermediate size is a multiple of 8, for down); then a batch of 150 tokens, top 2 of 4
/// experts (each with several 64-row tiles, the last partial), hidden 72 (k steps of 32, the
/// last a quarter full) and intermediate 104 (208 gate/up outputs: four 64-output blocks, the
/// last partial; down over 104 = 3¼ steps), against an f64 computation that rounds the
/// activations to bf16 where the form does, with a bound 20 times tighter than the rounding
/// itself; a token alone must give its batch row's bits; and experts whose hidden size is not a
/// multiple of 8 take the lanes' form (`moe_matmul_bf16`).
#[test]
fn emu_moe_tensor_cores() {
    use attention::moe::MoeRouting;
    let config = CudaConfig {
        moe_tensor_cores: true,
        ..CudaConfig::default()
    };
    let Some(b) = backend("emu_moe_tensor_cores", config) else {
        return;
    };
    let any = |_: &attention_cuda::Spec| true;
    report(&conformance::run_dense_suite(&b).unwrap());
    let suite_launches = b.device().launch_count("moe_matmul_mma", any);
    assert!(
        suite_launches >= 3,
        "{suite_launches} moe_matmul_mma launches"
    );

    let routing = MoeRouting {
        top_k: 2,
        renormalize: true,
        routed_scaling_factor: 1.0,
    };
    let before = b.device().launch_count("moe_matmul_mma", any);
    let o = conformance::moe_bf16_activations_case(&b, (150, 72, 4, 104), &routing, 0x7C).unwrap();
    println!("150x72 top 2 of 4 bf16 experts of 104: {o:?}");
    // The batch and three tokens alone, two expert matmuls each.
    assert_eq!(b.device().launch_count("moe_matmul_mma", any), before + 8);
    assert!(
        o.rows_per_expert.iter().all(|&r| r > 64 && r % 64 != 0),
        "every expert needs a full tile and a partial one: {:?}",
        o.rows_per_expert
    );
    assert!(o.rounded_error < 1e-4, "{o:?}");
    assert!(
        o.reference_error < 2.0 * conformance::BF16_WEIGHT_BOUND,
        "{o:?}"
    );
    assert!(o.batch_variant_tokens.is_empty(), "{o:?}");

    // Hidden 36: gate/up rows of 4.5 units take the lanes' form; down (over 104) the mma's.
    let (lanes, mma) = (
        b.device().launch_count("moe_matmul_bf16", any),
        b.device().launch_count("moe_matmul_mma", any),
    );
    let o = conformance::moe_bf16_activations_case(&b, (9, 36, 4, 104), &routing, 0x7D).unwrap();
    println!("9x36 top 2 of 4 bf16 experts of 104: {o:?}");
    assert_eq!(b.device().launch_count("moe_matmul_bf16", any), lanes + 4);
    assert_eq!(b.device().launch_count("moe_matmul_mma", any), mma + 4);
    assert!(
        o.reference_error < 2.0 * conformance::BF16_WEIGHT_BOUND,
        "{o:?}"
    );
    assert!(o.batch_variant_tokens.is_empty(), "{o:?}");
}

/// DoubleSparse decode over 300 positions (three of `ds_decode`'s chunks) whose label rows
/// take only three values, so the label scores tie in large groups: two positions score
/// highest, then 100 positions (every third) tie for the next score, and `top_k` = 12 must keep the two and
/// the ten earliest of the tie (the reference's and the CPU's rule). Every position's key
/// differs outside the label channels and every value differs, so keeping other positions
/// would change the output. Checked against the f64 reference over the stored rows, and
/// against the CPU backend, for an f32 and a bf16 store and pages of 1 and 16.
#[test]
fn ds_decode_keeps_the_earliest_of_tied_label_scores() {
    use attention::{
        conformance::{nonzero_vec, relative_error},
        reference, AttentionParams, BatchMetadata, CpuBackend, CpuConfig, DoubleSparseConfig,
        RequestKv,
    };
    use kv_pool::{KvBuffer, KvLayout, KvShape, KvStore, Slot, SplitMix64};

    let Some(emu) = backend("ds_decode_ties", CudaConfig::default()) else {
        return;
    };
    let cpu = CpuBackend::new(CpuConfig::default()).unwrap();
    let (q_heads, kv_heads, d, hc, top_k, kv_len) = (4, 2, 64, 4, 12, 300);
    // Label channels per KV head, and the label value of every channel at each position.
    let channels: Vec<u32> = vec![3, 17, 40, 62, 0, 9, 33, 51];
    let level = |j: usize| match j {
        250 | 280 => 3.0f32,
        j if j % 3 == 0 => 2.0,
        _ => 1.0,
    };
    let mut rng = SplitMix64::new(77);
    let mut k = nonzero_vec(&mut rng, kv_len * kv_heads * d);
    let v = nonzero_vec(&mut rng, kv_len * kv_heads * d);
    for j in 0..kv_len {
        for g in 0..kv_heads {
            for c in 0..hc {
                k[(j * kv_heads + g) * d + channels[g * hc + c] as usize] = level(j);
            }
        }
    }
    // Positive at the label channels, so a higher label level scores higher for every head.
    let mut q = nonzero_vec(&mut rng, q_heads * d);
    for h in 0..q_heads {
        for c in 0..hc {
            q[h * d + channels[(h / 2) * hc + c] as usize] = 0.5 + c as f32 * 0.25;
        }
    }
    let params = AttentionParams {
        scale: 1.0 / (d as f32).sqrt(),
        double_sparse: Some(DoubleSparseConfig {
            top_k,
            channels: channels.clone(),
        }),
    };
    let labels_of = |rows: &[f32]| -> Vec<f32> {
        rows.chunks_exact(kv_heads * d)
            .flat_map(|row| {
                channels
                    .iter()
                    .enumerate()
                    .map(move |(i, &c)| row[(i / hc) * d + c as usize])
            })
            .collect()
    };
    // One decode step of the last position over the 299 cached ones, on `b`.
    fn decode<B: Backend>(
        b: &B,
        layout: KvLayout,
        slots: &[Slot],
        (k, v, labels, q): (&[f32], &[f32], &[f32], &[f32]),
        params: &AttentionParams,
    ) -> (Vec<f32>, Vec<f32>) {
        let shape = layout.shape;
        let (kr, vr) = (
            shape.row_elems(KvBuffer::Key),
            shape.row_elems(KvBuffer::Value),
        );
        let lr = shape.row_elems(KvBuffer::Label);
        let n = slots.len() - 1;
        let mut store = b.new_kv_store(layout).unwrap();
        store
            .write_kv(1, &slots[..n], &k[..n * kr], &v[..n * vr])
            .unwrap();
        store
            .write_labels(1, &slots[..n], &labels[..n * lr])
            .unwrap();
        let reqs = [RequestKv {
            slots,
            extend_len: 1,
        }];
        let meta = BatchMetadata::new_decode(layout.page_size, &reqs).unwrap();
        let plan = b.plan(&meta).unwrap();
        let kv_heads = kr / 64;
        let out = b
            .attention(
                1,
                &plan,
                &mut store,
                &b.upload(q, &[1, q.len() / 64, 64]).unwrap(),
                &b.upload(&k[n * kr..], &[1, kv_heads, 64]).unwrap(),
                &b.upload(&v[n * vr..], &[1, kv_heads, 64]).unwrap(),
                params,
            )
            .unwrap();
        let mut stored = vec![0.0; slots.len() * lr];
        store
            .read_f32(1, KvBuffer::Label, slots, &mut stored)
            .unwrap();
        (b.download(&out).unwrap(), stored)
    }
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        for page_size in [1u32, 16] {
            let shape =
                KvShape::double_sparse(kv_heads as u32, d as u32, d as u32, hc as u32, 2, dtype)
                    .unwrap();
            let layout = KvLayout::new(shape, page_size, 1024).unwrap();
            // Pages in reverse order, so positions and slots disagree.
            let pages = kv_len.div_ceil(page_size as usize);
            let slots: Vec<Slot> = (0..kv_len)
                .map(|j| {
                    let page = pages - j / page_size as usize;
                    Slot((page * page_size as usize + j % page_size as usize) as u32)
                })
                .collect();
            let labels = labels_of(&k);
            let io = (&k[..], &v[..], &labels[..], &q[..]);
            let (got, stored) = decode(&emu, layout, &slots, io, &params);
            // Every decode here attends with the one channel list: uploaded once, then reused.
            assert_eq!(emu.ds_channel_lists(), 1);
            let (on_cpu, _) = decode(&cpu, layout, &slots, io, &params);
            // The reference over what the store holds (bf16 rounds the rows).
            let mut ks = vec![0.0; kv_len * kv_heads * d];
            let mut vs = vec![0.0; kv_len * kv_heads * d];
            {
                let mut store = cpu.new_kv_store(layout).unwrap();
                store.write_kv(1, &slots, &k, &v).unwrap();
                store.read_f32(1, KvBuffer::Key, &slots, &mut ks).unwrap();
                store.read_f32(1, KvBuffer::Value, &slots, &mut vs).unwrap();
            }
            let heads = reference::Heads {
                q_heads,
                kv_heads,
                head_dim: d,
                v_head_dim: d,
            };
            let want = reference::double_sparse_decode(
                heads,
                &q,
                &ks,
                &vs,
                &stored,
                &channels,
                top_k,
                params.scale,
            );
            let what = format!("{dtype:?} P={page_size}");
            assert!(
                relative_error(&got, &want) < 1e-5,
                "{what}: emu vs reference"
            );
            let cpu_as_f64: Vec<f64> = on_cpu.iter().map(|&x| x as f64).collect();
            assert!(
                relative_error(&got, &cpu_as_f64) < 1e-5,
                "{what}: emu vs cpu"
            );
            // Keeping the ten latest of the tie instead gives another output.
            let mut late = stored.clone();
            for j in (0..kv_len).filter(|j| j % 3 == 0).take(10) {
                for x in &mut late[j * kv_heads * hc..(j + 1) * kv_heads * hc] {
                    *x = 1.0;
                }
            }
            let other = reference::double_sparse_decode(
                heads,
                &q,
                &ks,
                &vs,
                &late,
                &channels,
                top_k,
                params.scale,
            );
            assert!(
                relative_error(&got, &other) > 1e-3,
                "{what}: the test would see it"
            );
        }
    }
}
