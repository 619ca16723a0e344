//! GEMM throughput on any [`Backend`]: a dense `matmul` over a weight ([`MatmulCase`]) and a
//! mixture-of-experts layer ([`MoeCase`]: one `fused_moe` call, routing, the experts' gate/up
//! and down matmuls and the weighted combine), timed, and the multiply-adds their matmuls do
//! divided by the time. Prefill batches are compute-bound: the figure a tensor-core form should
//! raise. A decode batch is bound by reading the weights; [`MatmulCase::weight_bytes`] and
//! [`MoeCase::weight_bytes_touched`] give what it must read.
//!
//! [`moe_experts`] uploads random experts of a case's shape once; [`measure_moe`] uploads
//! random hidden states and router logits that spread the tokens over every expert, and
//! [`measure_matmul`] random activations and weight. Each runs one untimed call (which compiles
//! kernels where a backend compiles at first use), then times `iters` samples of `calls` calls
//! back to back ending with [`Backend::synchronize`], and reports the median sample's time per
//! call. The GPU bench (`attention-cuda`'s `gemm_throughput` example) runs them per shape,
//! batch size and form; the tests run them on the CPU and emulated backends with small shapes.

use kv_pool::rng::SplitMix64;

use crate::backend::{Backend, TensorDtype};
use crate::bandwidth::median_seconds_per_call;
pub use crate::bandwidth::Timing;
use crate::conformance::nonzero_vec;
use crate::error::Result;
use crate::moe::{MoeExperts, MoeRouting};

/// One dense matmul, `[m, k] · [n, k]ᵀ`, over a weight stored as `dtype`; or with `heads` > 1
/// a matmul per head ([`Backend::bmm`], `[m, heads, k] · [heads, n, k]ᵀ`: MLA's absorptions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulCase {
    /// Rows (tokens) of the activations.
    pub m: usize,
    /// The inner dimension.
    pub k: usize,
    /// Outputs (the weight's rows), per head.
    pub n: usize,
    /// Heads: 1 is a `matmul`, more a `bmm`.
    pub heads: usize,
    /// How the weight is stored ([`Backend::upload_weight`]).
    pub dtype: TensorDtype,
}

impl MatmulCase {
    /// A plain matmul (one head).
    pub fn dense(m: usize, k: usize, n: usize, dtype: TensorDtype) -> Self {
        MatmulCase {
            m,
            k,
            n,
            heads: 1,
            dtype,
        }
    }

    /// FLOPs: `m · heads · n · k` multiply-adds.
    pub fn flops(&self) -> u64 {
        2 * (self.m * self.heads * self.n) as u64 * self.k as u64
    }

    /// Bytes of the weight as stored: what a call must read at least once.
    pub fn weight_bytes(&self) -> u64 {
        (self.heads * self.n * self.k) as u64 * self.dtype.bytes() as u64
    }
}

impl Timing<MatmulCase> {
    /// FLOPs per second, in TFLOP/s (10¹²).
    pub fn tflops(&self) -> f64 {
        self.case.flops() as f64 / self.seconds / 1e12
    }

    /// The weight's bytes per second, in GB/s (10⁹ bytes).
    pub fn weight_gbps(&self) -> f64 {
        self.case.weight_bytes() as f64 / self.seconds / 1e9
    }
}

/// Times `matmul` (or `bmm`, for more than one head) of `case` on `b` (see the module
/// documentation): the median of `iters` samples (at least one) of `calls` calls back to back
/// (at least one) and one synchronisation, per call, after one untimed call.
pub fn measure_matmul<B: Backend>(
    b: &B,
    case: &MatmulCase,
    iters: usize,
    calls: usize,
) -> Result<Timing<MatmulCase>> {
    let c = case;
    let mut rng = SplitMix64::new(0x6E3);
    let (x_shape, w_shape) = match c.heads {
        1 => (vec![c.m, c.k], vec![c.n, c.k]),
        h => (vec![c.m, h, c.k], vec![h, c.n, c.k]),
    };
    let x = b.upload(&nonzero_vec(&mut rng, c.m * c.heads * c.k), &x_shape)?;
    let w = b.upload_weight(
        &nonzero_vec(&mut rng, c.heads * c.n * c.k),
        &w_shape,
        c.dtype,
    )?;
    let seconds = median_seconds_per_call(b, iters, calls, || {
        if c.heads == 1 {
            b.matmul(&x, &w).map(drop)
        } else {
            b.bmm(&x, &w).map(drop)
        }
    })?;
    Ok(Timing {
        case: *case,
        seconds,
        calls: calls.max(1),
    })
}

