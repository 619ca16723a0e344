//! [`Device`]: what the backend needs from a GPU (or from the CPU emulation that stands in for
//! one in tests): zeroed allocations, host ↔ device copies and kernel launches by
//! specialisation and name with a grid, a block size and positional arguments, as
//! `cuLaunchKernel` takes them, and graph capture and replay (CUDA graphs, [`crate::graph`]).
//! The backend's host logic is generic over it, so the same
//! planning, validation and launch code drives the GPU and the emulated kernels.

use attention::{AttentionError, Result};

use crate::gemm::{GemmArgs, GemmInputs};
use crate::specs::Spec;

/// A launch's geometry: `grid` blocks (x, y, z) of `block` threads (1-D blocks only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks along x, y and z.
    pub grid: [u32; 3],
    /// Threads per block (a multiple of the warp size for kernels that reduce).
    pub block: u32,
}

/// One kernel argument, in the kernel's parameter order.
#[derive(Debug)]
pub enum KernelArg<'a, B> {
    /// A device buffer, passed as a pointer to its first byte. Kernels may write through it
    /// (device memory is not Rust memory: the device orders the accesses).
    Buf(&'a B),
    /// An `unsigned int`.
    U32(u32),
    /// A `float`.
    F32(f32),
}

/// A device the backend runs on. Every method returns a typed error instead of panicking; a
/// launch that the device rejects (an unknown kernel, too many threads) is an
/// [`AttentionError::Device`](attention::AttentionError::Device).
pub trait Device: Send + Sync {
    /// Device memory: a contiguous allocation of bytes.
    type Buffer: Send + Sync;

    /// A short name for logs and conformance output (`"cuda"`, `"cuda-emu"`).
    fn name(&self) -> &str;

