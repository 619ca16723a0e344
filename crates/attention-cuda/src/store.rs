//! [`CudaKvStore`]: kv-pool's [`KvStore`] in device memory, and [`CudaKvRows`], its rows as a
//! HiCache controller's IO thread copies them ([`DeviceKvRows`]).
//!
//! Each layer's K, V (and label) buffer is one device allocation of `layout.rows()` rows in the
//! layout's dtype, row `s` for slot `s`, exactly as [`kv_pool::HostKvStore`] lays them out, so
//! raw rows and the canonical packed pages are byte-identical to the host store's. Every method
//! validates with [`kv_pool::store::check`] first, so bad input gets the host store's errors and
//! leaves the store untouched. Row writes and reads go through the `scatter_rows` /
//! `gather_rows` kernels (converting f32 on the host with kv-pool's own encoder, so stored bytes
//! equal the host store's); pages are read with plain copies of their contiguous row ranges
//! and written with `scatter_rows`. Nothing writes the buffers except through kernels, so the
//! store and its rows handles share them, and the handles' copies run on the device's stream,
//! ordered with the forward passes the store's owner launches.

use std::fmt;
use std::sync::Arc;

use attention::AttentionError;
use kv_pool::dtype::{decode_to_f32, encode_f32};
use kv_pool::store::check;
use kv_pool::{
    DeviceKvRows, KvBuffer, KvLayout, KvPoolError, KvStore, MemoryRegion, Page, Result, Slot,
};

use crate::device::{Device, KernelArg};
use crate::geometry::{per_row, ROW_THREADS};
use crate::kernels::{self, Spec};
use crate::plan::write_list;

/// A KV store in `D`'s memory (see the [module docs](self)).
pub struct CudaKvStore<D: Device> {
    inner: Arc<StoreBuffers<D>>,
    scales: Vec<(f32, f32)>,
}

/// The store's device buffers and what moving raw rows through them takes: shared by the
/// store and its [`CudaKvRows`] handles.
struct StoreBuffers<D: Device> {
    device: Arc<D>,
    layout: KvLayout,
    spec: Spec,
    /// Buffer `b` (index in `shape.buffers()`) of layer `l` is `buffers[l × nbuf + b]`.
    buffers: Vec<D::Buffer>,
}

/// A [`CudaKvStore`]'s rows for a HiCache controller's IO thread ([`DeviceKvRows`]): reads and
/// writes through the `gather_rows` / `scatter_rows` kernels on the store's device, so they are
/// ordered with the forward passes the store's owner launches there.
pub struct CudaKvRows<D: Device> {
    inner: Arc<StoreBuffers<D>>,
}

impl<D: Device> fmt::Debug for CudaKvStore<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKvStore")
            .field("layout", &self.inner.layout)
            .finish_non_exhaustive()
    }
}

/// Another handle on the same rows.
impl<D: Device> Clone for CudaKvRows<D> {
    fn clone(&self) -> Self {
        CudaKvRows {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<D: Device> fmt::Debug for CudaKvRows<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKvRows")
            .field("layout", &self.inner.layout)
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
            inner: Arc::new(StoreBuffers {
                device,
                layout,
                spec,
                buffers,
            }),
            scales: vec![(1.0, 1.0); layout.shape.layers as usize],
        })
    }

    /// The device buffer of one layer's `buffer` (validated by the caller).
    pub(crate) fn buffer(&self, layer: usize, buffer: KvBuffer) -> &D::Buffer {
        self.inner.buffer(layer, buffer)
    }

    /// The store-kernel specialisation of this store's dtype.
    pub(crate) fn spec(&self) -> &Spec {
        &self.inner.spec
    }

    /// A handle on this store's rows for another thread (a HiCache controller's IO thread): it
    /// shares the device buffers, and its copies run on the device's stream.
    pub fn device_rows(&self) -> CudaKvRows<D> {
        CudaKvRows {
            inner: Arc::clone(&self.inner),
        }
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
        let dtype = self.inner.layout.shape.dtype;
        let mut bytes = vec![0u8; src.len() * dtype.bytes()];
        encode_f32(dtype, src, self.scale(layer, buffer), &mut bytes);
        self.inner.scatter(layer, buffer, slots, &bytes)
    }
}

impl<D: Device> StoreBuffers<D> {
    fn index(&self, layer: usize, buffer: KvBuffer) -> usize {
        let bufs = self.layout.shape.buffers();
        let b = bufs.iter().position(|&x| x == buffer).expect("checked");
        layer * bufs.len() + b
    }

    fn buffer(&self, layer: usize, buffer: KvBuffer) -> &D::Buffer {
        &self.buffers[self.index(layer, buffer)]
    }

