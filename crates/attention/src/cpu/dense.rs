//! Dense ops of the CPU backend, on contiguous f32 slices. Every op computes each output row
//! from its own input row in a fixed order, so results do not depend on the batch.

use super::primitives::dot;

/// `dst[m, n] = x[m, k] · w[n, k]ᵀ`. Lengths are checked by the caller.
///
/// Batch-invariant: every output element is one dot product of an `x` row and a `w` row in a
/// fixed order, so a row's result is bitwise the same whatever `m` and wherever the row sits in
/// `x` (greedy decoding must not depend on the batch). The `gemm` crate used before did not
/// give that (its `m = 1` path sums in another order than its tiled path), so the kernel is our
/// own: AVX2 + FMA tiles of 4 `x` rows × 3 `w` rows over cache blocks of `w` where the CPU has
/// them, else the portable 8-lane [`dot`].
pub(crate) fn matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, dst: &mut [f32]) {
    assert!(x.len() == m * k && w.len() == n * k && dst.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        dst.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked); lengths are asserted inside.
        unsafe { super::simd::matmul(x, w, m, k, n, dst) };
        return;
    }
    matmul_portable(x, w, k, n, dst);
}

/// The portable matmul: one [`dot`] per output element.
pub(crate) fn matmul_portable(x: &[f32], w: &[f32], k: usize, n: usize, dst: &mut [f32]) {
    for (xr, out) in x.chunks_exact(k).zip(dst.chunks_exact_mut(n)) {
        for (o, wr) in out.iter_mut().zip(w.chunks_exact(k)) {
            *o = dot(xr, wr);
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

/// `silu(gate) · up` for rows `[gate(d), up(d)]`.
pub(crate) fn silu_mul(x: &[f32], d: usize, dst: &mut [f32]) {
    for (row, out) in x.chunks_exact(2 * d).zip(dst.chunks_exact_mut(d)) {
        let (gate, up) = row.split_at(d);
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
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
        for (m, k, n) in [(1, 8, 1), (5, 37, 9), (9, 300, 130), (4, 7, 3)] {
            let x = nonzero_vec(&mut rng, m * k);
            let w = nonzero_vec(&mut rng, n * k);
            let mut out = vec![0.0; m * n];
            matmul(&x, &w, m, k, n, &mut out);
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

    /// The portable matmul is row-invariant too.
    #[test]
    fn portable_matmul_rows_do_not_depend_on_m() {
        let mut rng = SplitMix64::new(5);
        let (k, n) = (100, 20);
        let w = nonzero_vec(&mut rng, n * k);
        let x = nonzero_vec(&mut rng, 9 * k);
        let mut full = vec![0.0; 9 * n];
        matmul_portable(&x, &w, k, n, &mut full);
        let mut one = vec![0.0; n];
        matmul_portable(&x[4 * k..5 * k], &w, k, n, &mut one);
        assert!(one[..] == full[4 * n..5 * n]);
    }

    /// A row's result must not depend on how many other rows share the call (batch-invariant
    /// greedy decoding needs it): row 0 alone, among 7 rows and among 64 rows, and the last row
    /// of each batch alone, are bitwise the same.
    #[test]
    fn matmul_rows_do_not_depend_on_m() {
        let mut rng = SplitMix64::new(3);
        for (k, n) in [(64, 48), (256, 320), (1000, 77), (4096, 64)] {
            let w = nonzero_vec(&mut rng, n * k);
            let xs = nonzero_vec(&mut rng, 64 * k);
            let mut full = vec![0.0; 64 * n];
            matmul(&xs, &w, 64, k, n, &mut full);
            for m in [1usize, 2, 3, 7, 16, 33, 64] {
                let mut out = vec![0.0; m * n];
                matmul(&xs[..m * k], &w, m, k, n, &mut out);
                assert!(out[..] == full[..m * n], "k {k} n {n}: rows 0..{m} differ");
                // The same rows starting elsewhere in the batch.
                let off = 64 - m;
                matmul(&xs[off * k..], &w, m, k, n, &mut out);
                assert!(
                    out[..] == full[off * n..],
                    "k {k} n {n}: rows {off}.. differ"
                );
            }
        }
    }
}
