//! The AVX-512 matmul, chosen at run time where the CPU has AVX-512F beside AVX2, FMA and F16C.
//!
//! Bitwise the AVX2 matmul ([`super::matmul`]), and so the portable fused dot product: a
//! 512-bit register holds two independent 8-lane accumulators, the low half for weight row
//! `j` and the high half for row `j + 1`, and the 8 `x` elements of a step are broadcast to
//! both halves. Each lane therefore accumulates exactly the elements it accumulates in the
//! AVX2 kernel (`i, i + 8, …` of one dot product), with the same fused multiply-adds in the
//! same order; the halves are then reduced with the same lane-sum tree ([`hsum8`]) and the
//! tail is added one element at a time. f16 weights are widened exactly in registers
//! (`vcvtph2ps`); bf16 weights take the bf16 dot product instead ([`super::bf16dot`]).
//!
//! What it gains over AVX2 is register room: 32 registers hold a tile of up to 8 `x` rows ×
//! 6 weight rows (24 accumulators), so each weight load feeds 8 rows instead of 4 and each `x`
//! load 6 weight rows instead of 3. A small batch (decode: up to 4 rows with f32 weights, 8
//! with 16-bit ones), whose weight is read once from memory, runs streaming tiles instead:
//! two (f32) or four weight rows at a time, which read the weight almost as one sequential
//! stream, each prefetching the next tile's bytes line after line (`stream_tiles`).
//!
//! A batch of many rows (a prefill: at least 32) stages each cache block of weight rows once,
//! as f32 (f16 widened exactly) with the two rows of each pair interleaved 8 elements at a time,
//! so a tile loads a pair's chunk with one 512-bit load instead of two loads, an insert and (for
//! f16) a conversion, again for every 8 rows: the same products in the same order. On a SmolLM2
//! MLP projection of 512 rows (`matmul/512x576x1536` in the `matmul` bench) that took f16
//! weights from 5.55 to 4.47 ms and f32 from 5.09 to 4.51.

use std::arch::x86_64::*;
use std::marker::PhantomData;
use std::sync::OnceLock;

use super::super::columns::ColumnBlock;
use super::dot::dot_tile;
use super::elem::{hsum, hsum8, widen, Elem, F16, F32};
use super::matmul::{block_rows, blocking, matmul_for};

/// Whether the CPU runs these kernels (AVX-512F and AVX-512VL, which lets the 256-bit
/// halves of the reduction use all 32 registers; and the AVX2 set: see [`super::available`]),
/// detected once. `KVSERVE_CPU_NO_AVX512=1` turns them off (the AVX2 kernels run instead), for
/// comparing the two on one machine; results are the same either way.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        super::available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && std::env::var_os("KVSERVE_CPU_NO_AVX512").is_none_or(|v| v != "1")
    })
}

/// Loading two rows' 8-element chunks into the halves of one 512-bit register.
pub(crate) trait Elem512: Elem {
    /// Eight elements at `lo` in lanes 0–7 and eight at `hi` in lanes 8–15, as f32.
    ///
    /// # Safety
    /// `lo` and `hi` must each be valid for reading `8 × BYTES` bytes (any alignment), and the
    /// CPU must have AVX-512F ([`available`]).
    unsafe fn load8x2(lo: *const u8, hi: *const u8) -> __m512;
}

impl Elem512 for F32 {
    #[inline(always)]
    unsafe fn load8x2(lo: *const u8, hi: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 32 readable bytes at each pointer and AVX-512F.
        unsafe {
            let l = _mm512_castps256_ps512(_mm256_loadu_ps(lo.cast()));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castps_pd(l),
                _mm256_castps_pd(_mm256_loadu_ps(hi.cast())),
            ))
        }
    }
}

/// The two rows' sixteen 16-bit patterns in one 256-bit register (low row first).
///
/// # Safety
/// 16 readable bytes at each pointer; the CPU must have AVX2.
#[inline(always)]
unsafe fn load16x2(lo: *const u8, hi: *const u8) -> __m256i {
    // SAFETY: the caller guarantees the bytes and AVX2; loadu takes any alignment.
    unsafe {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(lo.cast())),
            _mm_loadu_si128(hi.cast()),
        )
    }
}

