//! The CPU backend: f32 tensors in host memory (weights may stay f16 or bf16,
//! [`Backend::upload_weight`]), a batch-invariant matmul, and paged attention over a
//! [`HostKvStore`] of any dtype (f32, f16, bf16, fp8), converted to f32 on read. Where the CPU
//! has AVX2, FMA and F16C (detected at run time) the matmul and the dense attention kernel run
//! hand-vectorised (`simd`), reading f32, f16 and bf16 rows in place (weights, store rows),
//! extend attention eight query rows per instruction (`simd::extend`); where it also has
//! AVX-512F and VL the matmul runs 512-bit tiles (`simd::avx512`) and extend attention sixteen
//! query rows per instruction, with the same results bit for bit. A bf16 weight's matmul rounds the activations to bf16 once and runs
//! `vdpbf16ps` arithmetic (`bf16dot`): on AVX-512 BF16 where the CPU has it, emulated exactly on
//! AVX2 and in portable code elsewhere, again with the same bits on every kernel. The rotary embedding keeps its cos/sin table across the calls of
//! a forward pass (`rope`).
//!
//! The backend owns one pool of `threads` threads (`pool`) for its lifetime. A matmul is split
//! by blocks of output columns (`columns`; [`Backend::matmul_many`] cuts the union of several
//! weights' columns, one dispatch for a layer's q, k and v), attention by requests, long prefills by pieces
//! of query tokens and a decode batch smaller than the pool by KV head (`split`), RMSNorm, the residual add, the rotary embedding and `silu_mul` by
//! rows; every output element is computed by one job in a fixed order, so results are bitwise
//! the same for any thread count. Op outputs reuse the buffers of dropped tensors (`buffers`).

mod attention;
mod bf16dot;
mod buffers;
mod columns;
mod dense;
mod pool;
mod primitives;
mod rope;
#[cfg(target_arch = "x86_64")]
mod simd;
mod split;

use std::sync::Arc;

use kv_pool::{HostKvStore, KvBuffer, KvLayout, KvStore};

use crate::backend::{Backend, DeviceTensor, TensorDtype};
use crate::check;
use crate::error::{AttentionError, Result};
use crate::metadata::BatchMetadata;
use crate::moe::{self, MoeExperts, MoeRouting};
use crate::params::AttentionParams;
use crate::rope::RopeConfig;

use attention::{RowSource, Scratch, Sources};
use pool::Pool;
use primitives::Geom;
use rope::RopeCache;

/// Work on one request: `(request, its q rows, its output rows, scratch)`.
type RequestFn<'a> = dyn Fn(usize, &[f32], &mut [f32], &mut Scratch) + Sync + 'a;

/// Work on some KV heads of a decode request: `(request, KV heads, their q rows, their output
/// rows, scratch)`.
#[cfg(target_arch = "x86_64")]
type HeadFn<'a> =
    dyn Fn(usize, std::ops::Range<usize>, &[f32], &mut [f32], &mut Scratch) + Sync + 'a;

/// A host tensor: row-major f32 data and its shape; or a weight kept in 16 bits
/// ([`Backend::upload_weight`]), which only the matmul (as `w`), the embedding (as the table)
/// and [`Backend::download`] take.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    shape: Vec<usize>,
    /// The elements (empty for a 16-bit weight).
    data: Vec<f32>,
    /// A 16-bit weight: its type (f16 or bf16) and bit patterns.
    half: Option<(TensorDtype, Vec<u16>)>,
}

impl CpuTensor {
    /// Wraps `data` with `shape` (the product of the shape must equal `data.len()`).
    pub fn new(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        Self::check_len(shape, data.len())?;
        Ok(CpuTensor {
            shape: shape.to_vec(),
            data,
            half: None,
        })
    }

    /// Refuses `got` elements for `shape` unless they are its product.
    fn check_len(shape: &[usize], got: usize) -> Result<()> {
        let expected: usize = shape.iter().product();
        if expected != got {
            return Err(AttentionError::LengthMismatch {
                what: "tensor data",
                expected,
                got,
            });
        }
        Ok(())
    }

    /// The elements, row-major (empty for a 16-bit weight: [`Backend::download`] widens it).
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The f32 elements an op computes on; a 16-bit weight is refused with a typed error.
    fn f32s(&self, op: &str) -> Result<&[f32]> {
        check::f32_tensor(op, self.dtype())?;
        Ok(&self.data)
    }

