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

/// The environment variable of [`tuning_defines`].
pub const TUNING_DEFINES_VAR: &str = "KVSERVE_CUDA_DEFINES";

/// Extra `#define`s for every kernel compiled at run time, from [`TUNING_DEFINES_VAR`]:
/// `NAME=VALUE` pairs (an upper-case C name, a decimal integer) separated by spaces or commas,
/// e.g. `ATTN_MIN_BLOCKS=3 V_UNROLL_MAX=4`, for measuring a kernel's tuning defines on a GPU
/// without rebuilding (the kernels name theirs: `ATTN_MIN_BLOCKS`, `V_UNROLL_MAX`,
/// `KVS_SOFT_CVT`). `Err` names a malformed pair; unset or empty: none.
pub fn tuning_defines(value: Option<&str>) -> Result<Vec<(String, u64)>, String> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    value
        .split([' ', ','])
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let bad = || {
                format!("{TUNING_DEFINES_VAR}: {pair:?} is not NAME=VALUE (e.g. V_UNROLL_MAX=4)")
            };
            let (name, v) = pair.split_once('=').ok_or_else(bad)?;
            let name_ok = name.starts_with(|c: char| c.is_ascii_uppercase() || c == '_')
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            let v: u64 = v.parse().map_err(|_| bad())?;
            if name_ok {
                Ok((name.to_string(), v))
            } else {
                Err(bad())
            }
        })
        .collect()
}

/// Compiles `spec` to PTX for `arch` (an NVRTC `--gpu-architecture` value such as
/// `"compute_90"`), with the [`tuning_defines`] of the environment first; `Err` carries
/// NVRTC's log or the malformed define. Checks [`available`] first.
pub fn compile(spec: &Spec, arch: &str) -> Result<cudarc::nvrtc::Ptx, String> {
    available()?;
    let tuning = tuning_defines(std::env::var(TUNING_DEFINES_VAR).ok().as_deref())?;
    let mut text: String = tuning
        .iter()
        .map(|(name, v)| format!("#define {name} {v}\n"))
        .collect();
    text.push_str(&source_text(spec));
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec!["--std=c++17".into(), format!("--gpu-architecture={arch}")],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(text, opts).map_err(|e| format!("{}: {e:?}", spec.name()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_defines_parse_pairs_and_refuse_anything_else() {
        assert_eq!(tuning_defines(None).unwrap(), vec![]);
        assert_eq!(tuning_defines(Some(" ")).unwrap(), vec![]);
        assert_eq!(
            tuning_defines(Some("ATTN_MIN_BLOCKS=3, V_UNROLL_MAX=4")).unwrap(),
            vec![
                ("ATTN_MIN_BLOCKS".to_string(), 3),
                ("V_UNROLL_MAX".to_string(), 4)
            ]
        );
        for bad in ["X", "x=1", "A=b", "A=-1", "A B=1", "1A=2", "A=1;B=2"] {
            assert!(tuning_defines(Some(bad)).is_err(), "{bad}");
        }
    }
}
