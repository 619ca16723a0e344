//! Mixture-of-experts layers as one backend op, [`Backend::fused_moe`] (SGLang's `FusedMoE`:
//! top-k routing and the routed experts; shared experts stay dense ops of the model): the
//! routing parameters ([`MoeRouting`]), the experts' stacked weights ([`MoeExperts`]), greedy
//! top-k routing of one token ([`route_token`]), and the host algorithm every backend gets by
//! default ([`fused_moe_on_host`]).
//!
//! A device backend overrides the op with kernels that keep the routing on the device (no
//! read-back, so a decode forward with MoE layers can be captured as a CUDA graph); the CPU
//! backend runs the host algorithm over slices of the stacked weights.
//!
//! Batch invariance: the host algorithm runs each expert's MLP over the rows routed to it and
//! adds a token's experts in its rank order, so on a row-invariant backend a token's result
//! does not depend on which other tokens share the batch.

use crate::backend::{Backend, DeviceTensor};
use crate::check;
use crate::error::{AttentionError, Result};

/// How a token is routed (HF `MoEGate` with `topk_method = greedy`, SGLang's `TopK`): softmax
/// over the router logits, the `top_k` largest probabilities (ties to the lower expert index),
/// then renormalised to sum to 1 (`renormalize` and `top_k > 1`) or multiplied by
/// `routed_scaling_factor`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeRouting {
    /// Experts each token is routed to (`1 ≤ top_k ≤` the expert count).
    pub top_k: usize,
    /// Renormalise the top-k probabilities (HF's `norm_topk_prob`; only when `top_k > 1`).
    pub renormalize: bool,
    /// Multiplies the probabilities when they are not renormalised.
    pub routed_scaling_factor: f64,
}

/// The routed experts of one layer, stacked (SGLang's `w13` and `w2`): `gate_up` is
/// `[experts, 2 · intermediate · hidden]`, expert `e`'s row its `[2 · intermediate, hidden]`
/// gate rows then up rows; `down` is `[experts, hidden · intermediate]`, expert `e`'s row its
/// `[hidden, intermediate]` down projection. One row per expert lets a backend that has no
/// kernel for the op take an expert's matrix with [`Backend::embedding`].
pub struct MoeExperts<T> {
    /// `[experts, 2 · intermediate · hidden]`.
    pub gate_up: T,
    /// `[experts, hidden · intermediate]`.
    pub down: T,
    /// Each expert's MLP width.
    pub intermediate: usize,
}

/// The dimensions of one [`Backend::fused_moe`] call, checked by [`check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeDims {
    /// Tokens.
    pub tokens: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Routed experts.
    pub experts: usize,
    /// Each expert's MLP width.
    pub intermediate: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// [`Backend::fused_moe`]'s input: `h [tokens, hidden]`, `router_logits [tokens, experts]`,
/// the experts' rows as [`MoeExperts`] says, `1 ≤ top_k ≤ experts`, a finite scaling factor.
pub fn check<T: DeviceTensor>(
    h: &T,
    router_logits: &T,
    experts: &MoeExperts<T>,
    routing: &MoeRouting,
) -> Result<MoeDims> {
    check::rank("h", h.shape(), 2)?;
    check::rank("router_logits", router_logits.shape(), 2)?;
    let (tokens, hidden) = (h.shape()[0], h.shape()[1]);
    let n_experts = router_logits.shape()[1];
    check::shape("router_logits", router_logits.shape(), &[tokens, n_experts])?;
    let i = experts.intermediate;
    if i == 0 || hidden == 0 || n_experts == 0 {
        return Err(AttentionError::InvalidConfig {
            field: "fused_moe",
            reason: format!(
                "hidden {hidden}, {n_experts} experts of width {i}: every dimension must be positive"
            ),
        });
    }
    let (gate_up_len, down_len) = match (i.checked_mul(hidden), i.checked_mul(2 * hidden)) {
        (Some(down), Some(gate_up)) => (gate_up, down),
        _ => {
            return Err(AttentionError::InvalidConfig {
                field: "fused_moe",
                reason: format!("experts of width {i} over hidden {hidden} overflow"),
            })
        }
    };
    check::shape(
        "gate_up",
        experts.gate_up.shape(),
        &[n_experts, gate_up_len],
    )?;
    check::shape("down", experts.down.shape(), &[n_experts, down_len])?;
    if routing.top_k == 0 || routing.top_k > n_experts {
        return Err(AttentionError::InvalidConfig {
            field: "top_k",
            reason: format!(
                "{} experts per token out of {n_experts}: need 1 ..= {n_experts}",
                routing.top_k
            ),
        });
    }
    if !routing.routed_scaling_factor.is_finite() {
        return Err(AttentionError::InvalidConfig {
            field: "routed_scaling_factor",
            reason: format!("{} is not finite", routing.routed_scaling_factor),
        });
    }
    Ok(MoeDims {
        tokens,
        hidden,
        experts: n_experts,
        intermediate: i,
        top_k: routing.top_k,
    })
}

