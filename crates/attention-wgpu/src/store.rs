//! The device KV store: kv-pool's [`KvStore`] over wgpu buffers.
//!
//! Each layer's K, V (and label) buffer holds `layout.rows()` rows in the layout's dtype, row
//! `s` for slot `s`, exactly as [`kv_pool::HostKvStore`] lays them out, so raw reads and the
//! canonical packed page format are byte-identical to the host store's. A buffer larger than
//! the adapter's storage-binding limit is split into chunks of whole rows, one wgpu buffer
//! each; kernels reach a row through a generated `switch` over the chunks.
//!
//! Only f32 and f16 (on adapters with f16 shaders) are stored; other dtypes are a typed
//! [`AttentionError::Unsupported`]. Every method validates with [`kv_pool::store::check`]
//! first, so bad input gets the host store's errors and leaves the store untouched. Writes
//! run as kernels (converting f32 to the store dtype, or copying raw bits), reads gather rows
//! on the device into a compact buffer and map it.
//!
//! [`WgpuKvStore::device_rows`] hands out a [`WgpuKvRows`]: the same buffers (shared, freed with
//! the last holder) for another thread to read and write raw rows through the same queue, so
//! its copies are ordered with the store owner's kernels.

use std::fmt;
use std::sync::Arc;

use attention::AttentionError;
use kv_pool::dtype::decode_to_f32;
use kv_pool::store::check;
use kv_pool::{
    DeviceKvRows, KvBuffer, KvDtype, KvLayout, KvStore, MemoryRegion, Page, Result, Slot,
};

use crate::device::WgpuError;
use crate::dispatch::{Dispatch, Runner};
use crate::kernels::{self, grid, StoreElem, StoreView};
use crate::plan::write_list;

/// Storage bindings an attention kernel uses besides the K and V chunks.
const OTHER_BINDINGS: u32 = 4;

/// One layer's buffer of one kind, as chunks of whole rows.
pub(crate) struct LayerBuffer {
    pub(crate) view: StoreView,
    pub(crate) chunks: Vec<wgpu::Buffer>,
}

impl LayerBuffer {
    fn refs(&self) -> impl Iterator<Item = &wgpu::Buffer> {
        self.chunks.iter()
    }
}

/// A store's device buffers and the operations on their rows that need no `&mut`: shared by
/// the [`WgpuKvStore`] and the [`WgpuKvRows`] handles it hands out, and freed with the last.
pub(crate) struct StoreBuffers {
    pub(crate) runner: Arc<Runner>,
    layout: KvLayout,
    /// Buffer `b` (index in `shape.buffers()`) of layer `l` is `buffers[l × nbuf + b]`.
    buffers: Vec<LayerBuffer>,
}

/// A KV store in device memory (see the [module docs](self)).
pub struct WgpuKvStore {
    inner: Arc<StoreBuffers>,
    scales: Vec<(f32, f32)>,
}

/// A handle on a [`WgpuKvStore`]'s rows for another thread (kv-pool's [`DeviceKvRows`]): the
/// hierarchical cache's controller copies rows between the device and its host pool through
/// it while the store's owner runs forward passes. Reads and writes are kernels and copies on
/// the store's own queue, so they are ordered with the owner's work (the queue runs
/// submissions in order); the buffers live as long as the store or any handle.
#[derive(Clone)]
pub struct WgpuKvRows {
    inner: Arc<StoreBuffers>,
}

impl fmt::Debug for WgpuKvStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuKvStore")
            .field("layout", &self.inner.layout)
            .field("chunks_per_buffer", &self.chunks_per_buffer())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for WgpuKvRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuKvRows")
            .field("layout", &self.inner.layout)
            .finish_non_exhaustive()
    }
}

/// The device element type of a store dtype, or why there is none.
pub(crate) fn store_elem(dtype: KvDtype, f16: bool) -> std::result::Result<StoreElem, String> {
    match dtype {
        KvDtype::F32 => Ok(StoreElem::F32),
        KvDtype::F16 if f16 => Ok(StoreElem::F16),
        KvDtype::F16 => {
            Err("float16 KV stores need f16 shaders (SHADER_F16), which this adapter lacks".into())
        }
        d => Err(format!(
            "{d} KV stores are not supported on wgpu (float32, and float16 where the adapter \
             has f16 shaders)"
        )),
    }
}

