//! Device setup: adapter selection in a fixed backend order, the features and limits the
//! kernels need, a report of what the adapter gave, and the crate's error type.
//!
//! wgpu reports validation and out-of-memory errors through a callback rather than through
//! return values; [`Gpu`] installs one that records them (instead of wgpu's default, which
//! panics), and every operation checks the record after it submits, so a driver error reaches
//! the caller as a typed [`WgpuError::Device`] and never as a panic.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use attention::AttentionError;
use kv_pool::KvPoolError;

/// Everything the wgpu backend refuses or fails at, before it is mapped into the trait crates'
/// errors ([`AttentionError::Device`], [`KvPoolError::Device`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WgpuError {
    /// No adapter of the requested backends exists (no driver, no GPU, or a backend set that
    /// this platform lacks).
    #[error(
        "no wgpu adapter among the requested backends ({requested}): {reason}; on Linux install \
         a Vulkan driver (e.g. mesa-vulkan-drivers for the lavapipe software driver) or allow GL"
    )]
    NoAdapter {
        /// The backends that were asked for, e.g. `Vulkan, GL`.
        requested: String,
        /// wgpu's own message, or `no adapter found` when enumeration came back empty.
        reason: String,
    },
    /// The adapter refused to open a device with the features and limits asked for.
    #[error("adapter {adapter} refused a device: {reason}")]
    RequestDevice {
        /// The adapter's name as its driver reports it.
        adapter: String,
        /// wgpu's message (usually a feature or limit the adapter refused).
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The [`WgpuConfig`] field.
        field: &'static str,
        /// The value given and the range it must be in.
        reason: String,
    },
    /// A buffer larger than the adapter allows.
    #[error("{what} needs {bytes} bytes, above the adapter's limit of {limit} ({limit_name})")]
    TooLarge {
        /// The buffer's purpose (`"tensor"`, `"one KV row"`, …).
        what: &'static str,
        /// Bytes it needs.
        bytes: u64,
        /// The adapter's limit, in bytes.
        limit: u64,
        /// wgpu's name for that limit (`max_buffer_size`, `max_storage_buffer_binding_size`).
        limit_name: &'static str,
    },
    /// The device failed: out of memory, lost, a mapping that failed, a validation error.
    #[error("{0}")]
    Device(String),
}

impl From<WgpuError> for AttentionError {
    fn from(e: WgpuError) -> Self {
        match e {
            WgpuError::InvalidConfig { field, reason } => {
                AttentionError::InvalidConfig { field, reason }
            }
            e => AttentionError::Device(e.to_string()),
        }
    }
}

impl From<WgpuError> for KvPoolError {
    fn from(e: WgpuError) -> Self {
        match e {
            WgpuError::InvalidConfig { field, reason } => {
                KvPoolError::InvalidConfig { field, reason }
            }
            e => KvPoolError::Device(e.to_string()),
        }
    }
}

/// `Result` with [`WgpuError`] as the default error.
pub type Result<T, E = WgpuError> = std::result::Result<T, E>;

/// How [`WgpuBackend::new`](crate::WgpuBackend::new) picks and configures its device.
#[derive(Debug, Clone, PartialEq)]
pub struct WgpuConfig {
    /// Backends to consider, tried in the order Vulkan, Metal, DX12, GL. Default: the ones
    /// wgpu's `WGPU_BACKEND` environment variable names (e.g. `WGPU_BACKEND=gl` forces the GL
    /// adapter where a Vulkan one exists too), else all four.
    pub backends: wgpu::Backends,
    /// Ask for f16 shaders when the adapter has them (default `true`); without them f16 KV
    /// stores are refused with a typed error.
    pub allow_f16: bool,
    /// Caps the bytes of one storage binding below the adapter's limit (default `None`: the
    /// adapter's `max_storage_buffer_binding_size`). KV store layers larger than this are split
    /// across several buffers; tests set a small cap to exercise the split. Where chunks of this
    /// size would need more storage bindings than one attention kernel may have (GL adapters
    /// allow 16), the store's chunks grow, up to the adapter's own limit, until they fit.
    pub max_binding_bytes: Option<u64>,
    /// Decode and extend split a request's KV range across workgroups until the batch has at
    /// least this many workgroups (or the splits would be shorter than one key block); `1`
    /// disables split-KV. Default 256.
    pub split_kv_target_workgroups: u32,
    /// Matmuls of at most this many rows take the thread-per-column kernel (`matmul_rows`),
    /// larger ones the tiled kernel; a row's values are bitwise the same either way. Default
    /// `None`: [`crate::kernels::dense::MM_ROWS_MAX`] (8, a decode batch) on a CPU adapter
    /// (lavapipe, llvmpipe, SwiftShader), where the tiled kernel's barriers took most of a
    /// decode step (its ITL 650 → 32 ms on lavapipe), and 0 on a GPU, where a thread per
    /// column would leave most of a large device idle on layers of a few thousand columns
    /// (neither kernel is timed on a GPU).
    pub matmul_rows_max: Option<u32>,
}

