//! The KV bytes: the [`KvStore`] trait that host memory and every device backend implement, and
//! [`HostKvStore`], the host-memory implementation.
//!
//! A store holds, per layer, the buffers of its [`KvLayout`] (`shape.buffers()`: K and V for
//! MHA, the latent row for MLA, K, V and labels for DoubleSparse), each `layout.rows()` rows of
//! `shape.row_bytes(buffer)` bytes in the layout's dtype; row `s` belongs to slot `s`, and page
//! `p` is rows `p·P .. (p+1)·P`. Page 0 is the padding page: it is never handed out by the
//! allocators, but writes into it are accepted (it is the dummy-write target of padded batches).
//!
//! # Canonical packed page format
//!
//! Host offload (HiCache) and KV transfer (PD disaggregation) move whole pages in one format,
//! produced by [`KvStore::read_pages`] and consumed by [`KvStore::write_pages`]:
//!
//! ```text
//! for page in pages (in the order given):
//!     for layer in 0..L:
//!         for buffer in shape.buffers():      // K, V, labels (MLA: the latent only)
//!             the P rows of that page, back to back, as raw store bytes
//! ```
//!
//! One page is therefore [`KvLayout::page_bytes`] bytes: layer `l`, buffer `b` of the `i`-th page
//! starts at `i·page_bytes + l·(P·slot_bytes_per_layer) + P·Σ_{b' before b} row_bytes(b')`.
//! Store bytes are little-endian ([`crate::dtype`]). The per-layer fp8 scales are not part of the
//! format: both sides share them through configuration.
//!
//! # Validation
//!
//! Every method validates its whole input before it changes anything, so an `Err` leaves the
//! store byte-identical. The checks are in [`check`], shared by every backend so that all report
//! the same errors:
//! - a layer `≥ layers` is [`KvPoolError::LayerOutOfRange`];
//! - a slot `≥ layout.rows()` is [`KvPoolError::SlotOutOfRange`] (with `first = 0` and
//!   `end = rows`, as the padding page is a valid target);
//! - a page outside `1..=layout.pages()` is [`KvPoolError::PageOutOfRange`];
//! - a buffer of the wrong length is [`KvPoolError::LengthMismatch`] naming it;
//! - a buffer the layout lacks (MLA's value, labels outside DoubleSparse) is
//!   [`KvPoolError::Unsupported`].
//!
//! Within one write, a slot (or page) given twice gets the data of its last occurrence.

use std::fmt;

use crate::dtype::{decode_to_f32, encode_f32};
use crate::error::{KvPoolError, Result};
use crate::host_memory::{Buffers, HostMemory};
use crate::ids::{Page, Slot};
use crate::layout::{KvBuffer, KvKind, KvLayout};

/// One per-layer buffer of a store, registered for transfer: SGLang's
/// `get_contiguous_buf_infos` entry (data pointer, byte length, item length).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryRegion {
    /// The layer the buffer belongs to.
    pub layer: usize,
    /// Which of the layer's buffers it is.
    pub buffer: KvBuffer,
    /// Address of the buffer's first byte (row 0, the padding row) in the store's address space
    /// (a host pointer for [`HostKvStore`], a device pointer for device backends).
    pub addr: usize,
    /// Bytes of the whole buffer (`layout.buffer_bytes(buffer)`, padding page included).
    pub len_bytes: usize,
    /// Bytes of one page of this layer of this buffer (`layout.page_bytes_per_layer(buffer)`):
    /// page `p` lies at `addr + p × item_len`.
    pub item_len: usize,
}

/// A KV store: the per-layer K/V (and label) buffers of one [`KvLayout`], wherever they live.
///
/// Implemented by [`HostKvStore`] and by every device backend, so it only moves slices in and
/// out (only [`memory_regions`](KvStore::memory_regions) exposes addresses). The trait is object
/// safe; `Send` is not required. Every method validates its whole input first (see the
/// [module docs](self)): an `Err` leaves the store unchanged. Use the functions of [`check`] to
/// report the same errors as every other backend.
#[doc(alias = "KVCache")]
pub trait KvStore {
    /// The layout this store holds.
    fn layout(&self) -> &KvLayout;

    /// The layer's `(k_scale, v_scale)`, both 1.0 until [`set_scales`](KvStore::set_scales).
    /// Scales apply to fp8 dtypes only (K uses `k_scale`, V uses `v_scale`, MLA's latent uses
    /// `k_scale`, labels are unscaled); other dtypes keep but ignore them.
    fn scales(&self, layer: usize) -> Result<(f32, f32)>;

    /// Sets the layer's fp8 scales (SGLang's `k_scale` / `v_scale`): stored values are
    /// `fp8(x / scale)` and read back as `fp8 × scale`. Both must be finite and `> 0`
    /// ([`KvPoolError::InvalidConfig`]). Bytes already stored are not rescaled.
    fn set_scales(&mut self, layer: usize, k_scale: f32, v_scale: f32) -> Result<()>;

    /// Writes one layer's K and V for `slots` (SGLang's `set_kv_buffer`), converting to the
    /// store dtype (fp8: K with `k_scale`, V with `v_scale`).
    ///
    /// MHA and DoubleSparse: `k` is `[n, row_elems(Key)]` and `v` is `[n, row_elems(Value)]`,
    /// row-major, `n = slots.len()`. MLA: `k` is the latent row `[n, kv_lora_rank +
    /// qk_rope_head_dim]` and `v` must be empty ([`KvPoolError::Unsupported`] otherwise).
    fn write_kv(&mut self, layer: usize, slots: &[Slot], k: &[f32], v: &[f32]) -> Result<()>;

    /// Writes one layer's DoubleSparse labels `[n, row_elems(Label)]` for `slots` (unscaled).
    /// Layouts without labels: [`KvPoolError::Unsupported`].
    fn write_labels(&mut self, layer: usize, slots: &[Slot], labels: &[f32]) -> Result<()>;

