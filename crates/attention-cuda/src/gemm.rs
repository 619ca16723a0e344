//! Which GEMM path [`Backend::matmul`](attention::Backend::matmul) takes: the vendor BLAS
//! (cuBLAS on NVIDIA, hipBLAS on AMD) when the device has it loaded, or the crate's own
//! `matmul` kernel (`kernels/dense.cu`). The choice is made once per backend by [`choose`] and
//! reported by `kvserve info`; a call whose shape the BLAS cannot take ([`gemm_args`]) uses
//! the kernel.
//!
//! The trade-off is batch invariance. The kernel sums each output element over `k` in
//! one fixed order whatever the number of rows `m` is, so a request's logits are bitwise the
//! same whichever batch it rides in. cuBLAS picks its algorithm (tile shape, split-K) by the
//! problem size, so the same row can round differently in a batch of 1 and a batch of 64. As
//! in SGLang, `--enable-deterministic-inference` (`CudaConfig::enable_deterministic_inference`)
//! asks for batch-invariant ops: it selects the kernel even where the BLAS is loaded.
//!
//! Activations are f32. A weight is f32, which the BLAS runs as plain SGEMM in the library's
//! default math mode (no TF32), or bf16, which it runs as a GEMM of bf16 inputs (the
//! activations rounded to bf16 first, as the `Backend::upload_weight` contract allows) with
//! f32 accumulation and output, on the tensor cores ([`GemmInputs::Bf16`]). That contract lets
//! only a bf16 weight's activations be rounded, and no BLAS multiplies f16 by f32, so an f16
//! weight is widened to f32 for SGEMM per call when the batch has more rows than one of the
//! kernel's row blocks (prefill), and takes the kernel otherwise (decode).
//!
//! The own kernel has a tensor-core form for bf16 weights (`matmul_mma`, opt-in by
//! `CudaConfig::gemm_tensor_cores`, for batches of more than [`MMA_MIN_ROWS`] rows): on large
//! decode batches under a CUDA graph, where `matmul`'s FMAs are the bound, it runs the GEMM on
//! `mma.sync` over the activations rounded to bf16, as the BLAS path does. Its choice depends
//! on the batch's size, so deterministic inference keeps `matmul`.

use std::fmt;

/// Rows a matmul must have for [`CudaConfig::gemm_tensor_cores`](crate::CudaConfig) to take the
/// own kernel's tensor-core form (`matmul_mma`) over a bf16 weight: below it, a decode batch
/// is bound by reading the weight, which `matmul` does with more blocks (`matmul_mma`'s 64
/// outputs a block leave a 4096-wide projection 64 blocks).
pub const MMA_MIN_ROWS: usize = 8;

/// A BLAS matrix operation (`cublasOperation_t` / `hipblasOperation_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The matrix as stored.
    N,
    /// Its transpose.
    T,
}

/// The type of a BLAS GEMM's inputs A (the weight) and B (the activations); C is f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmInputs {
    /// f32 inputs: SGEMM.
    F32,
    /// bf16 inputs, f32 accumulation (`cublasGemmEx` with `CUBLAS_COMPUTE_32F`).
    Bf16,
}

impl GemmInputs {
    /// Bytes of one input element.
    pub fn elem_bytes(self) -> usize {
        match self {
            GemmInputs::F32 => 4,
            GemmInputs::Bf16 => 2,
        }
    }
}

/// The column-major GEMM call `C = op(A) · op(B)` (alpha 1, beta 0) that computes the
/// backend's row-major `out[m, n] = x[m, k] · w[n, k]ᵀ`, with A = `w`, B = `x`, C = `out`.
///
/// Row-major `out` is the column-major `n × m` matrix `outᵀ = w · xᵀ`; row-major `w [n, k]`
/// read column-major is `wᵀ` (`k × n`, leading dimension `k`), so A is transposed; row-major
/// `x [m, k]` read column-major is `xᵀ` (`k × m`, leading dimension `k`), taken as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmArgs {
    /// How A (`w`) is applied.
    pub transa: Op,
    /// How B (`x`) is applied.
    pub transb: Op,
    /// Rows of op(A) and C (the backend's `n`).
    pub m: i32,
    /// Columns of op(B) and C (the backend's `m`).
    pub n: i32,
    /// The inner dimension.
    pub k: i32,
    /// Leading dimension of A.
    pub lda: i32,
    /// Leading dimension of B.
    pub ldb: i32,
    /// Leading dimension of C.
    pub ldc: i32,
}