impl Elem512 for F16 {
    #[inline(always)]
    unsafe fn load8x2(lo: *const u8, hi: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bytes at each pointer and AVX-512F (which
        // has the 16-lane half conversion); the conversion is exact.
        unsafe { _mm512_cvtph_ps(load16x2(lo, hi)) }
    }
}

/// Where a tile's `P` pairs of weight rows are read from: chunk `ch` of pair `p` (elements
/// `8ch .. 8ch + 8` of its low row in lanes 0–7, of its high row in lanes 8–15, as f32) and
/// its tail elements one by one.
trait PairSource<const P: usize> {
    /// # Safety
    /// `p < P`, the chunk within the rows; the CPU must have AVX-512F ([`available`]).
    unsafe fn chunk(&self, p: usize, ch: usize) -> __m512;
    /// Element `e` of row `s` (0 low, 1 high) of pair `p`, as f32.
    ///
    /// # Safety
    /// `p < P`, `s < 2`, `e` within the rows.
    unsafe fn tail(&self, p: usize, s: usize, e: usize) -> f32;
}

/// Pairs of rows of `E` where the weight lies: `[low, high]` row starts.
struct RowPairs<E, const P: usize>([[*const u8; 2]; P], std::marker::PhantomData<E>);

impl<E: Elem512, const P: usize> PairSource<P> for RowPairs<E, P> {
    #[inline(always)]
    unsafe fn chunk(&self, p: usize, ch: usize) -> __m512 {
        let off = ch * 8 * E::BYTES;
        // SAFETY: forwarded contract (the chunk lies within both rows).
        unsafe { E::load8x2(self.0[p][0].add(off), self.0[p][1].add(off)) }
    }
    #[inline(always)]
    unsafe fn tail(&self, p: usize, s: usize, e: usize) -> f32 {
        // SAFETY: forwarded contract.
        unsafe { E::load1(self.0[p][s].add(e * E::BYTES)) }
    }
}

/// Pairs of f32 rows staged interleaved ([`interleave`]): pair `p` starts at `at[p]`, its
/// chunk `ch` is the 16 f32 at `16·ch` (one load), its tails follow the chunks, the low row's
/// `tail` elements then the high row's.
struct Interleaved<const P: usize> {
    at: [*const f32; P],
    chunks: usize,
    tail: usize,
}

impl<const P: usize> PairSource<P> for Interleaved<P> {
    #[inline(always)]
    unsafe fn chunk(&self, p: usize, ch: usize) -> __m512 {
        // SAFETY: forwarded contract (16 f32 of the staged pair).
        unsafe { _mm512_loadu_ps(self.at[p].add(16 * ch)) }
    }
    #[inline(always)]
    unsafe fn tail(&self, p: usize, s: usize, e: usize) -> f32 {
        // SAFETY: forwarded contract (`e` is a tail element: `8·chunks ≤ e < 8·chunks + tail`).
        unsafe { *self.at[p].add(16 * self.chunks + s * self.tail + e - 8 * self.chunks) }
    }
}

/// Dot products of `H` f32 rows `a[h]` with `P` pairs of rows `b[p] = [lo, hi]` of `E`, `d`
/// elements each, in the fixed order (see the module docs): `out[p][s][h] = a[h]·b[p][s]`.
/// With `per > 0` it also prefetches `per` cache lines from `next` on per step of 8 elements,
/// line after line (hints: no effect on the result, and they never fault).
///
/// # Safety
/// Every `a[h]` must be valid for `d` f32 reads, `b` must hold its `P` pairs of `d` elements,
/// and the CPU must have AVX-512F, AVX-512VL, AVX2, FMA and F16C.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn dot_tile2<S: PairSource<P>, const H: usize, const P: usize>(
    a: &[*const f32; H],
    b: &S,
    d: usize,
    (next, per): (*const u8, usize),
) -> [[[f32; H]; 2]; P] {
    // SAFETY: every access is below `d` elements of its row (see the function's contract).
    // (Plain loops, no closures or `array::from_fn`: those are compiled without this
    // function's target features, so the registers would go through memory.)
    unsafe {
        let mut c = [[_mm512_setzero_ps(); H]; P];
        let chunks = d / 8;
        for ch in 0..chunks {
            for q in 0..per {
                let at = next.wrapping_add((ch * per + q) * 64);
                _mm_prefetch::<_MM_HINT_T0>(at.cast());
            }
            let mut w = [_mm512_setzero_ps(); P];
            for p in 0..P {
                w[p] = b.chunk(p, ch);
            }
            for h in 0..H {
                let x = _mm256_castps_pd(_mm256_loadu_ps(a[h].add(ch * 8)));
                let x = _mm512_castpd_ps(_mm512_broadcast_f64x4(x));
                for p in 0..P {
                    c[p][h] = _mm512_fmadd_ps(x, w[p], c[p][h]);
                }
            }
        }
        // The 2·H·P eight-lane accumulators, in the order (p, half, h).
        let mut halves = [[[_mm256_setzero_ps(); H]; 2]; P];
        for p in 0..P {
            for h in 0..H {
                let z = c[p][h];
                halves[p][0][h] = _mm512_castps512_ps256(z);
                halves[p][1][h] =
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(z)));
            }
        }
        let at = |i: usize| (i / (2 * H), i / H % 2, i % H);
        let mut out = [[[0.0f32; H]; 2]; P];
        let n = 2 * H * P;
        let mut k = 0;
        while k + 8 <= n {
            let mut v = [_mm256_setzero_ps(); 8];
            for (i, v) in v.iter_mut().enumerate() {
                let (p, s, h) = at(k + i);
                *v = halves[p][s][h];
            }
            let r = hsum8(v);
            for (i, r) in r.into_iter().enumerate() {
                let (p, s, h) = at(k + i);
                out[p][s][h] = r;
            }
            k += 8;
        }
        for i in k..n {
            let (p, s, h) = at(i);
            out[p][s][h] = hsum(halves[p][s][h]);
        }
        for p in 0..P {
            for s in 0..2 {
                for h in 0..H {
                    let o = &mut out[p][s][h];
                    for e in chunks * 8..d {
                        *o = (*a[h].add(e)).mul_add(b.tail(p, s, e), *o);
                    }
                }
            }
        }
        out
    }
}

