//! The AVX2 matmul: tiles of 4 `x` rows × 3 weight rows over cache blocks of the weight, and
//! streaming tiles for a decode batch (one or two rows).

use super::super::columns::ColumnBlock;
use super::dot::dot_tile;
use super::elem::{Elem, F16, F32};

/// Rows of `x` per matmul tile.
const MR: usize = 4;

/// Batches of at most this many rows (decode) take the streaming tiles.
const STREAM_ROWS: usize = 2;

/// `out[i, j] = x_i · w_j` for the rows of `x` (`k` each) and the columns `j` of `out` (rows of
/// `w`, `k` elements of `E` each, little-endian bytes), each in the module's fixed dot order, so
/// an element's result never depends on the number of rows or on the block; f16 rows are
/// widened exactly in registers, so an f16 weight gives bitwise what its f32 expansion gives
/// (bf16 weights take [`super::bf16dot`]). Blocks `w` so a block stays in cache over all rows.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`super::available`]). Lengths are asserted.
#[inline(always)]
unsafe fn matmul<E: Elem>(x: &[f32], w: &[u8], k: usize, out: &mut ColumnBlock<'_>) {
    let (m, nb) = blocking(x, w, k, E::BYTES, out);
    let cols = out.cols();
    if m <= STREAM_ROWS {
        // A decode batch reads its weight once from memory: tiles of 64 bytes of weight per
        // step (2 f32 rows, 4 16-bit rows) read it nearly as one stream and prefetch the next
        // tile (see `avx512::stream_tiles`, which measured the same layout).
        // SAFETY: rows 0 .. m of x and the columns of w exist (asserted by `blocking`).
        unsafe {
            match (m, E::BYTES) {
                (1, 4) => matmul_tile::<E, 1, 2>(x, w, k, 0, cols, out, true),
                (_, 4) => matmul_tile::<E, 2, 2>(x, w, k, 0, cols, out, true),
                (1, _) => matmul_tile::<E, 1, 4>(x, w, k, 0, cols, out, true),
                _ => matmul_tile::<E, 2, 4>(x, w, k, 0, cols, out, true),
            }
        }
        return;
    }
    // Plain loops, no closure: a closure is compiled without the caller's target features,
    // so the kernels' intrinsics would become calls.
    for j0 in cols.clone().step_by(nb) {
        let js = j0..(j0 + nb).min(cols.end);
        for i0 in (0..m).step_by(MR) {
            // SAFETY: rows i0 .. i0 + rows of x and js of w exist (`blocking` asserts the
            // lengths); the CPU per contract.
            unsafe {
                match (m - i0).min(MR) {
                    1 => matmul_tile::<E, 1, 3>(x, w, k, i0, js.clone(), out, false),
                    2 => matmul_tile::<E, 2, 3>(x, w, k, i0, js.clone(), out, false),
                    3 => matmul_tile::<E, 3, 3>(x, w, k, i0, js.clone(), out, false),
                    _ => matmul_tile::<E, 4, 3>(x, w, k, i0, js.clone(), out, false),
                }
            }
        }
    }
}

/// The cache blocking both matmuls share, after checking the lengths: `x`'s rows `m`, and the
/// rows of `w` (`k` elements of `bytes` each) per block of `out`'s columns, about 256 KiB of
/// `w`, which stays in cache while all rows of `x` go through it.
#[inline(always)]
pub(super) fn blocking(
    x: &[f32],
    w: &[u8],
    k: usize,
    bytes: usize,
    out: &ColumnBlock<'_>,
) -> (usize, usize) {
    assert!(k > 0 && x.len() % k == 0 && w.len() >= out.cols().end * k * bytes);
    (x.len() / k, block_rows(k, bytes))
}

/// Weight rows per cache block: 256 KiB of rows of `k` elements of `bytes` each (at least 12).
pub(super) fn block_rows(k: usize, bytes: usize) -> usize {
    (65536 * 4 / (k * bytes)).max(12)
}

/// Defines `$name`, the matmul of this module (`matmul::<$elem>` where it is invoked) compiled
/// for the target features `$features` (the AVX2 and AVX-512 modules share it).
macro_rules! matmul_for {
    ($name:ident, $elem:ty, $features:literal) => {
        #[doc = concat!("`matmul` for one weight element type, compiled for ", $features, ".")]
        ///
        /// # Safety
        /// The CPU must have those features (the module's `available`). Lengths are asserted.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name(x: &[f32], w: &[u8], k: usize, out: &mut ColumnBlock<'_>) {
            // SAFETY: forwarded contract.
            unsafe { matmul::<$elem>(x, w, k, out) }
        }
    };
}
pub(super) use matmul_for;

matmul_for!(matmul_f32, F32, "avx2,fma,f16c");
matmul_for!(matmul_f16, F16, "avx2,fma,f16c");

/// Rows `i0 .. i0 + H` of `x` against rows `js` of `w`, into `out`: `P` weight rows at a
/// time, then single rows. With `stream`, each tile of `P` rows prefetches the next one's
/// bytes (the rows follow each other), line after line as it goes.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. (Rows are sliced with bounds checks.)
#[inline(always)]
unsafe fn matmul_tile<E: Elem, const H: usize, const P: usize>(
    x: &[f32],
    w: &[u8],
    k: usize,
    i0: usize,
    js: std::ops::Range<usize>,
    out: &mut ColumnBlock<'_>,
    stream: bool,
) {
    let a: [*const f32; H] = std::array::from_fn(|i| x[(i0 + i) * k..][..k].as_ptr());
    let rb = k * E::BYTES;
    let row = |j: usize| w[j * rb..][..rb].as_ptr();
    let tile = P * rb;
    let per = if stream && k >= 8 {
        tile.div_ceil(64).div_ceil(k / 8)
    } else {
        0
    };
    let mut j = js.start;
    while j + P <= js.end {
        let b: [*const u8; P] = std::array::from_fn(|p| row(j + p));
        // SAFETY: the x rows hold k f32 and the P w rows k elements of E each (sliced); CPU
        // per contract; the prefetches are hints.
        let t = unsafe { dot_tile::<E, H, P>(&a, b, k, (b[0].wrapping_add(tile), per)) };
        out.put_tile(i0, j, &t);
        j += P;
    }
    while j < js.end {
        // SAFETY: as above, one w row, no prefetch.
        let t = unsafe { dot_tile::<E, H, 1>(&a, [row(j)], k, (row(j), 0)) };
        out.put_tile(i0, j, &t);
        j += 1;
    }
}
