//! AVX2 + FMA + F16C kernels of the CPU backend, chosen at run time when the CPU has them.
//!
//! They compute exactly what the portable kernels compute with fused multiply-adds (the `FMA =
//! true` instantiation of [`super::attention::dense_request_impl`] and
//! [`super::attention::dot_with`]), in the same order, only eight lanes at a time: every dot
//! product accumulates lane `i` over elements `i, i + 8, …` with fused multiply-adds, sums the
//! lanes as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` and then adds the tail one
//! element at a time; every weighted sum of value rows adds the rows one position after the
//! other, element-wise. The unit tests check the two bitwise equal.
//!
//! What makes them fast is memory traffic, not only width: f16 and bf16 rows are converted in
//! registers as they are read (no scratch copy, no call per element), f32 rows are read straight
//! from the store, and each K and V row of a KV head is loaded once for a tile of up to four
//! query heads (or matmul rows) that share it.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::attention::{exp_nonpos, Geom, BLOCK};

/// Whether the CPU runs these kernels (AVX2, FMA and F16C), detected once.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// An element type of store rows the kernels read directly.
pub(crate) trait Elem {
    /// Bytes per element.
    const BYTES: usize;
    /// Eight elements at `p`, as f32.
    ///
    /// # Safety
    /// `p` must be valid for reading `8 × BYTES` bytes (any alignment), and the CPU must have
    /// AVX2, FMA and F16C ([`available`]).
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

/// The lanes of `a` summed as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
///
/// # Safety
/// The CPU must have AVX.
#[inline(always)]
unsafe fn hsum(a: __m256) -> f32 {
    // SAFETY: register-only AVX/SSE operations, which the caller guarantees.
    unsafe {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }
}

/// Dot products of `H` f32 rows `a[h]` with two rows `b0`, `b1` of `E`, `d` elements each, in
/// the module's fixed order: `(a[h]·b0, a[h]·b1)`.
///
/// # Safety
/// Every `a[h]` must be valid for `d` f32 reads, `b0` and `b1` for `d` elements of `E`, and the
/// CPU must have AVX2, FMA and F16C.
#[inline(always)]
unsafe fn dot_h2<E: Elem, const H: usize>(
    a: &[*const f32; H],
    b0: *const u8,
    b1: *const u8,
    d: usize,
) -> ([f32; H], [f32; H]) {
    // SAFETY: every access is below `d` elements of its row (see the function's contract).
    unsafe {
        let mut c0 = [_mm256_setzero_ps(); H];
        let mut c1 = [_mm256_setzero_ps(); H];
        let chunks = d / 8;
        for c in 0..chunks {
            let k0 = E::load8(b0.add(c * 8 * E::BYTES));
            let k1 = E::load8(b1.add(c * 8 * E::BYTES));
            for h in 0..H {
                let q = _mm256_loadu_ps(a[h].add(c * 8));
                c0[h] = _mm256_fmadd_ps(q, k0, c0[h]);
                c1[h] = _mm256_fmadd_ps(q, k1, c1[h]);
            }
        }
        let mut s0 = [0.0f32; H];
        let mut s1 = [0.0f32; H];
        for h in 0..H {
            s0[h] = hsum(c0[h]);
            s1[h] = hsum(c1[h]);
            for e in chunks * 8..d {
                let q = *a[h].add(e);
                s0[h] = q.mul_add(E::load1(b0.add(e * E::BYTES)), s0[h]);
                s1[h] = q.mul_add(E::load1(b1.add(e * E::BYTES)), s1[h]);
            }
        }
        (s0, s1)
    }
}

/// [`dot_h2`] against one row.
///
/// # Safety
/// As [`dot_h2`].
#[inline(always)]
unsafe fn dot_h1<E: Elem, const H: usize>(a: &[*const f32; H], b: *const u8, d: usize) -> [f32; H] {
    // SAFETY: every access is below `d` elements of its row (see the function's contract).
    unsafe {
        let mut c0 = [_mm256_setzero_ps(); H];
        let chunks = d / 8;
        for c in 0..chunks {
            let k = E::load8(b.add(c * 8 * E::BYTES));
            for h in 0..H {
                c0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(a[h].add(c * 8)), k, c0[h]);
            }
        }
        let mut s = [0.0f32; H];
        for h in 0..H {
            s[h] = hsum(c0[h]);
            for e in chunks * 8..d {
                s[h] = (*a[h].add(e)).mul_add(E::load1(b.add(e * E::BYTES)), s[h]);
            }
        }
        s
    }
}

