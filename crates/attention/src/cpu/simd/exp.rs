//! Eight-lane versions of the scalar transcendental functions in `cpu::primitives`, each the
//! same operations in the same order, so each lane is bitwise the scalar `FMA = true` result.

use std::arch::x86_64::*;

use super::super::primitives::silu;

/// [`exp_nonpos`]`::<true>` on eight lanes: the same operations in the same order, so each
/// lane is bitwise the scalar result.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline(always)]
pub(super) unsafe fn exp8(x: __m256) -> __m256 {
    // The constants of `exp_nonpos`.
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0;
    // SAFETY: register-only AVX2/FMA operations, which the caller guarantees.
    unsafe {
        let small = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
        let x = _mm256_blendv_ps(x, _mm256_set1_ps(-87.0), small);
        let round = _mm256_set1_ps(ROUND);
        let n = _mm256_sub_ps(
            _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), round),
            round,
        );
        let neg_n = _mm256_xor_ps(n, _mm256_set1_ps(-0.0));
        let r = _mm256_fmadd_ps(
            neg_n,
            _mm256_set1_ps(LN2_LO),
            _mm256_fmadd_ps(neg_n, _mm256_set1_ps(LN2_HI), x),
        );
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvttps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
        _mm256_andnot_ps(small, y)
    }
}

/// [`exp_nonpos`]`::<true>` on sixteen lanes: [`exp8`]'s operations with AVX-512 masks for its
/// blends, so each lane is bitwise the scalar result.
///
/// # Safety
/// The CPU must have AVX-512F.
#[inline(always)]
pub(super) unsafe fn exp16(x: __m512) -> __m512 {
    // The constants of `exp_nonpos`.
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0;
    // SAFETY: register-only AVX-512F operations, which the caller guarantees.
    unsafe {
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.0));
        let x = _mm512_mask_blend_ps(small, x, _mm512_set1_ps(-87.0));
        let round = _mm512_set1_ps(ROUND);
        let n = _mm512_sub_ps(
            _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), round),
            round,
        );
        let neg_n = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(n),
            _mm512_set1_epi32(i32::MIN),
        ));
        let r = _mm512_fmadd_ps(
            neg_n,
            _mm512_set1_ps(LN2_LO),
            _mm512_fmadd_ps(neg_n, _mm512_set1_ps(LN2_HI), x),
        );
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvttps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        let y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
        _mm512_maskz_mov_ps(!small, y)
    }
}

/// [`silu`]`::<true>` on eight lanes (`silu(g)·u`), bitwise the scalar result per lane.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline(always)]
pub(super) unsafe fn silu_mul8(g: __m256, u: __m256) -> __m256 {
    // SAFETY: register-only AVX2/FMA operations, which the caller guarantees.
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let one = _mm256_set1_ps(1.0);
        // t = e^−|g|, as `silu` computes it.
        let t = exp8(_mm256_or_ps(g, sign));
        let nonneg = _mm256_cmp_ps::<_CMP_GE_OQ>(g, _mm256_setzero_ps());
        let s = _mm256_div_ps(_mm256_blendv_ps(t, one, nonneg), _mm256_add_ps(one, t));
        _mm256_mul_ps(_mm256_mul_ps(g, s), u)
    }
}

/// `silu(gate) · up` for one row, eight lanes at a time, the tail through the scalar [`silu`].
///
/// # Safety
/// The CPU must have AVX2 and FMA ([`super::available`]).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn silu_mul_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len();
    assert!(gate.len() == n && up.len() == n);
    let body = n / 8 * 8;
    for e in (0..body).step_by(8) {
        // SAFETY: e + 8 <= n for all three rows (asserted); the CPU per contract.
        unsafe {
            let y = silu_mul8(
                _mm256_loadu_ps(gate.as_ptr().add(e)),
                _mm256_loadu_ps(up.as_ptr().add(e)),
            );
            _mm256_storeu_ps(out.as_mut_ptr().add(e), y);
        }
    }
    for e in body..n {
        out[e] = silu::<true>(gate[e]) * up[e];
    }
}
