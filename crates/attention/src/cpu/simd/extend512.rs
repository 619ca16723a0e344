//! The AVX-512 extend attention kernel: sixteen query rows per register. A block that several
//! query tokens see (a prefill, or a chunk of one) is staged once as f32 rows, the request's
//! query rows are staged once transposed (lane `L` of a tile holds row `16·tile + L` of a KV
//! head), and every step of the online softmax then runs on sixteen rows at once: scores,
//! block maxima, weights, the running sums, the rescale factors.
//!
//! Bitwise the AVX2 and portable kernels, and so a query's decode result at the same position:
//! a score's dot product keeps its eight partial sums (lane `i` of the other kernels sums
//! elements `i, i + 8, …` with fused multiply-adds), here eight registers fed the same elements
//! in the same order; the eight are added with the same tree `((a0 + a4) + (a2 + a6)) + ((a1 +
//! a5) + (a3 + a7))` and the tail elements one by one after it. A row's weights are summed in
//! position order, one position per step, exactly as the scalar fold; its maximum needs no
//! order (NaN scores are skipped as `f32::max` skips them). Staging converts f16 and bf16
//! exactly, so a fused multiply-add of a staged element is the one of the element converted in
//! a register. The weighted sum of value rows adds the rows in position order, element-wise, 16
//! elements per register. Rows of a tile that see fewer positions (the causal diagonal) or
//! none (tokens before the block, padding) have their lanes masked out of every step, so they
//! are left exactly as the other kernels leave them.
//!
//! Staging costs about what reading the block once costs, so the kernel is taken only where
//! several query tokens see the block ([`WIDE_MIN_TOKENS`]); a decode step keeps the AVX2
//! kernel, which reads the store in place.

use std::arch::x86_64::*;

use super::super::primitives::{Geom, BLOCK};
use super::elem::{widen, Bf16, Elem, F16, F32};
use super::exp::exp16;

/// Query tokens that must see a block for it to be staged (fewer: the in-place kernel).
pub(crate) const WIDE_MIN_TOKENS: usize = 2;

/// Query rows per tile: the lanes of a register.
const LANES: usize = 16;

/// Rows whose weighted sums share every V load.
const ROWS: usize = 6;

/// Whether the CPU runs this kernel: AVX-512F and VL beside AVX2, FMA and F16C (the AVX-512
/// matmul's condition, including its `KVSERVE_CPU_NO_AVX512` switch).
pub(crate) fn available() -> bool {
    super::avx512::available()
}

/// Tiles of one KV head's query rows for `ext` tokens.
pub(crate) fn tiles(g: &Geom, ext: usize) -> usize {
    (ext * g.group).div_ceil(LANES)
}

/// The f32 elements the staged queries of `ext` tokens take ([`stage_queries`]).
pub(crate) fn queries_len(g: &Geom, ext: usize) -> usize {
    (g.q_heads / g.group) * tiles(g, ext) * g.d * LANES
}

/// The f32 elements a staged block takes: its K rows and its V rows ([`Staged`]).
pub(crate) fn block_len(g: &Geom) -> (usize, usize) {
    let kv_heads = g.q_heads / g.group;
    (kv_heads * BLOCK * g.d, kv_heads * BLOCK * g.dv)
}

/// Query row `k` of KV head `gk` (token `k / group`, query head `gk · group + k % group`), as
/// a row index of the request's token-major `q`, `m`, `l` and output.
#[inline(always)]
fn row(g: &Geom, gk: usize, k: usize) -> usize {
    (k / g.group) * g.q_heads + gk * g.group + k % g.group
}

/// Stages the request's query rows (`q`: `ext · q_heads` rows of `d`) transposed into `qt`:
/// `qt[((gk · tiles + t) · d + e) · 16 + L]` is element `e` of row `16·t + L` of KV head `gk`
/// (zero past the last row).
pub(crate) fn stage_queries(g: &Geom, q: &[f32], ext: usize, qt: &mut [f32]) {
    let (d, nt) = (g.d, tiles(g, ext));
    let rows = ext * g.group;
    let qt = &mut qt[..queries_len(g, ext)];
    for gk in 0..g.q_heads / g.group {
        for t in 0..nt {
            let tile = &mut qt[(gk * nt + t) * d * LANES..][..d * LANES];
            for lane in 0..LANES {
                let k = t * LANES + lane;
                if k < rows {
                    let qr = &q[row(g, gk, k) * d..][..d];
                    for (e, &x) in qr.iter().enumerate() {
                        tile[e * LANES + lane] = x;
                    }
                } else {
                    for e in 0..d {
                        tile[e * LANES + lane] = 0.0;
                    }
                }
            }
        }
    }
}