/// Rows of `x` per matmul tile.
const MR: usize = 8;

/// `out[i, j] = x_i · w_j` for the rows of `x` (`k` each) and the columns `j` of `out` (rows of
/// `w`, `k` elements of `E` each, little-endian bytes): bitwise [`super::matmul`]'s result,
/// whatever the tile an element falls in. Blocks `w` so a block stays in cache over all rows;
/// with `STREAM`, a small batch (decode) takes [`stream_tiles`] instead (the general tiles
/// otherwise: the tests compare the two).
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512VL, AVX2, FMA and F16C ([`available`]). Lengths are asserted.
#[inline(always)]
unsafe fn matmul_tiles<E: Elem512, const STREAM: bool>(
    x: &[f32],
    w: &[u8],
    k: usize,
    out: &mut ColumnBlock<'_>,
) {
    let (m, nb) = blocking(x, w, k, E::BYTES, out);
    let cols = out.cols();
    if STREAM && m <= stream_max_rows::<E>() {
        // SAFETY: forwarded contract; `blocking` asserted the lengths.
        unsafe { stream_tiles::<E>(x, w, k, m, cols, out) };
        return;
    }
    if m >= STAGE_MIN_ROWS {
        // Each block of weight rows staged once as interleaved f32 pairs, for all the rows of
        // x: the tiles then load a pair's chunk with one load, instead of two loads and an
        // insert (and, for 16-bit weights, a conversion) again for every 8 rows. Blocks of
        // f32's size, so a staged block stays in cache.
        let nb = block_rows(k, 4);
        let mut staged = STAGED.take();
        staged.resize(nb.next_multiple_of(2) * k, 0.0);
        for j0 in cols.clone().step_by(nb) {
            let js = j0..(j0 + nb).min(cols.end);
            let src = &w[j0 * k * E::BYTES..js.end * k * E::BYTES];
            let dst = &mut staged[..js.len().next_multiple_of(2) * k];
            // SAFETY: the CPU per contract; lengths are asserted.
            unsafe { interleave::<E>(src, k, dst) };
            // SAFETY: `dst` holds the rows `js` staged as pairs; the rest as below.
            unsafe { row_tiles(&StagedPairs { block: dst, js }, x, k, m, out) };
        }
        STAGED.set(staged);
        return;
    }
    for j0 in cols.clone().step_by(nb) {
        let js = j0..(j0 + nb).min(cols.end);
        let t = InPlace::<E> {
            w,
            js,
            elem: PhantomData,
        };
        // SAFETY: forwarded contract; `blocking` asserted the lengths.
        unsafe { row_tiles(&t, x, k, m, out) };
    }
}

