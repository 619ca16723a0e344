//! Run-time compilation of the kernel sources to AMD GPU code objects with hipRTC, the HIP
//! counterpart of [`crate::nvrtc`] (feature `rocm`). The hipRTC entry points are declared here
//! (hip-sys binds only the runtime API); they live in `libamdhip64` up to ROCm 5 and in
//! `libhiprtc` from ROCm 6, which the build script links when it finds it. Results are plain
//! `c_int`s, never Rust enums, so an unexpected code cannot be undefined behaviour.

use std::ffi::{c_char, c_int, CStr, CString};

use crate::compile_cache::{Artifact, CompileCache};
use crate::kernels::source_text;
use crate::specs::Spec;

#[repr(C)]
struct Program {
    _opaque: [u8; 0],
}

extern "C" {
    /// The HIP runtime's version (`HIP_VERSION`: major · 10⁷ + minor · 10⁵ + patch), which
    /// tells point releases apart where hipRTC's own version does not.
    fn hipRuntimeGetVersion(version: *mut c_int) -> c_int;
    fn hiprtcVersion(major: *mut c_int, minor: *mut c_int) -> c_int;
    fn hiprtcGetErrorString(result: c_int) -> *const c_char;
    fn hiprtcCreateProgram(
        prog: *mut *mut Program,
        src: *const c_char,
        name: *const c_char,
        num_headers: c_int,
        headers: *const *const c_char,
        include_names: *const *const c_char,
    ) -> c_int;
    fn hiprtcCompileProgram(
        prog: *mut Program,
        num_options: c_int,
        options: *const *const c_char,
    ) -> c_int;
    fn hiprtcGetProgramLogSize(prog: *mut Program, size: *mut usize) -> c_int;
    fn hiprtcGetProgramLog(prog: *mut Program, log: *mut c_char) -> c_int;
    fn hiprtcGetCodeSize(prog: *mut Program, size: *mut usize) -> c_int;
    fn hiprtcGetCode(prog: *mut Program, code: *mut c_char) -> c_int;
    fn hiprtcDestroyProgram(prog: *mut *mut Program) -> c_int;
}

fn error_string(rc: c_int) -> String {
    // SAFETY: hiprtcGetErrorString returns a pointer to a static NUL-terminated string (or
    // null, checked) for any code.
    let s = unsafe { hiprtcGetErrorString(rc) };
    if s.is_null() {
        return format!("hipRTC error {rc}");
    }
    // SAFETY: non-null, static and NUL-terminated (above).
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

/// hipRTC's version, or why it does not answer.
pub fn available() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; the call only writes them.
    let rc = unsafe { hiprtcVersion(&mut major, &mut minor) };
    if rc != 0 {
        return Err(format!("hiprtcVersion failed: {}", error_string(rc)));
    }
    Ok((major, minor))
}

/// A program handle, destroyed on drop.
struct Handle(*mut Program);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful hiprtcCreateProgram and is destroyed once.
        unsafe { hiprtcDestroyProgram(&mut self.0) };
    }
}

/// Held for the whole of every compile: hipRTC (ROCm 5.2's, in `libamdhip64`) is not safe to
/// call from two threads at once: concurrent `hiprtcCompileProgram` calls corrupt the heap
/// (glibc's "double free or corruption" and segfaults, about one run in three of the hipRTC
/// test when it compiled on two threads). Compiles are therefore serialised process-wide.
static COMPILE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Compiles `spec` to a code object for `arch` (an `--offload-arch` value such as `"gfx90a"`)
/// through the environment's [`CompileCache`] ([`CompileCache::from_env`]); `Err` carries
/// hipRTC's log. Safe to call from any thread: compiles are serialised ([`COMPILE_LOCK`]).
pub fn compile(spec: &Spec, arch: &str) -> Result<Vec<u8>, String> {
    compile_cached(spec, arch, CompileCache::from_env().as_ref()).map(|(code, _)| code)
}

