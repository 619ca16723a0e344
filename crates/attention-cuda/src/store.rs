//! [`CudaKvStore`]: kv-pool's [`KvStore`] in device memory.
//!
//! Each layer's K, V (and label) buffer is one device allocation of `layout.rows()` rows in the
//! layout's dtype, row `s` for slot `s`, exactly as [`kv_pool::HostKvStore`] lays them out, so
//! raw rows and the canonical packed pages are byte-identical to the host store's. Every method
//! validates with [`kv_pool::store::check`] first, so bad input gets the host store's errors and
//! leaves the store untouched. Row writes and reads go through the `scatter_rows` /
//! `gather_rows` kernels (converting f32 on the host with kv-pool's own encoder, so stored bytes
//! equal the host store's); pages are contiguous row ranges and move with plain copies.

use std::fmt;
use std::sync::Arc;

use attention::AttentionError;
use kv_pool::dtype::{decode_to_f32, encode_f32};
use kv_pool::store::check;
use kv_pool::{KvBuffer, KvLayout, KvPoolError, KvStore, MemoryRegion, Page, Result, Slot};

use crate::device::{Device, KernelArg};
use crate::geometry::{per_row, ROW_THREADS};
use crate::kernels::{self, Spec};
use crate::plan::write_list;

/// A KV store in `D`'s memory (see the [module docs](self)).
pub struct CudaKvStore<D: Device> {
    device: Arc<D>,
    layout: KvLayout,
    spec: Spec,
    scales: Vec<(f32, f32)>,
    /// Buffer `b` (index in `shape.buffers()`) of layer `l` is `buffers[l × nbuf + b]`.
    buffers: Vec<D::Buffer>,
}

impl<D: Device> fmt::Debug for CudaKvStore<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKvStore")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

/// A device failure seen through kv-pool's error type.
fn device_err(e: AttentionError) -> KvPoolError {
    match e {
        AttentionError::KvPool(e) => e,
        AttentionError::HostOutOfMemory { bytes } => KvPoolError::HostOutOfMemory { bytes },
        AttentionError::Device(e) => KvPoolError::Device(e),
        e => KvPoolError::Device(e.to_string()),
    }
}

fn u32_bytes(v: &[u32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

impl<D: Device> CudaKvStore<D> {
    /// Allocates a zeroed store for `layout` (f32, f16 and bf16 stores).
    pub(crate) fn new(device: Arc<D>, layout: KvLayout) -> attention::Result<Self> {
        let spec = kernels::store(layout.shape.dtype).map_err(AttentionError::Unsupported)?;
        let mut buffers = Vec::new();
        for _ in 0..layout.shape.layers {
            for &b in layout.shape.buffers() {
                buffers.push(device.alloc_zeroed(layout.buffer_bytes(b))?);
            }
        }
        Ok(CudaKvStore {
            device,
            layout,
            spec,
            scales: vec![(1.0, 1.0); layout.shape.layers as usize],
            buffers,
        })
    }

    fn index(&self, layer: usize, buffer: KvBuffer) -> usize {
        let bufs = self.layout.shape.buffers();
        let b = bufs.iter().position(|&x| x == buffer).expect("checked");
        layer * bufs.len() + b
    }

    /// The device buffer of one layer's `buffer` (validated by the caller).
    pub(crate) fn buffer(&self, layer: usize, buffer: KvBuffer) -> &D::Buffer {
        &self.buffers[self.index(layer, buffer)]
    }

    /// The store-kernel specialisation of this store's dtype.
    pub(crate) fn spec(&self) -> &Spec {
        &self.spec
    }

    fn upload(&self, bytes: &[u8]) -> attention::Result<D::Buffer> {
        let mut buf = self.device.alloc_zeroed(bytes.len())?;
        self.device.write(&mut buf, 0, bytes)?;
        Ok(buf)
    }

    /// Writes raw rows `bytes` (`slots.len()` of them) at `slots` (already validated).
    fn scatter(&self, layer: usize, buffer: KvBuffer, slots: &[Slot], bytes: &[u8]) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let row_bytes = self.layout.shape.row_bytes(buffer);
        let list = write_list(slots);
        let run = || -> attention::Result<()> {
            let src = self.upload(bytes)?;
            let writes = self.upload(u32_bytes(&list))?;
            self.device.launch(
                &self.spec,
                "scatter_rows",
                per_row("rows", list[0] as usize, ROW_THREADS)?,
                &[
                    KernelArg::Buf(&src),
                    KernelArg::Buf(&writes),
                    KernelArg::Buf(self.buffer(layer, buffer)),
                    KernelArg::U32(row_bytes as u32),
                ],
            )
        };
        run().map_err(device_err)
    }

    /// Reads raw rows at `slots` into `out` (already validated).
    fn gather(&self, layer: usize, buffer: KvBuffer, slots: &[Slot], out: &mut [u8]) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let row_bytes = self.layout.shape.row_bytes(buffer);
        let ids: Vec<u32> = slots.iter().map(|s| s.0).collect();
        let run = |out: &mut [u8]| -> attention::Result<()> {
            let idx = self.upload(u32_bytes(&ids))?;
            let dst = self.device.alloc_zeroed(out.len())?;
            self.device.launch(
                &self.spec,
                "gather_rows",
                per_row("rows", ids.len(), ROW_THREADS)?,
                &[
                    KernelArg::Buf(self.buffer(layer, buffer)),
                    KernelArg::Buf(&idx),
                    KernelArg::Buf(&dst),
                    KernelArg::U32(row_bytes as u32),
                ],
            )?;
            self.device.read(&dst, 0, out)
        };
        run(out).map_err(device_err)
    }

    fn scale(&self, layer: usize, buffer: KvBuffer) -> f32 {
        match buffer {
            KvBuffer::Key => self.scales[layer].0,
            KvBuffer::Value => self.scales[layer].1,
            KvBuffer::Label => 1.0,
        }
    }

    fn encode_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        src: &[f32],
    ) -> Result<()> {
        let dtype = self.layout.shape.dtype;
        let mut bytes = vec![0u8; src.len() * dtype.bytes()];
        encode_f32(dtype, src, self.scale(layer, buffer), &mut bytes);
        self.scatter(layer, buffer, slots, &bytes)
    }

    /// `(buffer index, byte offset, bytes)` of every contiguous piece of page `page`, in the
    /// canonical packed order (layers, then buffers).
    fn page_pieces(&self, page: Page) -> Vec<(usize, usize, usize)> {
        let p = self.layout.page_size as usize;
        let mut pieces = Vec::new();
        for layer in 0..self.layout.shape.layers as usize {
            for &b in self.layout.shape.buffers() {
                let len = p * self.layout.shape.row_bytes(b);
                pieces.push((self.index(layer, b), page.index() * len, len));
            }
        }
        pieces
    }
}