    /// Writes raw store bytes, `slots.len() × row_bytes(buffer)`, into one layer's `buffer`.
    fn write_raw(
        &mut self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()>;

    /// Reads one layer's `buffer` rows for `slots` into `out` (`slots.len() × row_elems`),
    /// converted to f32 with the buffer's scale.
    fn read_f32(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [f32],
    ) -> Result<()>;

    /// Reads raw store bytes of one layer's `buffer` rows for `slots` into `out`
    /// (`slots.len() × row_bytes`).
    fn read_raw(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> Result<()>;

    /// Copies slot rows across every layer and buffer: `dst[i]` gets `src[i]`'s row (SGLang's
    /// `move_kv_cache(tgt = dst, src)`). Behaves as if every read happened before any write, so
    /// overlapping sets (a shift by one, a swap) are safe. `src` and `dst` must have equal
    /// lengths ([`KvPoolError::LengthMismatch`] naming `dst`).
    fn copy_slots(&mut self, src: &[Slot], dst: &[Slot]) -> Result<()>;

    /// Reads whole pages in the canonical packed format (module docs) into `out`, which must be
    /// `pages.len() × layout.page_bytes()` bytes.
    fn read_pages(&self, pages: &[Page], out: &mut [u8]) -> Result<()>;

    /// Writes whole pages from the canonical packed format; `data` must be
    /// `pages.len() × layout.page_bytes()` bytes.
    fn write_pages(&mut self, pages: &[Page], data: &[u8]) -> Result<()>;

    /// The per-layer buffers for transfer registration, ordered `k0..k(L-1)`, `v0..v(L-1)`, then
    /// `label0..label(L-1)`, listing only the buffers the layout has (SGLang's
    /// `get_contiguous_buf_infos`).
    fn memory_regions(&self) -> Vec<MemoryRegion>;
}

/// Input validation shared by every [`KvStore`] implementation, so that all backends refuse the
/// same inputs with the same errors. Each function checks everything one trait method needs.
pub mod check {
    use super::*;

    /// `n × per_row`, saturating (a length that large can never match a real slice).
    fn times(n: usize, per_row: usize) -> usize {
        n.saturating_mul(per_row)
    }

    /// `Ok` when `layer < layout.shape.layers`, else [`KvPoolError::LayerOutOfRange`].
    pub fn layer(layout: &KvLayout, layer: usize) -> Result<()> {
        let layers = layout.shape.layers as usize;
        if layer >= layers {
            return Err(KvPoolError::LayerOutOfRange { layer, layers });
        }
        Ok(())
    }

    /// `Ok` when the layout's kind has `buffer`, else [`KvPoolError::Unsupported`] saying why
    /// (MLA has no value buffer; only DoubleSparse has labels).
    pub fn buffer(layout: &KvLayout, buffer: KvBuffer) -> Result<()> {
        if layout.shape.has_buffer(buffer) {
            return Ok(());
        }
        let kind = match layout.shape.kind {
            KvKind::Mha { .. } => "MHA",
            KvKind::Mla { .. } => "MLA",
            KvKind::DoubleSparse { .. } => "DoubleSparse",
        };
        Err(KvPoolError::Unsupported(match buffer {
            KvBuffer::Value => format!(
                "{kind} has no value buffer: the value is the first kv_lora_rank dims of the latent"
            ),
            _ => format!(
                "{kind} has no {} buffer: labels exist only in DoubleSparse layouts",
                buffer.name()
            ),
        }))
    }

    /// Every slot is a row of the store (`< layout.rows()`; the padding page is allowed).
    pub fn slots(layout: &KvLayout, slots: &[Slot]) -> Result<()> {
        let rows = layout.rows();
        match slots.iter().find(|s| s.index() >= rows) {
            Some(&slot) => Err(KvPoolError::SlotOutOfRange {
                slot,
                first: 0,
                end: rows as u32,
            }),
            None => Ok(()),
        }
    }

    /// Every page is allocatable (`1..=layout.pages()`).
    pub fn pages(layout: &KvLayout, pages: &[Page]) -> Result<()> {
        let last = layout.pages();
        match pages.iter().find(|p| p.0 == 0 || p.index() > last) {
            Some(&page) => Err(KvPoolError::PageOutOfRange {
                page,
                last: last as u32,
            }),
            None => Ok(()),
        }
    }

    /// `Ok` when `got == expected`, else [`KvPoolError::LengthMismatch`] naming the argument
    /// `what`.
    pub fn len(what: &'static str, expected: usize, got: usize) -> Result<()> {
        if expected != got {
            return Err(KvPoolError::LengthMismatch {
                what,
                expected,
                got,
            });
        }
        Ok(())
    }

    /// [`KvStore::set_scales`]: the layer exists and both scales are finite and `> 0`.
    pub fn set_scales(layout: &KvLayout, layer: usize, k_scale: f32, v_scale: f32) -> Result<()> {
        self::layer(layout, layer)?;
        for (field, s) in [("k_scale", k_scale), ("v_scale", v_scale)] {
            if !(s.is_finite() && s > 0.0) {
                return Err(KvPoolError::InvalidConfig {
                    field,
                    reason: format!("must be finite and > 0, got {s}"),
                });
            }
        }
        Ok(())
    }

    /// [`KvStore::write_kv`]: layer, MLA's empty `v`, the lengths of `k` and `v`, the slots.
    pub fn write_kv(
        layout: &KvLayout,
        layer: usize,
        slots: &[Slot],
        k_len: usize,
        v_len: usize,
    ) -> Result<()> {
        self::layer(layout, layer)?;
        let shape = &layout.shape;
        if !shape.has_buffer(KvBuffer::Value) && v_len != 0 {
            return Err(KvPoolError::Unsupported(
                "MLA has no value buffer: the value is the first kv_lora_rank dims of the latent; \
                 pass the latent rows as k and an empty v"
                    .into(),
            ));
        }
        let n = slots.len();
        len("k", times(n, shape.row_elems(KvBuffer::Key)), k_len)?;
        len("v", times(n, shape.row_elems(KvBuffer::Value)), v_len)?;
        self::slots(layout, slots)
    }

    /// [`KvStore::write_labels`]: layer, a label buffer, the length of `labels`, the slots.
    pub fn write_labels(
        layout: &KvLayout,
        layer: usize,
        slots: &[Slot],
        labels_len: usize,
    ) -> Result<()> {
        self::layer(layout, layer)?;
        buffer(layout, KvBuffer::Label)?;
        let per_row = layout.shape.row_elems(KvBuffer::Label);
        len("labels", times(slots.len(), per_row), labels_len)?;
        self::slots(layout, slots)
    }

    /// [`KvStore::read_f32`]: layer, buffer, `out_len == slots.len() × row_elems`, the slots.
    pub fn read_f32(
        layout: &KvLayout,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out_len: usize,
    ) -> Result<()> {
        self::layer(layout, layer)?;
        self::buffer(layout, buffer)?;
        let per_row = layout.shape.row_elems(buffer);
        len("out", times(slots.len(), per_row), out_len)?;
        self::slots(layout, slots)
    }

    /// [`KvStore::write_raw`] / [`KvStore::read_raw`]: layer, buffer,
    /// `bytes_len == slots.len() × row_bytes` (reported as `what`), the slots.
    pub fn raw(
        layout: &KvLayout,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        what: &'static str,
        bytes_len: usize,
    ) -> Result<()> {
        self::layer(layout, layer)?;
        self::buffer(layout, buffer)?;
        let per_row = layout.shape.row_bytes(buffer);
        len(what, times(slots.len(), per_row), bytes_len)?;
        self::slots(layout, slots)
    }

    /// [`KvStore::copy_slots`]: equal lengths, every slot of both lists.
    pub fn copy_slots(layout: &KvLayout, src: &[Slot], dst: &[Slot]) -> Result<()> {
        len("dst", src.len(), dst.len())?;
        slots(layout, src)?;
        slots(layout, dst)
    }

    /// [`KvStore::read_pages`] / [`KvStore::write_pages`]: every page, and
    /// `bytes_len == pages.len() × layout.page_bytes()` (reported as `what`).
    pub fn page_data(
        layout: &KvLayout,
        pages: &[Page],
        what: &'static str,
        bytes_len: usize,
    ) -> Result<()> {
        len(what, times(pages.len(), layout.page_bytes()), bytes_len)?;
        self::pages(layout, pages)
    }
}

/// Calls `f(i, first, len)` for each maximal run `slots[i..i + len] == first..first + len` of
/// consecutive ascending slots, in order, so contiguous rows move in one copy or conversion.
#[inline]
fn for_each_run(slots: &[Slot], mut f: impl FnMut(usize, usize, usize)) {
    let mut i = 0;
    while i < slots.len() {
        let first = slots[i].index();
        let mut len = 1;
        while i + len < slots.len() && slots[i + len].index() == first + len {
            len += 1;
        }
        f(i, first, len);
        i += len;
    }
}

/// Scratch kept by [`HostKvStore::copy_slots`] between calls up to this size; larger ones are
/// freed after the call.
const SCRATCH_KEEP_BYTES: usize = 16 << 20;

/// A [`KvStore`] in host memory: per layer, per buffer, one zeroed `Vec<u8>` of
/// `layout.rows() × row_bytes` bytes, or the same buffers back to back in memory given to
/// [`HostKvStore::with_memory`] (a [`HostMemory`]).
///
/// The buffers are allocated once and never reallocated, so the addresses of
/// [`memory_regions`](KvStore::memory_regions) stay valid for the store's life (moving the store
/// does not move them).
#[doc(alias = "MHATokenToKVPool")]
#[derive(Clone)]
pub struct HostKvStore {
    layout: KvLayout,
    /// Buffer `b` (its index in `shape.buffers()`) of layer `l` is `data.get(l × nbuf + b)`.
    data: Buffers,
    /// Per layer `(k_scale, v_scale)`.
    scales: Vec<(f32, f32)>,
    /// Staging rows for `copy_slots`, reused across calls.
    scratch: Vec<u8>,
}

impl HostKvStore {
    /// Allocates a zeroed store for `layout`, scales 1.0. Memory that cannot be reserved is
    /// [`KvPoolError::HostOutOfMemory`] with the store's total size, instead of an abort.
    pub fn new(layout: KvLayout) -> Result<Self> {
        let data = Buffers::heap(&layout)?;
        Ok(Self::over(layout, data))
    }

    /// A zeroed store for `layout` (scales 1.0) that lives in `mem` instead of its own heap
    /// buffers: the buffers lie back to back from `mem`'s first byte, layer-major, buffers in
    /// canonical order (the PD decode server's store, in a shared mapping a transfer peer writes
    /// into). Memory shorter than `layout.total_bytes()` is [`KvPoolError::MemoryTooSmall`].
    /// Behaves byte for byte as [`HostKvStore::new`]'s store; `Clone` copies it to the heap.
    pub fn with_memory(layout: KvLayout, mem: Box<dyn HostMemory>) -> Result<Self> {
        let data = Buffers::foreign(&layout, mem)?;
        Ok(Self::over(layout, data))
    }

    fn over(layout: KvLayout, data: Buffers) -> Self {
        HostKvStore {
            layout,
            data,
            scales: vec![(1.0, 1.0); layout.shape.layers as usize],
            scratch: Vec::new(),
        }
    }

    /// Whether the bytes live in memory given to [`HostKvStore::with_memory`].
    pub fn is_foreign_memory(&self) -> bool {
        self.data.is_foreign()
    }

    /// Borrows one layer's `buffer` as raw store bytes: `layout.rows() × row_bytes(buffer)`
    /// bytes, row `s` (slot `s`) at `s × row_bytes`, little-endian elements of the layout's dtype
    /// (decode them with [`crate::dtype::decode_to_f32`] and [`KvStore::scales`]).
    ///
    /// For host compute backends that read contiguous runs of rows without a copy. Errors as
    /// [`KvStore::read_raw`]: a layer out of range or a buffer the layout lacks.
    pub fn layer_buffer(&self, layer: usize, buffer: KvBuffer) -> Result<&[u8]> {
        check::layer(&self.layout, layer)?;
        check::buffer(&self.layout, buffer)?;
        Ok(self.data.get(self.index(layer, buffer)))
    }

    /// Index into `data` of a validated layer and buffer.
    #[inline]
    fn index(&self, layer: usize, buffer: KvBuffer) -> usize {
        let buffers = self.layout.shape.buffers();
        let b = buffers
            .iter()
            .position(|&x| x == buffer)
            .expect("buffer validated before use");
        layer * buffers.len() + b
    }

    /// The scale used for a buffer's fp8 conversion.
    #[inline]
    fn scale_of(&self, layer: usize, buffer: KvBuffer) -> f32 {
        match buffer {
            KvBuffer::Key => self.scales[layer].0,
            KvBuffer::Value => self.scales[layer].1,
            KvBuffer::Label => 1.0,
        }
    }

    /// Converts validated rows `src` (`slots.len() × row_elems`) into a buffer.
    fn encode_rows(&mut self, layer: usize, buffer: KvBuffer, slots: &[Slot], src: &[f32]) {
        let dtype = self.layout.shape.dtype;
        let elems = self.layout.shape.row_elems(buffer);
        let bytes = self.layout.shape.row_bytes(buffer);
        let scale = self.scale_of(layer, buffer);
        let idx = self.index(layer, buffer);
        let buf = self.data.get_mut(idx);
        for_each_run(slots, |i, first, len| {
            encode_f32(
                dtype,
                &src[i * elems..(i + len) * elems],
                scale,
                &mut buf[first * bytes..(first + len) * bytes],
            );
        });
    }
}

impl fmt::Debug for HostKvStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostKvStore")
            .field("layout", &self.layout)
            .field("bytes", &self.layout.total_bytes())
            .field("scales", &self.scales)
            .finish_non_exhaustive()
    }
}

