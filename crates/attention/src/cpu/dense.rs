//! Dense ops of the CPU backend, on contiguous f32 slices. Every op computes each output row
//! from its own input row in a fixed order, so results do not depend on the batch.

use super::bf16dot;
use super::buffers;
use super::columns::ColumnBlock;
use super::pool::Pool;
use super::primitives::{dot, silu};

/// Multiply-adds below which a matmul job is not worth a worker: smaller matmuls run on the
/// calling thread, and larger ones get at most one job per this much work.
const MIN_JOB_WORK: usize = 1 << 17;

/// Jobs per thread of a large matmul: the threads claim them as they come free, so a thread
/// that starts late (a worker waking up) or runs slower takes fewer.
const JOBS_PER_THREAD: usize = 4;

/// Elements below which an element-wise op runs on the calling thread.
const MIN_ELEMWISE: usize = 1 << 15;

/// The rows of a matmul's weight `w[n, k]`: f32, or 16-bit bit patterns kept in the
/// checkpoint's type (f16 widened exactly as it is read; bf16 multiplied with bf16-rounded
/// activations, `bf16dot`).
#[derive(Clone, Copy)]
pub(crate) enum Weights<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

impl Weights<'_> {
    /// Element `i`, as f32 (exact).
    pub(crate) fn get(&self, i: usize) -> f32 {
        match self {
            Weights::F32(w) => w[i],
            Weights::F16(w) => half::f16::from_bits(w[i]).to_f32(),
            Weights::Bf16(w) => half::bf16::from_bits(w[i]).to_f32(),
        }
    }

    /// Elements `range` (a block of whole rows: one expert's matrix of stacked weights).
    pub(crate) fn slice(&self, range: std::ops::Range<usize>) -> Self {
        match self {
            Weights::F32(w) => Weights::F32(&w[range]),
            Weights::F16(w) => Weights::F16(&w[range]),
            Weights::Bf16(w) => Weights::Bf16(&w[range]),
        }
    }

    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::F16(w) | Weights::Bf16(w) => w.len(),
        }
    }
}

/// `dst[m, n] = x[m, k] · w[n, k]ᵀ`, its columns split over `pool`. Lengths are checked by the
/// caller.
///
/// Batch- and thread-invariant: every output element is one dot product of an `x` row and a
/// `w` row in a fixed order, so a row's result is bitwise the same whatever `m`, wherever the
/// row sits in `x`, and whichever job computes its column (greedy decoding must not depend on
/// the batch or the thread count). The `gemm` crate used before did not give that (its `m = 1`
/// path sums in another order than its tiled path), so the kernel is our own: AVX2 + FMA tiles
/// of 4 `x` rows × 3 `w` rows over cache blocks of `w` where the CPU has them, else the
/// portable 8-lane [`dot`]. The pool's jobs own contiguous blocks of output columns (rows of
/// `w`), a few per thread ([`column_bounds`]); each runs that kernel on its block. An f16 `w`
/// gives bitwise what its f32 expansion gives. A bf16 `w` takes `x` rounded to bf16, once per
/// call before the jobs start (by rows over the pool), and the dot product of `bf16dot` (`vdpbf16ps` arithmetic),
/// whose kernels all give the same bits, so the invariances hold for it too.
pub(crate) fn matmul(
    pool: &Pool,
    x: &[f32],
    w: Weights<'_>,
    m: usize,
    k: usize,
    n: usize,
    dst: &mut [f32],
) {
    matmul_many(pool, x, m, k, vec![(w, n, dst)]);
}

