//! Page-run coalescing: SGLang's `group_concurrent_contiguous` (`disaggregation/common/utils.py`)
//! and the per-run, per-region block building of `disaggregation/mooncake/conn.py`.
//!
//! A transfer maps source page `src[i]` onto destination page `dst[i]`. [`page_runs`] splits the
//! pairs into maximal runs contiguous on both sides; [`blocks`] turns each run into one
//! [`TransferBlock`] per registered region (one per layer and buffer: K and V separately for
//! MHA), at `offset = page × item_len`, `len = run × item_len`. All blocks of one chunk go into
//! one batch.

use kv_pool::{MemoryRegion, Page};

use crate::engine::{RegionId, RemoteRegion, TransferBlock};

/// A run of pages contiguous on both sides: source pages `src .. src + len` go to destination
/// pages `dst .. dst + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRun {
    /// First source page.
    pub src: Page,
    /// First destination page.
    pub dst: Page,
    /// Pages in the run (≥ 1).
    pub len: u32,
}

/// Why pages or regions cannot be paired.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoalesceError {
    /// The source and destination page lists differ in length.
    #[error("{src} source pages but {dst} destination pages")]
    PageCountMismatch {
        /// Source pages given.
        src: usize,
        /// Destination pages given.
        dst: usize,
    },
    /// The source and destination region lists differ in length (different layer counts or
    /// KV kinds on the two sides).
    #[error("{src} source regions but {dst} destination regions")]
    RegionCountMismatch {
        /// Source regions.
        src: usize,
        /// Destination regions.
        dst: usize,
    },
    /// A region pair whose page sizes (item lengths) differ.
    #[error("region pair {index}: source pages are {src} bytes, destination pages {dst} bytes")]
    ItemLenMismatch {
        /// Position in the region lists.
        index: usize,
        /// Source `item_len`.
        src: u64,
        /// Destination `item_len`.
        dst: u64,
    },
    /// A byte offset that does not fit in `u64`.
    #[error("page {page} × item length {item_len} overflows")]
    Overflow {
        /// The page.
        page: u32,
        /// The item length.
        item_len: u64,
    },
}

/// Splits `(src[i], dst[i])` pairs into maximal runs contiguous on both sides, in order
/// (SGLang's `group_concurrent_contiguous`). Empty input gives no runs; unequal lengths are
/// [`CoalesceError::PageCountMismatch`].
pub fn page_runs(src: &[Page], dst: &[Page]) -> Result<Vec<PageRun>, CoalesceError> {
    if src.len() != dst.len() {
        return Err(CoalesceError::PageCountMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    let mut runs: Vec<PageRun> = Vec::new();
    for (&s, &d) in src.iter().zip(dst) {
        if let Some(r) = runs.last_mut() {
            let extends =
                r.src.0.checked_add(r.len) == Some(s.0) && r.dst.0.checked_add(r.len) == Some(d.0);
            if extends {
                r.len += 1;
                continue;
            }
        }
        runs.push(PageRun {
            src: s,
            dst: d,
            len: 1,
        });
    }
    Ok(runs)
}

/// One block per run per region pair: `src[j]` (a local region) pairs with `dst[j]` (the
/// peer's region of the same layer and buffer, with its `item_len`, the bytes of one page of
/// it). Blocks are ordered run-major. Unequal region counts or item lengths are errors; bounds
/// are left to the engine's `submit`, which validates the whole batch.
pub fn blocks(
    runs: &[PageRun],
    src: &[(RegionId, MemoryRegion)],
    dst: &[(RegionId, RemoteRegion, u64)],
) -> Result<Vec<TransferBlock>, CoalesceError> {
    if src.len() != dst.len() {
        return Err(CoalesceError::RegionCountMismatch {
            src: src.len(),
            dst: dst.len(),
        });
    }
    for (index, ((_, s), (_, _, d))) in src.iter().zip(dst).enumerate() {
        if s.item_len as u64 != *d {
            return Err(CoalesceError::ItemLenMismatch {
                index,
                src: s.item_len as u64,
                dst: *d,
            });
        }
    }
    let offset = |page: u32, item_len: u64| {
        (page as u64)
            .checked_mul(item_len)
            .ok_or(CoalesceError::Overflow { page, item_len })
    };
    let mut out = Vec::with_capacity(runs.len() * src.len());
    for run in runs {
        for ((src_region, s), (dst_region, _, item_len)) in src.iter().zip(dst) {
            out.push(TransferBlock {
                src_region: *src_region,
                src_offset: offset(run.src.0, s.item_len as u64)?,
                dst_region: *dst_region,
                dst_offset: offset(run.dst.0, *item_len)?,
                len: offset(run.len, *item_len)?,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(v: &[u32]) -> Vec<Page> {
        v.iter().map(|&p| Page(p)).collect()
    }

    #[test]
    fn runs_break_where_either_side_jumps() {
        let runs = page_runs(&pages(&[1, 2, 3, 7, 8, 9]), &pages(&[4, 5, 9, 10, 11, 3])).unwrap();
        let lens: Vec<_> = runs.iter().map(|r| (r.src.0, r.dst.0, r.len)).collect();
        assert_eq!(lens, vec![(1, 4, 2), (3, 9, 1), (7, 10, 2), (9, 3, 1)]);
        assert!(page_runs(&[], &[]).unwrap().is_empty());
        assert_eq!(
            page_runs(&pages(&[1]), &[]),
            Err(CoalesceError::PageCountMismatch { src: 1, dst: 0 })
        );
    }

    #[test]
    fn a_page_at_u32_max_does_not_overflow_the_run_check() {
        let runs = page_runs(&pages(&[u32::MAX, 0]), &pages(&[1, 2])).unwrap();
        assert_eq!(runs.len(), 2);
    }
}
