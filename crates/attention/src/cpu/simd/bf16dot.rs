//! The bf16-weight matmul's SIMD kernels: the dot product of [`super::super::bf16dot`] (16 f32
//! lanes, a pair of bf16 products per lane and step of 32 elements, odd element first, the
//! weight's tail read as zeros, then the fixed lane-sum tree) on AVX-512 BF16 (`vdpbf16ps`,
//! 32 multiply-adds per instruction), and emulated exactly on AVX2 + FMA for CPUs without it.
//!
//! One generic tile ([`dot_tile`]), column loop ([`tile`]) and driver ([`matmul`]) serve both;
//! an instruction set only says how it holds the 16 lanes ([`Lanes`]) and which tile shapes fit
//! its registers. Every element is one dot product in the fixed order whatever the tile, so the
//! two kernels and the portable code give the same bits (the tests compare them), and a row's
//! result depends neither on the batch nor on the column block.
//!
//! Like the f32 kernels, a big batch (prefill) runs register tiles of up to 8 `x` rows × 3
//! weight rows over cache blocks of the weight; a decode batch (up to 8 rows on AVX-512 BF16,
//! 2 on AVX2) runs streaming tiles of 3–4 weight rows that prefetch the next tile's bytes line
//! after line, so the weight is read nearly as one sequential stream.

use std::arch::x86_64::*;

use super::super::bf16dot::{padded, round_rows as round_rows_portable, STEP};
use super::super::columns::ColumnBlock;
use super::elem::hsum_tile;

/// Whether the CPU runs the AVX-512 BF16 kernel (AVX-512 BF16 and BW beside the AVX-512
/// kernels' features; off with them when `KVSERVE_CPU_NO_AVX512=1`, which leaves the AVX2
/// emulation), detected once.
pub(crate) fn hardware() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        super::avx512::available()
            && is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512bw")
    })
}

/// How an instruction set holds the 16 f32 lanes of a bf16 dot product, and the tile shapes
/// that fit its registers.
pub(super) trait Lanes: Sized {
    /// One of the [`Self::PARTS`] parts of a step of 32 bf16 elements of a row, as loaded.
    type Pairs: Copy;
    /// The 16 f32 lanes.
    type Acc: Copy;
    /// Most `x` rows per register tile of a big batch.
    const MR: usize;
    /// Batches of at most this many rows take the streaming tiles.
    const STREAM_ROWS: usize;
    /// Parts a step is loaded and multiplied in: part `q` holds elements `32 / PARTS` × `q`
    /// onwards and updates only their lanes, so the parts of a step may go one after the other
    /// (fewer live registers) without changing any lane's order.
    const PARTS: usize;

    /// Lanes of zeros.
    unsafe fn zero() -> Self::Acc;
    /// Pairs of zeros.
    unsafe fn zero_pairs() -> Self::Pairs;
    /// Part `q` of the 32 elements at `p`.
    ///
    /// # Safety
    /// `p` valid for 32 reads; `q < PARTS`; the CPU has the instruction set.
    unsafe fn load(p: *const u16, q: usize) -> Self::Pairs;
    /// Part `q` of the `n < 32` elements at `p`, zeros after them.
    ///
    /// # Safety
    /// `p` valid for `n` reads; `q < PARTS`; the CPU has the instruction set.
    unsafe fn load_part(p: *const u16, n: usize, q: usize) -> Self::Pairs;
    /// For each lane `l` of part `q`: `acc += x[2l + 1] · w[2l + 1]`, then `acc += x[2l] ·
    /// w[2l]`.
    unsafe fn madd(acc: Self::Acc, q: usize, x: Self::Pairs, w: Self::Pairs) -> Self::Acc;
    /// Lanes `0..8` plus lanes `8..16`: the first level of the lane-sum tree.
    unsafe fn fold(acc: Self::Acc) -> __m256;
    /// The streaming tile for `m ≤ STREAM_ROWS` rows over the columns `js`.
    ///
    /// # Safety
    /// As [`tile`].
    unsafe fn stream(o: Operands<'_>, m: usize, js: Cols, out: &mut ColumnBlock<'_>);
    /// The register tile for `rows ≤ MR` rows from `i0` over the columns `js`.
    ///
    /// # Safety
    /// As [`tile`].
    unsafe fn general(o: Operands<'_>, rows: usize, i0: usize, js: Cols, out: &mut ColumnBlock<'_>);
}

