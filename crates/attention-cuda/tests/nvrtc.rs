//! Every kernel × every specialisation compiles to PTX with NVRTC (no GPU needed). Without
//! libnvrtc the test prints why and passes, unless `KVSERVE_REQUIRE_NVRTC=1` (CI), where a
//! missing NVRTC fails it.
#![cfg(any(feature = "cuda-12", feature = "cuda-13"))]

use attention_cuda::kernels::{self, all_specs};
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
    let specs = all_specs();
    let start = std::time::Instant::now();
    for spec in &specs {
        let ptx = nvrtc::compile(spec, ARCH)
            .unwrap_or_else(|e| panic!("{e}"))
            .to_src();
        for kernel in spec.source.kernels() {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{}: no entry point {kernel} in the PTX",
                spec.name()
            );
        }
    }
    println!(
        "{} specialisations compiled to PTX in {:.1?}",
        specs.len(),
        start.elapsed()
    );
}

#[test]
fn a_broken_kernel_is_rejected_with_the_log() {
    if !nvrtc_or_skip("a_broken_kernel_is_rejected_with_the_log") {
        return;
    }
    // The attention source without its specialisation defines: the #error names what is
    // missing, so NVRTC's log must reach the caller.
    let spec = attention_cuda::Spec {
        source: attention_cuda::Source::Attention,
        defines: vec![("KV_DTYPE", 7)],
    };
    let err = nvrtc::compile(&spec, ARCH).unwrap_err();
    assert!(err.contains("KV_DTYPE must be"), "{err}");
    // And the real sources compile.
    assert!(nvrtc::compile(&kernels::dense(), ARCH).is_ok());
}