impl Default for WgpuConfig {
    fn default() -> Self {
        WgpuConfig {
            backends: wgpu::Backends::from_env().unwrap_or(
                wgpu::Backends::VULKAN
                    | wgpu::Backends::METAL
                    | wgpu::Backends::DX12
                    | wgpu::Backends::GL,
            ),
            allow_f16: true,
            max_binding_bytes: None,
            split_kv_target_workgroups: 256,
            matmul_rows_max: None,
        }
    }
}

/// The order in which backends are tried.
const BACKEND_ORDER: [wgpu::Backends; 4] = [
    wgpu::Backends::VULKAN,
    wgpu::Backends::METAL,
    wgpu::Backends::DX12,
    wgpu::Backends::GL,
];

/// What the device offers the kernels, as opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceReport {
    /// Adapter name (e.g. `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub name: String,
    /// Graphics API (`Vulkan`, `Metal`, `Dx12`, `Gl`).
    pub backend: String,
    /// `DiscreteGpu`, `IntegratedGpu`, `Cpu`, …
    pub device_type: String,
    /// Driver name and version, e.g. `llvmpipe Mesa 22.3.6 (LLVM 15.0.6)`.
    pub driver: String,
    /// f16 shaders and storage are enabled (f16 KV stores are available).
    pub f16: bool,
    /// The adapter has subgroup operations (reported only; the kernels do not need them).
    pub subgroups: bool,
    /// Largest storage binding the kernels use (after [`WgpuConfig::max_binding_bytes`]).
    pub max_binding_bytes: u64,
    /// Largest buffer the device allocates (`max_buffer_size`).
    pub max_buffer_bytes: u64,
    /// Storage buffers one kernel may bind (16 on GL): bounds the chunks of a KV layer.
    pub max_storage_buffers: u32,
    /// Workgroup shared memory in bytes (`max_compute_workgroup_storage_size`).
    pub max_workgroup_storage_bytes: u32,
}

impl fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, {}, driver {}): f16 {}, subgroups {}, max binding {}, max buffer {}, \
             {} storage buffers per kernel, {} KiB workgroup memory",
            self.name,
            self.backend,
            self.device_type,
            self.driver,
            if self.f16 { "yes" } else { "no" },
            if self.subgroups { "yes" } else { "no" },
            Bytes(self.max_binding_bytes),
            Bytes(self.max_buffer_bytes),
            self.max_storage_buffers,
            self.max_workgroup_storage_bytes >> 10,
        )
    }
}

/// A byte count for the report: whole MiB, or KiB below one MiB (a 512 KiB test cap must not
/// read as "0 MiB").
struct Bytes(u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 >= 1 << 20 {
            write!(f, "{} MiB", self.0 >> 20)
        } else {
            write!(f, "{} KiB", self.0 >> 10)
        }
    }
}

/// The device's limits with the ones a driver reports as 0 replaced by wgpu's downlevel
/// defaults. A GL driver can leave a limit unreported (wgpu then reads 0); taken literally, a 0
/// storage-binding or buffer size would refuse every buffer, although any adapter that runs
/// compute shaders meets the downlevel values (128 MiB bindings, 256 MiB buffers).
fn known_limits(mut limits: wgpu::Limits) -> wgpu::Limits {
    let fallback = wgpu::Limits::downlevel_defaults();
    if limits.max_storage_buffer_binding_size == 0 {
        limits.max_storage_buffer_binding_size = fallback.max_storage_buffer_binding_size;
    }
    if limits.max_buffer_size == 0 {
        limits.max_buffer_size = fallback.max_buffer_size;
    }
    limits
}

/// Errors wgpu reported through its callbacks since the last check.
type ErrorLog = Arc<Mutex<Vec<String>>>;

/// An open device: queue, limits, features, and the record of asynchronous errors.
pub(crate) struct Gpu {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) info: wgpu::AdapterInfo,
    /// The device's limits, with unreported (0) ones at wgpu's downlevel defaults.
    pub(crate) limits: wgpu::Limits,
    /// The adapter's largest storage binding the kernels can index (under 4 GiB), before
    /// [`WgpuConfig::max_binding_bytes`] caps it.
    pub(crate) binding_bytes: u64,
    pub(crate) report: DeviceReport,
    errors: ErrorLog,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

