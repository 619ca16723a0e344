//! The `rocm` feature without an AMD GPU: every kernel × every specialisation (of one page-size
//! family) compiles to an AMD code object with hipRTC (for `gfx90a`, CDNA2 with 64-wide wavefronts), a broken source
//! is rejected with hipRTC's log, and opening a device that is not there is a typed error.
//! Without a working hipRTC the compile tests print why and pass, unless
//! `KVSERVE_REQUIRE_HIPRTC=1` (CI).
#![cfg(feature = "rocm")]

use attention_cuda::{hiprtc, HipDevice, HipError};

/// The architecture the code objects target (MI200; hipRTC 5.2 knows gfx908/90a/1030/1100).
const ARCH: &str = "gfx90a";

mod common;

fn hiprtc_or_skip(test: &str) -> bool {
    common::found_or_skip(test, "KVSERVE_REQUIRE_HIPRTC", hiprtc::available())
}

#[test]
fn every_specialisation_compiles_with_hiprtc() {
    if !hiprtc_or_skip("every_specialisation_compiles_with_hiprtc") {
        return;
    }
    // Child processes (one per core) compile a share each, in parallel: `compile` serialises
    // the compiles of one process. Within each child several threads call `compile` at once on
    // purpose: hipRTC itself corrupts the heap under concurrent compiles, and `compile` must
    // serialise them (this test crashed about one run in three before it did).
    //
    // One page-size family of the attention source (powers of two, what serving uses) and,
    // for MHA/GQA, one head dim (128): the families differ only in `kvs_slot`'s index
    // arithmetic and the head dims only in constants, all of which NVRTC compiles
    // (tests/nvrtc.rs) and the emulation runs; every branch of the sources' `#if`s (each
    // dtype, MLA or not, one or several heads per block) is compiled here, but the tensor-core
    // MLA form (`MMA_HEADS`), which needs 32-lane warps and `mma.sync`: the host never selects
    // it on HIP, and the source refuses to compile it there. 31 of the 179 specialisations.
    let get =
        |s: &attention_cuda::Spec, key: &str| s.defines.iter().find(|d| d.0 == key).map(|d| d.1);
    let specs: Vec<_> = attention_cuda::kernels::all_specs()
        .into_iter()
        .filter(|s| get(s, "PAGE_FAMILY").is_none_or(|f| f == 1))
        .filter(|s| get(s, "MLA").is_some() || get(s, "HEAD_DIM").is_none_or(|d| d == 128))
        .filter(|s| get(s, "MMA_HEADS").is_none())
        .collect();
    assert_eq!(specs.len(), 31);
    common::compile_every_spec(
        "every_specialisation_compiles_with_hiprtc",
        &format!("with hipRTC {:?} for {ARCH}", hiprtc::available().unwrap()),
        specs,
        |spec| hiprtc::compile(spec, ARCH),
        |spec, code| {
            if code.starts_with(b"\x7fELF") {
                Ok(())
            } else {
                Err(format!("{}: the code object is not ELF", spec.name()))
            }
        },
    );
}

#[test]
fn a_broken_kernel_is_rejected_with_the_log() {
    if !hiprtc_or_skip("a_broken_kernel_is_rejected_with_the_log") {
        return;
    }
    common::a_broken_source_is_rejected_with_the_log(|spec| hiprtc::compile(spec, ARCH));
}

/// hipRTC's code objects through the on-disk cache (`compile_cache`): stored by the first
/// compile, read back by the second, another entry for another architecture.
#[test]
fn a_compile_is_stored_once_and_read_back() {
    if !hiprtc_or_skip("a_compile_is_stored_once_and_read_back") {
        return;
    }
    common::a_compile_is_stored_once_and_read_back(
        "hiprtc-cache",
        [ARCH, "gfx1030"],
        hiprtc::compile_cached,
    );
}

/// Opening a device is a typed error when there is none (this machine, CI), never a panic; on
/// a machine with an AMD GPU, device 0 opens and an ordinal past the count is refused.
#[test]
fn a_missing_device_is_a_typed_error() {
    match HipDevice::new(0) {
        Ok(d) => println!("device 0: {}", d.report()),
        Err(e) => {
            println!("device 0: {e}");
            assert!(matches!(e, HipError::NoDevice { ordinal: 0, .. }), "{e:?}");
        }
    }
    let e = HipDevice::new(4096).unwrap_err();
    assert!(
        matches!(e, HipError::NoDevice { ordinal: 4096, .. }),
        "{e:?}"
    );
}
