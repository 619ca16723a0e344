//! The dense-op checks: matmul, RMSNorm, every rotary variant, SiLU-and-mul, residual add,
//! embedding, concatenation, logits and mixture-of-experts layers against the f64 reference.

use kv_pool::rng::SplitMix64;

use crate::backend::{Backend, DeviceTensor, TensorDtype};
use crate::error::{AttentionError, Result};
use crate::moe::{MoeExperts, MoeRouting};
use crate::reference;
use crate::rope::{RopeConfig, RopeScaling, RopeStyle};

use super::inputs::nonzero_vec;
use super::outcome::{relative_error, Outcome};

/// Bound for the f32 dense ops.
const DENSE_BOUND: f64 = 1e-5;

/// Bound for a matmul over a bf16 weight: [`Backend::upload_weight`] lets a backend round the
/// activations to bf16, each off by at most `u = 2⁻⁸` relative. A worst case (every rounding
/// the same way) would move an output by `u Σ|xᵢwᵢ|`, which for random signs is about `√k`
/// times `|Σ xᵢwᵢ|`; but over our inputs (independent, symmetric, random signs) the roundings
/// are independent too, so the output's relative L2 error is about `u/√3` ≈ 2.3e-3 (the CPU
/// measures 1.5e-3). `2⁻⁷` bounds that with a margin of three to five: a statistical bound
/// for these inputs, not a worst case.
pub const BF16_WEIGHT_BOUND: f64 = 1.0 / 128.0;

