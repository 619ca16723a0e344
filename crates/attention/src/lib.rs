//! # attention — compute backends for kvserve
//!
//! The backend traits every device implements ([`Backend`]: device tensors, the dense ops of a
//! decoder layer, mixture-of-experts layers ([`moe`]), paged attention over a [`kv_pool::KvStore`]), the backend-neutral batch
//! metadata ([`BatchMetadata`]: FlashInfer-style page tables), the CPU backend
//! ([`CpuBackend`]), an f64 reference ([`reference`]), the conformance suite every backend
//! runs ([`conformance`]), decode attention's KV bandwidth on any backend ([`bandwidth`]: what
//! the GPU benches report against the device's peak), dense and mixture-of-experts GEMM throughput
//! ([`gemm_throughput`]) and the seam for backends that replay captured decode batches
//! ([`DecodeGraphs`]: CUDA graphs; the others implement nothing).
//!
//! ## Invariants
//! - Backends never allocate or free slots: they read the page tables they are given and write
//!   new K/V only at the batch's `out_cache_loc`, before attending (SGLang's contract).
//! - Attention reads every KV position, new tokens included, back from the store after the
//!   write, so a result depends only on the store contents and the query, never on whether a
//!   position was written in this batch or an earlier one.
//! - Batch metadata obeys kv-pool's page rule (`slot(p) mod P == p mod P`, one physical page
//!   per page index), checked when it is built.
//! - Bad input is a typed [`AttentionError`], never a panic; every backend validates through
//!   [`check`], so all refuse the same inputs with the same errors.
//! - The CPU backend is deterministic and batch-invariant by default: a request's output is
//!   bitwise the same alone or in any batch, chunked or not, with its prefix cached or not, on
//!   any slots, and on any number of worker threads (each output element is computed by one
//!   job, in a fixed order).
//!
//! ## Where it sits
//! attention depends on kv-pool only. The model crate builds decoder layers on [`Backend`];
//! the CUDA and wgpu backends implement it and call [`conformance`] in their tests.

// The embeddable crates document every public item; the engine, model and backends document
// where a name does not already say it.
#![warn(missing_docs)]

pub mod backend;
pub mod bandwidth;
pub mod check;
pub mod conformance;
pub mod cpu;
pub mod error;
pub mod gemm_throughput;
pub mod graphs;
pub mod metadata;
pub mod moe;
pub mod params;
pub mod reference;
pub mod rope;

pub use backend::{Backend, DeviceMemory, DeviceTensor, TensorDtype};
pub use cpu::{CpuBackend, CpuConfig, CpuPlan, CpuTensor};
pub use error::{AttentionError, Result};
pub use graphs::{DecodeForward, DecodeGraphs};
pub use metadata::{BatchMetadata, RequestKv};
pub use moe::{MoeExperts, MoeRouting};
pub use params::{AttentionParams, DoubleSparseConfig};
pub use rope::{RopeConfig, RopeScaling, RopeStyle};
