//! Run-time compilation of the kernel sources to PTX with NVRTC (cudarc, dynamically loaded).
//! [`available`] must say yes before [`compile`] is called: cudarc's loader panics when
//! `libnvrtc` cannot be opened.

use crate::kernels::source_text;
use crate::specs::Spec;

/// Whether `libnvrtc` can be loaded (`Err` says why not).
pub fn available() -> Result<(), String> {
    // SAFETY: `is_culib_present` only tries to dlopen the library by its candidate names and
    // closes it again; it touches no other state.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(
            "libnvrtc could not be loaded (install a CUDA toolkit, or PyPI's nvidia-cuda-nvrtc \
             and put its nvidia/cu13/lib on LD_LIBRARY_PATH)"
                .into(),
        )
    }
}

/// Compiles `spec` to PTX for `arch` (an NVRTC `--gpu-architecture` value such as
/// `"compute_90"`); `Err` carries NVRTC's log. Checks [`available`] first.
pub fn compile(spec: &Spec, arch: &str) -> Result<cudarc::nvrtc::Ptx, String> {
    available()?;
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec!["--std=c++17".into(), format!("--gpu-architecture={arch}")],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(source_text(spec), opts)
        .map_err(|e| format!("{}: {e:?}", spec.name()))
}