impl KvStore for HostKvStore {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn scales(&self, layer: usize) -> Result<(f32, f32)> {
        check::layer(&self.layout, layer)?;
        Ok(self.scales[layer])
    }

    fn set_scales(&mut self, layer: usize, k_scale: f32, v_scale: f32) -> Result<()> {
        check::set_scales(&self.layout, layer, k_scale, v_scale)?;
        self.scales[layer] = (k_scale, v_scale);
        Ok(())
    }

    fn write_kv(&mut self, layer: usize, slots: &[Slot], k: &[f32], v: &[f32]) -> Result<()> {
        check::write_kv(&self.layout, layer, slots, k.len(), v.len())?;
        self.encode_rows(layer, KvBuffer::Key, slots, k);
        if self.layout.shape.has_buffer(KvBuffer::Value) {
            self.encode_rows(layer, KvBuffer::Value, slots, v);
        }
        Ok(())
    }

    fn write_labels(&mut self, layer: usize, slots: &[Slot], labels: &[f32]) -> Result<()> {
        check::write_labels(&self.layout, layer, slots, labels.len())?;
        self.encode_rows(layer, KvBuffer::Label, slots, labels);
        Ok(())
    }

    fn write_raw(
        &mut self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        check::raw(&self.layout, layer, buffer, slots, "bytes", bytes.len())?;
        let rb = self.layout.shape.row_bytes(buffer);
        let idx = self.index(layer, buffer);
        let buf = self.data.get_mut(idx);
        for_each_run(slots, |i, first, len| {
            buf[first * rb..(first + len) * rb].copy_from_slice(&bytes[i * rb..(i + len) * rb]);
        });
        Ok(())
    }

    fn read_f32(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [f32],
    ) -> Result<()> {
        check::read_f32(&self.layout, layer, buffer, slots, out.len())?;
        let dtype = self.layout.shape.dtype;
        let elems = self.layout.shape.row_elems(buffer);
        let rb = self.layout.shape.row_bytes(buffer);
        let scale = self.scale_of(layer, buffer);
        let buf = self.data.get(self.index(layer, buffer));
        for_each_run(slots, |i, first, len| {
            decode_to_f32(
                dtype,
                &buf[first * rb..(first + len) * rb],
                scale,
                &mut out[i * elems..(i + len) * elems],
            );
        });
        Ok(())
    }

