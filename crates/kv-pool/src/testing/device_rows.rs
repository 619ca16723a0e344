//! [`LockedStoreRows`]: a [`DeviceKvRows`] over any [`KvStore`] behind a mutex, so tests can run
//! a cache controller's handle path (the one a wgpu store takes) on the host, and hold the
//! store to read it back.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::Result;
use crate::ids::Slot;
use crate::layout::{KvBuffer, KvLayout};
use crate::store::KvStore;
use crate::tier::DeviceKvRows;

/// A [`DeviceKvRows`] over a shared `S`: `read_rows` is `read_raw`, `write_rows` is `write_raw`,
/// each under the lock. Clones share the store.
#[derive(Debug)]
pub struct LockedStoreRows<S> {
    store: Arc<Mutex<S>>,
    layout: KvLayout,
}

impl<S> Clone for LockedStoreRows<S> {
    fn clone(&self) -> Self {
        LockedStoreRows {
            store: self.store.clone(),
            layout: self.layout,
        }
    }
}

impl<S: KvStore> LockedStoreRows<S> {
    /// Shares `store`.
    pub fn new(store: S) -> Self {
        let layout = *store.layout();
        LockedStoreRows {
            store: Arc::new(Mutex::new(store)),
            layout,
        }
    }

    /// The store, locked (a test reads or writes it between operations).
    pub fn store(&self) -> MutexGuard<'_, S> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<S: KvStore + Send> DeviceKvRows for LockedStoreRows<S> {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn read_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> Result<()> {
        self.store().read_raw(layer, buffer, slots, out)
    }

    fn write_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        self.store().write_raw(layer, buffer, slots, bytes)
    }
}
