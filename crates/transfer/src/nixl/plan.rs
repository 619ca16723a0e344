//! The NIXL backend's checks and address arithmetic, in plain Rust (no NIXL call): which
//! regions may be registered, and which NIXL descriptors a batch of [`TransferBlock`]s becomes.
//!
//! Kept apart from the agent so it can be tested without a NIXL install, and so every bad input
//! is refused here, whole, before NIXL sees any of it.

use kv_pool::MemoryRegion;

use crate::engine::{RegionId, RemoteRegion, TransferBlock};
use crate::error::{Result, TransferError};

/// A byte range in this process's address space (a registered region, or one descriptor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    /// First byte's address.
    pub addr: u64,
    /// Bytes (never 0 for a registered region).
    pub len: u64,
}

impl Span {
    fn end(self) -> u64 {
        // Registered spans are checked not to overflow.
        self.addr + self.len
    }
}

/// One NIXL write: `len` bytes from a local address to a remote one (the peer's address space).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteDesc {
    /// Source address, inside a region this engine registered.
    pub local: u64,
    /// Destination address, inside a region of the peer's segment.
    pub remote: u64,
    /// Bytes (never 0: empty blocks move nothing and get no descriptor).
    pub len: u64,
}

/// Checks regions about to be registered after `existing` ones: no null address, no empty
/// region, no range past the end of the address space, no overlap with each other or with a
/// region registered before. Returns their spans, in order.
pub(crate) fn check_new_regions(existing: &[Span], new: &[MemoryRegion]) -> Result<Vec<Span>> {
    let mut spans = Vec::with_capacity(new.len());
    for (i, r) in new.iter().enumerate() {
        let what = || format!("region {i} (layer {}, {})", r.layer, r.buffer.name());
        if r.addr == 0 {
            return Err(TransferError::BadRegion(format!(
                "{} has a null address",
                what()
            )));
        }
        if r.len_bytes == 0 {
            return Err(TransferError::BadRegion(format!("{} is empty", what())));
        }
        let span = Span {
            addr: r.addr as u64,
            len: r.len_bytes as u64,
        };
        if span.addr.checked_add(span.len).is_none() {
            return Err(TransferError::BadRegion(format!(
                "{} runs past the end of the address space",
                what()
            )));
        }
        spans.push(span);
    }
    let mut all: Vec<(Span, Option<usize>)> = existing.iter().map(|s| (*s, None)).collect();
    all.extend(spans.iter().enumerate().map(|(i, s)| (*s, Some(i))));
    all.sort_by_key(|(s, _)| s.addr);
    for pair in all.windows(2) {
        let ((a, ai), (b, bi)) = (pair[0], pair[1]);
        if b.addr < a.end() {
            let name = |i: Option<usize>| match i {
                Some(i) => format!("new region {i}"),
                None => "a region registered before".to_string(),
            };
            return Err(TransferError::BadRegion(format!(
                "{} ({:#x}, {} bytes) overlaps {} ({:#x}, {} bytes)",
                name(bi),
                b.addr,
                b.len,
                name(ai),
                a.addr,
                a.len
            )));
        }
    }
    Ok(spans)
}

/// Checks a peer's regions as its segment descriptor gives them: every writable region's
/// `base + len` must fit in 64 bits (`base == u64::MAX` marks a region peers may not write).
pub(crate) fn check_remote_regions(regions: &[RemoteRegion]) -> Result<()> {
    for (i, r) in regions.iter().enumerate() {
        if r.base != u64::MAX && r.base.checked_add(r.len).is_none() {
            return Err(TransferError::BadSegment(format!(
                "region {i} (base {:#x}, {} bytes) runs past the end of the address space",
                r.base, r.len
            )));
        }
    }
    Ok(())
}

/// Turns a batch into NIXL write descriptors, validating it whole first: every source region
/// registered here, every destination region in the peer's segment and writable, every block
/// inside both. Zero-length blocks are valid and produce no descriptor.
pub(crate) fn plan_writes(
    local: &[Span],
    remote: &[RemoteRegion],
    blocks: &[TransferBlock],
) -> Result<Vec<WriteDesc>> {
    let mut writes = Vec::with_capacity(blocks.len());
    for b in blocks {
        let src = region(local, b.src_region, "source")?;
        let dst = region(remote, b.dst_region, "destination")?;
        in_bounds("source", b.src_region, b.src_offset, b.len, src.len)?;
        in_bounds("destination", b.dst_region, b.dst_offset, b.len, dst.len)?;
        if dst.base == u64::MAX {
            return Err(TransferError::BadSegment(format!(
                "destination region {} is not writable by peers",
                b.dst_region
            )));
        }
        if b.len > 0 {
            writes.push(WriteDesc {
                local: src.addr + b.src_offset,
                remote: dst.base + b.dst_offset,
                len: b.len,
            });
        }
    }
    Ok(writes)
}

fn region<'a, T>(regions: &'a [T], id: RegionId, side: &'static str) -> Result<&'a T> {
    regions
        .get(id as usize)
        .ok_or(TransferError::UnknownRegion { side, region: id })
}