/// Rows of `x` at least this many take staged weight blocks (fewer rows read the weight in
/// place: a staged block would serve too few tiles).
const STAGE_MIN_ROWS: usize = 4 * MR;

thread_local! {
    /// Per thread: the block of weight rows staged as interleaved f32 pairs (see
    /// [`matmul_tiles`]).
    static STAGED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Stages the rows of `src` (`k` elements of `E` each) into `dst` as interleaved f32 pairs
/// ([`Interleaved`]): pair `q` (rows `2q`, `2q + 1`; a missing last high row is zeros) takes
/// `2k` f32 from `2k·q`, chunk by chunk of 8 elements of each row, then the low row's tail, then
/// the high row's. Widening is exact, so the tiles compute the same products.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C. (Lengths are asserted.)
#[inline(always)]
unsafe fn interleave<E: Elem>(src: &[u8], k: usize, dst: &mut [f32]) {
    let rows = src.len() / (k * E::BYTES);
    assert!(src.len() == rows * k * E::BYTES && dst.len() == rows.next_multiple_of(2) * k);
    let (chunks, tail) = (k / 8, k % 8);
    let mut row = vec![0.0f32; k];
    for (q, pair) in dst.chunks_exact_mut(2 * k).enumerate() {
        for s in 0..2 {
            let r = 2 * q + s;
            if r < rows {
                let bytes = &src[r * k * E::BYTES..][..k * E::BYTES];
                // SAFETY: `bytes` holds `k` elements of E and `row` k f32; the CPU per contract.
                unsafe { widen::<E>(bytes.as_ptr(), k, row.as_mut_ptr()) };
            } else {
                row.fill(0.0);
            }
            for ch in 0..chunks {
                pair[16 * ch + 8 * s..][..8].copy_from_slice(&row[8 * ch..][..8]);
            }
            pair[16 * chunks + s * tail..][..tail].copy_from_slice(&row[8 * chunks..]);
        }
    }
}

/// Stores a tile's results `t[p][s][h]` (row `i0 + h`, column `j + 2p + s`) in `out`, the
/// columns below `end` only (a last odd pair's high row has none), one row's run at a time.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // t is indexed [pair][row of pair][h]
fn put_tile<const H: usize>(
    out: &mut ColumnBlock<'_>,
    i0: usize,
    j: usize,
    end: usize,
    t: &[[[f32; H]; 2]],
) {
    let cols = j..(j + 2 * t.len()).min(end);
    for h in 0..H {
        for (c, v) in out.row(i0 + h, cols.clone()).iter_mut().enumerate() {
            *v = t[c / 2][c % 2][h];
        }
    }
}

/// Rows `i0 .. i0 + H` of `x` against the weight rows `js` staged in `block` as interleaved
/// pairs: `P` pairs at a time, then single pairs (the high row of a last odd pair is zeros and
/// its column is not written).
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512VL, AVX2, FMA and F16C. (Rows are sliced with bounds
/// checks.)
#[inline(always)]
unsafe fn pair_tile<const H: usize, const P: usize>(
    x: &[f32],
    block: &[f32],
    k: usize,
    i0: usize,
    js: std::ops::Range<usize>,
    out: &mut ColumnBlock<'_>,
) {
    let a: [*const f32; H] = std::array::from_fn(|i| x[(i0 + i) * k..][..k].as_ptr());
    let pairs = js.len().div_ceil(2);
    assert!(block.len() >= pairs * 2 * k);
    let pair = |q: usize| block[q * 2 * k..][..2 * k].as_ptr();
    let (chunks, tail) = (k / 8, k % 8);
    let mut put = |q: usize, t: &[[[f32; H]; 2]]| put_tile(out, i0, js.start + 2 * q, js.end, t);
    let mut q = 0;
    while q + P <= pairs {
        let src = Interleaved::<P> {
            at: std::array::from_fn(|p| pair(q + p)),
            chunks,
            tail,
        };
        // SAFETY: the x rows hold k f32 and each staged pair 2k (sliced); CPU per contract.
        let t = unsafe { dot_tile2::<_, H, P>(&a, &src, k, (std::ptr::null(), 0)) };
        put(q, &t);
        q += P;
    }
    while q < pairs {
        let src = Interleaved::<1> {
            at: [pair(q)],
            chunks,
            tail,
        };
        // SAFETY: as above, one pair.
        let t = unsafe { dot_tile2::<_, H, 1>(&a, &src, k, (std::ptr::null(), 0)) };
        put(q, &t);
        q += 1;
    }
}

/// Where a matmul's tiles read a set of weight rows: in place ([`InPlace`]) or staged as
/// interleaved pairs ([`StagedPairs`]).
trait Tiles {
    /// Rows `i0 .. i0 + H` of `x` (`k` each) against all the weight rows, `P` pairs at a time.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, AVX-512VL, AVX2, FMA and F16C.
    unsafe fn tile<const H: usize, const P: usize>(
        &self,
        x: &[f32],
        k: usize,
        i0: usize,
        out: &mut ColumnBlock<'_>,
    );
}

/// The rows `js` of a weight `w` of `E`, read in place ([`matmul_tile`]).
struct InPlace<'a, E> {
    w: &'a [u8],
    js: std::ops::Range<usize>,
    elem: PhantomData<E>,
}

impl<E: Elem512> Tiles for InPlace<'_, E> {
    #[inline(always)]
    unsafe fn tile<const H: usize, const P: usize>(
        &self,
        x: &[f32],
        k: usize,
        i0: usize,
        out: &mut ColumnBlock<'_>,
    ) {
        // SAFETY: forwarded contract.
        unsafe { matmul_tile::<E, H, P>(x, self.w, k, i0, self.js.clone(), out, false) }
    }
}

