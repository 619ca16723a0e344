//! Disjoint column blocks of a row-major `[m, n]` output, so the jobs of one matmul can each
//! write their own columns from their own thread (what `split_at_mut` does for rows).

use std::marker::PhantomData;
use std::ops::Range;

/// Columns `cols` of every row of a row-major `[m, n]` output, borrowed mutably: no other
/// block of the same split holds any of those columns.
pub(crate) struct ColumnBlock<'a> {
    ptr: *mut f32,
    len: usize,
    n: usize,
    cols: Range<usize>,
    _dst: PhantomData<&'a mut [f32]>,
}

// SAFETY: a block is a unique borrow of its elements (the split hands out disjoint column
// ranges of one `&mut` slice, see `split`), like a `&mut [f32]`, which is `Send`.
unsafe impl Send for ColumnBlock<'_> {}

impl<'a> ColumnBlock<'a> {
    /// Splits `dst` (`m × n`, row-major) at the column `bounds` (`0 = b_0 < b_1 < … = n`):
    /// block `i` holds columns `b_i .. b_{i+1}` of every row.
    pub(crate) fn split(dst: &'a mut [f32], n: usize, bounds: &[usize]) -> Vec<ColumnBlock<'a>> {
        assert!(n > 0 && dst.len() % n == 0, "dst is not m × {n}");
        assert!(
            bounds.first() == Some(&0)
                && bounds.last() == Some(&n)
                && bounds.windows(2).all(|w| w[0] < w[1]),
            "column bounds {bounds:?} do not split 0..{n}"
        );
        let (ptr, len) = (dst.as_mut_ptr(), dst.len());
        bounds
            .windows(2)
            .map(|w| ColumnBlock {
                ptr,
                len,
                n,
                cols: w[0]..w[1],
                _dst: PhantomData,
            })
            .collect()
    }

    /// The block's columns.
    pub(crate) fn cols(&self) -> Range<usize> {
        self.cols.clone()
    }

    /// Stores `v` at row `i`, column `j` (which must be one of the block's columns).
    #[inline(always)]
    pub(crate) fn set(&mut self, i: usize, j: usize, v: f32) {
        let at = i * self.n + j;
        assert!(
            self.cols.contains(&j) && at < self.len,
            "({i}, {j}) outside the block"
        );
        // SAFETY: `at` is inside the borrowed slice (asserted), and column `j` belongs to this
        // block alone (`split` hands out disjoint ranges), so nothing else reads or writes the
        // element while the borrow `'a` lasts.
        unsafe { self.ptr.add(at).write(v) }
    }

    /// Row `i`'s columns `cols` (which must be some of the block's), as a slice: one check for a
    /// run of stores instead of one per element.
    #[inline(always)]
    pub(crate) fn row(&mut self, i: usize, cols: Range<usize>) -> &mut [f32] {
        let at = i * self.n + cols.start;
        assert!(
            self.cols.start <= cols.start
                && cols.start <= cols.end
                && cols.end <= self.cols.end
                && at + cols.len() <= self.len,
            "row {i}, columns {cols:?} outside the block"
        );
        // SAFETY: the elements are inside the borrowed slice (asserted), and their columns
        // belong to this block alone (`split` hands out disjoint ranges), so nothing else reads
        // or writes them while the returned borrow (of `self`, within `'a`) lasts.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), cols.len()) }
    }

    /// Stores a tile of results `t[p][h]` at row `i0 + h`, column `j + p`, one row's run at a
    /// time ([`row`](Self::row)).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // the results are indexed [column][row]
    pub(crate) fn put_tile<const H: usize, const P: usize>(
        &mut self,
        i0: usize,
        j: usize,
        t: &[[f32; H]; P],
    ) {
        for h in 0..H {
            for (p, v) in self.row(i0 + h, j..j + P).iter_mut().enumerate() {
                *v = t[p][h];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks filled from different threads cover every element exactly once.
    #[test]
    fn blocks_write_their_columns_from_any_thread() {
        let (m, n) = (5, 11);
        let mut dst = vec![-1.0f32; m * n];
        let blocks = ColumnBlock::split(&mut dst, n, &[0, 3, 4, 11]);
        std::thread::scope(|s| {
            for mut b in blocks {
                s.spawn(move || {
                    for i in 0..m {
                        for j in b.cols() {
                            b.set(i, j, (i * n + j) as f32);
                        }
                    }
                });
            }
        });
        assert!(dst.iter().enumerate().all(|(e, &v)| v == e as f32));
    }

    #[test]
    #[should_panic(expected = "outside the block")]
    fn a_column_of_another_block_panics() {
        let mut dst = vec![0.0f32; 8];
        let mut blocks = ColumnBlock::split(&mut dst, 4, &[0, 2, 4]);
        blocks[0].set(0, 2, 1.0);
    }

    #[test]
    #[should_panic(expected = "outside the block")]
    fn a_row_past_the_end_panics() {
        let mut dst = vec![0.0f32; 8];
        let mut blocks = ColumnBlock::split(&mut dst, 4, &[0, 4]);
        blocks[0].set(2, 0, 1.0);
    }

    /// A row's run of columns is the same elements as `set` writes.
    #[test]
    fn a_rows_columns_are_its_elements() {
        let (m, n) = (3, 7);
        let mut dst = vec![-1.0f32; m * n];
        let mut blocks = ColumnBlock::split(&mut dst, n, &[0, 2, 7]);
        for i in 0..m {
            for (c, v) in blocks[1].row(i, 3..6).iter_mut().enumerate() {
                *v = (i * n + 3 + c) as f32;
            }
        }
        drop(blocks);
        for (e, &v) in dst.iter().enumerate() {
            let (i, j) = (e / n, e % n);
            let want = if (3..6).contains(&j) {
                (i * n + j) as f32
            } else {
                -1.0
            };
            assert_eq!(v, want, "({i}, {j})");
        }
    }

    #[test]
    #[should_panic(expected = "outside the block")]
    fn a_row_run_into_another_block_panics() {
        let mut dst = vec![0.0f32; 8];
        let mut blocks = ColumnBlock::split(&mut dst, 4, &[0, 2, 4]);
        blocks[0].row(1, 1..3);
    }

    #[test]
    #[should_panic(expected = "do not split")]
    fn overlapping_bounds_panic() {
        let mut dst = vec![0.0f32; 8];
        let _ = ColumnBlock::split(&mut dst, 4, &[0, 2, 2, 4]);
    }
}
