//! The CPU backend: f32 tensors in host memory, a batch-invariant matmul, and paged attention
//! over a [`HostKvStore`] of any dtype (f32, f16, bf16, fp8), converted to f32 on read. Where
//! the CPU has AVX2, FMA and F16C (detected at run time) the matmul and the dense attention
//! kernel run hand-vectorised (`simd`), reading f32, f16 and bf16 rows in place from the store.

mod attention;
mod dense;
#[cfg(target_arch = "x86_64")]
mod simd;

use kv_pool::store::check;
use kv_pool::{HostKvStore, KvBuffer, KvKind, KvLayout, KvStore};

use crate::backend::{AttentionParams, Backend, DeviceTensor, RopeConfig, RopeStyle, TensorDtype};
use crate::error::{AttentionError, Result};
use crate::metadata::BatchMetadata;

use attention::{Geom, RowSource, Scratch, Sources};

/// Work on one request: `(request, its q rows, its output rows, scratch)`.
type RequestFn<'a> = dyn Fn(usize, &[f32], &mut [f32], &mut Scratch) + Sync + 'a;

/// A host tensor: row-major f32 data and its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl CpuTensor {
    /// Wraps `data` with `shape` (the product of the shape must equal `data.len()`).
    pub fn new(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if expected != data.len() {
            return Err(AttentionError::LengthMismatch {
                what: "tensor data",
                expected,
                got: data.len(),
            });
        }
        Ok(CpuTensor {
            shape: shape.to_vec(),
            data,
        })
    }

    /// The elements, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Unwraps the elements.
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }
}

impl DeviceTensor for CpuTensor {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> TensorDtype {
        TensorDtype::F32
    }
}

/// Settings of the [`CpuBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuConfig {
    /// Worker threads for attention (`≥ 1`); the batch is split by request. Default 1.
    pub threads: usize,
    /// Batch-invariant execution (default `true`): a request's attention output is bitwise
    /// independent of the rest of the batch, of prompt chunking, of prefix caching and of slot
    /// placement. Every kernel of this backend currently runs in this mode; `false` only
    /// permits future kernels that trade the guarantee for speed (e.g. split-KV decode).
    pub deterministic: bool,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            threads: 1,
            deterministic: true,
        }
    }
}

/// The CPU backend (see the [module docs](self)).
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    config: CpuConfig,
}

/// The CPU backend's per-batch plan: the validated metadata.
#[derive(Debug, Clone)]
pub struct CpuPlan {
    meta: BatchMetadata,
}

impl CpuPlan {
    /// The batch metadata the plan was built from.
    pub fn metadata(&self) -> &BatchMetadata {
        &self.meta
    }
}

fn shape_err(what: &'static str, expected: &[usize], got: &[usize]) -> AttentionError {
    AttentionError::ShapeMismatch {
        what,
        expected: expected.to_vec(),
        got: got.to_vec(),
    }
}

fn expect_shape(what: &'static str, t: &CpuTensor, expected: &[usize]) -> Result<()> {
    if t.shape != expected {
        return Err(shape_err(what, expected, &t.shape));
    }
    Ok(())
}

fn expect_rank(what: &'static str, t: &CpuTensor, rank: usize) -> Result<()> {
    if t.shape.len() != rank {
        return Err(AttentionError::ShapeMismatch {
            what,
            expected: vec![0; rank],
            got: t.shape.clone(),
        });
    }
    Ok(())
}

impl CpuBackend {
    /// A backend with `config`. `threads` must be at least 1.
    pub fn new(config: CpuConfig) -> Result<Self> {
        if config.threads == 0 {
            return Err(AttentionError::InvalidConfig {
                field: "threads",
                reason: "must be at least 1".into(),
            });
        }
        Ok(CpuBackend { config })
    }

    /// The backend's settings.
    pub fn config(&self) -> &CpuConfig {
        &self.config
    }

    /// Checks the plan against the store and the layer.
    fn check_plan(&self, layer: usize, plan: &CpuPlan, layout: &KvLayout) -> Result<()> {
        check::layer(layout, layer)?;
        if plan.meta.page_size() != layout.page_size {
            return Err(AttentionError::PageSizeMismatch {
                plan: plan.meta.page_size(),
                store: layout.page_size,
            });
        }
        if let Some(max) = plan.meta.max_slot() {
            check::slots(layout, &[max])?;
        }
        Ok(())
    }