impl WgpuKvStore {
    /// Allocates a zeroed store for `layout`, chunking each per-layer buffer into pieces of at
    /// most `max_binding` bytes.
    pub(crate) fn new(
        runner: Arc<Runner>,
        layout: KvLayout,
        max_binding: u64,
    ) -> attention::Result<Self> {
        let report = &runner.gpu.report;
        let elem =
            store_elem(layout.shape.dtype, report.f16).map_err(AttentionError::Unsupported)?;
        let shape = layout.shape;
        let rows = layout.rows() as u64;
        // The attention kernel binds every chunk of K and V (labels are not attended on this
        // backend) beside OTHER_BINDINGS buffers: the chunks each buffer may have.
        let attended = shape.buffers().len().min(2) as u32;
        let chunk_budget =
            u64::from(report.max_storage_buffers.saturating_sub(OTHER_BINDINGS) / attended);
        let adapter_binding = runner.gpu.binding_bytes;
        let mut views = Vec::new();
        for &b in shape.buffers() {
            let row_bytes = shape.row_bytes(b) as u64;
            let mut rows_per_chunk = (max_binding / row_bytes).min(rows).min(u32::MAX as u64);
            if rows_per_chunk > 0
                && chunk_budget > 0
                && rows.div_ceil(rows_per_chunk) > chunk_budget
            {
                // Chunks of the configured size would need more bindings than a kernel has
                // (16 storage buffers on GL): grow them, within the adapter's own limit.
                let fitting = rows.div_ceil(chunk_budget);
                let largest = (adapter_binding / row_bytes).min(u32::MAX as u64);
                rows_per_chunk = rows_per_chunk.max(fitting.min(largest));
            }
            if rows_per_chunk == 0 {
                return Err(WgpuError::TooLarge {
                    what: "one KV row",
                    bytes: row_bytes,
                    limit: max_binding,
                    limit_name: "max_storage_buffer_binding_size",
                }
                .into());
            }
            views.push(StoreView {
                elem,
                row_elems: shape.row_elems(b) as u32,
                rows_per_chunk: rows_per_chunk as u32,
                chunks: rows.div_ceil(rows_per_chunk) as u32,
            });
        }
        let bound: u32 = views.iter().take(2).map(|v| v.chunks).sum::<u32>() + OTHER_BINDINGS;
        if bound > report.max_storage_buffers {
            return Err(AttentionError::Unsupported(format!(
                "a layer of this KV layout needs {bound} storage bindings in one attention \
                 kernel ({} KiB per buffer in chunks of at most {} KiB), above the adapter's \
                 {}",
                layout.buffer_bytes(KvBuffer::Key) >> 10,
                max_binding >> 10,
                report.max_storage_buffers
            )));
        }
        let mut buffers = Vec::with_capacity(shape.layers as usize * views.len());
        for _ in 0..shape.layers {
            for (&b, &view) in shape.buffers().iter().zip(&views) {
                let row_bytes = shape.row_bytes(b) as u64;
                let mut chunks = Vec::with_capacity(view.chunks as usize);
                for c in 0..view.chunks as u64 {
                    let first = c * view.rows_per_chunk as u64;
                    let n = (rows - first).min(view.rows_per_chunk as u64);
                    chunks.push(runner.alloc("kv store", n * row_bytes)?);
                }
                buffers.push(LayerBuffer { view, chunks });
            }
        }
        Ok(WgpuKvStore {
            inner: Arc::new(StoreBuffers {
                runner,
                layout,
                buffers,
            }),
            scales: vec![(1.0, 1.0); shape.layers as usize],
        })
    }

    /// The device the store lives on.
    pub(crate) fn runner(&self) -> &Arc<Runner> {
        &self.inner.runner
    }

    /// The device buffer of a validated layer and kind.
    pub(crate) fn buffer(&self, layer: usize, buffer: KvBuffer) -> &LayerBuffer {
        self.inner.buffer(layer, buffer)
    }

    /// How many wgpu buffers each per-layer buffer is split into.
    pub fn chunks_per_buffer(&self) -> usize {
        self.inner.buffers.first().map_or(0, |b| b.chunks.len())
    }

    /// A handle on the store's rows for another thread (see [`WgpuKvRows`]).
    pub fn device_rows(&self) -> WgpuKvRows {
        WgpuKvRows {
            inner: self.inner.clone(),
        }
    }

    /// The parts of one page in the canonical packed format, in order: `(layer, buffer,
    /// offset within the page, bytes)`.
    fn page_parts(&self) -> Vec<(usize, KvBuffer, usize, usize)> {
        let shape = self.inner.layout.shape;
        let p = self.inner.layout.page_size as usize;
        let mut parts = Vec::new();
        let mut off = 0;
        for layer in 0..shape.layers as usize {
            for &b in shape.buffers() {
                let n = p * shape.row_bytes(b);
                parts.push((layer, b, off, n));
                off += n;
            }
        }
        parts
    }

    /// The slots of `pages`, each page's `P` rows in order.
    fn page_slots(&self, pages: &[Page]) -> Vec<Slot> {
        let p = self.inner.layout.page_size;
        pages
            .iter()
            .flat_map(|pg| (0..p).map(move |i| Slot(pg.0 * p + i)))
            .collect()
    }
}

