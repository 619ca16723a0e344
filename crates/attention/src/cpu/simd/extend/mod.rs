//! The staged extend attention kernel: one query row per f32 lane, eight rows per register on
//! AVX2, sixteen on AVX-512 (one generic kernel, [`lanes::QueryLanes`] says how an instruction
//! set holds the lanes). A block that several query tokens see (a prefill, or a chunk of one)
//! is staged once as f32 rows, the request's query rows are staged once transposed (lane `L`
//! of a tile holds row `LANES·tile + L` of a KV head), and every step of the online softmax
//! then runs on a register of rows at once: scores, block maxima, weights, the running sums,
//! the rescale factors.
//!
//! Bitwise the in-place AVX2 and the portable kernels, and so a query's decode result at the
//! same position: a score's dot product keeps its eight partial sums (lane `i` of the other
//! kernels sums elements `i, i + 8, …` with fused multiply-adds), here eight registers fed the
//! same elements in the same order; the eight are added with the same tree `((a0 + a4) + (a2 +
//! a6)) + ((a1 + a5) + (a3 + a7))` and the tail elements one by one after it. A row's weights
//! are summed in position order, one position per step, exactly as the scalar fold; its
//! maximum needs no order (NaN scores are skipped as `f32::max` skips them). Staging converts
//! f16 and bf16 exactly, so a fused multiply-add of a staged element is the one of the element
//! converted in a register. The weighted sum of value rows adds the rows in position order,
//! element-wise, a register of elements at a time. Rows of a tile that see fewer positions (the
//! causal diagonal) or none (tokens before the block, padding) have their lanes masked out of
//! every step, so they are left exactly as the other kernels leave them.
//!
//! Staging costs about what reading the block once costs, so the kernel is taken only where
//! several query tokens see the block ([`WIDE_MIN_TOKENS`]); a decode step keeps the AVX2
//! kernel, which reads the store in place.
//!
//! The two differ in tile shape only. AVX-512 (32 registers, broadcast operands) scores one
//! tile against three positions per step with all eight partial sums live. AVX2 has 16
//! registers and needs a load for each broadcast, so a step scores two tiles against two
//! positions with the partial sums run two at a time (`i` and `i + 4`): one load per fused
//! multiply-add instead of two (one tile, one position, all eight partial sums live: two
//! loads per FMA, 1.15× slower than the in-place kernel). On a SmolLM2-shape prompt the
//! AVX-512 kernel is 1.6× the in-place one; on AVX2 (`KVSERVE_CPU_NO_AVX512=1` on this
//! machine, loaded) the eight-lane kernel is as fast as it on a SmolLM2 prompt (within the
//! noise) and 1.07× on Llama-3-8B chunks (`extend/*` in the `decode_attention` bench).

mod lanes;

use lanes::{Avx2, Avx512, QueryLanes};

use super::super::primitives::{Geom, BLOCK};
use super::elem::{widen, Bf16, Elem, F16, F32};

/// Query tokens that must see a block for it to be staged (fewer: the in-place kernel).
pub(crate) const WIDE_MIN_TOKENS: usize = 2;

/// The most query rows per register (AVX-512); per-tile arrays have this many entries, of
/// which a narrower register uses the first.
const MAX_LANES: usize = 16;

/// Rows whose weighted sums share every V load.
const ROWS: usize = 6;

/// The register the kernel holds query rows in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Width {
    /// Eight rows per `__m256`: AVX2, FMA and F16C.
    Avx2,
    /// Sixteen rows per `__m512`: AVX-512F and VL beside them.
    Avx512,
}

impl Width {
    /// The widest registers the CPU runs the kernel on, given that it runs the AVX2 kernels
    /// ([`super::available`]): AVX-512 where the AVX-512 matmul runs (including its
    /// `KVSERVE_CPU_NO_AVX512` switch), else AVX2.
    pub(crate) fn chosen() -> Width {
        if super::avx512::available() {
            Width::Avx512
        } else {
            Width::Avx2
        }
    }

    /// Query rows per register.
    pub(crate) fn lanes(self) -> usize {
        match self {
            Width::Avx2 => Avx2::LANES,
            Width::Avx512 => Avx512::LANES,
        }
    }
}

/// Tiles of one KV head's query rows for `ext` tokens.
pub(crate) fn tiles(g: &Geom, ext: usize, w: Width) -> usize {
    (ext * g.group).div_ceil(w.lanes())
}