/// [`compile`] through `cache` (none: always compile): the code object, and whether it came
/// from the cache. A compile the cache cannot store is still returned.
pub fn compile_cached(
    spec: &Spec,
    arch: &str,
    cache: Option<&CompileCache>,
) -> Result<(Vec<u8>, bool), String> {
    let (major, minor) = available()?;
    let name = spec.name();
    let text = source_text(spec);
    let options = [format!("--offload-arch={arch}"), "-std=c++17".to_string()];
    let mut runtime: c_int = 0;
    // SAFETY: one valid out-pointer; the call only writes it.
    let runtime = match unsafe { hipRuntimeGetVersion(&mut runtime) } {
        0 => runtime.to_string(),
        // Without the runtime's version no entry is shared with another build.
        _ => return compile_program(&name, &text, &options).map(|code| (code, false)),
    };
    let (version, joined) = (format!("{major}.{minor} ({runtime})"), options.join(" "));
    let key = [version.as_str(), joined.as_str(), text.as_str()];
    if let Some(code) = cache.and_then(|c| c.get(Artifact::CodeObject, &name, &key)) {
        return Ok((code, true));
    }
    let code = compile_program(&name, &text, &options)?;
    if let Some(cache) = cache {
        // Best effort, as the cache is.
        let _ = cache.put(Artifact::CodeObject, &name, &key, &code);
    }
    Ok((code, false))
}

/// One hipRTC compile of `text` (named `name`) with `options`, serialised ([`COMPILE_LOCK`]).
fn compile_program(name: &str, text: &str, options: &[String]) -> Result<Vec<u8>, String> {
    // A poisoned lock only means another compile panicked; hipRTC's state is per program.
    let _serialised = COMPILE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let cstr = |s: &str| CString::new(s).map_err(|_| format!("{name}: a NUL in the source"));
    let src = cstr(text)?;
    let file = cstr(&format!("{name}.cu"))?;
    let options = options
        .iter()
        .map(|o| cstr(o))
        .collect::<Result<Vec<_>, _>>()?;
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut prog = std::ptr::null_mut();
    // SAFETY: `src` and `file` are NUL-terminated and outlive the call; no headers are passed
    // (null arrays with a count of 0).
    let rc = unsafe {
        hiprtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            file.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(format!("{name}: hiprtcCreateProgram: {}", error_string(rc)));
    }
    let prog = Handle(prog);
    // SAFETY: a live program and `option_ptrs.len()` valid NUL-terminated options.
    let rc =
        unsafe { hiprtcCompileProgram(prog.0, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
    if rc != 0 {
        return Err(format!(
            "{name}: {}\n{}",
            error_string(rc),
            program_log(&prog)
        ));
    }
    let mut size = 0usize;
    // SAFETY: a live, compiled program and a valid out-pointer.
    let rc = unsafe { hiprtcGetCodeSize(prog.0, &mut size) };
    if rc != 0 || size == 0 {
        return Err(format!("{name}: no code object ({})", error_string(rc)));
    }
    let mut code = vec![0u8; size];
    // SAFETY: `code` has the `size` bytes hipRTC reported for this program.
    let rc = unsafe { hiprtcGetCode(prog.0, code.as_mut_ptr().cast()) };
    if rc != 0 {
        return Err(format!("{name}: hiprtcGetCode: {}", error_string(rc)));
    }
    Ok(code)
}

/// The program's compile log (empty when hipRTC has none).
fn program_log(prog: &Handle) -> String {
    let mut size = 0usize;
    // SAFETY: a live program and a valid out-pointer.
    if unsafe { hiprtcGetProgramLogSize(prog.0, &mut size) } != 0 || size == 0 {
        return String::new();
    }
    // One more byte than reported, zeroed: hipRTC 5 reports the size without the NUL.
    let mut log = vec![0u8; size + 1];
    // SAFETY: `log` holds at least the reported size.
    if unsafe { hiprtcGetProgramLog(prog.0, log.as_mut_ptr().cast()) } != 0 {
        return String::new();
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(size);
    String::from_utf8_lossy(&log[..end]).into_owned()
}
