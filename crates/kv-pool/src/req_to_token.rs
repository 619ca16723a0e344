//! [`ReqToTokenPool`]: the first level of the memory pool, mapping (request row, position) to
//! the KV slot of that token (SGLang's `ReqToTokenPool`, `memory_pool.py`).
//!
//! The table has `max_running_requests + 1` rows of `context_len + 4` positions; row 0 is the
//! padding row that padded batch entries point at and is never handed out. Rows are handed out
//! from the head of a free list and returned to its tail; each reuse bumps the row's generation,
//! so a stale handle can be told from a live one.

use std::collections::VecDeque;
use std::fmt;

use crate::error::{KvPoolError, Result};
use crate::ids::{ReqRow, Slot};

/// Positions per row beyond the context length (as SGLang: `context_len + 4`).
pub const ROW_PADDING: usize = 4;

/// The request-to-token table.
#[derive(Debug, Clone)]
pub struct ReqToTokenPool {
    rows: usize,
    width: usize,
    table: Vec<Slot>,
    free_rows: VecDeque<u32>,
    allocated: Vec<bool>,
    /// Rows written since construction or the last clear (only those need zeroing).
    dirty: Vec<bool>,
    generation: Vec<u32>,
}

impl ReqToTokenPool {
    /// A table for `max_running_requests` requests of up to `context_len` tokens.
    pub fn new(max_running_requests: usize, context_len: usize) -> Result<Self> {
        if max_running_requests == 0 {
            return Err(KvPoolError::InvalidConfig {
                field: "max_running_requests",
                reason: "must be at least 1".into(),
            });
        }
        if context_len == 0 {
            return Err(KvPoolError::InvalidConfig {
                field: "context_len",
                reason: "must be at least 1".into(),
            });
        }
        if max_running_requests >= u32::MAX as usize {
            return Err(KvPoolError::InvalidConfig {
                field: "max_running_requests",
                reason: format!("{max_running_requests} exceeds the u32 row id range"),
            });
        }
        let width = context_len
            .checked_add(ROW_PADDING)
            .ok_or(KvPoolError::Overflow("row width"))?;
        let cells = (max_running_requests + 1)
            .checked_mul(width)
            .ok_or(KvPoolError::Overflow("request-to-token table size"))?;
        let table = zeroed_slots(cells)?;
        Ok(ReqToTokenPool {
            rows: max_running_requests,
            width,
            table,
            free_rows: (1..=max_running_requests as u32).collect(),
            allocated: vec![false; max_running_requests + 1],
            dirty: vec![false; max_running_requests + 1],
            generation: vec![0; max_running_requests + 1],
        })
    }

    /// Real rows (`max_running_requests`); row ids are `1..=rows`.
    pub fn size(&self) -> usize {
        self.rows
    }

    /// Positions per row (`context_len + 4`).
    pub fn width(&self) -> usize {
        self.width
    }

    /// Rows that can still be allocated (the padding row 0 never counts).
    pub fn available_size(&self) -> usize {
        self.free_rows.len()
    }

    /// How many times `row` has been handed out.
    pub fn generation(&self, row: ReqRow) -> Result<u32> {
        self.check_row(row)?;
        Ok(self.generation[row.index()])
    }

    /// Whether `row` is allocated.
    pub fn is_allocated(&self, row: ReqRow) -> bool {
        row.index() >= 1 && row.index() <= self.rows && self.allocated[row.index()]
    }