fn in_bounds(side: &'static str, region: RegionId, offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        end => Err(TransferError::OutOfBounds {
            side,
            region,
            offset,
            end: end.unwrap_or(u64::MAX),
            len: size,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_pool::KvBuffer;
    use proptest::prelude::*;

    fn mr(addr: usize, len: usize) -> MemoryRegion {
        MemoryRegion {
            layer: 0,
            buffer: KvBuffer::Key,
            addr,
            len_bytes: len,
            item_len: 64,
        }
    }

    fn block(src: RegionId, so: u64, dst: RegionId, dof: u64, len: u64) -> TransferBlock {
        TransferBlock {
            src_region: src,
            src_offset: so,
            dst_region: dst,
            dst_offset: dof,
            len,
        }
    }

    const LOCAL: [Span; 2] = [
        Span {
            addr: 0x1000,
            len: 256,
        },
        Span {
            addr: 0x4000,
            len: 128,
        },
    ];
    const REMOTE: [RemoteRegion; 2] = [
        RemoteRegion {
            len: 256,
            base: 0x9000,
        },
        RemoteRegion {
            len: 64,
            base: u64::MAX,
        },
    ];

    /// Every refusal, one line each: what a caller sees for each kind of bad input.
    #[test]
    fn refusals_render() {
        let regions = [
            ("null", vec![mr(0, 8)]),
            ("empty", vec![mr(0x100, 0)]),
            ("wraps", vec![mr(usize::MAX - 4, 8)]),
            ("overlaps new", vec![mr(0x100, 64), mr(0x120, 8)]),
            ("overlaps old", vec![mr(0x10ff, 2)]),
        ];
        let blocks = [
            ("unknown source", block(2, 0, 0, 0, 8)),
            ("unknown destination", block(0, 0, 2, 0, 8)),
            ("source out", block(1, 120, 0, 0, 16)),
            ("destination out", block(0, 0, 0, 250, 16)),
            ("offset overflows", block(0, u64::MAX, 0, 0, 2)),
            ("not writable", block(0, 0, 1, 0, 8)),
        ];
        let mut out = String::new();
        for (name, new) in &regions {
            let e = check_new_regions(&LOCAL, new).unwrap_err();
            out += &format!("register {name}: {e}\n");
        }
        for (name, b) in &blocks {
            let e = plan_writes(&LOCAL, &REMOTE, &[block(0, 0, 0, 0, 8), *b]).unwrap_err();
            out += &format!("submit {name}: {e}\n");
        }
        let bad = [RemoteRegion {
            len: 16,
            base: u64::MAX - 8,
        }];
        out += &format!("open wraps: {}\n", check_remote_regions(&bad).unwrap_err());
        insta::assert_snapshot!(out);
    }

    #[test]
    fn plans_addresses_and_skips_empty_blocks() {
        let w = plan_writes(
            &LOCAL,
            &REMOTE,
            &[
                block(1, 16, 0, 32, 64),
                block(0, 0, 0, 0, 0),
                block(0, 8, 0, 0, 8),
            ],
        )
        .unwrap();
        assert_eq!(
            w,
            vec![
                WriteDesc {
                    local: 0x4010,
                    remote: 0x9020,
                    len: 64
                },
                WriteDesc {
                    local: 0x1008,
                    remote: 0x9000,
                    len: 8
                },
            ]
        );
        // Adjacent regions touch without overlapping.
        assert!(check_new_regions(&LOCAL, &[mr(0x1100, 8), mr(0x1108, 8)]).is_ok());
        assert!(check_remote_regions(&REMOTE).is_ok());
    }

    proptest! {
        /// A planned batch is exactly the non-empty blocks, each inside its two regions; a batch
        /// with any block outside a region is refused whole.
        #[test]
        fn planned_writes_stay_inside_regions(
            raw in prop::collection::vec((0u32..3, 0u64..300, 0u64..300, 0u64..80), 0..12)
        ) {
            let remote = [REMOTE[0], RemoteRegion { len: 128, base: 0x20_0000 }];
            let blocks: Vec<_> = raw.iter().map(|&(r, so, dof, len)| {
                block(r % 2, so, (r + 1) % 2, dof, len)
            }).collect();
            let fits = blocks.iter().all(|b| {
                b.src_offset + b.len <= LOCAL[b.src_region as usize].len
                    && b.dst_offset + b.len <= remote[b.dst_region as usize].len
            });
            match plan_writes(&LOCAL, &remote, &blocks) {
                Ok(writes) => {
                    prop_assert!(fits);
                    let nonempty: Vec<_> = blocks.iter().filter(|b| b.len > 0).collect();
                    prop_assert_eq!(writes.len(), nonempty.len());
                    for (w, b) in writes.iter().zip(nonempty) {
                        let (s, d) = (LOCAL[b.src_region as usize], remote[b.dst_region as usize]);
                        prop_assert!(w.local >= s.addr && w.local + w.len <= s.end());
                        prop_assert!(w.remote >= d.base && w.remote + w.len <= d.base + d.len);
                        prop_assert_eq!(w.len, b.len);
                    }
                }
                Err(e) => {
                    prop_assert!(!fits);
                    let is_bounds = matches!(e, TransferError::OutOfBounds { .. });
                    prop_assert!(is_bounds, "{}", e);
                }
            }
        }

        /// Registration refuses exactly the sets with an overlap (regions at most 64 bytes).
        #[test]
        fn overlap_is_refused(starts in prop::collection::vec((1usize..512, 1usize..64), 1..6)) {
            let new: Vec<_> = starts.iter().map(|&(a, l)| mr(a, l)).collect();
            let overlap = starts.iter().enumerate().any(|(i, &(a, l))| {
                starts.iter().skip(i + 1).any(|&(b, m)| a < b + m && b < a + l)
            });
            prop_assert_eq!(check_new_regions(&[], &new).is_err(), overlap);
        }
    }
}