type Cols = std::ops::Range<usize>;

/// A matmul's inputs: rounded `x` rows of `padded(k)` and bf16 weight rows of `k`.
#[derive(Clone, Copy)]
pub(super) struct Operands<'a> {
    x: &'a [u16],
    w: &'a [u16],
    k: usize,
}

/// Dot products of `H` rounded rows `a[h]` (zero-padded to a multiple of 32) with `P` weight
/// rows `b[p]` of `k` elements, in the fixed order: `out[p][h] = a[h]·b[p]`. With `per > 0` it
/// also prefetches `per` cache lines from `next` on per step (hints: never fault).
///
/// # Safety
/// Every `a[h]` valid for `padded(k)` reads, every `b[p]` for `k`; the CPU has `L`'s set.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles read clearer indexed
unsafe fn dot_tile<L: Lanes, const H: usize, const P: usize>(
    a: &[*const u16; H],
    b: &[*const u16; P],
    k: usize,
    (next, per): (*const u8, usize),
) -> [[f32; H]; P] {
    // SAFETY: every access is below `padded(k)` elements of an `a` row and `k` of a `b` row
    // (the last, partial step of `b` reads only its `k % 32` elements). Plain loops, no
    // closures: those would be compiled without the caller's target features.
    unsafe {
        let mut c = [[L::zero(); H]; P];
        let mut w = [L::zero_pairs(); P];
        let steps = k.div_ceil(STEP);
        for s in 0..steps {
            for q in 0..per {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add((s * per + q) * 64).cast());
            }
            let off = s * STEP;
            for part in 0..L::PARTS {
                for p in 0..P {
                    w[p] = if off + STEP <= k {
                        L::load(b[p].add(off), part)
                    } else {
                        L::load_part(b[p].add(off), k - off, part)
                    };
                }
                for h in 0..H {
                    let x = L::load(a[h].add(off), part);
                    for p in 0..P {
                        c[p][h] = L::madd(c[p][h], part, x, w[p]);
                    }
                }
            }
        }
        let mut folded = [[_mm256_setzero_ps(); H]; P];
        for p in 0..P {
            for h in 0..H {
                folded[p][h] = L::fold(c[p][h]);
            }
        }
        hsum_tile(&folded)
    }
}

/// Rows `i0 .. i0 + H` of `x` against the weight rows `js`, into `out`: `P` rows at a time,
/// then single rows. With `stream`, each tile of `P` rows prefetches the next one's bytes (the
/// rows follow each other), line after line as it goes.
///
/// # Safety
/// The CPU has `L`'s set. (Rows are sliced with bounds checks.)
#[inline(always)]
unsafe fn tile<L: Lanes, const H: usize, const P: usize>(
    o: Operands<'_>,
    i0: usize,
    js: Cols,
    out: &mut ColumnBlock<'_>,
    stream: bool,
) {
    let (k, kp) = (o.k, padded(o.k));
    let a: [*const u16; H] = std::array::from_fn(|i| o.x[(i0 + i) * kp..][..kp].as_ptr());
    let row = |j: usize| o.w[j * k..][..k].as_ptr();
    let bytes = P * k * 2;
    let per = if stream {
        bytes.div_ceil(64).div_ceil(k.div_ceil(STEP))
    } else {
        0
    };
    let mut j = js.start;
    while j + P <= js.end {
        let b: [*const u16; P] = std::array::from_fn(|p| row(j + p));
        let next = b[0].cast::<u8>().wrapping_add(bytes);
        // SAFETY: the x rows hold kp elements and the w rows k (sliced); the CPU per contract.
        let t = unsafe { dot_tile::<L, H, P>(&a, &b, k, (next, per)) };
        out.put_tile(i0, j, &t);
        j += P;
    }
    while j < js.end {
        // SAFETY: as above, one w row, no prefetch.
        let t = unsafe { dot_tile::<L, H, 1>(&a, &[row(j)], k, (row(j).cast(), 0)) };
        out.put_tile(i0, j, &t);
        j += 1;
    }
}

