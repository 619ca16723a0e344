//! Running kernels: the pipeline cache (keyed by the generated WGSL, which bakes in every
//! specialisation), explicit bind group layouts from each kernel's binding list, buffer
//! allocation that reports out-of-memory as an error, submission, and readback through a
//! `MAP_READ` staging buffer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use wgpu::util::DeviceExt;

use crate::device::{Gpu, Result, WgpuError};
use crate::kernels::{Access, Kernel};

/// A compiled kernel with the layout of its bindings.
struct Compiled {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

/// One dispatch: a kernel, its buffers in binding order (each bound whole), and the grid.
pub(crate) struct Dispatch<'a> {
    pub(crate) kernel: &'a Kernel,
    pub(crate) buffers: Vec<&'a wgpu::Buffer>,
    pub(crate) groups: [u32; 3],
}

/// The device plus the pipeline cache.
pub(crate) struct Runner {
    pub(crate) gpu: Gpu,
    cache: Mutex<HashMap<String, Arc<Compiled>>>,
}

/// Usage of every buffer the backend allocates for data.
pub(crate) const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// `n` rounded up to a multiple of 4 bytes, at least 4 (wgpu refuses empty bindings).
pub(crate) fn padded(n: u64) -> u64 {
    n.div_ceil(4).max(1) * 4
}

impl Runner {
    pub(crate) fn new(gpu: Gpu) -> Self {
        Runner {
            gpu,
            cache: Mutex::new(HashMap::new()),
        }
    }

    fn compiled(&self, kernel: &Kernel) -> Result<Arc<Compiled>> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = cache.get(&kernel.source) {
            return Ok(c.clone());
        }
        let device = &self.gpu.device;
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name),
            source: wgpu::ShaderSource::Wgsl(kernel.source.as_str().into()),
        });
        let entries: Vec<wgpu::BindGroupLayoutEntry> = kernel
            .bindings
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage {
                        read_only: b.access == Access::Read,
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(kernel.name),
            entries: &entries,
        });
        let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(kernel.name),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel.name),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(WgpuError::Device(format!(
                "kernel {} does not compile: {e}",
                kernel.name
            )));
        }
        let c = Arc::new(Compiled { pipeline, layout });
        cache.insert(kernel.source.clone(), c.clone());
        Ok(c)
    }

    /// Compiles (or finds cached) `kernel`.
    pub(crate) fn compile(&self, kernel: &Kernel) -> Result<()> {
        self.compiled(kernel).map(drop)
    }

    /// Pipelines in the cache (one per distinct kernel source compiled).
    pub(crate) fn cached_pipelines(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// A zeroed storage buffer of at least `bytes` (rounded up to 4), checked against the
    /// adapter's buffer limit; out-of-memory is an error, not a panic.
    pub(crate) fn alloc(&self, what: &'static str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = padded(bytes);
        let limit = self.gpu.limits.max_buffer_size;
        if size > limit {
            return Err(WgpuError::TooLarge {
                what,
                bytes: size,
                limit,
                limit_name: "max_buffer_size",
            });
        }
        let device = &self.gpu.device;
        let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size,
            usage: STORAGE,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(WgpuError::Device(format!(
                "could not allocate {size} bytes for {what}: {e}"
            )));
        }
        Ok(buf)
    }

    /// A storage buffer holding `data` (padded to 4 bytes).
    pub(crate) fn upload_bytes(&self, what: &'static str, data: &[u8]) -> Result<wgpu::Buffer> {
        if data.len() % 4 != 0 || data.is_empty() {
            let mut v = data.to_vec();
            v.resize(padded(data.len() as u64) as usize, 0);
            return self.upload_bytes(what, &v);
        }
        let limit = self.gpu.limits.max_buffer_size;
        if data.len() as u64 > limit {
            return Err(WgpuError::TooLarge {
                what,
                bytes: data.len() as u64,
                limit,
                limit_name: "max_buffer_size",
            });
        }
        let device = &self.gpu.device;
        let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(what),
            contents: data,
            usage: STORAGE,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(WgpuError::Device(format!(
                "could not allocate {} bytes for {what}: {e}",
                data.len()
            )));
        }
        Ok(buf)
    }

    /// A storage buffer of `u32` words (kernel parameters, slot lists, plans).
    pub(crate) fn upload_u32(&self, what: &'static str, data: &[u32]) -> Result<wgpu::Buffer> {
        self.upload_bytes(what, bytemuck::cast_slice(data))
    }

    /// Records every dispatch in order in one compute pass and submits it. WebGPU orders
    /// dispatches: each sees the writes of the ones before it.
    pub(crate) fn run(&self, dispatches: &[Dispatch<'_>]) -> Result<()> {
        let max_groups = self.gpu.limits.max_compute_workgroups_per_dimension;
        let mut compiled = Vec::with_capacity(dispatches.len());
        for d in dispatches {
            if let Some(&g) = d.groups.iter().find(|&&g| g > max_groups) {
                return Err(WgpuError::TooLarge {
                    what: d.kernel.name,
                    bytes: g as u64,
                    limit: max_groups as u64,
                    limit_name: "max_compute_workgroups_per_dimension (workgroups)",
                });
            }
            debug_assert_eq!(
                d.buffers.len(),
                d.kernel.bindings.len(),
                "{}",
                d.kernel.name
            );
            compiled.push(self.compiled(d.kernel)?);
        }
        let device = &self.gpu.device;
        let groups: Vec<wgpu::BindGroup> = dispatches
            .iter()
            .zip(&compiled)
            .map(|(d, c)| {
                let entries: Vec<wgpu::BindGroupEntry> = d
                    .buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| wgpu::BindGroupEntry {
                        binding: i as u32,
                        resource: b.as_entire_binding(),
                    })
                    .collect();
                device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(d.kernel.name),
                    layout: &c.layout,
                    entries: &entries,
                })
            })
            .collect();
        let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("kvserve dispatch"),
        });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("kvserve pass"),
                timestamp_writes: None,
            });
            for ((d, c), bg) in dispatches.iter().zip(&compiled).zip(&groups) {
                if d.groups.contains(&0) {
                    continue;
                }
                pass.set_pipeline(&c.pipeline);
                pass.set_bind_group(0, bg, &[]);
                pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
            }
        }
        self.gpu.queue.submit([enc.finish()]);
        self.gpu.take_error()
    }

    /// Reads the first `bytes` bytes of `src` back to the host (waits for all work before).
    pub(crate) fn read(&self, src: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let size = padded(bytes).min(src.size());
        let device = &self.gpu.device;
        let staging = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvserve readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("kvserve readback"),
        });
        enc.copy_buffer_to_buffer(src, 0, &staging, 0, size);
        self.gpu.queue.submit([enc.finish()]);
        self.gpu.take_error()?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| WgpuError::Device(format!("waiting for the device: {e}")))?;
        rx.recv()
            .map_err(|_| WgpuError::Device("the readback callback never ran".into()))?
            .map_err(|e| WgpuError::Device(format!("mapping a readback buffer: {e}")))?;
        let out = {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| WgpuError::Device(format!("reading a mapped buffer: {e}")))?;
            view[..bytes as usize].to_vec()
        };
        staging.unmap();
        self.gpu.take_error()?;
        Ok(out)
    }

    /// Reads `n` f32 values from the start of `src`.
    pub(crate) fn read_f32(&self, src: &wgpu::Buffer, n: usize) -> Result<Vec<f32>> {
        let bytes = self.read(src, n as u64 * 4)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}
