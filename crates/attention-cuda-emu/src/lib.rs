//! # attention-cuda-emu — attention-cuda's kernels executed on the CPU (tests only)
//!
//! [`EmuDevice`] implements [`attention_cuda::Device`] by running the very `.cu` sources the
//! GPU runs, compiled for the CPU by this crate's build script with g++ (C++20) over
//! `emu/emu.h`: a launch runs the grid's blocks one after another, a block's threads as fibers
//! switched at barriers, `__syncthreads` as a block barrier, warp shuffles through a per-warp
//! scratch row and barrier, `__shared__` as static storage (a specialisation runs one launch
//! at a time). Device memory is host memory. So `CudaBackend<EmuDevice>` runs the shared conformance suite against the f64
//! reference with the backend's real planning and launch code, without a GPU.
//!
//! ## Invariants
//! - The kernels are compiled unchanged: every specialisation of `attention_cuda::specs` that
//!   an emulated test launches (attention at head dims 64 and 128 and every MLA shape; 96 and
//!   256 are left to NVRTC and hipRTC), from the same files NVRTC compiles; only the header
//!   around them differs.
//! - Launches are checked before they run: an unknown specialisation or kernel, an argument
//!   count other than the kernel's, an empty grid or an oversized block is a typed `Device`
//!   error, as is a block whose threads wait on barriers that can never complete.
//! - Without a C++ compiler at build time the crate still builds; [`EmuDevice::new`] then
//!   returns why, and tests skip with that reason unless `KVSERVE_REQUIRE_CUDA_EMU=1`.
//! - Graph capture ([`Device::begin_capture`]) records launches (kernel, geometry and argument
//!   values) instead of running them, and refuses allocations, copies and reads with a typed
//!   error until the capture ends, as CUDA's stream capture does; a replay runs the recorded
//!   launches in order.
//! - Between two barriers a block's threads run one after another, in thread order by default;
//!   [`EmuDevice::with_schedule`] runs them reversed or in a new random order at every barrier
//!   ([`Schedule`]), so a read of what another thread writes with no barrier between them
//!   (a race on a GPU) changes the result, which the schedule tests compare bitwise.
//! - What emulation cannot check: the GPU memory model (threads switch only at barriers, so a
//!   race inside one barrier interval that no thread order exposes goes unnoticed) and speed.
//! - `cp.async` is modelled, not run as a plain copy: a copy's destination holds NaN bytes
//!   until its thread's `cp.async.wait_group` completes its group (`kvs_emu_cp_wait`), so a
//!   kernel that reads a stage too early (a wait count off by one, a missing barrier after
//!   another thread's wait) reads NaN here, as it would read undefined data on a GPU.
//! - A block's `__shared__` arrays start as 0xff bytes (NaN as f32), refilled before every
//!   block (each unit's arrays sit in a linker section of their own; ELF targets only), so a
//!   kernel that reads shared memory before writing it (undefined on a GPU) sees NaN, not a
//!   stale value.
//! - Device memory is fenced by guard pages on Unix ([`EmuBuffer`]): a kernel that reads or
//!   writes past the end of a buffer (its length rounded up to 16 bytes) faults, and the test
//!   process dies of SIGSEGV. With [`Placement::Start`] ([`EmuDevice::with_placement`]) the
//!   buffers abut the guard page before them instead, so an access just before a buffer's
//!   start faults. Overruns within a shared-memory array are not caught.
//!
//! ## Where it sits
//! A test-only crate (`publish = false`): depends on `attention-cuda` (the trait it implements)
//! and `attention`; nothing depends on it but tests.

#[cfg(not(unix))]
use std::alloc::Layout;
use std::ffi::{c_char, c_int, c_void, CString};
use std::ptr::NonNull;

use attention::{AttentionError, Result};
use attention_cuda::{Device, KernelArg, LaunchConfig, Spec};