/// One block staged as f32 for every KV head `gk` of its geometry: `k[(gk · BLOCK + j) · d +
/// e]` is element `e` of position `j`'s key, `v[(gk · BLOCK + j) · dv + e]` of its value; and the
/// request's staged queries ([`stage_queries`], `tiles` per KV head).
pub(crate) struct Staged<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub qt: &'a [f32],
    pub tiles: usize,
}

/// Stages the block's rows `k[j]`, `v[j]` (`j < k.len() ≤ BLOCK`) into `ks` and `vs` as
/// [`Staged`] lays them out (lengths at least [`block_len`]).
///
/// # Safety
/// Every `k[j]` must be valid for a whole K row of `E` (`g.k_row` elements), every `v[j]` for a
/// whole V row (`g.v_row`, or the K row when `g.v_in_k`); the CPU must have AVX2, FMA and F16C.
#[inline(always)]
unsafe fn stage<E: Elem>(
    g: &Geom,
    k: &[*const u8],
    v: &[*const u8],
    ks: &mut [f32],
    vs: &mut [f32],
) {
    let n = k.len();
    let (k_len, v_len) = block_len(g);
    assert!(n <= BLOCK && v.len() == n && ks.len() >= k_len && vs.len() >= v_len);
    let (d, dv) = (g.d, g.dv);
    for gk in 0..g.q_heads / g.group {
        let voff = if g.v_in_k { 0 } else { gk * dv * E::BYTES };
        for j in 0..n {
            let (ko, vo) = (
                &mut ks[(gk * BLOCK + j) * d..][..d],
                &mut vs[(gk * BLOCK + j) * dv..][..dv],
            );
            // SAFETY: head gk's `d` key elements start `gk · d` into the K row, its `dv` value
            // elements at `voff` into the V row (function contract); `ko` and `vo` hold `d` and
            // `dv` f32 (sliced above).
            unsafe {
                widen::<E>(k[j].add(gk * d * E::BYTES), d, ko.as_mut_ptr());
                widen::<E>(v[j].add(voff), dv, vo.as_mut_ptr());
            }
        }
    }
}

/// The scaled scores of a tile's sixteen query rows (`qt`: `d` registers of 16 lanes) against
/// the `J` positions `k[p]` (`d` f32 each), one register per position.
///
/// # Safety
/// `qt` must be valid for `16 · d` f32 reads, every `k[p]` for `d`; the CPU must have AVX-512F.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn scores<const J: usize>(
    qt: *const f32,
    k: [*const f32; J],
    d: usize,
    scale: f32,
) -> [__m512; J] {
    // SAFETY: every access is below `16 · d` f32 of `qt` and `d` of each `k[p]` (contract).
    unsafe {
        let mut a = [[_mm512_setzero_ps(); J]; 8];
        let chunks = d / 8;
        for ch in 0..chunks {
            for i in 0..8 {
                let e = ch * 8 + i;
                let q = _mm512_loadu_ps(qt.add(e * LANES));
                for p in 0..J {
                    a[i][p] = _mm512_fmadd_ps(q, _mm512_set1_ps(*k[p].add(e)), a[i][p]);
                }
            }
        }
        let mut out = [_mm512_setzero_ps(); J];
        for p in 0..J {
            let lo = _mm512_add_ps(
                _mm512_add_ps(a[0][p], a[4][p]),
                _mm512_add_ps(a[2][p], a[6][p]),
            );
            let hi = _mm512_add_ps(
                _mm512_add_ps(a[1][p], a[5][p]),
                _mm512_add_ps(a[3][p], a[7][p]),
            );
            let mut s = _mm512_add_ps(lo, hi);
            for e in chunks * 8..d {
                let q = _mm512_loadu_ps(qt.add(e * LANES));
                s = _mm512_fmadd_ps(q, _mm512_set1_ps(*k[p].add(e)), s);
            }
            out[p] = _mm512_mul_ps(_mm512_set1_ps(scale), s);
        }
        out
    }
}

