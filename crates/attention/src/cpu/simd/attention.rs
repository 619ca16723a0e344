//! The AVX2 dense attention kernel: query tokens against one block of KV positions, tiles of
//! query rows sharing every K and V load, the online softmax in the scalar kernel's order.

use std::arch::x86_64::*;

use super::super::primitives::{exp_nonpos, Geom, BLOCK};
use super::dot::dot_tile;
use super::elem::{Bf16, Elem, F16, F32};
use super::exp::exp8;

/// `acc[h][e] = p[h][j] · v_j[e] + acc[h][e]` (fused) for `j = 0..n` in order, `e < dv`, after
/// `acc[h][e] *= corr[h]` (the softmax rescale; a factor 1 leaves the row bitwise unchanged).
///
/// # Safety
/// Every `acc[h]` must be valid for `dv` f32 reads and writes and not alias the others or the
/// value rows, every `v[j]` (`j < n`) for `dv` elements of `E`; the CPU must have AVX2, FMA and
/// F16C.
#[inline(always)]
unsafe fn weighted_sum<E: Elem, const H: usize>(
    acc: &[*mut f32; H],
    corr: &[f32; H],
    p: &[[f32; BLOCK]; H],
    v: &[*const u8],
    n: usize,
    dv: usize,
) {
    // SAFETY: every access is below `dv` elements of its row (see the function's contract).
    unsafe {
        let mut e = 0;
        // As many accumulator registers per row as fit in the 16 registers.
        if H <= 3 {
            while e + 32 <= dv {
                weighted_chunk::<E, H, 4>(acc, corr, p, v, n, e);
                e += 32;
            }
        } else if H == 4 {
            while e + 24 <= dv {
                weighted_chunk::<E, H, 3>(acc, corr, p, v, n, e);
                e += 24;
            }
        } else if H <= 6 {
            while e + 16 <= dv {
                weighted_chunk::<E, H, 2>(acc, corr, p, v, n, e);
                e += 16;
            }
        }
        while e + 8 <= dv {
            weighted_chunk::<E, H, 1>(acc, corr, p, v, n, e);
            e += 8;
        }
        for e in e..dv {
            for h in 0..H {
                let mut a = *acc[h].add(e) * corr[h];
                for (j, &vp) in v[..n].iter().enumerate() {
                    a = p[h][j].mul_add(E::load1(vp.add(e * E::BYTES)), a);
                }
                *acc[h].add(e) = a;
            }
        }
    }
}

/// [`weighted_sum`] over elements `e .. e + 8W`, in `H × W` registers.
///
/// # Safety
/// As [`weighted_sum`], with `e + 8W ≤ dv`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn weighted_chunk<E: Elem, const H: usize, const W: usize>(
    acc: &[*mut f32; H],
    corr: &[f32; H],
    p: &[[f32; BLOCK]; H],
    v: &[*const u8],
    n: usize,
    e: usize,
) {
    // SAFETY: every access is below `e + 8W ≤ dv` elements of its row (function contract).
    unsafe {
        let mut a = [[_mm256_setzero_ps(); W]; H];
        for h in 0..H {
            let c = _mm256_set1_ps(corr[h]);
            for w in 0..W {
                a[h][w] = _mm256_mul_ps(_mm256_loadu_ps(acc[h].add(e + 8 * w)), c);
            }
        }
        for (j, &vp) in v[..n].iter().enumerate() {
            let x: [__m256; W] = std::array::from_fn(|w| E::load8(vp.add((e + 8 * w) * E::BYTES)));
            for h in 0..H {
                let wgt = _mm256_set1_ps(p[h][j]);
                for w in 0..W {
                    a[h][w] = _mm256_fmadd_ps(wgt, x[w], a[h][w]);
                }
            }
        }
        for h in 0..H {
            for w in 0..W {
                _mm256_storeu_ps(acc[h].add(e + 8 * w), a[h][w]);
            }
        }
    }
}

