//! [`WgpuBackend`]: the [`Backend`] implementation.

use std::sync::Arc;

use attention::check;
use attention::{
    AttentionError, AttentionParams, Backend, BatchMetadata, DeviceTensor, Result, RopeConfig,
    RopeStyle,
};
use kv_pool::{KvBuffer, KvKind, KvLayout, KvShape, KvStore};

use crate::device::{DeviceReport, Gpu, WgpuConfig, WgpuError};
use crate::dispatch::{Dispatch, Runner};
use crate::kernels::attention::{heads_per_wg, AttnSpec, ATTN_WG};
use crate::kernels::dense::{MM_ROWS_MAX, MM_TILE};
use crate::kernels::{self, grid};
use crate::plan::{self, WgpuPlan};
use crate::store::{store_elem, WgpuKvStore};
use crate::tensor::{self, WgpuTensor};

/// The wgpu compute backend: one device, its pipeline cache, and the configuration.
#[derive(Clone)]
pub struct WgpuBackend {
    runner: Arc<Runner>,
    config: WgpuConfig,
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuBackend")
            .field("device", &self.runner.gpu.report)
            .field("config", &self.config)
            .finish()
    }
}

/// A dimension as the `u32` kernels index with.
fn dim(what: &'static str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| AttentionError::InvalidConfig {
        field: what,
        reason: format!("{x} does not fit the kernels' 32-bit indices"),
    })
}

impl WgpuBackend {
    /// Opens a device as `config` says (adapter order Vulkan, Metal, DX12, GL). With no
    /// adapter the error is [`WgpuError::NoAdapter`], naming the backends tried.
    pub fn new(config: WgpuConfig) -> std::result::Result<Self, WgpuError> {
        let gpu = Gpu::open(&config)?;
        Ok(WgpuBackend {
            runner: Arc::new(Runner::new(gpu)),
            config,
        })
    }

    /// What the device offers (name, backend, f16, limits); its `Display` is a one-line
    /// report for logs.
    pub fn report(&self) -> &DeviceReport {
        &self.runner.gpu.report
    }