/// `acc[h][e] = p_h[j] · v_j[e] + acc[h][e]` (fused) for `j = 0..n` in order, `e < dv`, after
/// `acc[h][e] *= corr[h]`: the AVX2 kernel's weighted sum over the staged value rows (`v`: `dv`
/// f32 per position), 16 elements per register. Row `h`'s weights are lane `lane[h]` of the
/// tile's weight registers `p` (`n` of them).
///
/// # Safety
/// Every `acc[h]` must be valid for `dv` f32 reads and writes and not alias the others, `v` for
/// `n · dv` f32 reads, `lane[h] < 16`; the CPU must have AVX-512F.
#[inline(always)]
unsafe fn weighted_sum<const H: usize>(
    acc: &[*mut f32; H],
    corr: &[f32; H],
    p: &[[f32; LANES]; BLOCK],
    lane: &[usize; H],
    v: *const f32,
    n: usize,
    dv: usize,
) {
    // SAFETY: every access is below `dv` elements of its row (see the function's contract).
    unsafe {
        let mut e = 0;
        // As many accumulator registers per row as leave room in the 32 registers.
        if H <= 5 {
            while e + 64 <= dv {
                weighted_chunk::<H, 4>(acc, corr, p, lane, v, n, dv, e, !0);
                e += 64;
            }
        }
        while e + 32 <= dv {
            weighted_chunk::<H, 2>(acc, corr, p, lane, v, n, dv, e, !0);
            e += 32;
        }
        while e + 16 <= dv {
            weighted_chunk::<H, 1>(acc, corr, p, lane, v, n, dv, e, !0);
            e += 16;
        }
        if e < dv {
            weighted_chunk::<H, 1>(acc, corr, p, lane, v, n, dv, e, (1 << (dv - e)) - 1);
        }
    }
}

/// [`weighted_sum`] over elements `e .. e + 16W`, in `H × W` registers; the lanes of `mask`
/// only in the last register (all of them in the others).
///
/// # Safety
/// As [`weighted_sum`], with the masked-in elements below `dv`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn weighted_chunk<const H: usize, const W: usize>(
    acc: &[*mut f32; H],
    corr: &[f32; H],
    p: &[[f32; LANES]; BLOCK],
    lane: &[usize; H],
    v: *const f32,
    n: usize,
    dv: usize,
    e: usize,
    mask: __mmask16,
) {
    // SAFETY: every access is below `dv` elements of its row, masked lanes are not accessed
    // (function contract).
    unsafe {
        let mut a = [[_mm512_setzero_ps(); W]; H];
        for h in 0..H {
            let c = _mm512_set1_ps(corr[h]);
            for w in 0..W {
                let mk = if w + 1 == W { mask } else { !0 };
                let x = _mm512_maskz_loadu_ps(mk, acc[h].add(e + 16 * w));
                a[h][w] = _mm512_mul_ps(x, c);
            }
        }
        for j in 0..n {
            let mut x = [_mm512_setzero_ps(); W];
            for w in 0..W {
                let mk = if w + 1 == W { mask } else { !0 };
                x[w] = _mm512_maskz_loadu_ps(mk, v.add(j * dv + e + 16 * w));
            }
            for h in 0..H {
                let wgt = _mm512_set1_ps(p[j][lane[h]]);
                for w in 0..W {
                    a[h][w] = _mm512_fmadd_ps(wgt, x[w], a[h][w]);
                }
            }
        }
        for h in 0..H {
            for w in 0..W {
                let mk = if w + 1 == W { mask } else { !0 };
                _mm512_mask_storeu_ps(acc[h].add(e + 16 * w), mk, a[h][w]);
            }
        }
    }
}

