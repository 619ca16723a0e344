//! Local registrations and block validation, shared by the backends: every backend refuses the
//! same bad inputs with the same [`TransferError`]s.

use kv_pool::MemoryRegion;

use crate::engine::{BackendKind, RegionId, RemoteRegion, SegmentDesc, TransferBlock};
use crate::error::{Result, TransferError};

/// One registered local region: `addr..addr + len` in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LocalRegion {
    /// First byte.
    pub addr: usize,
    /// Bytes.
    pub len: u64,
}

/// An engine's registered memory, by [`RegionId`]. `closed` is set (under the engine's write
/// lock) when the engine drops: from then on no task may touch registered memory, so tasks read
/// or write it only while holding the read lock and after checking `closed`.
#[derive(Debug, Default)]
pub(crate) struct RegionTable {
    regions: Vec<LocalRegion>,
    /// The engine is gone: registered memory may already be freed.
    pub closed: bool,
}

impl RegionTable {
    /// Checks `new` (non-null, non-empty, no overlap with each other or with what is
    /// registered) and returns the regions it would add; changes nothing.
    pub fn check_new(&self, new: &[MemoryRegion]) -> Result<Vec<LocalRegion>> {
        let mut all: Vec<(usize, usize)> = self
            .regions
            .iter()
            .map(|r| (r.addr, r.len as usize))
            .collect();
        let mut out = Vec::with_capacity(new.len());
        for (i, r) in new.iter().enumerate() {
            if r.addr == 0 {
                return Err(TransferError::BadRegion(format!(
                    "region {i} of the call (layer {}) has a null address",
                    r.layer
                )));
            }
            if r.len_bytes == 0 {
                return Err(TransferError::BadRegion(format!(
                    "region {i} of the call (layer {}) is empty",
                    r.layer
                )));
            }
            let end = r.addr.checked_add(r.len_bytes).ok_or_else(|| {
                TransferError::BadRegion(format!("region {i} of the call wraps the address space"))
            })?;
            if let Some(&(a, l)) = all.iter().find(|&&(a, l)| r.addr < a + l && a < end) {
                return Err(TransferError::BadRegion(format!(
                    "region {i} of the call overlaps registered memory ({:#x}+{} over {a:#x}+{l})",
                    r.addr, r.len_bytes
                )));
            }
            all.push((r.addr, r.len_bytes));
            out.push(LocalRegion {
                addr: r.addr,
                len: r.len_bytes as u64,
            });
        }
        Ok(out)
    }

    /// Appends checked regions; returns their ids.
    pub fn push(&mut self, new: Vec<LocalRegion>) -> Vec<RegionId> {
        let first = self.regions.len() as RegionId;
        self.regions.extend(new);
        (first..self.regions.len() as RegionId).collect()
    }

    /// A region by id.
    pub fn get(&self, id: RegionId) -> Option<LocalRegion> {
        self.regions.get(id as usize).copied()
    }

    /// Every region, by id.
    pub fn all(&self) -> &[LocalRegion] {
        &self.regions
    }

    /// The regions as peers see them, with `base: 0` (backends that address by region id).
    pub fn remote(&self) -> Vec<RemoteRegion> {
        self.regions
            .iter()
            .map(|r| RemoteRegion {
                len: r.len,
                base: 0,
            })
            .collect()
    }
}

/// `Ok` when `offset..offset + len` lies within `region_len` bytes, else
/// [`TransferError::OutOfBounds`] (an overflowing end saturates at `u64::MAX`).
pub(crate) fn in_bounds(
    side: &'static str,
    region: RegionId,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        end => Err(TransferError::OutOfBounds {
            side,
            region,
            offset,
            end: end.unwrap_or(u64::MAX),
            len: region_len,
        }),
    }
}

/// Validates a whole batch against the local registrations and the destination segment's
/// regions; returns each block's source address (`addr + src_offset`).
pub(crate) fn check_blocks(
    local: &RegionTable,
    remote: &[RemoteRegion],
    blocks: &[TransferBlock],
) -> Result<Vec<usize>> {
    blocks
        .iter()
        .map(|b| {
            let src = local
                .get(b.src_region)
                .ok_or(TransferError::UnknownRegion {
                    side: "source",
                    region: b.src_region,
                })?;
            in_bounds("source", b.src_region, b.src_offset, b.len, src.len)?;
            let dst = remote
                .get(b.dst_region as usize)
                .ok_or(TransferError::UnknownRegion {
                    side: "destination",
                    region: b.dst_region,
                })?;
            in_bounds("destination", b.dst_region, b.dst_offset, b.len, dst.len)?;
            Ok(src.addr + b.src_offset as usize)
        })
        .collect()
}

/// Checks that `desc` was written by `kind` (else [`TransferError::BadSegment`]).
pub(crate) fn check_backend(desc: &SegmentDesc, kind: BackendKind) -> Result<()> {
    if desc.backend != kind {
        return Err(TransferError::BadSegment(format!(
            "a {} segment given to the {kind} backend",
            desc.backend
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use kv_pool::KvBuffer;

    use super::*;

    fn region(addr: usize, len: usize) -> MemoryRegion {
        MemoryRegion {
            layer: 0,
            buffer: KvBuffer::Key,
            addr,
            len_bytes: len,
            item_len: 1,
        }
    }

    #[test]
    fn registration_refuses_null_empty_and_overlapping_memory() {
        let mut t = RegionTable::default();
        let ok = t
            .check_new(&[region(0x1000, 16), region(0x2000, 16)])
            .unwrap();
        assert_eq!(t.push(ok), [0, 1]);
        for bad in [
            vec![region(0, 4)],
            vec![region(0x3000, 0)],
            vec![region(0x100f, 4)],
            vec![region(0x3000, 8), region(0x3004, 8)],
            vec![region(usize::MAX - 2, 8)],
        ] {
            assert!(matches!(
                t.check_new(&bad),
                Err(TransferError::BadRegion(_))
            ));
        }
        assert_eq!(t.all().len(), 2);
        // Adjacent is not overlapping.
        assert!(t.check_new(&[region(0x1010, 4)]).is_ok());
    }

    #[test]
    fn bounds_saturate_instead_of_overflowing() {
        assert!(in_bounds("source", 1, 4, 4, 8).is_ok());
        assert_eq!(
            in_bounds("destination", 2, u64::MAX, 2, 8),
            Err(TransferError::OutOfBounds {
                side: "destination",
                region: 2,
                offset: u64::MAX,
                end: u64::MAX,
                len: 8
            })
        );
    }
}
