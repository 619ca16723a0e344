//! The shared conformance suite from `attention` on `CudaBackend<EmuDevice>`: attention-cuda's
//! kernels, compiled for the CPU, against the f64 reference. Cases without kernels yet
//! (DoubleSparse) are skipped with their reason through `Backend::kv_support`.

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

/// The quick suite on both attention kernels.
#[test]
fn emu_attention_conformance_quick() {
    for kernel in AttentionKernel::ALL {
        let Some(b) = backend("emu_attention_conformance_quick", with_kernel(kernel)) else {
            return;
        };
        println!("{kernel}:");
        let outcomes = conformance::run_attention_suite(&b, SuiteSize::Quick);
        report(&outcomes);
        // Every MHA and MLA case has kernels (every store dtype), so it must have run.
        let runnable = conformance::attention_cases(SuiteSize::Quick)
            .iter()
            .filter(|c| has_kernels(c))
            .count();
        let ran = outcomes.iter().filter(|o| o.skipped.is_none()).count();
        println!("{ran} of {} cases ran", outcomes.len());
        assert_eq!(ran, runnable);
    }
}

fn has_kernels(case: &AttentionCase) -> bool {
    matches!(case.kind, CaseKind::Mha { .. } | CaseKind::Mla { .. })
}

/// The quick suite gives each MHA shape and page size two dtypes in rotation (MLA one); here
/// every MHA and MLA case runs over the other store dtypes too.
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
/// the log-sum-exp merge meet the reference, on both attention kernels.
#[test]
fn emu_attention_conformance_split_extremes() {
    for kernel in AttentionKernel::ALL {
        for (name, target) in [("no split", 1), ("max split", 1 << 20)] {
            let config = CudaConfig {
                split_kv_target_blocks: target,
                ..with_kernel(kernel)
            };
            let Some(b) = backend("emu_attention_split_extremes", config) else {
                return;
            };
            let outcomes: Vec<_> = conformance::attention_cases(SuiteSize::Quick)
                .iter()
                .filter(|c| has_kernels(c))
                .step_by(3)
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
/// every store dtype (each with one page size, in rotation), extend and decode, with no split
/// and with the most splits; the pipelined kernel with the most splits (the harder case: empty
/// splits and the merge).
#[test]
fn emu_mla_head_counts_off_the_block_grid() {
    const HEADS: usize = 6;
    let hpb = attention_cuda::specs::MLA_HEADS_PER_BLOCK as usize;
    assert!(HEADS > hpb && HEADS % hpb != 0);
    let mut outcomes = Vec::new();
    let configs = [
        (AttentionKernel::Chunked, 1),
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
    assert_eq!(outcomes.len(), 3 * 5 * 2);
    report(&outcomes);
}

/// Page sizes that are not powers of two (`PAGE_FAMILY 2`, the kernels' general page-table
/// walk, which the quick suite's 1, 16 and 64 never take): every fifth MHA and MLA case with
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
    let ds = kv_pool::KvShape::double_sparse(2, 64, 64, 8, 1, KvDtype::F16).unwrap();
    assert!(b.kv_support(&ds).unwrap_err().contains("DoubleSparse"));
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
/// other).
#[test]
fn emu_decode_bandwidth_measures_every_page_family() {
    use attention::bandwidth::{measure_decode, DecodeCase};
    for (kernel, page_size) in AttentionKernel::ALL
        .into_iter()
        .flat_map(|k| [1, 16, 24].map(|p| (k, p)))
    {
        let Some(b) = backend("emu_decode_bandwidth", with_kernel(kernel)) else {
            return;
        };
        let case = DecodeCase {
            requests: 2,
            kv_len: 40,
            page_size,
            kv_heads: 1,
            q_heads: 2,
            head_dim: 64,
            dtype: KvDtype::F16,
        };
        let t = measure_decode(&b, &case, 1).unwrap();
        assert!(t.seconds > 0.0 && t.gbps() > 0.0, "{t:?}");
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