/// Host memory standing in for a device allocation: 16-byte aligned, zeroed, at least one
/// byte. Kernels write through its pointer while Rust holds only `&EmuBuffer`, so the bytes are
/// never reached through a Rust reference except in [`Device::read`] / [`Device::write`].
///
/// On Unix the bytes are a mapping of their own, fenced by inaccessible guard pages: they end
/// (their length rounded up to 16 bytes) where the guard page after them begins, or with
/// [`Placement::Start`] begin where the guard page before them ends, so a kernel that reads or
/// writes past the end of a buffer (before its start), or outside its mapping, faults (the
/// test process dies of SIGSEGV) instead of touching another buffer, as compute-sanitizer's
/// memcheck would report on a GPU.
pub struct EmuBuffer {
    ptr: NonNull<u8>,
    len: usize,
    memory: Memory,
}

/// Where an [`EmuBuffer`]'s bytes live.
enum Memory {
    /// A guarded mapping: `len` bytes at `base`, the first and last pages inaccessible.
    #[cfg(unix)]
    Guarded { base: NonNull<u8>, len: usize },
    /// The global allocator's.
    #[cfg(not(unix))]
    Heap(Layout),
}

impl EmuBuffer {
    /// A zeroed buffer of `bytes` (at least one), 16-byte aligned, placed by `placement`.
    fn zeroed(bytes: usize, placement: Placement) -> Result<EmuBuffer> {
        let oom = AttentionError::HostOutOfMemory { bytes };
        let padded = bytes
            .max(1)
            .checked_next_multiple_of(16)
            .ok_or_else(|| oom.clone())?;
        #[cfg(unix)]
        {
            // SAFETY: sysconf only reads a constant of the system.
            let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
                .ok()
                .filter(|&p| p >= 16)
                .unwrap_or(4096);
            let data = padded.div_ceil(page) * page;
            let len = data.checked_add(2 * page).ok_or_else(|| oom.clone())?;
            // SAFETY: an anonymous private mapping at an address of the kernel's choosing
            // touches no existing memory.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return Err(oom);
            }
            let base = base.cast::<u8>();
            let memory = Memory::Guarded {
                base: NonNull::new(base).ok_or(oom)?,
                len,
            };
            // SAFETY: both ranges are whole pages inside the mapping just made, which nothing
            // else references; a failure leaves the pages accessible, which only loses the
            // guard.
            unsafe {
                libc::mprotect(base.cast(), page, libc::PROT_NONE);
                libc::mprotect(base.add(page + data).cast(), page, libc::PROT_NONE);
            }
            let offset = match placement {
                Placement::End => page + data - padded,
                Placement::Start => page,
            };
            // SAFETY: page ≤ offset and offset + padded ≤ page + data: inside the mapping's
            // accessible pages.
            let ptr = unsafe { base.add(offset) };
            Ok(EmuBuffer {
                ptr: NonNull::new(ptr).expect("inside a mapping"),
                len: bytes,
                memory,
            })
        }
        #[cfg(not(unix))]
        {
            let _ = placement; // no guard pages to place the bytes against
            let layout = Layout::from_size_align(padded, 16).map_err(|_| oom.clone())?;
            // SAFETY: the layout has a non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            Ok(EmuBuffer {
                ptr: NonNull::new(ptr).ok_or(oom)?,
                len: bytes,
                memory: Memory::Heap(layout),
            })
        }
    }

    /// The bytes a kernel may touch: the length rounded up to 16 (at least 16).
    fn capacity(&self) -> usize {
        self.len.max(1).next_multiple_of(16)
    }
}

// SAFETY: an EmuBuffer owns its allocation exclusively (like a Box<[u8]>); the raw pointer is
// only dereferenced by launches and copies, which the backend orders (one launch at a time per
// calling thread, and a buffer is not shared across threads while a launch writes it).
unsafe impl Send for EmuBuffer {}
// SAFETY: as for Send: shared references only read the pointer value and the length.
unsafe impl Sync for EmuBuffer {}

