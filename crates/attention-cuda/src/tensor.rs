//! [`CudaTensor`]: a tensor in device memory (a buffer of the backend's [`Device`]): f32, or a
//! weight kept in 16 bits.

use std::fmt;
use std::sync::Arc;

use attention::{DeviceTensor, TensorDtype};

use crate::device::Device;

/// A row-major tensor in a device buffer of `D` (shared with a CUDA graph's pool when the
/// graph's ops made it: [`crate::graph`]): f32 elements, or the bit patterns of a 16-bit weight
/// ([`attention::Backend::upload_weight`]).
pub struct CudaTensor<D: Device> {
    pub(crate) buf: Arc<D::Buffer>,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: TensorDtype,
}

impl<D: Device> fmt::Debug for CudaTensor<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaTensor")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl<D: Device> DeviceTensor for CudaTensor<D> {
    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn dtype(&self) -> TensorDtype {
        self.dtype
    }
}
