//! The backend conformance suite, written once as functions generic over [`Backend`]: the CPU
//! backend runs it in this crate's tests, and every device backend calls the same functions.
//!
//! Inputs come from a seeded [`SplitMix`] (never zeros). Attention cases allocate their slots
//! with kv-pool's allocators after shuffling the free list (so slots are scattered and
//! non-contiguous), write the cached prefix straight into the store, run one batched attention
//! call through the backend (which writes the new tokens' K/V and attends), and compare with the
//! f64 [`reference`](crate::reference) computed from the unquantized inputs. The error measure
//! is `‖out − ref‖₂ / ‖ref‖₂` over the whole batch output, within [`attention_bound`] of the
//! store dtype.

use std::fmt;

use kv_pool::{
    Allocator, ExtendRequest, KvBuffer, KvDtype, KvLayout, KvShape, KvStore, PagedAllocator, Slot,
    TokenAllocator,
};

use crate::backend::{
    AttentionParams, Backend, DoubleSparseConfig, RopeConfig, RopeScaling, RopeStyle,
};
use crate::error::Result;
use crate::metadata::{BatchMetadata, RequestKv};
use crate::reference::{self, Heads};
use crate::rng::SplitMix;

/// The bound on `‖out − ref‖ / ‖ref‖` for attention over a store of `dtype`.
///
/// The reference uses the unquantized K/V, so the error is dominated by storage rounding: each
/// stored element is off by at most `u` relative (f16 `2⁻¹¹`, bf16 `2⁻⁸`, e4m3 `2⁻⁴`, e5m2
/// `2⁻³`, [`kv_pool::dtype::max_relative_error`]). The value error carries into the output at
/// most `u` relative, and the key error moves each score by at most `u · scale · Σ|q_i k_i|`,
/// which for our inputs (`|x| < 1`, scale `2/√d`) changes softmax weights by well under `2u`
/// relative. So `4u` bounds the total with margin; f32 stores are exact and only f32
/// accumulation over at most a few thousand terms remains, bounded by `1e-5`.
pub fn attention_bound(dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::F32 => 1e-5,
        d => 4.0 * kv_pool::dtype::max_relative_error(d) as f64,
    }
}

/// The attention geometry of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaseKind {
    /// MHA / GQA / MQA.
    Mha {
        /// Query heads.
        q_heads: usize,
        /// KV heads.
        kv_heads: usize,
        /// Head dimension (keys and values).
        head_dim: usize,
    },
    /// MLA in absorbed form.
    Mla {
        /// Query heads.
        heads: usize,
        /// Latent dimension.
        kv_lora_rank: usize,
        /// Rotary key dimension.
        rope_dim: usize,
    },
    /// DoubleSparse (dense extend, top-k decode).
    DoubleSparse {
        /// Query heads.
        q_heads: usize,
        /// KV heads.
        kv_heads: usize,
        /// Head dimension.
        head_dim: usize,
        /// Label channels per KV head.
        heavy_channels: usize,
        /// Tokens kept per query head in decode.
        top_k: usize,
    },
}

/// One attention conformance case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionCase {
    /// Geometry.
    pub kind: CaseKind,
    /// Store dtype.
    pub dtype: KvDtype,
    /// Page size.
    pub page_size: u32,
    /// Per request `(prefix_len, extend_len)`; when every extend is 1 the case runs as a decode
    /// batch ([`BatchMetadata::new_decode`]).
    pub requests: Vec<(usize, usize)>,
    /// Seed of every random input.
    pub seed: u64,
}

impl fmt::Display for AttentionCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            CaseKind::Mha {
                q_heads,
                kv_heads,
                head_dim,
            } => write!(f, "mha {q_heads}/{kv_heads}x{head_dim}")?,
            CaseKind::Mla {
                heads,
                kv_lora_rank,
                rope_dim,
            } => write!(f, "mla {heads}x({kv_lora_rank}+{rope_dim})")?,
            CaseKind::DoubleSparse {
                q_heads,
                kv_heads,
                head_dim,
                heavy_channels,
                top_k,
            } => write!(
                f,
                "ds {q_heads}/{kv_heads}x{head_dim} hc={heavy_channels} k={top_k}"
            )?,
        }
        write!(
            f,
            " {} P={} reqs={:?}",
            self.dtype, self.page_size, self.requests
        )
    }
}