/// The f32 elements the staged queries of `ext` tokens take ([`stage_queries`]).
pub(crate) fn queries_len(g: &Geom, ext: usize, w: Width) -> usize {
    (g.q_heads / g.group) * tiles(g, ext, w) * g.d * w.lanes()
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

/// Stages the request's query rows (`q`: `ext · q_heads` rows of `d`) transposed into `qt`
/// for registers of `w`: with `L = w.lanes()`, `qt[((gk · tiles + t) · d + e) · L + i]` is
/// element `e` of row `L·t + i` of KV head `gk` (zero past the last row).
pub(crate) fn stage_queries(g: &Geom, q: &[f32], ext: usize, w: Width, qt: &mut [f32]) {
    let (d, nt, lanes) = (g.d, tiles(g, ext, w), w.lanes());
    let rows = ext * g.group;
    let qt = &mut qt[..queries_len(g, ext, w)];
    for gk in 0..g.q_heads / g.group {
        for t in 0..nt {
            let tile = &mut qt[(gk * nt + t) * d * lanes..][..d * lanes];
            for lane in 0..lanes {
                let k = t * lanes + lane;
                if k < rows {
                    let qr = &q[row(g, gk, k) * d..][..d];
                    for (e, &x) in qr.iter().enumerate() {
                        tile[e * lanes + lane] = x;
                    }
                } else {
                    for e in 0..d {
                        tile[e * lanes + lane] = 0.0;
                    }
                }
            }
        }
    }
}

/// One block staged as f32 for every KV head `gk` of its geometry: `k[(gk · BLOCK + j) · d +
/// e]` is element `e` of position `j`'s key, `v[(gk · BLOCK + j) · dv + e]` of its value; and the
/// request's staged queries ([`stage_queries`] for `width`, `tiles` per KV head).
pub(crate) struct Staged<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub qt: &'a [f32],
    pub tiles: usize,
    pub width: Width,
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

/// The scaled scores of `T` tiles of `LANES` query rows (`qt[t]`: `d` registers each) against
/// the `J` positions `k[p]` (`d` f32 each): `out[t][p]`. With `W::PAIRED` the eight partial
/// sums of each score are run two at a time (`i` and `i + 4`, then added), so that more tiles
/// and positions fit the registers; either way each partial sum is the same chain of fused
/// multiply-adds and the same tree adds them.
///
/// # Safety
/// Every `qt[t]` must be valid for `LANES · d` f32 reads, every `k[p]` for `d`; the CPU must
/// have `W`'s instruction set.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn scores<W: QueryLanes, const T: usize, const J: usize>(
    qt: [*const f32; T],
    k: [*const f32; J],
    d: usize,
    scale: f32,
) -> [[W::V; J]; T] {
    let chunks = d / 8;
    // SAFETY: every access is below `LANES · d` f32 of a `qt[t]` and `d` of each `k[p]`
    // (contract). No closures: those are compiled without the caller's target features.
    unsafe {
        let mut out = [[W::zero(); J]; T];
        if W::PAIRED {
            // `pairs[i][t][p]`: partial sums `i` and `i + 4` added.
            let mut pairs = [[[W::zero(); J]; T]; 4];
            for i in 0..4 {
                let mut a = [[[W::zero(); J]; T]; 2];
                for ch in 0..chunks {
                    for (h, e) in [ch * 8 + i, ch * 8 + i + 4].into_iter().enumerate() {
                        let mut b = [W::zero(); J];
                        for p in 0..J {
                            b[p] = W::set1(*k[p].add(e));
                        }
                        for t in 0..T {
                            let q = W::load(qt[t].add(e * W::LANES));
                            for p in 0..J {
                                a[h][t][p] = W::fmadd(q, b[p], a[h][t][p]);
                            }
                        }
                    }
                }
                for t in 0..T {
                    for p in 0..J {
                        pairs[i][t][p] = W::add(a[0][t][p], a[1][t][p]);
                    }
                }
            }
            for t in 0..T {
                for p in 0..J {
                    let lo = W::add(pairs[0][t][p], pairs[2][t][p]);
                    let hi = W::add(pairs[1][t][p], pairs[3][t][p]);
                    out[t][p] = W::add(lo, hi);
                }
            }
        } else {
            let mut a = [[[W::zero(); J]; T]; 8];
            for ch in 0..chunks {
                for i in 0..8 {
                    let e = ch * 8 + i;
                    for t in 0..T {
                        let q = W::load(qt[t].add(e * W::LANES));
                        for p in 0..J {
                            a[i][t][p] = W::fmadd(q, W::set1(*k[p].add(e)), a[i][t][p]);
                        }
                    }
                }
            }
            for t in 0..T {
                for p in 0..J {
                    let lo = W::add(
                        W::add(a[0][t][p], a[4][t][p]),
                        W::add(a[2][t][p], a[6][t][p]),
                    );
                    let hi = W::add(
                        W::add(a[1][t][p], a[5][t][p]),
                        W::add(a[3][t][p], a[7][t][p]),
                    );
                    out[t][p] = W::add(lo, hi);
                }
            }
        }
        for t in 0..T {
            for p in 0..J {
                let mut s = out[t][p];
                for e in chunks * 8..d {
                    let q = W::load(qt[t].add(e * W::LANES));
                    s = W::fmadd(q, W::set1(*k[p].add(e)), s);
                }
                out[t][p] = W::mul(W::set1(scale), s);
            }
        }
        out
    }
}

