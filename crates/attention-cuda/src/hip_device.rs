//! [`HipDevice`]: the [`Device`] on an AMD GPU through the HIP runtime (hip-sys, feature
//! `rocm`). Kernels are compiled by hipRTC ([`crate::hiprtc`]) for the GPU's architecture the
//! first time a specialisation is launched, and their modules cached. All work goes to the null
//! stream with synchronous copies, so launches and copies run in order.
//!
//! hip-sys links `libamdhip64` at build time, so a binary with this feature needs the HIP
//! runtime to start at all; [`HipDevice::new`] then asks the runtime for a device before any
//! other call, and no device (or no kernel driver) is a typed [`HipError`], never a panic.
//! hip-sys's `hipError_t` is a Rust enum: the runtime this links against returns only the codes
//! its own header (which hip-sys's bindings were generated from) declares.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;

use attention::{AttentionError, Result};
use hip_sys::hiprt::{self as hip, hipError_t};

use crate::device::{check_range, packed_args, Device, KernelArg, LaunchConfig};
use crate::hiprtc;
use crate::kernel_cache::KernelCache;
use crate::specs::Spec;

/// Why no HIP device could be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HipError {
    /// The runtime found no usable GPU, or no kernel driver (`/dev/kfd`) to reach one.
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the runtime reports.
        count: usize,
        /// The runtime's words.
        why: String,
    },
    /// hipRTC does not answer (kernels are compiled at run time).
    NoHiprtc(String),
    /// A runtime call failed.
    Runtime(String),
}

impl fmt::Display for HipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HipError::NoDevice {
                ordinal,
                count,
                why,
            } => write!(
                f,
                "no HIP device {ordinal} (the runtime reports {count}: {why})"
            ),
            HipError::NoHiprtc(why) => write!(f, "hipRTC unavailable: {why}"),
            HipError::Runtime(e) => write!(f, "HIP runtime error: {e}"),
        }
    }
}

impl std::error::Error for HipError {}

fn describe(e: hipError_t) -> String {
    // SAFETY: hipGetErrorString returns a static NUL-terminated string for any code (null
    // checked).
    let s = unsafe { hip::hipGetErrorString(e) };
    if s.is_null() {
        return format!("{e:?}");
    }
    // SAFETY: non-null, static, NUL-terminated.
    let text = unsafe { CStr::from_ptr(s) }.to_string_lossy();
    let name = format!("{e:?}");
    if text == name {
        name
    } else {
        format!("{name}: {text}")
    }
}

fn check(e: hipError_t) -> Result<()> {
    match e {
        hipError_t::hipSuccess => Ok(()),
        hipError_t::hipErrorOutOfMemory => Err(AttentionError::Device(format!(
            "out of device memory ({})",
            describe(e)
        ))),
        e => Err(AttentionError::Device(describe(e))),
    }
}

/// What [`HipDevice::new`] found: the device's name, architecture and memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HipReport {
    /// The device's name as the runtime reports it.
    pub name: String,
    /// The architecture hipRTC compiles for (`gcnArchName`'s first field, e.g. `gfx90a`).
    pub arch: String,
    /// Total device memory in bytes.
    pub total_bytes: usize,
}

impl fmt::Display for HipReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, {:.1} GiB)",
            self.name,
            self.arch,
            self.total_bytes as f64 / (1u64 << 30) as f64
        )
    }
}

/// Device memory: a `hipMalloc` allocation, freed on drop (`hipFree` waits for the device).
pub struct HipBuffer {
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: a HipBuffer owns its device allocation exclusively; the pointer is a device address,
// only passed to the runtime, which orders every access on the null stream.
unsafe impl Send for HipBuffer {}
// SAFETY: shared references only read the address and the length.
unsafe impl Sync for HipBuffer {}

impl Drop for HipBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from hipMalloc and is freed once, here.
        unsafe { hip::hipFree(self.ptr) };
    }
}

impl fmt::Debug for HipBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HipBuffer({} bytes)", self.len)
    }
}

/// A loaded kernel. The module that holds it is never unloaded while the device lives.
#[derive(Clone, Copy)]
struct Function(hip::hipFunction_t);

// SAFETY: a function handle is an immutable runtime object usable from any thread.
unsafe impl Send for Function {}

/// An AMD GPU (see the [module docs](self)).
pub struct HipDevice {
    ordinal: c_int,
    report: HipReport,
    functions: KernelCache<Function>,
    /// Compute units (multiprocessors) of the device.
    compute_units: usize,
}

impl fmt::Debug for HipDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HipDevice")
            .field("ordinal", &self.ordinal)
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

