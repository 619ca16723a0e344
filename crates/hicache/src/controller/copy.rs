//! The raw copies between the device store's memory and the host pool: [`DeviceRegions`] (the
//! store's buffers by address, from `KvStore::memory_regions`) and [`copy_layer`], which moves
//! one layer's rows of a batch of [`Segment`]s with one `copy_nonoverlapping` per segment and
//! buffer.
//!
//! A segment is a run of slots consecutive on both sides and back to back in the host layout
//! ([`kv_pool::HostKvPool::contiguous_rows`]): with `layer_first` a run of many pages is one
//! copy, with `page_first_direct` one page, with `page_first` one row.

use kv_pool::{HostKvPool, KvBuffer, KvStore, Slot};

use super::ControllerError;

/// The device store's per-(layer, buffer) buffers as host addresses: row `s` of `layer`'s
/// buffer `bi` is at `addr[layer × nb + bi] + s × row_bytes[bi]`.
#[derive(Debug)]
pub(crate) struct DeviceRegions {
    addrs: Vec<usize>,
    row_bytes: Vec<usize>,
    buffers: Vec<KvBuffer>,
    rows: usize,
}

impl DeviceRegions {
    /// Reads and checks `store.memory_regions()`: one region per (layer, buffer) of the layout,
    /// each `layout.buffer_bytes(buffer)` long.
    pub(crate) fn new(store: &dyn KvStore) -> Result<Self, ControllerError> {
        let layout = *store.layout();
        let shape = layout.shape;
        let buffers = shape.buffers().to_vec();
        let nb = buffers.len();
        let layers = shape.layers as usize;
        let mut addrs = vec![0usize; layers * nb];
        for r in store.memory_regions() {
            let bi = buffers.iter().position(|&b| b == r.buffer);
            match bi {
                Some(bi) if r.layer < layers && r.len_bytes == layout.buffer_bytes(r.buffer) => {
                    addrs[r.layer * nb + bi] = r.addr;
                }
                _ => {
                    return Err(ControllerError::Mismatch(format!(
                        "memory region (layer {}, buffer {}, {} bytes) does not fit the store's \
                         layout",
                        r.layer,
                        r.buffer.name(),
                        r.len_bytes
                    )))
                }
            }
        }
        if let Some(i) = addrs.iter().position(|&a| a == 0) {
            return Err(ControllerError::Mismatch(format!(
                "the store registers no memory for layer {}, buffer {}",
                i / nb,
                buffers[i % nb].name()
            )));
        }
        Ok(DeviceRegions {
            addrs,
            row_bytes: buffers.iter().map(|&b| shape.row_bytes(b)).collect(),
            buffers,
            rows: layout.rows(),
        })
    }

    /// Rows of every device buffer (slots `0..rows`).
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }
}

/// `rows` slots from `device` on the device and from `host` on the host, consecutive on both
/// sides and back to back in the host layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) device: usize,
    pub(crate) host: Slot,
    pub(crate) rows: usize,
}

/// Splits the pairs `(device[i], host[i])` (validated: equal lengths, in range) into maximal
/// segments.
pub(crate) fn segments(pool: &HostKvPool, device: &[Slot], host: &[Slot]) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    for (&d, &h) in device.iter().zip(host) {
        if let Some(last) = out.last_mut() {
            if d.index() == last.device + last.rows
                && h.index() == last.host.index() + last.rows
                && last.rows < pool.contiguous_rows(last.host)
            {
                last.rows += 1;
                continue;
            }
        }
        out.push(Segment {
            device: d.index(),
            host: h,
            rows: 1,
        });
    }
    out
}

/// Which way [`copy_layer`] moves rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Device → host (a write).
    ToHost,
    /// Host → device (a load).
    ToDevice,
}

/// Copies `layer`'s rows (every buffer) of `segs` between the device store and the pool.
///
/// # Safety
/// `dev`'s addresses must be live host memory of the store (the controller's construction
/// contract), the segments must come from [`segments`] over validated slots (in range on both
/// sides), and no one else may read or write the destination rows, or write the source rows,
/// during the call (the operation's contract: its slots stay the operation's until its ack).
pub(crate) unsafe fn copy_layer(
    dev: &DeviceRegions,
    pool: &HostKvPool,
    layer: usize,
    segs: &[Segment],
    dir: Direction,
) {
    let nb = dev.buffers.len();
    let host_base = pool.as_mut_ptr();
    for (bi, &buffer) in dev.buffers.iter().enumerate() {
        let rb = dev.row_bytes[bi];
        let dev_base = dev.addrs[layer * nb + bi] as *mut u8;
        for seg in segs {
            let host_off = pool
                .row_offset(layer, buffer, seg.host)
                .expect("segments come from validated slots");
            let len = seg.rows * rb;
            // SAFETY: the device rows `seg.device..+rows` lie in the region (validated slots,
            // `len_bytes` checked in `DeviceRegions::new`), the host rows lie back to back in
            // the pool from `host_off` (`segments` keeps `rows ≤ contiguous_rows`), the two are
            // different allocations, and the caller guarantees no one else touches them now.
            unsafe {
                let d = dev_base.add(seg.device * rb);
                let h = host_base.add(host_off);
                match dir {
                    Direction::ToHost => std::ptr::copy_nonoverlapping(d, h, len),
                    Direction::ToDevice => std::ptr::copy_nonoverlapping(h, d, len),
                }
            }
        }
    }
}