impl GemmArgs {
    /// Elements of A, B and C the call touches (`w`, `x`, `out`).
    pub fn elems(&self) -> (usize, usize, usize) {
        let (m, n, k) = (self.m as usize, self.n as usize, self.k as usize);
        (m * k, n * k, m * n)
    }

    /// Checks that buffers of `a`, `b` and `c` bytes hold what the call reads and writes
    /// (`inputs` A and B, f32 C), so a device never hands the library a short buffer.
    pub fn check_bytes(
        &self,
        inputs: GemmInputs,
        a: usize,
        b: usize,
        c: usize,
    ) -> Result<(), String> {
        let (ea, eb, ec) = self.elems();
        let size = inputs.elem_bytes();
        for (what, have, need) in [("w", a, ea * size), ("x", b, eb * size), ("out", c, ec * 4)] {
            if have < need {
                return Err(format!(
                    "gemm ({inputs:?}): {what} has {have} bytes, the call needs {need}"
                ));
            }
        }
        Ok(())
    }
}

/// The GEMM arguments for `x [m, k] · w [n, k]ᵀ`, or why the BLAS cannot take the shape (a
/// dimension over `i32::MAX`, the BLAS's `int`; the kernel takes up to `u32::MAX`). Leading
/// dimensions are at least 1, as the BLAS requires even for `k = 0` (then C is zeroed).
pub fn gemm_args(m: usize, k: usize, n: usize) -> Result<GemmArgs, String> {
    let int = |what: &str, x: usize| {
        i32::try_from(x).map_err(|_| format!("{what} = {x} exceeds the BLAS's 32-bit int"))
    };
    let (m, k, n) = (int("m", m)?, int("k", k)?, int("n", n)?);
    Ok(GemmArgs {
        transa: Op::T,
        transb: Op::N,
        m: n,
        n: m,
        k,
        lda: k.max(1),
        ldb: k.max(1),
        ldc: n.max(1),
    })
}

/// What the BLAS computes for `args` (alpha 1, beta 0), on the host, indexing A, B and C
/// column-major exactly as the BLAS does: the stand-in for cuBLAS/hipBLAS in tests (this machine
/// has neither), so the argument mapping above is checked by executing it.
pub fn gemm_host(args: &GemmArgs, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (args.m as usize, args.n as usize, args.k as usize);
    let (lda, ldb, ldc) = (args.lda as usize, args.ldb as usize, args.ldc as usize);
    let at = |i: usize, p: usize| match args.transa {
        Op::N => a[i + p * lda],
        Op::T => a[p + i * lda],
    };
    let bt = |p: usize, j: usize| match args.transb {
        Op::N => b[p + j * ldb],
        Op::T => b[j + p * ldb],
    };
    for j in 0..n {
        for i in 0..m {
            c[i + j * ldc] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
        }
    }
}

/// The GEMM path of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPath {
    /// The device's vendor BLAS.
    Blas,
    /// The crate's own `matmul` kernel.
    Kernel,
}

/// The path chosen and why, as `kvserve info` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmChoice {
    /// The path every supported GEMM takes.
    pub path: GemmPath,
    /// Why, in words.
    pub why: String,
}

impl fmt::Display for GemmChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = match self.path {
            GemmPath::Blas => "vendor BLAS",
            GemmPath::Kernel => "own kernel",
        };
        write!(f, "{path} ({})", self.why)
    }
}