/// [`matmul`] of `x[m, k]` by several weights at once, `parts` = `(w[n, k], n, dst[m, n])`
/// each: one pool dispatch over the union of their output columns (the fused QKV projection),
/// each element computed exactly as [`matmul`] computes it, so the bits are the same.
pub(crate) fn matmul_many(
    pool: &Pool,
    x: &[f32],
    m: usize,
    k: usize,
    parts: Vec<(Weights<'_>, usize, &mut [f32])>,
) {
    assert!(x.len() == m * k);
    let parts = parts
        .into_iter()
        .map(|(w, n, dst)| (0, w, n, dst))
        .collect();
    matmul_parts(pool, x, m, k, parts);
}

/// Matmuls of `m` rows of `x` each (`x` holds whole rows of `k`), `parts` =
/// `(first row, w[n, k], n, dst[m, n])`: part `i` multiplies rows `first .. first + m` of `x`
/// by its weight. One pool dispatch over the union of the parts' output columns, each element
/// computed exactly as [`matmul`] computes it (for a bf16 weight, over `x` rounded once for
/// every part). [`matmul_many`] is every part from row 0; a per-head matmul (`bmm`) gives each
/// head its own rows.
pub(crate) fn matmul_parts(
    pool: &Pool,
    x: &[f32],
    m: usize,
    k: usize,
    parts: Vec<(usize, Weights<'_>, usize, &mut [f32])>,
) {
    let total: usize = parts.iter().map(|(_, _, n, _)| n).sum();
    assert!(k == 0 || x.len() % k == 0);
    let mut jobs = Vec::new();
    let mut bounds = column_bounds(pool.threads(), m * k, total.max(1)).into_iter();
    let mut next = bounds.next();
    let mut off = 0;
    for (first, w, n, dst) in parts {
        assert!(w.len() == n * k && dst.len() == m * n && (first + m) * k <= x.len());
        if m == 0 || n == 0 {
            continue;
        }
        if k == 0 {
            dst.fill(0.0);
            continue;
        }
        // This part's columns cut where the union's blocks are cut.
        let mut local = vec![0];
        while let Some(b) = next.filter(|&b| b < off + n) {
            if b > off {
                local.push(b - off);
            }
            next = bounds.next();
        }
        local.push(n);
        off += n;
        jobs.extend(
            ColumnBlock::split(dst, n, &local)
                .into_iter()
                .map(|b| (first, w, b)),
        );
    }
    // Bf16 weights take the activations rounded to bf16, once for every job (`bf16dot`), in
    // a recycled buffer (`buffers`; two bf16 per f32 element), split by rows over the pool.
    let rows = x.len().checked_div(k).unwrap_or(0);
    let rounded = jobs
        .iter()
        .any(|(_, w, _)| matches!(w, Weights::Bf16(_)))
        .then(|| {
            let len = rows * bf16dot::padded(k);
            let mut buf = buffers::take(len.div_ceil(2));
            let dst = &mut bytemuck::cast_slice_mut(&mut buf)[..len];
            // By rows over the pool (each row is rounded alone: the split changes nothing).
            let per = rows_per_job(pool, x.len(), k);
            let items: Vec<(&[f32], &mut [u16])> = x
                .chunks(per * k)
                .zip(dst.chunks_mut(per * bf16dot::padded(k)))
                .collect();
            pool.for_each(items, |(x, dst)| round_activations(x, k, dst));
            (buf, len)
        });
    let xb: &[u16] = rounded
        .as_ref()
        .map_or(&[], |(buf, len)| &bytemuck::cast_slice(buf)[..*len]);
    let padded = bf16dot::padded(k);
    pool.for_each(jobs, |(first, w, mut out)| {
        let xs = &x[first * k..(first + m) * k];
        let xbs = xb.get(first * padded..(first + m) * padded).unwrap_or(&[]);
        matmul_block(xs, xbs, w, k, &mut out)
    });
    if let Some((buf, _)) = rounded {
        buffers::give(buf);
    }
}

/// Column bounds `0 = b_0 < … = n` of a matmul's jobs for `row_work = m · k` multiply-adds per
/// output column: [`JOBS_PER_THREAD`] blocks per thread, fewer when a block would be under
/// [`MIN_JOB_WORK`], each a multiple of 3 columns (the AVX2 tile) but the last.
pub(crate) fn column_bounds(threads: usize, row_work: usize, n: usize) -> Vec<usize> {
    if threads == 1 {
        return vec![0, n];
    }
    let jobs = (threads * JOBS_PER_THREAD)
        .min(row_work.saturating_mul(n) / MIN_JOB_WORK)
        .min(n.div_ceil(3))
        .max(1);
    let per = n.div_ceil(jobs).div_ceil(3) * 3;
    let mut bounds: Vec<usize> = (0..n).step_by(per).collect();
    bounds.push(n);
    bounds
}

/// One job of [`matmul`]: the columns of `out` (all rows of `x`; for a bf16 weight, of `xb`,
/// `x` rounded by `bf16dot::round_rows`).
fn matmul_block(x: &[f32], xb: &[u16], w: Weights<'_>, k: usize, out: &mut ColumnBlock<'_>) {
    let (bytes, f16): (&[u8], bool) = match w {
        Weights::Bf16(w) => return bf16_block(xb, w, k, out),
        Weights::F32(w) => (bytemuck::cast_slice(w), false),
        Weights::F16(w) => (bytemuck::cast_slice(w), true),
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, f16);
    #[cfg(target_arch = "x86_64")]
    if super::simd::avx512::available() {
        use super::simd::avx512;
        // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked); lengths are asserted
        // inside.
        unsafe {
            if f16 {
                avx512::matmul_f16(x, bytes, k, out)
            } else {
                avx512::matmul_f32(x, bytes, k, out)
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        use super::simd;
        // SAFETY: the CPU has AVX2, FMA and F16C (checked); lengths are asserted inside.
        unsafe {
            if f16 {
                simd::matmul_f16(x, bytes, k, out)
            } else {
                simd::matmul_f32(x, bytes, k, out)
            }
        }
        return;
    }
    matmul_portable(x, w, k, out);
}

/// The rows of `x` rounded to bf16 for a bf16 weight (`bf16dot::round_rows`), on AVX2 where
/// the CPU has it (the same bits).
fn round_activations(x: &[f32], k: usize, dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        // SAFETY: the CPU has AVX2 (checked); lengths are asserted inside.
        unsafe { super::simd::bf16dot::round_rows(x, k, dst) };
        return;
    }
    bf16dot::round_rows(x, k, dst);
}

/// One job of a bf16-weight matmul: the columns of `out` (all rows of `x`, rounded rows of
/// `bf16dot::padded(k)`), on the best kernel the CPU has: every kernel gives the same bits.
fn bf16_block(x: &[u16], w: &[u16], k: usize, out: &mut ColumnBlock<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::bf16dot;
        if bf16dot::hardware() {
            // SAFETY: the CPU has AVX-512 BF16, BW, F and VL, AVX2 and FMA (checked); lengths
            // are asserted inside.
            unsafe { bf16dot::matmul_avx512bf16(x, w, k, out) };
            return;
        }
        if super::simd::available() {
            // SAFETY: the CPU has AVX2 and FMA (checked); lengths are asserted inside.
            unsafe { bf16dot::matmul_avx2(x, w, k, out) };
            return;
        }
    }
    bf16dot::matmul_portable(x, w, k, out);
}

/// The portable matmul: one [`dot`] per output element of `out`'s columns (16-bit rows are
/// widened into a scratch row first).
pub(crate) fn matmul_portable(x: &[f32], w: Weights<'_>, k: usize, out: &mut ColumnBlock<'_>) {
    let mut row = vec![0.0f32; k];
    for j in out.cols() {
        let wr = match w {
            Weights::F32(w) => &w[j * k..][..k],
            _ => {
                row.iter_mut()
                    .enumerate()
                    .for_each(|(e, r)| *r = w.get(j * k + e));
                &row[..]
            }
        };
        for (i, xr) in x.chunks_exact(k).enumerate() {
            out.set(i, j, dot(xr, wr));
        }
    }
}

/// Sum of squares in a fixed order: eight lanes over the row, then the lanes and the tail.
fn sum_squares(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            lanes[i] += c[i] * c[i];
        }
    }
    let mut s = lanes.iter().sum::<f32>();
    for &v in chunks.remainder() {
        s += v * v;
    }
    s
}