/// Runs the dense-op checks (matmul, RMSNorm, rotary variants, SiLU-and-mul, residual add,
/// embedding, concat_last, logits, fused_moe; and matmul, logits, embedding and fused_moe over
/// weights kept in f16 and bf16) against the f64 reference.
pub fn run_dense_suite<B: Backend>(backend: &B) -> Result<Vec<Outcome>> {
    let mut rng = SplitMix64::new(0xD15E);
    let mut out = Vec::new();
    let mut push = |name: String, error: f64, bound: f64| {
        out.push(Outcome::measured(
            format!("{} {name}", backend.name()),
            error,
            bound,
        ))
    };
    for &(m, k, n) in &[(1, 64, 48), (7, 67, 33), (33, 128, 96), (64, 256, 17)] {
        let x = nonzero_vec(&mut rng, m * k);
        let w = nonzero_vec(&mut rng, n * k);
        let got = backend.matmul(&backend.upload(&x, &[m, k])?, &backend.upload(&w, &[n, k])?)?;
        let want = reference::matmul(&x, &w, m, k, n);
        push(
            format!("matmul {m}x{k}·({n}x{k})ᵀ"),
            relative_error(&backend.download(&got)?, &want),
            DENSE_BOUND,
        );
        let got = backend.logits(&backend.upload(&x, &[m, k])?, &backend.upload(&w, &[n, k])?)?;
        push(
            format!("logits {m}x{k}·({n}x{k})ᵀ"),
            relative_error(&backend.download(&got)?, &want),
            DENSE_BOUND,
        );
    }
    // MLA's shapes (16 heads, 128 ↔ 512), a k that is no multiple of a vector, one head.
    for &(n, heads, k, m) in BMM_SHAPES {
        push(
            format!("bmm {n}x{heads}x{k}·({heads}x{m}x{k})ᵀ"),
            bmm_case(backend, &mut rng, (n, heads, k, m), TensorDtype::F32)?,
            DENSE_BOUND,
        );
    }
    // Shapes that do not fit are typed errors naming the operand.
    let ones = |shape: &[usize]| backend.upload(&vec![0.5; shape.iter().product()], shape);
    let misfits: [(&[usize], &[usize], &str); 4] = [
        (&[2, 3, 4], &[3, 5, 6], "w"),
        (&[2, 3, 4], &[2, 5, 4], "w"),
        (&[2, 3, 4], &[15, 4], "w"),
        (&[6, 4], &[3, 5, 4], "x"),
    ];
    for (x, w, operand) in misfits {
        let refused = backend.bmm(&ones(x)?, &ones(w)?).err();
        let named =
            matches!(refused, Some(AttentionError::ShapeMismatch { what, .. }) if what == operand);
        push(
            format!("bmm refuses x {x:?} · w {w:?} naming {operand}"),
            if named { 0.0 } else { f64::INFINITY },
            0.0,
        );
    }
    for &(m, d) in &[(1, 64), (5, 96), (3, 4096)] {
        let x = nonzero_vec(&mut rng, m * d);
        let w = nonzero_vec(&mut rng, d);
        let got = backend.rms_norm(
            &backend.upload(&x, &[m, d])?,
            &backend.upload(&w, &[d])?,
            1e-6,
        )?;
        push(
            format!("rms_norm {m}x{d}"),
            relative_error(&backend.download(&got)?, &reference::rms_norm(&x, &w, 1e-6)),
            DENSE_BOUND,
        );
    }
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let ropes = [
        ("neox", RopeConfig::neox(64, 10000.0)),
        (
            "gptj",
            RopeConfig {
                style: RopeStyle::GptJ,
                ..RopeConfig::neox(64, 10000.0)
            },
        ),
        (
            "neox partial 32/64",
            RopeConfig {
                rotary_dim: 32,
                ..RopeConfig::neox(64, 10000.0)
            },
        ),
        (
            "gptj partial 16/64",
            RopeConfig {
                rotary_dim: 16,
                style: RopeStyle::GptJ,
                ..RopeConfig::neox(64, 10000.0)
            },
        ),
        (
            "llama3 128",
            RopeConfig {
                scaling: llama3,
                ..RopeConfig::neox(128, 500000.0)
            },
        ),
        (
            "linear x4 128",
            RopeConfig {
                scaling: RopeScaling::Linear { factor: 4.0 },
                ..RopeConfig::neox(128, 1e6)
            },
        ),
    ];
    for (name, cfg) in ropes {
        let (n, heads) = (9, 3);
        let x = nonzero_vec(&mut rng, n * heads * cfg.head_dim);
        let pos: Vec<u32> = (0..n).map(|_| rng.below(100_000) as u32).collect();
        let mut t = backend.upload(&x, &[n, heads, cfg.head_dim])?;
        backend.rotary(&mut t, &pos, &cfg)?;
        push(
            format!("rotary {name}"),
            relative_error(&backend.download(&t)?, &reference::rotary(&x, &pos, &cfg)),
            DENSE_BOUND,
        );
    }
    for &(m, d) in &[(1, 64), (6, 40)] {
        let x = nonzero_vec(&mut rng, m * 2 * d);
        let got = backend.silu_mul(&backend.upload(&x, &[m, 2 * d])?)?;
        push(
            format!("silu_mul {m}x{d}"),
            relative_error(&backend.download(&got)?, &reference::silu_mul(&x, d)),
            DENSE_BOUND,
        );
    }
    {
        let (a, b) = (nonzero_vec(&mut rng, 24), nonzero_vec(&mut rng, 24));
        let mut t = backend.upload(&a, &[4, 6])?;
        backend.add_assign(&mut t, &backend.upload(&b, &[4, 6])?)?;
        let want: Vec<f64> = a.iter().zip(&b).map(|(&x, &y)| (x + y) as f64).collect();
        push(
            "add_assign 4x6".into(),
            relative_error(&backend.download(&t)?, &want),
            0.0,
        );
    }
    {
        let table = nonzero_vec(&mut rng, 10 * 8);
        let ids = [3u32, 0, 9, 3];
        let got = backend.embedding(&backend.upload(&table, &[10, 8])?, &ids)?;
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&i| table[i as usize * 8..][..8].iter().map(|&x| x as f64))
            .collect();
        push(
            "embedding 10x8 [3,0,9,3]".into(),
            relative_error(&backend.download(&got)?, &want),
            0.0,
        );
    }
    // A copy, so exact: rank 2 and rank 3 (MLA's query: [tokens, heads, rank + rope]).
    for shape in [&[5usize][..], &[3, 4]] {
        let rows: usize = shape.iter().product();
        let (da, db) = (24, 8);
        let (a, b) = (
            nonzero_vec(&mut rng, rows * da),
            nonzero_vec(&mut rng, rows * db),
        );
        let dims = |d: usize| [shape, &[d]].concat();
        let got = backend.concat_last(
            &backend.upload(&a, &dims(da))?,
            &backend.upload(&b, &dims(db))?,
        )?;
        if got.shape() != dims(da + db).as_slice() {
            return Err(AttentionError::Device(format!(
                "concat_last returned shape {:?}, not {:?}",
                got.shape(),
                dims(da + db)
            )));
        }
        let want: Vec<f64> = (0..rows)
            .flat_map(|r| a[r * da..][..da].iter().chain(&b[r * db..][..db]))
            .map(|&x| x as f64)
            .collect();
        push(
            format!("concat_last {shape:?} {da}+{db}"),
            relative_error(&backend.download(&got)?, &want),
            0.0,
        );
    }
    // Mixture of experts: one token (decode), a batch where experts share tokens, renormalised
    // and scaled weights, every expert chosen (top_k = experts), and experts with more rows
    // than a device tile of 16 over widths that are not multiples of it.
    for &(n, d, e, i, top_k, renormalize) in &[
        (1, 64, 8, 32, 2, true),
        (5, 48, 4, 24, 1, false),
        (9, 64, 16, 40, 6, false),
        (3, 32, 3, 16, 3, true),
        (40, 40, 4, 20, 2, false),
    ] {
        let routing = MoeRouting {
            top_k,
            renormalize,
            routed_scaling_factor: 2.5,
        };
        let dims = (n, d, e, i);
        push(
            format!("fused_moe {n}x{d} top {top_k} of {e} experts of {i}"),
            moe_case(backend, &mut rng, dims, &routing, TensorDtype::F32)?,
            DENSE_BOUND,
        );
    }
    for dtype in [TensorDtype::F16, TensorDtype::Bf16] {
        half_weights(backend, &mut rng, dtype, &mut push)?;
    }
    Ok(out)
}