/// One mixture-of-experts layer shape and batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeCase {
    /// Tokens in the batch.
    pub tokens: usize,
    /// The hidden size (each expert's input and output).
    pub hidden: usize,
    /// Experts in the layer.
    pub experts: usize,
    /// Each expert's intermediate size.
    pub intermediate: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// How the experts are stored ([`Backend::upload_weight`]).
    pub dtype: TensorDtype,
}

impl MoeCase {
    /// Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top 8) over `tokens` tokens,
    /// bf16 experts.
    pub fn qwen3_30b_a3b(tokens: usize) -> Self {
        MoeCase {
            tokens,
            hidden: 2048,
            experts: 128,
            intermediate: 768,
            top_k: 8,
            dtype: TensorDtype::Bf16,
        }
    }

    /// DeepSeek-V2-Lite's routed experts (hidden 2048, 64 experts of 1408, top 6) over
    /// `tokens` tokens, bf16 experts.
    pub fn deepseek_v2_lite(tokens: usize) -> Self {
        MoeCase {
            tokens,
            hidden: 2048,
            experts: 64,
            intermediate: 1408,
            top_k: 6,
            dtype: TensorDtype::Bf16,
        }
    }

    /// FLOPs of the expert matmuls: each (token, rank) row through gate/up (`2 · intermediate`
    /// outputs of `hidden`) and down (`hidden` outputs of `intermediate`), a multiply and an
    /// add each.
    pub fn flops(&self) -> u64 {
        2 * (self.tokens * self.top_k) as u64 * 3 * (self.hidden * self.intermediate) as u64
    }

    /// Bytes of one expert's weights as stored.
    pub fn expert_bytes(&self) -> u64 {
        3 * (self.hidden * self.intermediate) as u64 * self.dtype.bytes() as u64
    }

    /// A lower bound on the weight bytes a call reads: every expert some row is routed to,
    /// once (at most `tokens · top_k` of them).
    pub fn weight_bytes_touched(&self) -> u64 {
        self.experts.min(self.tokens * self.top_k) as u64 * self.expert_bytes()
    }
}

impl Timing<MoeCase> {
    /// The expert matmuls' FLOPs per second, in TFLOP/s (10¹²).
    pub fn tflops(&self) -> f64 {
        self.case.flops() as f64 / self.seconds / 1e12
    }

    /// [`MoeCase::weight_bytes_touched`] per second, in GB/s (10⁹ bytes): a decode batch's
    /// figure against the device's memory bandwidth.
    pub fn weight_gbps(&self) -> f64 {
        self.case.weight_bytes_touched() as f64 / self.seconds / 1e9
    }
}

/// Random experts of `case`'s shape and dtype on `b`, for [`measure_moe`]: one expert's
/// random weights repeated for every expert (the values do not change the work, and a large
/// layer's are made in a memory copy's time), small enough to keep every activation finite.
pub fn moe_experts<B: Backend>(b: &B, case: &MoeCase) -> Result<MoeExperts<B::Tensor>> {
    let (d, e, i) = (case.hidden, case.experts, case.intermediate);
    let mut rng = SplitMix64::new(0x30E);
    let tiled = |rng: &mut SplitMix64, per_expert: usize| -> Vec<f32> {
        let one: Vec<f32> = nonzero_vec(rng, per_expert)
            .into_iter()
            .map(|v| v * 0.05)
            .collect();
        let mut all = Vec::with_capacity(e * per_expert);
        for _ in 0..e {
            all.extend_from_slice(&one);
        }
        all
    };
    Ok(MoeExperts {
        gate_up: b.upload_weight(&tiled(&mut rng, 2 * i * d), &[e, 2 * i * d], case.dtype)?,
        down: b.upload_weight(&tiled(&mut rng, d * i), &[e, d * i], case.dtype)?,
        intermediate: i,
    })
}