impl Drop for EmuBuffer {
    fn drop(&mut self) {
        match self.memory {
            // SAFETY: the mapping came from `mmap(len)` in `zeroed` and is unmapped once, here.
            #[cfg(unix)]
            Memory::Guarded { base, len } => unsafe {
                libc::munmap(base.as_ptr().cast(), len);
            },
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` and is freed once, here.
            #[cfg(not(unix))]
            Memory::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
        }
    }
}

impl std::fmt::Debug for EmuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmuBuffer({} bytes)", self.len)
    }
}

/// The order a block's threads run in between two barriers (see the [crate docs](crate)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// Thread order (0, 1, …) after every barrier: the default.
    #[default]
    InOrder,
    /// Reverse thread order after every barrier.
    Reversed,
    /// A new pseudo-random order after every barrier, drawn from this seed (the same seed, the
    /// same orders).
    Shuffled(u64),
}

impl Schedule {
    /// The runtime's (mode, seed) for `kvs_emu_set_schedule`.
    fn mode(self) -> (u32, u64) {
        match self {
            Schedule::InOrder => (0, 0),
            Schedule::Reversed => (1, 0),
            Schedule::Shuffled(seed) => (2, seed),
        }
    }
}

/// Where a buffer's bytes sit in their guarded mapping (Unix; see [`EmuBuffer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Against the guard page after them: an access past the end faults (the default).
    #[default]
    End,
    /// Against the guard page before them: an access before the start faults.
    Start,
}

/// The emulated device (see the [crate docs](crate)).
#[derive(Debug)]
pub struct EmuDevice {
    /// The order a block's threads run in between barriers.
    schedule: Schedule,
    /// Where its buffers sit in their guarded mappings.
    placement: Placement,
    /// The launches recorded since `begin_capture`, or `None` outside a capture.
    capture: std::sync::Mutex<Option<Vec<Recorded>>>,
    /// Launches run (or recorded) so far, by specialisation and kernel: what tests check to
    /// know which specialisation a backend chose.
    counts: std::sync::Mutex<std::collections::HashMap<(Spec, String), usize>>,
}

/// One recorded launch: what `launch_compiled` takes, argument values included.
#[derive(Debug, Clone)]
struct Recorded {
    spec: Spec,
    kernel: String,
    cfg: LaunchConfig,
    values: Vec<u64>,
}

/// A captured graph of the emulated device: its launches, in order.
#[derive(Debug)]
pub struct EmuGraph {
    launches: Vec<Recorded>,
}

impl EmuGraph {
    /// The number of recorded launches.
    pub fn launches(&self) -> usize {
        self.launches.len()
    }
}

#[cfg(not(kvs_emu_missing))]
extern "C" {
    fn kvs_emu_launch(
        spec: *const c_char,
        kernel: *const c_char,
        grid: *const u32,
        block: u32,
        params: *mut *mut c_void,
        nparams: u32,
    ) -> c_int;
    fn kvs_emu_selftest(
        kernel: *const c_char,
        grid: *const u32,
        block: u32,
        params: *mut *mut c_void,
        nparams: u32,
    ) -> c_int;
    fn kvs_emu_set_schedule(mode: u32, seed: u64);
}

impl EmuDevice {
    /// The emulated device, or why the kernels were not compiled for the CPU.
    pub fn new() -> std::result::Result<EmuDevice, String> {
        #[cfg(kvs_emu_missing)]
        return Err(env!("KVS_EMU_MISSING").to_string());
        #[cfg(not(kvs_emu_missing))]
        Ok(EmuDevice {
            schedule: Schedule::default(),
            placement: Placement::default(),
            capture: std::sync::Mutex::new(None),
            counts: std::sync::Mutex::default(),
        })
    }

    /// This device with its blocks' threads run in `schedule`'s order between barriers.
    pub fn with_schedule(self, schedule: Schedule) -> Self {
        EmuDevice { schedule, ..self }
    }

    /// This device with its buffers placed against `placement`'s guard page.
    pub fn with_placement(self, placement: Placement) -> Self {
        EmuDevice { placement, ..self }
    }

    /// How many launches of `kernel` this device has run or recorded so far from the
    /// specialisations `spec` accepts.
    pub fn launch_count(&self, kernel: &str, spec: impl Fn(&Spec) -> bool) -> usize {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts
            .iter()
            .filter(|((s, k), _)| k == kernel && spec(s))
            .map(|(_, n)| n)
            .sum()
    }

    fn recording(&self) -> std::sync::MutexGuard<'_, Option<Vec<Recorded>>> {
        self.capture.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Err` when a capture is running: `what` is refused inside one, as by CUDA.
    fn outside_capture(&self, what: &str) -> Result<()> {
        if self.recording().is_some() {
            return Err(AttentionError::Device(format!(
                "cuda-emu: {what} inside a graph capture (the capture is invalidated)"
            )));
        }
        Ok(())
    }

    fn check_range(what: &'static str, buf: &EmuBuffer, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > buf.len) {
            return Err(AttentionError::Device(format!(
                "{what}: {len} bytes at offset {offset} overrun a buffer of {}",
                buf.len
            )));
        }
        Ok(())
    }
}

/// The byte [`EmuDevice`] fills an uninitialised allocation with.
pub const UNINIT_BYTE: u8 = 0xff;

impl Device for EmuDevice {
    type Buffer = EmuBuffer;
    type Graph = EmuGraph;

    fn begin_capture(&self) -> Result<()> {
        let mut rec = self.recording();
        if rec.is_some() {
            return Err(AttentionError::Device(
                "cuda-emu: a capture is already running".into(),
            ));
        }
        *rec = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<EmuGraph> {
        match self.recording().take() {
            Some(launches) => Ok(EmuGraph { launches }),
            None => Err(AttentionError::Device(
                "cuda-emu: end_capture without begin_capture".into(),
            )),
        }
    }

    unsafe fn replay(&self, graph: &EmuGraph) -> Result<()> {
        self.outside_capture("a graph replay")?;
        for l in &graph.launches {
            // The caller guarantees that the buffers behind the recorded pointers are alive
            // (replay's contract), as a GPU graph's device addresses must be.
            launch_compiled(
                Some(&l.spec),
                &l.kernel,
                l.cfg,
                &mut l.values.clone(),
                self.schedule,
            )?;
        }
        Ok(())
    }

    fn name(&self) -> &str {
        "cuda-emu"
    }

    /// The kernels' tensor-core forms run here on their portable stand-ins, in the fragment
    /// layouts the GPU uses.
    fn tensor_cores(&self) -> bool {
        true
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<EmuBuffer> {
        self.outside_capture("an allocation")?;
        EmuBuffer::zeroed(bytes, self.placement)
    }

    /// Poisoned, not zeroed: every byte 0xff (an f32 NaN, a u32 past any index), so an output
    /// element a kernel leaves unwritten shows in the results.
    fn alloc_uninit(&self, bytes: usize) -> Result<EmuBuffer> {
        let buf = self.alloc_zeroed(bytes)?;
        // SAFETY: `buf` owns `capacity()` bytes at `ptr`, which nothing else references yet.
        unsafe { std::ptr::write_bytes(buf.ptr.as_ptr(), UNINIT_BYTE, buf.capacity()) };
        Ok(buf)
    }

    fn write(&self, dst: &mut EmuBuffer, offset: usize, src: &[u8]) -> Result<()> {
        self.outside_capture("a host-to-device copy")?;
        Self::check_range("write", dst, offset, src.len())?;
        // SAFETY: the range lies inside the allocation (checked above), `dst` is borrowed
        // mutably, and `src` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr.as_ptr().add(offset), src.len())
        };
        Ok(())
    }

    fn read(&self, src: &EmuBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.outside_capture("a device-to-host copy (a synchronisation)")?;
        Self::check_range("read", src, offset, dst.len())?;
        // SAFETY: the range lies inside the allocation (checked above); no launch runs while
        // the caller holds this call, so nothing writes the bytes meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(src.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    fn len(&self, buf: &EmuBuffer) -> usize {
        buf.len
    }

    fn address(&self, buf: &EmuBuffer) -> usize {
        buf.ptr.as_ptr() as usize
    }

    fn launch(
        &self,
        spec: &Spec,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, EmuBuffer>],
    ) -> Result<()> {
        *self
            .counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((spec.clone(), kernel.to_string()))
            .or_default() += 1;
        if let Some(rec) = self.recording().as_mut() {
            rec.push(Recorded {
                spec: spec.clone(),
                kernel: kernel.to_string(),
                cfg,
                values: values(args),
            });
            return Ok(());
        }
        launch_compiled(Some(spec), kernel, cfg, &mut values(args), self.schedule)
    }
}

fn values(args: &[KernelArg<'_, EmuBuffer>]) -> Vec<u64> {
    args.iter()
        .map(|a| match a {
            KernelArg::Buf(b) => b.ptr.as_ptr() as u64,
            KernelArg::U32(x) => u64::from(*x),
            KernelArg::F32(x) => u64::from(x.to_bits()),
        })
        .collect()
}

impl EmuDevice {
    /// Launches one of the emulator's own test kernels (`emu/selftest.cu`: `shfl_xor_table`,
    /// `block_reduce`, `mismatched_barriers`), for the tests of the emulation itself.
    pub fn launch_selftest(
        &self,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, EmuBuffer>],
    ) -> Result<()> {
        launch_compiled(None, kernel, cfg, &mut values(args), self.schedule)
    }
}

/// Calls the CPU-compiled kernel with cuLaunchKernel's convention: `params[i]` points at the
/// i-th argument's value (pointers as 8 bytes, `u32` and `f32` in the low 4 bytes of a
/// little-endian word). `spec: None` launches a self-test kernel. The launch runs on the
/// calling thread, its blocks' threads in `schedule`'s order.
#[cfg(not(kvs_emu_missing))]
fn launch_compiled(
    spec: Option<&Spec>,
    kernel: &str,
    cfg: LaunchConfig,
    values: &mut [u64],
    schedule: Schedule,
) -> Result<()> {
    let c = |s: &str| {
        CString::new(s).map_err(|_| AttentionError::Device(format!("bad kernel name {s:?}")))
    };
    let name = spec.map_or_else(|| "selftest".to_string(), Spec::name);
    let (spec_name, kernel_name) = (c(&name)?, c(kernel)?);
    let mut params: Vec<*mut c_void> = values
        .iter_mut()
        .map(|v| v as *mut u64 as *mut c_void)
        .collect();
    // SAFETY: the names are NUL-terminated, `grid` has 3 entries, and `params` has one valid
    // pointer per argument (the dispatcher refuses a count other than the kernel's). Buffer
    // arguments point at live allocations the backend sized for the launch; the kernel reads
    // and writes only through them. `kvs_emu_set_schedule` only sets two thread-locals.
    let rc = unsafe {
        let (mode, seed) = schedule.mode();
        // The schedule is the calling thread's, which runs the launch below.
        kvs_emu_set_schedule(mode, seed);
        match spec {
            Some(_) => kvs_emu_launch(
                spec_name.as_ptr(),
                kernel_name.as_ptr(),
                cfg.grid.as_ptr(),
                cfg.block,
                params.as_mut_ptr(),
                params.len() as u32,
            ),
            None => kvs_emu_selftest(
                kernel_name.as_ptr(),
                cfg.grid.as_ptr(),
                cfg.block,
                params.as_mut_ptr(),
                params.len() as u32,
            ),
        }
    };
    let what = match rc {
        0 => return Ok(()),
        -1 => "no such kernel in this specialisation",
        -2 => concat!(
            "no such specialisation (the emulation compiles attention for head dims ",
            env!("KVS_EMU_HEAD_DIMS"),
            " and MLA only)"
        ),
        -3 => "the block's threads wait on barriers that can never complete",
        -4 => "an empty grid or a block of 0 or more than 1024 threads",
        -5 => "the wrong number of arguments",
        _ => "an unknown failure",
    };
    Err(AttentionError::Device(format!(
        "cuda-emu: launching {kernel} of {name} with grid {:?} block {}: {what}",
        cfg.grid, cfg.block
    )))
}

#[cfg(kvs_emu_missing)]
fn launch_compiled(
    _: Option<&Spec>,
    kernel: &str,
    _: LaunchConfig,
    _: &mut [u64],
    _: Schedule,
) -> Result<()> {
    Err(AttentionError::Device(format!(
        "cuda-emu: cannot launch {kernel}: {}",
        env!("KVS_EMU_MISSING")
    )))
}

/// The emulated device for a test, or `None` after printing why it is missing; panics instead
/// when `KVSERVE_REQUIRE_CUDA_EMU=1` (CI).
pub fn emu_or_skip(test: &str) -> Option<EmuDevice> {
    match EmuDevice::new() {
        Ok(d) => Some(d),
        Err(reason) => {
            if std::env::var("KVSERVE_REQUIRE_CUDA_EMU").is_ok_and(|v| v == "1") {
                panic!("{test}: KVSERVE_REQUIRE_CUDA_EMU=1 but {reason}");
            }
            println!("skipping {test}: {reason}");
            None
        }
    }
}
