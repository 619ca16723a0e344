//! The AVX2 matmul: tiles of 4 `x` rows × 3 weight rows over cache blocks of the weight.

use super::super::columns::ColumnBlock;
use super::dot::dot_tile;
use super::elem::{Bf16, Elem, F16, F32};

/// Rows of `x` per matmul tile.
const MR: usize = 4;

/// `out[i, j] = x_i · w_j` for the rows of `x` (`k` each) and the columns `j` of `out` (rows of
/// `w`, `k` elements of `E` each, little-endian bytes), each in the module's fixed dot order, so
/// an element's result never depends on the number of rows or on the block; 16-bit rows are
/// widened exactly in registers, so a bf16 or f16 weight gives bitwise what its f32 expansion
/// gives. Blocks `w` so a block stays in cache over all rows.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`super::available`]). Lengths are asserted.
#[inline(always)]
unsafe fn matmul<E: Elem>(x: &[f32], w: &[u8], k: usize, out: &mut ColumnBlock<'_>) {
    let (m, nb) = blocking(x, w, k, E::BYTES, out);
    let cols = out.cols();
    // Plain loops, no closure: a closure is compiled without the caller's target features,
    // so the kernels' intrinsics would become calls.
    for j0 in cols.clone().step_by(nb) {
        let js = j0..(j0 + nb).min(cols.end);
        for i0 in (0..m).step_by(MR) {
            // SAFETY: rows i0 .. i0 + rows of x and js of w exist (`blocking` asserts the
            // lengths); the CPU per contract.
            unsafe {
                match (m - i0).min(MR) {
                    1 => matmul_tile::<E, 1>(x, w, k, i0, js.clone(), out),
                    2 => matmul_tile::<E, 2>(x, w, k, i0, js.clone(), out),
                    3 => matmul_tile::<E, 3>(x, w, k, i0, js.clone(), out),
                    _ => matmul_tile::<E, 4>(x, w, k, i0, js.clone(), out),
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
    (x.len() / k, (65536 * 4 / (k * bytes)).max(12))
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
matmul_for!(matmul_bf16, Bf16, "avx2,fma,f16c");

/// Rows `i0 .. i0 + H` of `x` against rows `js` of `w`, into `out`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. (Rows are sliced with bounds checks.)
#[inline(always)]
unsafe fn matmul_tile<E: Elem, const H: usize>(
    x: &[f32],
    w: &[u8],
    k: usize,
    i0: usize,
    js: std::ops::Range<usize>,
    out: &mut ColumnBlock<'_>,
) {
    let a: [*const f32; H] = std::array::from_fn(|i| x[(i0 + i) * k..][..k].as_ptr());
    let rb = k * E::BYTES;
    let row = |j: usize| w[j * rb..][..rb].as_ptr();
    let mut j = js.start;
    while j + 3 <= js.end {
        // SAFETY: the x rows hold k f32 and the three w rows k elements of E each (sliced); CPU
        // per contract.
        let t = unsafe { dot_tile::<E, H, 3>(&a, [row(j), row(j + 1), row(j + 2)], k) };
        for (p, t) in t.iter().enumerate() {
            for (h, &v) in t.iter().enumerate() {
                out.set(i0 + h, j + p, v);
            }
        }
        j += 3;
    }
    while j < js.end {
        // SAFETY: as above, one w row.
        let [t] = unsafe { dot_tile::<E, H, 1>(&a, [row(j)], k) };
        for (h, &v) in t.iter().enumerate() {
            out.set(i0 + h, j, v);
        }
        j += 1;
    }
}
