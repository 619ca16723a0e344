//! AVX2 + FMA + F16C kernels of the CPU backend, chosen at run time when the CPU has them.
//!
//! They compute exactly what the portable kernels compute with fused multiply-adds (the `FMA =
//! true` instantiation of [`super::attention::dense_request_impl`] and
//! [`super::primitives::dot_with`]), in the same order, only eight lanes at a time: every dot
//! product accumulates lane `i` over elements `i, i + 8, …` with fused multiply-adds, sums the
//! lanes as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` and then adds the tail one
//! element at a time; every weighted sum of value rows adds the rows one position after the
//! other, element-wise. The unit tests check the two bitwise equal.
//!
//! What makes them fast is memory traffic, not only width: f16 and bf16 rows are converted in
//! registers as they are read (no scratch copy, no call per element), f32 rows are read straight
//! from the store, each K and V row of a KV head is loaded once for a tile of up to six query
//! rows that share it (the KV head's query heads, over all the extend tokens that see the whole
//! block) or four matmul rows, and the rows of the next KV head (or next block) are prefetched
//! while a head is processed. The softmax weights are computed eight at a time with the same
//! operations as the scalar `exp_nonpos`, and eight dot products are reduced at once with the
//! same additions as `hsum`.
//!
//! Bf16 weights take their own kernels (`bf16dot`): activations rounded to bf16 and the dot
//! product of `vdpbf16ps`, run by that instruction on AVX-512 BF16 and emulated exactly here.
//!
//! Extend attention (`extend`) stages each block that several query tokens see, and the
//! request's query rows transposed, so that the online softmax runs on eight query rows per
//! instruction (sixteen where the CPU also has AVX-512): same operations per row, bitwise the
//! in-place kernel, which a decode step keeps.
//!
//! Where the CPU also has AVX-512 (`avx512`), the matmul runs 16-lane tiles that hold two
//! independent 8-lane accumulators per register, so every lane still sums exactly the same
//! elements in the same order: the results are bitwise those of the AVX2 and portable kernels.

mod attention;
pub(crate) mod avx512;
pub(crate) mod bf16dot;
mod dot;
mod elem;
mod exp;
pub(crate) mod extend;
mod matmul;

use std::sync::OnceLock;

pub(crate) use attention::{token_block_bf16, token_block_f16, token_block_f32, TokenBlock};
pub(crate) use exp::silu_mul_row;
pub(crate) use matmul::{matmul_f16, matmul_f32};

/// Whether the CPU runs these kernels (AVX2, FMA and F16C), detected once.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}