impl StoreBuffers {
    /// The device buffer of a validated layer and kind.
    fn buffer(&self, layer: usize, buffer: KvBuffer) -> &LayerBuffer {
        let bufs = self.layout.shape.buffers();
        let b = bufs
            .iter()
            .position(|&x| x == buffer)
            .expect("buffer validated before use");
        &self.buffers[layer * bufs.len() + b]
    }

    /// Writes f32 rows `src` (device, `[n, row_elems]`) at `slots` through the converting
    /// kernel. Validated by the caller.
    fn write_f32(&self, layer: usize, buffer: KvBuffer, slots: &[Slot], src: &[f32]) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let src = self
            .runner
            .upload_bytes("kv rows", bytemuck::cast_slice(src))?;
        let list = write_list(slots);
        let idx = self.runner.upload_u32("kv slots", &list)?;
        let lb = self.buffer(layer, buffer);
        let kernel = kernels::store::write_rows(lb.view);
        let mut bufs: Vec<&wgpu::Buffer> = lb.refs().collect();
        bufs.extend([&src, &idx]);
        self.runner.run(&[Dispatch {
            kernel: &kernel,
            buffers: bufs,
            groups: grid(list[0] as u64 * lb.view.row_elems as u64),
        }])?;
        Ok(())
    }

    /// Gathers raw rows at `slots` into a compact device buffer (the store's packing).
    fn gather(&self, layer: usize, buffer: KvBuffer, slots: &[Slot]) -> Result<wgpu::Buffer> {
        let lb = self.buffer(layer, buffer);
        let bytes = slots.len() as u64 * self.layout.shape.row_bytes(buffer) as u64;
        let out = self.runner.alloc("kv gather", bytes)?;
        let mut list = vec![slots.len() as u32];
        list.extend(slots.iter().map(|s| s.0));
        let idx = self.runner.upload_u32("kv slots", &list)?;
        let kernel = kernels::store::gather_raw(lb.view);
        let mut bufs: Vec<&wgpu::Buffer> = lb.refs().collect();
        bufs.extend([&out, &idx]);
        self.runner.run(&[Dispatch {
            kernel: &kernel,
            buffers: bufs,
            groups: grid(bytes.div_ceil(4)),
        }])?;
        Ok(out)
    }

    /// Scatters compact raw rows (`src` on the device, row `i` for `slots[i]`).
    fn scatter(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        src: &wgpu::Buffer,
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let lb = self.buffer(layer, buffer);
        let list = write_list(slots);
        let idx = self.runner.upload_u32("kv slots", &list)?;
        let kernel = kernels::store::scatter_raw(lb.view);
        let mut bufs: Vec<&wgpu::Buffer> = lb.refs().collect();
        bufs.extend([src, &idx]);
        self.runner.run(&[Dispatch {
            kernel: &kernel,
            buffers: bufs,
            groups: grid(list[0] as u64 * lb.view.row_elems as u64),
        }])?;
        Ok(())
    }

    /// Raw rows `bytes` of validated input at `slots`.
    fn write_raw_unchecked(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let src = self.runner.upload_bytes("kv raw rows", bytes)?;
        self.scatter(layer, buffer, slots, &src)
    }

    /// Raw rows of validated input into `out`.
    fn read_raw_unchecked(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let g = self.gather(layer, buffer, slots)?;
        let bytes = self.runner.read(&g, out.len() as u64)?;
        out.copy_from_slice(&bytes);
        Ok(())
    }
}

impl KvStore for WgpuKvStore {
    fn layout(&self) -> &KvLayout {
        &self.inner.layout
    }

    fn scales(&self, layer: usize) -> Result<(f32, f32)> {
        check::layer(&self.inner.layout, layer)?;
        Ok(self.scales[layer])
    }

    fn set_scales(&mut self, layer: usize, k_scale: f32, v_scale: f32) -> Result<()> {
        check::set_scales(&self.inner.layout, layer, k_scale, v_scale)?;
        self.scales[layer] = (k_scale, v_scale);
        Ok(())
    }

    fn write_kv(&mut self, layer: usize, slots: &[Slot], k: &[f32], v: &[f32]) -> Result<()> {
        check::write_kv(&self.inner.layout, layer, slots, k.len(), v.len())?;
        self.inner.write_f32(layer, KvBuffer::Key, slots, k)?;
        if self.inner.layout.shape.has_buffer(KvBuffer::Value) {
            self.inner.write_f32(layer, KvBuffer::Value, slots, v)?;
        }
        Ok(())
    }

    fn write_labels(&mut self, layer: usize, slots: &[Slot], labels: &[f32]) -> Result<()> {
        check::write_labels(&self.inner.layout, layer, slots, labels.len())?;
        self.inner.write_f32(layer, KvBuffer::Label, slots, labels)
    }