/// `out[i, j] = x_i · w_j` for the rounded rows of `x` (`padded(k)` each) and the columns `j`
/// of `out` (bf16 rows of `w`, `k` each). Blocks `w` (about 256 KiB) so a block stays in cache
/// over all rows; with `STREAM`, a small batch takes the streaming tiles (the general tiles
/// otherwise: the tests compare the two).
///
/// # Safety
/// The CPU has `L`'s set. Lengths are asserted.
#[inline(always)]
unsafe fn matmul<L: Lanes, const STREAM: bool>(
    x: &[u16],
    w: &[u16],
    k: usize,
    out: &mut ColumnBlock<'_>,
) {
    let cols = out.cols();
    assert!(k > 0 && x.len() % padded(k) == 0 && w.len() >= cols.end * k);
    let (m, nb) = (x.len() / padded(k), (65536 * 2 / k).max(12));
    let o = Operands { x, w, k };
    if STREAM && m <= L::STREAM_ROWS {
        // SAFETY: rows 0 .. m of x and the columns of w exist (asserted above); the CPU per
        // contract.
        unsafe { L::stream(o, m, cols, out) };
        return;
    }
    for j0 in cols.clone().step_by(nb) {
        let js = j0..(j0 + nb).min(cols.end);
        for i0 in (0..m).step_by(L::MR) {
            // SAFETY: as above, rows i0 .. i0 + MR at most.
            unsafe { L::general(o, (m - i0).min(L::MR), i0, js.clone(), out) };
        }
    }
}

/// `match $rows { h => tile::<Self, h, p>(args) }` over a table of tile shapes `h => p`, the
/// last one for every other row count; in a [`Lanes`] impl.
macro_rules! tiles {
    ($rows:expr, $args:tt; $($h:literal => $p:literal),*; $hl:literal => $pl:literal) => {
        match $rows {
            $($h => tiles!(@call $h, $p, $args),)*
            _ => tiles!(@call $hl, $pl, $args),
        }
    };
    (@call $h:literal, $p:literal, ($o:expr, $i0:expr, $js:expr, $out:expr, $s:expr)) => {
        tile::<Self, $h, $p>($o, $i0, $js, $out, $s)
    };
}

/// `vdpbf16ps` on 512-bit registers: the 16 lanes in one register, the tail by a masked load.
pub(super) struct Avx512Bf16;

impl Lanes for Avx512Bf16 {
    type Pairs = __m512i;
    type Acc = __m512;
    const MR: usize = 8;
    const STREAM_ROWS: usize = 8;
    const PARTS: usize = 1;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: AVX-512F per contract.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn zero_pairs() -> __m512i {
        // SAFETY: AVX-512F per contract.
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn load(p: *const u16, _: usize) -> __m512i {
        // SAFETY: 64 readable bytes per contract; loadu takes any alignment.
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load_part(p: *const u16, n: usize, _: usize) -> __m512i {
        // SAFETY: the masked load reads (and may fault on) only the n < 32 masked elements.
        unsafe { _mm512_maskz_loadu_epi16((1u32 << n) - 1, p.cast()) }
    }
    #[inline(always)]
    unsafe fn madd(acc: __m512, _: usize, x: __m512i, w: __m512i) -> __m512 {
        // SAFETY: AVX-512 BF16 per contract; `__m512bh` is the same 512 bits, read as 32 bf16.
        unsafe {
            let (x, w) = (
                std::mem::transmute::<__m512i, __m512bh>(x),
                std::mem::transmute::<__m512i, __m512bh>(w),
            );
            _mm512_dpbf16_ps(acc, x, w)
        }
    }
    #[inline(always)]
    unsafe fn fold(acc: __m512) -> __m256 {
        // SAFETY: AVX-512F per contract.
        unsafe {
            let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc));
            _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(hi))
        }
    }
    #[inline(always)]
    unsafe fn stream(o: Operands<'_>, m: usize, js: Cols, out: &mut ColumnBlock<'_>) {
        // SAFETY: forwarded contract. Four weight rows a tile (256 bytes a step), three past
        // six rows (the accumulators must fit the 32 registers).
        unsafe {
            tiles!(m, (o, 0, js, out, true);
                1 => 4, 2 => 4, 3 => 4, 4 => 4, 5 => 4, 6 => 4, 7 => 3; 8 => 3)
        }
    }
    #[inline(always)]
    unsafe fn general(
        o: Operands<'_>,
        rows: usize,
        i0: usize,
        js: Cols,
        out: &mut ColumnBlock<'_>,
    ) {
        // SAFETY: forwarded contract. The fewer the rows, the more weight rows per tile (as
        // many accumulators as fit in the 32 registers beside the loads).
        unsafe {
            tiles!(rows, (o, i0, js, out, false);
                1 => 12, 2 => 8, 3 => 6, 4 => 5, 5 => 4, 6 => 4, 7 => 3; 8 => 3)
        }
    }
}

