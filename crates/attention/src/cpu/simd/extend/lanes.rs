//! How an instruction set holds the query rows of an extend tile ([`QueryLanes`]): one query
//! row per f32 lane, eight on AVX2 ([`Avx2`]), sixteen on AVX-512 ([`Avx512`]), and the tile
//! shapes that fit its registers (16 on AVX2, 32 on AVX-512). Every operation is one
//! instruction per lane (the masks of AVX-512, the blends of AVX2), so a lane computes the
//! same bits on both.

use std::arch::x86_64::*;

use super::super::exp::{exp16, exp8};

/// One register of query-row lanes and the operations the extend kernel runs on it.
///
/// Every method is `unsafe`: the CPU must have the instruction set (AVX2 + FMA for [`Avx2`],
/// AVX-512F for [`Avx512`]), and a pointer must be valid for the lanes it reads or writes.
pub(super) trait QueryLanes {
    /// `LANES` f32.
    type V: Copy;
    /// A lane mask.
    type M: Copy;
    /// Which leading elements a partial load or store touches.
    type Tail: Copy;
    /// Query rows per register.
    const LANES: usize;
    /// Most positions a score step keeps in registers (8 partial sums each).
    const POSITIONS: usize;
    /// Whether a score step runs the eight partial sums two at a time ([`super::scores`]).
    const PAIRED: bool;
    /// Most rows of a weighted sum with 4 (then 2) accumulator registers per row.
    const ROWS_BY_4: usize;
    const ROWS_BY_2: usize;

    unsafe fn zero() -> Self::V;
    unsafe fn set1(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, x: Self::V);
    /// `a · b + c`, fused.
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// The instruction's maximum: `b` where either is NaN.
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// `exp_nonpos::<true>` per lane, bitwise.
    unsafe fn exp(x: Self::V) -> Self::V;
    /// `a > b` (ordered).
    unsafe fn gt(a: Self::V, b: Self::V) -> Self::M;
    /// `a == b` (ordered).
    unsafe fn eq(a: Self::V, b: Self::V) -> Self::M;
    /// `a != b` or unordered.
    unsafe fn ne(a: Self::V, b: Self::V) -> Self::M;
    /// Lanes that are not NaN.
    unsafe fn ordered(x: Self::V) -> Self::M;
    unsafe fn and(a: Self::M, b: Self::M) -> Self::M;
    /// `m ? b : a` per lane.
    unsafe fn select(m: Self::M, a: Self::V, b: Self::V) -> Self::V;
    /// The first `n ≤ LANES` elements.
    unsafe fn tail(n: usize) -> Self::Tail;
    /// The tail's elements at `p`, zeros in the other lanes (those are not read).
    unsafe fn load_tail(t: Self::Tail, p: *const f32) -> Self::V;
    /// Stores the tail's lanes of `x` at `p` (the other elements are not written).
    unsafe fn store_tail(t: Self::Tail, p: *mut f32, x: Self::V);
}

/// Eight rows per `__m256` (AVX2 + FMA); 16 registers: a score step of 2 tiles × 2 positions
/// with the partial sums two at a time (8 accumulators, 4 broadcasts), weighted sums of 2 rows
/// × 4 or 6 rows × 2 registers.
pub(super) struct Avx2;

/// Sixteen rows per `__m512` (AVX-512F); 32 registers: a score step of 3 positions (24 partial
/// sums, measured best), weighted sums of 5 rows × 4 or 6 rows × 2 registers.
pub(super) struct Avx512;

impl QueryLanes for Avx2 {
    type V = __m256;
    type M = __m256;
    type Tail = __m256i;
    const LANES: usize = 8;
    const POSITIONS: usize = 2;
    const PAIRED: bool = true;
    const ROWS_BY_4: usize = 2;
    const ROWS_BY_2: usize = 6;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: (all methods) the CPU has AVX2 and FMA, pointers valid (trait contract).
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn set1(x: f32) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, x: __m256) {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_storeu_ps(p, x) }
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { exp8(x) }
    }
    #[inline(always)]
    unsafe fn gt(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_cmp_ps::<_CMP_GT_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn eq(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_cmp_ps::<_CMP_EQ_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn ne(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_cmp_ps::<_CMP_NEQ_UQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn ordered(x: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_cmp_ps::<_CMP_ORD_Q>(x, x) }
    }
    #[inline(always)]
    unsafe fn and(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_and_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn select(m: __m256, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_blendv_ps(a, b, m) }
    }
    #[inline(always)]
    unsafe fn tail(n: usize) -> __m256i {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe {
            _mm256_cmpgt_epi32(
                _mm256_set1_epi32(n as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            )
        }
    }
    #[inline(always)]
    unsafe fn load_tail(t: __m256i, p: *const f32) -> __m256 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_maskload_ps(p, t) }
    }
    #[inline(always)]
    unsafe fn store_tail(t: __m256i, p: *mut f32, x: __m256) {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm256_maskstore_ps(p, t, x) }
    }
}

impl QueryLanes for Avx512 {
    type V = __m512;
    type M = __mmask16;
    type Tail = __mmask16;
    const LANES: usize = 16;
    const POSITIONS: usize = 3;
    const PAIRED: bool = false;
    const ROWS_BY_4: usize = 5;
    const ROWS_BY_2: usize = 6;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: (all methods) the CPU has AVX-512F, pointers valid (trait contract).
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn set1(x: f32) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, x: __m512) {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_storeu_ps(p, x) }
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { exp16(x) }
    }
    #[inline(always)]
    unsafe fn gt(a: __m512, b: __m512) -> __mmask16 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn eq(a: __m512, b: __m512) -> __mmask16 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn ne(a: __m512, b: __m512) -> __mmask16 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(a, b) }
    }
    #[inline(always)]
    unsafe fn ordered(x: __m512) -> __mmask16 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x) }
    }
    #[inline(always)]
    unsafe fn and(a: __mmask16, b: __mmask16) -> __mmask16 {
        a & b
    }
    #[inline(always)]
    unsafe fn select(m: __mmask16, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_mask_blend_ps(m, a, b) }
    }
    #[inline(always)]
    unsafe fn tail(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }
    #[inline(always)]
    unsafe fn load_tail(t: __mmask16, p: *const f32) -> __m512 {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_maskz_loadu_ps(t, p) }
    }
    #[inline(always)]
    unsafe fn store_tail(t: __mmask16, p: *mut f32, x: __m512) {
        // SAFETY: the trait's contract (CPU features, valid pointers).
        unsafe { _mm512_mask_storeu_ps(p, t, x) }
    }
}
