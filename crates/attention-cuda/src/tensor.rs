//! [`CudaTensor`]: an f32 tensor in device memory (a buffer of the backend's [`Device`]).

use std::fmt;
use std::sync::Arc;

use attention::{DeviceTensor, TensorDtype};

use crate::device::Device;

/// A row-major f32 tensor in a device buffer of `D` (shared with a CUDA graph's pool when the
/// graph's ops made it: [`crate::graph`]).
pub struct CudaTensor<D: Device> {
    pub(crate) buf: Arc<D::Buffer>,
    pub(crate) shape: Vec<usize>,
}

impl<D: Device> fmt::Debug for CudaTensor<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaTensor")
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl<D: Device> DeviceTensor for CudaTensor<D> {
    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn dtype(&self) -> TensorDtype {
        TensorDtype::F32
    }
}