    fn read_raw(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> Result<()> {
        check::raw(&self.layout, layer, buffer, slots, "out", out.len())?;
        let rb = self.layout.shape.row_bytes(buffer);
        let buf = self.data.get(self.index(layer, buffer));
        for_each_run(slots, |i, first, len| {
            out[i * rb..(i + len) * rb].copy_from_slice(&buf[first * rb..(first + len) * rb]);
        });
        Ok(())
    }

    fn copy_slots(&mut self, src: &[Slot], dst: &[Slot]) -> Result<()> {
        check::copy_slots(&self.layout, src, dst)?;
        if src.is_empty() {
            return Ok(());
        }
        let shape = self.layout.shape;
        let max_rb = shape
            .buffers()
            .iter()
            .map(|&b| shape.row_bytes(b))
            .max()
            .unwrap_or(0);
        let mut scratch = std::mem::take(&mut self.scratch);
        if scratch.len() < src.len() * max_rb {
            scratch.resize(src.len() * max_rb, 0);
        }
        for layer in 0..shape.layers as usize {
            for &b in shape.buffers() {
                let rb = shape.row_bytes(b);
                let idx = self.index(layer, b);
                let buf = self.data.get_mut(idx);
                let stage = &mut scratch[..src.len() * rb];
                // Gather every source row first, then scatter: overlapping sets see old rows.
                for_each_run(src, |i, first, len| {
                    stage[i * rb..(i + len) * rb]
                        .copy_from_slice(&buf[first * rb..(first + len) * rb]);
                });
                for_each_run(dst, |i, first, len| {
                    buf[first * rb..(first + len) * rb]
                        .copy_from_slice(&stage[i * rb..(i + len) * rb]);
                });
            }
        }
        if scratch.len() <= SCRATCH_KEEP_BYTES {
            self.scratch = scratch;
        }
        Ok(())
    }

    fn read_pages(&self, pages: &[Page], out: &mut [u8]) -> Result<()> {
        check::page_data(&self.layout, pages, "out", out.len())?;
        let p = self.layout.page_size as usize;
        let mut chunks = out.chunks_exact_mut(self.layout.page_bytes().max(1));
        for (&page, chunk) in pages.iter().zip(&mut chunks) {
            let mut off = 0;
            for i in 0..self.data.count() {
                // `data` is ordered layer-major, buffers in canonical order: exactly the format.
                let buf = self.data.get(i);
                let n = buf.len() / self.layout.rows() * p;
                let start = page.index() * n;
                chunk[off..off + n].copy_from_slice(&buf[start..start + n]);
                off += n;
            }
        }
        Ok(())
    }

    fn write_pages(&mut self, pages: &[Page], data: &[u8]) -> Result<()> {
        check::page_data(&self.layout, pages, "data", data.len())?;
        let p = self.layout.page_size as usize;
        let rows = self.layout.rows();
        let chunks = data.chunks_exact(self.layout.page_bytes().max(1));
        for (&page, chunk) in pages.iter().zip(chunks) {
            let mut off = 0;
            for i in 0..self.data.count() {
                let buf = self.data.get_mut(i);
                let n = buf.len() / rows * p;
                let start = page.index() * n;
                buf[start..start + n].copy_from_slice(&chunk[off..off + n]);
                off += n;
            }
        }
        Ok(())
    }

    fn memory_regions(&self) -> Vec<MemoryRegion> {
        let shape = &self.layout.shape;
        let mut regions = Vec::with_capacity(self.data.count());
        for &b in shape.buffers() {
            for layer in 0..shape.layers as usize {
                let buf = self.data.get(self.index(layer, b));
                regions.push(MemoryRegion {
                    layer,
                    buffer: b,
                    addr: buf.as_ptr() as usize,
                    len_bytes: buf.len(),
                    item_len: self.layout.page_bytes_per_layer(b),
                });
            }
        }
        regions
    }
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

    use super::*;
    use crate::dtype::max_relative_error;
    use crate::layout::{KvDtype, KvShape};

    use crate::rng::SplitMix64;

    /// Random non-zero values of random sign, magnitudes spread over the dtype's normal range
    /// (stored magnitude, i.e. before multiplying by `scale`).
    fn values(dtype: KvDtype, n: usize, scale: f32, seed: &mut SplitMix64) -> Vec<f32> {
        let (lo, hi) = match dtype {
            KvDtype::F32 | KvDtype::Bf16 => (-20.0, 20.0),
            KvDtype::F16 => (-14.0, 15.9),
            KvDtype::Fp8E4m3 => (-6.0, 8.7),
            KvDtype::Fp8E5m2 => (-14.0, 15.7),
        };
        (0..n)
            .map(|_| {
                let mag = (lo + (hi - lo) * seed.next_f32()).exp2() * scale;
                if seed.next_u64() & 1 == 0 {
                    mag
                } else {
                    -mag
                }
            })
            .collect()
    }

    fn random_bytes(n: usize, seed: &mut SplitMix64) -> Vec<u8> {
        (0..n).map(|_| seed.next_u64() as u8).collect()
    }

    /// A random permutation of `0..n`.
    fn permutation(n: usize, seed: &mut SplitMix64) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        seed.shuffle(&mut v);
        v
    }

    fn slots(ids: impl IntoIterator<Item = usize>) -> Vec<Slot> {
        ids.into_iter().map(|s| Slot(s as u32)).collect()
    }

    fn shapes(dtype: KvDtype) -> [KvShape; 3] {
        [
            KvShape::mha(2, 8, 4, 3, dtype).unwrap(),
            KvShape::mla(12, 4, 2, dtype).unwrap(),
            KvShape::double_sparse(2, 8, 4, 3, 2, dtype).unwrap(),
        ]
    }

    fn assert_close(dtype: KvDtype, want: &[f32], got: &[f32], what: &str) {
        assert_eq!(want.len(), got.len());
        if dtype == KvDtype::F32 {
            assert_eq!(want, got, "{what}: f32 must be exact");
            return;
        }
        let bound = max_relative_error(dtype) * (1.0 + 1e-5);
        for (i, (&x, &y)) in want.iter().zip(got).enumerate() {
            let rel = (x - y).abs() / x.abs();
            assert!(
                rel <= bound,
                "{what} [{i}]: wrote {x}, read {y} ({rel} > {bound})"
            );
        }
    }

    /// Every raw row of every layer and buffer (padding included), the packed pages, the scales.
    type Dump = (Vec<Vec<u8>>, Vec<u8>, Vec<(f32, f32)>);

    /// Everything observable in `store`.
    fn dump(store: &HostKvStore) -> Dump {
        let layout = *store.layout();
        let all = slots(0..layout.rows());
        let mut rows = Vec::new();
        for layer in 0..layout.shape.layers as usize {
            for &b in layout.shape.buffers() {
                let mut out = vec![0u8; all.len() * layout.shape.row_bytes(b)];
                store.read_raw(layer, b, &all, &mut out).unwrap();
                rows.push(out);
            }
        }
        let pages: Vec<Page> = (1..=layout.pages() as u32).map(Page).collect();
        let mut packed = vec![0u8; pages.len() * layout.page_bytes()];
        store.read_pages(&pages, &mut packed).unwrap();
        let scales = (0..layout.shape.layers as usize)
            .map(|l| store.scales(l).unwrap())
            .collect();
        (rows, packed, scales)
    }

    /// A store whose every byte (padding included) is random.
    fn random_store(layout: KvLayout, seed: &mut SplitMix64) -> HostKvStore {
        let mut store = HostKvStore::new(layout).unwrap();
        let all = slots(0..layout.rows());
        for layer in 0..layout.shape.layers as usize {
            for &b in layout.shape.buffers() {
                let bytes = random_bytes(all.len() * layout.shape.row_bytes(b), seed);
                store.write_raw(layer, b, &all, &bytes).unwrap();
            }
        }
        store
    }

    #[test]
    fn new_store_is_zeroed_with_unit_scales() {
        let layout = KvLayout::new(shapes(KvDtype::F16)[2], 4, 16).unwrap();
        let store = HostKvStore::new(layout).unwrap();
        let (rows, packed, scales) = dump(&store);
        assert!(rows.iter().all(|r| r.iter().all(|&b| b == 0)));
        assert!(packed.iter().all(|&b| b == 0));
        assert_eq!(scales, [(1.0, 1.0); 2]);
        assert_eq!(
            rows.iter().map(Vec::len).sum::<usize>(),
            layout.total_bytes()
        );
        // Object safe.
        let boxed: Box<dyn KvStore> = Box::new(store);
        assert_eq!(boxed.layout(), &layout);
        let store = HostKvStore::new(layout).unwrap();
        assert!(format!("{store:?}").starts_with("HostKvStore { layout: KvLayout {"));
    }

    #[test]
    fn impossible_size_is_host_out_of_memory() {
        // 256 KiB rows × 2^31 slots = 2^49 bytes per buffer: beyond any address space.
        let shape = KvShape::mha(64, 1024, 1024, 2, KvDtype::F32).unwrap();
        let layout = KvLayout::new(shape, 1, 1 << 31).unwrap();
        assert_eq!(
            HostKvStore::new(layout).unwrap_err(),
            KvPoolError::HostOutOfMemory {
                bytes: layout.total_bytes()
            }
        );
        // One buffer of about 1.5 × 2^63 bytes: fits a usize, but not a Vec (capacity overflow).
        let shape = KvShape::mla(u32::MAX, u32::MAX, 1, KvDtype::F32).unwrap();
        let layout = KvLayout::new(shape, 1, 3 << 27).unwrap();
        assert!(layout.total_bytes() > isize::MAX as usize);
        assert_eq!(
            HostKvStore::new(layout).unwrap_err(),
            KvPoolError::HostOutOfMemory {
                bytes: layout.total_bytes()
            }
        );
    }