    /// wgpu's description of the adapter.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.runner.gpu.info
    }

    /// The configuration the backend was opened with.
    pub fn config(&self) -> &WgpuConfig {
        &self.config
    }

    /// Matmuls of at most this many rows take the thread-per-column kernel
    /// ([`WgpuConfig::matmul_rows_max`], by default by the adapter's type).
    pub fn matmul_rows_max(&self) -> usize {
        let auto = if self.runner.gpu.info.device_type == wgpu::DeviceType::Cpu {
            MM_ROWS_MAX
        } else {
            0
        };
        self.config.matmul_rows_max.unwrap_or(auto) as usize
    }

    /// `out[m, H, n] = x[m, H, k] · w[H, n, k]ᵀ` per head (`matmul` is `H` = 1, `bmm` any),
    /// shaped `out_shape`: the tiled kernel, or the thread-per-column one for few rows.
    fn matmul_heads(
        &self,
        x: &WgpuTensor,
        w: &WgpuTensor,
        (m, heads, k, n): (usize, usize, usize, usize),
        out_shape: &[usize],
    ) -> Result<WgpuTensor> {
        let out = self.zeros(out_shape)?;
        if m == 0 || n == 0 || k == 0 || heads == 0 {
            return Ok(out);
        }
        // Heads go along the grid's z, which the adapter limits (65535 on most).
        let z = dim("heads", heads)?;
        if z > self.runner.gpu.limits.max_compute_workgroups_per_dimension {
            return Err(AttentionError::Unsupported(format!(
                "{heads} heads: past the adapter's workgroups per dimension"
            )));
        }
        let params = self.params(&[dim("m", m)?, dim("n", n)?, z])?;
        let (kernel, groups) = if m <= self.matmul_rows_max() {
            let kernel = kernels::dense::matmul_rows(dim("k", k)?);
            let [gx, gy, _] = grid(n as u64);
            (kernel, [gx, gy, z])
        } else {
            let kernel = kernels::dense::matmul(dim("k", k)?);
            let groups = [
                dim("n", n.div_ceil(MM_TILE as usize))?,
                dim("m", m.div_ceil(MM_TILE as usize))?,
                z,
            ];
            (kernel, groups)
        };
        self.run(&[Dispatch {
            kernel: &kernel,
            buffers: vec![&x.buf, &w.buf, &out.buf, &params],
            groups,
        }])?;
        Ok(out)
    }

    /// Pipelines compiled so far (one per kernel specialisation used).
    pub fn cached_pipelines(&self) -> usize {
        self.runner.cached_pipelines()
    }

    /// Compiles a generated kernel on this device (cached like every other), to check that a
    /// specialisation is valid WGSL for the adapter without running it.
    pub fn compile(&self, kernel: &kernels::Kernel) -> Result<()> {
        self.runner.compile(kernel)?;
        Ok(())
    }

    fn params(&self, words: &[u32]) -> Result<wgpu::Buffer> {
        Ok(self.runner.upload_u32("params", words)?)
    }

    fn run(&self, dispatches: &[Dispatch<'_>]) -> Result<()> {
        Ok(self.runner.run(dispatches)?)
    }

    fn zeros(&self, shape: &[usize]) -> Result<WgpuTensor> {
        tensor::zeros(&self.runner, shape)
    }

    /// Checks that a store was made by this backend's device.
    fn check_device(&self, store: &WgpuKvStore) -> Result<()> {
        if !Arc::ptr_eq(store.runner(), &self.runner) {
            return Err(AttentionError::InvalidConfig {
                field: "store",
                reason: "the KV store belongs to another wgpu backend (device)".into(),
            });
        }
        Ok(())
    }

    /// Writes the batch's new rows of `src` (`[n, row]`) into one of the layer's buffers.
    fn write_new<'a>(
        store: &'a WgpuKvStore,
        layer: usize,
        buffer: KvBuffer,
        plan: &'a WgpuPlan,
        src: &'a WgpuTensor,
        kernel: &'a kernels::Kernel,
    ) -> Dispatch<'a> {
        let lb = store.buffer(layer, buffer);
        let mut buffers: Vec<&wgpu::Buffer> = lb.chunks.iter().collect();
        buffers.extend([&*src.buf, &plan.writes]);
        let n = plan.meta.num_tokens() as u64;
        Dispatch {
            kernel,
            buffers,
            groups: grid(n * lb.view.row_elems as u64),
        }
    }

    /// The shared attention path: writes the new rows, then attends (split + merge when the
    /// batch is small).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        layer: usize,
        plan: &WgpuPlan,
        store: &WgpuKvStore,
        q: &WgpuTensor,
        new_rows: &[(KvBuffer, &WgpuTensor)],
        (kv_heads, d, dv): (usize, usize, usize),
        scale: f32,
    ) -> Result<WgpuTensor> {
        let n = plan.meta.num_tokens();
        let q_heads = q.shape[1];
        let out = self.zeros(&[n, q_heads, dv])?;
        if n == 0 {
            return Ok(out);
        }
        let mla = store.layout().shape.buffers() == [KvBuffer::Key];
        let group = (q_heads / kv_heads) as u32;
        let (d32, dv32) = (dim("head_dim", d)?, dim("v_head_dim", dv)?);
        let hb = heads_per_wg(group, d32, dv32);
        let base_groups = (n as u64) * (kv_heads as u64) * (group / hb) as u64;
        // Split-KV: enough workgroups to fill the device, splits of whole key blocks.
        let b = ATTN_WG as u64;
        let max_kv = plan.max_kv_len as u64;
        let max_splits = max_kv.div_ceil(b).max(1);
        let part_row = (dv as u64 + 2) * 4;
        let part_limit = (self
            .runner
            .gpu
            .limits
            .max_storage_buffer_binding_size
            .min(u64::from(u32::MAX))
            / (n as u64 * q_heads as u64 * part_row).max(1))
        .max(1);
        let want = (self.config.split_kv_target_workgroups as u64)
            .div_ceil(base_groups)
            .clamp(1, max_splits.min(part_limit).min(65_535));
        let chunk = max_kv.div_ceil(want).div_ceil(b) * b;
        let splits = max_kv.div_ceil(chunk.max(1)).max(1);
        let spec = AttnSpec {
            d: d32,
            dv: dv32,
            q_heads: dim("q_heads", q_heads)?,
            group,
            heads_per_wg: hb,
            page_size: store.layout().page_size,
            k: store.buffer(layer, KvBuffer::Key).view,
            v: (!mla).then(|| store.buffer(layer, KvBuffer::Value).view),
            direct: splits == 1,
        };
        let write_kernels: Vec<kernels::Kernel> = new_rows
            .iter()
            .map(|&(buf, _)| kernels::store::write_rows(store.buffer(layer, buf).view))
            .collect();
        let attn = kernels::attention::attention(spec);
        let params = self.params(&[scale.to_bits(), splits as u32, chunk as u32])?;
        let part = if splits > 1 {
            Some(self.runner.alloc(
                "attention partials",
                n as u64 * q_heads as u64 * splits * part_row,
            )?)
        } else {
            None
        };
        let mut dispatches: Vec<Dispatch<'_>> = new_rows
            .iter()
            .zip(&write_kernels)
            .map(|(&(buf, src), k)| Self::write_new(store, layer, buf, plan, src, k))
            .collect();
        let mut buffers: Vec<&wgpu::Buffer> = vec![
            &q.buf,
            &plan.table,
            &params,
            part.as_ref().unwrap_or(&out.buf),
        ];
        buffers.extend(store.buffer(layer, KvBuffer::Key).chunks.iter());
        if !mla {
            buffers.extend(store.buffer(layer, KvBuffer::Value).chunks.iter());
        }
        dispatches.push(Dispatch {
            kernel: &attn,
            buffers,
            groups: [
                dim("tokens", n)?,
                dim("kv_heads", kv_heads)? * (group / hb),
                splits as u32,
            ],
        });
        let merge = kernels::attention::merge(spec.q_heads, dv32);
        let merge_params = self.params(&[splits as u32])?;
        if let Some(part) = &part {
            dispatches.push(Dispatch {
                kernel: &merge,
                buffers: vec![part, &out.buf, &merge_params],
                groups: [dim("tokens", n)?, spec.q_heads, 1],
            });
        }
        self.run(&dispatches)?;
        Ok(out)
    }
}

