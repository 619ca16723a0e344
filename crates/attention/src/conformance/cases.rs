//! The attention cases (MHA/GQA/MQA, MLA, DoubleSparse over every page size and store dtype)
//! and the runner that checks one case on a backend against the f64 reference.

use std::fmt;

use kv_pool::rng::SplitMix64;
use kv_pool::{KvBuffer, KvDtype, KvLayout, KvShape, KvStore};

use crate::backend::Backend;
use crate::error::Result;
use crate::metadata::{BatchMetadata, RequestKv};
use crate::params::{AttentionParams, DoubleSparseConfig};
use crate::reference::{self, Heads};

use super::inputs::{nonzero_vec, scattered_slots};
use super::outcome::{attention_bound, relative_error, Outcome};

/// The attention geometry of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaseKind {
    /// MHA / GQA / MQA.
    Mha {
        /// Heads of `q` (a multiple of `kv_heads`: GQA when above it, MQA when `kv_heads` is 1).
        q_heads: usize,
        /// Heads the store keeps per token.
        kv_heads: usize,
        /// Elements per head, the same for keys and values here.
        head_dim: usize,
    },
    /// MLA in absorbed form.
    Mla {
        /// Heads of `q`; the store holds one latent row per token for all of them.
        heads: usize,
        /// Elements of the compressed KV (DeepSeek's `kv_lora_rank`), also the value dimension.
        kv_lora_rank: usize,
        /// Elements of the rotary key appended to each latent row (`qk_rope_head_dim`).
        rope_dim: usize,
    },
    /// DoubleSparse (dense extend, top-k decode).
    DoubleSparse {
        /// Heads of `q` (a multiple of `kv_heads`).
        q_heads: usize,
        /// Heads the store keeps per token.
        kv_heads: usize,
        /// Elements per head, keys and values.
        head_dim: usize,
        /// Label channels per KV head (the "heavy" channels decode scores tokens with).
        heavy_channels: usize,
        /// Tokens kept per query head in decode.
        top_k: usize,
    },
}

/// One attention conformance case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionCase {
    /// The attention kind and its head geometry.
    pub kind: CaseKind,
    /// The store's dtype; it sets the error bound ([`attention_bound`]).
    pub dtype: KvDtype,
    /// `P`, tokens per page of the store and the batch.
    pub page_size: u32,
    /// Per request `(prefix_len, extend_len)`; when every extend is 1 the case runs as a decode
    /// batch ([`BatchMetadata::new_decode`]).
    pub requests: Vec<(usize, usize)>,
    /// Seeds the generator of every input of the case (values and slot placement), so a
    /// failing case reruns alone.
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
    measure_case(backend, case, false)
}

/// [`run_attention_case`] with one element of a new key (a latent row for MLA) set to NaN:
/// first request, its middle new token. A NaN input must come out as NaN, never as a finite
/// wrong value: every output element the reference gives NaN (the rows that attend that token,
/// and no others: the causal mask is checked too) must be NaN, and the rest must be within the
/// usual bounds. An fp8 e4m3 store holds the NaN as its NaN byte, which every kernel must read
/// as NaN (a conversion by bit moves alone reads it as ±480).
pub fn run_nan_key_case<B: Backend>(backend: &B, case: &AttentionCase) -> Result<Outcome> {
    measure_case(backend, case, true)
}

/// Runs every case of [`nan_key_cases`] through [`run_nan_key_case`].
pub fn run_nan_key_suite<B: Backend>(backend: &B) -> Result<Vec<Outcome>> {
    nan_key_cases()
        .iter()
        .map(|case| run_nan_key_case(backend, case))
        .collect()
}

