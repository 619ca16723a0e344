//! Every kernel × every specialisation compiles to PTX with NVRTC (no GPU needed). Without
//! libnvrtc the test prints why and passes, unless `KVSERVE_REQUIRE_NVRTC=1` (CI), where a
//! missing NVRTC fails it.
#![cfg(any(feature = "cuda-12", feature = "cuda-13"))]

use attention_cuda::nvrtc;

/// The architecture the PTX targets (Hopper; PTX is forward compatible to newer GPUs).
const ARCH: &str = "compute_90";

mod common;

fn nvrtc_or_skip(test: &str) -> bool {
    common::found_or_skip(test, "KVSERVE_REQUIRE_NVRTC", nvrtc::available())
}

#[test]
fn every_specialisation_compiles_to_ptx() {
    if !nvrtc_or_skip("every_specialisation_compiles_to_ptx") {
        return;
    }
    common::compile_every_spec(
        "every_specialisation_compiles_to_ptx",
        "to PTX",
        attention_cuda::kernels::all_specs(),
        |spec| nvrtc::compile(spec, ARCH).map(|ptx| ptx.to_src()),
        |spec, ptx| match spec
            .source
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
