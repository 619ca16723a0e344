//! The f64 reference: plain loops over contiguous arrays, the semantics every backend is
//! compared against. Inputs are f32 (what backends receive); everything is computed in f64.
//!
//! Shapes are row-major; the functions trust their callers (they are test oracles) and panic on
//! inconsistent lengths.

use crate::rope::{RopeConfig, RopeStyle};

fn f(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// `x[m, k] · w[n, k]ᵀ`.
pub fn matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    assert!(x.len() == m * k && w.len() == n * k);
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|kk| x[i * k + kk] as f64 * w[j * k + kk] as f64)
                .sum();
        }
    }
    out
}

/// `out[t, h] = x[t, h] · w[h]ᵀ` for `x [n, heads, k]` and `w [heads, m, k]`: a matmul per
/// head (torch's `bmm` over the heads), `[n, heads, m]`.
pub fn bmm(x: &[f32], w: &[f32], n: usize, heads: usize, k: usize, m: usize) -> Vec<f64> {
    assert!(x.len() == n * heads * k && w.len() == heads * m * k);
    let mut out = vec![0.0; n * heads * m];
    for t in 0..n {
        for h in 0..heads {
            let xr = &x[(t * heads + h) * k..][..k];
            for j in 0..m {
                let wr = &w[(h * m + j) * k..][..k];
                out[(t * heads + h) * m + j] =
                    xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
            }
        }
    }
    out
}

/// RMSNorm of each row of `x` (`weight.len()` columns).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f64> {
    let d = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        out.extend(
            row.iter()
                .zip(weight)
                .map(|(&v, &w)| v as f64 * inv * w as f64),
        );
    }
    out
}

/// Rotary embedding of `x[n, heads, head_dim]`; panics on an invalid `cfg`.
pub fn rotary(x: &[f32], positions: &[u32], cfg: &RopeConfig) -> Vec<f64> {
    let inv = cfg.inv_freqs().expect("valid rope config");
    let half = cfg.rotary_dim / 2;
    let mut out = f(x);
    let per_tok = x.len() / positions.len();
    for (t, &pos) in positions.iter().enumerate() {
        for head in out[t * per_tok..(t + 1) * per_tok].chunks_exact_mut(cfg.head_dim) {
            for (i, &fr) in inv.iter().enumerate() {
                let (a, b) = match cfg.style {
                    RopeStyle::Neox => (i, i + half),
                    RopeStyle::GptJ => (2 * i, 2 * i + 1),
                };
                let (s, c) = (pos as f64 * fr).sin_cos();
                let (xa, xb) = (head[a], head[b]);
                head[a] = xa * c - xb * s;
                head[b] = xb * c + xa * s;
            }
        }
    }
    out
}

/// `silu(gate) · up` of rows `[gate(d), up(d)]`.
pub fn silu_mul(x: &[f32], d: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len() / 2);
    for row in x.chunks_exact(2 * d) {
        for i in 0..d {
            let g = row[i] as f64;
            out.push(g / (1.0 + (-g).exp()) * row[d + i] as f64);
        }
    }
    out
}

/// [`Backend::fused_moe`](crate::Backend::fused_moe) in f64: each of the `n` tokens of `h`
/// `[n, d]` routed by [`route_token`](crate::moe::route_token) over its row of `logits`
/// `[n, e]`, its experts' MLPs (`gate_up` `[e, 2i·d]`, `down` `[e, d·i]`) weighted and summed.
pub fn fused_moe(
    h: &[f32],
    logits: &[f32],
    gate_up: &[f32],
    down: &[f32],
    (n, d, e, i): (usize, usize, usize, usize),
    routing: &crate::moe::MoeRouting,
) -> Vec<f64> {
    let mut out = vec![0.0; n * d];
    for t in 0..n {
        let x = &h[t * d..(t + 1) * d];
        for (ex, w) in crate::moe::route_token(&logits[t * e..(t + 1) * e], routing) {
            let gu = matmul(
                x,
                &gate_up[ex * 2 * i * d..(ex + 1) * 2 * i * d],
                1,
                d,
                2 * i,
            );
            let act: Vec<f64> = (0..i)
                .map(|c| gu[c] / (1.0 + (-gu[c]).exp()) * gu[i + c])
                .collect();
            let wd = &down[ex * d * i..(ex + 1) * d * i];
            for (c, o) in out[t * d..(t + 1) * d].iter_mut().enumerate() {
                let y: f64 = (0..i).map(|j| act[j] * wd[c * i + j] as f64).sum();
                *o += w as f64 * y;
            }
        }
    }
    out
}

/// Softmax-weighted sum of `values(j)` with scores `s[j]` (stable, in f64).
fn softmax_sum(s: &[f64], dv: usize, value: impl Fn(usize) -> Vec<f64>) -> Vec<f64> {
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
    let z: f64 = w.iter().sum();
    let mut out = vec![0.0; dv];
    for (j, &wj) in w.iter().enumerate() {
        for (o, v) in out.iter_mut().zip(value(j)) {
            *o += wj / z * v;
        }
    }
    out
}