/// Jobs of at least [`MIN_ELEMWISE`] elements each (at most one per thread) for a row-wise op
/// over `len` elements in rows of `d`: rows per job.
pub(crate) fn rows_per_job(pool: &Pool, len: usize, d: usize) -> usize {
    let jobs = pool.threads().min(len / MIN_ELEMWISE).max(1);
    (len / d.max(1)).div_ceil(jobs).max(1)
}

/// [`rms_norm`] split by rows over `pool` when large (each row is computed alone, so the
/// split changes nothing).
pub(crate) fn rms_norm_rows(pool: &Pool, x: &[f32], weight: &[f32], eps: f32, dst: &mut [f32]) {
    let per = rows_per_job(pool, dst.len(), weight.len()) * weight.len();
    let items: Vec<(&[f32], &mut [f32])> = x.chunks(per).zip(dst.chunks_mut(per)).collect();
    pool.for_each(items, |(x, dst)| rms_norm(x, weight, eps, dst));
}

/// `x += y` element-wise, split over `pool` when large.
pub(crate) fn add_assign(pool: &Pool, x: &mut [f32], y: &[f32]) {
    let per = rows_per_job(pool, x.len(), 1);
    let items: Vec<(&mut [f32], &[f32])> = x.chunks_mut(per).zip(y.chunks(per)).collect();
    pool.for_each(items, |(x, y)| {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b)
    });
}

