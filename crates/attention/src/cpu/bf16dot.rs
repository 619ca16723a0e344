//! The matmul of bf16 weights: activations rounded to bf16 once per matmul, and the dot product
//! of AVX-512 BF16's `vdpbf16ps`, defined here in portable code (the reference every kernel
//! equals bitwise, and the kernel where the CPU has no AVX2); `simd::bf16dot` runs it on AVX-512
//! BF16 and emulates it on AVX2, and `dense` picks the kernel.
//!
//! As llama.cpp, SGLang's and vLLM's CPU kernels do for bf16 models, an `x` row is rounded to
//! bf16 ([`round`]: nearest-even, zero and subnormal inputs to a signed zero, NaN stays NaN, as
//! `vcvtneps2bf16`), into rows of `kp` = `k` rounded up to [`STEP`] elements, zero-padded. The
//! dot product of such a row with a weight row has 16 f32 lanes; `k` goes in steps of 32, and
//! lane `l` at step `s` does `acc += x[32s + 2l + 1] · w[32s + 2l + 1]`, then `acc += x[32s + 2l]
//! · w[32s + 2l]`, each one rounding (a bf16 × bf16 product is exact in f32, so a fused and an
//! unfused multiply-add give the same bits), the weight's tail past `k` read as zeros. The
//! lanes are then summed as `sum8(l_i + l_{i+8})` ([`sum16`]), the fixed tree of the f32 kernels.
//!
//! Where the kernels may differ: an intermediate outside f32's normal range. `vdpbf16ps` treats
//! subnormal inputs as zero and flushes subnormal results (DAZ, FTZ); the emulations (AVX2 and
//! this portable code) keep them, and an overflowing product is infinite unfused but may be
//! cancelled fused. Invariance does not depend on it: one machine always runs one kernel, for
//! every row, batch, chunk and thread count, and every kernel computes a row's element in one
//! fixed order whatever the tile; only bits across machines of different ISAs may differ there.

use super::columns::ColumnBlock;
use super::primitives::sum8;

/// Elements per step of the dot product: 16 lanes of a pair each.
pub(crate) const STEP: usize = 32;

/// The bf16 bits of `v` as `vcvtneps2bf16` rounds it: to nearest, ties to even; a zero or
/// subnormal input gives a zero of its sign; a NaN stays NaN (quiet); overflow gives infinity.
#[inline(always)]
pub(crate) fn round(v: f32) -> u16 {
    let b = v.to_bits();
    let top = (b >> 16) as u16;
    if b & 0x7F80_0000 == 0 {
        top & 0x8000
    } else if b & 0x7FFF_FFFF > 0x7F80_0000 {
        top | 0x0040
    } else {
        (b.wrapping_add(0x7FFF + (b >> 16 & 1)) >> 16) as u16
    }
}

/// The f32 value of bf16 bits (exact).
#[inline(always)]
pub(crate) fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Elements per rounded row for rows of `k`: `k` rounded up to [`STEP`].
pub(crate) fn padded(k: usize) -> usize {
    k.div_ceil(STEP) * STEP
}

/// The rows of `x` (`k` each) rounded to bf16 into `dst`, rows of [`padded`]`(k)` with zeros
/// after `k`. Written to vectorise: the SIMD module compiles it for AVX2.
#[inline(always)]
pub(crate) fn round_rows(x: &[f32], k: usize, dst: &mut [u16]) {
    let kp = padded(k);
    assert!(k > 0 && x.len() % k == 0 && dst.len() == x.len() / k * kp);
    for (row, out) in x.chunks_exact(k).zip(dst.chunks_exact_mut(kp)) {
        let (vals, pad) = out.split_at_mut(k);
        vals.iter_mut().zip(row).for_each(|(o, &v)| *o = round(v));
        pad.fill(0);
    }
}

/// The 16 lanes summed in the fixed order: `sum8` of `l_i + l_{i+8}`.
#[inline(always)]
pub(crate) fn sum16(l: &[f32; 16]) -> f32 {
    sum8(&std::array::from_fn(|i| l[i] + l[i + 8]))
}

/// The dot product of a rounded `x` row (`padded(w.len())` elements, zeros past `w.len()`) and
/// a bf16 weight row `w`, in the order of the module docs.
pub(crate) fn dot(x: &[u16], w: &[u16]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let at = |e: usize| w.get(e).map_or(0.0, |&b| widen(b));
    for (s, xs) in x.chunks_exact(STEP).enumerate() {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let e = s * STEP + 2 * l;
            *lane += widen(xs[2 * l + 1]) * at(e + 1);
            *lane += widen(xs[2 * l]) * at(e);
        }
    }
    sum16(&lanes)
}