/// The result of one check.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// What was checked.
    pub name: String,
    /// `‖out − ref‖ / ‖ref‖`.
    pub error: f64,
    /// The bound it must meet.
    pub bound: f64,
    /// `Some(reason)` when the backend does not support the case
    /// ([`Backend::kv_support`]): it was not run, and counts as passed.
    pub skipped: Option<String>,
}

impl Outcome {
    /// A measured check.
    pub fn measured(name: String, error: f64, bound: f64) -> Self {
        Outcome {
            name,
            error,
            bound,
            skipped: None,
        }
    }

    /// Whether the error is within the bound (NaN fails), or the case was skipped.
    pub fn passed(&self) -> bool {
        self.skipped.is_some() || self.error <= self.bound
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(reason) = &self.skipped {
            return write!(f, "skip {:<60} {reason}", self.name);
        }
        write!(
            f,
            "{} {:<60} err {:.3e} bound {:.1e}",
            if self.passed() { "ok  " } else { "FAIL" },
            self.name,
            self.error,
            self.bound
        )
    }
}

/// `‖got − want‖ / ‖want‖`.
pub fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}

/// Allocates slots for a batch the way the scheduler does, on a shuffled pool: every page is
/// allocated, then freed one at a time in random order; then all prefixes are allocated in one
/// `alloc_extend`, then all extends in a second one (continuing partial prefix pages). Returns
/// each request's slots for positions `0..prefix + extend`. `size` must be a multiple of
/// `page_size` and large enough.
pub fn scattered_slots(
    page_size: u32,
    size: usize,
    requests: &[(usize, usize)],
    rng: &mut SplitMix,
) -> Result<Vec<Vec<Slot>>> {
    let mut alloc: Box<dyn Allocator> = if page_size == 1 {
        Box::new(TokenAllocator::new(size)?)
    } else {
        Box::new(PagedAllocator::new(size, page_size)?)
    };
    let mut all = Vec::new();
    alloc.alloc(size, &mut all)?;
    let mut pages: Vec<Slot> = all.into_iter().step_by(page_size as usize).collect();
    rng.shuffle(&mut pages);
    for s in pages {
        alloc.free(&[s])?;
    }
    let mut slots: Vec<Vec<Slot>> = vec![Vec::new(); requests.len()];
    let with_prefix: Vec<usize> = (0..requests.len()).filter(|&r| requests[r].0 > 0).collect();
    let batch: Vec<ExtendRequest> = with_prefix
        .iter()
        .map(|&r| ExtendRequest {
            prefix_len: 0,
            seq_len: requests[r].0,
            last_loc: None,
        })
        .collect();
    let mut out = Vec::new();
    alloc.alloc_extend(&batch, &mut out)?;
    let mut it = out.into_iter();
    for &r in &with_prefix {
        slots[r].extend(it.by_ref().take(requests[r].0));
    }
    let batch: Vec<ExtendRequest> = requests
        .iter()
        .zip(&slots)
        .map(|(&(prefix, ext), s)| ExtendRequest {
            prefix_len: prefix,
            seq_len: prefix + ext,
            last_loc: s.last().copied(),
        })
        .collect();
    let mut out = Vec::new();
    alloc.alloc_extend(&batch, &mut out)?;
    let mut it = out.into_iter();
    for (s, &(_, ext)) in slots.iter_mut().zip(requests) {
        s.extend(it.by_ref().take(ext));
    }
    Ok(slots)
}

/// Pool size (a multiple of the page size) with room for the batch twice over.
fn pool_size(page_size: u32, requests: &[(usize, usize)]) -> usize {
    let p = page_size as usize;
    let pages: usize = requests.iter().map(|&(a, b)| (a + b).div_ceil(p)).sum();
    (2 * pages + 4) * p
}

/// The layer the cases attend in (layer 0 holds unrelated data at the same slots).
const LAYER: usize = 1;