/// The rows `js` of a weight staged in `block` as interleaved f32 pairs ([`pair_tile`]).
struct StagedPairs<'a> {
    block: &'a [f32],
    js: std::ops::Range<usize>,
}

impl Tiles for StagedPairs<'_> {
    #[inline(always)]
    unsafe fn tile<const H: usize, const P: usize>(
        &self,
        x: &[f32],
        k: usize,
        i0: usize,
        out: &mut ColumnBlock<'_>,
    ) {
        // SAFETY: forwarded contract.
        unsafe { pair_tile::<H, P>(x, self.block, k, i0, self.js.clone(), out) }
    }
}

/// All `m` rows of `x` against the weight rows of `t`, tile by tile.
///
/// # Safety
/// As [`Tiles::tile`]; `x` must hold `m` rows (they are sliced with bounds checks).
#[inline(always)]
unsafe fn row_tiles<T: Tiles>(t: &T, x: &[f32], k: usize, m: usize, out: &mut ColumnBlock<'_>) {
    // Plain loops, no closure (see `dot_tile2`).
    for i0 in (0..m).step_by(MR) {
        macro_rules! tile_rows {
            ($($h:literal => $p:literal),*) => {
                match (m - i0).min(MR) {
                    $($h => t.tile::<$h, $p>(x, k, i0, out),)*
                    _ => t.tile::<8, 3>(x, k, i0, out),
                }
            };
        }
        // SAFETY: forwarded contract. The fewer the rows, the more weight pairs per tile (as
        // many accumulators as fit in the 32 registers, and enough chains).
        unsafe { tile_rows!(1 => 6, 2 => 6, 3 => 4, 4 => 4, 5 => 3, 6 => 3, 7 => 3) }
    }
}