/// Times `fused_moe` of `case` on `b` over `experts` (of its shape: [`moe_experts`]; see the
/// module documentation): the median of `iters` samples (at least one) of `calls` calls back
/// to back (at least one) and one synchronisation, per call, after one untimed call.
pub fn measure_moe<B: Backend>(
    b: &B,
    case: &MoeCase,
    experts: &MoeExperts<B::Tensor>,
    iters: usize,
    calls: usize,
) -> Result<Timing<MoeCase>> {
    let c = case;
    let calls = calls.max(1);
    let mut rng = SplitMix64::new(0x30F);
    // Random logits spread the rows over the experts, as a trained router's tend to.
    let h = b.upload(
        &nonzero_vec(&mut rng, c.tokens * c.hidden),
        &[c.tokens, c.hidden],
    )?;
    let logits: Vec<f32> = nonzero_vec(&mut rng, c.tokens * c.experts)
        .into_iter()
        .map(|v| v * 4.0)
        .collect();
    let logits = b.upload(&logits, &[c.tokens, c.experts])?;
    let routing = MoeRouting {
        top_k: c.top_k,
        renormalize: true,
        routed_scaling_factor: 1.0,
    };
    let seconds = median_seconds_per_call(b, iters, calls, || {
        b.fused_moe(&h, &logits, experts, &routing).map(drop)
    })?;
    Ok(Timing {
        case: *case,
        seconds,
        calls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_cases_count_their_work() {
        let q = MoeCase::qwen3_30b_a3b(1);
        // One token through 8 experts: 8 rows · 3 · 2048 · 768 multiply-adds.
        assert_eq!(q.flops(), 2 * 8 * 3 * 2048 * 768);
        assert_eq!(q.expert_bytes(), 3 * 2048 * 768 * 2);
        assert_eq!(q.weight_bytes_touched(), 8 * q.expert_bytes());
        let big = MoeCase::deepseek_v2_lite(4096);
        assert_eq!(big.weight_bytes_touched(), 64 * big.expert_bytes());
    }

    #[test]
    fn a_matmul_is_measured_on_the_cpu_backend() {
        let b = crate::CpuBackend::default();
        let case = MatmulCase::dense(3, 16, 8, TensorDtype::Bf16);
        assert_eq!(
            (case.flops(), case.weight_bytes()),
            (2 * 3 * 8 * 16, 8 * 16 * 2)
        );
        let heads = MatmulCase { heads: 4, ..case };
        assert_eq!(
            (heads.flops(), heads.weight_bytes()),
            (4 * case.flops(), 4 * case.weight_bytes())
        );
        for case in [case, heads] {
            let t = measure_matmul(&b, &case, 3, 2).unwrap();
            assert!(
                t.seconds > 0.0 && t.tflops() > 0.0 && t.weight_gbps() > 0.0,
                "{t:?}"
            );
            assert_eq!((t.case, t.calls), (case, 2));
        }
    }

    #[test]
    fn the_cpu_backend_is_measured() {
        let b = crate::CpuBackend::default();
        let case = MoeCase {
            tokens: 5,
            hidden: 16,
            experts: 4,
            intermediate: 8,
            top_k: 2,
            dtype: TensorDtype::Bf16,
        };
        let experts = moe_experts(&b, &case).unwrap();
        let t = measure_moe(&b, &case, &experts, 3, 2).unwrap();
        assert!(
            t.seconds > 0.0 && t.tflops() > 0.0 && t.weight_gbps() > 0.0,
            "{t:?}"
        );
        assert_eq!((t.case, t.calls), (case, 2));
    }
}
