//! The host tier's KV memory (SGLang's `HostKVCache`, `mem_cache/memory_pool_host.py` and
//! `pool_host/`): [`HostKvPool`], one allocation of `(size + P) × slot_bytes` bytes in a
//! [`HostLayout`], and [`HostPoolSize`], SGLang's sizing of it.
//!
//! Host slots are numbered like device slots: page 0 (slots `0..P`) is padding, allocatable
//! slots are `P..size + P`, and a [`crate::PagedAllocator`] of `size` slots (owned by the
//! hierarchical cache, not by the pool) hands them out. The pool only holds bytes.
//!
//! Ways in and out:
//! - whole pages in the canonical packed page format of [`crate::store`]
//!   ([`read_pages`](HostKvPool::read_pages), [`write_pages`](HostKvPool::write_pages)), which
//!   is what an L3 store keeps;
//! - rows from and to a device [`KvStore`] through its safe `read_raw` / `write_raw`
//!   ([`copy_from_store`](HostKvPool::copy_from_store),
//!   [`copy_layer_to_store`](HostKvPool::copy_layer_to_store)), for any backend;
//! - raw addresses ([`as_mut_ptr`](HostKvPool::as_mut_ptr), [`row_offset`](HostKvPool::row_offset),
//!   [`contiguous_rows`](HostKvPool::contiguous_rows)) for a cache controller that copies
//!   between threads, and [`write_pages_shared`](HostKvPool::write_pages_shared) for its
//!   storage thread.
//!
//! Every safe method validates its whole input first (the checks of [`crate::store::check`],
//! so errors read as the store's): an `Err` leaves the pool unchanged.

mod layout;
mod size;

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

pub use layout::HostLayout;
pub use size::{HostPoolSize, HostPoolSizeInput, HOST_MEMORY_RESERVE_BYTES};

use crate::error::{KvPoolError, Result};
use crate::ids::{Page, Slot};
use crate::layout::{KvBuffer, KvLayout, KvShape};
use crate::store::{check, KvStore};

/// Alignment of the pool's allocation (a cache line, for the copies).
const ALIGN: usize = 64;

/// The host tier's KV bytes (SGLang's `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`): every
/// row of every (layer, buffer) of `size + P` host slots, in one zeroed allocation laid out as
/// its [`HostLayout`]. See the [module docs](self).
///
/// The allocation never moves or grows, so [`as_mut_ptr`](Self::as_mut_ptr) is stable for the
/// pool's life.
#[doc(alias = "HostKVCache")]
pub struct HostKvPool {
    layout: KvLayout,
    host_layout: HostLayout,
    /// Byte offset of each buffer's block, by the buffer's index in `shape.buffers()`.
    bases: Vec<usize>,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the pool owns its allocation outright (plain bytes, no thread affinity); `&self`
// methods only read it, `&mut self` methods are exclusive, and the only shared-reference write
// (`write_pages_shared`) is `unsafe` with the no-concurrent-access contract on its caller.
unsafe impl Send for HostKvPool {}
// SAFETY: as above.
unsafe impl Sync for HostKvPool {}

impl HostKvPool {
    /// A zeroed pool of `size_slots` allocatable host slots (a positive multiple of
    /// `page_size`) plus one padding page, for KV of `shape`, laid out as `host_layout`.
    /// An invalid size is the errors of [`KvLayout::new`]; memory that cannot be had is
    /// [`KvPoolError::HostOutOfMemory`] with the pool's size, never an abort.
    pub fn new(
        shape: KvShape,
        page_size: u32,
        size_slots: usize,
        host_layout: HostLayout,
    ) -> Result<Self> {
        let layout = KvLayout::new(shape, page_size, size_slots)?;
        let len = layout.total_bytes();
        let oom = KvPoolError::HostOutOfMemory { bytes: len };
        let alloc_layout = Layout::from_size_align(len, ALIGN).map_err(|_| oom.clone())?;
        // `KvLayout::new` refuses empty pools, so `len > 0`.
        debug_assert!(len > 0);
        // SAFETY: `alloc_layout` has a non-zero size (every dimension of a shape is ≥ 1 and a
        // pool has at least one page); a null result is handled as out of memory.
        let raw = unsafe { alloc::alloc_zeroed(alloc_layout) };
        let ptr = NonNull::new(raw).ok_or(oom)?;
        let mut bases = Vec::with_capacity(shape.buffers().len());
        let mut off = 0;
        for &b in shape.buffers() {
            bases.push(off);
            off += layout.buffer_bytes(b) * shape.layers as usize;
        }
        debug_assert_eq!(off, len);
        Ok(HostKvPool {
            layout,
            host_layout,
            bases,
            ptr,
            len,
        })
    }