/// `acc[h][e] = p[h][j] · v_j[e] + acc[h][e]` (fused) for `j = 0..n` in order, `e < dv`.
///
/// # Safety
/// Every `acc[h]` must be valid for `dv` f32 reads and writes and not alias the others or the
/// value rows, every `v[j]` (`j < n`) for `dv` elements of `E`; the CPU must have AVX2, FMA and
/// F16C.
#[inline(always)]
unsafe fn weighted_sum<E: Elem, const H: usize>(
    acc: &[*mut f32; H],
    p: &[[f32; BLOCK]; H],
    v: &[*const u8],
    n: usize,
    dv: usize,
) {
    // SAFETY: every access is below `dv` elements of its row (see the function's contract).
    unsafe {
        let mut e = 0;
        while e + 16 <= dv {
            let mut a0 = [_mm256_setzero_ps(); H];
            let mut a1 = [_mm256_setzero_ps(); H];
            for h in 0..H {
                a0[h] = _mm256_loadu_ps(acc[h].add(e));
                a1[h] = _mm256_loadu_ps(acc[h].add(e + 8));
            }
            for (j, &vp) in v[..n].iter().enumerate() {
                let v0 = E::load8(vp.add(e * E::BYTES));
                let v1 = E::load8(vp.add((e + 8) * E::BYTES));
                for h in 0..H {
                    let w = _mm256_set1_ps(p[h][j]);
                    a0[h] = _mm256_fmadd_ps(w, v0, a0[h]);
                    a1[h] = _mm256_fmadd_ps(w, v1, a1[h]);
                }
            }
            for h in 0..H {
                _mm256_storeu_ps(acc[h].add(e), a0[h]);
                _mm256_storeu_ps(acc[h].add(e + 8), a1[h]);
            }
            e += 16;
        }
        if e + 8 <= dv {
            let mut a0 = [_mm256_setzero_ps(); H];
            for h in 0..H {
                a0[h] = _mm256_loadu_ps(acc[h].add(e));
            }
            for (j, &vp) in v[..n].iter().enumerate() {
                let v0 = E::load8(vp.add(e * E::BYTES));
                for h in 0..H {
                    a0[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[h][j]), v0, a0[h]);
                }
            }
            for h in 0..H {
                _mm256_storeu_ps(acc[h].add(e), a0[h]);
            }
            e += 8;
        }
        for e in e..dv {
            for h in 0..H {
                let mut a = *acc[h].add(e);
                for (j, &vp) in v[..n].iter().enumerate() {
                    a = p[h][j].mul_add(E::load1(vp.add(e * E::BYTES)), a);
                }
                *acc[h].add(e) = a;
            }
        }
    }
}

/// One query token against one block: the rows of `q` (`q_heads × d`) fold the block's first
/// `seen` positions (`k[j]`, `v[j]`: row starts in the store or in scratch) into their softmax
/// states `m`, `l` and `acc` (`q_heads × dv`), head by head in the module's fixed order.
pub(crate) struct TokenBlock<'a> {
    pub g: &'a Geom,
    pub k: &'a [*const u8],
    pub v: &'a [*const u8],
    pub seen: usize,
    pub scale: f32,
}

/// Folds one tile of `H` query heads `h0 .. h0 + H` (all of KV head `gk`) into their states.
///
/// # Safety
/// `tb.k[j]` must be valid for a whole K row of `E` (`g.k_row` elements), `tb.v[j]` for a whole
/// V row (`g.v_row`, or the K row when `g.v_in_k`), for `j < tb.seen ≤ BLOCK`; `q`, `m`, `l`,
/// `acc` must hold `q_heads` rows; the CPU must have AVX2, FMA and F16C.
#[inline(always)]
unsafe fn tile<E: Elem, const H: usize>(
    tb: &TokenBlock<'_>,
    gk: usize,
    h0: usize,
    q: &[f32],
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let g = tb.g;
    let (d, dv, n) = (g.d, g.dv, tb.seen);
    let qp: [*const f32; H] = std::array::from_fn(|i| q[(h0 + i) * d..][..d].as_ptr());
    let koff = gk * d * E::BYTES;
    let voff = if g.v_in_k { 0 } else { gk * dv * E::BYTES };
    let mut s = [[0.0f32; BLOCK]; H];
    // SAFETY: the K rows hold head gk's `d` elements at `koff` (gk < kv heads), and the query
    // rows `d` f32 each (sliced above); see the function's contract for the CPU.
    unsafe {
        let mut j = 0;
        while j + 2 <= n {
            let (s0, s1) = dot_h2::<E, H>(&qp, tb.k[j].add(koff), tb.k[j + 1].add(koff), d);
            for h in 0..H {
                s[h][j] = tb.scale * s0[h];
                s[h][j + 1] = tb.scale * s1[h];
            }
            j += 2;
        }
        if j < n {
            let s0 = dot_h1::<E, H>(&qp, tb.k[j].add(koff), d);
            for h in 0..H {
                s[h][j] = tb.scale * s0[h];
            }
        }
    }
    for (h, s) in s.iter_mut().enumerate() {
        let i = h0 + h;
        let s = &mut s[..n];
        let m_b = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m_new = m[i].max(m_b);
        if m[i] != m_new {
            let corr = if m[i] == f32::NEG_INFINITY {
                0.0
            } else {
                exp_nonpos::<true>(m[i] - m_new)
            };
            l[i] *= corr;
            acc[i * dv..(i + 1) * dv]
                .iter_mut()
                .for_each(|a| *a *= corr);
            m[i] = m_new;
        }
        for x in s.iter_mut() {
            *x = exp_nonpos::<true>(*x - m_new);
        }
        let mut sum = 0.0f32;
        for &p in s.iter() {
            sum += p;
        }
        l[i] += sum;
    }
    let accp: [*mut f32; H] = std::array::from_fn(|i| acc[(h0 + i) * dv..][..dv].as_mut_ptr());
    let mut vp = [std::ptr::null::<u8>(); BLOCK];
    for (p, &v) in vp.iter_mut().zip(&tb.v[..n]) {
        // SAFETY: the V row holds head gk's `dv` elements at `voff` (function contract).
        *p = unsafe { v.add(voff) };
    }
    // SAFETY: the accumulator rows are disjoint `dv`-element rows of `acc` (sliced above), the
    // value rows hold `dv` elements at `vp[j]`; see the function's contract for the CPU.
    unsafe { weighted_sum::<E, H>(&accp, &s, &vp, n, dv) };
}