/// The most `x` rows [`stream_tiles`] takes for weights of `E`: 4 for f32, 8 for 16-bit
/// weights (measured: past these, the general tiles' register reuse beats the streaming).
const fn stream_max_rows<E: Elem>() -> usize {
    16 / E::BYTES
}

/// All `m ≤ stream_max_rows` rows of `x` against the columns `js`, for a batch whose weight
/// is read once from memory (decode): few weight rows per tile (one pair for f32, two for
/// 16-bit weights: 64 bytes of weight per step of 8 elements, enough independent chains), so
/// the tile reads its weight rows nearly as one sequential stream, and each tile prefetches
/// the next tile's bytes (contiguous: the rows follow each other) line after line as it goes.
/// A 12-row tile with a prefetch per row ran at 12–14 GB/s here (f32, one core), this one at
/// 19–21 GB/s, about a single sequential read's speed; 16-bit weights 9 → 18 GB/s.
///
/// # Safety
/// As [`matmul_tiles`], with `x` holding `m` rows.
#[inline(always)]
unsafe fn stream_tiles<E: Elem512>(
    x: &[f32],
    w: &[u8],
    k: usize,
    m: usize,
    js: std::ops::Range<usize>,
    out: &mut ColumnBlock<'_>,
) {
    macro_rules! rows {
        ($p:literal; $($h:literal),*) => {
            match m {
                $($h => matmul_tile::<E, $h, $p>(x, w, k, 0, js, out, true),)*
                _ => unreachable!("m ≤ stream_max_rows"),
            }
        };
    }
    // SAFETY: forwarded contract (rows 0 .. m of x, the columns js of w).
    unsafe {
        if E::BYTES == 4 {
            rows!(1; 1, 2, 3, 4)
        } else {
            rows!(2; 1, 2, 3, 4, 5, 6, 7, 8)
        }
    }
}

matmul_for!(matmul_f32, F32, "avx512f,avx512vl,avx2,fma,f16c");
matmul_for!(matmul_f16, F16, "avx512f,avx512vl,avx2,fma,f16c");

/// The matmul with the general tiles only, for the tests to compare with [`stream_tiles`].
#[cfg(test)]
mod general {
    use super::super::elem::{F16, F32};
    use super::super::matmul::matmul_for;
    use super::{ColumnBlock, Elem512};

    /// [`super::matmul_tiles`] without the streaming tiles.
    ///
    /// # Safety
    /// As [`super::matmul_tiles`].
    #[inline(always)]
    unsafe fn matmul<E: Elem512>(x: &[f32], w: &[u8], k: usize, out: &mut ColumnBlock<'_>) {
        // SAFETY: forwarded contract.
        unsafe { super::matmul_tiles::<E, false>(x, w, k, out) }
    }

    matmul_for!(matmul_f32, F32, "avx512f,avx512vl,avx2,fma,f16c");
    matmul_for!(matmul_f16, F16, "avx512f,avx512vl,avx2,fma,f16c");
}

/// What [`matmul_for`] compiles: the matmul with its streaming tiles for small batches.
///
/// # Safety
/// As [`matmul_tiles`].
#[inline(always)]
unsafe fn matmul<E: Elem512>(x: &[f32], w: &[u8], k: usize, out: &mut ColumnBlock<'_>) {
    // SAFETY: forwarded contract.
    unsafe { matmul_tiles::<E, true>(x, w, k, out) }
}

