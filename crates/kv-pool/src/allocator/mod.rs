//! Slot allocators: the [`Allocator`] trait and SGLang's two implementations, [`TokenAllocator`]
//! (page size 1, FIFO reuse, SGLang's `TokenToKVPoolAllocator`) and [`PagedAllocator`] (page size
//! `P`, LIFO reuse, SGLang's `PagedTokenToKVPoolAllocator`), plus [`BestFitAllocator`], a
//! placement policy measured for page contiguity.
//!
//! Both are one generic [`SlotAllocator`] whose [`ReuseOrder`] decides where freed pages go:
//! FIFO appends them in the order given, LIFO prepends them sorted ascending (SGLang's
//! `torch.unique` + `cat`). Everything else, including the three-phase `alloc_extend`, is the
//! same code; at `P = 1` it collapses to "take the next n free slots".
//!
//! State: a free list of pages (allocations take from its head), a release list used in
//! sorted-release mode (SGLang's `need_sort` for PD), the pages buffered by an open free group,
//! and a bitmap of allocated pages. The bitmap is what makes a double free an error instead of
//! a corrupted free list (SGLang's free is not idempotent).
//!
//! Files, each one job (dependencies point down the list, never back):
//! - `api`: the [`Allocator`] trait and its batch entries [`ExtendRequest`], [`DecodeRequest`].
//! - `order`: [`ReuseOrder`] with [`Fifo`] and [`Lifo`], and [`PageWant`] (one request's share
//!   of a batch, for an order that places pages per request).
//! - `best_fit`: [`BestFit`], a research order: each request's pages grow in place, else go to
//!   the smallest free run that holds them ([`BestFitAllocator`]).
//! - `state`: the free/release lists and allocation bitmap, and its snapshot [`AllocatorState`].
//! - `bitmap`: word-at-a-time bitmap access and run detection for the hot paths.
//! - `render`: [`render_page_runs`], the compact page-list rendering.
//! - `slot`: [`SlotAllocator`]: construction, page math, taking and returning pages, `Display`.
//! - `free`: `free`'s fast path (one run of consecutive slots) and general path (any slots).
//! - `validate`: batch validation for `alloc_extend` / `alloc_decode` (`last_loc`, page demand).
//! - `ops`: `impl Allocator for SlotAllocator`.
//! - `any`: [`AnyAllocator`], the enum over this crate's implementations.
//!
//! Contiguity metrics over what an allocator hands out are in [`crate::contiguity`].

// `api` first: enum_dispatch must see the trait before `any`'s enum to expand the impl there.
mod api;

mod any;
mod best_fit;
mod bitmap;
mod free;
mod ops;
mod order;
mod render;
mod slot;
mod state;
mod validate;

pub use any::AnyAllocator;
pub use api::{Allocator, DecodeRequest, ExtendRequest};
pub use best_fit::BestFit;
pub use order::{Fifo, Lifo, PageWant, ReuseOrder};
pub use render::render_page_runs;
pub use slot::{BestFitAllocator, PagedAllocator, SlotAllocator, TokenAllocator};
pub use state::AllocatorState;
