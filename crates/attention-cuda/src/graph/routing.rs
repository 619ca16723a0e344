//! How the backend's ops reach the device: every allocation and upload of [`CudaBackend`]
//! (and, through `graph_slot`, its launches) goes through these methods, which send it to the installed
//! [`GraphPool`] during a graph's warmup, capture or feed pass ([`super`]) and straight to the
//! device otherwise.

use std::sync::Arc;

use attention::{AttentionError, Result};

use super::pool::{GraphPool, Phase};
use crate::backend::CudaBackend;
use crate::device::Device;

impl<D: Device> CudaBackend<D> {
    /// Moves `pool` into the backend, where its ops go through it; refused, `pool` left as
    /// it was, while another is installed (a second runner on a clone of this backend
    /// mid-pass).
    pub(crate) fn install_graph_pool(&self, pool: &mut GraphPool<D::Buffer>) -> Result<()> {
        let mut slot = self.graph_slot();
        if slot.is_some() {
            return Err(AttentionError::Device(
                "CUDA graph: another capture or replay is using this backend".into(),
            ));
        }
        *slot = Some(std::mem::take(pool));
        Ok(())
    }

    /// Removes the installed pool (the ops are eager again).
    pub(crate) fn take_graph_pool(&self) -> Option<GraphPool<D::Buffer>> {
        self.graph_slot().take()
    }

    /// The pool slot. A poisoned lock only means an op panicked while holding it; the slot
    /// itself (which pool is installed) is still whole.
    pub(crate) fn graph_slot(&self) -> std::sync::MutexGuard<'_, Option<GraphPool<D::Buffer>>> {
        self.graph.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The graph phase the ops run in, `None` when eager.
    pub(crate) fn graph_phase(&self) -> Option<Phase> {
        self.graph_slot().as_ref().map(GraphPool::phase)
    }

    /// A buffer holding `bytes` (a static input of `capacity` bytes under a graph pool).
    pub(crate) fn upload_bytes(&self, bytes: &[u8], capacity: usize) -> Result<Arc<D::Buffer>> {
        if let Some(pool) = self.graph_slot().as_mut() {
            return pool.upload(&*self.device, bytes, capacity);
        }
        let mut buf = self.device.alloc_uninit(bytes.len())?;
        self.device.write(&mut buf, 0, bytes)?;
        Ok(Arc::new(buf))
    }

    pub(crate) fn buffer_from(&self, bytes: &[u8]) -> Result<Arc<D::Buffer>> {
        self.upload_bytes(bytes, bytes.len())
    }

    /// `bytes` of device memory whose contents are unspecified, for what the caller's kernels
    /// overwrite whole: uninitialised when eager ([`Device::alloc_uninit`]), from the graph
    /// pool otherwise (holding what an earlier op left).
    pub(crate) fn alloc(&self, bytes: usize) -> Result<Arc<D::Buffer>> {
        if let Some(pool) = self.graph_slot().as_mut() {
            return pool.alloc(&*self.device, bytes);
        }
        Ok(Arc::new(self.device.alloc_uninit(bytes)?))
    }
}