/// Rows `i0 .. i0 + H` of `x` against rows `js` of `w`, into `out`: `P` pairs of weight rows
/// at a time, then single pairs, then a last odd row through the AVX2 tile (the same
/// arithmetic). With `stream`, each tile of `P` pairs prefetches the next one's bytes.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512VL, AVX2, FMA and F16C. (Rows are sliced with bounds checks.)
#[inline(always)]
unsafe fn matmul_tile<E: Elem512, const H: usize, const P: usize>(
    x: &[f32],
    w: &[u8],
    k: usize,
    i0: usize,
    js: std::ops::Range<usize>,
    out: &mut ColumnBlock<'_>,
    stream: bool,
) {
    let a: [*const f32; H] = std::array::from_fn(|i| x[(i0 + i) * k..][..k].as_ptr());
    let rb = k * E::BYTES;
    let row = |j: usize| w[j * rb..][..rb].as_ptr();
    let mut put = |j: usize, t: &[[[f32; H]; 2]]| put_tile(out, i0, j, js.end, t);
    // The next tile's 2P rows are the 2P·rb bytes after this tile's first row: prefetched
    // over this tile's steps of 8 elements, `per` lines a step (one tile ahead measured best;
    // two were no better).
    let tile = 2 * P * rb;
    let per = if stream && k >= 8 {
        tile.div_ceil(64).div_ceil(k / 8)
    } else {
        0
    };
    let mut j = js.start;
    while j + 2 * P <= js.end {
        let b: [[*const u8; 2]; P] = std::array::from_fn(|p| [row(j + 2 * p), row(j + 2 * p + 1)]);
        let next = b[0][0].wrapping_add(tile);
        // SAFETY: the x rows hold k f32 and the 2P w rows k elements of E each (sliced); CPU
        // per contract; the prefetches are hints.
        let t =
            unsafe { dot_tile2::<_, H, P>(&a, &RowPairs::<E, P>(b, PhantomData), k, (next, per)) };
        put(j, &t);
        j += 2 * P;
    }
    while j + 2 <= js.end {
        let pair = RowPairs::<E, 1>([[row(j), row(j + 1)]], PhantomData);
        // SAFETY: as above, one pair of w rows, no prefetch.
        let t = unsafe { dot_tile2::<_, H, 1>(&a, &pair, k, (row(j), 0)) };
        put(j, &t);
        j += 2;
    }
    if j < js.end {
        // SAFETY: as above, one w row; the AVX2 tile needs a subset of the CPU's features.
        let t = unsafe { dot_tile::<E, H, 1>(&a, [row(j)], k, (row(j), 0)) };
        out.put_tile(i0, j, &t);
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::columns::ColumnBlock;
    use super::super::super::primitives::dot_with;
    use crate::conformance::nonzero_vec;
    use kv_pool::rng::SplitMix64;
    use proptest::prelude::*;

    /// Whether the AVX-512 kernels can run here; prints why not, and fails instead when
    /// `KVSERVE_REQUIRE_AVX512=1`.
    fn avx512_or_skip() -> bool {
        if super::available() {
            return true;
        }
        let why = "the CPU lacks AVX-512F (or AVX2/FMA/F16C), or KVSERVE_CPU_NO_AVX512=1";
        if std::env::var("KVSERVE_REQUIRE_AVX512").as_deref() == Ok("1") {
            panic!("KVSERVE_REQUIRE_AVX512=1 but {why}");
        }
        eprintln!("skipped: {why}");
        false
    }

    type Kernel = unsafe fn(&[f32], &[u8], usize, &mut ColumnBlock<'_>);

    /// A weight's name, its AVX-512 and AVX2 kernels, its bytes and its f32 expansion.
    type Case<'a> = (&'a str, Kernel, Kernel, &'a [u8], Vec<f32>);

    /// `kernel` over `x` and the weight bytes `w`, its columns cut at `bounds`, as bits.
    fn run(kernel: Kernel, x: &[f32], w: &[u8], k: usize, n: usize, bounds: &[usize]) -> Vec<u32> {
        let mut out = vec![0.0f32; x.len() / k * n];
        for mut b in ColumnBlock::split(&mut out, n, bounds) {
            // SAFETY: the caller checked the CPU (`avx512_or_skip`, which implies AVX2 too).
            unsafe { kernel(x, w, k, &mut b) };
        }
        out.iter().map(|v| v.to_bits()).collect()
    }

    /// The AVX-512 matmul equals the AVX2 matmul and the portable fused dot product bitwise,
    /// for f32 and f16 weights, over odd shapes (rows past every tile height, columns
    /// past every pair and tile width, `k` with and without a tail) and any column split.
    #[test]
    fn avx512_matmul_equals_avx2_and_portable() {
        if !avx512_or_skip() {
            return;
        }
        let mut rng = SplitMix64::new(11);
        let shapes = [
            (1, 8, 1),
            (1, 7, 2),
            (1, 576, 13),
            (2, 37, 25),
            (3, 64, 12),
            (5, 300, 31),
            (8, 9, 14),
            (9, 576, 19),
            (16, 1536, 7),
            (17, 100, 50),
            // Enough rows for staged weight blocks: several blocks of an odd number of rows,
            // k with and without a tail, an odd number of columns.
            (33, 576, 300),
            (40, 13, 30),
            (36, 20, 7),
        ];
        for (m, k, n) in shapes {
            let x = nonzero_vec(&mut rng, m * k);
            let wf = nonzero_vec(&mut rng, n * k);
            let hf = half(&wf);
            for (name, wide, narrow, w, expanded) in cases(&wf, &hf) {
                let what = format!("{name} {m}x{k}x{n}");
                let want = portable(&x, &expanded, k, n);
                assert!(run(narrow, &x, w, k, n, &[0, n]) == want, "AVX2 {what}");
                assert!(run(wide, &x, w, k, n, &[0, n]) == want, "AVX-512 {what}");
                let every: Vec<usize> = (0..=n).collect();
                for bounds in [&[0, 1, n][..], &[0, n / 2 + 1, n], &every] {
                    if bounds.windows(2).all(|b| b[0] < b[1]) {
                        let got = run(wide, &x, w, k, n, bounds);
                        assert!(got == want, "AVX-512 {what} split at {bounds:?}");
                    }
                }
            }
        }
    }

    /// The weight's f16 rounding, as bit patterns.
    fn half(wf: &[f32]) -> Vec<u16> {
        wf.iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect()
    }

    /// The f32 and f16 cases of one weight: AVX-512 and AVX2 kernels, bytes, expansion (bf16
    /// weights take their own kernels, `bf16dot`).
    fn cases<'a>(wf: &'a [f32], hf: &'a [u16]) -> [Case<'a>; 2] {
        [
            (
                "f32",
                super::matmul_f32,
                super::super::matmul_f32,
                bytemuck::cast_slice(wf),
                wf.to_vec(),
            ),
            (
                "f16",
                super::matmul_f16,
                super::super::matmul_f16,
                bytemuck::cast_slice(hf),
                hf.iter()
                    .map(|&b| half::f16::from_bits(b).to_f32())
                    .collect(),
            ),
        ]
    }

    /// The portable fused dot product of every row of `x` with every row of `w` (f32), as bits.
    fn portable(x: &[f32], w: &[f32], k: usize, n: usize) -> Vec<u32> {
        (0..x.len() / k * n)
            .map(|e| {
                let (i, j) = (e / n, e % n);
                dot_with::<true>(&x[i * k..][..k], &w[j * k..][..k]).to_bits()
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// The streaming tiles of small batches (decode) equal the general tiles, the AVX2
        /// matmul and the portable dot product bitwise, for f32 and f16 weights, on
        /// random shapes (batches of 1 to 10 rows: inside and past the streaming limits) and a
        /// random column split.
        #[test]
        fn stream_tiles_equal_general_tiles(
            m in 1usize..=10,
            k in 1usize..=200,
            n in 1usize..=40,
            cut in 0usize..=40,
            seed in any::<u64>(),
        ) {
            if !avx512_or_skip() {
                return Ok(());
            }
            let mut rng = SplitMix64::new(seed);
            let x = nonzero_vec(&mut rng, m * k);
            let wf = nonzero_vec(&mut rng, n * k);
            let hf = half(&wf);
            let general: [Kernel; 2] = [super::general::matmul_f32, super::general::matmul_f16];
            let bounds = if (1..n).contains(&cut) { vec![0, cut, n] } else { vec![0, n] };
            for ((name, stream, avx2, w, expanded), general) in
                cases(&wf, &hf).into_iter().zip(general)
            {
                let want = portable(&x, &expanded, k, n);
                let what = format!("{name} {m}x{k}x{n} split {bounds:?}");
                prop_assert!(run(general, &x, w, k, n, &bounds) == want, "general {}", what);
                prop_assert!(run(stream, &x, w, k, n, &bounds) == want, "stream {}", what);
                prop_assert!(run(avx2, &x, w, k, n, &bounds) == want, "AVX2 {}", what);
            }
        }
    }
}
