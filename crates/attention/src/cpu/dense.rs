//! Dense ops of the CPU backend, on contiguous f32 slices. Every op computes each output row
//! from its own input row in a fixed order, so results do not depend on the batch.

use gemm::Parallelism;

/// `dst[m, n] = x[m, k] · w[n, k]ᵀ`. Lengths are checked by the caller.
pub(crate) fn matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, dst: &mut [f32]) {
    assert!(x.len() == m * k && w.len() == n * k && dst.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        dst.fill(0.0);
        return;
    }
    // SAFETY: the assert above guarantees every index gemm touches is in bounds: dst is row-major
    // [m, n] (column stride 1, row stride n), lhs is x row-major [m, k] (column stride 1, row
    // stride k), rhs is wᵀ, i.e. element (kk, j) at w[j·k + kk] (column stride k, row stride 1).
    // The three slices do not alias (dst is a unique borrow), and read_dst = false means dst's
    // initial contents are never read, so alpha is ignored.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            Parallelism::None,
        );
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
