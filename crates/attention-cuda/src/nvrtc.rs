//! Run-time compilation of the kernel sources to PTX with NVRTC (cudarc, dynamically loaded),
//! and [`assemble`]: the same compile carried on through NVRTC's ptxas to a real architecture's
//! machine code, with ptxas's report per kernel ([`crate::ptxas`]), for tests that check
//! what only the assembler sees (inline assembly, static shared memory, registers, spills)
//! without a GPU. [`available`] must say yes before either is called: cudarc's loader panics
//! when `libnvrtc` cannot be opened.

use crate::compile_cache::{Artifact, CompileCache};
use crate::kernels::source_text;
use crate::ptxas::{self, KernelResources};
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
/// `"compute_90"`), with the [`tuning_defines`] of the environment first, through the
/// environment's [`CompileCache`] ([`CompileCache::from_env`]); `Err` carries NVRTC's log or
/// the malformed define. Checks [`available`] first.
pub fn compile(spec: &Spec, arch: &str) -> Result<cudarc::nvrtc::Ptx, String> {
    compile_cached(spec, arch, CompileCache::from_env().as_ref()).map(|(ptx, _)| ptx)
}

/// [`compile`] through `cache` (none: always compile): the PTX, and whether it came from the
/// cache. A compile the cache cannot store is still returned.
pub fn compile_cached(
    spec: &Spec,
    arch: &str,
    cache: Option<&CompileCache>,
) -> Result<(cudarc::nvrtc::Ptx, bool), String> {
    available()?;
    let options = vec![
        "--std=c++17".to_string(),
        format!("--gpu-architecture={arch}"),
    ];
    let text = compiled_text(spec)?;
    let name = spec.name();
    let version = version()?;
    let joined = options.join(" ");
    let key = [version.as_str(), joined.as_str(), text.as_str()];
    let stored = cache.and_then(|c| c.get(Artifact::Ptx, &name, &key));
    // A whole PTX entry is UTF-8 text (`Artifact::is_whole`).
    if let Some(ptx) = stored.and_then(|bytes| String::from_utf8(bytes).ok()) {
        return Ok((cudarc::nvrtc::Ptx::from_src(ptx), true));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        ..Default::default()
    };
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(&text, opts).map_err(|e| format!("{name}: {e:?}"))?;
    // NVRTC's image is NUL-terminated text; best effort, as the cache is.
    if let (Some(cache), Some(bytes)) = (cache, ptx.as_bytes()) {
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        let _ = cache.put(Artifact::Ptx, &name, &key, &bytes[..end]);
    }
    Ok((ptx, false))
}

/// NVRTC's version, `"major.minor"`.
fn version() -> Result<String, String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: `available` was checked by the caller, so the library is loaded; nvrtcVersion
    // only writes the two integers it is given.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(format!("{major}.{minor}"))
    } else {
        Err(format!("nvrtcVersion: {status:?}"))
    }
}

/// What NVRTC compiles for `spec`: the [`tuning_defines`] of the environment, then the
/// specialised source.
fn compiled_text(spec: &Spec) -> Result<String, String> {
    let tuning = tuning_defines(std::env::var(TUNING_DEFINES_VAR).ok().as_deref())?;
    let mut text: String = tuning
        .iter()
        .map(|(name, v)| format!("#define {name} {v}\n"))
        .collect();
    text.push_str(&source_text(spec));
    Ok(text)
}

/// Compiles `spec` for the real architecture `arch` (`"sm_90"`): NVRTC's PTX assembled by the
/// ptxas inside NVRTC into the machine code a GPU of that architecture loads, so that what
/// only the assembler checks fails here as it would when a GPU loads the module (a malformed
/// inline `asm`, static shared memory beyond 48 KiB, a launch bound the registers cannot
/// meet). Returns ptxas's report of every kernel ([`ptxas::parse_ptxas_report`]); `Err` carries
/// NVRTC's log.
pub fn assemble(spec: &Spec, arch: &str) -> Result<Vec<KernelResources>, String> {
    use cudarc::nvrtc::result;
    available()?;
    let src = std::ffi::CString::new(compiled_text(spec)?)
        .map_err(|_| format!("{}: the source holds a NUL byte", spec.name()))?;
    let prog = result::create_program(&src, None).map_err(|e| format!("{}: {e:?}", spec.name()))?;
    let options = [
        "--std=c++17".to_string(),
        format!("--gpu-architecture={arch}"),
        "--ptxas-options=-v".to_string(),
    ];
    // SAFETY: `prog` was created just above from `src`, which outlives it, and is destroyed
    // only at the end of this function.
    let compiled = unsafe { result::compile_program(prog, &options) };
    // SAFETY: as above; the log exists after a compile, failed or not.
    let log = unsafe { result::get_program_log(prog) }.map(|raw| {
        let bytes: Vec<u8> = raw
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    });
    // SAFETY: `prog` is live and not used again.
    let destroyed = unsafe { result::destroy_program(prog) };
    let log = log.map_err(|e| format!("{}: no NVRTC log: {e:?}", spec.name()))?;
    compiled.map_err(|e| {
        // NVRTC's log leaves out ptxas's error line; the one limit it can be told from the
        // report is static shared memory's.
        let over: Vec<String> = ptxas::parse_report(&log, false)
            .unwrap_or_default()
            .into_iter()
            .filter(|k| k.shared_bytes > ptxas::STATIC_SHARED_LIMIT)
            .map(|k| {
                format!(
                    "{} uses {} bytes of static shared memory",
                    k.kernel, k.shared_bytes
                )
            })
            .collect();
        let hint = if over.is_empty() {
            String::new()
        } else {
            format!(
                " ({}; at most {})",
                over.join(", "),
                ptxas::STATIC_SHARED_LIMIT
            )
        };
        format!("{}: {e:?}{hint}\n{log}", spec.name())
    })?;
    destroyed.map_err(|e| format!("{}: {e:?}", spec.name()))?;
    ptxas::parse_ptxas_report(&log).map_err(|e| format!("{}: {e}\n{log}", spec.name()))
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