    /// Allocates `bytes` zeroed bytes (at least one, so every buffer has an address).
    fn alloc_zeroed(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Allocates `bytes` bytes (at least one) whose contents are unspecified: for a buffer its
    /// user overwrites whole before anything reads it (an op's output, an upload), without the
    /// zeroing [`alloc_zeroed`](Device::alloc_zeroed) costs (a memset launch on a GPU). The
    /// default zeroes anyway.
    fn alloc_uninit(&self, bytes: usize) -> Result<Self::Buffer> {
        self.alloc_zeroed(bytes)
    }

    /// Copies `src` into `dst` at byte `offset` (must fit).
    fn write(&self, dst: &mut Self::Buffer, offset: usize, src: &[u8]) -> Result<()>;

    /// Copies `dst.len()` bytes out of `src` from byte `offset` (must fit).
    fn read(&self, src: &Self::Buffer, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// The buffer's length in bytes.
    fn len(&self, buf: &Self::Buffer) -> usize;

    /// The buffer's address in the device's address space (for transfer registration).
    fn address(&self, buf: &Self::Buffer) -> usize;

    /// Runs `kernel` of `spec` over `cfg` with `args`, ordered after every earlier launch and
    /// copy on this device (a later [`read`](Device::read) sees its writes).
    fn launch(
        &self,
        spec: &Spec,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, Self::Buffer>],
    ) -> Result<()>;

    /// A captured launch sequence ([`begin_capture`](Device::begin_capture) …
    /// [`end_capture`](Device::end_capture)), replayed by [`replay`](Device::replay): a CUDA
    /// graph on a GPU, the recorded launches in the emulation.
    type Graph: Send + Sync;

    /// Starts capturing: until [`end_capture`](Device::end_capture), launches are recorded
    /// into a graph instead of run, and an allocation, a host copy or a read (a
    /// synchronisation) is refused with a typed error, as CUDA's stream capture invalidates
    /// the capture on them. The default: this device cannot capture.
    fn begin_capture(&self) -> Result<()> {
        Err(AttentionError::Device(format!(
            "{} cannot capture graphs",
            self.name()
        )))
    }

    /// Ends the capture started by [`begin_capture`](Device::begin_capture) and returns what
    /// was recorded (also after a refused call, so the device leaves capture mode either way;
    /// the caller discards that graph).
    fn end_capture(&self) -> Result<Self::Graph> {
        Err(AttentionError::Device(format!(
            "{} cannot capture graphs",
            self.name()
        )))
    }

    /// Runs `graph`'s launches again, ordered after every earlier launch and copy.
    ///
    /// # Safety
    /// Every buffer the captured launches were given must still be alive: a graph holds
    /// device addresses, not borrows.
    unsafe fn replay(&self, graph: &Self::Graph) -> Result<()> {
        let _ = graph;
        Err(AttentionError::Device(format!(
            "{} cannot capture graphs",
            self.name()
        )))
    }

    /// Blocks of `kernel` of `spec`, `block` threads each, that the whole device runs at once
    /// (its multiprocessors times the blocks each holds by the kernel's registers and shared
    /// memory): one wave of a grid, which the split plan fills to whole waves
    /// ([`SplitPlan::new`](crate::plan::SplitPlan::new)). The default: `None`, the device
    /// cannot tell, and grids are sized by the target alone.
    fn wave_blocks(&self, spec: &Spec, kernel: &str, block: u32) -> Result<Option<usize>> {
        let _ = (spec, kernel, block);
        Ok(None)
    }

    /// Whether the kernels' tensor-core forms that need 32-lane warps and `mma.sync` (NVIDIA
    /// GPUs from sm_80) run on this device: the backend then selects specialisations that use
    /// them ([`crate::CudaConfig::mla_tensor_cores`]). The emulation runs their portable
    /// stand-ins. The default: no.
    fn tensor_cores(&self) -> bool {
        false
    }

    /// The device's free and total memory (`cuMemGetInfo`, `hipMemGetInfo`). The default:
    /// `None`, the device cannot tell (the emulation).
    fn memory_info(&self) -> Result<Option<attention::DeviceMemory>> {
        Ok(None)
    }

    /// Waits until every launch and copy submitted so far has finished. The default (a device
    /// that runs each launch to completion when called): nothing to wait for.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The vendor BLAS this device runs GEMMs through (`"cuBLAS"`), or why there is none
    /// (its library did not load, or the device has none). The default: none.
    fn blas(&self) -> std::result::Result<&str, String> {
        Err(format!("no vendor BLAS on {}", self.name()))
    }

    /// Runs `args` through the vendor BLAS with A = `w` and B = `x` of type `inputs`, C = `out`
    /// (f32; see [`GemmArgs`]), ordered after every earlier launch and copy. The backend calls
    /// it only when [`blas`](Device::blas) is `Ok`; the default refuses with `blas`'s reason.
    fn blas_gemm(
        &self,
        args: &GemmArgs,
        inputs: GemmInputs,
        w: &Self::Buffer,
        x: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (args, inputs, w, x, out);
        Err(AttentionError::Device(
            self.blas().err().unwrap_or_else(|| "vendor BLAS".into()),
        ))
    }
}

/// Checks that `n` bytes at byte `offset` fit a buffer of `len` bytes (a host copy's bounds,
/// checked before any device call); `what` names the copy in the error.
pub fn check_range(what: &'static str, len: usize, offset: usize, n: usize) -> Result<()> {
    if offset.checked_add(n).is_none_or(|end| end > len) {
        return Err(AttentionError::Device(format!(
            "{what}: {n} bytes at offset {offset} overrun a buffer of {len}"
        )));
    }
    Ok(())
}

/// The kernel's arguments packed as one parameter buffer, the layout `cuLaunchKernel` and
/// `hipModuleLaunchKernel` take through `extra` (`*_LAUNCH_PARAM_BUFFER_POINTER`): each value at
/// the next offset aligned to its size (pointers 8 bytes, `u32` and `f32` 4), little-endian,
/// the total rounded up to 8. `address` gives a buffer's device address.
pub fn packed_args<B>(args: &[KernelArg<'_, B>], address: impl Fn(&B) -> u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(args.len() * 8);
    for arg in args {
        let bytes: Vec<u8> = match arg {
            KernelArg::Buf(b) => address(b).to_le_bytes().to_vec(),
            KernelArg::U32(x) => x.to_le_bytes().to_vec(),
            KernelArg::F32(x) => x.to_le_bytes().to_vec(),
        };
        out.resize(out.len().next_multiple_of(bytes.len()), 0);
        out.extend_from_slice(&bytes);
    }
    out.resize(out.len().next_multiple_of(8), 0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_past_the_end_are_refused() {
        assert!(check_range("read", 16, 8, 8).is_ok() && check_range("read", 16, 16, 0).is_ok());
        let e = check_range("write", 16, 9, 8).unwrap_err();
        assert!(
            matches!(&e, AttentionError::Device(m) if m == "write: 8 bytes at offset 9 overrun a buffer of 16"),
            "{e:?}"
        );
        assert!(check_range("read", 16, usize::MAX, 2).is_err());
    }

    #[test]
    fn packed_args_align_each_value_to_its_size() {
        let (a, b) = (0x1122_3344_5566_7788u64, 0x99u64);
        let args = [
            KernelArg::U32(7),
            KernelArg::Buf(&a),
            KernelArg::F32(1.5),
            KernelArg::U32(9),
            KernelArg::Buf(&b),
            KernelArg::U32(3),
        ];
        let p = packed_args(&args, |&x| x);
        let mut want = Vec::new();
        want.extend(7u32.to_le_bytes());
        want.extend([0; 4]); // the pointer that follows starts at 8
        want.extend(a.to_le_bytes());
        want.extend(1.5f32.to_le_bytes());
        want.extend(9u32.to_le_bytes());
        want.extend(b.to_le_bytes());
        want.extend(3u32.to_le_bytes());
        want.extend([0; 4]); // the total is a multiple of 8
        assert_eq!(p, want);
        assert!(packed_args::<u64>(&[], |&x| x).is_empty());
    }
}