/// The exact emulation on AVX2 + FMA: the 16 lanes in two 256-bit registers; a 32-bit lane
/// holding a bf16 pair gives the odd element as `v & 0xFFFF0000` and the even one as `v << 16`
/// (exact), then two fused multiply-adds, odd first (the product is exact, so fusing changes
/// nothing); the tail through a zeroed copy. A step goes in two parts of 16 elements (lanes
/// 0..8, then 8..16), each split into its odd and even f32 elements once, as it is loaded, so a
/// tile splits each `x` row and weight row once per part instead of once per product, and a
/// part's operands stay in the 16 registers beside the accumulators.
pub(super) struct Avx2;

impl Avx2 {
    /// The odd and even elements of the pairs in `v`, as f32.
    #[inline(always)]
    unsafe fn split(v: __m256i) -> (__m256, __m256) {
        // SAFETY: AVX2 per contract.
        unsafe {
            let odd = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
            let even = _mm256_slli_epi32::<16>(v);
            (_mm256_castsi256_ps(odd), _mm256_castsi256_ps(even))
        }
    }
}

impl Lanes for Avx2 {
    /// A part's odd and even elements, as f32.
    type Pairs = [__m256; 2];
    type Acc = [__m256; 2];
    const MR: usize = 2;
    const STREAM_ROWS: usize = 2;
    const PARTS: usize = 2;

    #[inline(always)]
    unsafe fn zero() -> [__m256; 2] {
        // SAFETY: AVX per contract.
        unsafe { [_mm256_setzero_ps(); 2] }
    }
    #[inline(always)]
    unsafe fn zero_pairs() -> [__m256; 2] {
        // SAFETY: AVX per contract.
        unsafe { [_mm256_setzero_ps(); 2] }
    }
    #[inline(always)]
    unsafe fn load(p: *const u16, q: usize) -> [__m256; 2] {
        // SAFETY: 64 readable bytes per contract, of which part q < 2 reads 32; loadu takes
        // any alignment.
        unsafe {
            let (odd, even) = Self::split(_mm256_loadu_si256(p.add(16 * q).cast()));
            [odd, even]
        }
    }
    #[inline(always)]
    unsafe fn load_part(p: *const u16, n: usize, q: usize) -> [__m256; 2] {
        let mut step = [0u16; STEP];
        // SAFETY: n < 32 readable elements at p per contract, into the zeroed step.
        unsafe {
            std::ptr::copy_nonoverlapping(p, step.as_mut_ptr(), n);
            Self::load(step.as_ptr(), q)
        }
    }
    #[inline(always)]
    unsafe fn madd(acc: [__m256; 2], q: usize, x: [__m256; 2], w: [__m256; 2]) -> [__m256; 2] {
        // SAFETY: FMA per contract.
        unsafe {
            let mut acc = acc;
            acc[q] = _mm256_fmadd_ps(x[1], w[1], _mm256_fmadd_ps(x[0], w[0], acc[q]));
            acc
        }
    }
    #[inline(always)]
    unsafe fn fold(acc: [__m256; 2]) -> __m256 {
        // SAFETY: AVX per contract.
        unsafe { _mm256_add_ps(acc[0], acc[1]) }
    }
    #[inline(always)]
    unsafe fn stream(o: Operands<'_>, m: usize, js: Cols, out: &mut ColumnBlock<'_>) {
        // SAFETY: forwarded contract.
        unsafe { tiles!(m, (o, 0, js, out, true); 1 => 4; 2 => 2) }
    }
    #[inline(always)]
    unsafe fn general(
        o: Operands<'_>,
        rows: usize,
        i0: usize,
        js: Cols,
        out: &mut ColumnBlock<'_>,
    ) {
        // SAFETY: forwarded contract (16 registers: 2 × H × P accumulators and the loads).
        unsafe { tiles!(rows, (o, i0, js, out, false); 1 => 3; 2 => 2) }
    }
}

