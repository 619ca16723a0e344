//! # attention-wgpu — the wgpu compute backend for kvserve
//!
//! [`WgpuBackend`] implements [`attention::Backend`] with WGSL compute shaders, so kvserve
//! runs its decoders on any Vulkan, Metal, DX12 or GL device (and, in CI, on Mesa's software
//! drivers: lavapipe through Vulkan, then llvmpipe through GL). It is the second implementation of the backend traits after
//! the CPU backend, and it needs no special case anywhere else: the model crate runs on it
//! unchanged, and it passes the same conformance suite against the f64 reference.
//!
//! - [`device`]: adapter selection (Vulkan, Metal, DX12, GL, in that order unless
//!   configured, or `WGPU_BACKEND` says), the features and limits asked for (a limit a driver
//!   reports as 0 is taken as wgpu's downlevel default), a [`DeviceReport`] of what was
//!   granted, and [`WgpuError`] (no adapter is a clear, typed error).
//! - [`WgpuKvStore`]: kv-pool's [`KvStore`](kv_pool::KvStore) in device buffers (f32, and f16
//!   where the adapter has f16 shaders), byte-compatible with the host store, per-layer
//!   buffers split into chunks when they exceed the binding limit (the chunks grow, within
//!   that limit, until an attention kernel's bindings fit the adapter's storage-buffer count:
//!   16 on GL). [`WgpuKvRows`] is a handle on its rows for another thread (kv-pool's
//!   `DeviceKvRows`): the hierarchical cache's controller copies through it, ordered with
//!   the forward passes by the device queue.
//! - [`kernels`]: the WGSL generator. Every kernel is specialised by shape, dtype and chunking
//!   with the constants baked in; pipelines are cached by source.
//! - Paged attention: one kernel for extend and decode (causal over prefix plus new tokens,
//!   GQA, absorbed MLA) with the KV range split across workgroups when the batch is small,
//!   and a merge of the partial softmax states.
//!
//! ## Invariants
//! - Like every backend, it never allocates or frees slots: attention writes the new K/V at
//!   the plan's `out_cache_loc` on the device, then reads every position back from the store.
//! - Bad input is a typed error, checked on the host before anything is submitted; store
//!   methods use [`kv_pool::store::check`], so they refuse exactly what the host store
//!   refuses. Device failures (validation, out of memory, a lost device) are recorded from
//!   wgpu's callbacks and returned as `Device` errors, never panics.
//! - Unsupported store dtypes (bf16, fp8; f16 without f16 shaders, as on GL) and DoubleSparse
//!   attention are typed `Unsupported` errors, announced up front by
//!   [`Backend::kv_support`](attention::Backend::kv_support).
//!
//! ## Where it sits
//! Depends on `attention` (the traits it implements) and `kv-pool` (the store trait and its
//! validation) only. The engine picks it with `--backend wgpu`; tests call
//! [`test_support::backend_or_skip`], which skips without an adapter unless
//! `KVSERVE_REQUIRE_WGPU=1`.

pub mod backend;
pub mod device;
mod dispatch;
pub mod kernels;
pub mod plan;
pub mod store;
pub mod tensor;
pub mod test_support;

pub use backend::WgpuBackend;
pub use device::{DeviceReport, WgpuConfig, WgpuError};
pub use plan::WgpuPlan;
pub use store::{WgpuKvRows, WgpuKvStore};
pub use tensor::WgpuTensor;

// The engine runs a model on its own thread: the backend, its tensors, stores and plans must
// move there.
const _: () = {
    fn send_sync<T: Send + Sync>() {}
    #[allow(dead_code)]
    fn check() {
        send_sync::<WgpuBackend>();
        send_sync::<WgpuTensor>();
        send_sync::<WgpuKvStore>();
        send_sync::<WgpuKvRows>();
        send_sync::<WgpuPlan>();
    }
};