impl<D: Device> KvStore for CudaKvStore<D> {
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
        self.encode_rows(layer, KvBuffer::Key, slots, k)?;
        if self.layout.shape.has_buffer(KvBuffer::Value) {
            self.encode_rows(layer, KvBuffer::Value, slots, v)?;
        }
        Ok(())
    }

    fn write_labels(&mut self, layer: usize, slots: &[Slot], labels: &[f32]) -> Result<()> {
        check::write_labels(&self.layout, layer, slots, labels.len())?;
        self.encode_rows(layer, KvBuffer::Label, slots, labels)
    }

    fn write_raw(
        &mut self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        check::raw(&self.layout, layer, buffer, slots, "bytes", bytes.len())?;
        self.scatter(layer, buffer, slots, bytes)
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
        let mut bytes = vec![0u8; out.len() * dtype.bytes()];
        self.gather(layer, buffer, slots, &mut bytes)?;
        decode_to_f32(dtype, &bytes, self.scale(layer, buffer), out);
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
        self.gather(layer, buffer, slots, out)
    }

    fn copy_slots(&mut self, src: &[Slot], dst: &[Slot]) -> Result<()> {
        check::copy_slots(&self.layout, src, dst)?;
        // Every row is read before any is written, so overlapping sets are safe.
        let mut rows = Vec::new();
        for layer in 0..self.layout.shape.layers as usize {
            for &b in self.layout.shape.buffers() {
                let mut bytes = vec![0u8; src.len() * self.layout.shape.row_bytes(b)];
                self.gather(layer, b, src, &mut bytes)?;
                rows.push((layer, b, bytes));
            }
        }
        for (layer, b, bytes) in rows {
            self.scatter(layer, b, dst, &bytes)?;
        }
        Ok(())
    }

    fn read_pages(&self, pages: &[Page], out: &mut [u8]) -> Result<()> {
        check::page_data(&self.layout, pages, "out", out.len())?;
        let mut at = 0;
        for &page in pages {
            for (idx, offset, len) in self.page_pieces(page) {
                self.device
                    .read(&self.buffers[idx], offset, &mut out[at..at + len])
                    .map_err(device_err)?;
                at += len;
            }
        }
        Ok(())
    }

    fn write_pages(&mut self, pages: &[Page], data: &[u8]) -> Result<()> {
        check::page_data(&self.layout, pages, "data", data.len())?;
        let mut at = 0;
        for &page in pages {
            for (idx, offset, len) in self.page_pieces(page) {
                let device = Arc::clone(&self.device);
                device
                    .write(&mut self.buffers[idx], offset, &data[at..at + len])
                    .map_err(device_err)?;
                at += len;
            }
        }
        Ok(())
    }

    fn memory_regions(&self) -> Vec<MemoryRegion> {
        let mut out = Vec::new();
        for layer in 0..self.layout.shape.layers as usize {
            for &b in self.layout.shape.buffers() {
                out.push(MemoryRegion {
                    layer,
                    buffer: b,
                    addr: self.device.address(self.buffer(layer, b)),
                    len_bytes: self.layout.buffer_bytes(b),
                    item_len: self.layout.page_bytes_per_layer(b),
                });
            }
        }
        out
    }
}