/// Defines `$name`: [`matmul`] on `$lanes` (with the streaming tiles when `$stream`), compiled
/// for the target features `$features`.
macro_rules! bf16_matmul_for {
    ($name:ident, $lanes:ty, $stream:literal, $features:literal) => {
        #[doc = concat!("The bf16-weight matmul on `", stringify!($lanes), "`, compiled for ", $features, ".")]
        ///
        /// # Safety
        /// The CPU must have those features. Lengths are asserted.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name(x: &[u16], w: &[u16], k: usize, out: &mut ColumnBlock<'_>) {
            // SAFETY: forwarded contract.
            unsafe { matmul::<$lanes, $stream>(x, w, k, out) }
        }
    };
}

bf16_matmul_for!(
    matmul_avx512bf16,
    Avx512Bf16,
    true,
    "avx512bf16,avx512bw,avx512f,avx512vl,avx2,fma"
);
bf16_matmul_for!(matmul_avx2, Avx2, true, "avx2,fma");

/// The kernels with the general tiles only, for the tests to compare with the streaming ones.
#[cfg(test)]
mod general {
    use super::{matmul, Avx2, Avx512Bf16, ColumnBlock};

    bf16_matmul_for!(
        matmul_avx512bf16,
        Avx512Bf16,
        false,
        "avx512bf16,avx512bw,avx512f,avx512vl,avx2,fma"
    );
    bf16_matmul_for!(matmul_avx2, Avx2, false, "avx2,fma");
}

/// The rows of `x` rounded to bf16 into padded rows (`bf16dot::round_rows`), compiled for
/// AVX2 so the loop runs eight elements at a time.
///
/// # Safety
/// The CPU must have AVX2. Lengths are asserted.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn round_rows(x: &[f32], k: usize, dst: &mut [u16]) {
    round_rows_portable(x, k, dst);
}

#[cfg(test)]
mod tests {
    use super::super::super::bf16dot::{matmul_portable, padded, round, round_rows};
    use super::super::super::columns::ColumnBlock;
    use kv_pool::rng::SplitMix64;
    use proptest::prelude::*;

