//! What the engine keeps of the controller: [`ControllerHandle`], which starts the queued
//! load-backs before a forward pass, and the [`LoadGate`] that pass waits on layer by layer.

use std::sync::Arc;

use kv_pool::LayerWait;

use super::io::LoadProgress;
use super::Shared;

/// A handle on a [`HiCacheController`](super::HiCacheController) for the engine's executor
/// (the controller itself lives in the cache): cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct ControllerHandle {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for ControllerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerHandle").finish_non_exhaustive()
    }
}

impl ControllerHandle {
    /// Starts the load-backs queued since the last start (merged into one batch, copied layer
    /// by layer) and returns the gate the next forward pass waits on: it covers every load
    /// queued so far. Call it once before each forward pass.
    pub fn start_loads(&self) -> LoadGate {
        LoadGate {
            progress: self.shared.io.start_loads(self.shared.layers),
        }
    }

    /// Stops the IO thread after the batches already handed to it and returns once it has
    /// stopped: from then on nothing touches the device store's memory, which may be freed.
    /// The owner of the store calls it before dropping the store (the controller itself may
    /// live longer, in the cache); operations queued afterwards are never run.
    pub fn stop_io(&self) {
        self.shared.io.flush_writes();
        self.shared.io.stop_and_wait();
    }
}

/// What a forward pass waits on while load-backs land (SGLang's `LayerDoneCounter`):
/// [`wait_layer`](LayerWait::wait_layer)`(i)` returns once layer `i` of every load started so
/// far is on the device; `Err` when a load of the batch was refused (the pass must fail).
#[derive(Debug, Clone, Default)]
pub struct LoadGate {
    progress: Option<Arc<LoadProgress>>,
}

impl LoadGate {
    /// A gate that never waits (no loads).
    pub fn open() -> Self {
        Self::default()
    }
}

impl LayerWait for LoadGate {
    fn wait_layer(&self, layer: usize) -> Result<(), String> {
        match &self.progress {
            None => Ok(()),
            Some(p) => p.wait_layer(layer),
        }
    }
}