/// `acc[h][e] = p_h[j] · v_j[e] + acc[h][e]` (fused) for `j = 0..n` in order, `e < dv`, after
/// `acc[h][e] *= corr[h]`: the AVX2 kernel's weighted sum over the staged value rows (`v`: `dv`
/// f32 per position), a register of elements at a time. Row `h`'s weights are lane `lane[h]`
/// of the tile's weight registers `p` (`n` of them).
///
/// # Safety
/// Every `acc[h]` must be valid for `dv` f32 reads and writes and not alias the others, `v` for
/// `n · dv` f32 reads, `lane[h] < W::LANES`; the CPU must have `W`'s instruction set.
#[inline(always)]
unsafe fn weighted_sum<W: QueryLanes, const H: usize>(
    acc: &[*mut f32; H],
    corr: &[f32; H],
    p: &[[f32; MAX_LANES]; BLOCK],
    lane: &[usize; H],
    v: *const f32,
    n: usize,
    dv: usize,
) {
    let r = Rows {
        acc,
        corr,
        p,
        lane,
        v,
        n,
        dv,
    };
    let l = W::LANES;
    // SAFETY: every access is below `dv` elements of its row (see the function's contract).
    unsafe {
        let mut e = 0;
        // As many accumulator registers per row as leave room in the registers.
        if H <= W::ROWS_BY_4 {
            while e + 4 * l <= dv {
                weighted_chunk::<W, H, 4, false>(&r, e, W::tail(l));
                e += 4 * l;
            }
        }
        if H <= W::ROWS_BY_2 {
            while e + 2 * l <= dv {
                weighted_chunk::<W, H, 2, false>(&r, e, W::tail(l));
                e += 2 * l;
            }
        }
        while e + l <= dv {
            weighted_chunk::<W, H, 1, false>(&r, e, W::tail(l));
            e += l;
        }
        if e < dv {
            weighted_chunk::<W, H, 1, true>(&r, e, W::tail(dv - e));
        }
    }
}

/// The operands of [`weighted_sum`].
struct Rows<'a, const H: usize> {
    acc: &'a [*mut f32; H],
    corr: &'a [f32; H],
    p: &'a [[f32; MAX_LANES]; BLOCK],
    lane: &'a [usize; H],
    v: *const f32,
    n: usize,
    dv: usize,
}

/// [`weighted_sum`] over elements `e .. e + LANES·C`, in `H × C` registers; with `TAIL`, only
/// the lanes of `tail` in the last register (all of them in the others).
///
/// # Safety
/// As [`weighted_sum`], with the accessed elements below `dv`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn weighted_chunk<W: QueryLanes, const H: usize, const C: usize, const TAIL: bool>(
    r: &Rows<'_, H>,
    e: usize,
    tail: W::Tail,
) {
    let l = W::LANES;
    // SAFETY: every access is below `dv` elements of its row, lanes outside `tail` are not
    // accessed (function contract). No closures: those are compiled without the caller's
    // target features.
    unsafe {
        let mut a = [[W::zero(); C]; H];
        for h in 0..H {
            let c = W::set1(r.corr[h]);
            for w in 0..C {
                let at = r.acc[h].add(e + l * w);
                let x = if TAIL && w + 1 == C {
                    W::load_tail(tail, at)
                } else {
                    W::load(at)
                };
                a[h][w] = W::mul(x, c);
            }
        }
        for j in 0..r.n {
            let mut x = [W::zero(); C];
            for w in 0..C {
                let at = r.v.add(j * r.dv + e + l * w);
                x[w] = if TAIL && w + 1 == C {
                    W::load_tail(tail, at)
                } else {
                    W::load(at)
                };
            }
            for h in 0..H {
                let wgt = W::set1(r.p[j][r.lane[h]]);
                for w in 0..C {
                    a[h][w] = W::fmadd(wgt, x[w], a[h][w]);
                }
            }
        }
        for h in 0..H {
            for w in 0..C {
                let at = r.acc[h].add(e + l * w);
                if TAIL && w + 1 == C {
                    W::store_tail(tail, at, a[h][w]);
                } else {
                    W::store(at, a[h][w]);
                }
            }
        }
    }
}