    type Kernel = unsafe fn(&[u16], &[u16], usize, &mut ColumnBlock<'_>);

    /// Whether the AVX-512 BF16 kernel can run here; prints why not, and fails instead when
    /// `KVSERVE_REQUIRE_AVX512=1`.
    fn hardware_or_skip() -> bool {
        if super::hardware() {
            return true;
        }
        let why = "the CPU lacks AVX-512 BF16 (or BW, F, VL, AVX2), or KVSERVE_CPU_NO_AVX512=1";
        if std::env::var("KVSERVE_REQUIRE_AVX512").as_deref() == Ok("1") {
            panic!("KVSERVE_REQUIRE_AVX512=1 but {why}");
        }
        eprintln!("skipped: {why}");
        false
    }

    /// Whether the AVX2 emulation can run here; prints why not.
    fn avx2_or_skip() -> bool {
        if super::super::available() {
            return true;
        }
        eprintln!("skipped: the CPU lacks AVX2, FMA or F16C");
        false
    }

    /// `kernel` (or the portable matmul for `None`) over rounded rows `x` and bf16 rows `w`,
    /// its columns cut at `bounds`, as bits.
    fn run(
        kernel: Option<Kernel>,
        x: &[u16],
        w: &[u16],
        k: usize,
        n: usize,
        bounds: &[usize],
    ) -> Vec<u32> {
        let mut out = vec![f32::NAN; x.len() / padded(k) * n];
        for mut b in ColumnBlock::split(&mut out, n, bounds) {
            match kernel {
                // SAFETY: the caller checked the CPU for this kernel.
                Some(kernel) => unsafe { kernel(x, w, k, &mut b) },
                None => matmul_portable(x, w, k, &mut b),
            }
        }
        out.iter().map(|v| v.to_bits()).collect()
    }

    /// A value with a wide exponent range (2⁻⁴⁰ to 2⁴⁰, far from f32's subnormals and overflow
    /// even as products and sums of hundreds) and either sign; every fourth a near-repeat of
    /// the previous one with the other sign, so dot products cancel.
    fn values(rng: &mut SplitMix64, len: usize) -> Vec<f32> {
        let mut v: Vec<f32> = Vec::with_capacity(len);
        for i in 0..len {
            let r = rng.next_u64();
            let mant = 1.0 + (r & 0xFFFF) as f32 / 65536.0;
            let exp = ((r >> 16) % 81) as i32 - 40;
            let sign = if r >> 63 == 1 { -1.0 } else { 1.0 };
            let x = match v.last() {
                Some(&p) if i % 4 == 3 => -p * (1.0 + (r >> 32 & 0xFF) as f32 / 4096.0),
                _ => sign * mant * 2f32.powi(exp),
            };
            v.push(x);
        }
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The AVX-512 BF16 kernel (streaming and general tiles), the AVX2 emulation (both
        /// tiles) and the portable emulation give the same bits, on random shapes (`k` with and
        /// without a tail, rows past every tile height and the streaming limits, columns past
        /// every tile width) and column splits, with cancelling values over a wide exponent
        /// range (no subnormal intermediates: where those arise the hardware flushes them and
        /// the emulations keep them; see `bf16dot`).
        #[test]
        fn bf16_kernels_equal_the_portable_emulation(
            m in 1usize..=19,
            k in 1usize..=300,
            n in 1usize..=40,
            cut in 0usize..=40,
            seed in any::<u64>(),
        ) {
            if !avx2_or_skip() {
                return Ok(());
            }
            let mut rng = SplitMix64::new(seed);
            let xf = values(&mut rng, m * k);
            let mut x = vec![0u16; m * padded(k)];
            round_rows(&xf, k, &mut x);
            let w: Vec<u16> = values(&mut rng, n * k).into_iter().map(round).collect();
            let bounds = if (1..n).contains(&cut) { vec![0, cut, n] } else { vec![0, n] };
            let want = run(None, &x, &w, k, n, &[0, n]);
            let what = format!("{m}x{k}x{n} split {bounds:?}");
            prop_assert!(run(None, &x, &w, k, n, &bounds) == want, "portable {}", what);
            let mut kernels: Vec<(&str, Kernel)> = vec![
                ("AVX2 stream", super::matmul_avx2),
                ("AVX2 general", super::general::matmul_avx2),
            ];
            if hardware_or_skip() {
                kernels.push(("AVX-512 BF16 stream", super::matmul_avx512bf16));
                kernels.push(("AVX-512 BF16 general", super::general::matmul_avx512bf16));
            }
            for (name, kernel) in kernels {
                prop_assert!(run(Some(kernel), &x, &w, k, n, &bounds) == want, "{} {}", name, what);
            }
        }
    }

    /// The SmolLM2 shapes (prefill tiles and decode rows) through every kernel, bitwise.
    #[test]
    fn model_shapes_give_the_same_bits_on_every_kernel() {
        if !avx2_or_skip() {
            return;
        }
        let mut rng = SplitMix64::new(31);
        for (m, k, n) in [(1, 576, 192), (4, 576, 64), (37, 1536, 50), (16, 576, 31)] {
            let xf = values(&mut rng, m * k);
            let mut x = vec![0u16; m * padded(k)];
            round_rows(&xf, k, &mut x);
            let w: Vec<u16> = values(&mut rng, n * k).into_iter().map(round).collect();
            let want = run(None, &x, &w, k, n, &[0, n]);
            assert!(run(Some(super::matmul_avx2), &x, &w, k, n, &[0, n]) == want);
            if hardware_or_skip() {
                let got = run(Some(super::matmul_avx512bf16), &x, &w, k, n, &[0, n]);
                assert!(got == want, "{m}x{k}x{n}");
            }
        }
    }
}