/// What [`moe_bf16_activations_case`] measured.
#[derive(Debug, Clone)]
pub struct Bf16MoeOutcome {
    /// The (token, rank) rows each expert received.
    pub rows_per_expert: Vec<usize>,
    /// The relative error against an f64 computation that rounds the activations to bf16
    /// before each expert matmul (the hidden states, and the SiLU-and-mul output from its f32
    /// value): what a backend that rounds them, as [`Backend::upload_weight`] allows for a
    /// bf16 weight, computes up to its f32 arithmetic.
    pub rounded_error: f64,
    /// The relative error against the f64 [`reference::fused_moe`].
    pub reference_error: f64,
    /// Tokens (the first, the middle one and the last) whose output alone differs in any bit
    /// from their row in the batch's.
    pub batch_variant_tokens: Vec<usize>,
}

/// `fused_moe` over random bf16 experts of `(tokens, hidden, experts, intermediate)` (seeded by
/// `seed`), routed by `routing`: the errors of [`Bf16MoeOutcome`], and whether the first,
/// middle and last tokens run alone give their batch rows bitwise. A backend that rounds the
/// activations should be within `1e-4` of the rounded computation (20 times tighter than the
/// rounding itself, so a misplaced element shows); one that does not, within
/// [`BF16_WEIGHT_BOUND`] of either.
pub fn moe_bf16_activations_case<B: Backend>(
    backend: &B,
    (n, d, e, i): (usize, usize, usize, usize),
    routing: &MoeRouting,
    seed: u64,
) -> Result<Bf16MoeOutcome> {
    let bf16 = |v: f32| TensorDtype::Bf16.round(v);
    let mut rng = SplitMix64::new(seed);
    let h = nonzero_vec(&mut rng, n * d);
    let logits = nonzero_vec(&mut rng, n * e);
    let gate_up = rounded(nonzero_vec(&mut rng, e * 2 * i * d), TensorDtype::Bf16);
    let down = rounded(nonzero_vec(&mut rng, e * d * i), TensorDtype::Bf16);
    let experts = MoeExperts {
        gate_up: backend.upload_weight(&gate_up, &[e, 2 * i * d], TensorDtype::Bf16)?,
        down: backend.upload_weight(&down, &[e, d * i], TensorDtype::Bf16)?,
        intermediate: i,
    };
    let moe = |rows: std::ops::Range<usize>| -> Result<Vec<f32>> {
        let m = rows.len();
        let x = backend.upload(&h[rows.start * d..rows.end * d], &[m, d])?;
        let l = backend.upload(&logits[rows.start * e..rows.end * e], &[m, e])?;
        backend.download(&backend.fused_moe(&x, &l, &experts, routing)?)
    };
    let batch = moe(0..n)?;
    let mut want = vec![0.0f64; n * d];
    let mut rows_per_expert = vec![0usize; e];
    for t in 0..n {
        let x: Vec<f64> = h[t * d..(t + 1) * d]
            .iter()
            .map(|&v| bf16(v) as f64)
            .collect();
        for (ex, weight) in crate::moe::route_token(&logits[t * e..(t + 1) * e], routing) {
            rows_per_expert[ex] += 1;
            // Each gate/up output as the backend holds it (f32), then SiLU-and-mul rounded.
            let gu: Vec<f64> = (0..2 * i)
                .map(|c| {
                    let w = &gate_up[(ex * 2 * i + c) * d..][..d];
                    let y: f64 = x.iter().zip(w).map(|(a, &b)| a * b as f64).sum();
                    y as f32 as f64
                })
                .collect();
            let act: Vec<f64> = (0..i)
                .map(|c| bf16((gu[c] / (1.0 + (-gu[c]).exp()) * gu[i + c]) as f32) as f64)
                .collect();
            for c in 0..d {
                let w = &down[(ex * d + c) * i..][..i];
                let y: f64 = act.iter().zip(w).map(|(a, &b)| a * b as f64).sum();
                want[t * d + c] += weight as f64 * y;
            }
        }
    }
    let reference = reference::fused_moe(&h, &logits, &gate_up, &down, (n, d, e, i), routing);
    let mut batch_variant_tokens = Vec::new();
    for t in [0, n / 2, n - 1] {
        let alone = moe(t..t + 1)?;
        let within = &batch[t * d..(t + 1) * d];
        if alone
            .iter()
            .zip(within)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            batch_variant_tokens.push(t);
        }
    }
    Ok(Bf16MoeOutcome {
        rows_per_expert,
        rounded_error: relative_error(&batch, &want),
        reference_error: relative_error(&batch, &reference),
        batch_variant_tokens,
    })
}

