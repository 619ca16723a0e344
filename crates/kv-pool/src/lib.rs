//! # kv-pool — KV-cache memory pools for LLM serving
//!
//! The lowest crate of kvserve: SGLang's two-level memory pool, rebuilt with checked ownership.
//!
//! - Level one, [`ReqToTokenPool`]: a `(max_running_requests + 1) × (context_len + 4)` table that
//!   maps each request row and token position to a KV slot.
//! - Level two, the slot allocators behind the [`Allocator`] trait: [`TokenAllocator`] (page size
//!   1, FIFO reuse) and [`PagedAllocator`] (page size `P`, LIFO reuse, SGLang's three-phase
//!   `alloc_extend` and `alloc_decode`), with free groups, the sorted-release mode used for PD
//!   transfer, backup/restore, and double-free detection; and [`BestFitAllocator`], a research
//!   placement policy (each request's pages grow in place, else take the smallest free run
//!   that holds them).
//! - Contiguity, measured (module [`contiguity`]): page runs per request and the free pages'
//!   fragmentation, what decides PD transfer blocks and page-table reads per request.
//! - The KV bytes: [`KvShape`] / [`KvLayout`] (MHA/GQA, MLA, DoubleSparse; f32, f16, bf16, fp8
//!   with scales) and their byte math, the [`KvStore`] trait that host memory and every device
//!   backend implement, and [`HostKvStore`] (on its own heap buffers, or in memory given as a
//!   [`HostMemory`], e.g. a shared mapping a transfer peer writes into).
//! - The host tier's bytes: [`HostKvPool`] (one allocation in a [`HostLayout`]: SGLang's
//!   `layer_first`, `page_first`, `page_first_direct`), moving rows to and from a [`KvStore`]
//!   and whole pages in the canonical packed format, and [`HostPoolSize`], SGLang's host pool
//!   sizing (module [`host_pool`]).
//! - Tiers: the [`CacheController`] seam between a hierarchical prefix cache and whoever moves
//!   KV pages between the device store, the host pool and an L3 store, and [`LayerWait`], what
//!   a forward pass waits on while load-backs land (module [`tier`]).
//! - Sizing: [`MemoryPlan`] computes the pool size and the default request limit as SGLang does.
//! - Checking: [`OwnershipCheck`] proves that free pages and owned pages partition the pool;
//!   with the `testing` feature, `kv_pool::testing::check_allocator` runs the allocator
//!   conformance suite (the one this crate's tests run) on any [`Allocator`] implementation.
//!
//! ## Invariants
//! - Slot 0 / page 0 and row 0 are padding targets and are never handed out.
//! - A request position `p` lives at a slot with `slot mod P == p mod P`, and all positions of one
//!   page index of a request share one physical page (what attention backends' page tables rely on).
//! - Every allocator call validates its whole input first: an `Err` changes nothing. Allocation is
//!   all-or-nothing; running out of slots is [`KvPoolError::OutOfMemory`], an expected condition.
//! - A page is either free or allocated, tracked by a bitmap: a double free or a free of a page
//!   that was never handed out is refused with [`KvPoolError::PageNotAllocated`] naming the page.
//!
//! ## Where it sits
//! kv-pool knows nothing of token ids, trees, request contents, scheduling or HTTP. radix-cache,
//! the scheduler, attention backends and the transfer engine all build on it; device memory is
//! reached only through the [`KvStore`] trait that backends implement.

// The embeddable crates document every public item; the engine, model and backends document
// where a name does not already say it.
#![warn(missing_docs)]

pub mod allocator;
pub mod contiguity;
pub mod dtype;
pub mod error;
pub mod host_memory;
pub mod host_pool;
pub mod ids;
pub mod layout;
pub mod memory_plan;
pub mod ownership;
pub mod req_to_token;
pub mod rng;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tier;

pub use allocator::{
    Allocator, AllocatorState, AnyAllocator, BestFitAllocator, DecodeRequest, ExtendRequest,
    PagedAllocator, TokenAllocator,
};
pub use contiguity::{FreeFragmentation, RunStats};
pub use error::{KvPoolError, Result};
pub use host_memory::HostMemory;
pub use host_pool::{HostKvPool, HostLayout, HostPoolSize, HostPoolSizeInput};
pub use ids::{ceil_to_page, floor_to_page, slots_as_u32, u32_as_slots, Page, ReqRow, Slot};
pub use layout::{KvBuffer, KvDtype, KvKind, KvLayout, KvShape};
pub use memory_plan::{MemoryPlan, MemoryPlanInput, RequestLimitRule};
pub use ownership::{Owner, OwnershipCheck, OwnershipViolation};
pub use req_to_token::ReqToTokenPool;
pub use rng::SplitMix64;
pub use store::{HostKvStore, KvStore, MemoryRegion};
pub use tier::{
    Ack, AckOutcome, CacheController, DeviceKvRows, LayerWait, OpId, PageKey, TierOpKind,
};