    /// The pool as a [`KvLayout`]: shape, page size, `size` allocatable slots, `rows()` rows.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Its memory order.
    pub fn host_layout(&self) -> HostLayout {
        self.host_layout
    }

    /// Allocatable host slots (the padding page excluded).
    pub fn size(&self) -> usize {
        self.layout.size
    }

    /// Bytes of the whole allocation (`layout().total_bytes()`).
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// The first byte of the allocation. Row `(layer, buffer, slot)` lies at
    /// [`row_offset`](Self::row_offset) from it.
    ///
    /// Writing through the pointer is the caller's `unsafe` business: it must not overlap any
    /// bytes another thread reads or writes at the same time (through the pool's methods or
    /// this pointer), and must stay within [`len_bytes`](Self::len_bytes).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Byte offset from [`as_mut_ptr`](Self::as_mut_ptr) of row `slot` of `layer`'s `buffer`.
    /// A layer, buffer or slot (`< layout().rows()`) out of range is the store's error.
    pub fn row_offset(&self, layer: usize, buffer: KvBuffer, slot: Slot) -> Result<usize> {
        check::layer(&self.layout, layer)?;
        check::buffer(&self.layout, buffer)?;
        check::slots(&self.layout, &[slot])?;
        Ok(self.offset(layer, self.buffer_index(buffer), slot.index()))
    }

    /// Rows from `slot` on that lie back to back in every (layer, buffer): a run of
    /// consecutive slots this long is one copy (see [`HostLayout`]); 0 past the last row.
    pub fn contiguous_rows(&self, slot: Slot) -> usize {
        let rows = self.layout.rows();
        if slot.index() >= rows {
            return 0;
        }
        self.host_layout
            .contiguous_rows(rows, self.layout.page_size as usize, slot.index())
            .min(rows - slot.index())
    }

    /// Index of a validated buffer in `shape.buffers()`.
    #[inline]
    fn buffer_index(&self, buffer: KvBuffer) -> usize {
        self.layout
            .shape
            .buffers()
            .iter()
            .position(|&b| b == buffer)
            .expect("buffer validated before use")
    }

    /// Offset of a validated row.
    #[inline]
    fn offset(&self, layer: usize, bi: usize, slot: usize) -> usize {
        let shape = &self.layout.shape;
        let rb = shape.row_bytes(shape.buffers()[bi]);
        self.bases[bi]
            + self.host_layout.offset_in_block(
                shape.layers as usize,
                self.layout.rows(),
                self.layout.page_size as usize,
                rb,
                layer,
                slot,
            )
    }

    /// `len` bytes at `off`, read-only. Only the named bytes are borrowed, so a controller
    /// thread may write other rows through the raw pointer meanwhile.
    #[inline]
    fn bytes(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds (asserted); the allocation lives as long as `self`; writers of these
        // bytes need `&mut self` or the `unsafe` raw paths, whose contracts exclude this read.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// `len` bytes at `off`, writable.
    #[inline]
    fn bytes_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds (asserted); `&mut self` excludes every other borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }

    /// Calls `f(i, host_offset, len)` for each maximal run of `slots` that lies back to back in
    /// the pool (consecutive ascending slots within [`contiguous_rows`](Self::contiguous_rows))
    /// for `layer`'s buffer `bi`: rows `slots[i..i + len / row_bytes]`.
    fn for_each_span(
        &self,
        layer: usize,
        bi: usize,
        slots: &[Slot],
        mut f: impl FnMut(usize, usize, usize),
    ) {
        let rb = self.layout.shape.row_bytes(self.layout.shape.buffers()[bi]);
        let mut i = 0;
        while i < slots.len() {
            let first = slots[i];
            let max = self.contiguous_rows(first);
            let mut n = 1;
            while n < max && i + n < slots.len() && slots[i + n].index() == first.index() + n {
                n += 1;
            }
            f(i, self.offset(layer, bi, first.index()), n * rb);
            i += n;
        }
    }