    /// The matmul's view of this tensor as its weight.
    fn weights(&self) -> dense::Weights<'_> {
        match &self.half {
            None => dense::Weights::F32(&self.data),
            Some((TensorDtype::F16, bits)) => dense::Weights::F16(bits),
            Some((_, bits)) => dense::Weights::Bf16(bits),
        }
    }

    /// The elements, row-major, without a copy.
    pub fn into_data(mut self) -> Vec<f32> {
        std::mem::take(&mut self.data)
    }
}

/// A dropped tensor's buffer goes back to this thread's free list for the next op's output
/// (`buffers`).
impl Drop for CpuTensor {
    fn drop(&mut self) {
        buffers::give(std::mem::take(&mut self.data));
    }
}

impl DeviceTensor for CpuTensor {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> TensorDtype {
        self.half.as_ref().map_or(TensorDtype::F32, |h| h.0)
    }
}

/// Settings of the [`CpuBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuConfig {
    /// Worker threads (`≥ 1`), started with the backend: every matmul is split over them by
    /// blocks of output columns, attention by request. Results do not depend on it. Default 1.
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
    pool: Pool,
    /// The last rotary table (see `rope`).
    rope: Arc<RopeCache>,
}

/// The CPU backend's per-batch plan: the validated metadata, and the same batch with its long
/// extend requests cut into pieces of query tokens for the threads (`split`).
#[derive(Debug, Clone)]
pub struct CpuPlan {
    meta: BatchMetadata,
    pieces: Option<BatchMetadata>,
}

impl CpuPlan {
    /// The batch metadata the plan was built from.
    pub fn metadata(&self) -> &BatchMetadata {
        &self.meta
    }
}

impl CpuBackend {
    /// A backend with `config`, and its pool of `threads` workers (at least 1).
    pub fn new(config: CpuConfig) -> Result<Self> {
        let pool = Pool::new(config.threads)?;
        Ok(CpuBackend {
            config,
            pool,
            rope: Arc::default(),
        })
    }

    /// The backend's settings.
    pub fn config(&self) -> &CpuConfig {
        &self.config
    }

    /// Runs `f(request, q_rows, out_rows, scratch)` for every request of `meta`, in jobs of
    /// contiguous ranges of requests of roughly equal work, a few per thread.
    fn for_each_request(
        &self,
        meta: &BatchMetadata,
        q: &[f32],
        q_row: usize,
        out: &mut [f32],
        out_row: usize,
        f: &RequestFn<'_>,
    ) {
        let bounds = split::request_ranges(meta, self.pool.threads() * 4);
        // Each range of requests with its rows of `out`.
        let mut jobs = Vec::with_capacity(bounds.len() - 1);
        let mut rest = out;
        for w in bounds.windows(2) {
            let (a, b) = (w[0], w[1]);
            let base = meta.qo_indptr()[a];
            let rows = meta.qo_indptr()[b] - base;
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(rows * out_row);
            rest = tail;
            jobs.push((a..b, mine, base));
        }
        self.pool.for_each(jobs, |(range, out, base)| {
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
        });
    }