/// Head geometry of [`attention`].
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    /// Heads of `q` and of the output.
    pub q_heads: usize,
    /// KV heads (`q_heads` a multiple of it).
    pub kv_heads: usize,
    /// Elements per query and key head (`d`, the dimension of `q·k`).
    pub head_dim: usize,
    /// Elements per value head (`dv`, the dimension of each output head).
    pub v_head_dim: usize,
}

/// Causal attention of one request: `q[ext, q_heads, d]` for positions
/// `prefix_len .. prefix_len + ext`, over `k[kv_len, kv_heads, d]` and `v[kv_len, kv_heads, dv]`
/// (all positions). Returns `[ext, q_heads, dv]`.
pub fn attention(
    h: Heads,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    prefix_len: usize,
    scale: f32,
) -> Vec<f64> {
    let (d, dv) = (h.head_dim, h.v_head_dim);
    let ext = q.len() / (h.q_heads * d);
    let group = h.q_heads / h.kv_heads;
    let mut out = Vec::with_capacity(ext * h.q_heads * dv);
    for t in 0..ext {
        let pos = prefix_len + t;
        for head in 0..h.q_heads {
            let g = head / group;
            let qv = &q[(t * h.q_heads + head) * d..][..d];
            let s: Vec<f64> = (0..=pos)
                .map(|j| {
                    let kr = &k[(j * h.kv_heads + g) * d..][..d];
                    scale as f64
                        * qv.iter()
                            .zip(kr)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                })
                .collect();
            out.extend(softmax_sum(&s, dv, |j| {
                f(&v[(j * h.kv_heads + g) * dv..][..dv])
            }));
        }
    }
    out
}

/// MLA (absorbed) attention of one request: `q[ext, heads, r + rope]`,
/// `latent[kv_len, r + rope]` with `r = kv_lora_rank`; scores over the whole row, values the
/// first `kv_lora_rank` dims. Returns `[ext, heads, kv_lora_rank]`.
pub fn attention_mla(
    heads: usize,
    kv_lora_rank: usize,
    rope_dim: usize,
    q: &[f32],
    latent: &[f32],
    prefix_len: usize,
    scale: f32,
) -> Vec<f64> {
    let d = kv_lora_rank + rope_dim;
    let values: Vec<f32> = latent
        .chunks_exact(d)
        .flat_map(|r| r[..kv_lora_rank].iter().copied())
        .collect();
    attention(
        Heads {
            q_heads: heads,
            kv_heads: 1,
            head_dim: d,
            v_head_dim: kv_lora_rank,
        },
        q,
        latent,
        &values,
        prefix_len,
        scale,
    )
}

/// DoubleSparse decode of one request (one query at position `kv_len − 1`): each query head
/// scores every position by `Σ_c q[channels[g][c]] · labels[j, g, c]`, keeps the `top_k` best
/// (ties: the earlier position) and attends exactly over them. `q[q_heads, d]`,
/// `labels[kv_len, kv_heads, hc]`, `channels[kv_heads × hc]`. Returns `[q_heads, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn double_sparse_decode(
    h: Heads,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    labels: &[f32],
    channels: &[u32],
    top_k: usize,
    scale: f32,
) -> Vec<f64> {
    let (d, dv) = (h.head_dim, h.v_head_dim);
    let kv_len = k.len() / (h.kv_heads * d);
    let hc = channels.len() / h.kv_heads;
    let group = h.q_heads / h.kv_heads;
    let mut out = Vec::with_capacity(h.q_heads * dv);
    for head in 0..h.q_heads {
        let g = head / group;
        let qv = &q[head * d..][..d];
        let chans = &channels[g * hc..][..hc];
        let label_score = |j: usize| -> f64 {
            chans
                .iter()
                .enumerate()
                .map(|(c, &ch)| {
                    qv[ch as usize] as f64 * labels[(j * h.kv_heads + g) * hc + c] as f64
                })
                .sum()
        };
        let ls: Vec<f64> = (0..kv_len).map(label_score).collect();
        let mut order: Vec<usize> = (0..kv_len).collect();
        order.sort_by(|&a, &b| ls[b].total_cmp(&ls[a]).then(a.cmp(&b)));
        order.truncate(top_k.min(kv_len));
        order.sort();
        let s: Vec<f64> = order
            .iter()
            .map(|&j| {
                let kr = &k[(j * h.kv_heads + g) * d..][..d];
                scale as f64
                    * qv.iter()
                        .zip(kr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
            })
            .collect();
        out.extend(softmax_sum(&s, dv, |i| {
            f(&v[(order[i] * h.kv_heads + g) * dv..][..dv])
        }));
    }
    out
}
