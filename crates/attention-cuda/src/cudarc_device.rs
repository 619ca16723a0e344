//! [`CudarcDevice`]: the [`Device`] on an NVIDIA GPU through cudarc (dynamically loaded
//! libcuda and libnvrtc). Kernels are compiled by NVRTC for the GPU's compute capability the
//! first time a specialisation is launched, and their modules cached. All work goes to one
//! stream (created, not the legacy default stream, which cannot be captured), so launches and
//! copies run in order; reads wait for it. Graphs ([`crate::graph`]) are that stream's capture
//! (`cuStreamBeginCapture` in thread-local mode, instantiated at its end) and replay
//! (`cuGraphLaunch`), run on an H100 by `kvserve bench --backend cuda` (scripts/gpu_check.sh).
//!
//! Every cudarc call is preceded by `is_culib_present()` checks in [`CudarcDevice::new`]
//! (cudarc's loader panics when a library is missing): no driver and no device are typed
//! [`CudaError`]s, never panics. cuBLAS is optional: when libcublas loads and a handle opens
//! on the device's stream, [`Device::blas`] offers it for GEMMs ([`crate::gemm`]); otherwise
//! it says why not and the backend uses its own kernel.

use std::fmt;
use std::sync::Arc;

use attention::{AttentionError, Result};
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    sys as driver_sys, CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr,
    DriverError, PushKernelArg,
};

use crate::device::{check_range, Device, KernelArg, LaunchConfig};
use crate::gemm::{GemmArgs, GemmInputs, Op};
use crate::kernel_cache::KernelCache;
use crate::nvrtc;
use crate::specs::Spec;

/// Why no CUDA device could be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// libcuda (the driver) could not be loaded.
    NoDriver,
    /// The driver loaded but reports no device with this ordinal (`count` devices).
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// libnvrtc could not be loaded (kernels are compiled at run time).
    NoNvrtc(String),
    /// A driver call failed.
    Driver(String),
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::NoDriver => write!(f, "no CUDA driver (libcuda could not be loaded)"),
            CudaError::NoDevice { ordinal, count } => {
                write!(f, "no CUDA device {ordinal} (the driver reports {count})")
            }
            CudaError::NoNvrtc(why) => write!(f, "{why}"),
            CudaError::Driver(e) => write!(f, "CUDA driver error: {e}"),
        }
    }
}

impl std::error::Error for CudaError {}

fn driver(e: DriverError) -> AttentionError {
    let oom = e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
    AttentionError::Device(if oom {
        format!("out of device memory ({e})")
    } else {
        e.to_string()
    })
}

/// What [`CudarcDevice::probe`] found: the device's name, compute capability and memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaReport {
    /// The device's name as the driver reports it.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_bytes: usize,
}

impl fmt::Display for CudaReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "{} (compute capability {major}.{minor}, {:.1} GiB)",
            self.name,
            self.total_bytes as f64 / (1u64 << 30) as f64
        )
    }
}

/// An NVIDIA GPU (see the [module docs](self)).
pub struct CudarcDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    report: CudaReport,
    functions: KernelCache<CudaFunction>,
    /// Multiprocessors of the device.
    sm_count: usize,
    /// cuBLAS on `stream`, or why it is not available.
    blas: std::result::Result<CudaBlas, String>,
}

/// cuBLAS on `stream` when libcublas loads and a handle opens, or why not.
fn open_cublas(stream: &Arc<CudaStream>) -> std::result::Result<CudaBlas, String> {
    // SAFETY: only tries to dlopen libcublas by its candidate names; no other state.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err("libcublas could not be loaded".into());
    }
    CudaBlas::new(Arc::clone(stream)).map_err(|e| format!("cuBLAS did not initialise: {e}"))
}

impl fmt::Debug for CudarcDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudarcDevice")
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