fn backends_name(b: wgpu::Backends) -> String {
    let names: Vec<&str> = [
        (wgpu::Backends::VULKAN, "Vulkan"),
        (wgpu::Backends::METAL, "Metal"),
        (wgpu::Backends::DX12, "DX12"),
        (wgpu::Backends::GL, "GL"),
    ]
    .iter()
    .filter(|(x, _)| b.contains(*x))
    .map(|&(_, n)| n)
    .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// Preference among adapters of one backend: real GPUs first.
fn type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

impl Gpu {
    /// Picks the first adapter in backend order (Vulkan, Metal, DX12, GL; within a backend a
    /// discrete GPU before an integrated, virtual or CPU one) and opens a device with the
    /// adapter's own limits and f16 when available and allowed.
    pub(crate) fn open(config: &WgpuConfig) -> Result<Gpu> {
        if config.split_kv_target_workgroups == 0 {
            return Err(WgpuError::InvalidConfig {
                field: "split_kv_target_workgroups",
                reason: "must be at least 1".into(),
            });
        }
        if config.max_binding_bytes.is_some_and(|b| b < 1024) {
            return Err(WgpuError::InvalidConfig {
                field: "max_binding_bytes",
                reason: "must be at least 1024".into(),
            });
        }
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = config.backends;
        let instance = wgpu::Instance::new(desc);
        let mut adapter = None;
        for b in BACKEND_ORDER
            .iter()
            .filter(|&&b| config.backends.contains(b))
        {
            let mut found = pollster::block_on(instance.enumerate_adapters(*b));
            found.sort_by_key(|a| type_rank(a.get_info().device_type));
            if let Some(a) = found.into_iter().next() {
                adapter = Some(a);
                break;
            }
        }
        let requested = backends_name(config.backends);
        let adapter = adapter.ok_or_else(|| WgpuError::NoAdapter {
            requested: requested.clone(),
            reason: "no adapter found".into(),
        })?;
        let info = adapter.get_info();
        let features = adapter.features();
        let f16 = config.allow_f16 && features.contains(wgpu::Features::SHADER_F16);
        let mut required = wgpu::Features::empty();
        if f16 {
            required |= wgpu::Features::SHADER_F16;
        }
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kvserve attention-wgpu"),
            required_features: required,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| WgpuError::RequestDevice {
            adapter: info.name.clone(),
            reason: e.to_string(),
        })?;
        let errors: ErrorLog = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            sink.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(e.to_string());
        }));
        let sink = errors.clone();
        device.set_device_lost_callback(move |reason, msg| {
            sink.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(format!("device lost ({reason:?}): {msg}"));
        });
        let limits = known_limits(device.limits());
        // Kernels index bindings with u32: keep every binding under 4 GiB whatever the adapter
        // allows (Metal's limit is its buffer length, many GiB on Apple silicon).
        let binding_bytes = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size)
            .min(u64::from(u32::MAX))
            & !3;
        let binding = config
            .max_binding_bytes
            .map_or(binding_bytes, |c| c.min(binding_bytes))
            & !3;
        let report = DeviceReport {
            name: info.name.clone(),
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver: format!("{} {}", info.driver, info.driver_info)
                .trim()
                .to_string(),
            f16,
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            max_binding_bytes: binding,
            max_buffer_bytes: limits.max_buffer_size,
            max_storage_buffers: limits.max_storage_buffers_per_shader_stage,
            max_workgroup_storage_bytes: limits.max_compute_workgroup_storage_size,
        };
        Ok(Gpu {
            device,
            queue,
            info,
            limits,
            binding_bytes,
            report,
            errors,
        })
    }

    /// Returns the first error wgpu reported since the last call, clearing the record.
    pub(crate) fn take_error(&self) -> Result<()> {
        let mut log = self.errors.lock().unwrap_or_else(PoisonError::into_inner);
        if log.is_empty() {
            return Ok(());
        }
        let all = std::mem::take(&mut *log);
        Err(WgpuError::Device(all.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreported_limits_fall_back_to_the_downlevel_defaults() {
        let reported = wgpu::Limits {
            max_storage_buffer_binding_size: 0,
            max_buffer_size: 0,
            ..wgpu::Limits::downlevel_defaults()
        };
        let known = known_limits(reported);
        assert_eq!(known.max_storage_buffer_binding_size, 128 << 20);
        assert_eq!(known.max_buffer_size, 256 << 20);
        let real = wgpu::Limits::default();
        assert_eq!(known_limits(real.clone()), real);
    }

    #[test]
    fn byte_counts_below_a_mebibyte_read_in_kibibytes() {
        assert_eq!(Bytes(512 << 10).to_string(), "512 KiB");
        assert_eq!(Bytes(128 << 20).to_string(), "128 MiB");
    }
}