/// Query tokens against one block: their rows of `q` (`q_heads × d` per token) fold the
/// block's first `seen` positions (`k[j]`, `v[j]`: row starts in the store or in scratch) into
/// their softmax states `m`, `l` and `acc` (`q_heads × dv` per token), head by head in the
/// module's fixed order.
///
/// When `prefetch`, the tiles also prefetch the rows of the next KV head of the block, and
/// after the last head those of the first head in the next block (`next_k`, `next_v`; empty
/// when there is none), so they are in cache when their turn comes. Prefetching changes no
/// arithmetic.
pub(crate) struct TokenBlock<'a> {
    pub g: &'a Geom,
    pub k: &'a [*const u8],
    pub v: &'a [*const u8],
    pub seen: usize,
    pub scale: f32,
    pub prefetch: bool,
    pub next_k: &'a [*const u8],
    pub next_v: &'a [*const u8],
}

/// Rows one tile prefetches: the `kbytes` at `k[j] + koff` and the `vbytes` at `v[j] + voff`.
struct Prefetch<'a> {
    k: &'a [*const u8],
    v: &'a [*const u8],
    koff: usize,
    voff: usize,
    kbytes: usize,
    vbytes: usize,
}

impl Prefetch<'_> {
    /// Prefetches the rows `j0 .. j1` (those that exist).
    #[inline(always)]
    fn rows(&self, j0: usize, j1: usize) {
        for j in j0..j1.min(self.k.len()) {
            span(self.k[j].wrapping_add(self.koff), self.kbytes);
            if self.vbytes > 0 {
                span(self.v[j].wrapping_add(self.voff), self.vbytes);
            }
        }
    }
}

/// Prefetches the cache lines of `bytes` bytes at `p` into L1.
#[inline(always)]
fn span(p: *const u8, bytes: usize) {
    let mut o = 0;
    while o < bytes {
        // SAFETY: a prefetch is only a hint: it never faults, whatever the address, and the
        // address is computed with wrapping arithmetic (no pointer is dereferenced).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o).cast()) };
        o += 64;
    }
    // The last line, when the span is not line-aligned.
    // SAFETY: as above.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(bytes - 1).cast()) };
}

/// The largest lane of `x` (which holds no NaN).
///
/// # Safety
/// The CPU must have AVX.
#[inline(always)]
unsafe fn hmax(x: __m256) -> f32 {
    // SAFETY: register-only AVX/SSE operations, which the caller guarantees.
    unsafe {
        let m4 = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1));
        _mm_cvtss_f32(m1)
    }
}

/// The online-softmax step of `H` query rows `rows[i]` over one block: `s[i][..n]` holds row
/// `i`'s scaled scores of the block's first `n` positions and is overwritten with its weights
/// `e^(s − m_new)` (lanes past `n` hold unused values); the rows' maxima `m` and sums `l` are
/// updated, and the factor each accumulator row must be rescaled by is returned (1 where the
/// maximum did not change). Every row keeps the scalar kernel's order: the maximum and the sum
/// fold the positions in order (the maximum needs no order), the weights are `exp_nonpos`
/// eight lanes at a time.
///
/// # Safety
/// `rows[i]` must index `m` and `l`, `n ≤ BLOCK`; the CPU must have AVX2 and FMA.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // the rows' folds run side by side, indexed [row][position]
pub(super) unsafe fn softmax_block<const H: usize>(
    s: &mut [[f32; BLOCK]; H],
    rows: [usize; H],
    n: usize,
    m: &mut [f32],
    l: &mut [f32],
) -> [f32; H] {
    // The block maxima, eight lanes at a time: NaN scores (which the scalar fold's `f32::max`
    // skips) and lanes past `n` count as −∞, and the maximum of the rest does not depend on the
    // order (only the sign of a zero maximum could, and −0 and +0 give the same weights, and
    // the same rescale factors, in every use below).
    let mut m_b = [f32::NEG_INFINITY; H];
    // SAFETY: `s` rows hold BLOCK = 32 elements, a multiple of 8, and n ≤ BLOCK; the CPU has
    // AVX2 (function contract).
    unsafe {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
        for (m_b, s) in m_b.iter_mut().zip(s.iter()) {
            let mut mx = neg_inf;
            for c in 0..n.div_ceil(8) {
                let x = _mm256_loadu_ps(s[c * 8..].as_ptr());
                let inside = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - c * 8) as i32), lane);
                let keep = _mm256_and_ps(
                    _mm256_castsi256_ps(inside),
                    _mm256_cmp_ps::<_CMP_ORD_Q>(x, x),
                );
                mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, x, keep));
            }
            *m_b = hmax(mx);
        }
    }
    // The rescale of the accumulator rows is applied as `weighted_sum` loads them.
    let mut corr = [1.0f32; H];
    for (h, s) in s.iter_mut().enumerate() {
        let i = rows[h];
        let m_new = m[i].max(m_b[h]);
        if m[i] != m_new {
            corr[h] = if m[i] == f32::NEG_INFINITY {
                0.0
            } else {
                exp_nonpos::<true>(m[i] - m_new)
            };
            l[i] *= corr[h];
            m[i] = m_new;
        }
        // Eight weights at a time (past `n` the lanes compute unused values).
        // SAFETY: `s` holds BLOCK = 32 elements, a multiple of 8, and n ≤ BLOCK; the CPU has
        // AVX2 and FMA (function contract).
        unsafe {
            let mv = _mm256_set1_ps(m_new);
            for c in 0..n.div_ceil(8) {
                let x = _mm256_loadu_ps(s[c * 8..].as_ptr());
                _mm256_storeu_ps(s[c * 8..].as_mut_ptr(), exp8(_mm256_sub_ps(x, mv)));
            }
        }
    }
    let mut sum = [0.0f32; H];
    for j in 0..n {
        for h in 0..H {
            sum[h] += s[h][j];
        }
    }
    for h in 0..H {
        l[rows[h]] += sum[h];
    }
    corr
}