    fn upload(&self, bytes: &[u8]) -> attention::Result<D::Buffer> {
        let mut buf = self.device.alloc_uninit(bytes.len())?;
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
            let dst = self.device.alloc_uninit(out.len())?;
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

    /// `(layer, buffer, byte offset in a packed page, bytes)` of every piece of a page in the
    /// canonical packed order (layers, then buffers); a piece is the page's rows of one
    /// buffer, contiguous in it.
    fn page_pieces(&self) -> Vec<(usize, KvBuffer, usize, usize)> {
        let p = self.layout.page_size as usize;
        let mut pieces = Vec::new();
        let mut at = 0;
        for layer in 0..self.layout.shape.layers as usize {
            for &b in self.layout.shape.buffers() {
                let len = p * self.layout.shape.row_bytes(b);
                pieces.push((layer, b, at, len));
                at += len;
            }
        }
        pieces
    }
}

impl<D: Device> DeviceKvRows for CudaKvRows<D> {
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
        self.inner.gather(layer, buffer, slots, out)
    }

    fn write_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        let layout = &self.inner.layout;
        check::raw(layout, layer, buffer, slots, "bytes", bytes.len())?;
        self.inner.scatter(layer, buffer, slots, bytes)
    }
}

impl<D: Device> KvStore for CudaKvStore<D> {
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
        let layout = &self.inner.layout;
        check::write_kv(layout, layer, slots, k.len(), v.len())?;
        self.encode_rows(layer, KvBuffer::Key, slots, k)?;
        if layout.shape.has_buffer(KvBuffer::Value) {
            self.encode_rows(layer, KvBuffer::Value, slots, v)?;
        }
        Ok(())
    }

    fn write_labels(&mut self, layer: usize, slots: &[Slot], labels: &[f32]) -> Result<()> {
        check::write_labels(&self.inner.layout, layer, slots, labels.len())?;
        self.encode_rows(layer, KvBuffer::Label, slots, labels)
    }

    fn write_raw(
        &mut self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> Result<()> {
        self.device_rows().write_rows(layer, buffer, slots, bytes)
    }

    fn read_f32(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [f32],
    ) -> Result<()> {
        check::read_f32(&self.inner.layout, layer, buffer, slots, out.len())?;
        let dtype = self.inner.layout.shape.dtype;
        let mut bytes = vec![0u8; out.len() * dtype.bytes()];
        self.inner.gather(layer, buffer, slots, &mut bytes)?;
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
        self.device_rows().read_rows(layer, buffer, slots, out)
    }

    fn copy_slots(&mut self, src: &[Slot], dst: &[Slot]) -> Result<()> {
        let inner = &self.inner;
        check::copy_slots(&inner.layout, src, dst)?;
        // Every row is read before any is written, so overlapping sets are safe.
        let mut rows = Vec::new();
        for layer in 0..inner.layout.shape.layers as usize {
            for &b in inner.layout.shape.buffers() {
                let mut bytes = vec![0u8; src.len() * inner.layout.shape.row_bytes(b)];
                inner.gather(layer, b, src, &mut bytes)?;
                rows.push((layer, b, bytes));
            }
        }
        for (layer, b, bytes) in rows {
            inner.scatter(layer, b, dst, &bytes)?;
        }
        Ok(())
    }

    fn read_pages(&self, pages: &[Page], out: &mut [u8]) -> Result<()> {
        let inner = &self.inner;
        check::page_data(&inner.layout, pages, "out", out.len())?;
        let page_bytes = inner.layout.page_bytes();
        for (i, &page) in pages.iter().enumerate() {
            for (layer, b, at, len) in inner.page_pieces() {
                let dst = &mut out[i * page_bytes + at..][..len];
                inner
                    .device
                    .read(inner.buffer(layer, b), page.index() * len, dst)
                    .map_err(device_err)?;
            }
        }
        Ok(())
    }

    /// One `scatter_rows` per layer and buffer over every page's rows (the buffers are shared
    /// with the rows handles, so they are written by kernels only).
    fn write_pages(&mut self, pages: &[Page], data: &[u8]) -> Result<()> {
        let inner = &self.inner;
        check::page_data(&inner.layout, pages, "data", data.len())?;
        let p = inner.layout.page_size as usize;
        let page_bytes = inner.layout.page_bytes();
        let slots: Vec<Slot> = pages
            .iter()
            .flat_map(|page| (0..p).map(move |r| Slot((page.index() * p + r) as u32)))
            .collect();
        for (layer, b, at, len) in inner.page_pieces() {
            let mut rows = Vec::with_capacity(pages.len() * len);
            for i in 0..pages.len() {
                rows.extend_from_slice(&data[i * page_bytes + at..][..len]);
            }
            inner.scatter(layer, b, &slots, &rows)?;
        }
        Ok(())
    }

    fn memory_regions(&self) -> Vec<MemoryRegion> {
        let inner = &self.inner;
        let mut out = Vec::new();
        for layer in 0..inner.layout.shape.layers as usize {
            for &b in inner.layout.shape.buffers() {
                out.push(MemoryRegion {
                    layer,
                    buffer: b,
                    addr: inner.device.address(inner.buffer(layer, b)),
                    len_bytes: inner.layout.buffer_bytes(b),
                    item_len: inner.layout.page_bytes_per_layer(b),
                });
            }
        }
        out
    }
}
