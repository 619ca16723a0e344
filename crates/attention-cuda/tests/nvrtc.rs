//! Every kernel × every specialisation compiles with NVRTC (no GPU needed): the serving
//! family's (every branch of the sources) all the way to sm_90 machine code by NVRTC's ptxas,
//! the rest to PTX. Without libnvrtc the tests print why and pass, unless
//! `KVSERVE_REQUIRE_NVRTC=1` (CI), where a missing NVRTC fails them.
#![cfg(any(feature = "cuda-12", feature = "cuda-13"))]

use attention_cuda::nvrtc;

/// The architecture the PTX targets (Hopper; PTX is forward compatible to newer GPUs).
const ARCH: &str = "compute_90";

mod common;

fn nvrtc_or_skip(test: &str) -> bool {
    common::found_or_skip(test, "KVSERVE_REQUIRE_NVRTC", nvrtc::available())
}

/// The real architecture the serving family is assembled for (an H100's, H200's).
const SASS_ARCH: &str = "sm_90";

/// The specialisations assembled to machine code: the ones hipRTC compiles (every branch of
/// the sources' `#if`s: each dtype, MLA or not, one or several heads per block; powers of two
/// for the page size, what serving uses; MHA/GQA at head dim 128), and the tensor-core MLA
/// form. The others differ from one of these only in index arithmetic and constants.
fn assembled(spec: &attention_cuda::Spec) -> bool {
    let get = |key: &str| spec.defines.iter().find(|d| d.0 == key).map(|d| d.1);
    get("PAGE_FAMILY").is_none_or(|f| f == 1)
        && (get("MLA").is_some() || get("HEAD_DIM").is_none_or(|d| d == 128))
}

/// The serving family assembled for sm_90 by NVRTC's ptxas, which checks what PTX does not:
/// inline assembly, static shared memory (48 KiB at most: a kernel past it compiles to PTX
/// and fails only when a GPU loads it), launch bounds. Every kernel of each source must be in
/// ptxas's report, and neither the decode kernel `paged_attention_pipelined`, the prefill
/// kernel `paged_prefill` nor the tensor-core GEMMs (`moe_matmul_mma`, `matmul_mma`) may
/// spill.
#[test]
fn the_serving_family_assembles_for_sm_90_without_pipelined_spills() {
    if !nvrtc_or_skip("the_serving_family_assembles_for_sm_90_without_pipelined_spills") {
        return;
    }
    let specs: Vec<_> = attention_cuda::kernels::all_specs()
        .into_iter()
        .filter(assembled)
        .collect();
    assert_eq!(specs.len(), 37);
    common::compile_every_spec(
        "the_serving_family_assembles_for_sm_90_without_pipelined_spills",
        &format!("to {SASS_ARCH} machine code"),
        specs,
        |spec| nvrtc::assemble(spec, SASS_ARCH),
        |spec, kernels| {
            for k in kernels {
                if [
                    "paged_attention_pipelined",
                    "paged_prefill",
                    "moe_matmul_mma",
                    "matmul_mma",
                ]
                .contains(&k.kernel.as_str())
                {
                    println!(
                        "{} {}: {} registers, {} bytes of shared memory",
                        spec.name(),
                        k.kernel,
                        k.registers,
                        k.shared_bytes
                    );
                    if k.spill_store_bytes > 0 {
                        return Err(format!("{}: {k:?} spills", spec.name()));
                    }
                }
            }
            match spec
                .kernels()
                .into_iter()
                .find(|&name| !kernels.iter().any(|k| k.kernel == name))
            {
                Some(missing) => Err(format!("{}: ptxas did not report {missing}", spec.name())),
                None => Ok(()),
            }
        },
    );
}

#[test]
fn every_other_specialisation_compiles_to_ptx() {
    if !nvrtc_or_skip("every_other_specialisation_compiles_to_ptx") {
        return;
    }
    let specs: Vec<_> = attention_cuda::kernels::all_specs()
        .into_iter()
        .filter(|s| !assembled(s))
        .collect();
    assert_eq!(specs.len(), 179 - 37);
    common::compile_every_spec(
        "every_other_specialisation_compiles_to_ptx",
        "to PTX",
        specs,
        |spec| nvrtc::compile(spec, ARCH).map(|ptx| ptx.to_src()),
        |spec, ptx| match spec
            .kernels()
            .iter()
            .find(|k| !ptx.contains(&format!(".entry {k}(")))
        {
            Some(k) => Err(format!("{}: no entry point {k} in the PTX", spec.name())),
            None => Ok(()),
        },
    );
}

#[test]
fn a_broken_kernel_is_rejected_with_the_log() {
    if !nvrtc_or_skip("a_broken_kernel_is_rejected_with_the_log") {
        return;
    }
    common::a_broken_source_is_rejected_with_the_log(|spec| nvrtc::compile(spec, ARCH));
}

/// NVRTC's PTX through the on-disk cache (`compile_cache`): stored by the first compile, read
/// back by the second, another entry for another architecture.
#[test]
fn a_compile_is_stored_once_and_read_back() {
    if !nvrtc_or_skip("a_compile_is_stored_once_and_read_back") {
        return;
    }
    common::a_compile_is_stored_once_and_read_back(
        "nvrtc-cache",
        [ARCH, "compute_80"],
        |spec, arch, cache| {
            let (ptx, hit) = nvrtc::compile_cached(spec, arch, cache)?;
            Ok((ptx.to_src().trim_end_matches('\0').as_bytes().to_vec(), hit))
        },
    );
}