/// Runs one attention case through `backend` and measures it against the f64 reference. A
/// case whose store the backend does not support ([`Backend::kv_support`]) is not run: its
/// outcome is skipped, with the backend's reason.
pub fn run_attention_case<B: Backend>(backend: &B, case: &AttentionCase) -> Result<Outcome> {
    let mut rng = SplitMix(case.seed);
    let p = case.page_size;
    let (shape, qh, kvh, d, dv) = match case.kind {
        CaseKind::Mha {
            q_heads,
            kv_heads,
            head_dim,
        } => (
            KvShape::mha(
                kv_heads as u32,
                head_dim as u32,
                head_dim as u32,
                2,
                case.dtype,
            )?,
            q_heads,
            kv_heads,
            head_dim,
            head_dim,
        ),
        CaseKind::Mla {
            heads,
            kv_lora_rank,
            rope_dim,
        } => (
            KvShape::mla(kv_lora_rank as u32, rope_dim as u32, 2, case.dtype)?,
            heads,
            1,
            kv_lora_rank + rope_dim,
            kv_lora_rank,
        ),
        CaseKind::DoubleSparse {
            q_heads,
            kv_heads,
            head_dim,
            heavy_channels,
            ..
        } => (
            KvShape::double_sparse(
                kv_heads as u32,
                head_dim as u32,
                head_dim as u32,
                heavy_channels as u32,
                2,
                case.dtype,
            )?,
            q_heads,
            kv_heads,
            head_dim,
            head_dim,
        ),
    };
    if let Err(reason) = backend.kv_support(&shape) {
        return Ok(Outcome {
            name: format!("{} {case}", backend.name()),
            error: 0.0,
            bound: attention_bound(case.dtype),
            skipped: Some(reason),
        });
    }
    let mla = matches!(case.kind, CaseKind::Mla { .. });
    let (k_row, v_row) = (
        shape.row_elems(KvBuffer::Key),
        shape.row_elems(KvBuffer::Value),
    );
    let layout = KvLayout::new(shape, p, pool_size(p, &case.requests))?;
    let mut store = backend.new_kv_store(layout)?;
    if case.dtype.is_fp8() {
        store.set_scales(LAYER, 0.5, 0.25)?;
    }
    let slots = scattered_slots(p, layout.size, &case.requests, &mut rng)?;
    let params = AttentionParams {
        scale: 2.0 / (d as f32).sqrt(),
        double_sparse: match case.kind {
            CaseKind::DoubleSparse {
                heavy_channels,
                top_k,
                ..
            } => {
                let mut channels = Vec::new();
                for _ in 0..kvh {
                    let mut all: Vec<u32> = (0..d as u32).collect();
                    rng.shuffle(&mut all);
                    channels.extend_from_slice(&all[..heavy_channels]);
                }
                Some(DoubleSparseConfig { top_k, channels })
            }
            _ => None,
        },
    };
    let labels_of = |k: &[f32]| -> Vec<f32> {
        let ds = params.double_sparse.as_ref().expect("DoubleSparse case");
        let hc = ds.channels.len() / kvh;
        k.chunks_exact(k_row)
            .flat_map(|row| {
                ds.channels
                    .iter()
                    .enumerate()
                    .map(move |(i, &c)| row[(i / hc) * d + c as usize])
            })
            .collect()
    };
    // Full K/V per request; the prefix goes straight into the store (as if cached), layer 0
    // gets unrelated values at the same slots.
    let mut kf = Vec::new();
    let mut vf = Vec::new();
    for (s, &(prefix, _)) in slots.iter().zip(&case.requests) {
        let n = s.len();
        let k = rng.nonzero_vec(n * k_row);
        let v = rng.nonzero_vec(n * v_row);
        store.write_kv(
            0,
            s,
            &rng.nonzero_vec(n * k_row),
            &rng.nonzero_vec(n * v_row),
        )?;
        store.write_kv(
            LAYER,
            &s[..prefix],
            &k[..prefix * k_row],
            &v[..prefix * v_row],
        )?;
        if params.double_sparse.is_some() {
            store.write_labels(LAYER, &s[..prefix], &labels_of(&k[..prefix * k_row]))?;
        }
        kf.push(k);
        vf.push(v);
    }
    let reqs: Vec<RequestKv<'_>> = slots
        .iter()
        .zip(&case.requests)
        .map(|(s, &(_, ext))| RequestKv {
            slots: s,
            extend_len: ext,
        })
        .collect();
    let meta = if case.requests.iter().all(|&(_, ext)| ext == 1) {
        BatchMetadata::new_decode(p, &reqs)?
    } else {
        BatchMetadata::new(p, &reqs)?
    };
    let plan = backend.plan(&meta)?;
    let n = meta.num_tokens();
    let q = rng.nonzero_vec(n * qh * d);
    let mut k_new = Vec::new();
    let mut v_new = Vec::new();
    for ((k, v), &(prefix, _)) in kf.iter().zip(&vf).zip(&case.requests) {
        k_new.extend_from_slice(&k[prefix * k_row..]);
        v_new.extend_from_slice(&v[prefix * v_row..]);
    }
    let qt = backend.upload(&q, &[n, qh, d])?;
    let out = if mla {
        let lt = backend.upload(&k_new, &[n, d])?;
        backend.attention_mla(LAYER, &plan, &mut store, &qt, &lt, &params)?
    } else {
        let kt = backend.upload(&k_new, &[n, kvh, d])?;
        let vt = backend.upload(&v_new, &[n, kvh, dv])?;
        backend.attention(LAYER, &plan, &mut store, &qt, &kt, &vt, &params)?
    };
    let got = backend.download(&out)?;
    let heads = Heads {
        q_heads: qh,
        kv_heads: kvh,
        head_dim: d,
        v_head_dim: dv,
    };
    let mut want = Vec::with_capacity(got.len());
    for (r, &(prefix, _)) in case.requests.iter().enumerate() {
        let qr = &q[meta.qo_range(r).start * qh * d..meta.qo_range(r).end * qh * d];
        let part = match (case.kind, &params.double_sparse) {
            (CaseKind::Mla { .. }, _) => {
                reference::attention_mla(qh, dv, d - dv, qr, &kf[r], prefix, params.scale)
            }
            (_, Some(ds)) if meta.is_decode() => {
                let mut labels = vec![0.0f32; slots[r].len() * shape.row_elems(KvBuffer::Label)];
                store.read_f32(LAYER, KvBuffer::Label, &slots[r], &mut labels)?;
                reference::double_sparse_decode(
                    heads,
                    qr,
                    &kf[r],
                    &vf[r],
                    &labels,
                    &ds.channels,
                    ds.top_k,
                    params.scale,
                )
            }
            _ => reference::attention(heads, qr, &kf[r], &vf[r], prefix, params.scale),
        };
        want.extend(part);
    }
    Ok(Outcome::measured(
        format!("{} {case}", backend.name()),
        relative_error(&got, &want),
        attention_bound(case.dtype),
    ))
}