/// One query token against one block (see [`TokenBlock`]).
///
/// # Safety
/// As [`tile`], for every KV head.
#[inline(always)]
unsafe fn token_block<E: Elem>(
    tb: &TokenBlock<'_>,
    q: &[f32],
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let g = tb.g;
    for gk in 0..g.q_heads / g.group {
        let (mut h, end) = (gk * g.group, (gk + 1) * g.group);
        while h < end {
            // SAFETY: forwarded contract; h .. h + tile width stays within KV head gk.
            unsafe {
                match end - h {
                    1 => tile::<E, 1>(tb, gk, h, q, m, l, acc),
                    2 => tile::<E, 2>(tb, gk, h, q, m, l, acc),
                    3 => tile::<E, 3>(tb, gk, h, q, m, l, acc),
                    _ => tile::<E, 4>(tb, gk, h, q, m, l, acc),
                }
            }
            h += (end - h).min(4);
        }
    }
}

macro_rules! token_block_for {
    ($name:ident, $elem:ty) => {
        /// [`token_block`] for one element type, compiled for AVX2 + FMA + F16C.
        ///
        /// # Safety
        /// As [`token_block`]; the CPU must have AVX2, FMA and F16C ([`available`]).
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn $name(
            tb: &TokenBlock<'_>,
            q: &[f32],
            m: &mut [f32],
            l: &mut [f32],
            acc: &mut [f32],
        ) {
            // SAFETY: forwarded contract.
            unsafe { token_block::<$elem>(tb, q, m, l, acc) }
        }
    };
}

token_block_for!(token_block_f32, F32);
token_block_for!(token_block_f16, F16);
token_block_for!(token_block_bf16, Bf16);

/// Rows of `x` per matmul tile.
const MR: usize = 4;

/// `dst[i, j] = x_i · w_j` for rows `x[m, k]`, `w[n, k]`, each in the module's fixed dot order,
/// so a row's result never depends on `m`. Blocks `w` so a block stays in cache over all rows.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`available`]). Lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, dst: &mut [f32]) {
    assert!(x.len() == m * k && w.len() == n * k && dst.len() == m * n && k > 0);
    // About 256 KiB of w per block.
    let nb = (65536 / k).max(2) & !1;
    for j0 in (0..n).step_by(nb) {
        let j1 = (j0 + nb).min(n);
        for i0 in (0..m).step_by(MR) {
            let rows = (m - i0).min(MR);
            // SAFETY: rows i0 .. i0 + rows of x and j0 .. j1 of w exist (asserted lengths).
            unsafe {
                match rows {
                    1 => matmul_tile::<1>(x, w, k, n, i0, j0, j1, dst),
                    2 => matmul_tile::<2>(x, w, k, n, i0, j0, j1, dst),
                    3 => matmul_tile::<3>(x, w, k, n, i0, j0, j1, dst),
                    _ => matmul_tile::<4>(x, w, k, n, i0, j0, j1, dst),
                }
            }
        }
    }
}

/// Rows `i0 .. i0 + H` of `x` against rows `j0 .. j1` of `w`.
///
/// # Safety
/// Those rows must exist (`x`: `m × k`, `w`: `n × k`, `dst`: `m × n`); the CPU must have AVX2,
/// FMA and F16C.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_tile<const H: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    n: usize,
    i0: usize,
    j0: usize,
    j1: usize,
    dst: &mut [f32],
) {
    let a: [*const f32; H] = std::array::from_fn(|i| x[(i0 + i) * k..][..k].as_ptr());
    let row = |j: usize| w[j * k..][..k].as_ptr().cast::<u8>();
    let mut j = j0;
    while j + 2 <= j1 {
        // SAFETY: the x rows and the two w rows hold k f32 each (sliced); CPU per contract.
        let (s0, s1) = unsafe { dot_h2::<F32, H>(&a, row(j), row(j + 1), k) };
        for h in 0..H {
            dst[(i0 + h) * n + j] = s0[h];
            dst[(i0 + h) * n + j + 1] = s1[h];
        }
        j += 2;
    }
    if j < j1 {
        // SAFETY: as above, one w row.
        let s0 = unsafe { dot_h1::<F32, H>(&a, row(j), k) };
        for h in 0..H {
            dst[(i0 + h) * n + j] = s0[h];
        }
    }
}
