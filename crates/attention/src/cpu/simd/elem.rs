//! The element types the AVX2 kernels read in place (f32, f16, bf16 rows, widened exactly in
//! registers) and the fixed-order horizontal sums every dot product ends with.

use std::arch::x86_64::*;

/// An element type of store rows the kernels read directly.
pub(crate) trait Elem {
    /// Bytes per element in the store row (4 for f32, 2 for f16 and bf16).
    const BYTES: usize;
    /// Eight elements at `p`, as f32.
    ///
    /// # Safety
    /// `p` must be valid for reading `8 × BYTES` bytes (any alignment), and the CPU must have
    /// AVX2, FMA and F16C ([`super::available`]).
    unsafe fn load8(p: *const u8) -> __m256;
    /// One element at `p`, as f32.
    ///
    /// # Safety
    /// `p` must be valid for reading `BYTES` bytes (any alignment).
    unsafe fn load1(p: *const u8) -> f32;
}

/// Little-endian f32 rows.
pub(crate) struct F32;
/// Little-endian IEEE half rows.
pub(crate) struct F16;
/// Little-endian bfloat16 rows.
pub(crate) struct Bf16;

impl Elem for F32 {
    const BYTES: usize = 4;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 32 readable bytes at p and AVX; loadu takes any alignment.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees 4 readable bytes at p; read_unaligned takes any alignment.
        f32::from_le_bytes(unsafe { p.cast::<[u8; 4]>().read_unaligned() })
    }
}

impl Elem for F16 {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes at p and F16C; the conversion is exact.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees 2 readable bytes at p.
        half::f16::from_le_bytes(unsafe { p.cast::<[u8; 2]>().read_unaligned() }).to_f32()
    }
}

impl Elem for Bf16 {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes at p and AVX2. A bf16 is the top half
        // of the f32 with the same bits, so widening and shifting left by 16 is exact.
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
    #[inline(always)]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees 2 readable bytes at p.
        half::bf16::from_le_bytes(unsafe { p.cast::<[u8; 2]>().read_unaligned() }).to_f32()
    }
}

/// Widens `n` elements of `E` at `src` to f32 into `out`, exactly.
///
/// # Safety
/// `src` must be valid for `n` elements of `E`, `out` for `n` f32 writes; the CPU must have
/// AVX2, FMA and F16C.
#[inline(always)]
pub(super) unsafe fn widen<E: Elem>(src: *const u8, n: usize, out: *mut f32) {
    // SAFETY: every access is below `n` elements (function contract).
    unsafe {
        let mut e = 0;
        while e + 8 <= n {
            _mm256_storeu_ps(out.add(e), E::load8(src.add(e * E::BYTES)));
            e += 8;
        }
        for e in e..n {
            *out.add(e) = E::load1(src.add(e * E::BYTES));
        }
    }
}

/// The lanes of `a` summed as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
///
/// # Safety
/// The CPU must have AVX.
#[inline(always)]
pub(super) unsafe fn hsum(a: __m256) -> f32 {
    // SAFETY: register-only AVX/SSE operations, which the caller guarantees.
    unsafe {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }
}

/// [`hsum`] of eight vectors at once, bitwise the same sums: a transposing reduction that adds
/// the same pairs in the same order (`l_i + l_{i+4}`, then `+ (l_{i+2} + l_{i+6})`, then the
/// two halves).
///
/// # Safety
/// The CPU must have AVX.
#[inline(always)]
pub(super) unsafe fn hsum8(v: [__m256; 8]) -> [f32; 8] {
    // SAFETY: register-only AVX operations, which the caller guarantees.
    unsafe {
        // [a_i + a_{i+4} | b_i + b_{i+4}] for the pairs (a, b) = (0, 1), (2, 3), …
        let x: [__m256; 4] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        });
        // Per 128-bit lane [s_0 + s_2, s_1 + s_3] of the two vectors of x[i] and x[i + 1].
        let t: [__m256; 2] = std::array::from_fn(|i| {
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            _mm256_add_ps(
                _mm256_shuffle_ps::<0x44>(a, b),
                _mm256_shuffle_ps::<0xEE>(a, b),
            )
        });
        // Lanes: v0, v2, v4, v6, v1, v3, v5, v7.
        let r = _mm256_hadd_ps(t[0], t[1]);
        let mut o = [0.0f32; 8];
        _mm256_storeu_ps(o.as_mut_ptr(), r);
        [o[0], o[4], o[1], o[5], o[2], o[6], o[3], o[7]]
    }
}

/// The [`hsum`] of every accumulator of an `H × P` tile, eight at a time through [`hsum8`]
/// (the same sums), the rest one by one.
///
/// # Safety
/// The CPU must have AVX.
#[inline(always)]
pub(super) unsafe fn hsum_tile<const H: usize, const P: usize>(
    c: &[[__m256; H]; P],
) -> [[f32; H]; P] {
    // SAFETY: register-only AVX operations, which the caller guarantees. (Plain loops, no
    // closures: those are compiled without the caller's target features.)
    unsafe {
        let mut s = [[0.0f32; H]; P];
        let mut k = 0;
        while k + 8 <= H * P {
            let mut v = [_mm256_setzero_ps(); 8];
            for (i, v) in v.iter_mut().enumerate() {
                *v = c[(k + i) / H][(k + i) % H];
            }
            for (i, r) in hsum8(v).into_iter().enumerate() {
                s[(k + i) / H][(k + i) % H] = r;
            }
            k += 8;
        }
        for k in k..H * P {
            s[k / H][k % H] = hsum(c[k / H][k % H]);
        }
        s
    }
}