    /// Allocates `n` rows from the head of the free list, all or nothing.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<ReqRow>> {
        if n > self.free_rows.len() {
            return Err(KvPoolError::OutOfRows {
                requested: n,
                available: self.free_rows.len(),
            });
        }
        let rows: Vec<ReqRow> = self.free_rows.drain(..n).map(ReqRow).collect();
        for r in &rows {
            self.allocated[r.index()] = true;
            self.generation[r.index()] = self.generation[r.index()].wrapping_add(1);
        }
        Ok(rows)
    }

    /// Allocates the row at the head of the free list ([`KvPoolError::OutOfRows`] when none
    /// is free).
    pub fn alloc_one(&mut self) -> Result<ReqRow> {
        Ok(self.alloc(1)?[0])
    }

    /// Returns `row` to the tail of the free list. Its slots are not touched (the caller frees
    /// them through the allocator first).
    pub fn free(&mut self, row: ReqRow) -> Result<()> {
        self.check_allocated(row)?;
        self.allocated[row.index()] = false;
        self.free_rows.push_back(row.0);
        Ok(())
    }

    /// Writes `slots` at positions `start..start + slots.len()` of `row`.
    pub fn write(&mut self, row: ReqRow, start: usize, slots: &[Slot]) -> Result<()> {
        let range = self.range(row, start, slots.len())?;
        self.table[range].copy_from_slice(slots);
        self.dirty[row.index()] = true;
        Ok(())
    }

    /// The slots of positions `0..len` of `row`.
    pub fn read(&self, row: ReqRow, len: usize) -> Result<&[Slot]> {
        let range = self.range(row, 0, len)?;
        Ok(&self.table[range])
    }

    /// The slots of positions `start..start + len` of `row`.
    pub fn read_range(&self, row: ReqRow, start: usize, len: usize) -> Result<&[Slot]> {
        let range = self.range(row, start, len)?;
        Ok(&self.table[range])
    }

    /// Frees every row and zeroes the table.
    pub fn clear(&mut self) {
        for r in 1..=self.rows {
            if std::mem::take(&mut self.dirty[r]) {
                self.table[r * self.width..(r + 1) * self.width].fill(Slot::PADDING);
            }
        }
        self.free_rows = (1..=self.rows as u32).collect();
        self.allocated.fill(false);
    }

    fn check_row(&self, row: ReqRow) -> Result<()> {
        if row.index() == 0 || row.index() > self.rows {
            return Err(KvPoolError::RowOutOfRange {
                row,
                rows: self.rows,
            });
        }
        Ok(())
    }

    fn check_allocated(&self, row: ReqRow) -> Result<()> {
        self.check_row(row)?;
        if !self.allocated[row.index()] {
            return Err(KvPoolError::RowNotAllocated { row });
        }
        Ok(())
    }

    fn range(&self, row: ReqRow, start: usize, len: usize) -> Result<std::ops::Range<usize>> {
        self.check_allocated(row)?;
        let end = start.checked_add(len).filter(|&e| e <= self.width).ok_or(
            KvPoolError::RowRangeOutOfBounds {
                start,
                end: start.saturating_add(len),
                width: self.width,
            },
        )?;
        let base = row.index() * self.width;
        Ok(base + start..base + end)
    }
}