/// A NUL-terminated string out of a fixed C buffer (empty when there is no NUL).
fn c_field(bytes: &[c_char]) -> String {
    let bytes: Vec<u8> = bytes.iter().map(|&c| c as u8).collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(0);
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

impl HipDevice {
    /// Opens device `ordinal`, or says why it cannot (no device or driver, no hipRTC).
    pub fn new(ordinal: usize) -> std::result::Result<HipDevice, HipError> {
        let runtime = |e: hipError_t| HipError::Runtime(describe(e));
        let mut count: c_int = 0;
        // SAFETY: a valid out-pointer. hipGetDeviceCount initialises the runtime and reports
        // hipErrorNoDevice (or hipErrorInsufficientDriver) when there is nothing to open.
        let rc = unsafe { hip::hipGetDeviceCount(&mut count) };
        if rc != hipError_t::hipSuccess || count <= 0 || ordinal >= count as usize {
            return Err(HipError::NoDevice {
                ordinal,
                count: count.max(0) as usize,
                why: describe(rc),
            });
        }
        hiprtc::available().map_err(HipError::NoHiprtc)?;
        let ord = ordinal as c_int;
        // SAFETY: `ord` is below the device count.
        unsafe { hip::hipSetDevice(ord) }.ok_or_err(runtime)?;
        let mut name: [c_char; 256] = [0; 256];
        // SAFETY: `name` holds the 256 bytes passed as its length.
        unsafe { hip::hipDeviceGetName(name.as_mut_ptr(), name.len() as c_int, ord) }
            .ok_or_err(runtime)?;
        let mut total = 0usize;
        // SAFETY: a valid out-pointer and a valid device.
        unsafe { hip::hipDeviceTotalMem(&mut total, ord) }.ok_or_err(runtime)?;
        // The properties struct grew between ROCm releases: give the runtime room to spare.
        let words = std::mem::size_of::<hip::hipDeviceProp_t>().max(1 << 14) / 8;
        let mut props = vec![0u64; words];
        // SAFETY: `props` is zeroed, 8-byte aligned (the struct's alignment: ints, sizes and
        // char arrays) and larger than the struct this build's header declares.
        let rc = unsafe {
            hip::hipGetDeviceProperties(props.as_mut_ptr().cast::<hip::hipDeviceProp_t>(), ord)
        };
        rc.ok_or_err(runtime)?;
        // SAFETY: the runtime filled a struct of this build's layout at the start of `props`.
        let prop = unsafe { &*props.as_ptr().cast::<hip::hipDeviceProp_t>() };
        // "gfx90a:sramecc+:xnack-": hipRTC takes the whole string as --offload-arch.
        let arch = c_field(&prop.gcnArchName);
        if arch.is_empty() {
            return Err(HipError::Runtime(
                "the device reports no architecture".into(),
            ));
        }
        Ok(HipDevice {
            ordinal: ord,
            report: HipReport {
                name: c_field(&name),
                arch,
                total_bytes: total,
            },
            functions: KernelCache::default(),
            compute_units: prop.multiProcessorCount.max(1) as usize,
        })
    }

    /// What the device is.
    pub fn report(&self) -> &HipReport {
        &self.report
    }

    /// Makes this device current on the calling thread (the runtime's state is per thread).
    fn bind(&self) -> Result<()> {
        // SAFETY: the ordinal was valid when the device was opened.
        check(unsafe { hip::hipSetDevice(self.ordinal) })
    }

    fn function(&self, spec: &Spec, kernel: &str) -> Result<Function> {
        self.functions.get_or_load(spec, kernel, |names| {
            let code = hiprtc::compile(spec, &self.report.arch).map_err(AttentionError::Device)?;
            let mut module: hip::hipModule_t = std::ptr::null_mut();
            // SAFETY: `code` is a complete code object from hipRTC; the module is kept loaded
            // for the life of the process (its functions are cached).
            check(unsafe { hip::hipModuleLoadData(&mut module, code.as_ptr().cast()) })?;
            names
                .iter()
                .map(|k| {
                    let name =
                        CString::new(*k).map_err(|_| AttentionError::Device("bad name".into()))?;
                    let mut f: hip::hipFunction_t = std::ptr::null_mut();
                    // SAFETY: a loaded module and a NUL-terminated name.
                    check(unsafe { hip::hipModuleGetFunction(&mut f, module, name.as_ptr()) })?;
                    Ok(Function(f))
                })
                .collect()
        })
    }
}

trait OkOrErr {
    fn ok_or_err<E>(self, f: impl FnOnce(hipError_t) -> E) -> std::result::Result<(), E>;
}

impl OkOrErr for hipError_t {
    fn ok_or_err<E>(self, f: impl FnOnce(hipError_t) -> E) -> std::result::Result<(), E> {
        if self == hipError_t::hipSuccess {
            Ok(())
        } else {
            Err(f(self))
        }
    }
}

/// `HIP_LAUNCH_PARAM_BUFFER_POINTER`, `_SIZE` and `_END` of `hip_runtime_api.h`.
const PARAM_BUFFER_POINTER: usize = 1;
const PARAM_BUFFER_SIZE: usize = 2;
const PARAM_END: usize = 3;

impl Device for HipDevice {
    type Buffer = HipBuffer;
    /// None yet: the device runs on HIP's null stream, which cannot be captured.
    type Graph = std::convert::Infallible;

    fn name(&self) -> &str {
        "rocm"
    }

    fn blas(&self) -> std::result::Result<&str, String> {
        Err(
            "hipBLAS is not linked (hip-sys's `blas` feature needs hipBLAS and rocBLAS at \
             build time, which Debian's ROCm lacks)"
                .into(),
        )
    }

    fn wave_blocks(&self, spec: &Spec, kernel: &str, block: u32) -> Result<Option<usize>> {
        let f = self.function(spec, kernel)?;
        self.bind()?;
        let mut per_cu: c_int = 0;
        let block = c_int::try_from(block)
            .map_err(|_| AttentionError::Device(format!("block of {block} threads")))?;
        // SAFETY: a function of a loaded module (kept loaded for the process's life) and a
        // valid out-pointer.
        check(unsafe {
            hip::hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_cu, f.0, block, 0)
        })?;
        Ok(Some(per_cu.max(0) as usize * self.compute_units))
    }

    fn memory_info(&self) -> Result<Option<attention::DeviceMemory>> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two valid out-pointers, on the device bound above.
        check(unsafe { hip::hipMemGetInfo(&mut free, &mut total) })?;
        Ok(Some(attention::DeviceMemory {
            free_bytes: free as u64,
            total_bytes: total as u64,
        }))
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<HipBuffer> {
        self.bind()?;
        let len = bytes.max(1);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the allocation is owned by the returned buffer.
        check(unsafe { hip::hipMalloc(&mut ptr, len) })?;
        let buf = HipBuffer { ptr, len: bytes };
        // SAFETY: `len` bytes were just allocated at `ptr`.
        check(unsafe { hip::hipMemset(ptr, 0, len) })?;
        Ok(buf)
    }

    fn alloc_uninit(&self, bytes: usize) -> Result<HipBuffer> {
        self.bind()?;
        let len = bytes.max(1);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the allocation is owned by the returned buffer. Its
        // bytes are device memory, reached only by kernels and copies; the backend takes such
        // buffers only for what it overwrites whole (see `CudarcDevice::alloc_uninit`).
        check(unsafe { hip::hipMalloc(&mut ptr, len) })?;
        Ok(HipBuffer { ptr, len: bytes })
    }

    fn write(&self, dst: &mut HipBuffer, offset: usize, src: &[u8]) -> Result<()> {
        check_range("write", dst.len, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside the allocation (checked); the copy is synchronous, so
        // `src` outlives it. The runtime only reads through the host pointer.
        check(unsafe {
            hip::hipMemcpyHtoD(
                dst.ptr.cast::<u8>().add(offset).cast(),
                src.as_ptr().cast_mut().cast(),
                src.len(),
            )
        })
    }

    fn read(&self, src: &HipBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("read", src.len, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside the allocation (checked); the copy is synchronous and
        // ordered after earlier null-stream work, and writes only `dst`.
        check(unsafe {
            hip::hipMemcpyDtoH(
                dst.as_mut_ptr().cast(),
                src.ptr.cast::<u8>().add(offset).cast(),
                dst.len(),
            )
        })
    }

    fn len(&self, buf: &HipBuffer) -> usize {
        buf.len
    }

    fn address(&self, buf: &HipBuffer) -> usize {
        buf.ptr as usize
    }

    fn launch(
        &self,
        spec: &Spec,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, HipBuffer>],
    ) -> Result<()> {
        self.bind()?;
        let f = self.function(spec, kernel)?;
        let mut params = packed_args(args, |b| b.ptr as u64);
        let mut size = params.len();
        let mut extra: [*mut c_void; 5] = [
            PARAM_BUFFER_POINTER as *mut c_void,
            params.as_mut_ptr().cast(),
            PARAM_BUFFER_SIZE as *mut c_void,
            (&mut size as *mut usize).cast(),
            PARAM_END as *mut c_void,
        ];
        // SAFETY: `params` holds the kernel's parameters in its order and layout (the backend
        // passes them as the sources declare them; the CPU emulation checks the count against
        // the same sources); buffer addresses are live allocations sized for the launch, and
        // `params`/`size` outlive the call, which copies them when it queues the kernel.
        check(unsafe {
            hip::hipModuleLaunchKernel(
                f.0,
                cfg.grid[0] as c_uint,
                cfg.grid[1] as c_uint,
                cfg.grid[2] as c_uint,
                cfg.block as c_uint,
                1,
                1,
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                extra.as_mut_ptr(),
            )
        })
    }
}