/// The outcome of [`run_case`]: errors by [`relative_error`], or by [`nan_pattern_error`] for
/// a case with a NaN key.
fn measure_case<B: Backend>(backend: &B, case: &AttentionCase, nan_key: bool) -> Result<Outcome> {
    let name = format!(
        "{} {case}{}",
        backend.name(),
        if nan_key { " nan key" } else { "" }
    );
    let bound = attention_bound(case.dtype);
    let error = if nan_key {
        nan_pattern_error
    } else {
        relative_error
    };
    Ok(match run_case(backend, case, nan_key)? {
        Err(reason) => Outcome::skipped(name, bound, reason),
        Ok(run) => Outcome::measured(name, error(&run.got, &run.want), bound)
            .with_stored(error(&run.got, &run.want_stored)),
    })
}

/// [`relative_error`] over the elements `want` has as numbers; infinite unless `got` is NaN
/// exactly where `want` is.
fn nan_pattern_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() || got.iter().zip(want).any(|(g, w)| g.is_nan() != w.is_nan()) {
        return f64::INFINITY;
    }
    let (g, w): (Vec<f32>, Vec<f64>) = got.iter().zip(want).filter(|(_, w)| !w.is_nan()).unzip();
    relative_error(&g, &w)
}

/// What one run of a case gives: the backend's output, the reference over the unquantized
/// inputs, and the reference over the values the store holds after the call.
struct CaseRun {
    got: Vec<f32>,
    want: Vec<f64>,
    want_stored: Vec<f64>,
}