/// The rows of a tile, `seen[L]` positions each, through the weighted sum: rows that see the
/// whole `n` in groups of up to [`ROWS`] sharing every V load, the others one by one.
///
/// # Safety
/// As [`weighted_sum`] for every row (`acc` row pointers distinct), `seen[L] ≤ n ≤ BLOCK`,
/// `seen[L] = 0` from `W::LANES` on.
#[inline(always)]
unsafe fn weighted_tile<W: QueryLanes>(
    acc: &[*mut f32; MAX_LANES],
    corr: &[f32; MAX_LANES],
    p: &[[f32; MAX_LANES]; BLOCK],
    seen: &[usize; MAX_LANES],
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
            unsafe { weighted_sum::<W, 1>(&[acc[lane]], &[corr[lane]], p, &[lane], v, s, dv) };
            continue;
        }
        group[len] = lane;
        len += 1;
        if len == ROWS {
            // SAFETY: forwarded contract.
            unsafe { weighted_group::<W>(acc, corr, p, &group[..len], v, n, dv) };
            len = 0;
        }
    }
    if len > 0 {
        // SAFETY: forwarded contract.
        unsafe { weighted_group::<W>(acc, corr, p, &group[..len], v, n, dv) };
    }
}

/// [`weighted_sum`] for the lanes `lanes` (1 to [`ROWS`]) of a tile, all seeing `n` positions.
///
/// # Safety
/// As [`weighted_tile`].
#[inline(always)]
unsafe fn weighted_group<W: QueryLanes>(
    acc: &[*mut f32; MAX_LANES],
    corr: &[f32; MAX_LANES],
    p: &[[f32; MAX_LANES]; BLOCK],
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
                    unsafe { weighted_sum::<W, $h>(&a, &c, p, &l, v, n, dv) }
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
/// head, the tiles of `LANES` rows that hold a token from `span.t0` on, `T` tiles at a time
/// (then one by one).
///
/// # Safety
/// `st` must hold the block (`span.end − span.start ≤ BLOCK` positions) and the request's
/// queries staged for geometry `g` and `W`; `m`, `l`, `acc` must hold the request's `ext ·
/// q_heads` rows; the CPU must have `W`'s instruction set.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block<W: QueryLanes, const T: usize>(
    st: &Staged<'_>,
    g: &Geom,
    span: BlockSpan,
    scale: f32,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let n = span.end - span.start;
    assert!(n <= BLOCK && m.len() >= span.ext * g.q_heads && l.len() >= m.len());
    assert!(acc.len() >= m.len() * g.dv && W::LANES <= MAX_LANES);
    let at = At { st, g, span, scale };
    for gk in 0..g.q_heads / g.group {
        let mut t = span.t0 * g.group / W::LANES;
        // SAFETY: tiles below `st.tiles` (forwarded contract).
        unsafe {
            while t + T <= st.tiles {
                tile_group::<W, T>(&at, gk, t, m, l, acc);
                t += T;
            }
            while t < st.tiles {
                tile_group::<W, 1>(&at, gk, t, m, l, acc);
                t += 1;
            }
        }
    }
}

/// What [`block`] folds in: the staged block and queries, where the block lies, the scale.
struct At<'a, 'b> {
    st: &'a Staged<'b>,
    g: &'a Geom,
    span: BlockSpan,
    scale: f32,
}