/// Folds one tile of `H` query rows `rows[i]` (token-major indices `t · q_heads + h` into the
/// request's `q`, `m`, `l`, `acc`; every head `h` of KV head `gk`) into their states. The rows
/// share every K and V load; each keeps its own fixed-order arithmetic, so the tile's shape
/// changes no result.
///
/// # Safety
/// `tb.k[j]` must be valid for a whole K row of `E` (`g.k_row` elements), `tb.v[j]` for a whole
/// V row (`g.v_row`, or the K row when `g.v_in_k`), for `j < tb.seen ≤ BLOCK`; `q`, `m`, `l`,
/// `acc` must hold `q_heads` rows; the CPU must have AVX2, FMA and F16C.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)] // the rows' folds run side by side, indexed [row][position]
unsafe fn tile<E: Elem, const H: usize>(
    tb: &TokenBlock<'_>,
    gk: usize,
    rows: [usize; H],
    q: &[f32],
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    pf: Option<&Prefetch<'_>>,
) {
    let g = tb.g;
    let (d, dv, n) = (g.d, g.dv, tb.seen);
    let qp: [*const f32; H] = std::array::from_fn(|i| q[rows[i] * d..][..d].as_ptr());
    let koff = gk * d * E::BYTES;
    let voff = if g.v_in_k { 0 } else { gk * dv * E::BYTES };
    let mut s = [[0.0f32; BLOCK]; H];
    // SAFETY: the K rows hold head gk's `d` elements at `koff` (gk < kv heads), and the query
    // rows `d` f32 each (sliced above); see the function's contract for the CPU.
    unsafe {
        let kp = |j: usize| tb.k[j].add(koff);
        let mut j = 0;
        // Three positions per step where the 4 × 3 register tile fits, else two, else one.
        if H <= 4 {
            while j + 3 <= n {
                if let Some(pf) = pf {
                    pf.rows(j, j + 3);
                }
                let t = dot_tile::<E, H, 3>(&qp, [kp(j), kp(j + 1), kp(j + 2)], d, (kp(j), 0));
                for (p, t) in t.iter().enumerate() {
                    for h in 0..H {
                        s[h][j + p] = tb.scale * t[h];
                    }
                }
                j += 3;
            }
        } else if H <= 6 {
            while j + 2 <= n {
                if let Some(pf) = pf {
                    pf.rows(j, j + 2);
                }
                let t = dot_tile::<E, H, 2>(&qp, [kp(j), kp(j + 1)], d, (kp(j), 0));
                for (p, t) in t.iter().enumerate() {
                    for h in 0..H {
                        s[h][j + p] = tb.scale * t[h];
                    }
                }
                j += 2;
            }
        }
        while j < n {
            if let Some(pf) = pf {
                pf.rows(j, j + 1);
            }
            let [t] = dot_tile::<E, H, 1>(&qp, [kp(j)], d, (kp(j), 0));
            for h in 0..H {
                s[h][j] = tb.scale * t[h];
            }
            j += 1;
        }
    }
    // SAFETY: `s` holds the rows' scores for the block's first n ≤ BLOCK positions; the CPU
    // per the function's contract.
    let corr = unsafe { softmax_block(&mut s, rows, n, m, l) };
    let accp: [*mut f32; H] = std::array::from_fn(|i| acc[rows[i] * dv..][..dv].as_mut_ptr());
    let mut vp = [std::ptr::null::<u8>(); BLOCK];
    for (p, &v) in vp.iter_mut().zip(&tb.v[..n]) {
        // SAFETY: the V row holds head gk's `dv` elements at `voff` (function contract).
        *p = unsafe { v.add(voff) };
    }
    // SAFETY: the accumulator rows are disjoint `dv`-element rows of `acc` (sliced above), the
    // value rows hold `dv` elements at `vp[j]`; see the function's contract for the CPU.
    unsafe { weighted_sum::<E, H>(&accp, &corr, &s, &vp, n, dv) };
}