/// Runs `case` (with a NaN key element when `nan_key`, as [`run_nan_key_case`] says), or
/// gives the backend's reason for not supporting its store.
fn run_case<B: Backend>(
    backend: &B,
    case: &AttentionCase,
    nan_key: bool,
) -> Result<std::result::Result<CaseRun, String>> {
    let mut rng = SplitMix64::new(case.seed);
    let p = case.page_size;
    let (shape, (qh, kvh, d, dv)) = match case.kind {
        CaseKind::Mha {
            q_heads,
            kv_heads,
            head_dim,
        } => {
            let (kv, hd) = (kv_heads as u32, head_dim as u32);
            let shape = KvShape::mha(kv, hd, hd, 2, case.dtype)?;
            (shape, (q_heads, kv_heads, head_dim, head_dim))
        }
        CaseKind::Mla {
            heads,
            kv_lora_rank,
            rope_dim,
        } => {
            let shape = KvShape::mla(kv_lora_rank as u32, rope_dim as u32, 2, case.dtype)?;
            (shape, (heads, 1, kv_lora_rank + rope_dim, kv_lora_rank))
        }
        CaseKind::DoubleSparse {
            q_heads,
            kv_heads,
            head_dim,
            heavy_channels,
            ..
        } => {
            let (kv, hd, hc) = (kv_heads as u32, head_dim as u32, heavy_channels as u32);
            let shape = KvShape::double_sparse(kv, hd, hd, hc, 2, case.dtype)?;
            (shape, (q_heads, kv_heads, head_dim, head_dim))
        }
    };
    if let Err(reason) = backend.kv_support(&shape) {
        return Ok(Err(reason));
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
    for (r, (s, &(prefix, extend))) in slots.iter().zip(&case.requests).enumerate() {
        let n = s.len();
        let mut k = nonzero_vec(&mut rng, n * k_row);
        if nan_key && r == 0 {
            k[(prefix + extend / 2) * k_row] = f32::NAN;
        }
        let v = nonzero_vec(&mut rng, n * v_row);
        store.write_kv(
            0,
            s,
            &nonzero_vec(&mut rng, n * k_row),
            &nonzero_vec(&mut rng, n * v_row),
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
    let q = nonzero_vec(&mut rng, n * qh * d);
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
    // The reference over request r's keys and values `k`, `v` (full rows, prefix first).
    let reference_of = |r: usize, k: &[f32], v: &[f32]| -> Result<Vec<f64>> {
        let prefix = case.requests[r].0;
        let qr = &q[meta.qo_range(r).start * qh * d..meta.qo_range(r).end * qh * d];
        Ok(match (case.kind, &params.double_sparse) {
            (CaseKind::Mla { .. }, _) => {
                reference::attention_mla(qh, dv, d - dv, qr, k, prefix, params.scale)
            }
            (_, Some(ds)) if meta.is_decode() => {
                let mut labels = vec![0.0f32; slots[r].len() * shape.row_elems(KvBuffer::Label)];
                store.read_f32(LAYER, KvBuffer::Label, &slots[r], &mut labels)?;
                reference::double_sparse_decode(
                    heads,
                    qr,
                    k,
                    v,
                    &labels,
                    &ds.channels,
                    ds.top_k,
                    params.scale,
                )
            }
            _ => reference::attention(heads, qr, k, v, prefix, params.scale),
        })
    };
    let mut want = Vec::with_capacity(got.len());
    let mut want_stored = Vec::with_capacity(got.len());
    for r in 0..case.requests.len() {
        want.extend(reference_of(r, &kf[r], &vf[r])?);
        // What the store holds after the call (the prefix, and the new tokens it wrote).
        let mut ks = vec![0.0f32; slots[r].len() * k_row];
        store.read_f32(LAYER, KvBuffer::Key, &slots[r], &mut ks)?;
        let mut vs = vec![0.0f32; if mla { 0 } else { slots[r].len() * v_row }];
        if !mla {
            store.read_f32(LAYER, KvBuffer::Value, &slots[r], &mut vs)?;
        }
        want_stored.extend(reference_of(r, &ks, &vs)?);
    }
    Ok(Ok(CaseRun {
        got,
        want,
        want_stored,
    }))
}

/// Extend batches for a prefill kernel: the quick suite's MHA/GQA extend cases (head dims 64
/// and 128; groups of 1, 4, 7 and 8; pages of 1, 16 and 64) with `dtypes` in rotation, and
/// long extends (150 new tokens from no prefix, 66 after a prefix of 70, and a one-token
/// request beside them) at 32/8 × 128 and 14/2 × 64 over pages of 16 and 24, and short and
/// long extends after long prefixes (5 new tokens after 700, 70 after 260) at 8/2 × 128
/// (`dtypes` in rotation again).
pub fn extend_cases(dtypes: &[KvDtype]) -> Vec<AttentionCase> {
    let mut cases: Vec<AttentionCase> = attention_cases(SuiteSize::Quick)
        .into_iter()
        .filter(|c| matches!(c.kind, CaseKind::Mha { .. }))
        .filter(|c| c.requests.iter().any(|&(_, extend)| extend > 1))
        .enumerate()
        .map(|(i, case)| AttentionCase {
            dtype: dtypes[i % dtypes.len()],
            ..case
        })
        .collect();
    let mut i = 0;
    for (q_heads, kv_heads, head_dim) in [(32, 8, 128), (14, 2, 64)] {
        for page_size in [16, 24] {
            cases.push(AttentionCase {
                kind: CaseKind::Mha {
                    q_heads,
                    kv_heads,
                    head_dim,
                },
                dtype: dtypes[i % dtypes.len()],
                page_size,
                requests: vec![(0, 150), (70, 66), (5, 1)],
                seed: 0x9F + i as u64,
            });
            i += 1;
        }
    }
    // A short extend after a long prefix (a chat's next message), beside a longer one and a
    // fresh prompt: too few tiles to fill a GPU, so a device splits their KV range.
    cases.push(AttentionCase {
        kind: CaseKind::Mha {
            q_heads: 8,
            kv_heads: 2,
            head_dim: 128,
        },
        dtype: dtypes[i % dtypes.len()],
        page_size: 16,
        requests: vec![(700, 5), (260, 70), (0, 3)],
        seed: 0xA7,
    });
    cases
}

/// `count` extend batches drawn from `seed`, for prefill kernels beyond [`extend_cases`]'
/// fixed shapes: KV heads 1 to 4, GQA groups 1 to 8 (every packing of query heads: 2 and 3 as
/// well as the suite's 1, 4, 7 and 8), head dims 64 and 128, pages of 1 to 64 tokens, f16,
/// bf16 and fp8 stores, and 1 to 3 requests of 1 to 100 new tokens after 0 to 300 cached ones.
pub fn random_extend_cases(count: usize, seed: u64) -> Vec<AttentionCase> {
    let mut rng = SplitMix64::new(seed);
    let dtypes = [
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Fp8E4m3,
        KvDtype::Fp8E5m2,
    ];
    (0..count)
        .map(|_| {
            let kv_heads = 1 + rng.below(4);
            let group = 1 + rng.below(8);
            let requests = (0..1 + rng.below(3))
                .map(|_| (rng.below(301), 1 + rng.below(100)))
                .collect::<Vec<_>>();
            AttentionCase {
                kind: CaseKind::Mha {
                    q_heads: kv_heads * group,
                    kv_heads,
                    head_dim: [64, 128][rng.below(2)],
                },
                dtype: dtypes[rng.below(dtypes.len())],
                page_size: [1, 2, 16, 24, 64][rng.below(5)],
                // an extend batch: a lone request of one new token would make a decode batch
                requests: if requests.iter().all(|r| r.1 == 1) {
                    vec![(requests[0].0, 2)]
                } else {
                    requests
                },
                seed: rng.next_u64(),
            }
        })
        .collect()
}

/// Cases for [`run_nan_key_case`]: an extend batch (the NaN token mid-extend, after a prefix)
/// and a decode batch, each of GQA 8/2 × 64, MLA 16 × (512 + 64) (shapes every device form
/// serves) and DoubleSparse 8/2 × 64, over pages of 16, in every store dtype; the first
/// request's prefix is long enough (280 and 300 positions) for a device to split its KV range.
///
/// DoubleSparse labels every channel (64 of 64), so the NaN key's label scores NaN for every
/// query head of its KV head, and the top-k keeps it (a positive NaN orders above every
/// number, as `f32::total_cmp` orders it); its 7 companions fall anywhere in the 301
/// positions, so for some heads the NaN key is the only kept key of its block of positions.
pub fn nan_key_cases() -> Vec<AttentionCase> {
    let kinds = [
        CaseKind::Mha {
            q_heads: 8,
            kv_heads: 2,
            head_dim: 64,
        },
        CaseKind::Mla {
            heads: 16,
            kv_lora_rank: 512,
            rope_dim: 64,
        },
        CaseKind::DoubleSparse {
            q_heads: 8,
            kv_heads: 2,
            head_dim: 64,
            heavy_channels: 64,
            top_k: 8,
        },
    ];
    let mut cases = Vec::new();
    for dtype in KvDtype::ALL {
        for kind in kinds {
            // prefixes past two 128-position splits, so the split forms merge a NaN state
            for requests in [vec![(281, 10), (0, 7)], vec![(300, 1), (9, 1)]] {
                cases.push(AttentionCase {
                    kind,
                    dtype,
                    page_size: 16,
                    requests,
                    seed: 0x4E4E + cases.len() as u64,
                });
            }
        }
    }
    cases
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

/// The attention cases of the suite: shapes 32/8, 8/1, 4/4, 16/16, 14/2 (a group of 7, no
/// multiple of a GPU block's heads) over head dims 64 and 128,
/// MLA 512+64 and 32+16, DoubleSparse; page sizes 1, 16, 64; every store dtype; prefixes of
/// length 0, page-aligned and not; extend and decode batches of requests of different lengths.
pub fn attention_cases(size: SuiteSize) -> Vec<AttentionCase> {
    let mha = [
        (32, 8, 128),
        (8, 1, 64),
        (4, 4, 64),
        (16, 16, 128),
        (14, 2, 64),
    ];
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
