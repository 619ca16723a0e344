//! [`CudarcDevice`]: the [`Device`] on an NVIDIA GPU through cudarc (dynamically loaded
//! libcuda and libnvrtc). Kernels are compiled by NVRTC for the GPU's compute capability the
//! first time a specialisation is launched, and their modules cached. All work goes to one
//! stream, so launches and copies run in order; reads wait for it.
//!
//! Every cudarc call is preceded by `is_culib_present()` checks in [`CudarcDevice::new`]
//! (cudarc's loader panics when a library is missing): no driver and no device are typed
//! [`CudaError`]s, never panics.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use attention::{AttentionError, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, PushKernelArg,
};

use crate::device::{Device, KernelArg, LaunchConfig};
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
    functions: Mutex<HashMap<(String, String), CudaFunction>>,
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
        Ok(CudarcDevice {
            stream: ctx.default_stream(),
            ctx,
            arch: format!("compute_{major}{minor}"),
            report,
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// What the device is.
    pub fn report(&self) -> &CudaReport {
        &self.report
    }

    fn function(&self, spec: &Spec, kernel: &str) -> Result<CudaFunction> {
        let key = (spec.name(), kernel.to_string());
        let mut cache = self
            .functions
            .lock()
            .map_err(|_| AttentionError::Device("kernel cache poisoned".into()))?;
        if let Some(f) = cache.get(&key) {
            return Ok(f.clone());
        }
        let ptx = nvrtc::compile(spec, &self.arch).map_err(AttentionError::Device)?;
        let module = self.ctx.load_module(ptx).map_err(driver)?;
        for k in spec.source.kernels() {
            let f = module.load_function(k).map_err(driver)?;
            cache.insert((key.0.clone(), k.to_string()), f);
        }
        cache
            .get(&key)
            .cloned()
            .ok_or_else(|| AttentionError::Device(format!("{} has no kernel {kernel}", key.0)))
    }
}

fn range(what: &'static str, len: usize, offset: usize, n: usize) -> Result<()> {
    if offset.checked_add(n).is_none_or(|end| end > len) {
        return Err(AttentionError::Device(format!(
            "{what}: {n} bytes at offset {offset} overrun a buffer of {len}"
        )));
    }
    Ok(())
}

impl Device for CudarcDevice {
    type Buffer = CudaSlice<u8>;

    fn name(&self) -> &str {
        "cuda"
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(driver)
    }

    fn write(&self, dst: &mut CudaSlice<u8>, offset: usize, src: &[u8]) -> Result<()> {
        range("write", dst.len(), offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(offset..offset + src.len());
        self.stream.memcpy_htod(src, &mut view).map_err(driver)
    }

    fn read(&self, src: &CudaSlice<u8>, offset: usize, dst: &mut [u8]) -> Result<()> {
        range("read", src.len(), offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let view = src.slice(offset..offset + dst.len());
        self.stream.memcpy_dtoh(&view, dst).map_err(driver)?;
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
}
