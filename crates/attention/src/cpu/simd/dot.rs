//! The AVX2 dot-product tile: `H` f32 rows against `P` rows of an element type, eight lanes
//! per dot product in the module's fixed order, sharing every load.

use std::arch::x86_64::*;

use super::elem::{hsum_tile, Elem};

/// Dot products of `H` f32 rows `a[h]` with `P` rows `b[p]` of `E`, `d` elements each, in the
/// module's fixed order: `out[p][h] = a[h]·b[p]` (an `H × P` register tile sharing every load).
///
/// With `per > 0` it also prefetches `per` cache lines from `next` on per step of 8 elements,
/// line after line (hints: no effect on the result, and they never fault).
///
/// # Safety
/// Every `a[h]` must be valid for `d` f32 reads, every `b[p]` for `d` elements of `E`, and the
/// CPU must have AVX2, FMA and F16C.
#[inline(always)]
pub(super) unsafe fn dot_tile<E: Elem, const H: usize, const P: usize>(
    a: &[*const f32; H],
    b: [*const u8; P],
    d: usize,
    (next, per): (*const u8, usize),
) -> [[f32; H]; P] {
    // SAFETY: every access is below `d` elements of its row (see the function's contract).
    unsafe {
        let mut c = [[_mm256_setzero_ps(); H]; P];
        let chunks = d / 8;
        for ch in 0..chunks {
            for q in 0..per {
                let at = next.wrapping_add((ch * per + q) * 64);
                _mm_prefetch::<_MM_HINT_T0>(at.cast());
            }
            let k: [__m256; P] = std::array::from_fn(|p| E::load8(b[p].add(ch * 8 * E::BYTES)));
            for h in 0..H {
                let q = _mm256_loadu_ps(a[h].add(ch * 8));
                for p in 0..P {
                    c[p][h] = _mm256_fmadd_ps(q, k[p], c[p][h]);
                }
            }
        }
        let mut s = hsum_tile(&c);
        for p in 0..P {
            for h in 0..H {
                for e in chunks * 8..d {
                    s[p][h] = (*a[h].add(e)).mul_add(E::load1(b[p].add(e * E::BYTES)), s[p][h]);
                }
            }
        }
        s
    }
}