/// `matmul` of random `[m, k]` activations by a random bf16 `[n, k]` weight (seeded by
/// `seed`): the relative errors against the f64 matmul of the activations rounded to bf16 (what
/// a backend that rounds them computes up to its f32 arithmetic; within `1e-5` for one) and
/// against the f64 [`reference::matmul`] of the activations as given, in that order.
pub fn matmul_bf16_activations_case<B: Backend>(
    backend: &B,
    (m, k, n): (usize, usize, usize),
    seed: u64,
) -> Result<(f64, f64)> {
    let mut rng = SplitMix64::new(seed);
    let x = nonzero_vec(&mut rng, m * k);
    let w = rounded(nonzero_vec(&mut rng, n * k), TensorDtype::Bf16);
    let wt = backend.upload_weight(&w, &[n, k], TensorDtype::Bf16)?;
    let got = backend.download(&backend.matmul(&backend.upload(&x, &[m, k])?, &wt)?)?;
    let x_rounded = rounded(x.clone(), TensorDtype::Bf16);
    Ok((
        relative_error(&got, &reference::matmul(&x_rounded, &w, m, k, n)),
        relative_error(&got, &reference::matmul(&x, &w, m, k, n)),
    ))
}

/// `v` rounded to `dtype` (to nearest, ties to even): values a weight of that type holds.
fn rounded(v: Vec<f32>, dtype: TensorDtype) -> Vec<f32> {
    v.into_iter().map(|x| dtype.round(x)).collect()
}