/// The rows of a tile, `seen[L]` positions each, through the weighted sum: rows that see the
/// whole `n` in groups of up to [`ROWS`] sharing every V load, the others one by one.
///
/// # Safety
/// As [`weighted_sum`] for every row (`acc` row pointers distinct), `seen[L] ≤ n ≤ BLOCK`.
#[inline(always)]
unsafe fn weighted_tile(
    acc: &[*mut f32; LANES],
    corr: &[f32; LANES],
    p: &[[f32; LANES]; BLOCK],
    seen: &[usize; LANES],
    v: *const f32,
    n: usize,
    dv: usize,
) {
    let mut group = [0usize; ROWS];
    let mut len = 0;
    for (lane, &s) in seen.iter().enumerate() {
        if s == 0 {
            continue;
        }
        if s < n {
            // SAFETY: forwarded contract (one row, its own `seen`).
            unsafe { weighted_sum::<1>(&[acc[lane]], &[corr[lane]], p, &[lane], v, s, dv) };
            continue;
        }
        group[len] = lane;
        len += 1;
        if len == ROWS {
            // SAFETY: forwarded contract.
            unsafe { weighted_group(acc, corr, p, &group[..len], v, n, dv) };
            len = 0;
        }
    }
    if len > 0 {
        // SAFETY: forwarded contract.
        unsafe { weighted_group(acc, corr, p, &group[..len], v, n, dv) };
    }
}

/// [`weighted_sum`] for the lanes `lanes` (1 to [`ROWS`]) of a tile, all seeing `n` positions.
///
/// # Safety
/// As [`weighted_tile`].
#[inline(always)]
unsafe fn weighted_group(
    acc: &[*mut f32; LANES],
    corr: &[f32; LANES],
    p: &[[f32; LANES]; BLOCK],
    lanes: &[usize],
    v: *const f32,
    n: usize,
    dv: usize,
) {
    macro_rules! of_width {
        ($($h:literal)*) => {
            match lanes.len() {
                $($h => {
                    let mut l = [0usize; $h];
                    l.copy_from_slice(lanes);
                    let mut a = [std::ptr::null_mut::<f32>(); $h];
                    let mut c = [0.0f32; $h];
                    for i in 0..$h {
                        a[i] = acc[l[i]];
                        c[i] = corr[l[i]];
                    }
                    // SAFETY: forwarded contract.
                    unsafe { weighted_sum::<$h>(&a, &c, p, &l, v, n, dv) }
                })*
                _ => unreachable!("groups are 1 to ROWS rows"),
            }
        };
    }
    of_width!(1 2 3 4 5 6)
}

/// Where a block lies for the query tokens of one call: the request's first `ext` tokens
/// start at position `pos0`, the block holds positions `start .. end`, and tokens from `t0`
/// see it (token `t` sees positions up to `pos0 + t`).
#[derive(Clone, Copy)]
pub(crate) struct BlockSpan {
    pub pos0: usize,
    pub ext: usize,
    pub t0: usize,
    pub start: usize,
    pub end: usize,
}

impl BlockSpan {
    /// Positions of the block that token `t` sees (0 for tokens before `t0` or past `ext`).
    #[inline(always)]
    fn seen(&self, t: usize) -> usize {
        if t < self.t0 || t >= self.ext {
            0
        } else {
            (self.pos0 + t + 1).min(self.end) - self.start
        }
    }
}

