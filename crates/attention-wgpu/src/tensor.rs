//! Device tensors: a wgpu storage buffer of f32 values with a shape.

use std::fmt;
use std::sync::Arc;

use attention::{AttentionError, DeviceTensor, Result, TensorDtype};

use crate::device::WgpuError;
use crate::dispatch::Runner;

/// A row-major f32 tensor in a device buffer. Cloning shares the buffer; [`reshape`] keeps it.
///
/// [`reshape`]: attention::Backend::reshape
#[derive(Clone)]
pub struct WgpuTensor {
    pub(crate) buf: Arc<wgpu::Buffer>,
    pub(crate) shape: Vec<usize>,
}

impl fmt::Debug for WgpuTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuTensor")
            .field("shape", &self.shape)
            .field("bytes", &self.buf.size())
            .finish()
    }
}

impl DeviceTensor for WgpuTensor {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> TensorDtype {
        TensorDtype::F32
    }
}

impl WgpuTensor {
    /// The device buffer (at least 4 bytes; `numel × 4` of them hold the data).
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buf
    }

    /// Bytes of data (`numel × 4`).
    pub fn data_bytes(&self) -> u64 {
        self.numel() as u64 * 4
    }
}

/// Bytes of an f32 tensor of `shape`, checked against the adapter's single-binding limit
/// (kernels bind a tensor whole).
fn tensor_bytes(runner: &Runner, shape: &[usize]) -> Result<u64> {
    let bytes = shape
        .iter()
        .try_fold(4u64, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| AttentionError::InvalidConfig {
            field: "shape",
            reason: format!("{shape:?} overflows"),
        })?;
    // The adapter's limit (not the KV store's configurable split size), kept under the 4 GiB
    // the kernels' u32 indices reach.
    let limit = runner
        .gpu
        .limits
        .max_storage_buffer_binding_size
        .min(u64::from(u32::MAX));
    if bytes > limit {
        return Err(WgpuError::TooLarge {
            what: "tensor",
            bytes,
            limit,
            limit_name: "max_storage_buffer_binding_size",
        }
        .into());
    }
    Ok(bytes)
}

/// A zeroed tensor of `shape`.
pub(crate) fn zeros(runner: &Runner, shape: &[usize]) -> Result<WgpuTensor> {
    let bytes = tensor_bytes(runner, shape)?;
    Ok(WgpuTensor {
        buf: Arc::new(runner.alloc("tensor", bytes)?),
        shape: shape.to_vec(),
    })
}

/// A tensor holding `data` (whose length must match `shape`).
pub(crate) fn from_host(runner: &Runner, data: &[f32], shape: &[usize]) -> Result<WgpuTensor> {
    let expected: usize = shape.iter().product();
    if expected != data.len() {
        return Err(AttentionError::LengthMismatch {
            what: "tensor data",
            expected,
            got: data.len(),
        });
    }
    tensor_bytes(runner, shape)?;
    Ok(WgpuTensor {
        buf: Arc::new(runner.upload_bytes("tensor", bytemuck::cast_slice(data))?),
        shape: shape.to_vec(),
    })
}