    fn write_raw(
        &mut self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        check::raw(
            &self.inner.layout,
            layer,
            buffer,
            slots,
            "bytes",
            bytes.len(),
        )?;
        self.inner.write_raw_unchecked(layer, buffer, slots, bytes)
    }

    fn read_f32(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [f32],
    ) -> Result<()> {
        check::read_f32(&self.inner.layout, layer, buffer, slots, out.len())?;
        let mut raw = vec![0u8; slots.len() * self.inner.layout.shape.row_bytes(buffer)];
        self.inner
            .read_raw_unchecked(layer, buffer, slots, &mut raw)?;
        let scale = match buffer {
            KvBuffer::Key => self.scales[layer].0,
            KvBuffer::Value => self.scales[layer].1,
            KvBuffer::Label => 1.0,
        };
        decode_to_f32(self.inner.layout.shape.dtype, &raw, scale, out);
        Ok(())
    }

    fn read_raw(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> Result<()> {
        check::raw(&self.inner.layout, layer, buffer, slots, "out", out.len())?;
        self.inner.read_raw_unchecked(layer, buffer, slots, out)
    }

    fn copy_slots(&mut self, src: &[Slot], dst: &[Slot]) -> Result<()> {
        check::copy_slots(&self.inner.layout, src, dst)?;
        if src.is_empty() {
            return Ok(());
        }
        // Every source row is gathered before any write, so overlapping sets see old rows.
        for layer in 0..self.inner.layout.shape.layers as usize {
            for &b in self.inner.layout.shape.buffers() {
                let rows = self.inner.gather(layer, b, src)?;
                self.inner.scatter(layer, b, dst, &rows)?;
            }
        }
        Ok(())
    }

    fn read_pages(&self, pages: &[Page], out: &mut [u8]) -> Result<()> {
        check::page_data(&self.inner.layout, pages, "out", out.len())?;
        let page_bytes = self.inner.layout.page_bytes();
        let slots = self.page_slots(pages);
        for (layer, b, off, n) in self.page_parts() {
            let mut rows = vec![0u8; pages.len() * n];
            self.inner.read_raw_unchecked(layer, b, &slots, &mut rows)?;
            for (i, chunk) in rows.chunks_exact(n.max(1)).enumerate() {
                out[i * page_bytes + off..][..n].copy_from_slice(chunk);
            }
        }
        Ok(())
    }

    fn write_pages(&mut self, pages: &[Page], data: &[u8]) -> Result<()> {
        check::page_data(&self.inner.layout, pages, "data", data.len())?;
        if pages.is_empty() {
            return Ok(());
        }
        let page_bytes = self.inner.layout.page_bytes();
        let slots = self.page_slots(pages);
        for (layer, b, off, n) in self.page_parts() {
            let mut rows = Vec::with_capacity(pages.len() * n);
            for i in 0..pages.len() {
                rows.extend_from_slice(&data[i * page_bytes + off..][..n]);
            }
            let src = self.inner.runner.upload_bytes("kv pages", &rows)?;
            self.inner.scatter(layer, b, &slots, &src)?;
        }
        Ok(())
    }

    /// wgpu exposes no device addresses, so the regions live in a synthetic address space:
    /// each per-layer buffer gets a disjoint range of its true byte length, starting at 4 KiB
    /// and aligned to 4 KiB. The addresses are bookkeeping only (nothing can dereference
    /// them); moving KV in and out of a wgpu store goes through `read_pages` / `write_pages`.
    fn memory_regions(&self) -> Vec<MemoryRegion> {
        let shape = &self.inner.layout.shape;
        let mut regions = Vec::with_capacity(self.inner.buffers.len());
        let mut addr = 4096usize;
        for &b in shape.buffers() {
            for layer in 0..shape.layers as usize {
                let len = self.inner.layout.buffer_bytes(b);
                regions.push(MemoryRegion {
                    layer,
                    buffer: b,
                    addr,
                    len_bytes: len,
                    item_len: self.inner.layout.page_bytes_per_layer(b),
                });
                addr += len.div_ceil(4096) * 4096;
            }
        }
        regions
    }
}

impl DeviceKvRows for WgpuKvRows {
    fn layout(&self) -> &KvLayout {
        &self.inner.layout
    }

    fn read_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> Result<()> {
        check::raw(&self.inner.layout, layer, buffer, slots, "out", out.len())?;
        self.inner.read_raw_unchecked(layer, buffer, slots, out)
    }

    fn write_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        check::raw(
            &self.inner.layout,
            layer,
            buffer,
            slots,
            "bytes",
            bytes.len(),
        )?;
        self.inner.write_raw_unchecked(layer, buffer, slots, bytes)
    }
}