    /// Runs `f(request, kv_heads, q_rows, out_rows, scratch)` for every KV head of every
    /// request of a decode batch (one token each), one job each: `q_rows` and `out_rows` are
    /// the rows of that head's query heads (`g.group` of them, consecutive in the token's row).
    #[cfg(target_arch = "x86_64")]
    fn for_each_decode_head(
        &self,
        meta: &BatchMetadata,
        g: &Geom,
        q: &[f32],
        out: &mut [f32],
        f: &HeadFn<'_>,
    ) {
        let kv_heads = g.q_heads / g.group;
        let (qh, oh) = (g.group * g.d, g.group * g.dv);
        let mut jobs = Vec::with_capacity(meta.num_requests() * kv_heads);
        let mut rest = out;
        for r in 0..meta.num_requests() {
            let row = meta.qo_range(r).start;
            for h in 0..kv_heads {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(oh);
                rest = tail;
                let at = (row * kv_heads + h) * qh;
                jobs.push((r, h, &q[at..at + qh], mine));
            }
        }
        self.pool.for_each(jobs, |(r, h, q, out)| {
            f(r, h..h + 1, q, out, &mut Scratch::default());
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

    /// Keeps f16 and bf16 weights in 16 bits (half the memory and bandwidth). The matmul widens
    /// an f16 weight exactly in registers (results bitwise those of the f32 expansion) and
    /// computes a bf16 weight's products on activations rounded to bf16 (`bf16dot`).
    fn upload_weight(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: TensorDtype,
    ) -> Result<CpuTensor> {
        if dtype == TensorDtype::F32 {
            return self.upload(data, shape);
        }
        CpuTensor::check_len(shape, data.len())?;
        Ok(CpuTensor {
            shape: shape.to_vec(),
            data: Vec::new(),
            half: Some((dtype, data.iter().map(|&v| dtype.narrow(v)).collect())),
        })
    }

    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        let w = t.weights();
        Ok(match w {
            dense::Weights::F32(d) => d.to_vec(),
            _ => (0..t.numel()).map(|i| w.get(i)).collect(),
        })
    }

    fn reshape(&self, mut t: CpuTensor, shape: &[usize]) -> Result<CpuTensor> {
        check::reshape(&t.shape, shape)?;
        t.shape = shape.to_vec();
        Ok(t)
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuTensor) -> Result<CpuTensor> {
        let (m, k, n) = check::matmul(&x.shape, &w.shape)?;
        let xs = x.f32s("matmul")?;
        // Every element is written (zeros for k = 0).
        let mut out = buffers::take(m * n);
        dense::matmul(&self.pool, xs, w.weights(), m, k, n, &mut out);
        CpuTensor::new(out, &[m, n])
    }

    /// The rows gathered head-major (`[heads, n, k]`), every head multiplied by its weight in
    /// one pool dispatch (`dense::matmul_parts`: each element as `matmul` computes it), and the
    /// products scattered back to `[n, heads, m]`.
    fn bmm(&self, x: &CpuTensor, w: &CpuTensor) -> Result<CpuTensor> {
        let (n, heads, k, m) = check::bmm(&x.shape, &w.shape)?;
        let xs = x.f32s("bmm")?;
        let mut by_head = buffers::take(heads * n * k);
        for (h, rows) in by_head.chunks_mut((n * k).max(1)).enumerate().take(heads) {
            for t in 0..n {
                rows[t * k..][..k].copy_from_slice(&xs[(t * heads + h) * k..][..k]);
            }
        }
        // Every element of `prod` and `out` is written (zeros for k = 0).
        let mut prod = buffers::take(heads * n * m);
        let weights = w.weights();
        let parts = prod
            .chunks_mut((n * m).max(1))
            .take(heads)
            .enumerate()
            .map(|(h, dst)| (h * n, weights.slice(h * m * k..(h + 1) * m * k), m, dst))
            .collect();
        dense::matmul_parts(&self.pool, &by_head, n, k, parts);
        let mut out = buffers::take(n * heads * m);
        for h in 0..heads {
            for t in 0..n {
                out[(t * heads + h) * m..][..m].copy_from_slice(&prod[(h * n + t) * m..][..m]);
            }
        }
        buffers::give(by_head);
        buffers::give(prod);
        CpuTensor::new(out, &[n, heads, m])
    }

    /// One pool dispatch over the union of the weights' output columns.
    fn matmul_many(&self, x: &CpuTensor, ws: &[&CpuTensor]) -> Result<Vec<CpuTensor>> {
        let mut dims = Vec::with_capacity(ws.len());
        for w in ws {
            dims.push(check::matmul(&x.shape, &w.shape)?);
        }
        let xs = x.f32s("matmul")?;
        // Every element of every output is written (zeros for k = 0).
        let mut outs: Vec<Vec<f32>> = dims.iter().map(|&(m, _, n)| buffers::take(m * n)).collect();
        if let Some(&(m, k, _)) = dims.first() {
            let parts = ws
                .iter()
                .zip(&dims)
                .zip(&mut outs)
                .map(|((w, &(_, _, n)), out)| (w.weights(), n, &mut out[..]))
                .collect();
            dense::matmul_many(&self.pool, xs, m, k, parts);
        }
        outs.into_iter()
            .zip(&dims)
            .map(|(out, &(m, _, n))| CpuTensor::new(out, &[m, n]))
            .collect()
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        check::rms_norm(&x.shape, &weight.shape)?;
        let (xs, ws) = (x.f32s("rms_norm")?, weight.f32s("rms_norm")?);
        // Every row is written.
        let mut out = buffers::take(xs.len());
        if !out.is_empty() {
            dense::rms_norm_rows(&self.pool, xs, ws, eps, &mut out);
        }
        CpuTensor::new(out, &x.shape)
    }

    fn rotary(&self, x: &mut CpuTensor, positions: &[u32], cfg: &RopeConfig) -> Result<()> {
        let inv = check::rotary(&x.shape, positions.len(), cfg)?;
        x.f32s("rotary")?;
        self.rope
            .rotate(&self.pool, &mut x.data, positions, &inv, cfg);
        Ok(())
    }

    fn silu_mul(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let (m, d) = check::silu_mul(&x.shape)?;
        let xs = x.f32s("silu_mul")?;
        // Every element is written (none when d = 0).
        let mut out = buffers::take(m * d);
        if d > 0 {
            dense::silu_mul_rows(&self.pool, xs, d, &mut out);
        }
        CpuTensor::new(out, &[m, d])
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        check::add_assign(&x.shape, &y.shape)?;
        x.f32s("add_assign")?;
        let ys = y.f32s("add_assign")?;
        dense::add_assign(&self.pool, &mut x.data, ys);
        Ok(())
    }

    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        let (_, d) = check::embedding(&table.shape, ids)?;
        let mut out = Vec::with_capacity(ids.len() * d);
        let w = table.weights();
        for &i in ids {
            let row = i as usize * d..(i as usize + 1) * d;
            match w {
                dense::Weights::F32(t) => out.extend_from_slice(&t[row]),
                _ => out.extend(row.map(|e| w.get(e))),
            }
        }
        CpuTensor::new(out, &[ids.len(), d])
    }

    /// The host algorithm ([`moe::fused_moe_on_host`]) with each expert's matmuls reading its
    /// rows of the stacked weights in place (in their stored type, as a separate weight's
    /// matmul would: the same bits).
    fn fused_moe(
        &self,
        h: &CpuTensor,
        router_logits: &CpuTensor,
        experts: &MoeExperts<CpuTensor>,
        routing: &MoeRouting,
    ) -> Result<CpuTensor> {
        let (i, d) = (experts.intermediate, h.shape.get(1).copied().unwrap_or(0));
        let (gate_up, down) = (experts.gate_up.weights(), experts.down.weights());
        moe::fused_moe_on_host(self, h, router_logits, experts, routing, |x, rows| {
            let m = rows.shape[0];
            let mut gu = buffers::take(m * 2 * i);
            let w = gate_up.slice(x * 2 * i * d..(x + 1) * 2 * i * d);
            dense::matmul(&self.pool, rows.f32s("fused_moe")?, w, m, d, 2 * i, &mut gu);
            let act = self.silu_mul(&CpuTensor::new(gu, &[m, 2 * i])?)?;
            let mut out = buffers::take(m * d);
            let w = down.slice(x * d * i..(x + 1) * d * i);
            dense::matmul(&self.pool, act.f32s("fused_moe")?, w, m, i, d, &mut out);
            CpuTensor::new(out, &[m, d])
        })
    }

    fn plan(&self, meta: &BatchMetadata) -> Result<CpuPlan> {
        Ok(CpuPlan {
            meta: meta.clone(),
            pieces: split::token_pieces(meta, self.pool.threads())?,
        })
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
        let meta = &plan.meta;
        let g = check::attention(layer, meta, &layout, (&q.shape, &k.shape, &v.shape), params)?;
        for t in [q, k, v] {
            t.f32s("attention")?;
        }
        let (q_heads, kv_heads, d, dv) = (g.q_heads, g.kv_heads, g.head_dim, g.v_head_dim);
        let n = meta.num_tokens();
        let labels = match (g.heavy_channels, &params.double_sparse) {
            (Some(hc), Some(ds)) => {
                let mut lab = vec![0.0f32; n * kv_heads * hc];
                for (t, row) in lab.chunks_exact_mut(kv_heads * hc).enumerate() {
                    for (i, (l, &c)) in row.iter_mut().zip(&ds.channels).enumerate() {
                        *l = k.data[t * kv_heads * d + (i / hc) * d + c as usize];
                    }
                }
                Some(lab)
            }
            _ => None,
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
        let mut out = buffers::take_zeroed(n * q_heads * dv);
        let sparse = params.double_sparse.as_ref().filter(|_| meta.is_decode());
        // The same rows, long requests in pieces (see `split`).
        let meta = plan.pieces.as_ref().unwrap_or(meta);
        let scale = params.scale;
        #[cfg(target_arch = "x86_64")]
        if sparse.is_none()
            && simd::available()
            && split::decode_by_heads(meta, kv_heads, self.pool.threads())
        {
            self.for_each_decode_head(meta, &g, &q.data, &mut out, &|r, heads, q, out, sc| {
                attention::dense_heads_simd(&g, heads, meta, r, &sources, q, scale, out, sc)
            });
            return CpuTensor::new(out, &[n, q_heads, dv]);
        }
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
        let meta = &plan.meta;
        let (heads, d, dv) =
            check::attention_mla(layer, meta, &layout, &q.shape, &latent.shape, params)?;
        q.f32s("attention_mla")?;
        latent.f32s("attention_mla")?;
        let n = meta.num_tokens();
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
        let mut out = buffers::take_zeroed(n * heads * dv);
        let scale = params.scale;
        let meta = plan.pieces.as_ref().unwrap_or(meta);
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