/// One fused_moe case: random hidden states, router logits and experts of
/// `(tokens, hidden, experts, intermediate)` (the experts' values rounded to and kept in
/// `dtype`), routed by `routing`; the relative error against the reference.
fn moe_case<B: Backend>(
    backend: &B,
    rng: &mut SplitMix64,
    (n, d, e, i): (usize, usize, usize, usize),
    routing: &MoeRouting,
    dtype: TensorDtype,
) -> Result<f64> {
    let h = nonzero_vec(rng, n * d);
    let logits = nonzero_vec(rng, n * e);
    let gate_up = rounded(nonzero_vec(rng, e * 2 * i * d), dtype);
    let down = rounded(nonzero_vec(rng, e * d * i), dtype);
    let experts = MoeExperts {
        gate_up: backend.upload_weight(&gate_up, &[e, 2 * i * d], dtype)?,
        down: backend.upload_weight(&down, &[e, d * i], dtype)?,
        intermediate: i,
    };
    let got = backend.fused_moe(
        &backend.upload(&h, &[n, d])?,
        &backend.upload(&logits, &[n, e])?,
        &experts,
        routing,
    )?;
    let want = reference::fused_moe(&h, &logits, &gate_up, &down, (n, d, e, i), routing);
    Ok(relative_error(&backend.download(&got)?, &want))
}

/// The [`Backend::bmm`] shapes `(n, heads, k, m)`: MLA's absorptions (a decode row and a
/// prefill block, 128 → 512 and 512 → 128), a `k` that is no multiple of a vector, one head,
/// and no rows.
const BMM_SHAPES: &[(usize, usize, usize, usize)] = &[
    (1, 16, 128, 512),
    (70, 16, 512, 128),
    (5, 3, 67, 33),
    (9, 1, 64, 40),
    (0, 4, 32, 16),
];

/// [`Backend::bmm`] of random activations `[n, heads, k]` by a random weight `[heads, m, k]`
/// kept in `dtype` (its values exactly that type's): the relative error against the f64
/// reference over those values.
fn bmm_case<B: Backend>(
    backend: &B,
    rng: &mut SplitMix64,
    (n, heads, k, m): (usize, usize, usize, usize),
    dtype: TensorDtype,
) -> Result<f64> {
    let x = nonzero_vec(rng, n * heads * k);
    let w = rounded(nonzero_vec(rng, heads * m * k), dtype);
    let wt = backend.upload_weight(&w, &[heads, m, k], dtype)?;
    let got = backend.bmm(&backend.upload(&x, &[n, heads, k])?, &wt)?;
    if got.shape() != [n, heads, m] {
        return Ok(f64::INFINITY);
    }
    Ok(relative_error(
        &backend.download(&got)?,
        &reference::bmm(&x, &w, n, heads, k, m),
    ))
}