/// The portable matmul of rounded rows `x` (`kp` each) by bf16 weight rows (`k` each): one
/// [`dot`] per element of `out`'s columns.
pub(crate) fn matmul_portable(x: &[u16], w: &[u16], k: usize, out: &mut ColumnBlock<'_>) {
    let kp = padded(k);
    for j in out.cols() {
        let wr = &w[j * k..][..k];
        for (i, xr) in x.chunks_exact(kp).enumerate() {
            out.set(i, j, dot(xr, wr));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounding is `half`'s round-to-nearest-even for normal values, and flushes subnormals
    /// to signed zeros; infinities and NaNs stay what they are.
    #[test]
    fn rounding_is_nearest_even_with_subnormals_flushed() {
        let mut bits = 0u32;
        while bits < u32::MAX - 9973 {
            let v = f32::from_bits(bits);
            let got = round(v);
            if v.is_nan() {
                assert!(widen(got).is_nan(), "{bits:#x}");
            } else if v != 0.0 && v.abs() < f32::MIN_POSITIVE {
                assert_eq!(got, (bits >> 16) as u16 & 0x8000, "{bits:#x}");
            } else {
                assert_eq!(got, half::bf16::from_f32(v).to_bits(), "{bits:#x}");
            }
            bits += 9973;
        }
        for v in [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            -f32::MAX,
        ] {
            assert_eq!(round(v), half::bf16::from_f32(v).to_bits(), "{v}");
        }
        assert_eq!(round(f32::from_bits(0x0000_0001)), 0);
        assert_eq!(round(f32::from_bits(0x8000_0001)), 0x8000);
        assert_eq!(round(f32::from_bits(0x7FC0_0001)), 0x7FC0);
        assert_eq!(round(f32::from_bits(0x7F80_0001)), 0x7FC0);
        // Ties go to even: 1 + 2⁻⁸ lies between 1 and 1 + 2⁻⁷.
        assert_eq!(round(1.0 + 1.0 / 256.0), 0x3F80);
        assert_eq!(round(1.0 + 3.0 / 256.0), 0x3F82);
    }

    /// Rows are rounded into padded rows, zeros after `k`; the AVX2 build gives the same bits.
    #[test]
    fn rows_are_rounded_and_padded() {
        let (k, m) = (37, 3);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 - 50.0) * 0.3711).collect();
        let mut want = vec![7u16; m * padded(k)];
        round_rows(&x, k, &mut want);
        for (i, row) in want.chunks_exact(padded(k)).enumerate() {
            for (e, &b) in row.iter().enumerate() {
                let v = if e < k { round(x[i * k + e]) } else { 0 };
                assert_eq!(b, v, "row {i} element {e}");
            }
        }
        #[cfg(target_arch = "x86_64")]
        if super::super::simd::available() {
            let mut got = vec![7u16; m * padded(k)];
            // SAFETY: the CPU has AVX2 (checked).
            unsafe { super::super::simd::bf16dot::round_rows(&x, k, &mut got) };
            assert_eq!(got, want);
        }
    }

    /// The portable dot product against an f64 dot product of the same bf16 values: the lane
    /// order only changes rounding, within `k` roundings of the absolute sum (f32's 2⁻²⁴ each).
    #[test]
    fn dot_is_the_bf16_values_dot_product_within_rounding() {
        let mut rng = kv_pool::rng::SplitMix64::new(21);
        for k in [1, 31, 32, 33, 100, 576] {
            let xf = crate::conformance::nonzero_vec(&mut rng, k);
            let wf = crate::conformance::nonzero_vec(&mut rng, k);
            let mut x = vec![0u16; padded(k)];
            round_rows(&xf, k, &mut x);
            let w: Vec<u16> = wf.iter().map(|&v| round(v)).collect();
            let (mut exact, mut abs) = (0.0f64, 0.0f64);
            for e in 0..k {
                let p = f64::from(widen(x[e])) * f64::from(widen(w[e]));
                exact += p;
                abs += p.abs();
            }
            let got = f64::from(dot(&x, &w));
            let bound = abs * (k as f64 + 16.0) * f64::from(f32::EPSILON) / 2.0;
            assert!((got - exact).abs() <= bound, "k {k}: {got} vs {exact}");
        }
    }
}
