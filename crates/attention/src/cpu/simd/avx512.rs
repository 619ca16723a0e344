//! The AVX-512 matmul, chosen at run time where the CPU has AVX-512F beside AVX2, FMA and F16C.
//!
//! Bitwise the AVX2 matmul ([`super::matmul`]), and so the portable fused dot product: a
//! 512-bit register holds two independent 8-lane accumulators, the low half for weight row
//! `j` and the high half for row `j + 1`, and the 8 `x` elements of a step are broadcast to
//! both halves. Each lane therefore accumulates exactly the elements it accumulates in the
//! AVX2 kernel (`i, i + 8, …` of one dot product), with the same fused multiply-adds in the
//! same order; the halves are then reduced with the same lane-sum tree ([`hsum8`]) and the
//! tail is added one element at a time. 16-bit weights are widened exactly in registers
//! (bf16: shift; f16: `vcvtph2ps`).
//!
//! What it gains over AVX2 is register room: 32 registers hold a tile of up to 8 `x` rows ×
//! 6 weight rows (24 accumulators), so each weight load feeds 8 rows instead of 4 and each `x`
//! load 6 weight rows instead of 3, and a single-row (decode) tile runs 12 weight rows in
//! flight.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::super::columns::ColumnBlock;
use super::dot::dot_tile;
use super::elem::{hsum, hsum8, Bf16, Elem, F16, F32};
use super::matmul::{blocking, matmul_for};

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

impl Elem512 for Bf16 {
    #[inline(always)]
    unsafe fn load8x2(lo: *const u8, hi: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bytes at each pointer and AVX-512F. A bf16
        // is the top half of the f32 with the same bits: widening and shifting is exact.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(load16x2(
                lo, hi,
            ))))
        }
    }
}

/// Dot products of `H` f32 rows `a[h]` with `P` pairs of rows `b[p] = [lo, hi]` of `E`, `d`
/// elements each, in the fixed order (see the module docs): `out[p][s][h] = a[h]·b[p][s]`.
/// With `ahead > 0` it also prefetches the bytes `ahead` past each weight row as it reads it
/// (a hint: no effect on the result).
///
/// # Safety
/// Every `a[h]` must be valid for `d` f32 reads, every `b[p][s]` for `d` elements of `E`, and
/// the CPU must have AVX-512F, AVX-512VL, AVX2, FMA and F16C.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn dot_tile2<E: Elem512, const H: usize, const P: usize>(
    a: &[*const f32; H],
    b: &[[*const u8; 2]; P],
    d: usize,
    ahead: usize,
) -> [[[f32; H]; 2]; P] {
    // SAFETY: every access is below `d` elements of its row (see the function's contract).
    // (Plain loops, no closures or `array::from_fn`: those are compiled without this
    // function's target features, so the registers would go through memory.)
    unsafe {
        let mut c = [[_mm512_setzero_ps(); H]; P];
        let chunks = d / 8;
        for ch in 0..chunks {
            let off = ch * 8 * E::BYTES;
            if ahead > 0 && off % 64 == 0 {
                // Hints only (they never fault, so the address may lie past the weight).
                for p in 0..P {
                    for s in 0..2 {
                        let at = b[p][s].wrapping_add(off + ahead);
                        _mm_prefetch::<_MM_HINT_T0>(at.cast());
                    }
                }
            }
            let mut w = [_mm512_setzero_ps(); P];
            for p in 0..P {
                w[p] = E::load8x2(b[p][0].add(off), b[p][1].add(off));
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
                        *o = (*a[h].add(e)).mul_add(E::load1(b[p][s].add(e * E::BYTES)), *o);
                    }
                }
            }
        }
        out
    }
}

/// Rows of `x` per matmul tile.
const MR: usize = 8;

/// Tiles of at most this many `x` rows prefetch the next tile's weight rows.
const PREFETCH_MAX_ROWS: usize = 2;

/// `out[i, j] = x_i · w_j` for the rows of `x` (`k` each) and the columns `j` of `out` (rows of
/// `w`, `k` elements of `E` each, little-endian bytes): bitwise [`super::matmul`]'s result,
/// whatever the tile an element falls in. Blocks `w` so a block stays in cache over all rows.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512VL, AVX2, FMA and F16C ([`available`]). Lengths are asserted.
#[inline(always)]
unsafe fn matmul<E: Elem512>(x: &[f32], w: &[u8], k: usize, out: &mut ColumnBlock<'_>) {
    let (m, nb) = blocking(x, w, k, E::BYTES, out);
    let cols = out.cols();
    // Plain loops, no closure (see `dot_tile2`).
    for j0 in cols.clone().step_by(nb) {
        let js = j0..(j0 + nb).min(cols.end);
        for i0 in (0..m).step_by(MR) {
            macro_rules! tile_rows {
                ($($h:literal => $p:literal),*) => {
                    match (m - i0).min(MR) {
                        $($h => matmul_tile::<E, $h, $p>(x, w, k, i0, js.clone(), out),)*
                        _ => matmul_tile::<E, 8, 3>(x, w, k, i0, js.clone(), out),
                    }
                };
            }
            // SAFETY: rows i0 .. i0 + rows of x and js of w exist (`blocking` asserts the
            // lengths); the CPU per contract. The fewer the rows, the more weight pairs per
            // tile (as many accumulators as fit in the 32 registers, and enough chains).
            unsafe { tile_rows!(1 => 6, 2 => 6, 3 => 4, 4 => 4, 5 => 3, 6 => 3, 7 => 3) }
        }
    }
}