/// Weights kept in `dtype` ([`Backend::upload_weight`]) whose values are exactly that type's:
/// read back exactly; matmul, logits, embedding and fused_moe against the reference over those
/// values (exact widening for f16, [`BF16_WEIGHT_BOUND`] for bf16); and refused with a typed
/// error where an op takes f32 tensors.
fn half_weights<B: Backend>(
    backend: &B,
    rng: &mut SplitMix64,
    dtype: TensorDtype,
    push: &mut impl FnMut(String, f64, f64),
) -> Result<()> {
    let bound = match dtype {
        TensorDtype::Bf16 => BF16_WEIGHT_BOUND,
        _ => DENSE_BOUND,
    };
    let exact = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    // 70 rows: more than one of the CUDA kernel's row blocks, where a BLAS takes f16 weights.
    for &(m, k, n) in &[(1, 64, 48), (7, 67, 33), (33, 128, 96), (70, 64, 40)] {
        let x = nonzero_vec(rng, m * k);
        let w = rounded(nonzero_vec(rng, n * k), dtype);
        let wt = backend.upload_weight(&w, &[n, k], dtype)?;
        push(
            format!("{dtype:?} weight {n}x{k} read back"),
            relative_error(&backend.download(&wt)?, &exact(&w)),
            0.0,
        );
        let want = reference::matmul(&x, &w, m, k, n);
        let got = backend.matmul(&backend.upload(&x, &[m, k])?, &wt)?;
        push(
            format!("matmul {m}x{k}·({n}x{k} {dtype:?})ᵀ"),
            relative_error(&backend.download(&got)?, &want),
            bound,
        );
        let got = backend.logits(&backend.upload(&x, &[m, k])?, &wt)?;
        push(
            format!("logits {m}x{k}·({n}x{k} {dtype:?})ᵀ"),
            relative_error(&backend.download(&got)?, &want),
            bound,
        );
    }
    for &(n, heads, k, m) in BMM_SHAPES {
        push(
            format!("bmm {n}x{heads}x{k}·({heads}x{m}x{k} {dtype:?})ᵀ"),
            bmm_case(backend, rng, (n, heads, k, m), dtype)?,
            bound,
        );
    }
    {
        let table = rounded(nonzero_vec(rng, 10 * 8), dtype);
        let ids = [3u32, 0, 9, 3];
        let got = backend.embedding(&backend.upload_weight(&table, &[10, 8], dtype)?, &ids)?;
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&i| exact(&table[i as usize * 8..][..8]))
            .collect();
        push(
            format!("embedding 10x8 {dtype:?} [3,0,9,3]"),
            relative_error(&backend.download(&got)?, &want),
            0.0,
        );
    }
    // Experts in 16 bits: two matmuls with SiLU between them, so twice the matmul's bound.
    for &(n, d, e, i, top_k) in &[(1, 64, 8, 32, 2), (40, 40, 4, 20, 2)] {
        let routing = MoeRouting {
            top_k,
            renormalize: true,
            routed_scaling_factor: 1.0,
        };
        push(
            format!("fused_moe {n}x{d} top {top_k} of {e} {dtype:?} experts of {i}"),
            moe_case(backend, rng, (n, d, e, i), &routing, dtype)?,
            2.0 * bound,
        );
    }
    // A 16-bit weight where an op takes f32 (a backend that keeps weights in f32 has nothing
    // to refuse): a typed error, not a silent misreading of its bits.
    let w = backend.upload_weight(&rounded(nonzero_vec(rng, 4 * 8), dtype), &[4, 8], dtype)?;
    if w.dtype() != TensorDtype::F32 {
        let f32_ones = backend.upload(&[1.0; 8], &[8])?;
        let refused = [
            ("rms_norm", backend.rms_norm(&w, &f32_ones, 1e-6).err()),
            ("silu_mul", backend.silu_mul(&w).err()),
            (
                "matmul's x",
                backend
                    .matmul(&w, &backend.upload(&[1.0; 32], &[4, 8])?)
                    .err(),
            ),
        ];
        for (op, err) in refused {
            let ok = matches!(err, Some(AttentionError::Unsupported(_)));
            push(
                format!("{op} refuses a {dtype:?} weight"),
                if ok { 0.0 } else { f64::INFINITY },
                0.0,
            );
        }
    }
    Ok(())
}