/// Maximum query rows per tile.
const ROWS: usize = 6;

/// The query tokens `tokens` (all seeing the block's first `tb.seen` positions) against one
/// block (see [`TokenBlock`]): for each KV head, the rows of all those tokens on its query
/// heads go through tiles of up to [`ROWS`] rows that share the head's K and V loads, so the
/// block's rows are read from memory once for all the tokens. `q`, `m`, `l`, `acc` are the
/// request's (token-major) arrays.
///
/// # Safety
/// As [`tile`], for every KV head; `tokens` must be rows of `q`, `m`, `l` and `acc`.
#[inline(always)]
unsafe fn token_block<E: Elem>(
    tb: &TokenBlock<'_>,
    tokens: std::ops::Range<usize>,
    q: &[f32],
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let g = tb.g;
    let kv_heads = g.q_heads / g.group;
    let total = tokens.len() * g.group;
    for gk in 0..kv_heads {
        // The first tile of the head prefetches the next head's rows.
        let (rows_k, rows_v, next) = if gk + 1 < kv_heads {
            (tb.k, tb.v, gk + 1)
        } else {
            (tb.next_k, tb.next_v, 0)
        };
        let pf = Prefetch {
            k: rows_k,
            v: rows_v,
            koff: next * g.d * E::BYTES,
            voff: if g.v_in_k { 0 } else { next * g.dv * E::BYTES },
            kbytes: g.d * E::BYTES,
            vbytes: if g.v_in_k { 0 } else { g.dv * E::BYTES },
        };
        let mut pf = (tb.prefetch && !rows_k.is_empty()).then_some(&pf);
        // Row `k` of the head is token `tokens.start + k / group`, head `gk · group + k % group`.
        let row = |k: usize| (tokens.start + k / g.group) * g.q_heads + gk * g.group + k % g.group;
        let mut k = 0;
        while k < total {
            let w = (total - k).min(ROWS);
            // One monomorphised tile per width, so each width keeps its registers.
            macro_rules! tile_of_width {
                ($($n:literal)*) => {
                    match w {
                        $($n => tile::<E, $n>(tb, gk, std::array::from_fn(|i| row(k + i)), q, m, l, acc, pf),)*
                        _ => tile::<E, 8>(tb, gk, std::array::from_fn(|i| row(k + i)), q, m, l, acc, pf),
                    }
                };
            }
            // SAFETY: forwarded contract; the rows are rows of the request (see above) on the
            // query heads of KV head gk.
            unsafe { tile_of_width!(1 2 3 4 5 6 7) }
            pf = None;
            k += w;
        }
    }
}

macro_rules! token_block_for {
    ($name:ident, $elem:ty) => {
        /// [`token_block`] for one element type, compiled for AVX2 + FMA + F16C.
        ///
        /// # Safety
        /// As [`token_block`]; the CPU must have AVX2, FMA and F16C ([`super::available`]).
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn $name(
            tb: &TokenBlock<'_>,
            tokens: std::ops::Range<usize>,
            q: &[f32],
            m: &mut [f32],
            l: &mut [f32],
            acc: &mut [f32],
        ) {
            // SAFETY: forwarded contract.
            unsafe { token_block::<$elem>(tb, tokens, q, m, l, acc) }
        }
    };
}

token_block_for!(token_block_f32, F32);
token_block_for!(token_block_f16, F16);
token_block_for!(token_block_bf16, Bf16);