/// RMSNorm of each `d`-row of `x` into `dst`.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, dst: &mut [f32]) {
    let d = weight.len();
    for (row, out) in x.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
        let inv = 1.0 / (sum_squares(row) / d as f32 + eps).sqrt();
        for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// `silu(gate) · up` for rows `[gate(d), up(d)]`, split by rows over `pool` when large (each
/// element is computed alone, so the split changes nothing).
pub(crate) fn silu_mul_rows(pool: &Pool, x: &[f32], d: usize, dst: &mut [f32]) {
    let per = rows_per_job(pool, dst.len(), d);
    let items: Vec<(&[f32], &mut [f32])> =
        x.chunks(per * 2 * d).zip(dst.chunks_mut(per * d)).collect();
    pool.for_each(items, |(x, dst)| silu_mul(x, d, dst));
}

/// `silu(gate) · up` for rows `[gate(d), up(d)]`, each element through [`silu`]: eight lanes
/// at a time where the CPU has AVX2 and FMA (bitwise `silu::<true>`), else the scalar
/// `silu::<false>`.
pub(crate) fn silu_mul(x: &[f32], d: usize, dst: &mut [f32]) {
    for (row, out) in x.chunks_exact(2 * d).zip(dst.chunks_exact_mut(d)) {
        let (gate, up) = row.split_at(d);
        #[cfg(target_arch = "x86_64")]
        if super::simd::available() {
            // SAFETY: the CPU has AVX2 and FMA (checked); the rows have `d` elements each.
            unsafe { super::simd::silu_mul_row(gate, up, out) };
            continue;
        }
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu::<false>(g) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::nonzero_vec;
    use kv_pool::rng::SplitMix64;

    /// The AVX2 matmul computes every element as the portable fused dot product does, bitwise.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_matmul_equals_fused_dot() {
        use super::super::primitives::dot_with;
        if !super::super::simd::available() {
            return;
        }
        let mut rng = SplitMix64::new(4);
        // One and two rows take the streaming tiles (odd column counts: a last single row).
        for (m, k, n) in [
            (1, 8, 1),
            (1, 576, 13),
            (2, 100, 11),
            (5, 37, 9),
            (9, 300, 130),
            (4, 7, 3),
        ] {
            let x = nonzero_vec(&mut rng, m * k);
            let w = nonzero_vec(&mut rng, n * k);
            let mut out = vec![0.0; m * n];
            matmul(&Pool::default(), &x, Weights::F32(&w), m, k, n, &mut out);
            for i in 0..m {
                for j in 0..n {
                    let want = dot_with::<true>(&x[i * k..][..k], &w[j * k..][..k]);
                    assert_eq!(
                        out[i * n + j].to_bits(),
                        want.to_bits(),
                        "{m}x{k}x{n} ({i}, {j})"
                    );
                }
            }
        }
    }

    /// The portable matmul over `x`'s rows and `w`'s rows, in blocks of columns at `bounds`.
    fn portable(x: &[f32], w: Weights<'_>, k: usize, n: usize, bounds: &[usize]) -> Vec<f32> {
        let mut out = vec![0.0; x.len() / k * n];
        for mut b in ColumnBlock::split(&mut out, n, bounds) {
            matmul_portable(x, w, k, &mut b);
        }
        out
    }

    /// The portable matmul is row-invariant too, and does not depend on the column blocks.
    #[test]
    fn portable_matmul_rows_do_not_depend_on_m() {
        let mut rng = SplitMix64::new(5);
        let (k, n) = (100, 20);
        let w = nonzero_vec(&mut rng, n * k);
        let x = nonzero_vec(&mut rng, 9 * k);
        let w = Weights::F32(&w);
        let full = portable(&x, w, k, n, &[0, n]);
        let one = portable(&x[4 * k..5 * k], w, k, n, &[0, n]);
        assert!(one[..] == full[4 * n..5 * n]);
        assert!(portable(&x, w, k, n, &[0, 1, 7, 19, n]) == full);
    }

    /// The column blocks of a matmul: all of `0..n`, at most `JOBS_PER_THREAD` per thread, a
    /// multiple of 3 columns each but the last, none under the minimum work unless it is the
    /// only one; one thread takes everything in one block.
    #[test]
    fn column_bounds_split_by_work_and_workers() {
        for threads in 1..=4 {
            for row_work in [1, 10, 576, 1536, 512 * 576, MIN_JOB_WORK] {
                for n in [1, 2, 3, 4, 7, 100, 192, 576, 3072, 49_152] {
                    let b = column_bounds(threads, row_work, n);
                    let what = format!("{threads} threads, {row_work} x {n}: {b:?}");
                    assert!(b[0] == 0 && b[b.len() - 1] == n, "{what}");
                    let jobs = b.len() - 1;
                    assert!(jobs <= threads * JOBS_PER_THREAD, "{what}");
                    assert!(threads > 1 || jobs == 1, "{what}");
                    for w in b.windows(2) {
                        assert!(w[0] < w[1], "{what}");
                        assert!(w[1] == n || (w[1] - w[0]) % 3 == 0, "{what}");
                        assert!(jobs == 1 || (w[1] - w[0]) * row_work >= MIN_JOB_WORK / 2);
                    }
                }
            }
        }
        assert_eq!(
            column_bounds(2, MIN_JOB_WORK, 48),
            [0, 6, 12, 18, 24, 30, 36, 42, 48]
        );
        assert_eq!(column_bounds(4, 10, 100), [0, 100]);
    }

    /// However a matmul's columns are cut into jobs (down to one column each, with the tiles
    /// of 3 straddling the cuts), every element is bitwise the same.
    #[test]
    fn any_column_split_gives_the_same_bits() {
        let mut rng = SplitMix64::new(7);
        for (m, k, n) in [(1, 37, 8), (5, 64, 8), (6, 300, 13)] {
            let x = nonzero_vec(&mut rng, m * k);
            let w = nonzero_vec(&mut rng, n * k);
            let whole = |bounds: &[usize]| {
                let mut out = vec![0.0; m * n];
                for mut b in ColumnBlock::split(&mut out, n, bounds) {
                    matmul_block(&x, &[], Weights::F32(&w), k, &mut b);
                }
                out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            let want = whole(&[0, n]);
            let every: Vec<usize> = (0..=n).collect();
            for bounds in [&[0, 1, n][..], &[0, 2, 5, n], &[0, 4, n - 1, n], &every] {
                assert!(whole(bounds) == want, "{m}x{k}x{n} split at {bounds:?}");
            }
        }
    }

    /// An f16 weight gives bitwise what its f32 expansion gives, on every path (AVX2 and
    /// portable) and thread count.
    #[test]
    fn f16_weights_equal_their_f32_expansion() {
        let mut rng = SplitMix64::new(9);
        for (m, k, n) in [(1, 37, 8), (5, 576, 31), (16, 300, 200)] {
            let x = nonzero_vec(&mut rng, m * k);
            let w = nonzero_vec(&mut rng, n * k);
            let hf: Vec<u16> = w
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            let wide: Vec<f32> = hf
                .iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect();
            let mut want = vec![0.0; m * n];
            matmul(
                &Pool::default(),
                &x,
                Weights::F32(&wide),
                m,
                k,
                n,
                &mut want,
            );
            for t in 1..=3 {
                let mut got = vec![0.0; m * n];
                matmul(
                    &Pool::new(t).unwrap(),
                    &x,
                    Weights::F16(&hf),
                    m,
                    k,
                    n,
                    &mut got,
                );
                assert!(got == want, "{m}x{k}x{n}, {t} threads");
            }
            let p = portable(&x, Weights::F16(&hf), k, n, &[0, n]);
            assert!(
                p == portable(&x, Weights::F32(&wide), k, n, &[0, n]),
                "{m}x{k}x{n}"
            );
        }
    }

    /// A bf16 weight gives bitwise the bf16-activation reference (`x` rounded to bf16, the
    /// scalar `bf16dot::dot`), on 1, 2 and 3 threads, on every row of every batch size; and
    /// that reference is the f64 dot product of the rounded values within its rounding bound.
    #[test]
    fn bf16_weights_equal_the_bf16_activation_reference() {
        let mut rng = SplitMix64::new(9);
        for (m, k, n) in [(1, 37, 8), (5, 576, 31), (16, 300, 200), (3, 1536, 7)] {
            let x = nonzero_vec(&mut rng, m * k);
            let w: Vec<u16> = nonzero_vec(&mut rng, n * k)
                .iter()
                .map(|&v| bf16dot::round(v))
                .collect();
            let kp = bf16dot::padded(k);
            let mut want = vec![0.0f32; m * n];
            for i in 0..m {
                let xb: Vec<u16> = (0..kp)
                    .map(|e| {
                        if e < k {
                            bf16dot::round(x[i * k + e])
                        } else {
                            0
                        }
                    })
                    .collect();
                for j in 0..n {
                    let wr = &w[j * k..][..k];
                    want[i * n + j] = bf16dot::dot(&xb, wr);
                    let (mut exact, mut abs) = (0.0f64, 0.0f64);
                    for (&a, &b) in xb.iter().zip(wr) {
                        let p = f64::from(bf16dot::widen(a)) * f64::from(bf16dot::widen(b));
                        exact += p;
                        abs += p.abs();
                    }
                    let bound = abs * (k + 16) as f64 * f64::from(f32::EPSILON) / 2.0;
                    let err = (f64::from(want[i * n + j]) - exact).abs();
                    assert!(err <= bound, "{m}x{k}x{n} ({i}, {j}): {err} > {bound}");
                }
            }
            for t in 1..=3 {
                let mut got = vec![f32::NAN; m * n];
                matmul(
                    &Pool::new(t).unwrap(),
                    &x,
                    Weights::Bf16(&w),
                    m,
                    k,
                    n,
                    &mut got,
                );
                assert!(got == want, "{m}x{k}x{n}, {t} threads");
                // Every row alone gives its bits in the batch.
                for i in 0..m {
                    let mut one = vec![f32::NAN; n];
                    let xr = &x[i * k..][..k];
                    matmul(
                        &Pool::new(t).unwrap(),
                        xr,
                        Weights::Bf16(&w),
                        1,
                        k,
                        n,
                        &mut one,
                    );
                    assert!(
                        one[..] == want[i * n..][..n],
                        "{m}x{k}x{n} row {i}, {t} threads"
                    );
                }
            }
        }
    }

    /// The AVX2 `silu_mul` is bitwise the scalar `silu::<true>` on every element: odd row
    /// lengths (the scalar tail), ±0, values around 0, large magnitudes and below −87.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_silu_mul_equals_scalar() {
        if !super::super::simd::available() {
            eprintln!("skipped: this CPU has no AVX2/FMA");
            return;
        }
        let mut rng = SplitMix64::new(9);
        let special = [
            0.0, -0.0, 1e-30, -1e-30, 3.5, -3.5, 20.0, -20.0, 86.9, -86.9, -87.5, 100.0,
        ];
        for d in [1, 7, 8, 13, 64, 1536] {
            let m = 3;
            let mut x = nonzero_vec(&mut rng, m * 2 * d);
            for (i, v) in x.iter_mut().enumerate() {
                // Gate elements spread over [-24, 24], some replaced by special values.
                *v *= 8.0;
                if i % 5 == 0 {
                    *v = special[i / 5 % special.len()];
                }
            }
            let mut got = vec![0.0; m * d];
            silu_mul(&x, d, &mut got);
            let want: Vec<f32> = x
                .chunks_exact(2 * d)
                .flat_map(|r| {
                    let (g, u) = r.split_at(d);
                    g.iter()
                        .zip(u)
                        .map(|(&g, &u)| silu::<true>(g) * u)
                        .collect::<Vec<_>>()
                })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "d = {d}");
        }
    }

    /// `silu_mul` split by rows over 1, 2 and 3 threads gives the same bits.
    #[test]
    fn silu_mul_does_not_depend_on_threads() {
        let mut rng = SplitMix64::new(8);
        let (m, d) = (37, 1536);
        let x = nonzero_vec(&mut rng, m * 2 * d);
        let mut want = vec![0.0; m * d];
        silu_mul(&x, d, &mut want);
        for t in 1..=3 {
            let mut got = vec![0.0; m * d];
            silu_mul_rows(&Pool::new(t).unwrap(), &x, d, &mut got);
            assert!(got == want, "{t} threads");
        }
    }

    /// `rms_norm` and `add_assign` split by rows over 1, 2 and 3 threads give the same bits.
    #[test]
    fn rms_norm_and_add_do_not_depend_on_threads() {
        let mut rng = SplitMix64::new(9);
        let (m, d) = (71, 576);
        let x = nonzero_vec(&mut rng, m * d);
        let y = nonzero_vec(&mut rng, m * d);
        let w = nonzero_vec(&mut rng, d);
        let mut want = vec![0.0; m * d];
        rms_norm(&x, &w, 1e-5, &mut want);
        let mut sum = x.clone();
        sum.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        for t in 1..=3 {
            let pool = Pool::new(t).unwrap();
            let mut got = vec![0.0; m * d];
            rms_norm_rows(&pool, &x, &w, 1e-5, &mut got);
            assert!(got == want, "rms_norm, {t} threads");
            let mut got = x.clone();
            add_assign(&pool, &mut got, &y);
            assert!(got == sum, "add, {t} threads");
        }
    }

    /// `matmul_many` gives each weight's `matmul` bitwise, for 1, 2 and 3 threads, with
    /// column counts that cut the union's blocks inside and across the weights (the QKV
    /// shapes of SmolLM2, odd ones, an empty weight, 16-bit weights).
    /// Each weight's values as bf16 bits (round to nearest even).
    fn bf16_bits(ws: &[Vec<f32>]) -> Vec<Vec<u16>> {
        ws.iter()
            .map(|w| {
                w.iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn matmul_parts_equal_one_matmul_per_part_on_its_own_rows() {
        // Parts over rows 4.., 0.. and 2.. of a 7-row x: each bitwise its own matmul.
        let mut rng = SplitMix64::new(11);
        let (rows, m, k) = (7, 3, 67);
        let x = nonzero_vec(&mut rng, rows * k);
        let parts_at = [(4, 33), (0, 5), (2, 40)];
        let ws: Vec<Vec<f32>> = parts_at
            .iter()
            .map(|&(_, n)| nonzero_vec(&mut rng, n * k))
            .collect();
        let bf = bf16_bits(&ws);
        for t in 1..=3 {
            let pool = Pool::new(t).unwrap();
            for half in [false, true] {
                let weight = |i: usize| {
                    if half {
                        Weights::Bf16(&bf[i])
                    } else {
                        Weights::F32(&ws[i])
                    }
                };
                let mut got: Vec<Vec<f32>> = parts_at
                    .iter()
                    .map(|&(_, n)| vec![f32::NAN; m * n])
                    .collect();
                let parts = parts_at
                    .iter()
                    .zip(&mut got)
                    .enumerate()
                    .map(|(i, (&(first, n), out))| (first, weight(i), n, &mut out[..]))
                    .collect();
                matmul_parts(&pool, &x, m, k, parts);
                for (i, &(first, n)) in parts_at.iter().enumerate() {
                    let mut want = vec![0.0; m * n];
                    let xs = &x[first * k..(first + m) * k];
                    matmul(&Pool::default(), xs, weight(i), m, k, n, &mut want);
                    let same = got[i]
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "part {i}, {t} threads, bf16 {half}");
                }
            }
        }
    }

    #[test]
    fn matmul_many_equals_one_matmul_per_weight() {
        let mut rng = SplitMix64::new(10);
        for (m, k, ns) in [
            (1, 576, vec![576, 192, 192]),
            (3, 64, vec![5, 0, 7, 1]),
            (9, 300, vec![131, 64]),
            (1, 8, vec![1]),
        ] {
            let x = nonzero_vec(&mut rng, m * k);
            let ws: Vec<Vec<f32>> = ns.iter().map(|&n| nonzero_vec(&mut rng, n * k)).collect();
            let bf = bf16_bits(&ws);
            for t in 1..=3 {
                let pool = Pool::new(t).unwrap();
                for half in [false, true] {
                    let weights: Vec<Weights<'_>> = if half {
                        bf.iter().map(|w| Weights::Bf16(w)).collect()
                    } else {
                        ws.iter().map(|w| Weights::F32(w)).collect()
                    };
                    let want: Vec<Vec<f32>> = weights
                        .iter()
                        .zip(&ns)
                        .map(|(&w, &n)| {
                            let mut out = vec![0.0; m * n];
                            matmul(&Pool::default(), &x, w, m, k, n, &mut out);
                            out
                        })
                        .collect();
                    let mut got: Vec<Vec<f32>> =
                        ns.iter().map(|&n| vec![f32::NAN; m * n]).collect();
                    let parts = weights
                        .iter()
                        .zip(&ns)
                        .zip(&mut got)
                        .map(|((&w, &n), out)| (w, n, &mut out[..]))
                        .collect();
                    matmul_many(&pool, &x, m, k, parts);
                    for (g, w) in got.iter().zip(&want) {
                        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{m}x{k} by {ns:?}, {t} threads, 16-bit {half}");
                    }
                }
            }
        }
    }

    /// A matmul's output is bitwise the same for 1, 2 and 3 workers, on odd shapes and on fewer
    /// columns than workers.
    #[test]
    fn matmul_does_not_depend_on_threads() {
        let pools: Vec<Pool> = (1..=3).map(|t| Pool::new(t).unwrap()).collect();
        let mut rng = SplitMix64::new(6);
        for (m, k, n) in [
            (1, 64, 1),
            (1, 64, 2),
            (3, 33, 5),
            (7, 300, 131),
            (64, 256, 999),
        ] {
            let x = nonzero_vec(&mut rng, m * k);
            let w = nonzero_vec(&mut rng, n * k);
            let outs: Vec<Vec<f32>> = pools
                .iter()
                .map(|p| {
                    let mut out = vec![0.0; m * n];
                    matmul(p, &x, Weights::F32(&w), m, k, n, &mut out);
                    out
                })
                .collect();
            for (t, out) in outs.iter().enumerate() {
                let same = out
                    .iter()
                    .zip(&outs[0])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{m}x{k}x{n}: {} threads differ from 1", t + 1);
            }
        }
    }

    /// A row's result must not depend on how many other rows share the call (batch-invariant
    /// greedy decoding needs it): row 0 alone, among 7 rows and among 64 rows, and the last row
    /// of each batch alone, are bitwise the same.
    #[test]
    fn matmul_rows_do_not_depend_on_m() {
        let mut rng = SplitMix64::new(3);
        let pool = Pool::new(2).unwrap();
        for (k, n) in [(64, 48), (256, 320), (1000, 77), (4096, 64)] {
            let w = nonzero_vec(&mut rng, n * k);
            let xs = nonzero_vec(&mut rng, 64 * k);
            let mut full = vec![0.0; 64 * n];
            matmul(&pool, &xs, Weights::F32(&w), 64, k, n, &mut full);
            for m in [1usize, 2, 3, 7, 16, 33, 64] {
                let mut out = vec![0.0; m * n];
                matmul(&pool, &xs[..m * k], Weights::F32(&w), m, k, n, &mut out);
                assert!(out[..] == full[..m * n], "k {k} n {n}: rows 0..{m} differ");
                // The same rows starting elsewhere in the batch.
                let off = 64 - m;
                matmul(&pool, &xs[off * k..], Weights::F32(&w), m, k, n, &mut out);
                assert!(
                    out[..] == full[off * n..],
                    "k {k} n {n}: rows {off}.. differ"
                );
            }
        }
    }
}