/// Greedy top-k routing of one token: softmax over the router logits (f64), the `top_k`
/// largest probabilities (ties to the lower expert index), then renormalised (if
/// `renormalize` and `top_k > 1`) or scaled by `routed_scaling_factor`. Returns
/// `(expert, weight)` in rank order.
pub fn route_token(logits: &[f32], routing: &MoeRouting) -> Vec<(usize, f32)> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let exps: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
    let k = routing.top_k.min(order.len());
    let top: Vec<(usize, f64)> = order[..k].iter().map(|&e| (e, exps[e] / sum)).collect();
    let total: f64 = top.iter().map(|x| x.1).sum();
    top.into_iter()
        .map(|(e, p)| {
            let w = if k > 1 && routing.renormalize {
                p / (total + 1e-20)
            } else {
                p * routing.routed_scaling_factor
            };
            (e, w as f32)
        })
        .collect()
}

/// The host algorithm of [`Backend::fused_moe`] (every backend's default): router logits read
/// back, each token routed by [`route_token`]; per expert, the tokens routed to it (ascending)
/// gathered by [`Backend::embedding`] and run through `expert_mlp(expert, rows)` (the expert's
/// MLP, `[rows, hidden] → [rows, hidden]`); each token's experts added in its rank order, and
/// the result uploaded. Input is checked by [`check`] first.
pub fn fused_moe_on_host<B: Backend + ?Sized>(
    backend: &B,
    h: &B::Tensor,
    router_logits: &B::Tensor,
    experts: &MoeExperts<B::Tensor>,
    routing: &MoeRouting,
    mut expert_mlp: impl FnMut(usize, &B::Tensor) -> Result<B::Tensor>,
) -> Result<B::Tensor> {
    let dims = check(h, router_logits, experts, routing)?;
    let (n, d, e) = (dims.tokens, dims.hidden, dims.experts);
    let logits = backend.download(router_logits)?;
    let routes: Vec<Vec<(usize, f32)>> = (0..n)
        .map(|t| route_token(&logits[t * e..(t + 1) * e], routing))
        .collect();
    // Per expert: the tokens routed to it (ascending) and its output rows.
    let mut outputs: Vec<Option<(Vec<u32>, Vec<f32>)>> = Vec::with_capacity(e);
    for x in 0..e {
        let rows: Vec<u32> = (0..n)
            .filter(|&t| routes[t].iter().any(|&(ex, _)| ex == x))
            .map(|t| t as u32)
            .collect();
        if rows.is_empty() {
            outputs.push(None);
            continue;
        }
        let sel = backend.embedding(h, &rows)?;
        let y = backend.download(&expert_mlp(x, &sel)?)?;
        outputs.push(Some((rows, y)));
    }
    // Combine per token in its rank order, so the sum never depends on the batch.
    let mut out = vec![0.0f32; n * d];
    for (t, route) in routes.iter().enumerate() {
        let dst = &mut out[t * d..(t + 1) * d];
        for &(x, wgt) in route {
            // Every expert of a route had this token among its rows, in ascending order.
            let Some((rows, y)) = &outputs[x] else {
                continue;
            };
            let Ok(i) = rows.binary_search(&(t as u32)) else {
                continue;
            };
            for (o, &v) in dst.iter_mut().zip(&y[i * d..(i + 1) * d]) {
                *o += wgt * v;
            }
        }
    }
    backend.upload(&out, &[n, d])
}

/// [`fused_moe_on_host`] with each expert's matrices taken out of the stacked weights by
/// [`Backend::embedding`] (a copy of the expert's weights per call: what a backend without its
/// own kernel for the op pays). The stack is one tensor per layer, so it must fit the
/// backend's largest buffer (wgpu refuses a larger upload with a typed `TooLarge` error).
pub fn fused_moe_by_embedding<B: Backend + ?Sized>(
    backend: &B,
    h: &B::Tensor,
    router_logits: &B::Tensor,
    experts: &MoeExperts<B::Tensor>,
    routing: &MoeRouting,
) -> Result<B::Tensor> {
    let (i, d) = (experts.intermediate, h.shape().get(1).copied().unwrap_or(0));
    fused_moe_on_host(backend, h, router_logits, experts, routing, |x, rows| {
        let gate_up = backend.embedding(&experts.gate_up, &[x as u32])?;
        let gate_up = backend.reshape(gate_up, &[2 * i, d])?;
        let down = backend.embedding(&experts.down, &[x as u32])?;
        let down = backend.reshape(down, &[d, i])?;
        let act = backend.silu_mul(&backend.matmul(rows, &gate_up)?)?;
        backend.matmul(&act, &down)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(top_k: usize, renormalize: bool, scale: f64) -> MoeRouting {
        MoeRouting {
            top_k,
            renormalize,
            routed_scaling_factor: scale,
        }
    }

    #[test]
    fn ties_go_to_the_lower_expert_and_weights_follow_the_rule() {
        let logits = [0.5f32, 2.0, 2.0, -1.0];
        let scaled = route_token(&logits, &routing(2, false, 3.0));
        assert_eq!(scaled.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2]);
        let sum: f64 = logits.iter().map(|&l| (l as f64 - 2.0).exp()).sum();
        assert!((scaled[0].1 as f64 - 3.0 / sum).abs() < 1e-6);
        let norm = route_token(&logits, &routing(2, true, 3.0));
        assert!((norm[0].1 - 0.5).abs() < 1e-6 && (norm[1].1 - 0.5).abs() < 1e-6);
        // One expert is never renormalised.
        let one = route_token(&logits, &routing(1, true, 1.0));
        assert_eq!(one[0].0, 1);
        assert!((one[0].1 as f64 - 1.0 / sum).abs() < 1e-6);
    }
}