matmul_for!(matmul_f32, F32, "avx512f,avx512vl,avx2,fma,f16c");
matmul_for!(matmul_f16, F16, "avx512f,avx512vl,avx2,fma,f16c");
matmul_for!(matmul_bf16, Bf16, "avx512f,avx512vl,avx2,fma,f16c");

/// Rows `i0 .. i0 + H` of `x` against rows `js` of `w`, into `out`: `P` pairs of weight rows
/// at a time, then single pairs, then a last odd row through the AVX2 tile (the same
/// arithmetic).
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
) {
    let a: [*const f32; H] = std::array::from_fn(|i| x[(i0 + i) * k..][..k].as_ptr());
    let rb = k * E::BYTES;
    let row = |j: usize| w[j * rb..][..rb].as_ptr();
    let mut put = |j: usize, t: &[[[f32; H]; 2]]| {
        for (p, pair) in t.iter().enumerate() {
            for (s, col) in pair.iter().enumerate() {
                for (h, &v) in col.iter().enumerate() {
                    out.set(i0 + h, j + 2 * p + s, v);
                }
            }
        }
    };
    // A tile of few rows (decode) streams its weight rows from memory once: it prefetches
    // the next tile's rows as it goes (the 2P rows it reads at once are too short a stream
    // each for the hardware prefetcher). Tiles of more rows reuse a cached block of `w`.
    let ahead = if H <= PREFETCH_MAX_ROWS {
        2 * P * rb
    } else {
        0
    };
    let mut j = js.start;
    while j + 2 * P <= js.end {
        let b: [[*const u8; 2]; P] = std::array::from_fn(|p| [row(j + 2 * p), row(j + 2 * p + 1)]);
        // SAFETY: the x rows hold k f32 and the 2P w rows k elements of E each (sliced); CPU
        // per contract.
        let t = unsafe { dot_tile2::<E, H, P>(&a, &b, k, ahead) };
        put(j, &t);
        j += 2 * P;
    }
    while j + 2 <= js.end {
        // SAFETY: as above, one pair of w rows.
        let t = unsafe { dot_tile2::<E, H, 1>(&a, &[[row(j), row(j + 1)]], k, 0) };
        put(j, &t);
        j += 2;
    }
    if j < js.end {
        // SAFETY: as above, one w row; the AVX2 tile needs a subset of the CPU's features.
        let [t] = unsafe { dot_tile::<E, H, 1>(&a, [row(j)], k) };
        for (h, &v) in t.iter().enumerate() {
            out.set(i0 + h, j, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::columns::ColumnBlock;
    use super::super::super::primitives::dot_with;
    use crate::conformance::nonzero_vec;
    use kv_pool::rng::SplitMix64;

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
    /// for f32, f16 and bf16 weights, over odd shapes (rows past every tile height, columns
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
        ];
        for (m, k, n) in shapes {
            let x = nonzero_vec(&mut rng, m * k);
            let wf = nonzero_vec(&mut rng, n * k);
            let bf: Vec<u16> = wf
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let hf: Vec<u16> = wf
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            let cases: [Case<'_>; 3] = [
                (
                    "f32",
                    super::matmul_f32,
                    super::super::matmul_f32,
                    bytemuck::cast_slice(&wf),
                    wf.clone(),
                ),
                (
                    "bf16",
                    super::matmul_bf16,
                    super::super::matmul_bf16,
                    bytemuck::cast_slice(&bf),
                    bf.iter()
                        .map(|&b| half::bf16::from_bits(b).to_f32())
                        .collect(),
                ),
                (
                    "f16",
                    super::matmul_f16,
                    super::super::matmul_f16,
                    bytemuck::cast_slice(&hf),
                    hf.iter()
                        .map(|&b| half::f16::from_bits(b).to_f32())
                        .collect(),
                ),
            ];
            for (name, wide, narrow, w, expanded) in cases {
                let what = format!("{name} {m}x{k}x{n}");
                let want: Vec<u32> = (0..m * n)
                    .map(|e| {
                        let (i, j) = (e / n, e % n);
                        dot_with::<true>(&x[i * k..][..k], &expanded[j * k..][..k]).to_bits()
                    })
                    .collect();
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
}