    /// Calls `f(packed_offset, host_offset, len)` for every contiguous span of `page` in the
    /// canonical packed page format: `packed_offset` within the page's packed bytes.
    fn for_each_page_span(&self, page: Page, mut f: impl FnMut(usize, usize, usize)) {
        let shape = self.layout.shape;
        let p = self.layout.page_size as usize;
        let first = page.index() * p;
        let slots: Vec<Slot> = (first..first + p).map(|s| Slot(s as u32)).collect();
        let mut packed = 0;
        for layer in 0..shape.layers as usize {
            for (bi, &b) in shape.buffers().iter().enumerate() {
                let rb = shape.row_bytes(b);
                self.for_each_span(layer, bi, &slots, |i, off, len| {
                    f(packed + i * rb, off, len)
                });
                packed += p * rb;
            }
        }
    }

    /// Reads one layer's `buffer` rows for `slots` into `out` (`slots.len() × row_bytes`), as
    /// [`KvStore::read_raw`].
    pub fn read_raw(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> Result<()> {
        check::raw(&self.layout, layer, buffer, slots, "out", out.len())?;
        let bi = self.buffer_index(buffer);
        let rb = self.layout.shape.row_bytes(buffer);
        self.for_each_span(layer, bi, slots, |i, off, len| {
            out[i * rb..i * rb + len].copy_from_slice(self.bytes(off, len));
        });
        Ok(())
    }

    /// Writes one layer's `buffer` rows for `slots` from `bytes` (`slots.len() × row_bytes`),
    /// as [`KvStore::write_raw`].
    pub fn write_raw(
        &mut self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        check::raw(&self.layout, layer, buffer, slots, "bytes", bytes.len())?;
        let bi = self.buffer_index(buffer);
        let rb = self.layout.shape.row_bytes(buffer);
        let mut spans = Vec::new();
        self.for_each_span(layer, bi, slots, |i, off, len| spans.push((i, off, len)));
        for (i, off, len) in spans {
            self.bytes_mut(off, len)
                .copy_from_slice(&bytes[i * rb..i * rb + len]);
        }
        Ok(())
    }

    /// Reads whole pages in the canonical packed page format into `out`
    /// (`pages.len() × page_bytes`), as [`KvStore::read_pages`].
    pub fn read_pages(&self, pages: &[Page], out: &mut [u8]) -> Result<()> {
        check::page_data(&self.layout, pages, "out", out.len())?;
        let pb = self.layout.page_bytes();
        for (i, &page) in pages.iter().enumerate() {
            self.for_each_page_span(page, |packed, off, len| {
                out[i * pb + packed..i * pb + packed + len].copy_from_slice(self.bytes(off, len));
            });
        }
        Ok(())
    }

    /// Writes whole pages from the canonical packed page format (`pages.len() × page_bytes`),
    /// as [`KvStore::write_pages`] (a page given twice gets its last data).
    pub fn write_pages(&mut self, pages: &[Page], data: &[u8]) -> Result<()> {
        check::page_data(&self.layout, pages, "data", data.len())?;
        // SAFETY: `&mut self` excludes every other access to the pool.
        unsafe { self.write_pages_unchecked(pages, data) };
        Ok(())
    }

    /// [`write_pages`](Self::write_pages) through a shared reference, for a controller's
    /// storage thread while its IO thread copies other rows.
    ///
    /// # Safety
    /// No other thread may read or write the bytes of `pages` during the call (through any
    /// method or [`as_mut_ptr`](Self::as_mut_ptr)); other pages may be in use.
    pub unsafe fn write_pages_shared(&self, pages: &[Page], data: &[u8]) -> Result<()> {
        check::page_data(&self.layout, pages, "data", data.len())?;
        // SAFETY: the caller's contract.
        unsafe { self.write_pages_unchecked(pages, data) };
        Ok(())
    }

    /// Copies validated packed pages in.
    ///
    /// # Safety
    /// As [`write_pages_shared`](Self::write_pages_shared); the input is validated.
    unsafe fn write_pages_unchecked(&self, pages: &[Page], data: &[u8]) {
        let pb = self.layout.page_bytes();
        let base = self.ptr.as_ptr();
        for (i, &page) in pages.iter().enumerate() {
            self.for_each_page_span(page, |packed, off, len| {
                let src = &data[i * pb + packed..i * pb + packed + len];
                assert!(off + len <= self.len);
                // SAFETY: `off..off + len` is in the allocation (asserted) and is one span of a
                // page no one else touches (the caller's contract); `src` is a separate buffer.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(off), len) };
            });
        }
    }

    /// Refuses a store whose shape or page size is not the pool's.
    fn check_store(&self, store: &dyn KvStore) -> Result<()> {
        let d = store.layout();
        if d.shape != self.layout.shape || d.page_size != self.layout.page_size {
            return Err(KvPoolError::InvalidConfig {
                field: "host pool",
                reason: format!(
                    "the device store holds {} with page size {}, the host pool {} with page \
                     size {}",
                    d.shape, d.page_size, self.layout.shape, self.layout.page_size
                ),
            });
        }
        Ok(())
    }

    /// Copies `device[i]`'s rows (every layer and buffer) into host slot `host[i]` through the
    /// store's `read_raw` (the safe path, for any backend). Lengths must match
    /// ([`KvPoolError::LengthMismatch`] naming `host`), every slot must be in range, and the
    /// store's shape and page size must be the pool's.
    pub fn copy_from_store(
        &mut self,
        store: &dyn KvStore,
        device: &[Slot],
        host: &[Slot],
    ) -> Result<()> {
        self.check_store(store)?;
        check::len("host", device.len(), host.len())?;
        check::slots(store.layout(), device)?;
        check::slots(&self.layout, host)?;
        let shape = self.layout.shape;
        for layer in 0..shape.layers as usize {
            for (bi, &b) in shape.buffers().iter().enumerate() {
                let rb = shape.row_bytes(b);
                let mut spans = Vec::new();
                self.for_each_span(layer, bi, host, |i, off, len| spans.push((i, off, len)));
                for (i, off, len) in spans {
                    let rows = &device[i..i + len / rb];
                    store.read_raw(layer, b, rows, self.bytes_mut(off, len))?;
                }
            }
        }
        Ok(())
    }

    /// Copies host slot `host[i]`'s rows of one layer (every buffer) into device slot
    /// `device[i]` through the store's `write_raw` (the safe path, for any backend). Errors as
    /// [`copy_from_store`](Self::copy_from_store), plus the layer's range; an `Err` before any
    /// write changes nothing.
    pub fn copy_layer_to_store(
        &self,
        store: &mut dyn KvStore,
        layer: usize,
        host: &[Slot],
        device: &[Slot],
    ) -> Result<()> {
        self.check_store(store)?;
        check::layer(&self.layout, layer)?;
        check::len("device", host.len(), device.len())?;
        check::slots(store.layout(), device)?;
        check::slots(&self.layout, host)?;
        let shape = self.layout.shape;
        for (bi, &b) in shape.buffers().iter().enumerate() {
            let rb = shape.row_bytes(b);
            let mut spans = Vec::new();
            self.for_each_span(layer, bi, host, |i, off, len| spans.push((i, off, len)));
            for (i, off, len) in spans {
                store.write_raw(layer, b, &device[i..i + len / rb], self.bytes(off, len))?;
            }
        }
        Ok(())
    }
}

impl Drop for HostKvPool {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this size and alignment (checked
        // in `new`), and is freed once.
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, ALIGN),
            )
        };
    }
}

impl fmt::Debug for HostKvPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostKvPool")
            .field("layout", &self.layout)
            .field("host_layout", &self.host_layout)
            .field("bytes", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