/// How much of the suite to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuiteSize {
    /// Every shape, page size and dtype at least once with short sequences (seconds in a
    /// debug build).
    Quick,
    /// Every shape × page size × dtype with longer sequences (for release builds).
    Full,
}

/// The attention cases of the suite: shapes 32/8, 8/1, 4/4, 16/16 over head dims 64 and 128,
/// MLA 512+64 and 32+16, DoubleSparse; page sizes 1, 16, 64; every store dtype; prefixes of
/// length 0, page-aligned and not; extend and decode batches of requests of different lengths.
pub fn attention_cases(size: SuiteSize) -> Vec<AttentionCase> {
    let mha = [(32, 8, 128), (8, 1, 64), (4, 4, 64), (16, 16, 128)];
    let mut cases = Vec::new();
    let mut seed = 1u64;
    let mut next_seed = || {
        seed += 1;
        seed
    };
    let scale = match size {
        SuiteSize::Quick => 1,
        SuiteSize::Full => 8,
    };
    let extend = |s: usize| vec![(0, 37 * s), (64 * s, 5 * s), (50 * s, 21), (130 * s, 1)];
    let decode = |s: usize| vec![(63 * s, 1), (200 * s, 1), (17, 1), (1, 1), (128 * s, 1)];
    let mut i = 0usize;
    for &(qh, kvh, d) in &mha {
        for &p in &[1u32, 16, 64] {
            let dtypes: Vec<KvDtype> = match size {
                SuiteSize::Quick => vec![KvDtype::ALL[i % 5], KvDtype::ALL[(i + 2) % 5]],
                SuiteSize::Full => KvDtype::ALL.to_vec(),
            };
            i += 1;
            for dtype in dtypes {
                for requests in [extend(scale), decode(scale)] {
                    cases.push(AttentionCase {
                        kind: CaseKind::Mha {
                            q_heads: qh,
                            kv_heads: kvh,
                            head_dim: d,
                        },
                        dtype,
                        page_size: p,
                        requests,
                        seed: next_seed(),
                    });
                }
            }
        }
    }
    let mla = [(16, 512, 64), (4, 32, 16)];
    for (j, &(heads, r, rope)) in mla.iter().enumerate() {
        for &p in &[1u32, 16, 64] {
            let dtypes: Vec<KvDtype> = match size {
                SuiteSize::Quick => vec![KvDtype::ALL[(j + p as usize) % 5]],
                SuiteSize::Full => KvDtype::ALL.to_vec(),
            };
            for dtype in dtypes {
                for requests in [extend(scale), decode(scale)] {
                    cases.push(AttentionCase {
                        kind: CaseKind::Mla {
                            heads,
                            kv_lora_rank: r,
                            rope_dim: rope,
                        },
                        dtype,
                        page_size: p,
                        requests,
                        seed: next_seed(),
                    });
                }
            }
        }
    }
    let ds = [(8, 2, 64, 16, 24), (4, 4, 128, 8, 64)];
    for &(qh, kvh, d, hc, top_k) in &ds {
        for &p in &[1u32, 16] {
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
                for requests in [extend(scale), decode(scale)] {
                    cases.push(AttentionCase {
                        kind: CaseKind::DoubleSparse {
                            q_heads: qh,
                            kv_heads: kvh,
                            head_dim: d,
                            heavy_channels: hc,
                            top_k,
                        },
                        dtype,
                        page_size: p,
                        requests,
                        seed: next_seed(),
                    });
                }
            }
        }
    }
    cases
}