impl Backend for WgpuBackend {
    type Tensor = WgpuTensor;
    type KvStore = WgpuKvStore;
    type Plan = WgpuPlan;

    fn name(&self) -> &str {
        "wgpu"
    }

    fn new_kv_store(&self, layout: KvLayout) -> Result<WgpuKvStore> {
        WgpuKvStore::new(
            self.runner.clone(),
            layout,
            self.runner.gpu.report.max_binding_bytes,
        )
    }

    fn kv_support(&self, shape: &KvShape) -> std::result::Result<(), String> {
        store_elem(shape.dtype, self.runner.gpu.report.f16)?;
        if let KvKind::DoubleSparse { .. } = shape.kind {
            return Err("DoubleSparse attention is not implemented on the wgpu backend".into());
        }
        Ok(())
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<WgpuTensor> {
        tensor::from_host(&self.runner, data, shape)
    }

    fn download(&self, t: &WgpuTensor) -> Result<Vec<f32>> {
        Ok(self.runner.read_f32(&t.buf, t.numel())?)
    }

    fn synchronize(&self) -> Result<()> {
        self.runner
            .gpu
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| WgpuError::Device(format!("waiting for the device: {e}")))?;
        Ok(self.runner.gpu.take_error()?)
    }

    fn reshape(&self, t: WgpuTensor, shape: &[usize]) -> Result<WgpuTensor> {
        check::reshape(&t.shape, shape)?;
        Ok(WgpuTensor {
            buf: t.buf,
            shape: shape.to_vec(),
        })
    }

    fn matmul(&self, x: &WgpuTensor, w: &WgpuTensor) -> Result<WgpuTensor> {
        let (m, k, n) = check::matmul(&x.shape, &w.shape)?;
        self.matmul_heads(x, w, (m, 1, k, n), &[m, n])
    }

    fn bmm(&self, x: &WgpuTensor, w: &WgpuTensor) -> Result<WgpuTensor> {
        let (n, heads, k, m) = check::bmm(&x.shape, &w.shape)?;
        self.matmul_heads(x, w, (n, heads, k, m), &[n, heads, m])
    }

    fn rms_norm(&self, x: &WgpuTensor, weight: &WgpuTensor, eps: f32) -> Result<WgpuTensor> {
        let (rows, d) = check::rms_norm(&x.shape, &weight.shape)?;
        let out = self.zeros(&x.shape)?;
        if rows == 0 || d == 0 {
            return Ok(out);
        }
        let kernel = kernels::dense::rms_norm(dim("d", d)?);
        let params = self.params(&[dim("rows", rows)?, eps.to_bits()])?;
        let groups = if rows <= 65_535 {
            [rows as u32, 1, 1]
        } else {
            [65_535, dim("rows", rows.div_ceil(65_535))?, 1]
        };
        self.run(&[Dispatch {
            kernel: &kernel,
            buffers: vec![&x.buf, &weight.buf, &out.buf, &params],
            groups,
        }])?;
        Ok(out)
    }

    fn rotary(&self, x: &mut WgpuTensor, positions: &[u32], cfg: &RopeConfig) -> Result<()> {
        let inv = check::rotary(&x.shape, positions.len(), cfg)?;
        let (n, heads) = (x.shape[0], x.shape[1]);
        if n == 0 || heads == 0 {
            return Ok(());
        }
        // cos/sin in f64 on the host, rounded to f32: the same table the CPU backend uses.
        let mut cs = Vec::with_capacity(n * inv.len() * 2);
        for &pos in positions {
            for &f in &inv {
                let (s, c) = (pos as f64 * f).sin_cos();
                cs.extend([c as f32, s as f32]);
            }
        }
        let table = self.upload(&cs, &[cs.len()])?;
        let kernel = kernels::dense::rotary(
            dim("head_dim", cfg.head_dim)?,
            dim("rotary_dim", cfg.rotary_dim)?,
            cfg.style == RopeStyle::Neox,
        );
        let params = self.params(&[dim("n", n)?, dim("heads", heads)?])?;
        self.run(&[Dispatch {
            kernel: &kernel,
            buffers: vec![&x.buf, &table.buf, &params],
            groups: grid((n * heads * inv.len()) as u64),
        }])
    }