    /// Runs `f(request, q_rows, out_rows, scratch)` for every request, splitting requests over
    /// `threads` workers by contiguous ranges of roughly equal work.
    fn for_each_request(
        &self,
        meta: &BatchMetadata,
        q: &[f32],
        q_row: usize,
        out: &mut [f32],
        out_row: usize,
        f: &RequestFn<'_>,
    ) {
        let n = meta.num_requests();
        let work = |r: usize| meta.kv_len(r) * meta.extend_len(r) + 1;
        let threads = self.config.threads.min(n).max(1);
        let run = |range: std::ops::Range<usize>, out: &mut [f32], base: usize| {
            let mut sc = Scratch::default();
            for r in range {
                let rows = meta.qo_range(r);
                f(
                    r,
                    &q[rows.start * q_row..rows.end * q_row],
                    &mut out[(rows.start - base) * out_row..(rows.end - base) * out_row],
                    &mut sc,
                );
            }
        };
        if threads == 1 {
            run(0..n, out, 0);
            return;
        }
        let total: usize = (0..n).map(work).sum();
        let mut bounds = vec![0];
        let mut acc = 0;
        for r in 0..n {
            acc += work(r);
            if acc * threads >= total * bounds.len() && bounds.len() < threads {
                bounds.push(r + 1);
            }
        }
        if *bounds.last().unwrap() != n {
            bounds.push(n);
        }
        std::thread::scope(|s| {
            let mut rest = out;
            for w in bounds.windows(2) {
                let (a, b) = (w[0], w[1]);
                let base = meta.qo_indptr()[a];
                let rows = meta.qo_indptr()[b] - base;
                let (mine, tail) = rest.split_at_mut(rows * out_row);
                rest = tail;
                let run = &run;
                s.spawn(move || run(a..b, mine, base));
            }
        });
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type KvStore = HostKvStore;
    type Plan = CpuPlan;

    fn name(&self) -> &str {
        "cpu"
    }

    fn new_kv_store(&self, layout: KvLayout) -> Result<HostKvStore> {
        Ok(HostKvStore::new(layout)?)
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<CpuTensor> {
        CpuTensor::new(data.to_vec(), shape)
    }

    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn reshape(&self, t: CpuTensor, shape: &[usize]) -> Result<CpuTensor> {
        if shape.iter().product::<usize>() != t.data.len() {
            return Err(shape_err("reshape", shape, &t.shape));
        }
        Ok(CpuTensor {
            shape: shape.to_vec(),
            data: t.data,
        })
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuTensor) -> Result<CpuTensor> {
        expect_rank("x", x, 2)?;
        expect_rank("w", w, 2)?;
        let (m, k, n) = (x.shape[0], x.shape[1], w.shape[0]);
        expect_shape("w", w, &[n, k])?;
        let mut out = vec![0.0; m * n];
        dense::matmul(&x.data, &w.data, m, k, n, &mut out);
        CpuTensor::new(out, &[m, n])
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        expect_rank("x", x, 2)?;
        expect_shape("weight", weight, &[x.shape[1]])?;
        let mut out = vec![0.0; x.data.len()];
        if !out.is_empty() {
            dense::rms_norm(&x.data, &weight.data, eps, &mut out);
        }
        CpuTensor::new(out, &x.shape)
    }

    fn rotary(&self, x: &mut CpuTensor, positions: &[u32], cfg: &RopeConfig) -> Result<()> {
        let inv = cfg.inv_freqs()?;
        expect_rank("x", x, 3)?;
        let (n, heads) = (x.shape[0], x.shape[1]);
        expect_shape("x", x, &[n, heads, cfg.head_dim])?;
        if positions.len() != n {
            return Err(AttentionError::LengthMismatch {
                what: "positions",
                expected: n,
                got: positions.len(),
            });
        }
        let half = cfg.rotary_dim / 2;
        let mut cs = vec![(0.0f32, 0.0f32); half];
        for (tok, &pos) in x.data.chunks_exact_mut(heads * cfg.head_dim).zip(positions) {
            for (c, &f) in cs.iter_mut().zip(&inv) {
                let (s, co) = (pos as f64 * f).sin_cos();
                *c = (co as f32, s as f32);
            }
            for head in tok.chunks_exact_mut(cfg.head_dim) {
                for (i, &(cos, sin)) in cs.iter().enumerate() {
                    let (a, b) = match cfg.style {
                        RopeStyle::Neox => (i, i + half),
                        RopeStyle::GptJ => (2 * i, 2 * i + 1),
                    };
                    let (xa, xb) = (head[a], head[b]);
                    head[a] = xa * cos - xb * sin;
                    head[b] = xb * cos + xa * sin;
                }
            }
        }
        Ok(())
    }

    fn silu_mul(&self, x: &CpuTensor) -> Result<CpuTensor> {
        expect_rank("x", x, 2)?;
        let (m, two_d) = (x.shape[0], x.shape[1]);
        if two_d % 2 != 0 {
            return Err(shape_err(
                "x (last dim must be even)",
                &[m, two_d + 1],
                &x.shape,
            ));
        }
        let d = two_d / 2;
        let mut out = vec![0.0; m * d];
        if d > 0 {
            dense::silu_mul(&x.data, d, &mut out);
        }
        CpuTensor::new(out, &[m, d])
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        expect_shape("y", y, &x.shape.clone())?;
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        expect_rank("table", table, 2)?;
        let (vocab, d) = (table.shape[0], table.shape[1]);
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(AttentionError::InvalidConfig {
                field: "ids",
                reason: format!("id {bad} out of range for a table of {vocab} rows"),
            });
        }
        let mut out = Vec::with_capacity(ids.len() * d);
        for &i in ids {
            out.extend_from_slice(&table.data[i as usize * d..(i as usize + 1) * d]);
        }
        CpuTensor::new(out, &[ids.len(), d])
    }

    fn plan(&self, meta: &BatchMetadata) -> Result<CpuPlan> {
        Ok(CpuPlan { meta: meta.clone() })
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        layer: usize,
        plan: &CpuPlan,
        store: &mut HostKvStore,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        params: &AttentionParams,
    ) -> Result<CpuTensor> {
        let layout = *store.layout();
        self.check_plan(layer, plan, &layout)?;
        let (kv_heads, d, dv, heavy) = match layout.shape.kind {
            KvKind::Mha {
                kv_heads,
                head_dim,
                v_head_dim,
            } => (kv_heads, head_dim, v_head_dim, None),
            KvKind::DoubleSparse {
                kv_heads,
                head_dim,
                v_head_dim,
                heavy_channels,
            } => (
                kv_heads,
                head_dim,
                v_head_dim,
                Some(heavy_channels as usize),
            ),
            KvKind::Mla { .. } => {
                return Err(AttentionError::Unsupported(
                    "an MLA store needs attention_mla".into(),
                ))
            }
        };
        let (kv_heads, d, dv) = (kv_heads as usize, d as usize, dv as usize);
        let meta = &plan.meta;
        let n = meta.num_tokens();
        expect_rank("q", q, 3)?;
        let q_heads = q.shape[1];
        if q_heads == 0 || q_heads % kv_heads != 0 {
            return Err(AttentionError::HeadsNotMultiple { q_heads, kv_heads });
        }
        expect_shape("q", q, &[n, q_heads, d])?;
        expect_shape("k", k, &[n, kv_heads, d])?;
        expect_shape("v", v, &[n, kv_heads, dv])?;
        let labels = match (heavy, &params.double_sparse) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(AttentionError::Unsupported(
                    "double_sparse parameters given for a store without labels".into(),
                ))
            }
            (Some(_), None) => {
                return Err(AttentionError::InvalidConfig {
                    field: "double_sparse",
                    reason: "a DoubleSparse store needs its channels and top_k".into(),
                })
            }
            (Some(hc), Some(ds)) => {
                if ds.top_k == 0 {
                    return Err(AttentionError::InvalidConfig {
                        field: "top_k",
                        reason: "must be at least 1".into(),
                    });
                }
                if ds.channels.len() != kv_heads * hc {
                    return Err(AttentionError::LengthMismatch {
                        what: "channels",
                        expected: kv_heads * hc,
                        got: ds.channels.len(),
                    });
                }
                if let Some(&c) = ds.channels.iter().find(|&&c| c as usize >= d) {
                    return Err(AttentionError::InvalidConfig {
                        field: "channels",
                        reason: format!("channel {c} out of range for head_dim {d}"),
                    });
                }
                let mut lab = vec![0.0f32; n * kv_heads * hc];
                for (t, row) in lab.chunks_exact_mut(kv_heads * hc).enumerate() {
                    for (i, (l, &c)) in row.iter_mut().zip(&ds.channels).enumerate() {
                        *l = k.data[t * kv_heads * d + (i / hc) * d + c as usize];
                    }
                }
                Some(lab)
            }
        };
        store.write_kv(layer, meta.out_cache_loc(), &k.data, &v.data)?;
        if let Some(lab) = &labels {
            store.write_labels(layer, meta.out_cache_loc(), lab)?;
        }
        let store: &HostKvStore = store;
        let (k_scale, v_scale) = store.scales(layer)?;
        let dtype = layout.shape.dtype;
        let src = |b: KvBuffer, scale: f32| -> Result<RowSource<'_>> {
            Ok(RowSource {
                bytes: store.layer_buffer(layer, b)?,
                dtype,
                scale,
                elems: layout.shape.row_elems(b),
            })
        };
        let sources = Sources {
            k: src(KvBuffer::Key, k_scale)?,
            v: Some(src(KvBuffer::Value, v_scale)?),
            labels: if labels.is_some() {
                Some(src(KvBuffer::Label, 1.0)?)
            } else {
                None
            },
        };
        let g = Geom {
            q_heads,
            group: q_heads / kv_heads,
            d,
            dv,
            k_row: kv_heads * d,
            v_row: kv_heads * dv,
            v_in_k: false,
        };
        let mut out = vec![0.0f32; n * q_heads * dv];
        let sparse = params.double_sparse.as_ref().filter(|_| meta.is_decode());
        let scale = params.scale;
        self.for_each_request(
            meta,
            &q.data,
            q_heads * d,
            &mut out,
            q_heads * dv,
            &|r, q, out, sc| match sparse {
                Some(ds) if meta.kv_len(r) > ds.top_k => {
                    attention::sparse_decode_request(&g, meta, r, &sources, ds, q, scale, out, sc)
                }
                _ => attention::dense_request(&g, meta, r, &sources, q, scale, out, sc),
            },
        );
        CpuTensor::new(out, &[n, q_heads, dv])
    }

    fn attention_mla(
        &self,
        layer: usize,
        plan: &CpuPlan,
        store: &mut HostKvStore,
        q: &CpuTensor,
        latent: &CpuTensor,
        params: &AttentionParams,
    ) -> Result<CpuTensor> {
        let layout = *store.layout();
        self.check_plan(layer, plan, &layout)?;
        let KvKind::Mla {
            kv_lora_rank,
            qk_rope_head_dim,
        } = layout.shape.kind
        else {
            return Err(AttentionError::Unsupported(
                "attention_mla needs an MLA store".into(),
            ));
        };
        if params.double_sparse.is_some() {
            return Err(AttentionError::Unsupported(
                "double_sparse parameters given for an MLA store".into(),
            ));
        }
        let (dv, d) = (
            kv_lora_rank as usize,
            kv_lora_rank as usize + qk_rope_head_dim as usize,
        );
        let meta = &plan.meta;
        let n = meta.num_tokens();
        expect_rank("q", q, 3)?;
        let heads = q.shape[1];
        if heads == 0 {
            return Err(AttentionError::HeadsNotMultiple {
                q_heads: 0,
                kv_heads: 1,
            });
        }
        expect_shape("q", q, &[n, heads, d])?;
        expect_shape("latent", latent, &[n, d])?;
        store.write_kv(layer, meta.out_cache_loc(), &latent.data, &[])?;
        let store: &HostKvStore = store;
        let (k_scale, _) = store.scales(layer)?;
        let sources = Sources {
            k: RowSource {
                bytes: store.layer_buffer(layer, KvBuffer::Key)?,
                dtype: layout.shape.dtype,
                scale: k_scale,
                elems: d,
            },
            v: None,
            labels: None,
        };
        let g = Geom {
            q_heads: heads,
            group: heads,
            d,
            dv,
            k_row: d,
            v_row: 0,
            v_in_k: true,
        };
        let mut out = vec![0.0f32; n * heads * dv];
        let scale = params.scale;
        self.for_each_request(
            meta,
            &q.data,
            heads * d,
            &mut out,
            heads * dv,
            &|r, q, out, sc| attention::dense_request(&g, meta, r, &sources, q, scale, out, sc),
        );
        CpuTensor::new(out, &[n, heads, dv])
    }
}