/// Folds the staged block into the softmax states of every query row that sees it: for each KV
/// head, the tiles of sixteen rows that hold a token from `span.t0` on.
///
/// # Safety
/// `st` must hold the block (`span.end − span.start ≤ BLOCK` positions) and the request's
/// queries staged for geometry `g`; `m`, `l`, `acc` must hold the request's `ext · q_heads`
/// rows; the CPU must have AVX-512F, AVX2 and FMA.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    st: &Staged<'_>,
    g: &Geom,
    span: BlockSpan,
    scale: f32,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let (d, dv, n) = (g.d, g.dv, span.end - span.start);
    let rows = span.ext * g.group;
    assert!(n <= BLOCK && m.len() >= span.ext * g.q_heads && l.len() >= m.len());
    assert!(acc.len() >= m.len() * dv);
    for gk in 0..g.q_heads / g.group {
        let kr = &st.k[gk * BLOCK * d..][..n * d];
        let vr = &st.v[gk * BLOCK * dv..][..n * dv];
        for t in span.t0 * g.group / LANES..st.tiles {
            let qt = st.qt[(gk * st.tiles + t) * d * LANES..][..d * LANES].as_ptr();
            let mut seen = [0usize; LANES];
            let mut ri = [0usize; LANES];
            for lane in 0..LANES {
                let k = t * LANES + lane;
                if k < rows {
                    seen[lane] = span.seen(k / g.group);
                    ri[lane] = row(g, gk, k);
                }
            }
            let most = seen.iter().copied().max().unwrap_or(0);
            if most == 0 {
                continue;
            }
            // Scores, three positions per step.
            // SAFETY: a register operation; the CPU per contract.
            let mut s = [unsafe { _mm512_setzero_ps() }; BLOCK];
            let kp = |j: usize| kr[j * d..][..d].as_ptr();
            let mut j = 0;
            // SAFETY: `qt` holds the tile's `16 · d` staged query elements and every `kp(j)` a
            // staged key row of `d` (sliced above); the CPU per contract.
            unsafe {
                while j + 3 <= most {
                    let [a, b, c] = scores::<3>(qt, [kp(j), kp(j + 1), kp(j + 2)], d, scale);
                    (s[j], s[j + 1], s[j + 2]) = (a, b, c);
                    j += 3;
                }
                if j + 2 <= most {
                    let [a, b] = scores::<2>(qt, [kp(j), kp(j + 1)], d, scale);
                    (s[j], s[j + 1]) = (a, b);
                    j += 2;
                }
                if j < most {
                    [s[j]] = scores::<1>(qt, [kp(j)], d, scale);
                }
            }
            // SAFETY: register operations and loads/stores of the local arrays; the CPU per
            // contract.
            let (corr, p) = unsafe { softmax(&mut s, &seen, most, &ri, m, l) };
            let mut accp = [std::ptr::null_mut::<f32>(); LANES];
            for lane in 0..LANES {
                if seen[lane] > 0 {
                    accp[lane] = acc[ri[lane] * dv..][..dv].as_mut_ptr();
                }
            }
            // SAFETY: the rows with `seen > 0` are distinct rows of the request, their
            // accumulators disjoint `dv`-element rows of `acc` (sliced above); `vr` holds `n`
            // staged value rows; the CPU per contract.
            unsafe { weighted_tile(&accp, &corr, &p, &seen, vr.as_ptr(), n, dv) };
        }
    }
}

/// The online-softmax step of a tile over its first `most` positions (`s[j]`: the sixteen rows'
/// scaled scores of position `j`; lane `L` counts positions below `seen[L]` only): updates the
/// rows' maxima and sums in `m` and `l` (rows `ri[L]` of lanes that see a position) and returns
/// each lane's rescale factor and its weights `e^(s − m_new)` (lanes past their `seen` hold
/// unused values). The scalar kernel's operations per row: the maximum skips NaN scores, the
/// sum adds the weights in position order.
///
/// # Safety
/// `most ≤ BLOCK`, `ri[L]` must index `m` and `l` where `seen[L] > 0`; the CPU must have
/// AVX-512F.
#[inline(always)]
unsafe fn softmax(
    s: &mut [__m512; BLOCK],
    seen: &[usize; LANES],
    most: usize,
    ri: &[usize; LANES],
    m: &mut [f32],
    l: &mut [f32],
) -> ([f32; LANES], [[f32; LANES]; BLOCK]) {
    let mut m_old = [f32::NEG_INFINITY; LANES];
    let mut l_old = [0.0f32; LANES];
    let mut seen32 = [0i32; LANES];
    for lane in 0..LANES {
        if seen[lane] > 0 {
            m_old[lane] = m[ri[lane]];
            l_old[lane] = l[ri[lane]];
        }
        seen32[lane] = seen[lane] as i32;
    }
    let mut corr = [1.0f32; LANES];
    let mut p = [[0.0f32; LANES]; BLOCK];
    // SAFETY: register-only AVX-512F operations and loads/stores of the local arrays (16
    // lanes each); the CPU per contract.
    unsafe {
        // (No closures: those are compiled without the caller's target features.)
        let seen_v = _mm512_loadu_si512(seen32.as_ptr().cast());
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut mx = neg_inf;
        for (j, &x) in s.iter().enumerate().take(most) {
            let inside = _mm512_cmpgt_epi32_mask(seen_v, _mm512_set1_epi32(j as i32));
            let keep = inside & _mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x);
            mx = _mm512_max_ps(mx, _mm512_mask_blend_ps(keep, neg_inf, x));
        }
        let m_o = _mm512_loadu_ps(m_old.as_ptr());
        let m_new = _mm512_max_ps(m_o, mx);
        // Where the maximum changed: the factor e^(m_old − m_new), 0 from −∞; elsewhere 1.
        let changed = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(m_o, m_new);
        let from_inf = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m_o, neg_inf);
        let f = _mm512_maskz_mov_ps(!from_inf, exp16(_mm512_sub_ps(m_o, m_new)));
        let c = _mm512_mask_blend_ps(changed, _mm512_set1_ps(1.0), f);
        let mut l_v = _mm512_loadu_ps(l_old.as_ptr());
        l_v = _mm512_mask_mul_ps(l_v, changed, l_v, c);
        let mut sum = _mm512_setzero_ps();
        for (j, x) in s.iter().enumerate().take(most) {
            let w = exp16(_mm512_sub_ps(*x, m_new));
            _mm512_storeu_ps(p[j].as_mut_ptr(), w);
            let inside = _mm512_cmpgt_epi32_mask(seen_v, _mm512_set1_epi32(j as i32));
            sum = _mm512_mask_add_ps(sum, inside, sum, w);
        }
        l_v = _mm512_add_ps(l_v, sum);
        _mm512_storeu_ps(corr.as_mut_ptr(), c);
        let (mut m_out, mut l_out) = ([0.0f32; LANES], [0.0f32; LANES]);
        _mm512_storeu_ps(m_out.as_mut_ptr(), m_new);
        _mm512_storeu_ps(l_out.as_mut_ptr(), l_v);
        for lane in 0..LANES {
            if seen[lane] > 0 {
                m[ri[lane]] = m_out[lane];
                l[ri[lane]] = l_out[lane];
            }
        }
    }
    (corr, p)
}