/// [`block`] for KV head `gk`'s tiles `t0 .. t0 + T` (all below `at.st.tiles`).
///
/// # Safety
/// As [`block`].
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn tile_group<W: QueryLanes, const T: usize>(
    at: &At<'_, '_>,
    gk: usize,
    t0: usize,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let (st, g, span) = (at.st, at.g, at.span);
    let (d, dv, n, lanes) = (g.d, g.dv, span.end - span.start, W::LANES);
    let rows = span.ext * g.group;
    let kr = &st.k[gk * BLOCK * d..][..n * d];
    let vr = &st.v[gk * BLOCK * dv..][..n * dv];
    let mut qt = [std::ptr::null::<f32>(); T];
    let mut seen = [[0usize; MAX_LANES]; T];
    let mut ri = [[0usize; MAX_LANES]; T];
    let mut most = 0;
    for i in 0..T {
        let t = t0 + i;
        qt[i] = st.qt[(gk * st.tiles + t) * d * lanes..][..d * lanes].as_ptr();
        for lane in 0..lanes {
            let k = t * lanes + lane;
            if k < rows {
                seen[i][lane] = span.seen(k / g.group);
                ri[i][lane] = row(g, gk, k);
                most = most.max(seen[i][lane]);
            }
        }
    }
    if most == 0 {
        return;
    }
    // Scores, up to `W::POSITIONS` positions per step (a tile's lanes past their `seen` are
    // computed and not used).
    // SAFETY: a register operation; the CPU per contract.
    let mut s = [[unsafe { W::zero() }; BLOCK]; T];
    let kp = |j: usize| kr[j * d..][..d].as_ptr();
    let mut j = 0;
    // SAFETY: every `qt[i]` holds a tile's `LANES · d` staged query elements and every `kp(j)`
    // a staged key row of `d` (sliced above); the CPU per contract.
    unsafe {
        while W::POSITIONS >= 3 && j + 3 <= most {
            let o = scores::<W, T, 3>(qt, [kp(j), kp(j + 1), kp(j + 2)], d, at.scale);
            for i in 0..T {
                s[i][j..j + 3].copy_from_slice(&o[i]);
            }
            j += 3;
        }
        while W::POSITIONS >= 2 && j + 2 <= most {
            let o = scores::<W, T, 2>(qt, [kp(j), kp(j + 1)], d, at.scale);
            for i in 0..T {
                s[i][j..j + 2].copy_from_slice(&o[i]);
            }
            j += 2;
        }
        while j < most {
            let o = scores::<W, T, 1>(qt, [kp(j)], d, at.scale);
            for i in 0..T {
                s[i][j] = o[i][0];
            }
            j += 1;
        }
    }
    for i in 0..T {
        let most = seen[i].iter().copied().max().unwrap_or(0);
        if most == 0 {
            continue;
        }
        // SAFETY: register operations and loads/stores of the local arrays; the CPU per
        // contract.
        let (corr, p) = unsafe { softmax::<W>(&s[i], &seen[i], most, &ri[i], m, l) };
        let mut accp = [std::ptr::null_mut::<f32>(); MAX_LANES];
        for lane in 0..lanes {
            if seen[i][lane] > 0 {
                accp[lane] = acc[ri[i][lane] * dv..][..dv].as_mut_ptr();
            }
        }
        // SAFETY: the rows with `seen > 0` are distinct rows of the request, their
        // accumulators disjoint `dv`-element rows of `acc` (sliced above); `vr` holds `n`
        // staged value rows; lanes from `LANES` on have `seen = 0`; the CPU per contract.
        unsafe { weighted_tile::<W>(&accp, &corr, &p, &seen[i], vr.as_ptr(), n, dv) };
    }
}

