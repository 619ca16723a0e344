//! PD from a device KV store: [`KvHostMirror`], a host copy of a device store's layout that the
//! transfer engines register and move, with the pages staged across as they are sent or land.
//!
//! The transfer engines (`tcp`, `shm`, NIXL) read and write host memory at page offsets of a
//! store's regions. A `wgpu`, `cuda` or `rocm` store keeps its KV on the device, so a PD server
//! on one of them registers a mirror instead: a [`HostKvStore`] of the same layout (same page
//! ids, same region offsets, so the pair's compatibility check and the page lists are the same
//! as on the `cpu` backend), which it keeps current only where a transfer needs it:
//!
//! - prefill: [`KvHostMirror::to_host`] copies the pages a step sends from the device just
//!   before they are sent (after the forward pass that computed them; the rows handle's read
//!   waits for it), every sending request's in one call;
//! - decode: once transfers have succeeded, [`KvHostMirror::to_device`] copies their pages to
//!   the device ahead of the requests' first decode pass (the rows handle queues the copy
//!   before any later work), every arrived request's in one call.
//!
//! Both go through the store's [`DeviceKvRows`] handle (HiCache's path): one read or write per
//! layer and buffer of all the pages' rows. The mirror costs host memory equal to the device
//! store's size. A page shared by two requests' transfers (a prefix both send) is copied again
//! with the same bytes. A decode server on the `shm` backend keeps its mirror in a shared
//! mapping, as the `cpu` backend keeps its store.

use std::sync::Arc;

use kv_pool::store::check;
use kv_pool::{
    DeviceKvRows, HostKvStore, HostMemory, KvLayout, KvStore, MemoryRegion, Page, Result, Slot,
};

/// Which way [`KvHostMirror::copy`] moves pages.
#[derive(Clone, Copy)]
enum Direction {
    ToHost,
    ToDevice,
}

/// A host copy of a device KV store's layout for PD transfers (see the module docs).
pub struct KvHostMirror {
    host: HostKvStore,
    rows: Arc<dyn DeviceKvRows>,
    /// Staging bytes for one layer's buffer, reused across calls.
    staging: Vec<u8>,
}

impl std::fmt::Debug for KvHostMirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvHostMirror")
            .field("layout", self.host.layout())
            .field("shared", &self.host.is_foreign_memory())
            .finish()
    }
}

impl KvHostMirror {
    /// A zeroed mirror of the store behind `rows`, in its own heap memory or in `memory` (a
    /// shared mapping). Memory that cannot be reserved is `HostOutOfMemory`.
    pub fn new(rows: Arc<dyn DeviceKvRows>, memory: Option<Box<dyn HostMemory>>) -> Result<Self> {
        let layout = *rows.layout();
        let host = match memory {
            None => HostKvStore::new(layout)?,
            Some(mem) => HostKvStore::with_memory(layout, mem)?,
        };
        Ok(KvHostMirror {
            host,
            rows,
            staging: Vec::new(),
        })
    }

    /// The layout (the device store's).
    pub fn layout(&self) -> &KvLayout {
        self.host.layout()
    }

    /// The mirror's buffers, for registration with a transfer engine.
    pub fn memory_regions(&self) -> Vec<MemoryRegion> {
        self.host.memory_regions()
    }

    /// The mirror itself (tests read what was staged).
    pub fn host(&self) -> &HostKvStore {
        &self.host
    }

    /// Copies `pages` (every layer and buffer) from the device into the mirror. A page out of
    /// range (or the padding page) is refused before anything is copied.
    pub fn to_host(&mut self, pages: &[Page]) -> Result<()> {
        self.copy(pages, Direction::ToHost)
    }

    /// Copies `pages` (every layer and buffer) from the mirror to the device. A page out of
    /// range (or the padding page) is refused before anything is copied.
    pub fn to_device(&mut self, pages: &[Page]) -> Result<()> {
        self.copy(pages, Direction::ToDevice)
    }

