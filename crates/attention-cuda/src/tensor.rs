//! [`CudaTensor`]: an f32 tensor in device memory (a buffer of the backend's [`Device`]).

use std::fmt;

use attention::{DeviceTensor, TensorDtype};

use crate::device::Device;

/// A row-major f32 tensor in a device buffer of `D`.
pub struct CudaTensor<D: Device> {
    pub(crate) buf: D::Buffer,
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