    #[test]
    fn write_kv_read_f32_round_trip_every_dtype_and_kind() {
        let mut seed = SplitMix64::new(1);
        for dtype in KvDtype::ALL {
            for shape in shapes(dtype) {
                for page_size in [1u32, 4] {
                    let layout = KvLayout::new(shape, page_size, 8 * page_size as usize).unwrap();
                    let mut store = HostKvStore::new(layout).unwrap();
                    let kr = shape.row_elems(KvBuffer::Key);
                    let vr = shape.row_elems(KvBuffer::Value);
                    let lr = shape.row_elems(KvBuffer::Label);
                    // Scattered distinct slots (padding page included), then a contiguous run.
                    let perm = permutation(layout.rows(), &mut seed);
                    let scattered = slots(perm[..layout.rows() / 2].iter().copied());
                    let run = slots(1..1 + layout.rows() / 2);
                    for (case, ss) in [("scattered", scattered), ("ascending", run)] {
                        let n = ss.len();
                        for layer in 0..shape.layers as usize {
                            let what = format!("{shape} P={page_size} {case} layer {layer}");
                            let k = values(dtype, n * kr, 1.0, &mut seed);
                            let v = values(dtype, n * vr, 1.0, &mut seed);
                            store.write_kv(layer, &ss, &k, &v).unwrap();
                            let mut out = vec![0f32; n * kr];
                            store.read_f32(layer, KvBuffer::Key, &ss, &mut out).unwrap();
                            assert_close(dtype, &k, &out, &format!("{what} k"));
                            if vr > 0 {
                                let mut out = vec![0f32; n * vr];
                                store
                                    .read_f32(layer, KvBuffer::Value, &ss, &mut out)
                                    .unwrap();
                                assert_close(dtype, &v, &out, &format!("{what} v"));
                            }
                            if lr > 0 {
                                let labels = values(dtype, n * lr, 1.0, &mut seed);
                                store.write_labels(layer, &ss, &labels).unwrap();
                                let mut out = vec![0f32; n * lr];
                                store
                                    .read_f32(layer, KvBuffer::Label, &ss, &mut out)
                                    .unwrap();
                                assert_close(dtype, &labels, &out, &format!("{what} labels"));
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rows_land_at_their_slots_and_other_rows_stay_zero() {
        let shape = KvShape::mha(1, 2, 1, 2, KvDtype::F32).unwrap();
        let layout = KvLayout::new(shape, 2, 4).unwrap();
        let mut store = HostKvStore::new(layout).unwrap();
        store
            .write_kv(
                1,
                &slots([5, 0, 3]),
                &[1., 2., 3., 4., 5., 6.],
                &[7., 8., 9.],
            )
            .unwrap();
        let mut k = vec![0f32; 12];
        store
            .read_f32(1, KvBuffer::Key, &slots(0..6), &mut k)
            .unwrap();
        assert_eq!(k, [3., 4., 0., 0., 0., 0., 5., 6., 0., 0., 1., 2.]);
        let mut v = vec![0f32; 6];
        store
            .read_f32(1, KvBuffer::Value, &slots(0..6), &mut v)
            .unwrap();
        assert_eq!(v, [8., 0., 0., 9., 0., 7.]);
        store
            .read_f32(0, KvBuffer::Value, &slots(0..6), &mut v)
            .unwrap();
        assert_eq!(v, [0.; 6]);
    }

    #[test]
    fn duplicate_slots_in_one_write_last_wins() {
        let shape = KvShape::mha(1, 2, 1, 1, KvDtype::F16).unwrap();
        let layout = KvLayout::new(shape, 1, 8).unwrap();
        let mut store = HostKvStore::new(layout).unwrap();
        store
            .write_kv(
                0,
                &slots([3, 4, 3]),
                &[1., 1., 2., 2., 3., 3.],
                &[1., 2., 3.],
            )
            .unwrap();
        let mut k = [0f32; 4];
        store
            .read_f32(0, KvBuffer::Key, &slots([3, 4]), &mut k)
            .unwrap();
        assert_eq!(k, [3., 3., 2., 2.]);
        store
            .write_raw(0, KvBuffer::Value, &slots([2, 2]), &[1, 2, 3, 4])
            .unwrap();
        let mut raw = [0u8; 2];
        store
            .read_raw(0, KvBuffer::Value, &slots([2]), &mut raw)
            .unwrap();
        assert_eq!(raw, [3, 4]);
    }

    #[test]
    fn fp8_scales_stretch_the_range_per_layer() {
        for dtype in [KvDtype::Fp8E4m3, KvDtype::Fp8E5m2] {
            let shape = KvShape::mha(2, 4, 2, 2, dtype).unwrap();
            let layout = KvLayout::new(shape, 4, 16).unwrap();
            let mut store = HostKvStore::new(layout).unwrap();
            let ss = slots([13, 2, 7, 19, 4]);
            let mut seed = SplitMix64::new(99);
            let (k0s, v0s, k1s, v1s) = (64.0, 256.0, 0.5, 2.0);
            store.set_scales(0, k0s, v0s).unwrap();
            store.set_scales(1, k1s, v1s).unwrap();
            assert_eq!(store.scales(0).unwrap(), (k0s, v0s));
            assert_eq!(store.scales(1).unwrap(), (k1s, v1s));
            let k0 = values(dtype, 5 * 8, k0s, &mut seed);
            let v0 = values(dtype, 5 * 4, v0s, &mut seed);
            let k1 = values(dtype, 5 * 8, k1s, &mut seed);
            let v1 = values(dtype, 5 * 4, v1s, &mut seed);
            if dtype == KvDtype::Fp8E4m3 {
                // Values beyond the format's 448 survive through the scale.
                assert!(k0.iter().any(|x| x.abs() > 448.0));
                assert!(v0.iter().any(|x| x.abs() > 448.0));
            }
            store.write_kv(0, &ss, &k0, &v0).unwrap();
            store.write_kv(1, &ss, &k1, &v1).unwrap();
            let read = |store: &HostKvStore, layer, b, n| {
                let mut out = vec![0f32; n];
                store.read_f32(layer, b, &ss, &mut out).unwrap();
                out
            };
            assert_close(dtype, &k0, &read(&store, 0, KvBuffer::Key, 40), "k0");
            assert_close(dtype, &v0, &read(&store, 0, KvBuffer::Value, 20), "v0");
            assert_close(dtype, &k1, &read(&store, 1, KvBuffer::Key, 40), "k1");
            assert_close(dtype, &v1, &read(&store, 1, KvBuffer::Value, 20), "v1");
            // The stored bytes are fp8(x / scale): reading with scale 1 gives x / scale.
            store.set_scales(0, 1.0, 1.0).unwrap();
            let unscaled: Vec<f32> = k0.iter().map(|x| x / k0s).collect();
            assert_close(
                dtype,
                &unscaled,
                &read(&store, 0, KvBuffer::Key, 40),
                "k0/s",
            );
            // Changing layer 0's scales did not touch layer 1.
            assert_close(dtype, &k1, &read(&store, 1, KvBuffer::Key, 40), "k1 again");
            assert_eq!(store.scales(1).unwrap(), (k1s, v1s));
            // Without a scale, large values saturate.
            store.write_kv(0, &ss[..1], &[1e6; 8], &[-1e6; 4]).unwrap();
            let max = if dtype == KvDtype::Fp8E4m3 {
                448.0
            } else {
                57344.0
            };
            let mut out = [0f32; 8];
            store
                .read_f32(0, KvBuffer::Key, &ss[..1], &mut out)
                .unwrap();
            assert_eq!(out, [max; 8]);
        }
    }

    #[test]
    fn raw_round_trip_every_kind() {
        let mut seed = SplitMix64::new(5);
        for dtype in [KvDtype::Bf16, KvDtype::Fp8E5m2] {
            for shape in shapes(dtype) {
                let layout = KvLayout::new(shape, 4, 16).unwrap();
                let mut store = HostKvStore::new(layout).unwrap();
                let ss = slots(permutation(layout.rows(), &mut seed).into_iter().take(9));
                for layer in 0..shape.layers as usize {
                    for &b in shape.buffers() {
                        let bytes = random_bytes(9 * shape.row_bytes(b), &mut seed);
                        store.write_raw(layer, b, &ss, &bytes).unwrap();
                        let mut out = vec![0u8; bytes.len()];
                        store.read_raw(layer, b, &ss, &mut out).unwrap();
                        assert_eq!(out, bytes, "{shape} layer {layer} {}", b.name());
                    }
                }
            }
        }
    }

    /// Checks `copy_slots(src, dst)` against a model that reads everything first.
    fn check_copy(layout: KvLayout, src: &[usize], dst: &[usize], seed: &mut SplitMix64) {
        let mut store = random_store(layout, seed);
        let (mut want, _, _) = dump(&store);
        let shape = layout.shape;
        let nbuf = shape.buffers().len();
        for (i, rows) in want.iter_mut().enumerate() {
            let rb = shape.row_bytes(shape.buffers()[i % nbuf]);
            let old = rows.clone();
            for (&s, &d) in src.iter().zip(dst) {
                rows[d * rb..(d + 1) * rb].copy_from_slice(&old[s * rb..(s + 1) * rb]);
            }
        }
        store
            .copy_slots(&slots(src.iter().copied()), &slots(dst.iter().copied()))
            .unwrap();
        assert_eq!(dump(&store).0, want, "{shape}: copy {src:?} -> {dst:?}");
    }

    #[test]
    fn copy_slots_reads_everything_before_writing() {
        let mut seed = SplitMix64::new(17);
        for dtype in [KvDtype::F32, KvDtype::Fp8E4m3] {
            for shape in shapes(dtype) {
                for page_size in [1u32, 4] {
                    let layout = KvLayout::new(shape, page_size, 8 * page_size as usize).unwrap();
                    // Shift up by one and down by one (overlapping), a swap, a rotation,
                    // disjoint scattered rows, and nothing.
                    check_copy(layout, &[1, 2, 3, 4], &[2, 3, 4, 5], &mut seed);
                    check_copy(layout, &[2, 3, 4, 5], &[1, 2, 3, 4], &mut seed);
                    check_copy(layout, &[1, 3], &[3, 1], &mut seed);
                    check_copy(layout, &[1, 2, 3], &[2, 3, 1], &mut seed);
                    check_copy(layout, &[5, 1, 4], &[0, 7, 2], &mut seed);
                    check_copy(layout, &[], &[], &mut seed);
                }
            }
        }
    }

    /// Random slots, with repeats, from the whole store (padding row included).
    fn random_slots(layout: KvLayout, n: usize, seed: &mut SplitMix64) -> Vec<Slot> {
        (0..n)
            .map(|_| Slot(seed.below(layout.rows()) as u32))
            .collect()
    }

    /// One random mutation, applied to both stores (valid or not: both must answer alike).
    fn random_op(stores: [&mut HostKvStore; 2], seed: &mut SplitMix64) {
        let layout = *stores[0].layout();
        let shape = layout.shape;
        let layer = seed.below(shape.layers as usize + 1); // sometimes out of range
        let n = 1 + seed.below(6);
        let ss = random_slots(layout, n, seed);
        let op = seed.below(5);
        let results: Vec<Result<()>> = match op {
            0 => {
                let k = values(shape.dtype, n * shape.row_elems(KvBuffer::Key), 1.0, seed);
                let v = values(shape.dtype, n * shape.row_elems(KvBuffer::Value), 1.0, seed);
                stores.map(|s| s.write_kv(layer, &ss, &k, &v)).into()
            }
            1 => {
                let b = shape.buffers()[seed.below(shape.buffers().len())];
                let bytes = random_bytes(n * shape.row_bytes(b), seed);
                stores.map(|s| s.write_raw(layer, b, &ss, &bytes)).into()
            }
            2 => {
                let dst = random_slots(layout, n, seed);
                stores.map(|s| s.copy_slots(&ss, &dst)).into()
            }
            3 => {
                let pages: Vec<Page> = (0..1 + seed.below(3))
                    .map(|_| Page(1 + seed.below(layout.pages()) as u32))
                    .collect();
                let data = random_bytes(pages.len() * layout.page_bytes(), seed);
                stores.map(|s| s.write_pages(&pages, &data)).into()
            }
            _ => {
                let (k, v) = (0.5 + seed.next_f32(), 0.5 + seed.next_f32());
                stores.map(|s| s.set_scales(layer, k, v)).into()
            }
        };
        assert_eq!(results[0], results[1], "op {op}");
    }

    #[test]
    fn a_store_over_host_memory_behaves_byte_for_byte_as_the_heap_store() {
        use crate::host_memory::tests::TestMemory;
        let mut seed = SplitMix64::new(99);
        for dtype in [KvDtype::F32, KvDtype::Fp8E4m3] {
            for shape in shapes(dtype) {
                for page_size in [1u32, 4] {
                    let layout = KvLayout::new(shape, page_size, 6 * page_size as usize).unwrap();
                    let mut heap = HostKvStore::new(layout).unwrap();
                    // One spare byte, dirty memory: the store zeroes what it uses.
                    let mem = TestMemory::new(layout.total_bytes() + 1, 0xa5);
                    let base = mem.0.as_ptr() as usize;
                    let mut foreign = HostKvStore::with_memory(layout, Box::new(mem)).unwrap();
                    assert!(foreign.is_foreign_memory() && !heap.is_foreign_memory());
                    assert_eq!(dump(&heap), dump(&foreign));
                    for _ in 0..200 {
                        random_op([&mut heap, &mut foreign], &mut seed);
                        assert_eq!(dump(&heap), dump(&foreign), "{shape} P={page_size}");
                    }
                    // The regions tile the memory from its first byte, in store order.
                    let regions = foreign.memory_regions();
                    assert_eq!(regions.len(), heap.memory_regions().len());
                    let mut spans: Vec<(usize, usize)> = regions
                        .iter()
                        .map(|r| (r.addr - base, r.len_bytes))
                        .collect();
                    spans.sort();
                    let mut end = 0;
                    for (off, len) in spans {
                        assert_eq!(off, end);
                        end += len;
                    }
                    assert_eq!(end, layout.total_bytes());
                    // Reading through `layer_buffer` sees the same rows.
                    let b = shape.buffers()[0];
                    assert_eq!(
                        heap.layer_buffer(0, b).unwrap(),
                        foreign.layer_buffer(0, b).unwrap()
                    );
                    // Clone copies to the heap: a separate, equal store.
                    let mut copy = foreign.clone();
                    assert!(!copy.is_foreign_memory());
                    assert_eq!(dump(&copy), dump(&foreign));
                    let all = slots(0..layout.rows());
                    let ones = vec![1u8; all.len() * shape.row_bytes(b)];
                    copy.write_raw(0, b, &all, &ones).unwrap();
                    assert_eq!(dump(&heap), dump(&foreign));
                }
            }
        }
    }

    #[test]
    fn memory_shorter_than_the_layout_is_refused() {
        use crate::host_memory::tests::TestMemory;
        let layout = KvLayout::new(shapes(KvDtype::F16)[0], 4, 16).unwrap();
        let got = layout.total_bytes() - 1;
        let err = HostKvStore::with_memory(layout, Box::new(TestMemory::new(got, 0))).unwrap_err();
        assert_eq!(
            err,
            KvPoolError::MemoryTooSmall {
                needed: layout.total_bytes(),
                got
            }
        );
        assert_eq!(
            err.to_string(),
            format!(
                "the KV store needs {} bytes of memory, the memory given has {got}",
                got + 1
            )
        );
    }

    #[test]
    fn pages_move_between_stores_at_other_ids() {
        let mut seed = SplitMix64::new(23);
        for dtype in [KvDtype::F16, KvDtype::Fp8E4m3] {
            for shape in shapes(dtype) {
                for page_size in [1u32, 4] {
                    let p = page_size as usize;
                    let a_layout = KvLayout::new(shape, page_size, 4 * p).unwrap();
                    let b_layout = KvLayout::new(shape, page_size, 6 * p).unwrap();
                    let a = random_store(a_layout, &mut seed);
                    let mut b = HostKvStore::new(b_layout).unwrap();
                    let (from, to) = ([3u32, 1, 4], [5u32, 2, 6]);
                    let from: Vec<Page> = from.into_iter().map(Page).collect();
                    let to: Vec<Page> = to.into_iter().map(Page).collect();
                    let mut packed = vec![0u8; 3 * a_layout.page_bytes()];
                    a.read_pages(&from, &mut packed).unwrap();
                    b.write_pages(&to, &packed).unwrap();
                    for layer in 0..shape.layers as usize {
                        for &buf in shape.buffers() {
                            let rb = shape.row_bytes(buf);
                            let read = |s: &HostKvStore, pages: &[Page]| {
                                let ss: Vec<Slot> =
                                    pages.iter().flat_map(|pg| pg.slots(page_size)).collect();
                                let mut out = vec![0u8; ss.len() * rb];
                                s.read_raw(layer, buf, &ss, &mut out).unwrap();
                                out
                            };
                            assert_eq!(read(&a, &from), read(&b, &to), "{shape} P={p}");
                            let untouched: Vec<Page> = [0, 1, 3, 4].map(Page).to_vec();
                            assert!(read(&b, &untouched).iter().all(|&x| x == 0));
                        }
                    }
                    // Writing the same pages back yields the same packed bytes.
                    let mut again = vec![0u8; packed.len()];
                    b.read_pages(&to, &mut again).unwrap();
                    assert_eq!(again, packed);
                }
            }
        }
    }

    #[test]
    fn layer_buffer_borrows_the_rows_read_raw_returns() {
        let mut seed = SplitMix64::new(77);
        for shape in shapes(KvDtype::F16) {
            let layout = KvLayout::new(shape, 4, 16).unwrap();
            let store = random_store(layout, &mut seed);
            for layer in 0..shape.layers as usize {
                for &b in shape.buffers() {
                    let rb = shape.row_bytes(b);
                    let all = slots(0..layout.rows());
                    let mut want = vec![0u8; all.len() * rb];
                    store.read_raw(layer, b, &all, &mut want).unwrap();
                    assert_eq!(store.layer_buffer(layer, b).unwrap(), &want[..]);
                }
            }
            assert_eq!(
                store.layer_buffer(shape.layers as usize, KvBuffer::Key),
                Err(KvPoolError::LayerOutOfRange {
                    layer: shape.layers as usize,
                    layers: shape.layers as usize
                })
            );
        }
        let mla = KvLayout::new(KvShape::mla(6, 2, 1, KvDtype::F32).unwrap(), 1, 8).unwrap();
        let store = HostKvStore::new(mla).unwrap();
        assert!(matches!(
            store.layer_buffer(0, KvBuffer::Value),
            Err(KvPoolError::Unsupported(_))
        ));
    }

    #[test]
    fn memory_regions_order_and_sizes() {
        for shape in shapes(KvDtype::Bf16) {
            let layout = KvLayout::new(shape, 4, 16).unwrap();
            let store = HostKvStore::new(layout).unwrap();
            let regions = store.memory_regions();
            let want: Vec<(KvBuffer, usize)> = shape
                .buffers()
                .iter()
                .flat_map(|&b| (0..shape.layers as usize).map(move |l| (b, l)))
                .collect();
            assert_eq!(
                regions
                    .iter()
                    .map(|r| (r.buffer, r.layer))
                    .collect::<Vec<_>>(),
                want
            );
            for r in &regions {
                assert_eq!(r.len_bytes, layout.buffer_bytes(r.buffer));
                assert_eq!(r.item_len, layout.page_bytes_per_layer(r.buffer));
                assert_eq!(r.len_bytes, r.item_len * (layout.pages() + 1));
            }
            let total: usize = regions.iter().map(|r| r.len_bytes).sum();
            assert_eq!(total, layout.total_bytes());
            // Moving the store does not move its buffers.
            let moved = Box::new(store);
            assert_eq!(moved.memory_regions(), regions);
        }
    }

    /// `op` must fail with `want` and leave every byte and scale of `store` as it was.
    fn assert_refused(
        store: &mut HostKvStore,
        want: KvPoolError,
        op: impl FnOnce(&mut HostKvStore) -> Result<()>,
    ) {
        let before = dump(store);
        assert_eq!(op(store), Err(want));
        assert!(dump(store) == before, "a refused call changed the store");
    }

    fn len_err(what: &'static str, expected: usize, got: usize) -> KvPoolError {
        KvPoolError::LengthMismatch {
            what,
            expected,
            got,
        }
    }

    #[test]
    fn bad_inputs_are_refused_and_change_nothing() {
        use KvBuffer::{Key, Label, Value};
        let mut seed = SplitMix64::new(31);
        // MHA: 2 layers, K row 8 elems (16 bytes), V row 4 elems (8 bytes), P = 4, 20 rows.
        let mha = KvLayout::new(KvShape::mha(2, 4, 2, 2, KvDtype::F16).unwrap(), 4, 16).unwrap();
        let mut s = random_store(mha, &mut seed);
        let oob = KvPoolError::SlotOutOfRange {
            slot: Slot(20),
            first: 0,
            end: 20,
        };
        let good = slots([1, 7, 2]);
        let bad = slots([1, 7, 2, 20]);
        let (k3, v3) = (vec![1.0f32; 24], vec![1.0f32; 12]);
        let (k4, v4) = (vec![1.0f32; 32], vec![1.0f32; 16]);
        let layer_err = KvPoolError::LayerOutOfRange {
            layer: 2,
            layers: 2,
        };
        assert_refused(&mut s, layer_err.clone(), |s| {
            s.write_kv(2, &good, &k3, &v3)
        });
        assert_refused(&mut s, oob.clone(), |s| s.write_kv(1, &bad, &k4, &v4));
        assert_refused(&mut s, len_err("k", 24, 23), |s| {
            s.write_kv(0, &good, &k3[..23], &v3)
        });
        assert_refused(&mut s, len_err("v", 12, 16), |s| {
            s.write_kv(0, &good, &k3, &v4)
        });
        let no_labels = KvPoolError::Unsupported(
            "MHA has no label buffer: labels exist only in DoubleSparse layouts".into(),
        );
        assert_refused(&mut s, no_labels.clone(), |s| s.write_labels(0, &good, &[]));
        assert_refused(&mut s, no_labels.clone(), |s| {
            s.write_raw(0, Label, &good, &[])
        });
        assert_refused(&mut s, no_labels.clone(), |s| {
            s.read_raw(0, Label, &good, &mut [])
        });
        assert_refused(&mut s, no_labels, |s| s.read_f32(0, Label, &good, &mut []));
        assert_refused(&mut s, layer_err.clone(), |s| {
            s.write_raw(2, Key, &good, &[0; 48])
        });
        assert_refused(&mut s, oob.clone(), |s| s.write_raw(0, Key, &bad, &[0; 64]));
        assert_refused(&mut s, len_err("bytes", 24, 48), |s| {
            s.write_raw(0, Value, &good, &[0; 48])
        });
        assert_refused(&mut s, len_err("out", 24, 25), |s| {
            s.read_f32(0, Key, &good, &mut [0.0; 25])
        });
        assert_refused(&mut s, oob.clone(), |s| {
            s.read_f32(0, Key, &bad, &mut [0.0; 32])
        });
        assert_refused(&mut s, layer_err.clone(), |s| {
            s.read_raw(2, Key, &good, &mut [0; 48])
        });
        assert_refused(&mut s, len_err("out", 48, 0), |s| {
            s.read_raw(0, Key, &good, &mut [])
        });
        assert_refused(&mut s, len_err("dst", 3, 4), |s| s.copy_slots(&good, &bad));
        assert_refused(&mut s, oob.clone(), |s| {
            s.copy_slots(&slots([3, 4, 5, 6]), &bad)
        });
        assert_refused(&mut s, oob.clone(), |s| {
            s.copy_slots(&bad, &slots([3, 4, 5, 6]))
        });
        let pb = mha.page_bytes();
        let page_err = |p: u32| KvPoolError::PageOutOfRange {
            page: Page(p),
            last: 4,
        };
        assert_refused(&mut s, page_err(0), |s| {
            s.read_pages(&[Page(1), Page(0)], &mut vec![0; 2 * pb])
        });
        assert_refused(&mut s, page_err(5), |s| {
            s.write_pages(&[Page(1), Page(2), Page(5)], &vec![7; 3 * pb])
        });
        assert_refused(&mut s, page_err(0), |s| {
            s.write_pages(&[Page(0)], &vec![7; pb])
        });
        assert_refused(&mut s, len_err("data", 2 * pb, 2 * pb - 1), |s| {
            s.write_pages(&[Page(1), Page(2)], &vec![7; 2 * pb - 1])
        });
        assert_refused(&mut s, len_err("out", pb, 0), |s| {
            s.read_pages(&[Page(1)], &mut [])
        });
        let scale_err = |field: &'static str, v: f32| KvPoolError::InvalidConfig {
            field,
            reason: format!("must be finite and > 0, got {v}"),
        };
        assert_refused(&mut s, layer_err, |s| s.set_scales(2, 1.0, 1.0));
        assert_refused(&mut s, scale_err("k_scale", 0.0), |s| {
            s.set_scales(0, 0.0, 1.0)
        });
        assert_refused(&mut s, scale_err("v_scale", -1.0), |s| {
            s.set_scales(0, 1.0, -1.0)
        });
        assert_refused(&mut s, scale_err("k_scale", f32::NAN), |s| {
            s.set_scales(1, f32::NAN, 1.0)
        });
        assert_refused(&mut s, scale_err("v_scale", f32::INFINITY), |s| {
            s.set_scales(1, 2.0, f32::INFINITY)
        });
        assert_eq!(
            s.scales(2),
            Err(KvPoolError::LayerOutOfRange {
                layer: 2,
                layers: 2
            })
        );
        // The padding page is a valid write target.
        s.write_kv(0, &slots([0, 3]), &k3[..16], &v3[..8]).unwrap();

        // MLA: no value buffer.
        let mla = KvLayout::new(KvShape::mla(6, 2, 2, KvDtype::Fp8E4m3).unwrap(), 1, 8).unwrap();
        let mut s = random_store(mla, &mut seed);
        let no_v_write = KvPoolError::Unsupported(
            "MLA has no value buffer: the value is the first kv_lora_rank dims of the latent; \
             pass the latent rows as k and an empty v"
                .into(),
        );
        let no_v = KvPoolError::Unsupported(
            "MLA has no value buffer: the value is the first kv_lora_rank dims of the latent"
                .into(),
        );
        assert_refused(&mut s, no_v_write, |s| {
            s.write_kv(0, &good, &k3, &[1.0; 18])
        });
        assert_refused(&mut s, no_v.clone(), |s| {
            s.read_f32(0, Value, &good, &mut [])
        });
        assert_refused(&mut s, no_v.clone(), |s| s.write_raw(0, Value, &good, &[]));
        assert_refused(&mut s, no_v, |s| s.read_raw(1, Value, &good, &mut []));
        assert_refused(&mut s, len_err("k", 24, 23), |s| {
            s.write_kv(0, &good, &k3[..23], &[])
        });
        let mla_oob = KvPoolError::SlotOutOfRange {
            slot: Slot(9),
            first: 0,
            end: 9,
        };
        assert_refused(&mut s, mla_oob, |s| {
            s.write_kv(0, &slots([8, 9]), &k3[..16], &[])
        });
        s.write_kv(1, &slots([8, 0]), &k3[..16], &[]).unwrap();

        // DoubleSparse: labels are checked like K and V.
        let ds = KvLayout::new(
            KvShape::double_sparse(2, 4, 2, 3, 2, KvDtype::Bf16).unwrap(),
            2,
            8,
        )
        .unwrap();
        let mut s = random_store(ds, &mut seed);
        assert_refused(&mut s, len_err("labels", 18, 12), |s| {
            s.write_labels(0, &good, &[1.0; 12])
        });
        let ds_oob = KvPoolError::SlotOutOfRange {
            slot: Slot(10),
            first: 0,
            end: 10,
        };
        assert_refused(&mut s, ds_oob, |s| {
            s.write_labels(1, &slots([2, 10]), &[1.0; 12])
        });
        assert_refused(
            &mut s,
            KvPoolError::LayerOutOfRange {
                layer: 3,
                layers: 2,
            },
            |s| s.write_labels(3, &good, &[1.0; 18]),
        );
        s.write_labels(1, &good, &[1.0; 18]).unwrap();
    }

    /// Renders the memory regions of a layout, addresses replaced by buffer names (after
    /// checking that the buffers are distinct and do not overlap).
    fn render_regions(layout: KvLayout) -> String {
        let store = HostKvStore::new(layout).unwrap();
        let regions = store.memory_regions();
        let mut spans: Vec<(usize, usize)> = regions
            .iter()
            .map(|r| (r.addr, r.addr + r.len_bytes))
            .collect();
        spans.sort();
        assert!(
            spans.windows(2).all(|w| w[0].1 <= w[1].0),
            "regions overlap"
        );
        let mut s = format!("{}", layout.shape);
        writeln!(s, " page_size={} size={}", layout.page_size, layout.size).unwrap();
        for (i, r) in regions.iter().enumerate() {
            writeln!(
                s,
                "  [{i}] layer={} buffer={:<5} addr=<{}{}> len_bytes={} item_len={}",
                r.layer,
                r.buffer.name(),
                r.buffer.name(),
                r.layer,
                r.len_bytes,
                r.item_len
            )
            .unwrap();
        }
        s
    }

    #[test]
    fn memory_regions_snapshot() {
        let mut s = String::new();
        for shape in [
            KvShape::mha(2, 8, 4, 3, KvDtype::Bf16).unwrap(),
            KvShape::mla(12, 4, 2, KvDtype::Fp8E4m3).unwrap(),
            KvShape::double_sparse(2, 8, 4, 3, 2, KvDtype::F32).unwrap(),
        ] {
            s += &render_regions(KvLayout::new(shape, 4, 16).unwrap());
        }
        insta::assert_snapshot!("memory_regions", s);
    }

    /// Fills every row with a one-byte tag naming its layer, buffer and slot, reads pages back
    /// packed, and renders which row sits at which offset of the packed bytes.
    fn render_packed(layout: KvLayout, pages: &[Page]) -> String {
        let shape = layout.shape;
        assert_eq!(shape.dtype.bytes(), 1);
        assert!(layout.rows() <= 16 && shape.layers <= 4);
        let tag = |layer: usize, bi: usize, slot: usize| (layer << 6 | bi << 4 | slot) as u8;
        let mut store = HostKvStore::new(layout).unwrap();
        for layer in 0..shape.layers as usize {
            for (bi, &b) in shape.buffers().iter().enumerate() {
                let rb = shape.row_bytes(b);
                let bytes: Vec<u8> = (0..layout.rows())
                    .flat_map(|slot| std::iter::repeat_n(tag(layer, bi, slot), rb))
                    .collect();
                store
                    .write_raw(layer, b, &slots(0..layout.rows()), &bytes)
                    .unwrap();
            }
        }
        let mut packed = vec![0u8; pages.len() * layout.page_bytes()];
        store.read_pages(pages, &mut packed).unwrap();
        let mut s = format!("{}", layout.shape);
        writeln!(
            s,
            " page_size={} page_bytes={} pages={pages:?}",
            layout.page_size,
            layout.page_bytes()
        )
        .unwrap();
        let mut off = 0;
        while off < packed.len() {
            let t = packed[off];
            let (layer, bi, slot) = ((t >> 6) as usize, (t >> 4 & 3) as usize, (t & 15) as usize);
            let b = shape.buffers()[bi];
            let rb = shape.row_bytes(b);
            assert!(
                packed[off..off + rb].iter().all(|&x| x == t),
                "torn row at {off}"
            );
            if off % layout.page_bytes() == 0 {
                writeln!(s, "{}:", Page(slot as u32 / layout.page_size)).unwrap();
            }
            writeln!(
                s,
                "  bytes {off:>3}..{:>3}  layer {layer} {:<5} slot {slot}",
                off + rb,
                b.name()
            )
            .unwrap();
            off += rb;
        }
        s
    }

    #[test]
    fn canonical_page_format_snapshot() {
        let mha = KvShape::mha(1, 3, 2, 2, KvDtype::Fp8E4m3).unwrap();
        let ds = KvShape::double_sparse(1, 3, 2, 1, 2, KvDtype::Fp8E5m2).unwrap();
        let mut s = render_packed(KvLayout::new(mha, 2, 4).unwrap(), &[Page(2), Page(1)]);
        s += &render_packed(KvLayout::new(ds, 2, 4).unwrap(), &[Page(1)]);
        insta::assert_snapshot!("canonical_page_format", s);
    }
}