/// `n` padding slots in one zeroed allocation. The dense table can be large (SGLang sizes it
/// `(max_running_requests + 1) × (context_len + 4)`: 4,097 rows of a 128k context are 2 GiB),
/// and the allocator hands out zeroed memory lazily: pages are only touched where rows are
/// written, instead of all at construction (measured: constant time instead of about 0.5 s per
/// GiB here). An impossible size is an error, not an abort.
fn zeroed_slots(n: usize) -> Result<Vec<Slot>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let bytes = n.saturating_mul(std::mem::size_of::<Slot>());
    let layout =
        std::alloc::Layout::array::<Slot>(n).map_err(|_| KvPoolError::HostOutOfMemory { bytes })?;
    // SAFETY: `layout` has a non-zero size (n > 0 and a Slot is 4 bytes). `alloc_zeroed`
    // returns null (checked) or a block of `layout.size()` zeroed bytes aligned for `Slot`.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<Slot>();
    if ptr.is_null() {
        return Err(KvPoolError::HostOutOfMemory { bytes });
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `[Slot; n]`
    // (capacity `n`, `Slot`'s alignment), and all `n` elements are initialised: an all-zero
    // u32 is a valid `Slot` (it is `#[repr(transparent)]` over u32 and `Pod`).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

impl fmt::Display for ReqToTokenPool {
    /// The table's shape, the free rows in order, and each allocated row's leading non-padding
    /// slots.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "req_to_token rows={} width={} free=[{}]",
            self.rows,
            self.width,
            crate::allocator::render_page_runs(self.free_rows.iter().copied())
        )?;
        for r in 1..=self.rows {
            if !self.allocated[r] {
                continue;
            }
            let row = &self.table[r * self.width..(r + 1) * self.width];
            let used = row
                .iter()
                .rposition(|s| *s != Slot::PADDING)
                .map_or(0, |i| i + 1);
            let slots: Vec<String> = row[..used].iter().map(|s| s.0.to_string()).collect();
            writeln!(
                f,
                "  row {r} (gen {}): [{}]",
                self.generation[r],
                slots.join(" ")
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_all_or_nothing_and_fifo() {
        let mut pool = ReqToTokenPool::new(3, 8).unwrap();
        assert_eq!(pool.width(), 12);
        let rows = pool.alloc(2).unwrap();
        assert_eq!(rows, [ReqRow(1), ReqRow(2)]);
        assert_eq!(
            pool.alloc(2),
            Err(KvPoolError::OutOfRows {
                requested: 2,
                available: 1
            })
        );
        assert_eq!(pool.available_size(), 1);
        pool.free(ReqRow(1)).unwrap();
        assert_eq!(pool.alloc(2).unwrap(), [ReqRow(3), ReqRow(1)]);
        assert_eq!(pool.generation(ReqRow(1)).unwrap(), 2);
    }

    #[test]
    fn write_read_and_bounds() {
        let mut pool = ReqToTokenPool::new(2, 4).unwrap();
        let r = pool.alloc_one().unwrap();
        pool.write(r, 0, &[Slot(5), Slot(6)]).unwrap();
        pool.write(r, 2, &[Slot(9)]).unwrap();
        assert_eq!(pool.read(r, 3).unwrap(), &[Slot(5), Slot(6), Slot(9)]);
        assert_eq!(pool.read_range(r, 1, 1).unwrap(), &[Slot(6)]);
        assert_eq!(
            pool.write(r, 7, &[Slot(1), Slot(2)]),
            Err(KvPoolError::RowRangeOutOfBounds {
                start: 7,
                end: 9,
                width: 8
            })
        );
        assert!(pool.write(r, usize::MAX, &[Slot(1)]).is_err());
        assert_eq!(
            pool.read(r, 3).unwrap(),
            &[Slot(5), Slot(6), Slot(9)],
            "failed write changed nothing"
        );
        assert_eq!(
            pool.read(ReqRow(2), 1),
            Err(KvPoolError::RowNotAllocated { row: ReqRow(2) })
        );
        assert_eq!(
            pool.read(ReqRow(0), 1),
            Err(KvPoolError::RowOutOfRange {
                row: ReqRow(0),
                rows: 2
            })
        );
        assert_eq!(
            pool.read(ReqRow(3), 1),
            Err(KvPoolError::RowOutOfRange {
                row: ReqRow(3),
                rows: 2
            })
        );
    }

    #[test]
    fn double_free_of_a_row_is_refused() {
        let mut pool = ReqToTokenPool::new(2, 4).unwrap();
        let r = pool.alloc_one().unwrap();
        pool.free(r).unwrap();
        assert_eq!(pool.free(r), Err(KvPoolError::RowNotAllocated { row: r }));
        assert_eq!(pool.available_size(), 2);
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(ReqToTokenPool::new(0, 8).is_err());
        assert!(ReqToTokenPool::new(8, 0).is_err());
        assert_eq!(
            ReqToTokenPool::new(4, usize::MAX).unwrap_err(),
            KvPoolError::Overflow("row width")
        );
        assert!(matches!(
            ReqToTokenPool::new(1 << 30, 1 << 40),
            Err(KvPoolError::Overflow(_))
        ));
        assert!(matches!(
            ReqToTokenPool::new(1 << 40, 8),
            Err(KvPoolError::InvalidConfig {
                field: "max_running_requests",
                ..
            })
        ));
    }

    #[test]
    fn zeroed_table_reads_padding_and_is_writable_everywhere() {
        let mut v = zeroed_slots(1000).unwrap();
        assert_eq!(v.len(), 1000);
        assert!(v.iter().all(|s| *s == Slot::PADDING));
        v[999] = Slot(7);
        v.push(Slot(8));
        assert_eq!(&v[999..], &[Slot(7), Slot(8)]);
        assert!(zeroed_slots(0).unwrap().is_empty());
        assert!(matches!(
            zeroed_slots(usize::MAX / 2),
            Err(KvPoolError::HostOutOfMemory { .. })
        ));
    }

    #[test]
    fn clear_frees_everything() {
        let mut pool = ReqToTokenPool::new(2, 4).unwrap();
        let r = pool.alloc_one().unwrap();
        pool.write(r, 0, &[Slot(3)]).unwrap();
        pool.clear();
        assert_eq!(pool.available_size(), 2);
        let r = pool.alloc_one().unwrap();
        assert_eq!(pool.read(r, 1).unwrap(), &[Slot::PADDING]);
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "insta reads snapshot files, which miri's isolation forbids"
    )]
    fn rendering() {
        let mut pool = ReqToTokenPool::new(3, 4).unwrap();
        let rows = pool.alloc(2).unwrap();
        pool.write(rows[0], 0, &[Slot(4), Slot(5), Slot(6)])
            .unwrap();
        pool.write(rows[1], 0, &[Slot(8)]).unwrap();
        insta::assert_snapshot!(pool.to_string(), @r"
        req_to_token rows=3 width=8 free=[3]
          row 1 (gen 1): [4 5 6]
          row 2 (gen 1): [8]
        ");
    }
}
