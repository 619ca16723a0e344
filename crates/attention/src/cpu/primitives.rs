//! The scalar primitives both CPU kernels build on: the fixed block of the reduction order, the
//! head geometry of a call, the fixed-order dot product and the softmax exponential. The
//! portable kernels ([`super::attention`], [`super::dense`]) call them directly; the AVX2
//! kernels ([`super::simd`]) reproduce them eight lanes at a time, bitwise, so both read the
//! same constants from here.

/// KV positions per block of the fixed reduction order.
pub(crate) const BLOCK: usize = 32;

/// Head geometry of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geom {
    pub q_heads: usize,
    /// Query heads per KV head (1 for MHA, `q_heads` for MQA and MLA).
    pub group: usize,
    /// Elements per query and key head (the dimension of `q·k`).
    pub d: usize,
    /// Elements per value head and per output head.
    pub dv: usize,
    /// Elements per K row in the store.
    pub k_row: usize,
    /// Elements per V row in the store (unused when `v_in_k`).
    pub v_row: usize,
    /// MLA: the value is the first `dv` elements of the (single-head) K row.
    pub v_in_k: bool,
}

/// `a · b + c`, fused when `FMA` (reserved for a SIMD build; the shipped kernel is unfused).
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Dot product in a fixed order: lane `i` of eight accumulates elements `i, i + 8, …`, the
/// lanes are summed by [`sum8`] (the order of the AVX2 kernels' horizontal sum), then the tail
/// is added element by element.
#[inline(always)]
pub(crate) fn dot_with<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let ac = a.chunks_exact(8);
    let bc = b.chunks_exact(8);
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] = madd::<FMA>(x[i], y[i], lanes[i]);
        }
    }
    let mut s = sum8(&lanes);
    for (x, y) in ar.iter().zip(br) {
        s = madd::<FMA>(*x, *y, s);
    }
    s
}

/// Eight lanes summed in the fixed order of the kernels' horizontal sums:
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
#[inline(always)]
pub(crate) fn sum8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// [`dot_with`] without fusion.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with::<false>(a, b)
}

/// `e^x` for `x ≤ 0` (softmax weights), vectorisable: Cody–Waite reduction `x = n·ln2 + r`,
/// `|r| ≤ ln2/2`, a degree-6 Taylor polynomial for `e^r` (relative error below 2e-7), and
/// `2^n` built in the exponent bits. Inputs below −87 give 0 (e^−87 is below f32's normal
/// range), as do −∞.
#[inline(always)]
pub(crate) fn exp_nonpos<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let small = x < -87.0;
    let x = if small { -87.0 } else { x };
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, x));
    let mut p = 1.0 / 720.0;
    p = madd::<FMA>(p, r, 1.0 / 120.0);
    p = madd::<FMA>(p, r, 1.0 / 24.0);
    p = madd::<FMA>(p, r, 1.0 / 6.0);
    p = madd::<FMA>(p, r, 0.5);
    p = madd::<FMA>(p, r, 1.0);
    p = madd::<FMA>(p, r, 1.0);
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if small {
        0.0
    } else {
        p * scale
    }
}

/// `silu(g) = g · σ(g)` through [`exp_nonpos`]: with `t = e^−|g|` (never above 1, so it cannot
/// overflow), `σ(g)` is `1 / (1 + t)` for `g ≥ 0` and `t / (1 + t)` below; relative error a few
/// units in the last place (the exponential's 2e-7, one division, one product). Below −87 it
/// gives −0 (the true value is under 1e-36).
#[inline(always)]
pub(crate) fn silu<const FMA: bool>(g: f32) -> f32 {
    let t = exp_nonpos::<FMA>(-g.abs());
    let num = if g >= 0.0 { 1.0 } else { t };
    g * (num / (1.0 + t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_std() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -100.0 {
            let want = (x as f64).exp();
            for got in [exp_nonpos::<false>(x), exp_nonpos::<true>(x)] {
                if x < -87.0 {
                    assert_eq!(got, 0.0);
                } else {
                    worst = worst.max((got as f64 - want).abs() / want);
                }
            }
            x -= 0.013;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpos::<false>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos::<false>(0.0), 1.0);
    }

    #[test]
    fn silu_matches_f64() {
        let mut worst = 0.0f64;
        let mut g = -90.0f32;
        while g < 90.0 {
            let want = g as f64 / (1.0 + (-g as f64).exp());
            for got in [silu::<false>(g), silu::<true>(g)] {
                if g < -87.0 {
                    assert!(got == 0.0 && got.is_sign_negative(), "{g}: {got}");
                } else if want != 0.0 {
                    worst = worst.max((got as f64 - want).abs() / want.abs());
                }
            }
            g += 0.0137;
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert_eq!(silu::<true>(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(silu::<true>(-0.0).to_bits(), (-0.0f32).to_bits());
        assert!(silu::<true>(f32::NAN).is_nan());
    }
}