    /// One read and one write of all the pages' rows per layer and buffer, staged through
    /// `self.staging`.
    fn copy(&mut self, pages: &[Page], dir: Direction) -> Result<()> {
        let slots = self.slots_of(pages)?;
        if slots.is_empty() {
            return Ok(());
        }
        let layout = *self.host.layout();
        for layer in 0..layout.shape.layers as usize {
            for &buffer in layout.shape.buffers() {
                let bytes = slots.len() * layout.shape.row_bytes(buffer);
                self.staging.resize(bytes, 0);
                let stage = &mut self.staging;
                match dir {
                    Direction::ToHost => {
                        self.rows.read_rows(layer, buffer, &slots, stage)?;
                        self.host.write_raw(layer, buffer, &slots, stage)?;
                    }
                    Direction::ToDevice => {
                        self.host.read_raw(layer, buffer, &slots, stage)?;
                        self.rows.write_rows(layer, buffer, &slots, stage)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The slots of `pages`, in page order, after checking every page is in range.
    fn slots_of(&self, pages: &[Page]) -> Result<Vec<Slot>> {
        let layout = self.host.layout();
        check::pages(layout, pages)?;
        let p = layout.page_size;
        Ok(pages.iter().flat_map(|page| page.slots(p)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_pool::testing::LockedStoreRows;
    use kv_pool::{KvDtype, KvPoolError, KvShape, SplitMix64};

    fn layout(shape: KvShape) -> KvLayout {
        KvLayout::new(shape, 4, 64).unwrap()
    }

    fn shapes() -> [KvShape; 3] {
        [
            KvShape::mha(2, 8, 8, 3, KvDtype::Bf16).unwrap(),
            KvShape::mla(16, 4, 2, KvDtype::Fp8E4m3).unwrap(),
            KvShape::double_sparse(2, 8, 8, 2, 2, KvDtype::F16).unwrap(),
        ]
    }

    /// A device store of random bytes behind a rows handle.
    fn device(layout: KvLayout, seed: u64) -> LockedStoreRows<HostKvStore> {
        let mut store = HostKvStore::new(layout).unwrap();
        let mut rng = SplitMix64::new(seed);
        let slots: Vec<Slot> = (0..layout.rows() as u32).map(Slot).collect();
        for layer in 0..layout.shape.layers as usize {
            for &b in layout.shape.buffers() {
                let bytes: Vec<u8> = (0..slots.len() * layout.shape.row_bytes(b))
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                store.write_raw(layer, b, &slots, &bytes).unwrap();
            }
        }
        LockedStoreRows::new(store)
    }

    fn pages_bytes(store: &dyn KvStore, pages: &[Page]) -> Vec<u8> {
        let mut out = vec![0; pages.len() * store.layout().page_bytes()];
        store.read_pages(pages, &mut out).unwrap();
        out
    }

    #[test]
    fn to_host_copies_exactly_the_pages_and_to_device_puts_them_back() {
        for shape in shapes() {
            let l = layout(shape);
            let dev = device(l, 7);
            let mut mirror = KvHostMirror::new(Arc::new(dev.clone()), None).unwrap();
            let sent = [Page(3), Page(1), Page(9)];
            mirror.to_host(&sent).unwrap();
            assert_eq!(
                pages_bytes(mirror.host(), &sent),
                pages_bytes(&*dev.store(), &sent),
                "{shape:?}"
            );
            // Pages not staged stay zero in the mirror.
            let zero = pages_bytes(mirror.host(), &[Page(2)]);
            assert!(zero.iter().all(|&b| b == 0), "{shape:?}");

            // A decode side: another device's pages 5 and 6 land from the mirror, the rest of
            // that device is unchanged.
            let other = device(l, 8);
            let before = pages_bytes(&*other.store(), &[Page(2), Page(7)]);
            let mut landing = KvHostMirror::new(Arc::new(other.clone()), None).unwrap();
            let payload = pages_bytes(&*dev.store(), &[Page(3), Page(1)]);
            landing
                .host
                .write_pages(&[Page(5), Page(6)], &payload)
                .unwrap();
            landing.to_device(&[Page(5), Page(6)]).unwrap();
            assert_eq!(pages_bytes(&*other.store(), &[Page(5), Page(6)]), payload);
            assert_eq!(pages_bytes(&*other.store(), &[Page(2), Page(7)]), before);
        }
    }

    #[test]
    fn bad_pages_are_refused_and_nothing_is_copied() {
        let l = layout(shapes()[0]);
        let dev = device(l, 9);
        let mut mirror = KvHostMirror::new(Arc::new(dev.clone()), None).unwrap();
        let before = pages_bytes(&*dev.store(), &[Page(1)]);
        for bad in [Page(0), Page(l.pages() as u32 + 1)] {
            let e = mirror.to_host(&[Page(1), bad]).unwrap_err();
            assert!(matches!(e, KvPoolError::PageOutOfRange { .. }), "{e}");
            let e = mirror.to_device(&[Page(1), bad]).unwrap_err();
            assert!(matches!(e, KvPoolError::PageOutOfRange { .. }), "{e}");
        }
        assert!(pages_bytes(mirror.host(), &[Page(1)])
            .iter()
            .all(|&b| b == 0));
        assert_eq!(pages_bytes(&*dev.store(), &[Page(1)]), before);
        // Nothing to move is not an error.
        mirror.to_host(&[]).unwrap();
        mirror.to_device(&[]).unwrap();
    }

    /// What a transfer engine relies on: page `p` of a staged request lies at `addr + p ×
    /// item_len` of each registered region, holding that layer's buffer rows of the page as the
    /// device has them.
    #[test]
    fn registered_regions_hold_the_staged_pages_at_their_offsets() {
        for shape in shapes() {
            let l = layout(shape);
            let dev = device(l, 3);
            let mut mirror = KvHostMirror::new(Arc::new(dev.clone()), None).unwrap();
            let staged = [Page(4), Page(11)];
            mirror.to_host(&staged).unwrap();
            let regions = mirror.memory_regions();
            assert_eq!(
                regions.len(),
                l.shape.layers as usize * l.shape.buffers().len()
            );
            for r in &regions {
                for page in staged {
                    let slots: Vec<Slot> = page.slots(l.page_size).collect();
                    let mut want = vec![0u8; r.item_len];
                    dev.store()
                        .read_raw(r.layer, r.buffer, &slots, &mut want)
                        .unwrap();
                    assert!(page.index() * r.item_len + r.item_len <= r.len_bytes);
                    // SAFETY: the region is the mirror's buffer of `len_bytes` bytes (checked
                    // in range just above), alive while `mirror` is, and nothing writes it now.
                    let got = unsafe {
                        std::slice::from_raw_parts(
                            (r.addr + page.index() * r.item_len) as *const u8,
                            r.item_len,
                        )
                    };
                    assert_eq!(got, &want[..], "{shape:?} {:?} layer {}", r.buffer, r.layer);
                }
            }
        }
    }
}