/// Runs every attention case; an `Err` from the backend is reported as an infinite error.
pub fn run_attention_suite<B: Backend>(backend: &B, size: SuiteSize) -> Vec<Outcome> {
    attention_cases(size)
        .iter()
        .map(|case| {
            run_attention_case(backend, case).unwrap_or_else(|e| {
                Outcome::measured(
                    format!("{} {case}: {e}", backend.name()),
                    f64::INFINITY,
                    attention_bound(case.dtype),
                )
            })
        })
        .collect()
}

/// Panics with the full report if any outcome failed (for tests). Skipped outcomes pass; each
/// is printed with its reason, so a skip is never silent.
pub fn assert_all_passed(outcomes: &[Outcome]) {
    for o in outcomes.iter().filter(|o| o.skipped.is_some()) {
        println!("{o}");
    }
    let report: String = outcomes.iter().map(|o| format!("{o}\n")).collect();
    assert!(
        outcomes.iter().all(Outcome::passed),
        "conformance failures:\n{report}"
    );
}

/// Bound for the f32 dense ops.
const DENSE_BOUND: f64 = 1e-5;

/// Runs the dense-op checks (matmul, RMSNorm, rotary variants, SiLU-and-mul, residual add,
/// embedding, logits) against the f64 reference.
pub fn run_dense_suite<B: Backend>(backend: &B) -> Result<Vec<Outcome>> {
    let mut rng = SplitMix(0xD15E);
    let mut out = Vec::new();
    let mut push = |name: String, error: f64, bound: f64| {
        out.push(Outcome::measured(
            format!("{} {name}", backend.name()),
            error,
            bound,
        ))
    };
    for &(m, k, n) in &[(1, 64, 48), (7, 67, 33), (33, 128, 96), (64, 256, 17)] {
        let x = rng.nonzero_vec(m * k);
        let w = rng.nonzero_vec(n * k);
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
    for &(m, d) in &[(1, 64), (5, 96), (3, 4096)] {
        let x = rng.nonzero_vec(m * d);
        let w = rng.nonzero_vec(d);
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
        let x = rng.nonzero_vec(n * heads * cfg.head_dim);
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
        let x = rng.nonzero_vec(m * 2 * d);
        let got = backend.silu_mul(&backend.upload(&x, &[m, 2 * d])?)?;
        push(
            format!("silu_mul {m}x{d}"),
            relative_error(&backend.download(&got)?, &reference::silu_mul(&x, d)),
            DENSE_BOUND,
        );
    }
    {
        let (a, b) = (rng.nonzero_vec(24), rng.nonzero_vec(24));
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
        let table = rng.nonzero_vec(10 * 8);
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
    Ok(out)
}