/// Picks the GEMM path: the kernel under `enable_deterministic_inference`, else the BLAS when
/// the device loaded one (`blas`: its name, or why there is none), else the kernel.
pub fn choose(enable_deterministic_inference: bool, blas: Result<&str, String>) -> GemmChoice {
    match (enable_deterministic_inference, blas) {
        (true, _) => GemmChoice {
            path: GemmPath::Kernel,
            why: "--enable-deterministic-inference: the own kernel is batch-invariant".into(),
        },
        (false, Ok(name)) => GemmChoice {
            path: GemmPath::Blas,
            why: format!(
                "{name} loaded; not batch-invariant (its algorithm depends on the batch size), \
                 --enable-deterministic-inference selects the kernel"
            ),
        },
        (false, Err(why)) => GemmChoice {
            path: GemmPath::Kernel,
            why,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The arguments make the BLAS compute the backend's row-major `x · wᵀ`.
        #[test]
        fn gemm_args_compute_x_times_w_transposed(
            m in 1usize..6, k in 0usize..6, n in 1usize..6, seed in any::<u64>()
        ) {
            let mut s = seed;
            let mut next = || {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) % 17) as f32 - 8.0
            };
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let args = gemm_args(m, k, n).unwrap();
            prop_assert_eq!(args.check_bytes(GemmInputs::F32, w.len() * 4, x.len() * 4, m * n * 4), Ok(()));
            let mut out = vec![f32::NAN; m * n];
            gemm_host(&args, &w, &x, &mut out);
            for r in 0..m {
                for c in 0..n {
                    let want: f32 = (0..k).map(|p| x[r * k + p] * w[c * k + p]).sum();
                    prop_assert_eq!(out[r * n + c], want, "out[{}, {}]", r, c);
                }
            }
        }
    }

    #[test]
    fn oversized_shapes_and_short_buffers_are_refused() {
        let big = i32::MAX as usize + 1;
        let e = gemm_args(big, 4, 4).unwrap_err();
        assert!(e.contains("m = 2147483648"), "{e}");
        assert!(gemm_args(4, big, 4).is_err() && gemm_args(4, 4, big).is_err());
        let args = gemm_args(2, 3, 4).unwrap();
        assert_eq!(args.elems(), (12, 6, 8));
        let f32 = |a, b, c| args.check_bytes(GemmInputs::F32, a, b, c);
        assert_eq!(f32(48, 24, 32), Ok(()));
        let e = f32(48, 23, 32).unwrap_err();
        assert_eq!(e, "gemm (F32): x has 23 bytes, the call needs 24");
        assert!(f32(47, 24, 32).is_err() && f32(48, 24, 31).is_err());
        // bf16 inputs are half the bytes; the f32 output is not.
        let bf16 = |a, b, c| args.check_bytes(GemmInputs::Bf16, a, b, c);
        assert_eq!(bf16(24, 12, 32), Ok(()));
        let e = bf16(24, 12, 16).unwrap_err();
        assert_eq!(e, "gemm (Bf16): out has 16 bytes, the call needs 32");
        assert!(bf16(23, 12, 32).is_err() && bf16(24, 11, 32).is_err());
    }

    #[test]
    fn the_flag_wins_then_the_library_decides() {
        let loaded = || Ok::<_, String>("cuBLAS");
        let absent = || Err::<&str, _>("libcublas not found".to_string());
        assert_eq!(choose(false, loaded()).path, GemmPath::Blas);
        assert_eq!(choose(true, loaded()).path, GemmPath::Kernel);
        assert_eq!(choose(false, absent()).path, GemmPath::Kernel);
        assert_eq!(choose(true, absent()).path, GemmPath::Kernel);
        insta::assert_snapshot!(
            [choose(false, loaded()), choose(true, loaded()), choose(false, absent())]
                .map(|c| c.to_string())
                .join("\n"),
            @r"
        vendor BLAS (cuBLAS loaded; not batch-invariant (its algorithm depends on the batch size), --enable-deterministic-inference selects the kernel)
        own kernel (--enable-deterministic-inference: the own kernel is batch-invariant)
        own kernel (libcublas not found)
        "
        );
    }
}