macro_rules! stage_for {
    ($name:ident, $elem:ty) => {
        /// [`stage`] for one element type, compiled for AVX2 + FMA + F16C.
        ///
        /// # Safety
        /// As [`stage`].
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn $name(
            g: &Geom,
            k: &[*const u8],
            v: &[*const u8],
            ks: &mut [f32],
            vs: &mut [f32],
        ) {
            // SAFETY: forwarded contract.
            unsafe { stage::<$elem>(g, k, v, ks, vs) }
        }
    };
}

stage_for!(stage_f32, F32);
stage_for!(stage_f16, F16);
stage_for!(stage_bf16, Bf16);

/// [`block`], compiled for AVX-512F + VL beside AVX2, FMA and F16C.
///
/// # Safety
/// As [`block`]; the CPU must have them ([`available`]).
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn block_staged(
    st: &Staged<'_>,
    g: &Geom,
    span: BlockSpan,
    scale: f32,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    // SAFETY: forwarded contract.
    unsafe { block(st, g, span, scale, m, l, acc) }
}

#[cfg(test)]
mod tests {
    use super::super::super::primitives::exp_nonpos;
    use super::*;

    /// [`exp16`] on sixteen lanes.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16_of(x: &[f32; 16]) -> [f32; 16] {
        let mut out = [0.0f32; 16];
        // SAFETY: both arrays hold 16 f32; the CPU per contract.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp16(_mm512_loadu_ps(x.as_ptr()))) };
        out
    }

    /// The sixteen-lane exponential is the scalar `exp_nonpos::<true>` bitwise, across its
    /// range, at the −87 cut-off and on the special values.
    #[test]
    fn exp16_is_the_scalar_exp_bitwise() {
        if !available() {
            eprintln!("no AVX-512F: nothing to compare");
            return;
        }
        let mut xs: Vec<f32> = (0..40_000).map(|i| -(i as f32) * 0.002_3).collect();
        xs.extend([
            0.0,
            -0.0,
            -87.0,
            -86.999_99,
            -87.000_01,
            -1e-30,
            -f32::MIN_POSITIVE,
            f32::MIN,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        xs.resize(xs.len().div_ceil(16) * 16, -1.0);
        for chunk in xs.chunks_exact(16) {
            let x: [f32; 16] = chunk.try_into().unwrap();
            // SAFETY: AVX-512F checked above.
            let got = unsafe { exp16_of(&x) };
            for (x, got) in x.iter().zip(got) {
                let want = exp_nonpos::<true>(*x);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "exp({x}): {got} vs {want}"
                );
            }
        }
    }
}