/// The online-softmax step of a tile over its first `most` positions (`s[j]`: the tile rows'
/// scaled scores of position `j`; lane `L` counts positions below `seen[L]` only): updates the
/// rows' maxima and sums in `m` and `l` (rows `ri[L]` of lanes that see a position) and returns
/// each lane's rescale factor and its weights `e^(s − m_new)` (lanes past their `seen` hold
/// unused values). The scalar kernel's operations per row: the maximum skips NaN scores, the
/// sum adds the weights in position order.
///
/// # Safety
/// `most ≤ BLOCK`, `ri[L]` must index `m` and `l` where `seen[L] > 0`, `seen[L] ≤ BLOCK`; the
/// CPU must have `W`'s instruction set.
#[inline(always)]
#[allow(clippy::type_complexity)]
unsafe fn softmax<W: QueryLanes>(
    s: &[W::V; BLOCK],
    seen: &[usize; MAX_LANES],
    most: usize,
    ri: &[usize; MAX_LANES],
    m: &mut [f32],
    l: &mut [f32],
) -> ([f32; MAX_LANES], [[f32; MAX_LANES]; BLOCK]) {
    let mut m_old = [f32::NEG_INFINITY; MAX_LANES];
    let mut l_old = [0.0f32; MAX_LANES];
    // Counts up to BLOCK are exact in f32: lanes compare them as floats.
    let mut seen_f = [0.0f32; MAX_LANES];
    for lane in 0..MAX_LANES {
        if seen[lane] > 0 {
            m_old[lane] = m[ri[lane]];
            l_old[lane] = l[ri[lane]];
        }
        seen_f[lane] = seen[lane] as f32;
    }
    let mut corr = [1.0f32; MAX_LANES];
    let mut p = [[0.0f32; MAX_LANES]; BLOCK];
    // SAFETY: register operations and loads/stores of the local arrays (`MAX_LANES ≥ LANES`
    // each); the CPU per contract.
    unsafe {
        // (No closures: those are compiled without the caller's target features.)
        let seen_v = W::load(seen_f.as_ptr());
        let neg_inf = W::set1(f32::NEG_INFINITY);
        let mut mx = neg_inf;
        for (j, &x) in s.iter().enumerate().take(most) {
            let inside = W::gt(seen_v, W::set1(j as f32));
            let keep = W::and(inside, W::ordered(x));
            mx = W::max(mx, W::select(keep, neg_inf, x));
        }
        let m_o = W::load(m_old.as_ptr());
        let m_new = W::max(m_o, mx);
        // Where the maximum changed: the factor e^(m_old − m_new), 0 from −∞; elsewhere 1.
        let changed = W::ne(m_o, m_new);
        let from_inf = W::eq(m_o, neg_inf);
        let f = W::select(from_inf, W::exp(W::sub(m_o, m_new)), W::zero());
        let c = W::select(changed, W::set1(1.0), f);
        let mut l_v = W::load(l_old.as_ptr());
        l_v = W::select(changed, l_v, W::mul(l_v, c));
        let mut sum = W::zero();
        for (j, x) in s.iter().enumerate().take(most) {
            let w = W::exp(W::sub(*x, m_new));
            W::store(p[j].as_mut_ptr(), w);
            let inside = W::gt(seen_v, W::set1(j as f32));
            sum = W::select(inside, sum, W::add(sum, w));
        }
        l_v = W::add(l_v, sum);
        W::store(corr.as_mut_ptr(), c);
        let (mut m_out, mut l_out) = ([0.0f32; MAX_LANES], [0.0f32; MAX_LANES]);
        W::store(m_out.as_mut_ptr(), m_new);
        W::store(l_out.as_mut_ptr(), l_v);
        for lane in 0..MAX_LANES {
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

macro_rules! block_for {
    ($name:ident, $lanes:ty, $tiles:literal, $features:literal, $doc:literal) => {
        #[doc = concat!("[`block`] on ", $doc, ", compiled for ", $features, ".")]
        ///
        /// # Safety
        /// As [`block`].
        #[target_feature(enable = $features)]
        unsafe fn $name(
            st: &Staged<'_>,
            g: &Geom,
            span: BlockSpan,
            scale: f32,
            m: &mut [f32],
            l: &mut [f32],
            acc: &mut [f32],
        ) {
            // SAFETY: forwarded contract.
            unsafe { block::<$lanes, $tiles>(st, g, span, scale, m, l, acc) }
        }
    };
}

block_for!(
    block_avx2,
    Avx2,
    2,
    "avx2,fma,f16c",
    "eight-lane registers, two tiles at a time"
);
block_for!(
    block_avx512,
    Avx512,
    1,
    "avx512f,avx512vl,avx2,fma,f16c",
    "sixteen-lane registers"
);

/// [`block`] on the registers the block and queries were staged for (`st.width`).
///
/// # Safety
/// As [`block`]; the CPU must run `st.width` (AVX2, FMA and F16C; AVX-512 where
/// [`Width::chosen`] says so).
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
    unsafe {
        match st.width {
            Width::Avx2 => block_avx2(st, g, span, scale, m, l, acc),
            Width::Avx512 => block_avx512(st, g, span, scale, m, l, acc),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::primitives::exp_nonpos;
    use std::arch::x86_64::*;

    use super::super::exp::exp16;
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
        if Width::chosen() != Width::Avx512 {
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
