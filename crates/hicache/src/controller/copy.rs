//! The copies between the device store and the host pool. The device side ([`DeviceSide`]) is
//! either the store's buffers by address ([`DeviceRegions`], from `KvStore::memory_regions`:
//! the CPU backend), moved with one `copy_nonoverlapping` per segment and buffer, or a
//! [`DeviceKvRows`] handle (wgpu), read or written once per layer and buffer through a staging
//! buffer that the segments fill or drain. [`copy_layer`] moves one layer's rows of a batch of
//! [`Segment`]s either way.
//!
//! A segment is a run of slots consecutive on both sides and back to back in the host layout
//! ([`kv_pool::HostKvPool::contiguous_rows`]): with `layer_first` a run of many pages is one
//! copy, with `page_first_direct` one page, with `page_first` one row.

use std::sync::Arc;

use kv_pool::{DeviceKvRows, HostKvPool, KvBuffer, KvLayout, KvStore, Slot};

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
}

/// How the controller reaches the device store.
pub(crate) enum DeviceSide {
    /// The store's memory as host addresses (the CPU backend's `HostKvStore`).
    Regions(DeviceRegions),
    /// A handle that copies rows through the device's own queue (wgpu).
    Rows(Arc<dyn DeviceKvRows>),
}

impl std::fmt::Debug for DeviceSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSide::Regions(r) => f.debug_tuple("Regions").field(r).finish(),
            DeviceSide::Rows(r) => f.debug_tuple("Rows").field(r.layout()).finish(),
        }
    }
}

impl DeviceSide {
    /// Rows of every device buffer (slots `0..rows`).
    pub(crate) fn rows(&self) -> usize {
        match self {
            DeviceSide::Regions(r) => r.rows,
            DeviceSide::Rows(r) => r.layout().rows(),
        }
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
/// `Err` is a device failure reported by a [`DeviceKvRows`] handle (the destination rows are
/// then undefined).
///
/// # Safety
/// `dev`'s addresses (when they are addresses) must be live host memory of the store (the
/// controller's construction contract), the segments must come from [`segments`] over
/// validated slots (in range on both sides), and no one else may read or write the destination
/// rows, or write the source rows, during the call (the operation's contract: its slots stay
/// the operation's until its ack).
pub(crate) unsafe fn copy_layer(
    dev: &DeviceSide,
    pool: &HostKvPool,
    layer: usize,
    segs: &[Segment],
    dir: Direction,
) -> Result<(), String> {
    match dev {
        DeviceSide::Regions(regions) => {
            // SAFETY: the caller's contract.
            unsafe { copy_layer_regions(regions, pool, layer, segs, dir) };
            Ok(())
        }
        // SAFETY: the caller's contract.
        DeviceSide::Rows(rows) => unsafe { copy_layer_rows(rows.as_ref(), pool, layer, segs, dir) },
    }
}

/// [`copy_layer`] through a [`DeviceKvRows`] handle: one read or write of every segment's
/// device rows per buffer, staged in host memory in segment order.
///
/// # Safety
/// As [`copy_layer`] (the host side is written through the pool's raw pointer).
unsafe fn copy_layer_rows(
    rows: &dyn DeviceKvRows,
    pool: &HostKvPool,
    layer: usize,
    segs: &[Segment],
    dir: Direction,
) -> Result<(), String> {
    let layout: &KvLayout = rows.layout();
    let device: Vec<Slot> = segs
        .iter()
        .flat_map(|s| (s.device..s.device + s.rows).map(|d| Slot(d as u32)))
        .collect();
    if device.is_empty() {
        return Ok(());
    }
    let host_base = pool.as_mut_ptr();
    for &buffer in layout.shape.buffers() {
        let rb = layout.shape.row_bytes(buffer);
        let mut staging = vec![0u8; device.len() * rb];
        if dir == Direction::ToHost {
            rows.read_rows(layer, buffer, &device, &mut staging)
                .map_err(|e| format!("reading layer {layer} from the device: {e}"))?;
        }
        let mut off = 0;
        for seg in segs {
            let host_off = pool
                .row_offset(layer, buffer, seg.host)
                .expect("segments come from validated slots");
            let len = seg.rows * rb;
            let stage = &mut staging[off..off + len];
            // SAFETY: the host rows lie back to back in the pool from `host_off` (`segments`
            // keeps `rows ≤ contiguous_rows`, slots validated), `stage` is our own buffer, and
            // the caller guarantees no one else touches those host rows now.
            unsafe {
                let h = host_base.add(host_off);
                match dir {
                    Direction::ToHost => std::ptr::copy_nonoverlapping(stage.as_ptr(), h, len),
                    Direction::ToDevice => {
                        std::ptr::copy_nonoverlapping(h, stage.as_mut_ptr(), len)
                    }
                }
            }
            off += len;
        }
        if dir == Direction::ToDevice {
            rows.write_rows(layer, buffer, &device, &staging)
                .map_err(|e| format!("writing layer {layer} to the device: {e}"))?;
        }
    }
    Ok(())
}

/// [`copy_layer`] between host addresses.
///
/// # Safety
/// As [`copy_layer`].
unsafe fn copy_layer_regions(
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
