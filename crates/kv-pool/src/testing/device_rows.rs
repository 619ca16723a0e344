//! [`LockedStoreRows`]: a [`DeviceKvRows`] over any [`KvStore`] behind a mutex, so tests can run
//! a cache controller's handle path (the one a wgpu store takes) on the host, and hold the
//! store to read it back; [`check_device_rows`]: the checks every device store's rows handle
//! passes (wgpu's, CUDA's).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::Result;
use crate::ids::Slot;
use crate::layout::{KvBuffer, KvLayout};
use crate::rng::SplitMix64;
use crate::store::{HostKvStore, KvStore};
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

/// The checks of a device store's rows handle `rows` (over `dev`, a fresh store of at least 64
/// slots and 2 layers) against a [`HostKvStore`] of the same layout: rows written and read
/// through handle clones on other threads are the host store's bytes for every layer and
/// buffer (repeated slots: the last write wins); the store sees the handle's writes and the
/// handle the store's; bad input (a slot or layer out of range, a short buffer) gets the host
/// store's error and writes nothing; the handle keeps the buffers after `dev` is dropped.
/// Panics on the first failure, naming the shape.
pub fn check_device_rows<S, R>(mut dev: S, rows: R, seed: u64)
where
    S: KvStore,
    R: DeviceKvRows + Clone + 'static,
{
    let layout = *dev.layout();
    let shape = layout.shape;
    assert_eq!(rows.layout(), &layout, "{shape}: the handle's layout");
    let mut host = HostKvStore::new(layout).expect("the device store's layout");
    let mut rng = SplitMix64::new(seed);
    let mut bytes = |n: usize| (0..n).map(|_| rng.next_u64() as u8).collect::<Vec<u8>>();
    let slots = |ids: &[u32]| ids.iter().map(|&s| Slot(s)).collect::<Vec<_>>();
    let dump = |s: &dyn KvStore| super::dump_store(s).expect("dump");
    for layer in 0..shape.layers as usize {
        for &b in shape.buffers() {
            let s = slots(&[5, 6, 9, 5, 62, 1]);
            let raw = bytes(s.len() * shape.row_bytes(b));
            host.write_raw(layer, b, &s, &raw).unwrap();
            let (handle, s2) = (rows.clone(), s.clone());
            std::thread::spawn(move || handle.write_rows(layer, b, &s2, &raw).unwrap())
                .join()
                .unwrap();
            let mut want = vec![0u8; s.len() * shape.row_bytes(b)];
            host.read_raw(layer, b, &s, &mut want).unwrap();
            let handle = rows.clone();
            let got = std::thread::spawn(move || {
                let mut got = vec![0u8; s.len() * shape.row_bytes(b)];
                handle.read_rows(layer, b, &s, &mut got).unwrap();
                got
            })
            .join()
            .unwrap();
            assert!(got == want, "{shape} layer {layer} {}", b.name());
        }
    }
    assert!(
        dump(&host) == dump(&dev),
        "{shape}: the store sees the handle's writes"
    );
    let rb = shape.row_bytes(KvBuffer::Key);
    let s = slots(&[7, 8]);
    let raw = bytes(2 * rb);
    dev.write_raw(1, KvBuffer::Key, &s, &raw).unwrap();
    host.write_raw(1, KvBuffer::Key, &s, &raw).unwrap();
    let mut got = vec![0u8; raw.len()];
    rows.read_rows(1, KvBuffer::Key, &s, &mut got).unwrap();
    assert_eq!(got, raw, "{shape}: the handle sees the store's writes");
    let before = dump(&dev);
    let bad = slots(&[1, 1000]);
    let refused = rows.write_rows(0, KvBuffer::Key, &bad, &vec![0; 2 * rb]);
    assert!(refused.is_err(), "{shape}: a slot out of range");
    assert_eq!(
        refused,
        host.write_raw(0, KvBuffer::Key, &bad, &vec![0; 2 * rb])
    );
    assert_eq!(
        rows.read_rows(9, KvBuffer::Key, &slots(&[1]), &mut vec![0; rb]),
        host.read_raw(9, KvBuffer::Key, &slots(&[1]), &mut vec![0; rb])
    );
    assert!(rows
        .write_rows(0, KvBuffer::Key, &slots(&[1]), &[1, 2])
        .is_err());
    assert!(
        dump(&dev) == before,
        "{shape}: a refused write changed the store"
    );
    drop(dev);
    let mut got = vec![0u8; rb];
    rows.read_rows(0, KvBuffer::Key, &slots(&[5]), &mut got)
        .unwrap();
    let mut want = vec![0u8; rb];
    host.read_raw(0, KvBuffer::Key, &slots(&[5]), &mut want)
        .unwrap();
    assert_eq!(got, want, "{shape}: the handle outlives the store");
}