impl CudarcDevice {
    /// Opens device `ordinal`, or says why it cannot (no driver, no such device, no NVRTC).
    pub fn new(ordinal: usize) -> std::result::Result<CudarcDevice, CudaError> {
        // SAFETY: only tries to dlopen libcuda by its candidate names; no other state.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        nvrtc::available().map_err(CudaError::NoNvrtc)?;
        let err = |e: DriverError| CudaError::Driver(e.to_string());
        let count = CudaContext::device_count().map_err(err)?.max(0) as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        let (major, minor) = ctx.compute_capability().map_err(err)?;
        let report = CudaReport {
            name: ctx.name().map_err(err)?,
            compute_capability: (major, minor),
            total_bytes: ctx.total_mem().map_err(err)?,
        };
        // SAFETY: the device submits all its work to the one stream below, so cudarc's
        // cross-stream events (recorded on every buffer use otherwise, also inside captures)
        // order nothing that the stream does not already order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(err)?;
        let sm_count = ctx
            .attribute(driver_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(err)?
            .max(1) as usize;
        Ok(CudarcDevice {
            sm_count,
            blas: open_cublas(&stream),
            stream,
            ctx,
            arch: format!("compute_{major}{minor}"),
            report,
            functions: KernelCache::default(),
        })
    }

    /// What the device is.
    pub fn report(&self) -> &CudaReport {
        &self.report
    }

    fn function(&self, spec: &Spec, kernel: &str) -> Result<CudaFunction> {
        self.functions.get_or_load(spec, kernel, |names| {
            let ptx = nvrtc::compile(spec, &self.arch).map_err(AttentionError::Device)?;
            let module = self.ctx.load_module(ptx).map_err(driver)?;
            names
                .iter()
                .map(|k| module.load_function(k).map_err(driver))
                .collect()
        })
    }
}

/// A captured and instantiated CUDA graph of the device's stream.
pub struct CudarcGraph(std::sync::Mutex<CudaGraph>);

// SAFETY: a CUgraphExec may be launched from any thread (cudarc binds the context first); the
// driver requires that one graph is not used by two threads at once, which the mutex ensures.
unsafe impl Send for CudarcGraph {}
// SAFETY: as above: every use goes through the mutex.
unsafe impl Sync for CudarcGraph {}

impl Device for CudarcDevice {
    type Buffer = CudaSlice<u8>;
    type Graph = CudarcGraph;

    fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver)
    }

    fn end_capture(&self) -> Result<CudarcGraph> {
        match self
            .stream
            .end_capture(driver_sys::CUgraphInstantiate_flags(0))
            .map_err(driver)?
        {
            Some(graph) => Ok(CudarcGraph(std::sync::Mutex::new(graph))),
            None => Err(AttentionError::Device(
                "the capture was invalidated (an operation a capture refuses ran inside it)".into(),
            )),
        }
    }

    unsafe fn replay(&self, graph: &CudarcGraph) -> Result<()> {
        let graph = graph.0.lock().unwrap_or_else(|e| e.into_inner());
        graph.launch().map_err(driver)
    }

    fn name(&self) -> &str {
        "cuda"
    }

    fn tensor_cores(&self) -> bool {
        self.report.compute_capability.0 >= 8
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(driver)
    }

    fn alloc_uninit(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: the bytes are device memory, reached only by kernels and copies, never as
        // Rust values, and every u8 pattern is valid. The backend takes such buffers only for
        // what it overwrites whole before reading: the emulated device fills them with 0xff
        // (f32 NaN), so a kernel that leaves an output element unwritten fails its tests.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(driver)
    }

    fn write(&self, dst: &mut CudaSlice<u8>, offset: usize, src: &[u8]) -> Result<()> {
        check_range("write", dst.len(), offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(offset..offset + src.len());
        self.stream.memcpy_htod(src, &mut view).map_err(driver)
    }

    fn read(&self, src: &CudaSlice<u8>, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("read", src.len(), offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let view = src.slice(offset..offset + dst.len());
        self.stream.memcpy_dtoh(&view, dst).map_err(driver)?;
        self.stream.synchronize().map_err(driver)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver)
    }

    fn len(&self, buf: &CudaSlice<u8>) -> usize {
        buf.len()
    }

    fn address(&self, buf: &CudaSlice<u8>) -> usize {
        let (ptr, _sync) = buf.device_ptr(&self.stream);
        ptr as usize
    }

    fn launch(
        &self,
        spec: &Spec,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, CudaSlice<u8>>],
    ) -> Result<()> {
        let func = self.function(spec, kernel)?;
        let mut builder = self.stream.launch_builder(&func);
        for arg in args {
            match arg {
                KernelArg::Buf(b) => builder.arg(*b),
                KernelArg::U32(x) => builder.arg(x),
                KernelArg::F32(x) => builder.arg(x),
            };
        }
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (cfg.grid[0], cfg.grid[1], cfg.grid[2]),
            block_dim: (cfg.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel's parameters are, in order, the arguments the backend passes
        // (device pointers to buffers it sized for the launch, u32 and f32 scalars; the CPU
        // emulation checks the count against the same sources). Buffers dropped before the
        // kernel ends are freed stream-ordered by cudarc (after it), and the scalars are copied
        // into the launch when it is queued.
        unsafe { builder.launch(cfg) }.map_err(driver)?;
        Ok(())
    }

    fn wave_blocks(&self, spec: &Spec, kernel: &str, block: u32) -> Result<Option<usize>> {
        let func = self.function(spec, kernel)?;
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(block, 0, None)
            .map_err(driver)?;
        Ok(Some(per_sm as usize * self.sm_count))
    }

    fn memory_info(&self) -> Result<Option<attention::DeviceMemory>> {
        let (free, total) = self.ctx.mem_get_info().map_err(driver)?;
        Ok(Some(attention::DeviceMemory {
            free_bytes: free as u64,
            total_bytes: total as u64,
        }))
    }

    fn blas(&self) -> std::result::Result<&str, String> {
        self.blas.as_ref().map(|_| "cuBLAS").map_err(Clone::clone)
    }

    fn blas_gemm(
        &self,
        args: &GemmArgs,
        inputs: GemmInputs,
        w: &CudaSlice<u8>,
        x: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let blas = self
            .blas
            .as_ref()
            .map_err(|e| AttentionError::Device(e.clone()))?;
        args.check_bytes(inputs, w.len(), x.len(), out.len())
            .map_err(AttentionError::Device)?;
        let op = |o: Op| match o {
            Op::N => cublasOperation_t::CUBLAS_OP_N,
            Op::T => cublasOperation_t::CUBLAS_OP_T,
        };
        let (a_len, b_len, c_len) = args.elems();
        let short = || AttentionError::Device("gemm: a buffer is shorter than its view".into());
        // SAFETY: cuMemAlloc aligns every buffer to 256 bytes, and check_bytes verified that
        // each holds the elements viewed (of the input type for A and B, f32 for C).
        let mut c = unsafe { out.transmute_mut::<f32>(c_len) }.ok_or_else(short)?;
        match inputs {
            GemmInputs::F32 => {
                // SAFETY: as above: the backend wrote f32 tensors into `w` and `x`.
                let (a, b) = unsafe { (w.transmute::<f32>(a_len), x.transmute::<f32>(b_len)) };
                let (a, b) = (a.ok_or_else(short)?, b.ok_or_else(short)?);
                let cfg = GemmConfig {
                    transa: op(args.transa),
                    transb: op(args.transb),
                    m: args.m,
                    n: args.n,
                    k: args.k,
                    alpha: 1.0f32,
                    lda: args.lda,
                    ldb: args.ldb,
                    beta: 0.0f32,
                    ldc: args.ldc,
                };
                // SAFETY: `args` come from `gemm::gemm_args`, whose mapping the host GEMM
                // (`gemm::gemm_host`) checks, and the views hold every element those
                // dimensions and leading dimensions reach (check_bytes); the call is queued
                // on the device's stream.
                unsafe { blas.gemm(cfg, &a, &b, &mut c) }
                    .map_err(|e| AttentionError::Device(format!("cuBLAS sgemm: {e}")))
            }
            GemmInputs::Bf16 => {
                use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
                use cudarc::driver::{DevicePtr, DevicePtrMut};
                let (alpha, beta) = (1.0f32, 0.0f32);
                let (a, _record_a) = w.device_ptr(&self.stream);
                let (b, _record_b) = x.device_ptr(&self.stream);
                let (c, _record_c) = c.device_ptr_mut(&self.stream);
                // SAFETY: A and B hold bf16 bit patterns the backend wrote (`upload_weight`,
                // `round_bf16`) and C room for the f32 output, each at least the bytes the
                // dimensions and leading dimensions reach (check_bytes); alpha and beta are
                // host f32 scalars (the handle's default pointer mode, CUBLAS_COMPUTE_32F's
                // scale type) that outlive the call, which is queued on the device's stream.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *blas.handle(),
                        op(args.transa),
                        op(args.transb),
                        args.m,
                        args.n,
                        args.k,
                        (&alpha) as *const f32 as *const _,
                        a as *const _,
                        cudaDataType_t::CUDA_R_16BF,
                        args.lda,
                        b as *const _,
                        cudaDataType_t::CUDA_R_16BF,
                        args.ldb,
                        (&beta) as *const f32 as *const _,
                        c as *mut _,
                        cudaDataType_t::CUDA_R_32F,
                        args.ldc,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| AttentionError::Device(format!("cuBLAS bf16 gemm: {e}")))
            }
        }
    }
}