    fn silu_mul(&self, x: &WgpuTensor) -> Result<WgpuTensor> {
        let (m, d) = check::silu_mul(&x.shape)?;
        let out = self.zeros(&[m, d])?;
        let kernel = kernels::dense::silu_mul();
        let params = self.params(&[dim("m", m)?, dim("d", d)?])?;
        self.run(&[Dispatch {
            kernel: &kernel,
            buffers: vec![&x.buf, &out.buf, &params],
            groups: grid((m * d) as u64),
        }])?;
        Ok(out)
    }

    fn add_assign(&self, x: &mut WgpuTensor, y: &WgpuTensor) -> Result<()> {
        check::add_assign(&x.shape, &y.shape)?;
        let kernel = kernels::dense::add_assign();
        let params = self.params(&[dim("len", x.numel())?])?;
        self.run(&[Dispatch {
            kernel: &kernel,
            buffers: vec![&x.buf, &y.buf, &params],
            groups: grid(x.numel() as u64),
        }])
    }

    fn embedding(&self, table: &WgpuTensor, ids: &[u32]) -> Result<WgpuTensor> {
        let (_, d) = check::embedding(&table.shape, ids)?;
        let out = self.zeros(&[ids.len(), d])?;
        if ids.is_empty() || d == 0 {
            return Ok(out);
        }
        let idb = self.runner.upload_u32("ids", ids)?;
        let kernel = kernels::dense::gather_rows();
        let params = self.params(&[dim("ids", ids.len())?, dim("d", d)?])?;
        self.run(&[Dispatch {
            kernel: &kernel,
            buffers: vec![&table.buf, &idb, &out.buf, &params],
            groups: grid((ids.len() * d) as u64),
        }])?;
        Ok(out)
    }

    fn concat_last(&self, a: &WgpuTensor, b: &WgpuTensor) -> Result<WgpuTensor> {
        let (rows, da, db) = check::concat_last(&a.shape, &b.shape)?;
        let mut shape = a.shape.clone();
        *shape.last_mut().expect("rank checked") = da + db;
        let out = self.zeros(&shape)?;
        let kernel = kernels::dense::concat_last();
        let params = self.params(&[dim("rows", rows)?, dim("da", da)?, dim("db", db)?])?;
        self.run(&[Dispatch {
            kernel: &kernel,
            buffers: vec![&a.buf, &b.buf, &out.buf, &params],
            groups: grid((rows * (da + db)) as u64),
        }])?;
        Ok(out)
    }

    fn plan(&self, meta: &BatchMetadata) -> Result<WgpuPlan> {
        plan::build(&self.runner, meta)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        layer: usize,
        plan: &WgpuPlan,
        store: &mut WgpuKvStore,
        q: &WgpuTensor,
        k: &WgpuTensor,
        v: &WgpuTensor,
        params: &AttentionParams,
    ) -> Result<WgpuTensor> {
        self.check_device(store)?;
        let g = check::attention(
            layer,
            &plan.meta,
            store.layout(),
            (&q.shape, &k.shape, &v.shape),
            params,
        )?;
        if g.heavy_channels.is_some() {
            return Err(AttentionError::Unsupported(
                "DoubleSparse attention is not implemented on the wgpu backend".into(),
            ));
        }
        let (kv_heads, d, dv) = (g.kv_heads, g.head_dim, g.v_head_dim);
        self.attend(
            layer,
            plan,
            store,
            q,
            &[(KvBuffer::Key, k), (KvBuffer::Value, v)],
            (kv_heads, d, dv),
            params.scale,
        )
    }

    fn attention_mla(
        &self,
        layer: usize,
        plan: &WgpuPlan,
        store: &mut WgpuKvStore,
        q: &WgpuTensor,
        latent: &WgpuTensor,
        params: &AttentionParams,
    ) -> Result<WgpuTensor> {
        self.check_device(store)?;
        let (_, d, dv) = check::attention_mla(
            layer,
            &plan.meta,
            store.layout(),
            &q.shape,
            &latent.shape,
            params,
        )?;
        self.attend(
            layer,
            plan,
            store,
            q,
            &[(KvBuffer::Key, latent)],
            (1, d, dv),
            params.scale,
        )
    }
}
